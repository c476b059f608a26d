"""pd.tools.bench --vs-hf: the side-by-side run on a tiny checkpoint (the engine built as a
serving worker builds it, transformers on the same directory) and the CLI's argument checks."""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")

from kvcache.audit import assert_all_free
from pd.engine.model.checkpoint import save_checkpoint
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model
from pd.tools.vs_hf import divergences, serving_engine, side_by_side, summarize

TINY = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, bos_token_id=1, eos_token_id=2)


def save_tiny_checkpoint(path):
    """The tiny model with a tokenizer of its own: a worker serves a checkpoint with its tokenizer only.
    The prompts here are token ids, so a word-level vocabulary of the model's size is enough."""
    from tokenizers import Tokenizer, models

    save_checkpoint(build_model(TINY, seed=3), path)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY.vocab_size)}, unk_token="w0")).save(
        str(path / "tokenizer.json"))


def test_side_by_side_matches_hf_on_a_tiny_checkpoint(tmp_path):
    save_tiny_checkpoint(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    eng = serving_engine(str(tmp_path), num_requests=3)
    try:
        assert (eng.config.block_size, eng.config.attention_backend, eng.config.dtype) == (16, "auto", "float32")
        assert not eng.config.enable_prefix_caching
        prompts = {"a": list(range(3, 10)), "b": list(range(40, 61)), "c": [7, 8, 9, 250]}
        run = side_by_side(eng, hf, prompts, pad_id=0, max_new=6, rounds=2)
        assert_all_free(eng.kv_cache_manager)
    finally:
        eng.shutdown()
    assert all(len(run["ours"][rid]) == 6 == len(run["hf"][rid]) for rid in prompts)
    result = summarize(run, 3, 6, 2, "4-21")
    assert result["greedy_outputs_identical"] == "3/3"
    assert result["wall"]["decode_ratio"] > 0 and result["cpu"]["ours_decode_tokens_per_s"] > 0
    assert divergences(hf, prompts, run["ours"], run["hf"]) == []
    # A planted divergence is found at its position, with HF's own margin there.
    flipped = {rid: list(toks) for rid, toks in run["hf"].items()}
    flipped["b"][4] = (flipped["b"][4] + 1) % TINY.vocab_size
    (found,) = divergences(hf, prompts, flipped, run["hf"])
    assert (found["request"], found["first_divergence"], found["hf_token"]) == ("b", 4, run["hf"]["b"][4])
    assert found["hf_top1_top2_margin"] >= 0 and found["hf_logit_gap_hf_vs_pdkv_token"] >= 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "x.gguf"], "--model needs --vs-hf"),
    (["--vs-hf", "--model", "x.gguf", "--rounds", "0"], "--rounds must be positive"),
])
def test_cli_refuses_bad_arguments(argv, message):
    proc = subprocess.run([sys.executable, "-m", "pd.tools.bench", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr
