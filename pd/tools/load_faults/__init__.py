"""`python -m pd.tools.load_faults`: load and faults at once on a real Ray deployment (cli.py: the
run and its command line; driver.py: the clients, in a process of their own; injectors.py: event
subscribers and poisoned sampling; report.py: the figures and the verdict)."""
