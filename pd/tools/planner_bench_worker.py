"""One worker of `pd.tools.planner_bench`, in a process of its own (one GIL, one core).

It reads one JSON spec on stdin's first line (`worker_id`, `role`, `config` as the deploy
config's JSON, `secret`, `cpu`: the core to pin to, or null), pins itself to that core
(`os.sched_setaffinity`, before the engine starts its threads, so they inherit it), runs
torch on one thread, starts the real `Worker` (engine, ZMQ connector, HTTP API) and writes
`{"url": ...}` on stdout. It serves until stdin closes (the benchmark exited or is done),
then stops the worker and exits.

    echo '{"worker_id": "prefill-0", "role": "prefill", ...}' | python -m pd.tools.planner_bench_worker
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
    if spec.get("cpu") is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(spec["cpu"])})
    import torch

    torch.set_num_threads(1)
    asyncio.run(_serve(spec))


if __name__ == "__main__":
    main()
