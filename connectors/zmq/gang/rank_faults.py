"""A fault plan's points on one rank of a TP gang (`connectors.links.fault_points.GANG_POINTS`).

A rank fires `gang.<kind>` and `gang.rank<r>.<kind>` (kind `slice` on a P rank about to answer a slice
pull, `load` on a D rank about to pull its part) on the plan it was given (duck-typed: anything with
`fire(point)` returning None or a rule with `action` and `seconds`, as `connectors.links.faults.FaultPlan`
does; the gang imports no rig). What an action does here:

- `drop`: the rank does not answer (its peer's wait ends by its deadline);
- `delay`, `stall`: the rank sleeps `seconds`, then goes on;
- `corrupt`: a P rank answers with one block's checksum wrong (the D rank refuses that block); a D
  rank reports its first destination block as not landed;
- `dup`: a P rank answers twice (the D rank drops the second answer: it answers nothing in flight);
- `kill`: the rank's process ends here (exit status 1), as a crashed rank would.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)


class RankFaults:
    """Rank `rank`'s view of a fault plan (None: no plan, every `fire` answers None at the cost of one test)."""

    def __init__(self, plan: Any, rank: int):
        self.plan = plan
        self.rank = rank

    def fire(self, kind: str) -> str | None:
        """The action due at this hit of `kind` on this rank (after sleeping a delay or stall), or None."""
        if self.plan is None:
            return None
        mine = self.plan.fire(f"gang.rank{self.rank}.{kind}")  # (both hit: each rule counts its own point)
        rule = self.plan.fire(f"gang.{kind}") if mine is None else mine
        if rule is None:
            return None
        action = rule.action.value
        logger.warning("fault injection: gang rank %d, %s: %s", self.rank, kind, action)
        if action in ("delay", "stall"):
            time.sleep(rule.seconds)
        elif action == "kill":
            logging.shutdown()
            os._exit(1)
        return action
