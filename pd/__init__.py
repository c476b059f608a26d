"""pdkv's serving system, one subpackage per job; imports point downward only:

    tools -> deploy -> router | worker -> cluster -> engine -> connectors -> kvcache

- `engine/`  the model and its kernels, KV layout and page pool, scheduler, engine loop
- `cluster/` what every process of a deployment shares: the deploy config schema,
             worker roles and endpoints, the router <-> worker messages
- `worker/`  one P, D or colocated worker: engine + connector wiring, its HTTP API, its Ray actor
- `router/`  the OpenAI-compatible front door: worker choice, dispatch, admission, metrics
- `deploy/`  placement on a Ray cluster and `python -m pd.launch`
- `tools/`   benchmarks, load generator, GPU check, fault report (not imported by the runtime)

The modules at this level are command-line entry points only.
"""
