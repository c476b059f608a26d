"""The ZMQ connector: pull-mode KV transfer behind the `connectors.base` contract.

`connectors.zmq.connector.ZmqConnector` is the `KVConnector` the engine takes (the entry the rest
of pdkv imports, with `transfer_settings` for the deploy config). Beside it the scheduler half
(`scheduler.py`), and five rooms:

- `control/`: what both sides share: wire messages, framing, handshake, session keys and MACs;
- `producer/`: the prefill side: side channel, data listener, data streams, leases;
- `consumer/`: the decode side: sessions per producer, pull streams, loads;
- `paths/`: the data paths (tcp, shm_mapped, shm_staged, cuda_ipc), one interface, one module each,
  and how a stream reaches its pool's pages (in place, or the pinned staging ring);
- `streaming/`: KV streaming (parts published while the prefill runs).
"""
