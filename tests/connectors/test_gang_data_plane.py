"""Each rank moves its own KV heads between gangs of different TP (connectors/zmq/gang): real page
pools (a model with a full and a sliding-window group), real ZMQ sockets (rank 0's ipc control
socket, each P rank's tcp data socket, each P pool mapped by the D ranks on `shm`), every rank's
agent a thread here (`test_gang_processes.py` runs them as processes).

Checked for (P TP, D TP, KV heads) = (2,1,2), (1,2,2), (4,2,2) replicated, (4,2,8), on tcp and shm:
every D rank's pool holds exactly its heads of the canonical pages at the destination blocks and
nothing elsewhere; each D rank received exactly its share (page bytes * its heads / H per block),
only from the P ranks the mapping rule names (replicas never read: they serve nothing); D ranks
serve nothing (no rank forwards another's heads); the gang's answer agrees with pd's transfer plan.
"""
from __future__ import annotations

import secrets

import pytest
import torch

from connectors.zmq.gang.gang_control import GangControl
from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads, plan_pulls
from connectors.zmq.gang.rank_agent import RankAgent
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.parallel.head_slices import gather_heads, head_view, rank_layout, scatter_heads
from pd.engine.parallel.tp import TPShape, transfer_plan

NUM_BLOCKS = 10
P_BLOCKS = [1, 3, 4, 6, 9]
D_BLOCKS = [5, 2, 7, 1, 8]


def _layout(num_kv_heads: int) -> KVLayout:
    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=num_kv_heads, head_dim=4,
                      layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=8)
    return KVLayout(cfg, block_size=4)


def _canonical(layout: KVLayout) -> torch.Tensor:
    pool = PagePool(NUM_BLOCKS, layout.page_size_bytes, shareable=False)
    rows = layout.bind(pool).token_rows
    rows.copy_(torch.arange(rows.numel(), dtype=torch.float32).view_as(rows) + 1)
    return head_view(layout, pool)


def _geometry(layout: KVLayout) -> HeadGeometry:
    return HeadGeometry(layout.num_kv_heads, layout.head_dim, torch.float32)


def test_the_advertised_plan_is_the_mapping_rule_for_every_pair():
    for h in (1, 2, 4, 8, 16):
        for a in (1, 2, 4, 8):
            for b in (1, 2, 4, 8):
                if (h % a and a % h) or (h % b and b % h):
                    continue
                p, d = TPShape(a, h), TPShape(b, h)
                sources = [RankHeads(r, p.heads_of(r).start, len(p.heads_of(r))) for r in range(a)]
                got = [(dr, s.p_rank, s.p_first, s.d_first, s.count, s.head) for dr in range(b)
                       for s in plan_pulls(sources, RankHeads(dr, d.heads_of(dr).start, len(d.heads_of(dr))))]
                want = [(s.d_rank, s.p_rank, s.p_first, s.d_first, s.count, s.head) for s in transfer_plan(a, b, h)]
                assert got == want, (a, b, h)


def test_a_head_nobody_holds_is_refused():
    with pytest.raises(ValueError, match="KV head 2 is held by no rank"):
        plan_pulls([RankHeads(0, 0, 2)], RankHeads(1, 2, 2))


class Gangs:
    """A P gang and a D gang of agent threads, each rank with its own real pool."""

    def __init__(self, p_tp: int, d_tp: int, num_kv_heads: int):
        self.layout = _layout(num_kv_heads)
        self.canonical = _canonical(self.layout)
        self.p_shape, self.d_shape = TPShape(p_tp, num_kv_heads), TPShape(d_tp, num_kv_heads)
        self.p_layout, self.d_layout = rank_layout(self.layout, p_tp), rank_layout(self.layout, d_tp)
        self.p_ctl, self.d_ctl = GangControl(p_tp), GangControl(d_tp)
        self.p_pools, self.d_pools, self.p_agents, self.d_agents = [], [], [], []
        everything = list(range(NUM_BLOCKS))
        for r in range(p_tp):
            heads = self.p_shape.heads_of(r)
            pool = PagePool(NUM_BLOCKS, self.p_layout.page_size_bytes)  # memfd: mappable by the D ranks
            scatter_heads(head_view(self.p_layout, pool), everything, 0,
                          gather_heads(self.canonical, everything, heads.start, len(heads)))
            self.p_pools.append(pool)
            self.p_agents.append(RankAgent(self.p_ctl.address, pool, _geometry(self.p_layout),
                                           RankHeads(r, heads.start, len(heads)), serve=True))
        for r in range(d_tp):
            heads = self.d_shape.heads_of(r)
            pool = PagePool(NUM_BLOCKS, self.d_layout.page_size_bytes)
            self.d_pools.append(pool)
            self.d_agents.append(RankAgent(self.d_ctl.address, pool, _geometry(self.d_layout),
                                           RankHeads(r, heads.start, len(heads)), serve=False))
        self.p_ctl.wait_ranks(10.0)
        self.d_ctl.wait_ranks(10.0)

    def move(self, path: str, src=P_BLOCKS, dst=D_BLOCKS, grant=True, timeout_s=10.0):
        ticket = secrets.token_bytes(16)
        if grant:
            self.p_ctl.grant(ticket, src, ttl_s=30.0)
        try:
            return self.d_ctl.load(ticket, self.p_ctl.sources(), src, dst, path, timeout_s)
        finally:
            self.p_ctl.revoke(ticket)

    def close(self, timeout_s: float = 5.0):
        self.d_ctl.close(timeout_s)
        self.p_ctl.close(timeout_s)


@pytest.mark.parametrize("path", ["tcp", "shm"])
@pytest.mark.parametrize(("p_tp", "d_tp", "num_kv_heads"), [(2, 1, 2), (1, 2, 2), (4, 2, 2), (4, 2, 8)])
def test_each_d_rank_pulls_exactly_its_heads_from_their_p_ranks(p_tp, d_tp, num_kv_heads, path):
    g = Gangs(p_tp, d_tp, num_kv_heads)
    try:
        res = g.move(path)
        assert res.ok, res
        plan = transfer_plan(p_tp, d_tp, num_kv_heads)
        page = g.layout.page_size_bytes
        for r, pool in enumerate(g.d_pools):
            heads = g.d_shape.heads_of(r)
            got = head_view(g.d_layout, pool)
            assert torch.equal(got[D_BLOCKS], g.canonical[P_BLOCKS][:, :, heads.start:heads.stop])
            untouched = sorted(set(range(NUM_BLOCKS)) - set(D_BLOCKS))
            assert int(pool.buffer[untouched].count_nonzero()) == 0
            share = len(P_BLOCKS) * page * len(heads) // num_kv_heads
            assert sum(res.by_rank[r].values()) == share == g.d_agents[r].received_bytes
            want_from = {}
            for s in plan:
                if s.d_rank == r:
                    want_from[s.p_rank] = want_from.get(s.p_rank, 0) + len(P_BLOCKS) * page * s.count // num_kv_heads
            assert res.by_rank[r] == want_from  # only from the P ranks the rule names, each its heads
        read = {s.p_rank for s in plan}
        for r, agent in enumerate(g.p_agents):
            if r not in read:  # a replica: never read
                assert agent.server.served_slices == 0
            if path == "tcp":
                assert agent.server.served_bytes == sum(len(P_BLOCKS) * page * s.count // num_kv_heads
                                                        for s in plan if s.p_rank == r)
            else:
                assert agent.server.served_bytes == 0  # the D ranks copied out of the mapped pool
        assert all(a.server is None for a in g.d_agents)  # a D rank serves nobody: it cannot forward
        assert all(a.received_bytes == 0 for a in g.p_agents)
        assert all(a.server.live_tickets() == 0 for a in g.p_agents)
    finally:
        g.close()


def test_without_a_grant_nothing_is_served_and_every_block_is_untrusted():
    g = Gangs(2, 1, 2)
    try:
        res = g.move("tcp", grant=False)
        assert not res.ok and res.bad == sorted(D_BLOCKS) and res.cause.value == "pull_refused"
        assert int(g.d_pools[0].buffer.count_nonzero()) == 0
        assert sum(a.server.served_bytes for a in g.p_agents) == 0
    finally:
        g.close()


def test_blocks_outside_the_grant_are_refused():
    g = Gangs(1, 2, 2)
    try:
        ticket = secrets.token_bytes(16)
        g.p_ctl.grant(ticket, P_BLOCKS[:2], ttl_s=30.0)
        res = g.d_ctl.load(ticket, g.p_ctl.sources(), P_BLOCKS, D_BLOCKS, "tcp", 5.0)
        assert not res.ok and res.bad == sorted(D_BLOCKS)
        assert all(int(p.buffer.count_nonzero()) == 0 for p in g.d_pools)
    finally:
        g.close()


def test_a_slice_failing_its_checksum_makes_every_block_it_covers_untrusted(monkeypatch):
    from connectors.zmq.gang import slice_server

    real, calls = slice_server.digest, []

    def lying(view):  # the first slice served (one P rank's heads) carries wrong checksums
        calls.append(1)
        return real(view) + (1 if len(calls) <= len(P_BLOCKS) else 0)

    monkeypatch.setattr(slice_server, "digest", lying)
    g = Gangs(2, 1, 2)
    try:
        res = g.move("tcp")
        assert not res.ok and res.cause.value == "checksum" and res.bad == sorted(D_BLOCKS)
        assert res.by_rank[0] and sum(res.by_rank[0].values()) == g.d_agents[0].received_bytes
        assert g.d_agents[0].received_bytes == len(P_BLOCKS) * g.layout.page_size_bytes // 2  # only the good slice
        monkeypatch.setattr(slice_server, "digest", real)
        assert g.move("tcp").ok  # the next load of the same blocks lands whole
        assert torch.equal(head_view(g.d_layout, g.d_pools[0])[D_BLOCKS], g.canonical[P_BLOCKS])
    finally:
        g.close()


def test_a_d_rank_that_never_answers_fails_the_load_in_bounded_time():
    g = Gangs(1, 2, 2)
    try:
        g.d_agents[1].close()  # rank 1 is gone: its part never lands
        res = g.move("tcp", timeout_s=0.5)
        assert not res.ok and res.cause.value == "timeout" and res.bad == sorted(D_BLOCKS)
        assert res.seconds < 5.0
        assert g.d_agents[0].received_bytes > 0  # rank 0's part landed; the blocks are still untrusted
    finally:
        g.close(timeout_s=0.5)  # (rank 1 cannot answer its stop)


def _with_faults(g: Gangs, spec: str, side: str, rank: int) -> None:
    """Gives rank `rank` of one side a fault plan (as a worker hands its plan to its ranks)."""
    from connectors.links.faults import FaultPlan
    from pd.cluster.fault_rules import ALL_POINTS

    agent = (g.p_agents if side == "p" else g.d_agents)[rank]
    agent.faults.plan = FaultPlan.parse(spec, ALL_POINTS)


@pytest.mark.parametrize(("spec", "cause", "bad"), [("gang.rank1.slice:corrupt", "checksum", D_BLOCKS[:1]),
                                                    ("gang.slice:drop", "timeout", D_BLOCKS),
                                                    ("gang.slice:delay:0.3", None, [])])
def test_fault_plans_fire_on_the_p_rank_that_holds_them(spec, cause, bad):
    g = Gangs(2, 1, 2)
    try:
        _with_faults(g, spec, "p", 1)
        res = g.move("tcp", timeout_s=1.0)
        assert res.bad == sorted(bad) and (res.cause.value if res.cause else None) == cause
        assert res.ok or res.seconds < 5.0
        if cause is None:
            assert res.seconds >= 0.3
        half = g.layout.page_size_bytes // 2  # each P rank's head of a page
        got_from_1 = {"checksum": (len(P_BLOCKS) - 1) * half, "timeout": 0}.get(cause, len(P_BLOCKS) * half)
        want = {0: len(P_BLOCKS) * half, **({1: got_from_1} if got_from_1 else {})}
        assert g.d_agents[0].received_from == want
        assert g.p_agents[1].faults.plan.fired()[0][1] == spec.split(":")[1]
        assert g.p_agents[0].faults.plan is None and g.move("tcp").ok  # fired once: the next load is whole
    finally:
        g.close()


def test_a_d_rank_fault_fails_only_the_blocks_it_names():
    g = Gangs(1, 2, 2)
    try:
        _with_faults(g, "gang.rank1.load:corrupt", "d", 1)
        res = g.move("shm")
        assert not res.ok and res.bad == [D_BLOCKS[0]] and res.cause.value == "checksum"
        _with_faults(g, "gang.load:drop", "d", 0)
        res = g.move("shm", timeout_s=0.5)
        assert not res.ok and res.cause.value == "timeout" and res.bad == sorted(D_BLOCKS)
    finally:
        g.close()


def test_a_slice_server_drops_oversized_frames_and_refuses_heads_it_does_not_hold():
    """A peer without a ticket cannot make a P rank buffer a huge message; a ticket holder asking for
    heads past this rank's gets an error, and the server keeps serving."""
    import zmq

    from connectors.zmq.gang import agent_wire
    from connectors.zmq.gang.slice_server import SliceServer

    layout = _layout(2)
    pool = PagePool(NUM_BLOCKS, layout.page_size_bytes, shareable=False)
    server = SliceServer(pool, _geometry(layout))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        ticket = secrets.token_bytes(16)
        server.grant(ticket, P_BLOCKS, ttl_s=30.0)
        sock.connect(server.endpoint)

        def ask(first: int, count: int) -> tuple[str, dict]:
            sock.send(agent_wire.encode("slice", id=first + 10, ticket=ticket, block_ids=P_BLOCKS[:1], first=first,
                                        count=count, send=False))
            return agent_wire.decode(sock.recv())

        assert ask(0, 1)[0] == "sliced"
        # (without the limit zmq would take in the whole frame before the decoder refuses it)
        assert server._sock.getsockopt(zmq.MAXMSGSIZE) == agent_wire.MAX_MESSAGE_BYTES
        sock.send(b"\x00" * (agent_wire.MAX_MESSAGE_BYTES + 1))  # zmq drops this peer's connection
        sock.close()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(server.endpoint)
        kind, msg = ask(1, 2)  # 2 local heads: heads 1 and 2
        assert kind == "err" and "not this rank's" in msg["reason"]
        assert ask(1, 1)[0] == "sliced" and server.served_slices == 2
    finally:
        sock.close()
        server.close()
