"""One worker process: engine + connector wiring, its internal HTTP API, its Ray actor."""
