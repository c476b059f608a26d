"""A few questions put to a freshly launched deployment, answers printed beside the load report.

They go through the router's public `/v1/chat/completions`, greedy, like any client's, so
the answers shown are what the served model really says.
"""
from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

from pd.cluster.config import DeployConfig

logger = logging.getLogger(__name__)

SAMPLE_QUESTIONS = ("What is the capital of France?", "Name three primary colors.",
                    "Which planet is known as the red planet?")
ANSWER_TIMEOUT_S = 120.0
MAX_ANSWER_TOKENS = 48


def ask(url: str, config: DeployConfig, question: str) -> str:
    """The model's greedy answer to one user message; raises OSError / ValueError on failure."""
    body = {"model": config.model.name, "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_ANSWER_TOKENS, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    key = next(iter(config.router.tenant_keys().values()), None)  # any tenant's key will do
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S) as response:
        answer = json.loads(response.read())
    return str(answer["choices"][0]["message"]["content"]).strip()


def print_sample_answers(url: str, config: DeployConfig) -> None:
    print("{:-^60}".format(" Sample answers (greedy, /v1/chat/completions) "), flush=True)
    for question in SAMPLE_QUESTIONS:
        try:
            answer = ask(url, config, question)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            answer = f"<no answer: {exc}>"
        print(f"Q: {question}\nA: {answer}", flush=True)
    print("-" * 60, flush=True)
