"""Deterministic fault injection: a plan of rules, parsed strictly, matched by named points.

A plan is a comma-separated list of rules (from a config value or the
`PDKV_FAULTS` environment variable)::

    point:action[:arg][:after=N][:times=M|all]

- `point` names where the fault fires, e.g. `data.pages` (the PAGES header of
  a pull answer on a KV data stream) or `worker.prefill_done` (a prefill
  worker about to answer). Each user of a plan declares the points it knows;
  a rule naming any other point is an error, so a typo never silently
  disables a test;
- `action` is one of `FaultAction` (drop, delay, dup, corrupt, stall, kill);
- `arg` is a non-negative number: seconds for delay and stall, unused (and
  refused) for the others;
- `after=N` skips the first N hits of the point; `times=M` fires M times
  (default 1), `times=all` on every hit after the skipped ones.

Guarantees: matching is deterministic (hit counters per rule, under a lock,
no randomness); parsing either returns a valid plan or raises `FaultSpecError`
naming the rule and the problem; an empty spec gives `None`, and components
hold `None` when no plan is set, so an unfaulted system pays one `is None`
test per injection point and nothing else.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import threading

ENV_VAR = "PDKV_FAULTS"


class FaultSpecError(ValueError):
    """A fault plan that does not parse; the message names the rule."""


class FaultAction(str, enum.Enum):
    DROP = "drop"  # the frame never arrives
    DELAY = "delay"  # the frame arrives `arg` seconds late (order kept)
    DUP = "dup"  # the frame arrives twice
    CORRUPT = "corrupt"  # one byte of the frame is flipped
    STALL = "stall"  # the peer stops moving anything for `arg` seconds
    KILL = "kill"  # the process (or the link, where no process is ours to kill) dies here


_TAKES_SECONDS = (FaultAction.DELAY, FaultAction.STALL)


@dataclasses.dataclass(frozen=True)
class FaultRule:
    """One rule; fires on hits number after+1 .. after+times of its point (times=None: all)."""

    point: str
    action: FaultAction
    seconds: float = 0.0
    after: int = 0
    times: int | None = 1

    def __post_init__(self) -> None:
        if self.after < 0 or (self.times is not None and self.times < 1) or self.seconds < 0:
            raise FaultSpecError(f"{self}: after must be >= 0, times >= 1, seconds >= 0")

    def __str__(self) -> str:
        arg = f":{self.seconds:g}" if self.action in _TAKES_SECONDS else ""
        times = "all" if self.times is None else str(self.times)
        return f"{self.point}:{self.action.value}{arg}:after={self.after}:times={times}"


class FaultPlan:
    """A parsed plan; `fire(point)` says which rule (if any) fires on this hit of `point`.

    Thread-safe; one hit of a point advances the counter of every rule naming
    it, and the first rule due wins.
    """

    def __init__(self, rules: tuple[FaultRule, ...]):
        if not rules:
            raise FaultSpecError("a fault plan needs at least one rule")
        self.rules = rules
        self._hits = [0] * len(rules)
        self._fired: list[tuple[str, str]] = []  # (point, action) in firing order
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str | None, known_points: frozenset[str] | set[str]) -> FaultPlan | None:
        """Parses `spec` (None or blank: no plan). Points must be in `known_points`."""
        if spec is None or not spec.strip():
            return None
        return cls(tuple(_parse_rule(text.strip(), known_points) for text in spec.split(",")))

    @classmethod
    def from_env(cls, known_points: frozenset[str] | set[str]) -> FaultPlan | None:
        return cls.parse(os.environ.get(ENV_VAR), known_points)

    def points(self) -> set[str]:
        return {r.point for r in self.rules}

    def fire(self, point: str) -> FaultRule | None:
        hit = None
        with self._lock:
            for i, rule in enumerate(self.rules):
                if rule.point != point:
                    continue
                self._hits[i] += 1
                n = self._hits[i] - rule.after
                due = n >= 1 and (rule.times is None or n <= rule.times)
                if due and hit is None:
                    hit = rule
            if hit is not None:
                self._fired.append((hit.point, hit.action.value))
        return hit

    def fired(self) -> list[tuple[str, str]]:
        """(point, action) of every fault that fired so far, in order."""
        with self._lock:
            return list(self._fired)

    def __str__(self) -> str:
        return ",".join(str(r) for r in self.rules)


def _parse_rule(text: str, known_points) -> FaultRule:
    parts = text.split(":")
    if len(parts) < 2 or not all(parts):
        raise FaultSpecError(f"fault rule {text!r}: expected point:action[:seconds][:after=N][:times=M|all]")
    point, action_name, rest = parts[0], parts[1], parts[2:]
    if point not in known_points:
        raise FaultSpecError(f"fault rule {text!r}: unknown point {point!r}; known: {sorted(known_points)}")
    try:
        action = FaultAction(action_name)
    except ValueError:
        raise FaultSpecError(f"fault rule {text!r}: unknown action {action_name!r}; "
                             f"known: {[a.value for a in FaultAction]}") from None
    seconds, after = 0.0, 0
    times: int | None = 1
    seen: set[str] = set()
    for item in rest:
        key, eq, value = item.partition("=")
        if not eq:
            key, value = "seconds", item
        if key in seen:
            raise FaultSpecError(f"fault rule {text!r}: {key} given twice")
        seen.add(key)
        if key == "seconds" and action not in _TAKES_SECONDS:
            raise FaultSpecError(f"fault rule {text!r}: {action.value} takes no seconds argument")
        if key not in ("seconds", "after", "times"):
            raise FaultSpecError(f"fault rule {text!r}: unknown option {key!r} (after, times)")
        try:
            if key == "seconds":
                seconds = float(value)
                if not 0 <= seconds < 3600:
                    raise ValueError
            elif key == "after":
                after = int(value)
            elif key == "times":
                times = None if value == "all" else int(value)
        except ValueError:
            raise FaultSpecError(f"fault rule {text!r}: bad value {value!r} for {key}") from None
    if action in _TAKES_SECONDS and "seconds" not in seen:
        raise FaultSpecError(f"fault rule {text!r}: {action.value} needs seconds, e.g. {point}:{action.value}:0.5")
    return FaultRule(point, action, seconds, after, times)
