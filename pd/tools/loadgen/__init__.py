"""`python -m pd.tools.loadgen` (also `python -m pd.loadgen`): the load generator (cli.py: the
arguments and the run; client.py: one request; data.py: the datasets; report.py: the figures and the
result JSON; plot.py: the charts)."""
