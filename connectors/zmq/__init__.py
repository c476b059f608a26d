"""The ZMQ connector: pull-mode KV transfer behind the `connectors.base` contract.

A ZMQ side channel (handshake, sessions, leases, heartbeats) and plain-socket or
shared-memory data streams; `connectors.zmq.connector.ZmqConnector` is the
`KVConnector` the engine takes.
"""
