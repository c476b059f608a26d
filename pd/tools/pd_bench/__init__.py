"""`python -m pd.tools.pd_bench`: what P/D is for, on the real model (cli.py: the run and its
command line; deploy.py: the deployments compared; load.py: the workload; report.py: figures, tables
and the chart)."""
