"""The hysteresis on re-snapshotting a worker over its index share (`pd.router.kv_feed.RefitGate`),
on given figures: poll by poll, the gate says whether to fetch a snapshot."""
from __future__ import annotations

import pytest

from pd.router.kv_feed import HOLD_POLLS, RefitGate, refit_limit

SHARE = 40


@pytest.mark.parametrize(("share", "limit"), [(1, 0), (8, 7), (40, 36), (250_000, 225_000)])
def test_refit_limit_is_a_tenth_below_the_share_and_at_least_one_block(share, limit):
    assert refit_limit(share) == limit


def test_the_first_snapshot_comes_as_soon_as_the_cache_fits():
    gate = RefitGate()
    assert not gate.over_share(SHARE + 1, SHARE)
    assert gate.over_share(SHARE, SHARE)


def test_a_worker_over_its_share_again_soon_after_waits_for_the_margin():
    gate = RefitGate()
    assert gate.over_share(SHARE, SHARE)  # snapshot; EXACT for two polls, then over the share again
    gate.exact()
    gate.exact()
    assert not gate.over_share(SHARE, SHARE)  # hovering: fitting is not enough
    assert not gate.over_share(refit_limit(SHARE) + 1, SHARE)
    assert gate.over_share(refit_limit(SHARE), SHARE)


def test_a_snapshot_that_did_not_fit_counts_as_hovering():
    gate = RefitGate()
    assert gate.over_share(SHARE, SHARE)  # the snapshot came back over the share: no EXACT poll
    assert not gate.over_share(SHARE - 1, SHARE)
    assert gate.over_share(refit_limit(SHARE) - 3, SHARE)


def test_a_snapshot_that_held_resets_the_hysteresis():
    gate = RefitGate()
    assert gate.over_share(SHARE, SHARE)
    gate.exact()
    assert not gate.over_share(SHARE, SHARE)  # hovering
    assert gate.over_share(refit_limit(SHARE), SHARE)
    for _ in range(HOLD_POLLS):  # that snapshot held: a later overflow is a new one
        gate.exact()
    assert gate.over_share(SHARE, SHARE)
