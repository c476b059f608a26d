"""A model and its tokenizer must speak the same ids (real tokenizer trained here, real checkpoint,
real workers and router over HTTP):
- a random-weight model declaring another vocabulary than the byte tokenizer's 260 ids is refused
  when the deploy config is validated (`pd.launch` exits 2 naming both numbers, nothing serves);
- a checkpoint whose tokenizer knows more ids than the model has rows is refused at worker start,
  naming both numbers;
- a padded checkpoint (embedding rows past the tokenizer's ids, here rows that dominate the
  logits, as untrained padding can) serves, and no response ever carries an id the tokenizer
  cannot decode, greedy or sampled, streamed or not;
- an id the tokenizer cannot decode that reaches the router anyway is shown as no text, never a 500.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import requests
import torch
from rel_deploy import SECRET, LocalDeployment, local_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pd.cluster.config import ConfigError, DeployConfig
from pd.cluster.roles import Role
from pd.engine.model.checkpoint import save_checkpoint
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model
from pd.engine.text.tokenizer import ByteTokenizer, load_tokenizer
from pd.engine.text.vocab import VocabularyMismatch
from pd.router.text_stream import TextStream
from pd.worker.worker import Worker, WorkerSpec

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. ", "Padding rows are never sampled, said the model. ",
          "Grüße aus München! Ça va? 日本語のテキスト。 ", "hello world, hello there, a tokenizer of our own. "]
TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, bos_token_id=1,
            eos_token_id=2)


def write_tokenizer(path, vocab_size: int) -> int:
    """A byte-level BPE trained on CORPUS, saved as a checkpoint's tokenizer files; returns its id count."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 20, trainer)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return load_tokenizer(str(path)).vocab_size


def write_model(path, vocab_size: int, dominant_from: int | None = None) -> None:
    """A seeded random model of `vocab_size` rows; rows from `dominant_from` on outscore the others."""
    model = build_model(ModelConfig(vocab_size=vocab_size, **TINY), seed=0)
    if dominant_from is not None:
        with torch.no_grad():
            model.lm_head.weight[:dominant_from] *= 0.01
            model.lm_head.weight[dominant_from:] *= 20.0
    save_checkpoint(model, path)


@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("padded")
    num_ids = write_tokenizer(path, 400)
    model_vocab = (num_ids // 128 + 2) * 128  # rounded up past the tokenizer, as padded checkpoints are
    write_model(path, model_vocab, dominant_from=num_ids)
    return path, num_ids, model_vocab


def test_byte_model_declaring_another_vocabulary_is_refused_before_serving(tmp_path):
    with pytest.raises(ConfigError) as info:
        DeployConfig.from_dict({"model": {"architecture": {"vocab_size": 32000}}})
    message = str(info.value)
    assert "model.architecture" in message and "32000" in message and "260" in message
    assert "declare vocab_size: 260" in message
    assert DeployConfig.from_dict({"model": {"architecture": {"vocab_size": 260}}}).model.path is None
    assert DeployConfig().model.architecture.overrides() == {}  # (the default model is the byte tokenizer's 260)
    # the launcher refuses it before Ray or any worker starts
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  architecture: {vocab_size: 32000, hidden_size: 64, num_heads: 4, num_kv_heads: 2}\n"
                   "router: {port: 0}\n")
    run = subprocess.run([sys.executable, "-m", "pd.launch", "--config", str(bad)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "32000" in run.stderr and "260" in run.stderr and "serving at" not in run.stdout


def test_tokenizer_larger_than_the_model_is_refused_at_worker_start(tmp_path):
    num_ids = write_tokenizer(tmp_path, 400)
    small = num_ids - 50
    write_model(tmp_path, small)
    config = local_config("colocated", model__path=str(tmp_path), model__architecture={})
    worker = Worker(WorkerSpec("w", Role.BOTH, config, SECRET))
    with pytest.raises(VocabularyMismatch) as info:
        asyncio.run(worker.start())
    assert f"has {num_ids} ids" in str(info.value) and f"vocab_size {small}" in str(info.value)
    assert worker.url is None  # nothing listens
    # and the launcher, where the checkpoint is readable, refuses it before Ray or any worker starts
    yaml_path = tmp_path / "deploy.yaml"
    yaml_path.write_text(f"model:\n  path: {tmp_path}\ntopology: {{mode: colocated}}\nrouter: {{port: 0}}\n")
    run = subprocess.run([sys.executable, "-m", "pd.launch", "--config", str(yaml_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"has {num_ids} ids" in run.stderr and f"vocab_size {small}" in run.stderr
    assert "Traceback" not in run.stderr and "serving at" not in run.stdout


def _completion(url: str, body: dict) -> list[int]:
    resp = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _streamed(url: str, body: dict) -> list[int]:
    ids = []
    with requests.post(f"{url}/v1/completions", json=dict(body, stream=True), stream=True, timeout=60) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids += [t for c in event["choices"] for t in c.get("token_ids") or []]
    return ids


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_padded_checkpoint_serves_and_never_emits_an_unknown_id(padded_checkpoint, mode):
    path, num_ids, model_vocab = padded_checkpoint
    assert model_vocab > num_ids
    config = local_config(mode, model__path=str(path), model__architecture={})
    emitted: list[int] = []
    with LocalDeployment(config) as dep:
        for i, sampling in enumerate([{"temperature": 0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 1.5, "top_p": 1.0, "seed": 11}]):
            body = {"prompt": f"{i} The quick brown fox", "max_tokens": 24, "ignore_eos": True,
                    "return_token_ids": True, **sampling}
            for ids in (_completion(dep.url, body), _streamed(dep.url, body)):
                assert len(ids) == 24
                emitted += ids
        dep.wait_all_free()
    unknown = sorted({t for t in emitted if t >= num_ids})
    assert not unknown, f"ids the tokenizer ({num_ids} ids) cannot decode: {unknown[:10]}"


def test_an_unknown_id_reaching_the_router_is_no_text_never_an_error():
    tokenizer = ByteTokenizer()
    stream = TextStream(tokenizer, stop=["!"])
    shown = stream.push([104, 105]) + stream.push([tokenizer.vocab_size + 5, 32]) + stream.push([4000, 33, 120])
    assert shown + stream.flush() == "hi "  # the stop string still applies past the unknown ids
    assert stream.stopped and stream.num_unknown == 2 and len(stream.token_ids) == 7
