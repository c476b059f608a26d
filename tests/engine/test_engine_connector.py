"""Connector hooks of the scheduler, driven by the in-process fake connector (pd_fake_connector.py)."""
from kvcache import RequestStatus
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, engine_config, mixed_prompts
from pd_fake_connector import FakeConnector, FakeLink

from connectors.metrics import FailureCause
from pd.engine.engine import Engine
from pd.engine.outputs import FinishReason
from pd.engine.sample.params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PREFILL_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)
PROMPTS = mixed_prompts(6, 5, 70, seed=7)


def make_pair(model, link=None, **d_kw):
    link = link or FakeLink()
    p = Engine(engine_config(model, engine_id="P"), connector=FakeConnector(link, "P", 4))
    d = Engine(engine_config(model, engine_id="D", **d_kw), connector=FakeConnector(link, "D", 4))
    return link, p, d


def step_all(*engines, until=None, max_steps=500):
    """Step every engine until all are idle (or `until()` holds); returns outputs per request id."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if until is not None and until():
            return outs
        if not any(e.has_unfinished_requests() for e in engines):
            return outs
        for e in engines:
            for o in e.step():
                outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engines did not go idle")


def status_of(eng, rid):
    state = eng.scheduler.requests.get(rid)
    return state.request.status if state is not None else None


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def prefill_on_p(p, rid, prompt):
    p.add_request(rid, prompt, PREFILL_ONLY, kv_transfer_params={"do_remote_decode": True})
    for _ in range(100):
        done = [o for o in p.step() if o.request_id == rid and o.finished]
        if done:
            break
    out = done[0]
    assert out.finished and out.kv_transfer_params.do_remote_prefill
    return out


def test_remote_prefill_gives_single_worker_tokens(model_config):
    alone = Engine(engine_config(model_config)).generate_sync(PROMPTS, GREEDY)
    link, p, d = make_pair(model_config)
    firsts = {rid: prefill_on_p(p, rid, prompt) for rid, prompt in PROMPTS.items()}
    assert p.stats()["num_held_for_transfer"] == len(PROMPTS)  # P keeps blocks until D read them
    for rid, prompt in PROMPTS.items():
        d.add_request(rid, prompt, GREEDY, kv_transfer_params=firsts[rid].kv_transfer_params)
    outs = step_all(p, d)
    for rid in PROMPTS:
        assert tokens(outs[rid]) == alone[rid], rid
        assert firsts[rid].new_token_ids == alone[rid][:1]
    assert link.num_loads == len(PROMPTS)
    assert d.scheduler.stats.num_remote_tokens == sum(len(x) for x in PROMPTS.values())
    assert p.stats()["num_held_for_transfer"] == 0
    assert set(p.connector.scheduler.finished_calls) == set(PROMPTS)
    assert_all_free(p.kv_cache_manager)
    assert_all_free(d.kv_cache_manager)


def test_remote_blocks_not_prefix_cached_before_load_finishes():
    link, p, d = make_pair(FULL_MODEL)
    prompt = PROMPTS["req0"] + list(range(40))
    params = prefill_on_p(p, "r", prompt).kv_transfer_params
    link.hold_loads = True
    d.add_request("r", prompt, GREEDY, kv_transfer_params=params)
    step_all(d, until=lambda: status_of(d, "r") == RequestStatus.WAITING_FOR_REMOTE_KVS)
    d.add_request("local", prompt, GREEDY)
    d.step()
    step_all(d, until=lambda: status_of(d, "local") is None)
    assert d.stats()["prefix_cache_hits"] == 0  # the unverified pages were invisible
    link.release("r")
    outs = step_all(p, d)
    d.add_request("again", prompt, GREEDY)
    outs.update(step_all(d))
    assert d.stats()["prefix_cache_hits"] > 0
    assert tokens(outs["r"]) == tokens(outs["again"])
    assert_all_free(p.kv_cache_manager)
    assert_all_free(d.kv_cache_manager)


def test_load_failure_recompute_policy(model_config):
    alone = Engine(engine_config(model_config)).generate_sync({"r": PROMPTS["req1"]}, GREEDY)["r"]
    link, p, d = make_pair(model_config, kv_load_failure_policy="recompute")
    params = prefill_on_p(p, "r", PROMPTS["req1"]).kv_transfer_params
    link.corrupt.add("r")
    d.add_request("r", PROMPTS["req1"], GREEDY, kv_transfer_params=params)
    outs = step_all(p, d)
    assert tokens(outs["r"]) == alone
    assert d.scheduler.stats.num_load_failures_recomputed == 1
    assert d.scheduler.stats.num_remote_tokens == 0
    assert_all_free(p.kv_cache_manager)
    assert_all_free(d.kv_cache_manager)


def test_load_failure_fail_policy():
    link, p, d = make_pair(FULL_MODEL, kv_load_failure_policy="fail")
    params = prefill_on_p(p, "r", PROMPTS["req1"]).kv_transfer_params
    link.corrupt.add("r")
    d.add_request("r", PROMPTS["req1"], GREEDY, kv_transfer_params=params)
    outs = step_all(p, d)
    assert [o.finish_reason for o in outs["r"]] == [FinishReason.ERROR] and outs["r"][0].error
    assert outs["r"][0].error_cause is FailureCause.CHECKSUM  # the connector's cause, as the enum
    assert tokens(outs["r"]) == []
    assert d.stats()["num_errors"] == 1
    assert_all_free(p.kv_cache_manager)
    assert_all_free(d.kv_cache_manager)


def test_abort_during_load_keeps_blocks_until_recv_finished():
    link, p, d = make_pair(FULL_MODEL)
    params = prefill_on_p(p, "r", PROMPTS["req2"]).kv_transfer_params
    link.hold_loads = True
    d.add_request("r", PROMPTS["req2"], GREEDY, kv_transfer_params=params)
    step_all(d, until=lambda: status_of(d, "r") == RequestStatus.WAITING_FOR_REMOTE_KVS)
    held = d.kv_cache_manager.num_free_blocks
    d.abort_request("r")
    outs = d.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "abort")]
    assert d.kv_cache_manager.num_free_blocks == held  # the load may still write into them
    assert d.stats()["num_held_for_transfer"] == 1
    link.release("r")
    step_all(p, d)
    assert_all_free(p.kv_cache_manager)
    assert_all_free(d.kv_cache_manager)


def test_producer_abort_frees_at_once():
    link, p, _ = make_pair(FULL_MODEL)
    p.add_request("r", PROMPTS["req3"], SamplingParams(max_tokens=5, ignore_eos=True),
                  kv_transfer_params={"do_remote_decode": True})
    p.step()
    p.abort_request("r")
    outs = p.step()
    assert outs[-1].finish_reason == "abort" and outs[-1].kv_transfer_params is None
    assert p.stats()["num_held_for_transfer"] == 0
    assert_all_free(p.kv_cache_manager)


def test_async_load_waits_for_inflight_prefill_reservations():
    link = FakeLink()
    # D: 40 usable blocks of 4 tokens, chunked prefill at 16 tokens
    link, p, d = make_pair(FULL_MODEL, link, num_blocks=41, long_prefill_token_threshold=16, max_num_batched_tokens=16)
    remote_prompt = list(range(30, 70))  # 40 tokens: 10 blocks
    params = prefill_on_p(p, "remote", remote_prompt).kv_transfer_params
    d.add_request("local", list(range(120)), SamplingParams(max_tokens=2, ignore_eos=True))  # 30 blocks
    d.step()  # first chunk: "local" holds 4 blocks and still needs 26
    d.add_request("remote", remote_prompt, GREEDY, kv_transfer_params=params)
    d.step()
    # 36 free would hold the load's 10 blocks, but 36 - 26 reserved does not
    assert d.scheduler.requests["remote"].request.status == RequestStatus.WAITING
    outs = step_all(p, d)
    assert outs["remote"][-1].finish_reason == "length"
    assert d.scheduler.stats.num_remote_tokens == len(remote_prompt)
    assert_all_free(p.kv_cache_manager)
    assert_all_free(d.kv_cache_manager)


def test_no_connector_ignores_transfer_params(caplog):
    eng = Engine(engine_config(FULL_MODEL))
    eng.add_request("r", [1, 2, 3], GREEDY, kv_transfer_params={"do_remote_prefill": True})
    outs = step_all(eng)
    assert len(tokens(outs["r"])) == GREEDY.max_tokens
    assert "no connector" in caplog.text
    assert_all_free(eng.kv_cache_manager)
