"""One worker of a benchmark (`pd.tools.pd_bench`, `pd.tools.planner_bench`), in a process of its own,
pinned to the cores it is given.

It reads one JSON spec on stdin's first line (`worker_id`, `role`, `config`: the deploy config's
JSON, `secret`, `cpus`: the cores to pin to or null (or `cpu`: one core), `threads`: torch threads,
default 1), pins itself to
those cores (`os.sched_setaffinity`, before the engine starts its threads, so they inherit
it), starts the real `Worker` (engine, ZMQ connector, HTTP API) and writes `{"url": ...}` on
stdout. It serves until stdin closes (the benchmark is done with it), then stops and exits.

    echo '{"worker_id": "decode-0", "role": "decode", "cpus": [1], "threads": 1, ...}' \\
        | python -m pd.tools.pinned_worker
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys


async def _serve(spec: dict) -> None:
    from pd.cluster.config import DeployConfig
    from pd.cluster.roles import Role
    from pd.worker.worker import Worker, WorkerSpec

    worker = Worker(WorkerSpec(spec["worker_id"], Role(spec["role"]), DeployConfig.from_json(spec["config"]),
                               spec["secret"]))
    url = await worker.start()
    print(json.dumps({"url": url}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # EOF: the benchmark is done with us
    await worker.stop()


def main() -> None:
    logging.basicConfig(level=os.environ.get("PDKV_LOG_LEVEL", "WARNING").upper())
    spec = json.loads(sys.stdin.readline())
    cpus = spec.get("cpus") or ([spec["cpu"]] if spec.get("cpu") is not None else None)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus})
    import torch

    torch.set_num_threads(int(spec.get("threads") or 1))
    asyncio.run(_serve(spec))


if __name__ == "__main__":
    main()
