"""Executes parity ops against a KV cache manager through a thin adapter.

An op is a dict `{"op": name, **kwargs}`; its observation is `[result, num_free_blocks]` where
result is JSON-able (block ids per group, hit lengths, bools, None, or {"error": ExcType}).
The adapter base works for both vLLM 0.25.1 and pdkv because pdkv mirrors vLLM's method names;
subclasses only build the manager, requests and status values.
"""
from __future__ import annotations

import json
import zlib

# Errors that are part of the documented contract (e.g. allocate_slots with nothing to
# allocate raises ValueError). Anything else is a bug in a scenario or an implementation.
CONTRACT_ERRORS = (ValueError,)


def block_ids(kv_blocks) -> list[list[int]]:
    """Per-group block ids of a KVCacheBlocks-like object as plain lists."""
    return [list(ids) for ids in kv_blocks.get_block_ids()]


class ManagerAdapter:
    """Maps parity ops onto a manager whose API follows vLLM 0.25.1's KVCacheManager.

    Subclasses set `self.mgr` and implement `make_request` and `status`.
    Invariant: `self.requests` holds every request created by `new_request`, and
    `self.last_hit[id]` the last get_computed_blocks result not yet consumed by allocate_slots.
    """

    def __init__(self) -> None:
        self.mgr = None
        self.requests: dict = {}
        self.last_hit: dict = {}
        self.popped: dict = {}
        self.hash_ids: dict = {}

    # --- subclass hooks ---------------------------------------------------------------------
    def make_request(self, request_id, tokens, salt, lora, skip_read, max_tokens):
        raise NotImplementedError  # pragma: no cover

    def status(self, name: str):
        raise NotImplementedError  # pragma: no cover

    # --- ops ----------------------------------------------------------------------------------
    def new_request(self, id, tokens, salt=None, lora=None, skip_read=False, max_tokens=4096):
        self.requests[id] = self.make_request(id, list(tokens), salt, lora, skip_read, max_tokens)
        return None

    def get_computed_blocks(self, id):
        blocks, num_hit = self.mgr.get_computed_blocks(self.requests[id])
        self.last_hit[id] = (blocks, num_hit)
        return [block_ids(blocks), num_hit]

    def allocate_slots(self, id, num_new, use_hit=False, lookahead=0, ext=0, delay=False,
                       full_fit=False, reserved=0, has_sched=True):
        req = self.requests[id]
        blocks, num_hit = self.last_hit.pop(id) if use_hit else (None, 0)
        new = self.mgr.allocate_slots(
            req, num_new, num_hit, blocks, num_lookahead_tokens=lookahead,
            num_external_computed_tokens=ext, delay_cache_blocks=delay,
            full_sequence_must_fit=full_fit, reserved_blocks=reserved,
            has_scheduled_reqs=has_sched)
        table = [list(ids) for ids in self.mgr.get_block_ids(id)]
        return {"new": None if new is None else block_ids(new), "table": table}

    def set_num_computed(self, id, n):
        self.requests[id].num_computed_tokens = n

    def set_status(self, id, status):
        self.requests[id].status = self.status(status)

    def preempt(self, id):
        """What vLLM's scheduler does on preemption (without its queues)."""
        req = self.requests[id]
        self.mgr.free(req)
        req.status = self.status("PREEMPTED")
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def append_tokens(self, id, tokens):
        self.requests[id].append_output_token_ids(list(tokens))

    def free(self, id):
        self.mgr.free(self.requests[id])

    def pop_blocks_for_free(self, id):
        blocks = self.mgr.pop_blocks_for_free(self.requests[id])
        self.popped.setdefault(id, []).append(blocks)
        return [b.block_id for b in blocks]

    def free_popped(self, id):
        for blocks in self.popped.pop(id, []):
            self.mgr.block_pool.free_blocks(reversed(blocks))

    def cache_blocks(self, id, n):
        self.mgr.cache_blocks(self.requests[id], n)

    def remove_skipped_blocks(self, id, n):
        self.mgr.remove_skipped_blocks(id, n)

    def reset_prefix_cache(self):
        return bool(self.mgr.reset_prefix_cache())

    def evict_blocks(self, ids):
        self.mgr.evict_blocks(set(ids))

    def common_prefix_blocks(self, id):
        return list(self.mgr.get_num_common_prefix_blocks(id))

    def get_block_ids(self, id):
        return [list(ids) for ids in self.mgr.get_block_ids(id)]

    def take_events(self):
        """KV events with hash values replaced by first-seen ordinals (values differ between
        implementations, identity does not) and token ids by (count, crc32)."""
        return [self._event(ev) for ev in self.mgr.take_events()]

    def prefix_cache_stats(self):
        s = self.mgr.make_prefix_cache_stats()
        if s is None:
            return None
        return [bool(s.reset), s.requests, s.queries, s.hits, s.preempted_requests,
                s.preempted_queries, s.preempted_hits]

    def _hash_id(self, block_hash):
        if block_hash is None:
            return None
        return self.hash_ids.setdefault(block_hash, len(self.hash_ids))

    def _event(self, ev) -> list:
        kind = type(ev).__name__
        if kind == "BlockStored":
            tokens = list(ev.token_ids)
            extra = None if ev.extra_keys is None else [
                None if k is None else list(k) for k in ev.extra_keys]
            return ["stored", [self._hash_id(h) for h in ev.block_hashes],
                    self._hash_id(ev.parent_block_hash), len(tokens),
                    zlib.crc32(json.dumps(tokens).encode()), ev.block_size, ev.lora_name, extra,
                    ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window,
                    ev.medium]
        if kind == "BlockRemoved":
            return ["removed", [self._hash_id(h) for h in ev.block_hashes], ev.group_idx,
                    ev.medium]
        if kind == "AllBlocksCleared":
            return ["cleared"]
        return ["unknown", kind]

    def num_free_blocks(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks()


def execute(adapter: ManagerAdapter, op: dict) -> list:
    """Run one op; returns the observation [result, num_free_blocks]."""
    kwargs = {k: v for k, v in op.items() if k != "op"}
    try:
        result = getattr(adapter, op["op"])(**kwargs)
    except CONTRACT_ERRORS as exc:
        result = {"error": type(exc).__name__}
    return [result, adapter.num_free_blocks()]


def first_mismatch(expected: list, observed: list):
    """Index of the first differing observation, or None if all agree."""
    for i, (exp, obs) in enumerate(zip(expected, observed)):
        if exp != obs:
            return i
    if len(expected) != len(observed):
        return min(len(expected), len(observed))
    return None


def resolve_and_run(run_op, ops: list) -> tuple[list, list]:
    """Run a hand-written op list, turning derived ops into concrete ones first.

    `run_op(op) -> observation` executes one op (e.g. `lambda op: execute(adapter, op)`).
    Derived ops: `admit_alloc` becomes allocate_slots(use_hit=True) for what the request's
    last get_computed_blocks result left (at most `chunk` tokens if given); `admitted` becomes
    set_num_computed(last hit + last admitted tokens). Returns (concrete ops, observations).
    """
    num_tokens: dict = {}
    last_hit: dict = {}
    last_new: dict = {}
    concrete, observed = [], []
    for op in ops:
        rid = op.get("id")
        if op["op"] == "admit_alloc":
            kw = {k: v for k, v in op.items() if k not in ("op", "id", "chunk")}
            num_new = num_tokens[rid] - last_hit.get(rid, 0)
            if op.get("chunk") is not None:
                num_new = min(num_new, op["chunk"])
            last_new[rid] = num_new
            op = {"op": "allocate_slots", "id": rid, "num_new": num_new, "use_hit": True, **kw}
        elif op["op"] == "admitted":
            op = {"op": "set_num_computed", "id": rid,
                  "n": last_hit.get(rid, 0) + last_new.get(rid, 0)}
        obs = run_op(op)
        if op["op"] == "new_request":
            num_tokens[rid] = len(op["tokens"])
        elif op["op"] == "append_tokens":
            num_tokens[rid] += len(op["tokens"])
        elif op["op"] == "get_computed_blocks":
            last_hit[rid] = obs[0][1]
        concrete.append(op)
        observed.append(obs)
    return concrete, observed
