"""The workloads of `pd.tools.route_bench`, as trees of prompts.

A workload is a list of `Node` trees: a node's prompt is sent once its parent has
answered, and a node's children are sent together (siblings run at once). Both
workloads are pure functions of their parameters and seed.

- `Workload` (`--workload sessions`, the default): `tenants` each have a long system
  prompt; `sessions` conversations per tenant grow turn by turn (user text + a fixed
  assistant reply appended): chains, one node per turn.
- `BranchingWorkload` (`--workload branching`): multi-tenant traffic shaped like trees.
  Every tenant's system prompt starts with one short preamble shared by all tenants
  and is 170-640 tokens long (BOS included), never a multiple of the block size, so
  the last block of a system prompt is never a full shared block. Each tenant has
  `roots` conversations; a child is its parent's prompt plus the parent's reply plus a
  new user turn, and a node branches (two children: the same reply, two different next
  turns) with probability `branch_rate`. One-off prompts (a tenant's system prompt and
  one question, or free text with no preamble at all) and client aborts (a node whose
  client goes away, after the first streamed chunk or right after the answer's headers;
  always a leaf) are mixed in. With `--kv-memory-mb 12` (192 blocks per worker) every
  worker evicts.
- `BurstWorkload` (`--workload bursts`): the branching trees arriving in bursts. Tenants
  are unequally popular (tenant t drawn with weight 1 / (t + 1)); each burst is
  `burst_size` new conversation trees of one tenant, all sent at the same instant (a
  team starting its day, a batch job), plus, with probability `one_off_rate`, a free
  one-off; bursts start at Poisson times, `rate` a second. A burst of one tenant is what
  piles up on the worker that holds its system prompt. Always open loop.
"""
from __future__ import annotations

import dataclasses
import enum
import random
import string
from collections.abc import Iterator

BOS = "\x00"  # stands for the tokenizer's BOS when prefixes are compared as strings
PREAMBLE = "You are a support assistant of the Example Corp platform. Be brief, be exact. "


class Abort(str, enum.Enum):
    NONE = "none"
    FIRST_CHUNK = "first_chunk"  # the client reads one streamed chunk, then goes away
    HEADERS = "headers"  # the client goes away as soon as the answer's headers arrive


@dataclasses.dataclass(frozen=True)
class Node:
    prompt: str
    reply: str = ""  # the assistant text a child appends after this prompt
    abort: Abort = Abort.NONE
    tenant: int | None = None  # None: a free one-off, with no preamble
    children: tuple[Node, ...] = ()

    def walk(self) -> Iterator[Node]:
        """This node and its descendants, parents first."""
        yield self
        for child in self.children:
            yield from child.walk()


def _check_load(concurrency: int, rate: float) -> None:
    if concurrency < 1 or not 0 <= rate <= 1000:
        raise ValueError(f"concurrency must be >= 1 and rate within [0, 1000], got {concurrency} and {rate}")


def arrival_offsets(num_trees: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each tree's root is sent under an open-loop load of `rate`
    trees per second: a Poisson process (exponential gaps), the same for every policy given the seed."""
    rng = random.Random(f"arrivals-{seed}")
    out, t = [], 0.0
    for _ in range(num_trees):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _words(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase + "     ", k=n))


@dataclasses.dataclass(frozen=True)
class Workload:
    tenants: int = 12
    sessions: int = 2
    turns: int = 4
    system_tokens: int = 512
    user_tokens: int = 48
    max_tokens: int = 8
    concurrency: int = 8
    rate: float = 0.0  # conversations started per second, Poisson (open loop); 0: `concurrency` at once
    seed: int = 0

    def __post_init__(self) -> None:
        _check_load(self.concurrency, self.rate)

    def conversations(self) -> list[list[str]]:
        """Each conversation's prompts, turn by turn."""
        rng = random.Random(self.seed)
        systems = [f"system of tenant {t}: " + _words(rng, self.system_tokens) for t in range(self.tenants)]
        out = []
        for t in range(self.tenants):
            for s in range(self.sessions):
                history, prompts = systems[t], []
                for turn in range(self.turns):
                    history += f"\nuser {s}.{turn}: " + _words(rng, self.user_tokens) + "\nassistant:"
                    prompts.append(history)
                    history += " noted, here is my answer."
                out.append(prompts)
        rng.shuffle(out)
        return out

    def trees(self) -> list[Node]:
        """The conversations as chains (each turn the only child of the one before)."""
        out = []
        for prompts in self.conversations():
            node = None
            for prompt in reversed(prompts):
                node = Node(prompt, children=() if node is None else (node,))
            assert node is not None  # (turns >= 1)
            out.append(node)
        return out


@dataclasses.dataclass(frozen=True)
class BranchingWorkload:
    tenants: int = 8
    roots: int = 2  # conversations (trees) per tenant
    depth: int = 4  # turns along a branch, root included
    branch_rate: float = 0.35
    one_offs: int = 16
    abort_rate: float = 0.08
    block_size: int = 16
    min_system_tokens: int = 170
    max_system_tokens: int = 640
    max_tokens: int = 8
    abort_max_tokens: int = 64  # so that a FIRST_CHUNK abort lands mid-decode
    concurrency: int = 8
    rate: float = 0.0  # trees started per second, Poisson (open loop); 0: `concurrency` at once (closed loop)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.branch_rate <= 1 or not 0 <= self.abort_rate <= 1:
            raise ValueError("branch_rate and abort_rate must be within [0, 1]")
        if self.min_system_tokens <= len(PREAMBLE) + 1 or self.max_system_tokens < self.min_system_tokens:
            raise ValueError(f"system prompt lengths must be within ({len(PREAMBLE) + 1}, max_system_tokens]")
        if self.depth < 1 or self.tenants < 1:
            raise ValueError("depth and tenants must be >= 1")
        _check_load(self.concurrency, self.rate)

    def system_prompts(self, rng: random.Random) -> list[str]:
        """Per tenant: the preamble, then tenant text; BOS + prompt is never a whole number of blocks."""
        out = []
        for t in range(self.tenants):
            num_tokens = rng.randint(self.min_system_tokens, self.max_system_tokens)
            if num_tokens % self.block_size == 0:
                num_tokens += 1 if num_tokens < self.max_system_tokens else -1
            head = PREAMBLE + f"Tenant {t}. "
            out.append(head + _words(rng, num_tokens - 1 - len(head)))
        return out

    def trees(self) -> list[Node]:
        rng = random.Random(self.seed)
        systems = self.system_prompts(rng)
        out = [self._tree(rng, systems[t], t, 1) for t in range(self.tenants) for _ in range(self.roots)]
        for i in range(self.one_offs):
            if i % 2:
                t = rng.randrange(self.tenants)
                prompt = systems[t] + "\nuser: " + _words(rng, rng.randint(16, 96)) + "\nassistant:"
                out.append(Node(prompt, abort=self._abort(rng), tenant=t))
            else:
                out.append(Node("one-off: " + _words(rng, rng.randint(100, 900)), abort=self._abort(rng)))
        rng.shuffle(out)
        return out

    def _abort(self, rng: random.Random) -> Abort:
        if rng.random() >= self.abort_rate:
            return Abort.NONE
        return rng.choice((Abort.FIRST_CHUNK, Abort.HEADERS))

    def _tree(self, rng: random.Random, history: str, tenant: int, level: int) -> Node:
        prompt = history + "\nuser: " + _words(rng, rng.randint(16, 96)) + "\nassistant:"
        abort = self._abort(rng)
        reply = " " + _words(rng, rng.randint(24, 120))
        if abort is not Abort.NONE or level >= self.depth:
            return Node(prompt, reply, abort, tenant)
        num_children = 2 if rng.random() < self.branch_rate else 1
        children = tuple(self._tree(rng, prompt + reply, tenant, level + 1) for _ in range(num_children))
        return Node(prompt, reply, abort, tenant, children)


def unbounded_bound(trees: list[Node], block_size: int = 16) -> float:
    """Hit rate of one unbounded cache holding every earlier prompt's full blocks, prompts taken
    parents first (the last prompt token is never a hit, as on a worker; aborts not counted)."""
    seen: set[str] = set()
    hit = total = 0
    for tree in trees:
        for node in tree.walk():
            p = BOS + node.prompt
            n = 0
            while (n + 1) * block_size <= len(p) - 1 and p[:(n + 1) * block_size] in seen:
                n += 1
            if node.abort is Abort.NONE:
                hit, total = hit + n * block_size, total + len(p)
            seen.update(p[:(i + 1) * block_size] for i in range(len(p) // block_size))
    return hit / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class BurstWorkload:
    tenants: int = 8
    bursts: int = 10
    burst_size: int = 4  # trees of one tenant started at one instant
    depth: int = 3
    branch_rate: float = 0.35
    one_off_rate: float = 0.5  # a burst also carries a free one-off prompt with this probability
    abort_rate: float = 0.1
    block_size: int = 16
    min_system_tokens: int = 170
    max_system_tokens: int = 640
    max_tokens: int = 8
    abort_max_tokens: int = 64
    concurrency: int = 8  # (unused: bursts are an open loop)
    rate: float = 1.0  # bursts started per second, Poisson
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bursts < 1 or self.burst_size < 1 or not 0 <= self.one_off_rate <= 1:
            raise ValueError("bursts and burst_size must be >= 1, one_off_rate within [0, 1]")
        if self.rate <= 0:
            raise ValueError("bursts arrive in an open loop: rate (bursts a second) must be > 0")
        _ = self._trees_of  # (checks the branching parameters)

    @property
    def _trees_of(self) -> BranchingWorkload:
        return BranchingWorkload(tenants=self.tenants, roots=1, depth=self.depth, branch_rate=self.branch_rate,
                                 one_offs=0, abort_rate=self.abort_rate, block_size=self.block_size,
                                 min_system_tokens=self.min_system_tokens, max_system_tokens=self.max_system_tokens,
                                 rate=self.rate, seed=self.seed)

    def bursts_of_trees(self) -> list[list[Node]]:
        """Each burst's trees: `burst_size` conversations of one tenant, then maybe a free one-off."""
        rng = random.Random(f"bursts-{self.seed}")
        shape = self._trees_of
        systems = shape.system_prompts(rng)
        weights = [1.0 / (t + 1) for t in range(self.tenants)]
        out = []
        for _ in range(self.bursts):
            t = rng.choices(range(self.tenants), weights)[0]
            burst = [shape._tree(rng, systems[t], t, 1) for _ in range(self.burst_size)]
            if rng.random() < self.one_off_rate:
                burst.append(Node("one-off: " + _words(rng, rng.randint(100, 900)), abort=shape._abort(rng)))
            out.append(burst)
        return out

    def trees(self) -> list[Node]:
        return [tree for burst in self.bursts_of_trees() for tree in burst]

    def arrivals(self) -> list[float]:
        """Each tree's start, in seconds from the run's start: a burst's trees share their burst's
        Poisson arrival time (the same for every policy, given the seed)."""
        starts = arrival_offsets(self.bursts, self.rate, self.seed)
        return [start for start, burst in zip(starts, self.bursts_of_trees(), strict=True) for _ in burst]
