"""The planner's fits and decision, on given figures (pd.router.planner): what it learns from
samples, and where the decision flips. The end-to-end paths are in
tests/reliability/test_planner_paths.py and tests/e2e/test_planner_ray.py."""
from __future__ import annotations

import random
import time

import pytest

from pd.cluster.config import ConfigError, DeployConfig
from pd.router.planner.decision import Candidate, Decider, DecisionSettings, Kind, Reason
from pd.router.planner.figures import CostFigures, FitSettings
from pd.router.planner.fit import WindowFit

BLOCK_BYTES = 64 * 1024  # a KV block of a mid-sized model


def _prefill_s(n: int, speed: float = 1.0) -> float:
    """A worker's prefill curve: 2 ms fixed, 50 us/token, a small quadratic attention term."""
    return (0.002 + 5e-5 * n + 2e-9 * n * n) / speed


def _figures(gbps: float = 10.0, latency_s: float = 0.001, d_speed: float = 1.0) -> CostFigures:
    """Figures fed with samples of known curves: P and D prefill, the P->D link."""
    figures = CostFigures(FitSettings(window=64, min_samples=4, block_size=16))
    rng = random.Random(0)
    for _ in range(3):
        for n in (1, 64, 256, 1024, 2048, 4096, 8192):
            figures.observe_compute("p", n, _prefill_s(n), 0.0)
            figures.observe_compute("d", n, _prefill_s(n, d_speed), 0.0)
            num_blocks = -(-n // 16)
            num_bytes = num_blocks * BLOCK_BYTES
            figures.observe_pull("p", "d", num_blocks, num_bytes, latency_s + num_bytes / (gbps * 1e9)
                                 * (1 + rng.uniform(-0.01, 0.01)))
    for kind in ("remote", "local"):
        figures.observe_residual(kind, 0.0)
    return figures


def _decide(figures: CostFigures, n: int, d_running: int = 0, d_hit: int = 0, tpot_weight: float = 1.0):
    decider = Decider(figures, DecisionSettings(exploration_rate=0.0, tpot_weight=tpot_weight))
    return decider.plan(n, [Candidate("p")], [Candidate("d", d_hit, d_running)])


def test_quadratic_fit_recovers_the_curve_and_follows_a_change():
    fit = WindowFit(2, window=32, min_samples=4)
    assert fit.predict(100) is None
    rng = random.Random(1)
    for _ in range(4):
        for n in (16, 128, 512, 1024, 4096):
            fit.add(n, _prefill_s(n) * (1 + rng.uniform(-0.02, 0.02)))
    for n in (64, 2000, 8000):  # within 5% (2% noise), extrapolating to 8000 included
        assert fit.predict(n) == pytest.approx(_prefill_s(n), rel=0.05)
    for n in (16, 128, 512, 1024, 4096) * 7:  # the worker got 2x slower: the window forgets the old speed
        fit.add(n, 2 * _prefill_s(n))
    assert fit.predict(1024) == pytest.approx(2 * _prefill_s(1024), rel=0.02)


def test_fit_of_one_size_is_its_mean_and_never_negative():
    fit = WindowFit(2, min_samples=2)
    fit.add(1, 0.004)
    fit.add(1, 0.006)
    assert fit.predict(1) == pytest.approx(0.005) and fit.predict(5000) == pytest.approx(0.005)
    falling = WindowFit(1, min_samples=2)
    for x, y in ((1.0, 0.01), (2.0, 0.005), (3.0, 0.001)):
        falling.add(x, y)
    assert falling.predict(100.0) == pytest.approx(0.016 / 3)  # a falling line reads as flat


def test_link_figures_recover_bandwidth_and_latency():
    figures = _figures(gbps=2.5, latency_s=0.004)
    link = figures.link("p", "d").describe()
    assert link["gbps"] == pytest.approx(2.5, rel=0.02)
    assert link["latency_s"] == pytest.approx(0.004, rel=0.05)
    assert figures.bytes_per_block == BLOCK_BYTES
    assert figures.pull_bytes(17) == 2 * BLOCK_BYTES  # whole blocks move


def test_long_prompt_goes_remote_on_a_fast_link_when_d_is_decoding():
    plan = _decide(_figures(gbps=10.0), 8192, d_running=8)
    assert plan.chosen.kind is Kind.REMOTE and plan.reason is Reason.BEST
    local = next(o for o in plan.options if o.kind is Kind.LOCAL)
    assert local.tpot_cost_s == pytest.approx(8 * _prefill_s(8192), rel=0.05)  # what it would stall on D


def test_long_prompt_goes_remote_when_requests_arrive_during_its_prefill():
    """D idle, P 30% slower: alone, the long prompt prefills locally; once requests keep
    arriving while others are in flight, D's seconds on it would hold them up: it goes to P."""
    figures = _figures(gbps=10.0, d_speed=1.3)
    assert _decide(figures, 8192).chosen.kind is Kind.LOCAL
    start = time.monotonic() - 15.0  # the decision reads the rate now: arrivals over the last 15 s
    for i in range(10):  # one client, one request at a time: nobody arrives during a prefill
        figures.observe_arrival(0, now=start + i * 0.5)
    assert figures.overlap_rate() == 0.0
    assert _decide(figures, 8192).chosen.kind is Kind.LOCAL
    for i in range(40):  # then 4 requests a second arrive while others are in flight
        figures.observe_arrival(2, now=start + 5.0 + i * 0.25)
    assert figures.overlap_rate(now=start + 15.0) == pytest.approx(40 / 15.0)
    plan = _decide(figures, 8192)
    assert plan.chosen.kind is Kind.REMOTE
    local = next(o for o in plan.options if o.kind is Kind.LOCAL)
    remote = next(o for o in plan.options if o.kind is Kind.REMOTE)
    assert local.queue_cost_s > 0.3 * _prefill_s(8192, 1.3) and remote.queue_cost_s < 1e-3
    assert _decide(figures, 64).chosen.kind is Kind.LOCAL  # a short one still stays on D


def test_short_prompt_stays_local_when_p_is_queued(monkeypatch):
    # the wall clock held still: the queued prefills' predicted wait is theirs whole, however long a loaded
    # machine takes between sending them and deciding (the rule, not this machine's speed)
    import pd.router.planner.figures as figures_module

    frozen = time.monotonic()
    monkeypatch.setattr(figures_module, "time", type("FrozenClock", (), {"monotonic": staticmethod(lambda: frozen)}))
    figures = _figures(gbps=10.0)
    tickets = [figures.add_pending("p", 4096) for _ in range(8)]  # P has eight long prompts ahead
    plan = _decide(figures, 64, d_running=8)
    assert plan.chosen.kind is Kind.LOCAL
    remote = next(o for o in plan.options if o.kind is Kind.REMOTE)
    assert remote.predicted_ttft_s >= 8 * _prefill_s(4096) * (1 - 1e-9)  # their prefills, none of them begun
    for ticket in tickets:  # P idle again: the same prompt goes remote (D's decodes matter)
        figures.remove_pending("p", ticket)
    assert _decide(figures, 64, d_running=8).chosen.kind is Kind.REMOTE


def test_everything_stays_local_on_a_very_slow_link():
    figures = _figures(gbps=0.001, latency_s=0.05)  # 1 MB/s
    for n in (64, 512, 4096, 8192):
        assert _decide(figures, n, d_running=8).chosen.kind is Kind.LOCAL, n


def test_idle_d_of_the_same_speed_prefills_itself():
    # No decode to stall and no faster P: moving the KV only adds the pull.
    assert _decide(_figures(gbps=10.0), 4096, d_running=0).chosen.kind is Kind.LOCAL
    # A D three times slower at prefill (a decode-tuned box) sends long prompts to P, keeps short ones.
    slow_d = _figures(gbps=10.0, d_speed=1 / 3)
    assert _decide(slow_d, 8192).chosen.kind is Kind.REMOTE
    assert _decide(slow_d, 16).chosen.kind is Kind.LOCAL


def test_prefix_held_by_d_pulls_only_the_missing_part():
    figures = _figures(gbps=0.05, latency_s=0.001)  # 50 MB/s: the pull matters
    plan = _decide(figures, 4096, d_running=64, d_hit=4000)
    remote = next(o for o in plan.options if o.kind is Kind.REMOTE_PREFIX)
    full = _decide(figures, 4096, d_running=64, d_hit=0)
    remote_full = next(o for o in full.options if o.kind is Kind.REMOTE)
    pull_missing = figures.link("p", "d").pull.predict(figures.pull_bytes(96))
    pull_all = figures.link("p", "d").pull.predict(figures.pull_bytes(4096))
    assert remote_full.predicted_ttft_s - remote.predicted_ttft_s == pytest.approx(pull_all - pull_missing, rel=1e-6)
    local = next(o for o in plan.options if o.kind is Kind.LOCAL)
    assert local.num_prefill_tokens == 96  # and local prefill computes only the missing part too


def test_cold_start_tries_each_option_until_its_figures_exist():
    figures = CostFigures(FitSettings(min_samples=2))
    decider = Decider(figures, DecisionSettings(exploration_rate=0.0))
    kinds = {decider.plan(100, [Candidate("p")], [Candidate("d")]).chosen.kind for _ in range(4)}
    assert kinds == {Kind.REMOTE, Kind.LOCAL}
    assert decider.plan(100, [Candidate("p")], [Candidate("d")]).reason is Reason.COLD_START


def test_exploration_rate_is_respected():
    figures = _figures()
    decider = Decider(figures, DecisionSettings(exploration_rate=0.2, seed=3))
    plans = [decider.plan(4096, [Candidate("p")], [Candidate("d", 0, 8)]) for _ in range(2000)]
    explored = sum(p.reason is Reason.EXPLORE for p in plans) / len(plans)
    assert explored == pytest.approx(0.2, abs=0.03)
    assert all(p.chosen.kind is Kind.REMOTE for p in plans if p.reason is Reason.BEST)


def test_planner_section_validates_once_at_the_edge():
    config = DeployConfig.from_dict({"router": {"planner": {"mode": "planner", "exploration_rate": 0.1}}})
    assert config.router.planner.mode == "planner"
    assert DeployConfig.from_dict({}).router.planner.mode == "always_disaggregate"  # today's flow by default
    with pytest.raises(ConfigError, match="exploration_rate"):
        DeployConfig.from_dict({"router": {"planner": {"exploration_rate": 1.5}}})
    with pytest.raises(ConfigError, match="mode"):
        DeployConfig.from_dict({"router": {"planner": {"mode": "sometimes"}}})


def test_equal_figures_spread_over_the_less_busy_workers():
    figures = _figures()
    for wid in ("p2", "d2"):  # a second P and D with the same curves
        for n in (1, 64, 1024, 4096):
            figures.observe_compute(wid, n, _prefill_s(n), 0.0)
    for p in ("p", "p2"):
        for d in ("d", "d2"):
            for blocks in (1, 64, 256, 512):
                figures.observe_pull(p, d, blocks, blocks * BLOCK_BYTES, 0.001 + blocks * BLOCK_BYTES / 1e10)
    decider = Decider(figures, DecisionSettings(exploration_rate=0.0))
    plan = decider.plan(4096, [Candidate("p", 0, 3), Candidate("p2", 0, 1)], [Candidate("d", 0, 9),
                                                                             Candidate("d2", 0, 8)])
    assert plan.chosen.kind is Kind.REMOTE
    assert (plan.chosen.prefill.worker_id, plan.chosen.decode.worker_id) == ("p2", "d2")


def test_the_fit_separates_a_prompt_from_the_batch_it_shared():
    """Samples whose steps also computed other requests' tokens (z) cost more; the fit learns the
    prompt's own curve and the per-token cost of the batch, and a prediction for a worker with
    decodes running counts one of their tokens per step of the prompt."""
    per_batch_token = 4e-5
    figures = CostFigures(FitSettings(window=128, min_samples=4, max_num_batched_tokens=2048))
    rng = random.Random(2)
    for _ in range(4):
        for n in (1, 64, 256, 1024, 2048, 4096, 8192):
            for z in (0, 3, 40, 600):
                figures.observe_compute("w", n, (_prefill_s(n) + per_batch_token * z) * (1 + rng.uniform(-0.01, 0.01)),
                                        0.0, num_batched_tokens=z)
    costs = figures.worker("w")
    coefs = costs.prefill.coefficients()
    assert coefs is not None and coefs[3] == pytest.approx(per_batch_token, rel=0.1)
    assert costs.prefill_s(3000) == pytest.approx(_prefill_s(3000), rel=0.03)
    # 8 requests running, none waiting for its first token: 8 decode tokens in each of 4 steps of 8k.
    assert costs.prefill_s(8000, num_running=8) == pytest.approx(_prefill_s(8000) + per_batch_token * 32, rel=0.03)
    pending = costs.add_pending(500)  # one of the 8 is still prefilling: it is the wait, not the batch
    assert costs.prefill_s(8000, num_running=8) == pytest.approx(_prefill_s(8000) + per_batch_token * 28, rel=0.03)
    costs.remove_pending(pending)


def test_a_batch_that_seems_to_make_steps_cheaper_is_ignored():
    fit = WindowFit(2, min_samples=4)
    for n, z in ((100, 0), (100, 50), (400, 0), (400, 50), (1600, 0), (1600, 50)):
        fit.add(n, _prefill_s(n) - (1e-4 * z if n == 1600 else 0.0), z)  # noise that reads as "batch is free"
    coefs = fit.coefficients()
    assert coefs is not None and coefs[3] == 0.0
    assert fit.predict(1600, 1000) == fit.predict(1600)


def test_a_batch_that_follows_the_prompt_length_is_not_fitted_apart():
    """With a steady number of decodes, the batch is that number times the prompt's steps: the
    polynomial in n explains it, so its coefficient cannot be told from theirs and stays 0 (the
    curve then holds the cost at that batch)."""
    fit = WindowFit(2, min_samples=4)
    rng = random.Random(3)
    for _ in range(4):
        for n in range(100, 401, 25):
            z = 8 * -(-n // 64)
            fit.add(n, (0.002 + 2e-5 * n + 1e-6 * z) * (1 + rng.uniform(-0.01, 0.01)), z)
    coefs = fit.coefficients()
    assert coefs is not None and coefs[3] == 0.0
    assert fit.predict(300) == pytest.approx(0.002 + 2e-5 * 300 + 1e-6 * 40, rel=0.03)
    assert fit.covers(300, 10_000)  # without a z term, any batch reads the same curve
