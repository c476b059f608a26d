"""UnitaryCoordinator.allocate_slots against the generic per-group sequence.

The unitary coordinator runs the generic allocation sequence for its one group
without the per-group plumbing (and skips sizing when the request's blocks
already hold every slot). Here the same random workload is replayed through a
manager using the unitary path and one forced onto the generic
KVCacheCoordinator.allocate_slots / free; every decision must match.
"""
import random

import pytest

from kvcache.audit import check_invariants
from kvcache.coordinator import KVCacheCoordinator, UnitaryCoordinator
from kvcache.testing import fa_spec, make_manager, make_request, swa_spec


def _generic(mgr):
    coord = mgr.coordinator
    assert isinstance(coord, UnitaryCoordinator)
    coord.allocate_slots = KVCacheCoordinator.allocate_slots.__get__(coord)
    coord.free = KVCacheCoordinator.free.__get__(coord)
    return mgr


def _ids(blocks):
    return None if blocks is None else blocks.get_block_ids()


@pytest.mark.parametrize("spec", [fa_spec(4), swa_spec(4, 9)], ids=["full", "sliding"])
@pytest.mark.parametrize("seed", range(4))
def test_unitary_matches_generic_sequence(spec, seed):
    rng = random.Random(seed)
    mgrs = [make_manager(60, spec, max_model_len=96, watermark=0.05),
            _generic(make_manager(60, spec, max_model_len=96, watermark=0.05))]
    prefix = [rng.randrange(50) for _ in range(24)]
    live: dict[str, list] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            rid = f"r{step}"
            prompt = (prefix[:rng.randrange(25)] if rng.random() < 0.6 else []) + \
                [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            reqs = [make_request(rid, prompt, block_size=4) for _ in mgrs]
            ext = rng.choice([0, 0, 0, 4, 7])
            kw = dict(num_lookahead_tokens=rng.choice([0, 0, 3]), delay_cache_blocks=rng.random() < 0.2,
                      full_sequence_must_fit=rng.random() < 0.3, reserved_blocks=rng.choice([0, 0, 2]),
                      num_external_computed_tokens=ext)
            got = []
            for mgr, req in zip(mgrs, reqs):
                blocks, num_hit = mgr.get_computed_blocks(req)
                if ext >= req.num_tokens - num_hit:
                    kw["num_external_computed_tokens"] = 0
                n_new = req.num_tokens - num_hit - kw["num_external_computed_tokens"]
                got.append((_ids(blocks), num_hit, _ids(mgr.allocate_slots(req, n_new, num_hit, blocks, **kw))))
                if got[-1][2] is not None:
                    req.num_computed_tokens = req.num_tokens
            assert got[0] == got[1], (step, got)
            if got[0][2] is not None:
                live[rid] = reqs
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            reqs = live[rid]
            tok, lookahead = rng.randrange(50), rng.choice([0, 0, 2])
            got = []
            for mgr, req in zip(mgrs, reqs):
                req.append_output_token_ids(tok)
                got.append(_ids(mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens,
                                                   num_lookahead_tokens=lookahead)))
                if got[-1] is not None:
                    req.num_computed_tokens = req.num_tokens
            assert got[0] == got[1], (step, got)
            if got[0] is None or reqs[0].num_tokens >= 90:
                for mgr, req in zip(mgrs, reqs):
                    mgr.free(req)
                del live[rid]
        else:
            rid = rng.choice(sorted(live))
            for mgr, req in zip(mgrs, live.pop(rid)):
                mgr.free(req)
        assert mgrs[0].num_free_blocks == mgrs[1].num_free_blocks, step
        for rid in live:
            assert mgrs[0].get_block_ids(rid) == mgrs[1].get_block_ids(rid), (step, rid)
    for mgr in mgrs:
        check_invariants(mgr)
