"""Frame faults on a live KV link: two real engines with real ZMQ connectors, a
FaultLink between them dropping, delaying, duplicating or corrupting one kind
of frame, stalling, or vanishing mid-transfer.

Each case asserts what the user sees (exactly the colocated reference's
greedy tokens, within a bounded time) and that both pools end all free.
"""
from __future__ import annotations

import time

import pytest

from rel_pair import Pair, Side, prompt, reference

LEASE_S = 3.0  # P's lease: a lost completion message frees P's blocks within this
TIMEOUT_S = 2.0  # D's handshake / transfer / io timeouts

# fault -> what pdkv is expected to do ("transferred": the KV moved; "recomputed": D computed the prompt)
CASES = {
    "data.page_bytes:corrupt": "recomputed",  # checksum catches the flipped byte
    "data.pages:corrupt": "recomputed",
    "data.pages:dup": "recomputed",  # stream out of step: checksums fail, pages scrubbed
    "data.pages:drop": "recomputed",
    "data.page_bytes:drop": "recomputed",
    "data.pull:drop": "recomputed",  # no answer: transfer timeout
    "data.pull:dup": "transferred",  # first answer used; the stray second one breaks only that stream
    "data.pull:corrupt": "recomputed",
    "data.pull:delay:0.5": "transferred",  # late but within the timeout
    "data.pull:delay:3": "recomputed",  # later than the timeout
    # every stream's ATTACH / ATTACHED: with only the first one hit, whether the load rides the
    # broken stream depends on which stream's thread connected first
    "data.attach:drop:times=all": "recomputed",
    "data.attached:corrupt:times=all": "recomputed",
    "side.hello:drop": "recomputed",  # handshake timeout
    "side.challenge:corrupt": "recomputed",  # refused: proof or message broken
    "side.auth:corrupt": "recomputed",
    "side.welcome:drop": "recomputed",
    "side.welcome:dup": "transferred",  # a stray WELCOME is dropped as malformed
    "side.welcome:delay:0.5": "transferred",
    "side.done:drop": "transferred",  # lost completion: P frees at lease expiry
    "side.done:dup": "transferred",  # duplicate completion: ends the lease once
    "side.done:delay:1": "transferred",  # late completion
    "data.pull:stall:3": "recomputed",  # the peer freezes longer than the timeout
    "data.pull:kill": "recomputed",  # the producer vanishes mid-transfer
}


# Where P's lease may only end by expiry: P is killed or frozen, or D's DONE is what was lost.
# Everywhere else D tells P (DONE over the side channel, even after a data stream broke), so P
# frees the blocks at once instead of at lease expiry.
LEASE_EXPIRES = {"data.pull:kill", "data.pull:stall:3", "side.done:drop"}


@pytest.fixture(scope="module")
def tokens():
    toks = prompt(70)
    return toks, reference(toks, 8)


@pytest.mark.parametrize("fault", sorted(CASES))
def test_frame_fault_gives_the_right_answer_and_frees_every_block(fault, tokens, fault_record):
    toks, want = tokens
    p = Side("prefill-0", lease_s=LEASE_S, timeout_s=TIMEOUT_S)
    d = Side("decode-0", timeout_s=TIMEOUT_S)
    with Pair(p, d, faults=fault) as pair:
        out = pair.run("r1", toks, n=8, timeout_s=20)
        assert out.error is None and out.finish_reason == "length"
        assert out.tokens == want, f"{fault}: wrong tokens"
        recomputed = pair.d.scheduler.stats.num_load_failures_recomputed
        assert ("recomputed" if recomputed else "transferred") == CASES[fault], pair.d.connector.stats()
        assert pair.link.plan.fired(), f"{fault} never fired"
        t0 = time.monotonic()
        pair.assert_all_free(timeout_s=LEASE_S + 10)
        freed_s = time.monotonic() - t0
        # a second, clean request on the same engines still works (nothing poisoned)
        again = pair.run("r2", toks, n=8, timeout_s=20)
        assert again.tokens == want
        pair.assert_all_free(timeout_s=LEASE_S + 10)
        failures = pair.d.connector.stats()["failures"]
        leases = pair.p.connector.stats()["leases_ended"]
        if fault not in LEASE_EXPIRES:
            assert "expired" not in leases, f"{fault}: P's lease ran out instead of ending on D's DONE: {leases}"
    fault_record(fault=fault, where="KV link (FaultLink between P and D)",
                 user_saw=f"correct tokens in {out.seconds:.1f}s",
                 pdkv_did=(f"{CASES[fault]}; D failures {failures or '{}'}; P leases ended {leases}"),
                 pools=f"all free ({freed_s:.1f}s after the answer)")
