"""The fault-plan syntax: strict parsing with clear errors, deterministic firing."""
from __future__ import annotations

import pytest

from connectors.links.fault_link import LINK_POINTS
from connectors.links.faults import FaultAction, FaultPlan, FaultSpecError
from pd.worker.faults import parse_worker_faults


def test_plan_parses_and_fires_deterministically():
    plan = FaultPlan.parse("data.pull:drop:after=1:times=2, side.done:delay:0.5", LINK_POINTS)
    assert [r.action for r in plan.rules] == [FaultAction.DROP, FaultAction.DELAY]
    assert plan.rules[1].seconds == 0.5 and plan.rules[1].times == 1
    fired = [plan.fire("data.pull") is not None for _ in range(5)]
    assert fired == [False, True, True, False, False]
    assert plan.fire("side.done").seconds == 0.5 and plan.fire("side.done") is None
    assert plan.fired() == [("data.pull", "drop"), ("data.pull", "drop"), ("side.done", "delay")]
    every = FaultPlan.parse("side.heartbeat:drop:times=all", LINK_POINTS)
    assert all(every.fire("side.heartbeat") for _ in range(100))


@pytest.mark.parametrize("spec, message", [
    ("data.pul:drop", "unknown point"),
    ("data.pull:explode", "unknown action"),
    ("data.pull", "expected point:action"),
    ("data.pull:delay", "needs seconds"),
    ("data.pull:drop:1", "takes no seconds"),
    ("data.pull:delay:-1", "bad value"),
    ("data.pull:drop:after=x", "bad value"),
    ("data.pull:drop:times=0", "times >= 1"),
    ("data.pull:drop:every=2", "unknown option"),
    ("data.pull:drop:after=1:after=2", "given twice"),
    ("data.pull:drop,,side.done:drop", "expected point:action"),
])
def test_bad_plans_are_refused_with_the_rule_named(spec, message):
    with pytest.raises(FaultSpecError, match=message):
        FaultPlan.parse(spec, LINK_POINTS)


def test_no_plan_costs_nothing_and_env_is_read(monkeypatch):
    assert FaultPlan.parse("", LINK_POINTS) is None and FaultPlan.parse(None, LINK_POINTS) is None
    monkeypatch.setenv("PDKV_FAULTS", "worker.prefill_done:kill")
    assert parse_worker_faults("").rules[0].action is FaultAction.KILL
    monkeypatch.delenv("PDKV_FAULTS")
    assert parse_worker_faults("") is None
    with pytest.raises(FaultSpecError, match="worker points take"):
        parse_worker_faults("worker.prefill_done:corrupt")
