"""The shape of `pd.tools.route_bench`'s workloads (pure functions of their seed: no processes)."""
from __future__ import annotations

import random

import pytest

from pd.engine.text.tokenizer import ByteTokenizer
from pd.tools.route_bench.workload import (
    PREAMBLE,
    Abort,
    BranchingWorkload,
    BurstWorkload,
    Node,
    Workload,
    arrival_offsets,
    unbounded_bound,
)


def _nodes(trees):
    return [n for t in trees for n in t.walk()]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_branching_workload_is_trees_of_tenants_with_one_offs_and_aborts(seed):
    work = BranchingWorkload(seed=seed)
    trees = work.trees()
    assert trees == BranchingWorkload(seed=seed).trees()  # a pure function of its seed
    tok = ByteTokenizer()
    systems = work.system_prompts(random.Random(seed))  # drawn first, as trees() does
    for system in systems:  # the preamble, then 170-640 tokens (BOS included), never whole blocks
        n = len(tok.encode(system))
        assert system.startswith(PREAMBLE)
        assert work.min_system_tokens <= n <= work.max_system_tokens and n % work.block_size, n
    assert len({len(tok.encode(s)) // work.block_size for s in systems}) > 1  # lengths vary
    nodes = _nodes(trees)
    branched = 0
    for parent in nodes:
        if parent.children:
            assert parent.abort is Abort.NONE  # an aborted request has no follow-up
        for child in parent.children:  # a child is its parent, the parent's reply, and a new turn
            assert child.prompt.startswith(parent.prompt + parent.reply) and child.tenant == parent.tenant
            assert len(child.prompt) > len(parent.prompt + parent.reply)
        if len(parent.children) == 2:
            branched += 1
            a, b = parent.children
            assert a.prompt != b.prompt  # two different next turns after one reply
    assert branched > 0
    for node in nodes:
        if node.tenant is not None:
            assert node.prompt.startswith(systems[node.tenant])
        assert len(tok.encode(node.prompt)) < 2048  # fits route_bench's max_model_len
    free = [n for n in nodes if n.tenant is None]
    single = [t for t in trees if t.tenant is not None and not t.children]
    assert len(free) + len(single) >= work.one_offs // 2 and all(not n.prompt.startswith(PREAMBLE) for n in free)
    assert {n.abort for n in nodes} == set(Abort)  # both kinds of client abort, and complete requests
    assert any(t.children and any(c.children for c in t.children) for t in trees)  # trees deeper than 2
    assert 0 < unbounded_bound(trees) < 1


def test_branching_workload_rejects_bad_figures():
    with pytest.raises(ValueError, match="branch_rate"):
        BranchingWorkload(branch_rate=1.5)
    with pytest.raises(ValueError, match="system prompt"):
        BranchingWorkload(min_system_tokens=10)
    for bad in ({"rate": -1.0}, {"concurrency": 0}, {"rate": 1e6}):
        with pytest.raises(ValueError, match="concurrency must be >= 1 and rate"):
            BranchingWorkload(**bad)
        with pytest.raises(ValueError, match="concurrency must be >= 1 and rate"):
            Workload(**bad)


def test_open_loop_arrivals_are_a_seeded_poisson_process():
    offsets = arrival_offsets(4000, rate=4.0, seed=7)
    assert offsets == arrival_offsets(4000, rate=4.0, seed=7)  # the same for every policy of a seed
    assert offsets != arrival_offsets(4000, rate=4.0, seed=8)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    assert 0.9 / 4.0 < mean < 1.1 / 4.0  # exponential gaps of mean 1/rate: 4000 draws land within 10%
    # exponential, not even: about e^-1 of the gaps are longer than the mean
    assert 0.3 < sum(g > 1 / 4.0 for g in gaps) / len(gaps) < 0.43


def test_sessions_workload_is_chains_of_turns():
    work = Workload(tenants=3, sessions=2, turns=4)
    trees = work.trees()
    assert len(trees) == 6
    for tree in trees:
        chain = list(tree.walk())
        assert len(chain) == 4 and all(len(n.children) <= 1 for n in chain)
        assert all(b.prompt.startswith(a.prompt) for a, b in zip(chain, chain[1:], strict=False))
        assert all(n.abort is Abort.NONE for n in chain)
    assert [[n.prompt for n in t.walk()] for t in trees] == work.conversations()


def test_unbounded_bound_counts_full_blocks_of_earlier_prompts():
    # BOS + 31 chars: two full blocks of 16; the second prompt repeats them, then one more block
    first = "a" * 31
    bound = unbounded_bound([Node(first, children=(Node(first + "b" * 16),))], block_size=16)
    # first: no hit, 32 tokens; second: 48 tokens, blocks 1-2 seen, and its last token is never a hit: 32
    assert bound == pytest.approx(32 / (32 + 48))


@pytest.mark.parametrize("seed", [0, 1])
def test_burst_workload_sends_one_tenants_trees_at_one_instant(seed):
    work = BurstWorkload(seed=seed)
    bursts = work.bursts_of_trees()
    assert bursts == BurstWorkload(seed=seed).bursts_of_trees()  # a pure function of its seed
    assert len(bursts) == work.bursts
    trees, starts = work.trees(), work.arrivals()
    assert len(trees) == len(starts) == sum(len(b) for b in bursts)
    i = 0
    for burst, start in zip(bursts, arrival_offsets(work.bursts, work.rate, seed), strict=True):
        tenants = {t.tenant for t in burst[:work.burst_size]}
        assert len(tenants) == 1 and None not in tenants  # burst_size conversations of one tenant
        assert all(t.tenant is None for t in burst[work.burst_size:])  # then maybe a free one-off
        assert starts[i:i + len(burst)] == [start] * len(burst)  # all sent at the burst's instant
        i += len(burst)
    nodes = _nodes(trees)
    assert any(n.abort is not Abort.NONE for n in nodes) and any(n.children for n in nodes)
    counts: dict[int, int] = {}
    for b in bursts:
        counts[b[0].tenant] = counts.get(b[0].tenant, 0) + 1
    assert len(counts) > 1  # tenants differ in popularity, but more than one shows up
    tok = ByteTokenizer()
    assert all(len(tok.encode(n.prompt)) < 2048 for n in nodes)  # fits route_bench's max_model_len
    with pytest.raises(ValueError, match="open loop"):
        BurstWorkload(rate=0.0)
    with pytest.raises(ValueError, match="bursts"):
        BurstWorkload(bursts=0)
