"""KV streaming (`transfer.streaming: chunk | layer`): what a streamed prefill publishes
(`publisher.py`), the consumer's load that pulls each part as it is published (`stream_load.py`),
and layer slices (`layer_slices.py`)."""
