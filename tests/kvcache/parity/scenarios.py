"""Hand-written parity scenarios (plain JSON-able op lists, configs in configs.py).

Scenarios are op lists executed by `runner.execute`; they follow vLLM's tests/v1/core cases
listed in the reference (§12-13) plus the manager arguments those tests leave out (watermark,
reserved_blocks, full_sequence_must_fit, delay_cache_blocks, pop_blocks_for_free).
Expected values come from running them against vLLM 0.25.1 (record_vllm.py), except the
free-order example whose vLLM value is also asserted literally by the test.
"""
from __future__ import annotations

from parity.configs import (
    FULL4, FULL16, FULL16_3, FULL16_64, FULL16_NOCACHE, FULL16_WM, HYBRID3, HYBRID4, HYBRID4_SM,
    HYBRID_MIXED, HYBRID_TWIN, SWA4,
)


# --- op constructors ------------------------------------------------------------------------
def new(id, tokens, salt=None, lora=None, skip_read=False):
    op = {"op": "new_request", "id": id, "tokens": list(tokens)}
    if salt is not None:
        op["salt"] = salt
    if lora is not None:
        op["lora"] = lora
    if skip_read:
        op["skip_read"] = True
    return op


def hit(id):
    return {"op": "get_computed_blocks", "id": id}


def alloc(id, num_new, **kw):
    """kw: use_hit, lookahead, ext, delay, full_fit, reserved, has_sched (see runner)."""
    return {"op": "allocate_slots", "id": id, "num_new": num_new, **kw}


def computed(id, n):
    return {"op": "set_num_computed", "id": id, "n": n}


def status(id, name):
    return {"op": "set_status", "id": id, "status": name}


def append(id, tokens):
    return {"op": "append_tokens", "id": id, "tokens": list(tokens)}


def free(id):
    return {"op": "free", "id": id}


def op(name, **kw):
    return {"op": name, **kw}


def admit_alloc(id, **kw):
    """allocate_slots(use_hit=True) for everything the last hit left; resolved to a concrete
    allocate_slots op when recorded (runner.resolve), so fixtures hold plain ops only."""
    return {"op": "admit_alloc", "id": id, **kw}


def seq(start, n):
    return list(range(start, start + n))


COMMON = seq(0, 48)  # three full 16-token blocks


def _prefill_pair():
    """vLLM test_prefill's first half: two requests sharing three full blocks."""
    return [
        new("0", COMMON + seq(1000, 7)), hit("0"), alloc("0", 55, use_hit=True),
        new("1", COMMON + seq(2000, 5)), hit("1"), alloc("1", 5, use_hit=True),
        free("0"), free("1"),
    ]


def free_order():
    """Free order [5,4,6,...]: a 160-token miss takes blocks in exactly free-queue order."""
    return _prefill_pair() + [new("miss", seq(5000, 160)), hit("miss"),
                              alloc("miss", 160, use_hit=True), free("miss")]


FREE_ORDER_EXPECTED = [[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]]


def prefill():
    return _prefill_pair() + [
        new("2", COMMON + seq(3000, 6)), hit("2"), alloc("2", 6, use_hit=True), free("2"),
        new("3", [99] * 160), hit("3"), alloc("3", 160, use_hit=True), free("3"),
        new("4", COMMON + seq(3000, 6)), hit("4"), alloc("4", 54, use_hit=True), free("4"),
    ]


def decode():
    ops = [new("0", seq(0, 55)), hit("0"), alloc("0", 55, use_hit=True), computed("0", 55),
           status("0", "RUNNING")]
    n = 55
    for i in range(12):
        ops += [append("0", [7000 + i]), alloc("0", 1), computed("0", n + 1)]
        n += 1
    # a burst of accepted tokens (like speculative decoding) crosses a block boundary
    ops += [append("0", seq(8000, 20)), alloc("0", 20, lookahead=3), computed("0", n + 20)]
    n += 20
    ops += [op("get_block_ids", id="0")]
    ops += [new("1", seq(0, 55) + [7000 + i for i in range(12)] + seq(8000, 20) + [1]),
            hit("1"), free("0"), hit("1"), admit_alloc("1"), free("1")]
    return ops


def evict():
    return [
        new("0", seq(0, 87)), hit("0"), alloc("0", 87, use_hit=True),
        new("1", seq(87, 48)), hit("1"), alloc("1", 48, use_hit=True),
        free("0"), free("1"),
        new("2", seq(0, 35)), hit("2"), alloc("2", 3, use_hit=True),
        new("3", seq(9000, 100)), hit("3"), alloc("3", 100, use_hit=True),
        free("2"), free("3"),
        new("4", seq(0, 87)), hit("4"), admit_alloc("4"), free("4"),
    ]


def hash_block_correct_reuse():
    return [
        new("0", seq(0, 16)), hit("0"), alloc("0", 16, use_hit=True), free("0"),
        new("1", seq(100, 7)), hit("1"), alloc("1", 7, use_hit=True),
        new("2", seq(0, 17)), hit("2"), alloc("2", 17, use_hit=True),
        free("1"), free("2"),
    ]


def computed_blocks_not_evicted():
    return [
        new("0", seq(0, 16)), hit("0"), alloc("0", 16, use_hit=True),
        new("1", seq(16, 16)), hit("1"), alloc("1", 16, use_hit=True),
        free("0"), free("1"),
        new("2", seq(0, 32)), hit("2"), alloc("2", 16, use_hit=True),
        free("2"),
    ]


def not_enough_free_with_computed():
    return [
        new("0", COMMON + [1]), hit("0"), alloc("0", 49, use_hit=True),
        new("big", seq(500, 80)), hit("big"), alloc("big", 80, use_hit=True),
        new("1", COMMON + seq(600, 40)), hit("1"), alloc("1", 40, use_hit=True),
        hit("1"), alloc("1", 40, use_hit=True, full_fit=True),
        free("big"), hit("1"), alloc("1", 40, use_hit=True),
        free("0"), free("1"),
    ]


def reset_prefix_cache():
    return [
        new("0", seq(0, 40)), hit("0"), alloc("0", 40, use_hit=True),
        op("reset_prefix_cache"), free("0"), op("reset_prefix_cache"),
        new("1", seq(0, 40)), hit("1"), alloc("1", 40, use_hit=True),
        new("2", seq(0, 40)), hit("2"), alloc("2", 8, use_hit=True),
        free("1"), free("2"), op("reset_prefix_cache"), op("reset_prefix_cache"),
    ]


def salting_and_lora():
    toks = seq(0, 40)
    ops = [new("0", toks), hit("0"), alloc("0", 40, use_hit=True)]
    for rid, kw in [("s", {"salt": "salt-a"}), ("s2", {"salt": "salt-a"}),
                    ("t", {"salt": "salt-b"}), ("l", {"lora": "lora-a"}),
                    ("l2", {"lora": "lora-a"}), ("m", {"lora": "lora-b", "salt": "salt-a"}),
                    ("p", {})]:
        ops += [new(rid, toks, **kw), hit(rid), admit_alloc(rid)]
    for rid in ["0", "s", "s2", "t", "l", "l2", "m", "p"]:
        ops.append(free(rid))
    return ops


def caching_disabled():
    return _prefill_pair() + [new("2", COMMON + [1]), hit("2"), alloc("2", 49, use_hit=True),
                              op("cache_blocks", id="2", n=49), free("2"),
                              op("reset_prefix_cache")]


def skip_reading():
    return [
        new("0", seq(0, 40), skip_read=True), hit("0"), alloc("0", 40, use_hit=True),
        new("1", seq(0, 40), skip_read=True), hit("1"),
        new("2", seq(0, 40)), hit("2"), alloc("2", 8, use_hit=True),
        free("0"), free("2"),
    ]


def watermark():
    # 11 blocks, watermark 0.2 -> 2 blocks; 10 free
    return [
        new("a", seq(0, 100)), hit("a"), alloc("a", 100, use_hit=True, has_sched=False),
        computed("a", 100), status("a", "RUNNING"),
        new("b", seq(200, 48)), hit("b"), alloc("b", 48, use_hit=True, has_sched=True),
        alloc("b", 48, has_sched=False),
        free("b"), status("b", "PREEMPTED"), computed("b", 0),
        alloc("b", 16, has_sched=True), alloc("b", 16, has_sched=True, full_fit=True),
        free("b"),
        append("a", seq(300, 30)), alloc("a", 30),
        free("a"),
    ]


def full_sequence_and_reserved():
    # 10 usable blocks; "hold" keeps 3 -> 7 free; a 120-token prompt needs 8 blocks in full
    return [
        new("hold", seq(0, 40)), hit("hold"), alloc("hold", 40, use_hit=True),
        new("long", seq(500, 120)), hit("long"),
        alloc("long", 16, use_hit=True, full_fit=True),
        alloc("long", 16, reserved=6), free("long"),
        new("r7", seq(700, 120)), hit("r7"), alloc("r7", 16, use_hit=True, reserved=7),
        alloc("r7", 16, full_fit=True, reserved=0), alloc("r7", 16, reserved=5, full_fit=False),
        free("r7"), free("hold"),
        new("again", seq(500, 120)), hit("again"),
        admit_alloc("again", full_fit=True, reserved=2), free("again"),
        new("again2", seq(500, 120)), hit("again2"),
        admit_alloc("again2", full_fit=True, reserved=9), free("again2"),
    ]


def delay_cache_and_external():
    return [
        new("0", seq(0, 64)), hit("0"),
        alloc("0", 0, use_hit=True, ext=40, delay=True),
        status("0", "WAITING_FOR_REMOTE_KVS"),
        new("1", seq(0, 64)), hit("1"),
        op("cache_blocks", id="0", n=40), computed("0", 40), status("0", "WAITING"),
        hit("1"), alloc("0", 24), computed("0", 64), status("0", "RUNNING"),
        alloc("1", 24, use_hit=True, ext=8, delay=True), op("cache_blocks", id="1", n=56),
        new("2", seq(0, 64)), hit("2"), alloc("2", 64, use_hit=True, has_sched=False),
        free("0"), free("1"), free("2"),
        new("3", seq(0, 16)), alloc("3", 0), free("3"),
    ]


def pop_blocks_for_free():
    return [
        new("0", COMMON + seq(1000, 7)), hit("0"), alloc("0", 55, use_hit=True),
        new("1", COMMON + seq(2000, 5)), hit("1"), alloc("1", 5, use_hit=True),
        op("pop_blocks_for_free", id="0"), op("pop_blocks_for_free", id="0"),
        new("2", COMMON + [5]), hit("2"),
        op("free_popped", id="0"), op("pop_blocks_for_free", id="1"),
        op("free_popped", id="1"),
        new("miss", seq(5000, 160)), hit("miss"), alloc("miss", 160, use_hit=True),
        free("miss"),
    ]


def evict_blocks():
    return [
        new("0", seq(0, 64)), hit("0"), alloc("0", 64, use_hit=True),
        op("evict_blocks", ids=[3]), free("0"),
        new("1", seq(0, 64)), hit("1"), op("evict_blocks", ids=[1, 9]), hit("1"),
        alloc("1", 64, use_hit=True), free("1"), op("evict_blocks", ids=[2, 4]),
        new("2", seq(0, 64)), hit("2"), alloc("2", 64, use_hit=True), free("2"),
    ]


def lookahead():
    return [
        new("0", [1, 2, 3]), hit("0"), alloc("0", 3, use_hit=True, lookahead=2),
        new("1", seq(0, 12)), hit("1"), alloc("1", 12, use_hit=True, lookahead=5),
        new("2", seq(0, 13)), hit("2"), alloc("2", 5, use_hit=True, lookahead=4),
        free("0"), free("1"), free("2"),
    ]


def value_error():
    return [new("0", seq(0, 10)), hit("0"), alloc("0", 0), alloc("0", 0, ext=0),
            alloc("0", 10), alloc("0", 0), free("0")]


def _decode_loop(id, start_token, n_computed, steps, lookahead=0):
    ops = []
    for i in range(steps):
        ops += [append(id, [start_token + i]), alloc(id, 1, lookahead=lookahead),
                computed(id, n_computed + i + 1)]
    return ops


def sliding_window():
    ops = [new("0", seq(0, 40)), hit("0"), alloc("0", 16, use_hit=True), computed("0", 16),
           status("0", "RUNNING"), alloc("0", 16), computed("0", 32), alloc("0", 8),
           computed("0", 40), op("get_block_ids", id="0")]
    ops += _decode_loop("0", 900, 40, 10)
    ops += [op("remove_skipped_blocks", id="0", n=50), op("get_block_ids", id="0"),
            new("1", seq(0, 40)), hit("1"), admit_alloc("1"),
            free("0"), free("1"),
            new("2", seq(0, 40) + list(range(900, 910)) + [5]), hit("2"),
            admit_alloc("2"), free("2"),
            new("3", seq(0, 30)), hit("3"), alloc("3", 30, use_hit=True), free("3")]
    return ops


def swa_full_fit_cap():
    # window 10, max_num_batched_tokens 16: the admission cap is cdiv(9+16, 4)+1 = 8 blocks
    return [
        new("hold", seq(5000, 24)), hit("hold"), alloc("hold", 24, use_hit=True),
        new("long", seq(0, 200)), hit("long"), alloc("long", 16, use_hit=True, full_fit=True),
        computed("long", 16), status("long", "RUNNING"),
        alloc("long", 16, full_fit=True), computed("long", 32),
        alloc("long", 16), computed("long", 48), op("get_block_ids", id="long"),
        free("hold"), free("long"),
    ]


def swa_free_split():
    return [
        new("0", seq(0, 30)), hit("0"), alloc("0", 30, use_hit=True), computed("0", 30),
        status("0", "RUNNING"),
    ] + _decode_loop("0", 700, 30, 6) + [
        free("0"),
        new("1", seq(3000, 44)), hit("1"), alloc("1", 44, use_hit=True), free("1"),
        new("2", seq(0, 30)), hit("2"), admit_alloc("2"), free("2"),
    ]


def hybrid_prefill():
    common = seq(0, 24)
    return [
        new("0", common + seq(1000, 7)), hit("0"), alloc("0", 31, use_hit=True),
        new("1", common + seq(2000, 5)), hit("1"), admit_alloc("1"),
        free("0"), free("1"),
        new("2", common + seq(3000, 9)), hit("2"), admit_alloc("2"),
        new("miss", seq(9000, 60)), hit("miss"), alloc("miss", 60, use_hit=True),
        free("2"), free("miss"),
        new("3", common + seq(3000, 9)), hit("3"), admit_alloc("3"), free("3"),
    ]


def hybrid_local_and_external():
    return [
        new("0", seq(0, 40)), hit("0"), alloc("0", 40, use_hit=True), computed("0", 40),
        new("1", seq(0, 60)), hit("1"), alloc("1", 0, use_hit=True, ext=19, delay=True),
        op("get_block_ids", id="1"), status("1", "WAITING_FOR_REMOTE_KVS"),
        op("cache_blocks", id="1", n=58), computed("1", 58), status("1", "WAITING"),
        alloc("1", 2), op("preempt", id="1"), hit("1"),
        alloc("1", 0, use_hit=True, ext=3, delay=True), free("0"), free("1"),
        new("2", seq(0, 60)), hit("2"), admit_alloc("2"), free("2"),
    ]


# ops after which the prefix cache may have changed: the recorder drains KV events there
MUTATING = {"allocate_slots", "admit_alloc", "free", "free_popped", "cache_blocks",
            "reset_prefix_cache", "evict_blocks", "preempt", "remove_skipped_blocks"}


def observed(ops: list) -> list:
    """`ops` with take_events after every mutating op and prefix-cache stats at the end."""
    out = []
    for o in ops:
        out.append(o)
        if o["op"] in MUTATING:
            out.append(op("take_events"))
    return out + [op("prefix_cache_stats")]


def hybrid_probe_after_window_eviction():
    """kvcache state-machine falsifying example (08:25): a probe of a running request's prompt
    in a full+SWA hybrid after the request's out-of-window SWA blocks were recycled."""
    def admit(rid, chunk, has_sched):
        return [hit(rid), admit_alloc(rid, chunk=chunk, has_sched=has_sched),
                op("admitted", id=rid), status(rid, "RUNNING")]
    return ([new("r0", seq(100, 24) + [0], salt="s")] + admit("r0", 16, False)
            + [op("preempt", id="r0")] + admit("r0", 4, False)
            + [op("preempt", id="r0")] + admit("r0", 1, False)
            + [new("r1", seq(200, 10) + [0])] + admit("r1", 9, True)
            + [new("r2", [7] * 16 + [0])] + admit("r2", 17, True)
            + [append("r2", [0]), alloc("r2", 1), computed("r2", 18)]
            + [new("r3", seq(100, 24) + [0])] + admit("r3", 25, True)
            + [status("r0", "FINISHED_STOPPED"), free("r0")]
            + [new("probe", [7] * 16 + [0, 0]), hit("probe")]
            + [free("r1"), free("r2"), free("r3")])


HANDWRITTEN = [
    ("free_order", FULL16, free_order),
    ("prefill", FULL16, prefill),
    ("decode", FULL16, decode),
    ("evict", FULL16, evict),
    ("hash_block_correct_reuse", FULL16, hash_block_correct_reuse),
    ("computed_blocks_not_evicted", FULL16_3, computed_blocks_not_evicted),
    ("not_enough_free_with_computed", FULL16, not_enough_free_with_computed),
    ("reset_prefix_cache", FULL16, reset_prefix_cache),
    ("salting_and_lora", FULL16_64, salting_and_lora),
    ("caching_disabled", FULL16_NOCACHE, caching_disabled),
    ("skip_reading", FULL16, skip_reading),
    ("watermark", FULL16_WM, watermark),
    ("full_sequence_and_reserved", FULL16, full_sequence_and_reserved),
    ("delay_cache_and_external", FULL16, delay_cache_and_external),
    ("pop_blocks_for_free", FULL16, pop_blocks_for_free),
    ("evict_blocks", FULL16, evict_blocks),
    ("lookahead", FULL4, lookahead),
    ("value_error", FULL4, value_error),
    ("swa_sliding_window", SWA4, sliding_window),
    ("swa_full_fit_cap", SWA4, swa_full_fit_cap),
    ("swa_free_split", SWA4, swa_free_split),
    ("hybrid_prefill", HYBRID4, hybrid_prefill),
    ("hybrid_local_and_external", HYBRID4, hybrid_local_and_external),
    ("hybrid_probe_after_window_eviction", HYBRID4_SM, hybrid_probe_after_window_eviction),
    ("hybrid3_prefill", HYBRID3, hybrid_prefill),
    ("hybrid3_local_and_external", HYBRID3, hybrid_local_and_external),
    ("hybrid_twin_prefill", HYBRID_TWIN, hybrid_prefill),
    ("hybrid_mixed_prefill", HYBRID_MIXED, hybrid_prefill),
    ("hybrid_mixed_local_and_external", HYBRID_MIXED, hybrid_local_and_external),
]
