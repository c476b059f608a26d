"""The unmodified `openai` client against a real router and real workers on Ray:
`/v1/chat/completions` streamed and not, colocated and 1P1D, usage chunks only
on request, `return_token_ids` (vLLM's extension), `/v1/models/{id}`, and the
fields and types pdkv refuses by name.
"""
from __future__ import annotations

import json

import openai
import pytest
import requests

from pd.deploy.launch import Deployment
from pd.engine.text.tokenizer import load_tokenizer
from tests.helpers.e2e import e2e_config, wait_all_free

MODEL = "pdkv-tiny"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "The quick brown fox jumps over the lazy dog. What did the fox do?"}]
GREEDY = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def urls(ray_instance):
    with Deployment(e2e_config("local-colocated.yaml")) as colocated, Deployment(e2e_config("local.yaml")) as pd:
        yield {"colocated": colocated.url, "pd": pd.url}


@pytest.fixture(params=["colocated", "pd"])
def url(request, urls):
    return urls[request.param]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def rendered_prompt_len(messages) -> int:
    """The prompt the router must build: the chat template's text, as the tokenizer encodes a chat
    (the byte tokenizer's template writes no BOS, so `encode_chat` puts one BOS in front)."""
    tokenizer = load_tokenizer(None)
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    assert text.startswith("<|system|>") or text.startswith("<|user|>")
    return len(text.encode()) + 1


def test_chat_completion_is_the_same_colocated_and_pd(urls):
    results = {name: client(u).chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
               for name, u in urls.items()}
    for result in results.values():
        assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
        choice = result.choices[0]
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert result.usage.completion_tokens == 16
        assert result.usage.prompt_tokens == rendered_prompt_len(MESSAGES)
        assert result.usage.prompt_tokens_details.cached_tokens >= 0
    assert results["pd"].choices[0].message.content == results["colocated"].choices[0].message.content


def test_chat_stream_equals_non_stream(url):
    whole = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                      stream_options={"include_usage": True}, **GREEDY))
    *content_chunks, usage_chunk = chunks
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert len(content_chunks) > 3  # really streamed: role, several content deltas, finish
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_no_usage_chunk_unless_asked(url, endpoint):
    c = client(url)
    if endpoint == "chat":
        stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **GREEDY)
    else:
        stream = c.completions.create(model=MODEL, prompt="Hello", stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks and all(chunk.choices for chunk in chunks)  # `chunk.choices[0]` is safe on every chunk
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens_seed_and_stop(urls):
    pd, colocated = client(urls["pd"]), client(urls["colocated"])
    short = pd.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    sampled = {name: c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.9, top_p=0.95, seed=7,
                                               max_tokens=16, extra_body={"ignore_eos": True, "top_k": 50})
               for name, c in (("pd", pd), ("colocated", colocated))}
    assert sampled["pd"].choices[0].message.content == sampled["colocated"].choices[0].message.content
    full = pd.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY).choices[0].message.content
    # two characters adjacent in the real output, neither a replacement character
    windows = [full[i:i + 2] for i in range(1, len(full) - 1) if "\ufffd" not in full[i:i + 2]]
    if not windows:
        pytest.skip("random model produced no printable text to stop on")
    stop = windows[0]
    cut = pd.chat.completions.create(model=MODEL, messages=MESSAGES, stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content and full.startswith(cut.message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in pd.chat.completions.create(
        model=MODEL, messages=MESSAGES, stop=[stop], stream=True, **GREEDY))
    assert streamed == cut.message.content


def chat_events(url: str, body: dict) -> list:
    """The SSE `data:` payloads of a streamed chat completion ("[DONE]" last)."""
    events = []
    with requests.post(f"{url}/v1/chat/completions", json=dict(body, stream=True), stream=True, timeout=60) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: "):
                events.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
    return events


WITH_IDS = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 16, "ignore_eos": True,
            "return_token_ids": True}


def test_chat_return_token_ids(url):
    tokenizer = load_tokenizer(None)
    prompt_ids = tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    resp = post(url, "chat/completions", WITH_IDS)
    assert resp.status_code == 200, resp.text
    whole = resp.json()
    choice = whole["choices"][0]
    assert whole["prompt_token_ids"] == prompt_ids and len(prompt_ids) == whole["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == 16 == whole["usage"]["completion_tokens"]
    assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    # the same prompt ids through /v1/completions generate the same ids (greedy)
    completion = post(url, "completions", {"prompt": prompt_ids, "max_tokens": 16, "temperature": 0,
                                           "ignore_eos": True, "return_token_ids": True}).json()
    assert completion["choices"][0]["token_ids"] == choice["token_ids"]

    events = chat_events(url, dict(WITH_IDS, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and "prompt_token_ids" not in usage
    assert chunks[0]["prompt_token_ids"] == prompt_ids and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert all(isinstance(c["choices"][0]["token_ids"], list) for c in chunks)
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]

    # the unmodified openai client passes the field through and keeps the extra response fields
    result = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    assert result.model_extra["prompt_token_ids"] == prompt_ids
    assert result.choices[0].model_extra["token_ids"] == choice["token_ids"]


def test_completions_return_prompt_token_ids(url):
    """vLLM's extension on /v1/completions: each choice carries its prompt's ids (a stream: on its
    first chunk only) and the generated ids; a text prompt's ids are the tokenizer's."""
    tokenizer = load_tokenizer(None)
    text = "The capital of France is"
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = post(url, "completions", dict(body, prompt=[text, "Hello"])).json()
    first, second = whole["choices"]
    assert first["prompt_token_ids"] == tokenizer.encode(text) and second["prompt_token_ids"] == tokenizer.encode("Hello")
    ids = post(url, "completions", dict(body, prompt=[[5, 6, 7]])).json()["choices"][0]
    assert ids["prompt_token_ids"] == [5, 6, 7]
    assert len(first["token_ids"]) == 8 and tokenizer.decode(first["token_ids"]) == first["text"]
    chunks = []
    with requests.post(f"{url}/v1/completions", json=dict(body, prompt=text, stream=True), stream=True,
                       timeout=60) as resp:
        assert resp.status_code == 200, resp.text
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith(b"data: ") and line != b"data: [DONE]"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenizer.encode(text)
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == first["token_ids"]
    plain = post(url, "completions", dict(body, prompt=text, return_token_ids=False)).json()["choices"][0]
    assert "prompt_token_ids" not in plain and "token_ids" not in plain


def test_chat_token_ids_absent_unless_asked(urls):
    body = dict(WITH_IDS, return_token_ids=False)
    whole = post(urls["pd"], "chat/completions", body).json()
    assert "prompt_token_ids" not in whole and "token_ids" not in whole["choices"][0]
    for event in chat_events(urls["pd"], body)[:-1]:
        assert "prompt_token_ids" not in event and all("token_ids" not in c for c in event["choices"])


def test_chat_streamed_ids_equal_non_streamed_with_a_stop_string(urls):
    """A stop string's first characters are held back, but their token ids still go out, once."""
    full = post(urls["pd"], "chat/completions", WITH_IDS).json()["choices"][0]["message"]["content"]
    starts = [i for i in range(1, len(full) - 1) if "\ufffd" not in full[i:i + 2]]
    if not starts:
        pytest.skip("random model produced no printable text to stop on")
    body = dict(WITH_IDS, stop=[full[starts[0]:starts[0] + 2]])
    whole = post(urls["pd"], "chat/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and len(whole["token_ids"]) < 16
    chunks = [e for e in chat_events(urls["pd"], body)[:-1] if e["choices"]]
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["message"]["content"]


def test_models_by_id(urls):
    c = client(urls["pd"])
    model = c.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        c.models.retrieve("gpt-17")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_openai_client_sees_refused_fields_as_bad_requests(urls):
    c = client(urls["pd"])
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="x", max_tokens=4, n=2)
    assert err.value.body["param"] == "n"


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}
REFUSED = [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
           ("response_format", {"type": "json_object"}), ("logit_bias", {"65": 10}), ("presence_penalty", 0.5),
           ("frequency_penalty", -1), ("n", 2), ("logprobs", True), ("top_logprobs", 3), ("functions", [{}])]
REFUSED_COMPLETION = [("n", 3), ("best_of", 2), ("logprobs", 1), ("echo", True), ("suffix", "x"),
                      ("logit_bias", {"65": 10}), ("presence_penalty", 0.5), ("frequency_penalty", 1.5),
                      ("tools", [{}]), ("response_format", {"type": "json_object"})]


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}/v1/{path}", data=json.dumps(body), timeout=30,
                         headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path, base, field, value",
                         [("chat/completions", CHAT, f, v) for f, v in REFUSED]
                         + [("completions", COMPLETION, f, v) for f, v in REFUSED_COMPLETION])
def test_unimplemented_fields_are_refused_by_name(urls, path, base, field, value):
    resp = post(urls["pd"], path, dict(base, **{field: value}))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, base", [("chat/completions", CHAT), ("completions", COMPLETION)])
def test_neutral_values_of_unimplemented_fields_are_accepted(urls, path, base):
    neutral = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u",
               "kv_transfer_params": {"do_remote_prefill": True}}
    neutral.update({"logprobs": False, "tool_choice": "none", "response_format": {"type": "text"}}
                   if path.startswith("chat") else {"best_of": 1, "echo": False, "logprobs": None})
    assert post(urls["pd"], path, dict(base, **neutral)).status_code == 200


STRICT = [
    ({"stream": "false"}, "stream"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"ignore_eos": 0}, "ignore_eos"),
    ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"seed": 2 ** 63, "temperature": 0.7}, "seed"),
    ({"seed": -(2 ** 63) - 1, "temperature": 0.7}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [260]}, "stop_token_ids[0]"),  # the byte tokenizer's vocabulary is 260
    ({"max_tokens": True}, "max_tokens"),
    ({"return_token_ids": "yes"}, "return_token_ids"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"surprise": 1}, "surprise"),
]


@pytest.mark.parametrize("path, base", [("chat/completions", CHAT), ("completions", COMPLETION)])
@pytest.mark.parametrize("extra, param", STRICT)
def test_strict_types_name_the_field(urls, path, base, extra, param):
    resp = post(urls["pd"], path, dict(base, **extra))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": [65, 260]}, "prompt"),
    ("completions", {"prompt": [[65], [1.0]]}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
])
def test_prompt_and_message_errors_name_the_field(urls, path, body, param):
    resp = post(urls["pd"], path, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_in_range_edges_are_served(urls):
    for seed in (2 ** 63 - 1, -(2 ** 63)):
        resp = post(urls["pd"], "completions", dict(COMPLETION, seed=seed, temperature=0.7))
        assert resp.status_code == 200, resp.text
    resp = post(urls["pd"], "completions", dict(COMPLETION, prompt=[0, 259], stop_token_ids=[259]))
    assert resp.status_code == 200, resp.text


def test_zz_every_pool_is_all_free_after_the_run(urls):
    for u in urls.values():
        reports = wait_all_free(u)
        assert all(r["healthy"] for r in reports.values())
