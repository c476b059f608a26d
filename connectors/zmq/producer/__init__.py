"""The prefill side: the side channel (`producer.py`), the data port (`data_listener.py`), one
thread per attached data stream (`data_stream.py`), leases (`leases.py`) and the config."""
