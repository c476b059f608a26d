"""`python -m pd.tools.peer_bench`: served speed against llama.cpp's server (cli.py: the run and
its command line; servers.py: the servers it starts; workload.py: the waves; stats.py: the figures;
report.py: the tables and chart; engine.py: the engine's own rate, in a child process)."""
