"""The decode side: one session per producer (`consumer.py`, `consumer_session.py`), its data
streams (`pull_stream.py`), loads and their parts (`loads.py`) and the config."""
