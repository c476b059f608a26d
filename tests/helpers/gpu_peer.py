"""The far side of the two-process GPU tests, driven by JSON lines on stdin/stdout.

Modes (first line {"mode": ..., ...}):
- "pages": a CUDA page pool filled with seeded random bytes (written on the
  compute stream, then fenced like the engine does), a Producer serving a
  lease on `block_ids`; answers {"port": ...}.
- "prefill": a CUDA Engine with a producer ZmqConnector; prefills `prompts`
  (max_tokens=1, do_remote_decode) in one batch; answers {"port", "params",
  "first"} and keeps stepping so D's reads release its blocks.
Then it waits for {"cmd": "quit"} and answers {"audit": "ok" | error text}.
Nothing is pickled.
"""
from __future__ import annotations

import json
import select
import sys

import torch

from tests.helpers.gpu_cases import DEVICE, SECRET, engine_config, model_config, seeded_pages

QUIT_TIMEOUT_S = 300.0


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _wait_quit() -> None:
    ready, _, _ = select.select([sys.stdin], [], [], QUIT_TIMEOUT_S)
    if ready:
        sys.stdin.readline()


def serve_pages(a: dict) -> None:
    from connectors.zmq.paths.cuda_staging import fences_for
    from pd.engine.kv.page_pool import PagePool
    from connectors.zmq.producer.producer import Producer, ProducerConfig

    pool = PagePool(a["num_blocks"], a["page_bytes"], device=DEVICE)
    pool.buffer.copy_(seeded_pages(a["num_blocks"], a["page_bytes"], a["seed"]).to(DEVICE, non_blocking=True))
    fences_for(pool).mark_written()  # as the engine does after a forward
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="gpu-test"), pool)
    prod.start()
    prod.add_lease("r", a["block_ids"])
    _reply({"port": prod.port})
    _wait_quit()
    prod.shutdown()
    _reply({"audit": "ok"})


def serve_prefill(a: dict) -> None:
    from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
    from kvcache.audit import assert_all_free
    from pd.engine.engine import Engine
    from pd.engine.kv.layout import KVLayout
    from pd.engine.sample.params import SamplingParams

    cfg = engine_config(model_config(a["hybrid"]), "P")
    conn = ZmqConnector(ZmqConnectorConfig(engine_id="P", role=KVRole.PRODUCER, secret=SECRET, model_id="gpu-test"),
                        KVLayout(cfg.model, cfg.block_size).kv_cache_groups())
    eng = Engine(cfg, connector=conn)
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    for rid, ids in a["prompts"].items():
        eng.add_request(rid, ids, once, kv_transfer_params={"do_remote_decode": True})
    params, first = {}, {}
    for _ in range(200):
        for out in eng.step():
            if out.finished:
                params[out.request_id] = out.kv_transfer_params.to_dict()  # (JSON to the test)
                first[out.request_id] = out.new_token_ids
        if len(params) == len(a["prompts"]):
            break
    eng.start()  # keeps stepping: D's DONE releases P's blocks
    _reply({"port": conn.port, "params": params, "first": first})
    _wait_quit()
    eng.shutdown()
    try:
        assert_all_free(eng.kv_cache_manager)
        audit = "ok"
    except AssertionError as e:
        audit = str(e)
    conn.shutdown()
    _reply({"audit": audit})


def main() -> None:
    torch.set_num_threads(1)
    a = json.loads(sys.stdin.readline())
    {"pages": serve_pages, "prefill": serve_prefill}[a["mode"]](a)


if __name__ == "__main__":
    main()
