"""Seeded random parity scenarios: a small scheduler loop that drives a KV cache manager.

The loop behaves like vLLM's scheduler as far as the manager can tell: running requests first
(chunked prefill, decode with optional lookahead and multi-token appends, FCFS preemption of
the last running request on a None result: free + PREEMPTED + num_computed 0 +
num_preemptions += 1), then waiting requests (prefix hit, optional asynchronous external load
with delay_cache_blocks and reserved_blocks, full_sequence_must_fit, has_scheduled_reqs),
deferred frees via pop_blocks_for_free, evictions and prefix-cache resets.

Ops depend on the manager's answers, so the op list is produced while running against the
reference (vLLM) and stored concretely in the fixture; pdkv then replays that exact list.
"""
from __future__ import annotations

import random
from collections import deque

from parity import configs, runner


class _Req:
    """Driver-side view of one request (what the scheduler would know)."""

    def __init__(self, rid, tokens, max_out):
        self.id = rid
        self.tokens = list(tokens)
        self.max_out = max_out
        self.num_out = 0
        self.computed = 0
        self.pending_hit = 0
        self.status = "WAITING"
        self.preemptions = 0
        self.failed_alone = 0
        self.remote_steps = 0
        self.remote_tokens = 0


class _Driver:
    def __init__(self, adapter, cfg, params):
        self.adapter = adapter
        self.cfg = cfg
        self.p = params
        self.rng = random.Random(params["seed"])
        self.ops: list = []
        self.observed: list = []
        self.reqs: dict[str, _Req] = {}
        self.waiting: deque = deque()
        self.running: list[str] = []
        self.deferred: list[tuple[str, int]] = []
        self.history: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.step_no = 0
        self.num_created = 0
        block = configs.block_sizes(cfg)[0]
        self.prefixes = [self._rand(n) for n in (3 * block + 1, 6 * block, 9 * block + 2)]

    # --- helpers -------------------------------------------------------------------------
    def call(self, op):
        obs = runner.execute(self.adapter, op)
        self.ops.append(op)
        self.observed.append(obs)
        return obs[0]

    def _rand(self, n):
        return [self.rng.randrange(1000) for _ in range(n)]

    def _chance(self, key):
        return self.rng.random() < self.p.get(key, 0.0)

    def _set_status(self, r, name):
        r.status = name
        self.call({"op": "set_status", "id": r.id, "status": name})

    # --- request lifecycle -----------------------------------------------------------------
    def arrive(self):
        rng, pmax = self.rng, self.p["prompt_max"]
        roll, share = rng.random(), self.p["share"]
        if roll < share:
            prompt = rng.choice(self.prefixes) + self._rand(rng.randint(1, pmax // 2))
        elif roll < share + 0.15 and self.history:
            prompt = rng.choice(self.history) + self._rand(rng.randint(1, 8))
        elif roll < share + 0.25 and self.prompts:
            prompt = list(rng.choice(self.prompts))
        else:
            prompt = self._rand(rng.randint(2, pmax))
        prompt = prompt[:pmax]
        rid = f"r{self.num_created}"
        self.num_created += 1
        op = {"op": "new_request", "id": rid, "tokens": prompt}
        if self._chance("p_salt"):
            op["salt"] = rng.choice(["salt-x", "salt-y"])
        if self._chance("p_lora"):
            op["lora"] = rng.choice(["lora-a", "lora-b"])
        if self._chance("p_skip_read"):
            op["skip_read"] = True
        self.call(op)
        self.prompts.append(prompt)
        self.reqs[rid] = _Req(rid, prompt, rng.randint(1, self.p["out_max"]))
        self.waiting.append(rid)

    def preempt(self, rid):
        r = self.reqs[rid]
        self.call({"op": "preempt", "id": rid})
        r.computed, r.status, r.pending_hit = 0, "PREEMPTED", 0
        r.preemptions += 1
        self.waiting.appendleft(rid)

    def finish(self, rid, reason="FINISHED_STOPPED"):
        r = self.reqs[rid]
        if rid in self.running:
            self.running.remove(rid)
        self._set_status(r, reason)
        if self._chance("p_remove_skipped") and r.computed > 0:
            self.call({"op": "remove_skipped_blocks", "id": rid, "n": r.computed})
        if self._chance("p_deferred"):
            self.call({"op": "pop_blocks_for_free", "id": rid})
            self.deferred.append((rid, self.step_no + self.rng.randint(1, 2)))
        else:
            self.call({"op": "free", "id": rid})
        self.history.append(r.tokens)

    # --- one scheduling step ---------------------------------------------------------------
    def schedule_running(self, budget, scheduled):
        chunk = self.p["chunk"]
        i = 0
        preempted = False
        while i < len(self.running) and budget > 0:
            rid = self.running[i]
            r = self.reqs[rid]
            num_new = min(len(r.tokens) - r.computed, budget, chunk)
            if num_new <= 0:
                i += 1
                continue
            decoding = r.num_out > 0
            lookahead = self.rng.randint(0, 3) if decoding and self._chance("p_lookahead") else 0
            self_preempted = False
            while True:
                res = self.call({"op": "allocate_slots", "id": rid, "num_new": num_new,
                                 "lookahead": lookahead})
                if res["new"] is not None:
                    break
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim == rid:
                    self_preempted = True
                    break
            if self_preempted:
                break
            scheduled[rid] = num_new
            budget -= num_new
            i += 1
        return budget, preempted

    def admit_one(self, rid, budget, scheduled, skipped):
        """Returns False when admission must stop (FCFS)."""
        r = self.reqs[rid]
        if r.status == "WAITING_FOR_REMOTE_KVS":
            skipped.append(rid)
            return True
        if r.preemptions > 4 or r.failed_alone >= 2:
            self.finish(rid, "FINISHED_ABORTED")
            return True
        num_hit, use_hit = 0, False
        if r.computed == 0:
            num_hit = self.call({"op": "get_computed_blocks", "id": rid})[1]
            use_hit = True
        remaining = len(r.tokens) - r.computed - num_hit
        op = {"op": "allocate_slots", "id": rid, "use_hit": use_hit,
              "full_fit": self.p["full_fit"], "has_sched": bool(self.running)}
        remote = r.computed == 0 and remaining > 1 and self._chance("p_ext")
        if remote:
            ext = self.rng.randint(1, remaining - 1)
            op.update(num_new=0, ext=ext, delay=True, reserved=self.rng.randint(0, 3))
        else:
            op["num_new"] = min(remaining, budget, self.p["chunk"])
        res = self.call(op)
        if res["new"] is None:
            self.waiting.appendleft(rid)
            if not self.running and not scheduled:
                r.failed_alone += 1
            return False
        r.failed_alone = 0
        if remote:
            r.remote_tokens = num_hit + op["ext"]
            r.remote_steps = self.rng.randint(1, 3)
            self._set_status(r, "WAITING_FOR_REMOTE_KVS")
            skipped.append(rid)
            return True
        self._set_status(r, "RUNNING")
        r.pending_hit = num_hit
        scheduled[rid] = op["num_new"]
        self.running.append(rid)
        return True

    def finish_remote_loads(self):
        for rid in list(self.waiting):
            r = self.reqs[rid]
            if r.status != "WAITING_FOR_REMOTE_KVS":
                continue
            r.remote_steps -= 1
            if r.remote_steps > 0:
                continue
            self.call({"op": "cache_blocks", "id": rid, "n": r.remote_tokens})
            r.computed = r.remote_tokens
            self.call({"op": "set_num_computed", "id": rid, "n": r.computed})
            self._set_status(r, "WAITING")

    def after_model_step(self, scheduled):
        for rid, num_new in scheduled.items():
            r = self.reqs[rid]
            r.computed += r.pending_hit + num_new
            r.pending_hit = 0
            self.call({"op": "set_num_computed", "id": rid, "n": r.computed})
            if r.computed >= len(r.tokens):
                k = self.rng.randint(2, 4) if self._chance("p_multi_token") else 1
                toks = self._rand(k)
                self.call({"op": "append_tokens", "id": rid, "tokens": toks})
                r.tokens += toks
                r.num_out += k
                if r.num_out >= r.max_out or self._chance("p_abort"):
                    self.finish(rid)
            elif self._chance("p_abort"):
                self.finish(rid, "FINISHED_ABORTED")

    def housekeeping(self):
        for rid, at in list(self.deferred):
            if at <= self.step_no:
                self.deferred.remove((rid, at))
                self.call({"op": "free_popped", "id": rid})
        if self._chance("p_evict"):
            ids = self.rng.sample(range(1, self.cfg["num_blocks"]), self.rng.randint(1, 3))
            self.call({"op": "evict_blocks", "ids": sorted(ids)})
        if self._chance("p_cache") and self.running:
            rid = self.rng.choice(self.running)
            self.call({"op": "cache_blocks", "id": rid, "n": self.reqs[rid].computed})
        idle = not self.running and not self.deferred and not any(
            self.reqs[w].status == "WAITING_FOR_REMOTE_KVS" for w in self.waiting)
        if self._chance("p_reset") or (idle and self.rng.random() < 0.3):
            self.call({"op": "reset_prefix_cache"})
        if self.running and self.step_no % 3 == 0:
            self.call({"op": "common_prefix_blocks", "id": self.running[0]})
        self.call({"op": "take_events"})
        if self.step_no % 4 == 0:
            self.call({"op": "prefix_cache_stats"})

    def step(self, arrivals):
        self.step_no += 1
        for _ in range(arrivals):
            self.arrive()
        self.finish_remote_loads()
        budget = self.p["budget"]
        scheduled: dict[str, int] = {}
        budget, preempted = self.schedule_running(budget, scheduled)
        if not preempted:
            skipped: list[str] = []
            while (self.waiting and budget > 0
                   and len(self.running) < self.p["max_running"]):
                rid = self.waiting.popleft()
                if not self.admit_one(rid, budget, scheduled, skipped):
                    break
                budget -= scheduled.get(rid, 0)
            self.waiting.extendleft(reversed(skipped))
        self.after_model_step(scheduled)
        self.housekeeping()

    def drain(self):
        for rid in list(self.running):
            self.finish(rid, "FINISHED_ABORTED")
        for rid in list(self.waiting):
            self.finish(rid, "FINISHED_ABORTED")
        self.waiting.clear()
        for rid, _ in self.deferred:
            self.call({"op": "free_popped", "id": rid})
        self.deferred.clear()
        self.call({"op": "reset_prefix_cache"})
        self.call({"op": "new_request", "id": "final", "tokens": self.prompts[0]})
        self.call({"op": "get_computed_blocks", "id": "final"})
        self.call({"op": "take_events"})
        self.call({"op": "prefix_cache_stats"})

    def run(self):
        while len(self.ops) < self.p["max_ops"] and self.step_no < 4 * self.p["max_ops"]:
            arrivals = 0
            if self.num_created < self.p["num_requests"]:
                arrivals = self.rng.choice([0, 0, 1, 1, 1, 2, 3])
            elif not self.running and not self.waiting and not self.deferred:
                break
            self.step(arrivals)
        self.drain()
        return self.ops, self.observed


def generate(adapter, cfg, params):
    """Run the seeded scheduler loop against `adapter`; returns (ops, observations)."""
    return _Driver(adapter, cfg, params).run()


_BASE = dict(num_requests=60, max_ops=600, budget=32, chunk=16, max_running=8,
             prompt_max=60, out_max=24, share=0.45, full_fit=False, p_ext=0.0, p_lookahead=0.0,
             p_multi_token=0.1, p_abort=0.03, p_deferred=0.0, p_evict=0.0, p_reset=0.0,
             p_cache=0.05, p_salt=0.05, p_lora=0.05, p_skip_read=0.03,
             p_remove_skipped=0.2)


def _params(seed, **kw):
    return {**_BASE, "seed": seed, **kw}


_R_FULL = configs.config("full4_rand", [configs.full(4)], num_blocks=40,
                           max_model_len=256, max_num_batched_tokens=32)
_R_FULL_WM = dict(_R_FULL, name="full4_rand_wm", watermark=0.1)
_R_SWA = configs.config("swa4_rand", [configs.swa(4, 10)], num_blocks=24,
                          max_model_len=256, max_num_batched_tokens=32)
_R_SWA_WM = dict(_R_SWA, name="swa4_rand_wm", watermark=0.1)
_R_HYB = configs.config("hybrid4_rand", [configs.full(4), configs.swa(4, 10)],
                          num_blocks=56, max_model_len=256, max_num_batched_tokens=32)
_R_HYB_WM = dict(_R_HYB, name="hybrid4_rand_wm", watermark=0.1)
_R_MIX = configs.config("hybrid_mixed_rand", [configs.full(4), configs.swa(8, 12)],
                          num_blocks=64, max_model_len=256, max_num_batched_tokens=32)

_R_HYB3 = configs.config("hybrid3_rand", [configs.full(4), configs.swa(4, 10),
                                            configs.swa(4, 6)],
                           num_blocks=72, max_model_len=256, max_num_batched_tokens=32)
_R_HYB_NOCACHE = dict(_R_HYB, name="hybrid4_rand_nocache", enable_caching=False)
_R_SWA_BIG = dict(_R_SWA, name="swa4_rand_big", num_blocks=64)
_R_HYB_BIG = dict(_R_HYB, name="hybrid4_rand_big", num_blocks=128)
_SHARING = dict(share=0.6, max_running=4, out_max=6, num_requests=80, p_ext=0.1, p_deferred=0.2, p_lookahead=0.2)
_PRESSURE = dict(p_ext=0.15, p_lookahead=0.3, p_deferred=0.3, p_evict=0.05, p_reset=0.02)

RANDOM_SCENARIOS = [
    ("rand_full_basic", _R_FULL, _params(1)),
    ("rand_full_pressure", _R_FULL, _params(2, full_fit=True, **_PRESSURE)),
    ("rand_full_watermark", _R_FULL_WM, _params(3, full_fit=True, **_PRESSURE)),
    ("rand_full_nochunk", _R_FULL, _params(4, chunk=64, budget=64, **_PRESSURE)),
    ("rand_swa_basic", _R_SWA, _params(11)),
    ("rand_swa_pressure", _R_SWA, _params(12, full_fit=True, **_PRESSURE)),
    ("rand_swa_watermark", _R_SWA_WM, _params(13, **_PRESSURE)),
    ("rand_swa_sharing", _R_SWA_BIG, _params(14, **_SHARING)),
    ("rand_hybrid_basic", _R_HYB, _params(21)),
    ("rand_hybrid_sharing", _R_HYB_BIG, _params(24, **_SHARING)),
    ("rand_hybrid_pressure", _R_HYB, _params(22, full_fit=True, **_PRESSURE)),
    ("rand_hybrid_watermark", _R_HYB_WM, _params(23, full_fit=True, **_PRESSURE)),
    ("rand_hybrid3", _R_HYB3, _params(25, **_PRESSURE)),
    ("rand_hybrid3_sharing", dict(_R_HYB3, num_blocks=160), _params(26, **_SHARING)),
    ("rand_hybrid_nocache", _R_HYB_NOCACHE, _params(27, full_fit=True, **_PRESSURE)),
    ("rand_hybrid_mixed", _R_MIX, _params(31, **_PRESSURE)),
    ("rand_hybrid_mixed_fit", _R_MIX, _params(32, full_fit=True, **_PRESSURE)),
]
