"""Test and benchmark rigs that sit between a KV consumer and a producer.

`emulated_link` (a slow link on real sockets), `fault_link` (a man-in-the-middle
that fires a fault plan), `faults` and `fault_points` (the plan's grammar and
point names) and `link_shape` (an emulated link's bandwidth and latency).
The runtime reaches this room only where a config selects a rig (the doors are
listed in tests/test_layers.py): a fault plan, or `transfer.emulated_link`.
"""
