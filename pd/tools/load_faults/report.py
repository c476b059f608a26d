"""What a `pd.tools.load_faults` run found: its figures, the verdict and the printed report.

A run passes when every request was answered (200, or 429/503 with `Retry-After`), none hung,
every 200 is a complete stream (no error event, `[DONE]`) token-identical to the undisturbed
reference, the RSS of router and workers grew by less than the allowed bound, and every
surviving KV pool ended all free; besides, every poisoned-sampling request ended answered 200
with all its tokens, no worker but the killed one left the router's rotation, and the KV event
stream never held more subscribers than its cap.
"""
from __future__ import annotations

import collections
import dataclasses

ANSWERED = (200, 429, 503)


@dataclasses.dataclass
class RSSTrack:
    """One process's resident memory (MiB): before the load, the highest seen, and after it."""

    pid: int
    before_mb: float = 0.0
    peak_mb: float = 0.0
    after_mb: float | None = None  # None: the process was gone (the killed worker)

    def observe(self, mb: float) -> None:
        self.peak_mb = max(self.peak_mb, mb)

    @property
    def growth_mb(self) -> float:
        return max(self.peak_mb, self.after_mb or 0.0) - self.before_mb


@dataclasses.dataclass
class LoadFaultsReport:
    num_clients: int
    duration_s: float
    rows: list[dict]
    reference: list[list[int]]
    rss: dict[str, RSSTrack]
    max_rss_growth_mb: float
    victim: str = ""
    killed_at_s: float | None = None
    victim_in_flight_at_kill: int = 0
    num_migrations: int = 0
    num_redispatches: int = 0
    junk: dict = dataclasses.field(default_factory=dict)
    refuse_sent: int = 0
    router_idle: dict = dataclasses.field(default_factory=dict)  # the holder's counts, "router": the guard's
    refused_counted: dict = dataclasses.field(default_factory=dict)
    metrics_lines: tuple[int, int] = (0, 0)  # router /metrics before, after
    transfer: dict = dataclasses.field(default_factory=dict)  # the surviving decode workers' loads
    pools: dict = dataclasses.field(default_factory=dict)  # worker id -> audit, after the run
    # the driver's never-reading subscribers; "worker": the publisher's counts (before, at the kill, after)
    event_subscribers: dict = dataclasses.field(default_factory=dict)
    poisoned: list[dict] = dataclasses.field(default_factory=list)  # a row per poisoned-sampling request
    left_rotation: dict = dataclasses.field(default_factory=dict)  # worker id -> s into the load first seen out
    seconds: float = 0.0

    # -- verdict ----------------------------------------------------------
    def statuses(self) -> dict[str, int]:
        counts = collections.Counter(str(r["status"]) if r["status"] is not None else
                                     ("hung" if r["hung"] else "no answer") for r in self.rows)
        return dict(sorted(counts.items()))

    def _is_correct(self, row: dict) -> bool:
        return (row["status"] == 200 and row["done"] and not row["errors"]
                and row["token_ids"] == self.reference[row["prompt"]])

    def num_identical(self) -> int:
        return sum(self._is_correct(r) for r in self.rows)

    def failures(self) -> list[str]:
        """Every way the run broke the contract, in words; empty when it passed."""
        out = []
        unanswered = [r for r in self.rows if r["status"] not in ANSWERED]
        if unanswered:
            out.append(f"{len(unanswered)} requests not answered with 200/429/503, e.g. {_brief(unanswered[0])}")
        no_retry = [r for r in self.rows if r["status"] in (429, 503) and not r["retry_after"]]
        if no_retry:
            out.append(f"{len(no_retry)} 429/503 answers without Retry-After, e.g. {_brief(no_retry[0])}")
        wrong = [r for r in self.rows if r["status"] == 200 and not self._is_correct(r)]
        if wrong:
            out.append(f"{len(wrong)} answers with status 200 are incomplete, errored or differ from the "
                       f"reference, e.g. {_brief(wrong[0])} (want {len(self.reference[wrong[0]['prompt']])} tokens)")
        if not any(r["status"] == 200 for r in self.rows):
            out.append("no request was served")
        for name, track in self.rss.items():
            if track.growth_mb > self.max_rss_growth_mb:
                out.append(f"RSS of {name} grew by {track.growth_mb:.0f} MiB (bound {self.max_rss_growth_mb:.0f})")
        bad_poison = [p for p in self.poisoned if not _poison_served(p)]
        if bad_poison:
            p = bad_poison[0]
            out.append(f"{len(bad_poison)} of {len(self.poisoned)} poisoned-sampling requests not answered 200 with "
                       f"all their tokens, e.g. {p['values']}: attempts {p['attempts']}, {p['num_tokens']} tokens, "
                       f"error {p['error']}")
        strays = sorted(set(self.left_rotation) - {self.victim})
        if strays:
            out.append(f"workers left the router's rotation besides {self.victim}: {strays}")
        worker = self.event_subscribers.get("worker", {})
        if worker and worker.get("peak_subscribers", 0) > worker.get("max_subscribers", 0):
            out.append(f"the KV event stream held {worker['peak_subscribers']} subscribers, past its cap "
                       f"of {worker['max_subscribers']}")
        leaks = {wid: a.get("detail") or a for wid, a in self.pools.items() if not a.get("all_free")}
        if leaks or not self.pools:
            out.append(f"KV pools not all free after the run: {leaks or 'no pool audited'}")
        return out

    # -- output -----------------------------------------------------------
    def to_dict(self) -> dict:
        return {"num_clients": self.num_clients, "duration_s": self.duration_s, "seconds": round(self.seconds, 1),
                "requests": len(self.rows), "statuses": self.statuses(), "identical": self.num_identical(),
                "retry_after_missing": sum(1 for r in self.rows if r["status"] in (429, 503) and not r["retry_after"]),
                "rss_mb": {k: dataclasses.asdict(v) for k, v in self.rss.items()},
                "victim": self.victim, "killed_at_s": self.killed_at_s,
                "victim_in_flight_at_kill": self.victim_in_flight_at_kill, "migrations": self.num_migrations,
                "redispatches": self.num_redispatches, "junk": self.junk, "refuse_sent": self.refuse_sent,
                "router_idle": self.router_idle,
                "refused_counted": self.refused_counted, "metrics_lines": list(self.metrics_lines),
                "transfer": self.transfer, "event_subscribers": self.event_subscribers,
                "poisoned": self.poisoned_figures(), "left_rotation": self.left_rotation,
                "pools_all_free": {w: bool(a.get("all_free")) for w, a in self.pools.items()},
                "failures": self.failures()}

    def format(self) -> str:
        served = [r for r in self.rows if r["status"] == 200]
        slowest = max((r["seconds"] for r in self.rows), default=0.0)
        lines = [
            f"load + faults: {self.num_clients} clients for {self.duration_s:.0f} s ({self.seconds:.1f} s in all)",
            f"  requests: {len(self.rows)}, by status {self.statuses()}; slowest answer {slowest:.1f} s",
            f"  status 200: {len(served)}, token-identical to the undisturbed reference: {self.num_identical()}",
            f"  {self.victim} SIGKILLed at {self.killed_at_s:.1f} s with {self.victim_in_flight_at_kill} requests "
            f"in flight; {self.num_migrations} streams migrated, {self.num_redispatches} calls re-dispatched"
            if self.killed_at_s is not None else "  no worker killed",
            f"  junk on P's data port: {self.junk.get('held', 0)} held (never fewer than "
            f"{self.junk.get('min_open', 0)} open), {self.junk.get('opened', 0)} opened, "
            f"{self.junk.get('closed_by_peer', 0)} closed by P",
            _router_idle_line(self.router_idle),
            f"  REFUSE frames sent: {self.refuse_sent}; P counted {self.refused_counted}; router /metrics "
            f"{self.metrics_lines[0]} -> {self.metrics_lines[1]} lines",
            _subscribers_line(self.event_subscribers),
            self._poisoned_line(),
            f"  KV loads on the surviving decode workers: {self.transfer}",
            "  RSS (MiB)       before    peak   after",
        ]
        for name, t in self.rss.items():
            after = f"{t.after_mb:7.0f}" if t.after_mb is not None else "   gone"
            lines.append(f"    {name:<12} {t.before_mb:7.0f} {t.peak_mb:7.0f} {after}")
        lines.append("  KV pools after: " + ("all free" if all(a.get("all_free") for a in self.pools.values())
                                               and self.pools else "NOT all free")
                     + f" ({', '.join(sorted(self.pools))})")
        problems = self.failures()
        lines.append("PASS" if not problems else "FAIL:\n" + "\n".join(f"  - {p}" for p in problems))
        return "\n".join(lines)


    def poisoned_figures(self) -> dict:
        final = collections.Counter(str(p["status"]) for p in self.poisoned)
        attempts = collections.Counter(str(s) for p in self.poisoned for s in p["attempts"])
        return {"sent": len(self.poisoned), "final_statuses": dict(sorted(final.items())),
                "attempt_statuses": dict(sorted(attempts.items())),
                "with_all_tokens": sum(1 for p in self.poisoned if _poison_served(p)),
                "kinds": len({repr(sorted(p["values"].items())) for p in self.poisoned})}

    def _poisoned_line(self) -> str:
        if not self.poisoned:
            return "  no poisoned-sampling requests"
        f = self.poisoned_figures()
        out = sorted(set(self.left_rotation) - {self.victim})
        return (f"  poisoned sampling: {f['sent']} requests ({f['kinds']} kinds of values), final statuses "
                f"{f['final_statuses']} (attempts {f['attempt_statuses']}), {f['with_all_tokens']} with all their "
                f"tokens; workers out of the rotation: {sorted(self.left_rotation) or 'none'}"
                + (f" (besides {self.victim}: {out})" if out else f" (only the killed {self.victim})"
                   if self.victim in self.left_rotation else ""))


def _poison_served(row: dict) -> bool:
    return row["status"] == 200 and not row["error"] and row["num_tokens"] == row["want_tokens"]


def _subscribers_line(subs: dict) -> str:
    if not subs.get("opened"):
        return "  no event subscribers"
    worker = subs.get("worker", {})
    return (f"  never-reading KV event subscribers on {worker.get('worker_id', '?')}: {subs['opened']} "
            f"({subs['with_secret']} with the secret, {subs['plain']} plain), {subs['connected']} connected, "
            f"{subs['admitted']} ever admitted ({subs['admitted_plain']} plain); worker counted "
            f"{worker.get('at_kill_subscribers', '?')} subscribed at the kill (router included, peak "
            f"{worker.get('peak_subscribers', '?')}, cap {worker.get('max_subscribers', '?')}), "
            f"{worker.get('refused', '?')} refused; client handshakes failed {subs['handshakes_failed']}")


def _brief(row: dict) -> str:
    return (f"status {row['status']}, {len(row['token_ids'])} tokens, done={row['done']}, hung={row['hung']}, "
            f"errors={row['errors'][:1]}, exception={row['exception']}")


def _router_idle_line(held: dict) -> str:
    if not held.get("held"):
        return "  no idle connections held on the router"
    guard = held.get("router", {})
    return (f"  idle connections on the router: {held['held']} held ({held.get('max_open', 0)} open at most, "
            f"{held.get('opened', 0)} opened, {held.get('closed_by_peer', 0)} closed by the router: "
            f"{guard.get('evicted', 0)} past its cap of {guard.get('max_connections', '?')}, "
            f"{guard.get('idle_closed', 0)} at its keep-alive timeout)")
