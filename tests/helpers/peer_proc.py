"""A KV peer in its own process, driven by JSON lines on stdin/stdout.

It owns a real PagePool, a real kvcache KVCacheManager and a real ZmqConnector,
and plays the engine scheduler's part around them (the calls pd/engine/sched/scheduler.py
makes), so tests can check bytes, block accounting and leaks on both sides.
Commands are {"cmd": ..., ...}; every reply is {"ok": true, ...} or
{"ok": false, "error": "..."}. Nothing is pickled.
"""
from __future__ import annotations

import json
import logging
import sys
import time
import traceback

import torch

from connectors.params import TransferParams
from connectors.zmq.paths.page_access import digest
from pd.engine.kv.page_pool import PagePool
from connectors.zmq.connector import ZmqConnector, ZmqConnectorConfig
from kvcache import (BlockHasher, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                     KVCacheManager, Request, RequestStatus, SlidingWindowSpec)
from kvcache.audit import assert_all_free


class Peer:
    def __init__(self, a: dict):
        torch.set_num_threads(1)
        groups = []
        for i, g in enumerate(a["groups"]):
            kw = dict(block_size=a["block_size"], num_kv_heads=g.get("heads", 1), head_size=a["head_size"], dtype="float32")
            spec = SlidingWindowSpec(sliding_window=g["window"], **kw) if g.get("window") else FullAttentionSpec(**kw)
            groups.append(KVCacheGroupSpec(layer_names=(f"g{i}.l0",), spec=spec))
        self.block_size = a["block_size"]
        cfg = KVCacheConfig(num_blocks=a["num_blocks"], groups=tuple(groups))
        self.mgr = KVCacheManager(cfg, max_model_len=4096, enable_caching=True)
        page = max(g.spec.page_size_bytes for g in groups)
        self.pool = PagePool(a["num_blocks"], page)
        self.hasher = BlockHasher(block_size=a["block_size"], algorithm="sha256")
        conf = ZmqConnectorConfig(
            engine_id=a["engine_id"], role=a["role"], secret=a["secret"].encode(), model_id=a.get("model_id", "tiny"),
            lease_s=a.get("lease_s", 30.0), handshake_timeout_s=a.get("timeout_s", 2.0),
            transfer_timeout_s=a.get("timeout_s", 2.0), io_timeout_s=a.get("timeout_s", 2.0),
            heartbeat_interval_s=a.get("heartbeat_s"), data_path=a.get("data_path", "auto"))
        self.conn = ZmqConnector(conf, cfg.groups)
        self.conn.worker.register_kv_caches(self.pool)
        self.reqs: dict[str, Request] = {}
        self.fillers: list[Request] = []
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.invalid: set[int] = set()

    # ---------------------------------------------------------------- engine-like step
    def step(self) -> None:
        w = self.conn.worker
        w.bind_connector_metadata(self.conn.scheduler.build_connector_meta())
        w.start_load_kv()
        sending, recving = w.get_finished()
        invalid = w.get_block_ids_with_load_errors()
        from connectors.base import ConnectorOutput
        self.conn.scheduler.update_connector_output(ConnectorOutput(sending, recving, invalid))
        self.invalid |= invalid
        self.finished_recving |= recving
        for rid in sending:  # the producer released its lease: free the held blocks
            self.finished_sending.add(rid)
            req = self.reqs.pop(rid, None)
            if req is not None:
                self.mgr.free(req)

    def digests(self, rid: str) -> list[list[int]]:
        ids = self.mgr.get_block_ids(rid)
        return [[digest(self.pool.page(b).numpy()) if b else 0 for b in g] for g in ids]

    # ---------------------------------------------------------------- producer side
    def prefill(self, a: dict) -> dict:
        req = Request(a["request_id"], a["prompt"], block_hasher=self.hasher, max_tokens=1,
                      kv_transfer_params=TransferParams(do_remote_decode=True))
        blocks, hit = self.mgr.get_computed_blocks(req)
        n = len(a["prompt"])
        assert self.mgr.allocate_slots(req, n - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks) is not None
        gen = torch.Generator().manual_seed(a.get("seed", 0))
        for g in self.mgr.get_block_ids(req.request_id):
            for b in g:
                if b:
                    self.pool.page(b).copy_(torch.randint(0, 256, (self.pool.page_size_bytes,), dtype=torch.uint8, generator=gen))
        req.num_computed_tokens = n
        self.mgr.cache_blocks(req, n)
        self.mgr.remove_skipped_blocks(req.request_id, n)
        req.append_output_token_ids(1)
        req.status = RequestStatus.FINISHED_ABORTED if a.get("abort") else RequestStatus.FINISHED_LENGTH_CAPPED
        num_blocks = -(-n // self.block_size)
        block_ids = tuple(ids[:num_blocks] for ids in self.mgr.get_block_ids(req.request_id))
        delay, params = self.conn.scheduler.request_finished(req, block_ids)
        digests = self.digests(req.request_id)
        if delay:
            self.reqs[req.request_id] = req
        else:
            self.mgr.free(req)
        return {"delay": delay, "params": params.to_dict() if params else None, "block_ids": [list(g) for g in block_ids], "digests": digests}

    def corrupt(self, a: dict) -> dict:
        rid = a["request_id"]
        deadline = time.monotonic() + 5
        while not self.conn.worker.producer.leases.is_sealed(rid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.pool.page(a["block_id"])[:8] ^= 0xFF
        return {}

    # ---------------------------------------------------------------- consumer side
    def decode(self, a: dict) -> dict:
        req = self.reqs.get(a["request_id"])
        if req is None:
            req = Request(a["request_id"], a["prompt"], block_hasher=self.hasher, max_tokens=4,
                          kv_transfer_params=TransferParams.from_dict(a["params"]))
            self.reqs[req.request_id] = req
        sched = self.conn.scheduler
        sched.on_new_request(req)
        blocks, num_local = self.mgr.get_computed_blocks(req)
        ext, is_async = sched.get_num_new_matched_tokens(req, num_local)
        new = self.mgr.allocate_slots(req, 0 if is_async else len(a["prompt"]) - num_local,
                                      num_new_computed_tokens=num_local, new_computed_blocks=blocks,
                                      num_external_computed_tokens=ext, delay_cache_blocks=is_async)
        assert new is not None, "allocation failed"
        sched.update_state_after_alloc(req, self.mgr.get_blocks(req.request_id), ext)
        req.num_computed_tokens = num_local + ext
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS if is_async else RequestStatus.RUNNING
        self.step()  # the step that starts the load
        return {"num_local": num_local, "num_external": ext, "async": is_async,
                "block_ids": [list(g) for g in self.mgr.get_block_ids(req.request_id)]}

    def wait_load(self, a: dict) -> dict:
        rid = a["request_id"]
        t0 = time.monotonic()
        while rid not in self.finished_recving and time.monotonic() - t0 < a.get("timeout_s", 20):
            self.step()
            time.sleep(0.005)
        done = rid in self.finished_recving
        self.finished_recving.discard(rid)
        req = self.reqs[rid]
        mine = {b for g in self.mgr.get_block_ids(rid) for b in g}
        bad = sorted(self.invalid & mine)
        self.invalid -= mine
        out = {"done": done, "seconds": time.monotonic() - t0, "invalid": bad, "digests": self.digests(rid)}
        if done and not bad:
            self.mgr.cache_blocks(req, req.num_computed_tokens)  # verified: now visible to prefix lookups
        if a.get("free", True):
            req.status = RequestStatus.FINISHED_STOPPED
            self.conn.scheduler.request_finished(req, tuple(self.mgr.get_block_ids(rid)))
            self.mgr.free(req)
            del self.reqs[rid]
        return out

    def finish(self, a: dict) -> dict:
        """Aborts/finishes a decode request (without waiting for any load)."""
        req = self.reqs.pop(a["request_id"])
        req.status = RequestStatus.FINISHED_ABORTED
        self.conn.scheduler.request_finished(req, tuple(self.mgr.get_block_ids(req.request_id)))
        self.mgr.free(req)
        self.step()
        return {}

    # ---------------------------------------------------------------- both
    def wait_sent(self, a: dict) -> dict:
        t0 = time.monotonic()
        while a["request_id"] not in self.finished_sending and time.monotonic() - t0 < a.get("timeout_s", 20):
            self.step()
            time.sleep(0.01)
        return {"done": a["request_id"] in self.finished_sending, "seconds": time.monotonic() - t0}

    def filler(self, a: dict) -> dict:
        """Holds `num_tokens` tokens' worth of blocks so the two sides use different block ids."""
        req = Request(f"filler-{len(self.fillers)}", list(range(7, 7 + a["num_tokens"])), block_hasher=self.hasher, max_tokens=1)
        assert self.mgr.allocate_slots(req, a["num_tokens"]) is not None
        self.fillers.append(req)
        return {}

    def set_lease(self, a: dict) -> dict:
        self.conn.scheduler.lease_s = a["lease_s"]
        return {}

    def enqueue(self, a: dict) -> dict:
        """A decode request waiting in the queue (not admitted yet): only heartbeats run."""
        req = Request(a["request_id"], a["prompt"], block_hasher=self.hasher, max_tokens=4,
                      kv_transfer_params=TransferParams.from_dict(a["params"]))
        self.reqs[req.request_id] = req
        self.conn.scheduler.on_new_request(req)
        return {}

    def idle(self, a: dict) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < a["seconds"]:
            self.step()
            time.sleep(0.02)
        return {}

    def audit(self, a: dict) -> dict:
        self.step()
        for req in self.fillers:
            self.mgr.free(req)
        self.fillers = []
        if a.get("reset_prefix_cache"):
            self.mgr.reset_prefix_cache()
        assert_all_free(self.mgr)
        return {}

    def stats(self, a: dict) -> dict:
        self.step()
        return {"stats": self.conn.stats(), "held": sorted(self.reqs)}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    peer = None
    for line in sys.stdin:
        a = json.loads(line)
        try:
            if a["cmd"] == "init":
                peer = Peer(a)
                out = {"port": peer.conn.port,
                       "data_port": peer.conn.worker.producer.data_port if peer.conn.worker.producer else 0}
            elif a["cmd"] == "exit":
                peer.conn.shutdown()
                print(json.dumps({"ok": True}), flush=True)
                return
            else:
                out = getattr(peer, a["cmd"])(a)
            print(json.dumps({"ok": True, **out}), flush=True)
        except Exception as e:  # report, keep serving
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}), flush=True)


if __name__ == "__main__":
    main()
