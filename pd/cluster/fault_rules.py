"""Which fault-injection rules a worker accepts: point names and actions, checked without side effects.

Points (`WORKER_POINTS`, used with `connectors.links.faults` rule syntax):
- `worker.request_received`: a generate request was accepted, before the engine sees it;
- `worker.prefill_done`: a prefill worker has its answer (kv_transfer_params) but has not sent it;
- `worker.decode_token`: a worker is about to stream a token event (`after=N` picks the N+1-th);
- `engine.step` (`kill` only): the engine step computing this request raises, as a bad input would
  (hit once per request a worker takes; the request fails, the engine goes on);
- `engine.loop` (`kill` only): the engine's step loop dies while computing this request, as a bug
  in the loop would (the worker reports itself unhealthy; under Ray the actor restarts);
- `engine.device_oom`, `engine.device_error` (`kill` only): the step computing this request raises
  what torch raises for CUDA out of memory (`torch.OutOfMemoryError`) or an illegal memory access
  (`torch.AcceleratorError`): every request of that step fails with a device-fault error, and the
  worker reports itself unhealthy and restarts its process, as on a GPU (`pd.engine.step_isolation`);
- `engine.perturb_kv` (`corrupt` only): a prefill worker sends this request's KV well-formed but wrong
  (its first layer's K shifted after the forward, before the connector seals its checksums), for the
  KV audit to catch (`pd.engine.runner.kv_audit`, `transfer.kv_audit_rate`);
plus every `connectors.links.fault_points.LINK_POINTS` point (fired by a FaultLink in
front of the producer a decode worker pulls from) and every `GANG_POINTS` point (fired by a TP
gang's ranks as they move their own KV heads: `connectors/zmq/gang/rank_faults.py`).

This is the pure half of the fault kit: the deploy config validates plans
with it, and `pd.worker.faults` applies them (it alone imports the link and zmq).
"""
from __future__ import annotations

from connectors.links.fault_points import GANG_POINTS, LINK_POINTS
from connectors.links.faults import FaultAction, FaultPlan, FaultSpecError

WORKER_POINTS = frozenset({"worker.request_received", "worker.prefill_done", "worker.decode_token"})
ENGINE_POINTS = frozenset({"engine.step", "engine.loop", "engine.device_oom", "engine.device_error",
                           "engine.perturb_kv"})
CORRUPT_POINTS = frozenset({"engine.perturb_kv"})  # (engine points that do not fail: they corrupt)
ALL_POINTS = WORKER_POINTS | ENGINE_POINTS | LINK_POINTS | GANG_POINTS
WORKER_ACTIONS = (FaultAction.KILL, FaultAction.DELAY, FaultAction.STALL)


def parse_worker_faults(spec: str | None) -> FaultPlan | None:
    """Parses a worker's plan (the config value, else `PDKV_FAULTS`); raises FaultSpecError."""
    plan = FaultPlan.parse(spec, ALL_POINTS) if spec else FaultPlan.from_env(ALL_POINTS)
    if plan is not None:
        for rule in plan.rules:
            if rule.point in WORKER_POINTS and rule.action not in WORKER_ACTIONS:
                raise FaultSpecError(f"fault rule {rule}: worker points take {[a.value for a in WORKER_ACTIONS]}")
            if rule.point in CORRUPT_POINTS and rule.action is not FaultAction.CORRUPT:
                raise FaultSpecError(f"fault rule {rule}: {rule.point} takes corrupt only")
            if rule.point in ENGINE_POINTS - CORRUPT_POINTS and rule.action is not FaultAction.KILL:
                raise FaultSpecError(f"fault rule {rule}: engine points take kill only")
    return plan
