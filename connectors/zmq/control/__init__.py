"""Control and security, shared by both sides: versioned wire messages (`wire.py`), data-stream
framing (`framing.py`), the handshake (`handshake.py`), per-session keys and MACs (`session.py`),
the side channel's connection guard (`side_guard.py`) and logging what strangers trigger (`peer_log.py`).
Imports no other room of `connectors.zmq`."""
