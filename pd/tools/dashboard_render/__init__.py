"""`python -m pd.tools.dashboard_render`: the Grafana dashboard's panels drawn from scrapes (cli.py:
the scraper and the command line; data.py: the panels evaluated; promql.py: the PromQL subset;
plot.py: the picture)."""
