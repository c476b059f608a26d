"""The tensor-parallel mapping rule: which KV heads each rank holds, and who reads what from whom.

A worker with TP degree t splits the model's H KV heads over t ranks. Valid t: `t % H == 0` or
`H % t == 0` (and t divides the query heads). Then

- `n(t) = max(1, H // t)` heads per rank, `rho(t) = max(1, t // H)` replicas of each head;
- rank r holds heads `first(r) .. first(r) + n(t) - 1`, `first(r) = (r // rho(t)) * n(t)`, at
  local indices `0 .. n(t) - 1` (head h is local index `h - first(r)`);
- the owners of head h are ranks `(h // n(t)) * rho(t) + i` for `i < rho(t)`; the primary owner
  is `i = 0`.

Between a P worker of TP a and a D worker of TP b (`transfer_plan`), every D rank takes exactly
the heads it holds (D replicas all take the same head), each from the head's primary P owner:
a head replicated on several P ranks is read once, from one rank, and the others are never read.
Heads are contiguous on both sides, so the plan is one `HeadSlice` (a run of heads) per pair of
ranks that share any.
"""
from __future__ import annotations

import dataclasses

def check_tp(tp: int, num_heads: int, num_kv_heads: int, role: str) -> None:
    """Refuses a TP degree the model cannot be split by, naming both numbers and the role.

    TP must be positive, divide the query heads, and TP and the KV heads must divide one another.
    """
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{role} TP {tp}: {num_heads} query heads and {num_kv_heads} KV heads do not make a "
                         "model (the query heads must be a positive multiple of the KV heads)")
    _check_kv_split(tp, num_kv_heads, role, f" (TP in {valid_tps(num_heads, num_kv_heads)} fits this model)")
    if num_heads % tp:
        where = f"{role} TP {tp}"
        raise ValueError(f"{where} and {num_heads} query heads: TP must divide the query heads "
                         f"(TP in {valid_tps(num_heads, num_kv_heads)} fits this model)")


def _check_kv_split(tp: int, num_kv_heads: int, role: str, hint: str = "") -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"{role} TP {tp!r}: TP must be a positive integer")
    if num_kv_heads < 1:
        raise ValueError(f"{role} TP {tp} and {num_kv_heads} KV heads: a model has at least one KV head")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"{role} TP {tp} and {num_kv_heads} KV heads: TP and the KV heads must divide one another"
                         + hint)


def valid_tps(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every TP degree `check_tp` accepts for this model, ascending."""
    return [t for t in range(1, num_heads + 1)
            if num_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]


@dataclasses.dataclass(frozen=True)
class TPShape:
    """How one worker of TP degree `tp` splits `num_kv_heads` KV heads (and `num_heads` query heads).

    Guarantees: every head has `replicas` owners; every rank holds `heads_per_rank` consecutive
    heads; the ranks of one head's owners are consecutive, the primary first.
    """

    tp: int
    num_kv_heads: int
    num_heads: int | None = None  # the query heads; None when only the KV split matters
    role: str = "worker"

    def __post_init__(self) -> None:
        if self.num_heads is None:
            _check_kv_split(self.tp, self.num_kv_heads, self.role)
        else:
            check_tp(self.tp, self.num_heads, self.num_kv_heads, self.role)

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    @property
    def replicas(self) -> int:
        return max(1, self.tp // self.num_kv_heads)

    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} is not a rank of TP {self.tp}")
        return rank

    def _head(self, head: int) -> int:
        if not 0 <= head < self.num_kv_heads:
            raise ValueError(f"KV head {head} is not a head of a model with {self.num_kv_heads} KV heads")
        return head

    def first_head(self, rank: int) -> int:
        return (self._rank(rank) // self.replicas) * self.heads_per_rank

    def heads_of(self, rank: int) -> range:
        """The KV heads `rank` holds, in local order (local index i is head `first + i`)."""
        first = self.first_head(rank)
        return range(first, first + self.heads_per_rank)

    def local_index(self, rank: int, head: int) -> int:
        if head not in self.heads_of(rank):
            raise ValueError(f"rank {rank} of TP {self.tp} does not hold KV head {head}")
        return head - self.first_head(rank)

    def owners(self, head: int) -> range:
        """The ranks holding `head`, primary first."""
        first = (self._head(head) // self.heads_per_rank) * self.replicas
        return range(first, first + self.replicas)

    def primary_owner(self, head: int) -> int:
        return self.owners(head)[0]

    def is_primary(self, rank: int) -> bool:
        """Whether `rank` is the primary owner of the heads it holds (the rank a transfer reads)."""
        return self._rank(rank) % self.replicas == 0

    def query_heads_of(self, rank: int) -> range:
        """The query heads `rank` computes; each maps to a KV head the rank holds (GQA groups never split
        across KV shards, by the divisibility rule)."""
        if self.num_heads is None:
            raise ValueError("query heads unknown: build the TPShape with num_heads")
        per = self.num_heads // self.tp
        return range(self._rank(rank) * per, (rank + 1) * per)


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """One copy of a transfer: `count` consecutive KV heads, from P rank `p_rank`'s local heads
    `p_first ..` into D rank `d_rank`'s local heads `d_first ..`, canonical heads `head ..`."""

    d_rank: int
    d_first: int
    p_rank: int
    p_first: int
    count: int
    head: int


def transfer_plan(p_tp: int, d_tp: int, num_kv_heads: int) -> tuple[HeadSlice, ...]:
    """Every copy that moves a page from a P worker of TP `p_tp` to a D worker of TP `d_tp`.

    Guarantees: each D rank receives each of its heads exactly once; every slice reads a primary
    P owner only (replicated P heads are read once per D rank that holds them, never from a
    replica); slices are ordered by D rank, then head.
    """
    p = TPShape(p_tp, num_kv_heads, role="prefill")
    d = TPShape(d_tp, num_kv_heads, role="decode")
    plan = []
    for d_rank in range(d_tp):
        heads = d.heads_of(d_rank)
        head = heads.start
        while head < heads.stop:
            p_rank = p.primary_owner(head)
            run = min(heads.stop, p.heads_of(p_rank).stop) - head
            plan.append(HeadSlice(d_rank=d_rank, d_first=head - heads.start, p_rank=p_rank,
                                  p_first=p.local_index(p_rank, head), count=run, head=head))
            head += run
    return tuple(plan)


def slices_for(plan: tuple[HeadSlice, ...], d_rank: int) -> tuple[HeadSlice, ...]:
    """The part of `plan` one D rank carries out (each D rank pulls its own heads, in parallel)."""
    return tuple(s for s in plan if s.d_rank == d_rank)


def describe_plan(plan: tuple[HeadSlice, ...]) -> str:
    """The plan as one line per D rank, e.g. `D0 <- P0: 0-1->0-1, P1: 0-1->2-3` (docs and logs)."""
    def span(first: int, count: int) -> str:
        return f"{first}" if count == 1 else f"{first}-{first + count - 1}"

    lines: dict[int, list[str]] = {}
    for s in plan:
        lines.setdefault(s.d_rank, []).append(f"P{s.p_rank}: {span(s.p_first, s.count)}->{span(s.d_first, s.count)}")
    return "; ".join(f"D{d} <- " + ", ".join(parts) for d, parts in sorted(lines.items()))
