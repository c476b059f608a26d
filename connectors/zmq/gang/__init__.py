"""KV between tensor-parallel gangs, rank to rank: every rank moves its own KV heads (`head_plan.py`:
who reads what from whom; `slice_server.py` / `slice_puller.py`: one rank's data plane;
`rank_agent.py`: the thread in each rank; `gang_control.py`: rank 0's side of the gang)."""
