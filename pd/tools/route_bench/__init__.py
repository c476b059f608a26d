"""`python -m pd.tools.route_bench`: routing by where the KV is, measured (cli.py: the run and its
command line; workload.py: the workloads, as trees of prompts)."""
