"""Hypothesis state machine over allocate / append / free / preempt / reset /
prefix hits: the pool invariants hold after every step and nothing leaks."""
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache import RequestStatus
from kvcache.audit import assert_all_free, check_invariants
from kvcache.testing import fa_spec, make_manager, make_request, swa_spec

BS = 4
MAX_LEN = 96
PREFIXES = [list(range(100, 124)), list(range(200, 210)), [7] * 16]
LAYOUTS = {
    "full": lambda: make_manager(24, fa_spec(BS), max_model_len=MAX_LEN),
    "sliding": lambda: make_manager(16, swa_spec(BS, 10), max_model_len=MAX_LEN),
    "hybrid": lambda: make_manager(40, fa_spec(BS), swa_spec(BS, 10), max_model_len=MAX_LEN),
}


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), watermark=st.sampled_from([0.0, 0.1]))
    def setup(self, layout, watermark):
        self.mgr = LAYOUTS[layout]()
        self.mgr.watermark_blocks = int(watermark * self.mgr.kv_cache_config.num_blocks)
        self.running = {}
        self.waiting = []
        self.next_id = 0

    def _admit(self, req, chunk):
        mgr = self.mgr
        blocks, hit = mgr.get_computed_blocks(req)
        assert hit % BS == 0 and hit <= req.num_tokens - 1
        if hit:
            assert all(len(g) * BS >= hit for g in blocks.blocks)
        num_new = min(req.num_tokens - hit, chunk)
        out = mgr.allocate_slots(req, num_new, hit, blocks, has_scheduled_reqs=bool(self.running))
        if out is None:
            return False
        req.num_computed_tokens = hit + num_new
        req.status = RequestStatus.RUNNING
        self.running[req.request_id] = req
        return True

    @rule(prefix=st.sampled_from(range(len(PREFIXES) + 1)), suffix=st.lists(st.integers(0, 30), min_size=1,
          max_size=30), chunk=st.integers(1, 64), salt=st.sampled_from([None, None, "s"]))
    def add_request(self, prefix, suffix, chunk, salt):
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        req = make_request(f"r{self.next_id}", prompt, block_size=BS, cache_salt=salt)
        self.next_id += 1
        if not self._admit(req, chunk):
            self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 64))
    def resume(self, chunk):
        req = self.waiting[0]
        if self._admit(req, chunk):
            self.waiting.pop(0)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 30))
    def step(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if req.num_computed_tokens >= req.num_tokens:
            if req.num_tokens >= MAX_LEN - 1:
                self._finish(rid)
                return
            req.append_output_token_ids(token)
        num_new = req.num_tokens - req.num_computed_tokens
        if self.mgr.allocate_slots(req, num_new) is None:
            self._preempt(rid)
        else:
            req.num_computed_tokens += num_new

    def _preempt(self, rid):
        req = self.running.pop(rid)
        self.mgr.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def _finish(self, rid):
        req = self.running.pop(rid)
        self.mgr.free(req)
        req.status = RequestStatus.FINISHED_STOPPED

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(sorted(self.running))))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), deferred=st.booleans())
    def free(self, data, deferred):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        if deferred:
            req = self.running.pop(rid)
            blocks = self.mgr.pop_blocks_for_free(req)
            check_invariants(self.mgr)
            self.mgr.block_pool.free_blocks(reversed(blocks))
        else:
            self._finish(rid)

    @rule()
    def reset(self):
        in_use = self.mgr.num_free_blocks != self.mgr.kv_cache_config.num_blocks - 1
        assert self.mgr.reset_prefix_cache() is (not in_use)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def prefix_hit_of_a_running_prompt(self, data):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        probe = make_request("probe", req.all_token_ids, block_size=BS, cache_salt=req.cache_salt)
        blocks, hit = self.mgr.get_computed_blocks(probe)
        cached = req.num_computed_tokens // self.mgr.scheduler_block_size * self.mgr.scheduler_block_size
        assert hit <= probe.num_tokens - 1 and hit % self.mgr.scheduler_block_size == 0
        if all(g.spec.kind == "full_attention" for g in self.mgr.kv_cache_config.groups):
            # the running request's own computed full blocks are cached and held
            assert hit >= min(cached, probe.num_tokens - 1) // BS * BS

    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "mgr"):
            check_invariants(self.mgr)

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for rid in sorted(self.running):
            self._finish(rid)
        check_invariants(self.mgr)
        assert_all_free(self.mgr)
        assert self.mgr.reset_prefix_cache()


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVCacheStateMachine = KVCacheMachine.TestCase
