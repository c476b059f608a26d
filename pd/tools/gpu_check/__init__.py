"""`python -m pd.tools.gpu_check`: the one-shot GPU check (check.py: the run and its report;
transfer.py: KV transfer GB/s; engine.py: the engine on the GPU)."""
