"""The connector seam's remote-block lifecycle on two real engines with real ZMQ connectors:
`release_remote` (D will not read: P frees at once) and `abort_lease` (P frees a prefill nobody
will pull), and a load failure cause that reaches D's output as the enum. Pools end all free."""
from __future__ import annotations

import dataclasses

from rel_pair import Pair, Side, prompt, reference

from connectors.metrics import FailureCause
from connectors.params import TransferParams
from pd.engine.outputs import FinishReason

TOKS = prompt(40)


def leases_ended(pair: Pair) -> dict:
    return pair.p.connector.stats()["leases_ended"]


def test_release_remote_frees_the_producers_blocks_at_once():
    with Pair(Side("prefill-0", lease_s=30.0), Side("decode-0")) as pair:
        params = pair.prefill("r1", TOKS)
        assert pair.p.stats()["num_held_for_transfer"] == 1
        # nothing to release: not a remote prefill, malformed address, or not the consumer side
        assert pair.d.connector.release_remote(TransferParams(do_remote_decode=True)) is False
        assert pair.d.connector.release_remote(dataclasses.replace(params, remote_port=0)) is False
        assert pair.p.connector.release_remote(params) is False
        assert pair.d.connector.release_remote(params) is True
        pair.step_until(lambda: pair.p.stats()["num_held_for_transfer"] == 0, timeout_s=5, engines=[pair.p])
        assert leases_ended(pair) == {"done": 1}  # ended by D's notice, far before the 30 s lease
        assert pair.d.connector.release_remote(params) is True  # a repeat is harmless: the lease ends once
        pair.assert_all_free(timeout_s=5)
        assert leases_ended(pair) == {"done": 1}


def test_abort_lease_frees_a_prefill_nobody_pulls_and_a_late_pull_gets_the_cause():
    want = reference(TOKS, 4)
    with Pair(Side("prefill-0", lease_s=30.0), Side("decode-0", policy="fail")) as pair:
        params = pair.prefill("r1", TOKS)
        assert pair.d.connector.abort_lease("r1") is False  # D keeps no leases
        assert pair.p.connector.abort_lease("r1") is True
        pair.step_until(lambda: pair.p.stats()["num_held_for_transfer"] == 0, timeout_s=5, engines=[pair.p])
        assert leases_ended(pair) == {"aborted": 1}
        # D tries to pull the aborted prefill: P refuses, and the cause reaches D's output as the enum
        outs = {"r1": pair.add_decode("r1", TOKS, params, 4)}
        pair.drive(outs, timeout_s=10)
        assert outs["r1"]["reason"] is FinishReason.ERROR and outs["r1"]["tokens"] == []
        assert outs["r1"]["cause"] is FailureCause.PULL_REFUSED and "pull_refused" in outs["r1"]["error"]
        again = pair.run("r2", TOKS, 4)
        assert again.tokens == want
        pair.assert_all_free(timeout_s=5)

