"""The KV pool audit after a run: every worker of the deployment is asked, none is taken on trust.

`PoolAuditReport` guarantees: it is `clean` only when every worker the deployment has answered
its audit and every one of those pools is all free (a TP gang's audit is all free only when every
rank's is: `pd.worker.gang.Gang.audit`), so an audit that reached no worker, or fewer
than the deployment has, is never reported as clean; `lines()` says how many of how many were
audited and names each worker that leaked or did not answer (with why).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from pd.router.worker_client import WorkerCallError

logger = logging.getLogger(__name__)

AUDIT_PATH = "/internal/stats?audit=1"  # the stats answer with the pool audit, taken under the engine's step lock


@dataclasses.dataclass
class PoolAuditReport:
    """`expected`: every worker id of the deployment; `audits`: the audit of each worker that
    answered; `unreachable`: worker id -> why it gave no audit."""

    expected: list[str]
    audits: dict[str, dict] = dataclasses.field(default_factory=dict)
    unreachable: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def leaks(self) -> dict[str, object]:
        """Worker id -> what its audit found, for each pool audited that is not all free."""
        return {wid: a.get("detail") or a for wid, a in self.audits.items() if not a.get("all_free")}

    @property
    def complete(self) -> bool:
        """Every expected worker was audited."""
        return bool(self.expected) and all(wid in self.audits for wid in self.expected)

    @property
    def clean(self) -> bool:
        return self.complete and not self.leaks

    @property
    def num_ranks(self) -> int:
        """Ranks audited: a TP gang's audit carries one entry per rank (`ranks`), any other worker is one."""
        return sum(len(a.get("ranks") or [a]) for a in self.audits.values())

    def lines(self) -> list[str]:
        verdict = "all free" if self.clean else "NOT all free" if self.leaks else "NOT verified"
        ranks = f", {self.num_ranks} ranks" if any("ranks" in a for a in self.audits.values()) else ""
        out = [f"KV pools after the run: {verdict} ({len(self.audits)} of {len(self.expected)} workers audited{ranks})"]
        out += [f"  {wid}: {detail}" for wid, detail in self.leaks.items()]
        missing = [wid for wid in self.expected if wid not in self.audits]
        out += [f"  {wid}: unreachable: {self.unreachable.get(wid, 'no answer')}" for wid in missing]
        return out


async def audit_once(router) -> PoolAuditReport:
    """One audit of every worker `router` knows (a `pd.router.server.Router`), asked directly
    (not the router's last figures, which may be stale); the pool's stats take the answers."""
    loads = router.pool.all()
    timeout_s = router.recovery.stats_timeout_s
    answers = await asyncio.gather(*(router.client.get_json(w.endpoint.url, AUDIT_PATH, timeout_s=timeout_s)
                                     for w in loads), return_exceptions=True)
    report = PoolAuditReport(expected=[w.endpoint.worker_id for w in loads])
    for load, answer in zip(loads, answers, strict=True):
        worker_id = load.endpoint.worker_id
        if isinstance(answer, WorkerCallError):
            report.unreachable[worker_id] = str(answer)
        elif isinstance(answer, BaseException):
            raise answer
        elif not isinstance(answer.get("audit"), dict):
            report.unreachable[worker_id] = f"its stats carry no pool audit: {sorted(answer)[:8]}"
        else:
            report.audits[worker_id] = answer["audit"]
            router.pool.update_stats(worker_id, answer)
    return report


def settled(report: PoolAuditReport, in_rotation: set[str]) -> bool:
    """Nothing more to wait for: every pool audited is all free, and each worker that gave no audit
    is out of the router's rotation (the router gave up on it: asking again soon will not help)."""
    return not report.leaks and not (set(report.unreachable) & in_rotation)
