"""The prefill planner on Ray: real worker processes (Ray actors), the real router over HTTP.

A `planner`-mode 1P1D deployment takes both paths (its cold start tries remote prefill
and local prefill on D), each token-identical to a colocated deployment's greedy output;
the unmodified `openai` client parses the responses carrying the `pdkv_route` extension
(non-stream: on each choice; stream: on the last chunk's choice); every pool ends all free.
"""
from __future__ import annotations

import openai

from tests.helpers.e2e import PROMPTS, complete, e2e_config, stream_events, wait_all_free
from pd.deploy.launch import Deployment

PLANNER = {"mode": "planner", "min_samples": 2, "exploration_rate": 0.0, "seed": 0}


def test_planner_paths_are_token_identical_and_parse_with_openai(ray_instance):
    with Deployment(e2e_config("local-colocated.yaml")) as colocated:
        want = [complete(colocated.url, p, ignore_eos=True)["choices"][0]["token_ids"] for p in PROMPTS]
        wait_all_free(colocated.url)
    with Deployment(e2e_config("local.yaml", router__planner=PLANNER, router__report_route=True)) as dep:
        decisions = set()
        for _ in range(2):
            for prompt, ids in zip(PROMPTS, want, strict=True):
                choice = complete(dep.url, prompt, ignore_eos=True)["choices"][0]
                assert choice["token_ids"] == ids, prompt
                decisions.add(choice["pdkv_route"]["decision"])
        assert "local" in decisions and decisions & {"remote", "remote_prefix"}, decisions  # (shared prefixes)
        events = stream_events(dep.url, PROMPTS[1], ignore_eos=True)
        last = [e for e in events[:-1] if e["choices"]][-1]["choices"][0]
        assert last["finish_reason"] == "length" and last["pdkv_route"]["ttft_s"] > 0
        client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=60)
        parsed = client.completions.create(model="pdkv-tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
        assert parsed.choices[0].finish_reason in ("length", "stop")
        assert parsed.choices[0].model_extra["pdkv_route"]["decision"] in ("remote", "remote_prefix", "local")
        streamed = list(client.completions.create(model="pdkv-tiny", prompt=PROMPTS[0], max_tokens=5,
                                                  temperature=0, stream=True))
        assert streamed[-1].choices[0].model_extra["pdkv_route"]["decision"]
        chat = client.chat.completions.create(model="pdkv-tiny", max_tokens=4, temperature=0, stream=True,
                                              messages=[{"role": "user", "content": "hello"}])
        assert list(chat)[-1].choices[0].finish_reason is not None
        wait_all_free(dep.url)
