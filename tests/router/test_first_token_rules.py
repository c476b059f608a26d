"""The rules of P's first token to the client (pd.router.first_token), on the wire messages: which
requests go that way, when P's token ends one, and what D is then asked for. The deployment's
behaviour is in tests/reliability/test_first_token.py."""
from __future__ import annotations

from pd.cluster.messages import GenerateRequest, KVTransferParams, Sampling, TokenEvent
from pd.router.first_token import decode_request, finish_at_first, first_event, forwards

PARAMS = KVTransferParams(do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1", remote_port=1,
                          remote_request_id="r", remote_block_ids=[[1, 2]], remote_num_tokens=20)


def _request(**sampling) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_token_ids=list(range(20)), sampling=Sampling(**sampling))


def test_only_unseeded_requests_and_only_when_on():
    assert forwards(True, Sampling()) and forwards(True, Sampling(temperature=0.8))
    assert not forwards(True, Sampling(seed=0)) and not forwards(True, Sampling(seed=7, temperature=0.0))
    assert not forwards(False, Sampling())


def test_p_ends_the_request_on_a_stop_token_or_one_token():
    answer = TokenEvent(token_ids=[9], finished=True, finish_reason="length", kv_transfer_params=PARAMS)
    assert finish_at_first(_request(max_tokens=5), answer) is None
    assert finish_at_first(_request(max_tokens=1), answer) == "length"
    stopped = answer.model_copy(update={"finish_reason": "stop"})
    assert finish_at_first(_request(max_tokens=5), stopped) == "stop"
    assert finish_at_first(_request(max_tokens=1), stopped) == "stop"  # the engine checks stop before length
    event = first_event(stopped, 16, "stop")
    assert event.token_ids == [9] and event.finished and event.finish_reason == "stop"
    assert event.num_cached_tokens == 16 and event.kv_transfer_params is None and event.timing is None
    going_on = first_event(answer, 0, None)
    assert not going_on.finished and going_on.finish_reason is None


def test_d_is_asked_for_what_is_left_after_ps_token():
    request = _request(max_tokens=5, temperature=0.7, top_p=0.9)
    answer = TokenEvent(token_ids=[9], finished=True, finish_reason="length", kv_transfer_params=PARAMS)
    decode = decode_request(request, answer, PARAMS)
    assert decode.prompt_token_ids == list(range(20)) + [9]
    assert decode.sampling == request.sampling.model_copy(update={"max_tokens": 4})
    assert decode.kv_transfer_params == PARAMS and decode.request_id == "r"
    assert decode_request(request, answer, None).kv_transfer_params is None  # D computes the prompt itself
    assert request.prompt_token_ids == list(range(20))  # the caller's request is untouched
