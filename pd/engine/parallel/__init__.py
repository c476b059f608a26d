"""Tensor parallelism: the building blocks of a worker that spans several devices.

`tp.py` (which KV heads each rank holds, and the plan that moves KV between P and D workers of any
TP degrees), `head_slices.py` (copying a run of heads between two ranks' page pools), `group.py`
(a TP group: rendezvous, collectives with a timeout), `step_channel.py` (rank 0's step plans to the
other ranks, msgpack) and `layers.py` (column- and row-parallel linears, the sharding of a Llama
block's weights). docs/tensor-parallel.md says what is built and what is not.
"""
