"""Tensor parallelism: the building blocks of a worker that spans several devices.

`tp.py` (which KV heads each rank holds, and the plan that moves KV between P and D workers of any
TP degrees), `head_slices.py` (copying a run of heads between two ranks' page pools), `group.py`
(a TP group: rendezvous, collectives with a timeout), `step_channel.py` (rank 0's step plans to the
other ranks, msgpack), `layers.py` (column- and row-parallel linears, the sharding of a Llama
block's weights), `sharded_model.py` (one rank's shard of the model, and what every rank sets up
before its first step) and `follower.py` (a rank r > 0: its shard, its pool, the loop that runs rank
0's plans; rank 0 is the engine, `Engine(config, tp=group)`). docs/tensor-parallel.md says what is
built and what is not.
"""
