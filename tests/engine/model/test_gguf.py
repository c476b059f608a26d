"""GGUF files: converted once into a Hugging Face directory that equals transformers' own GGUF loading
(weights, logits, tokenizer ids), cached atomically; what pdkv cannot serve is refused, naming the key."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the reference GGUF loader")
pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")

from gguf_cases import CORPUS, hf_model, llama_cpp_permute, train_tokenizer, write_gguf
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kvcache.audit import assert_all_free
from pd.engine.model.checkpoint import load_checkpoint
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.gguf import GGUFError, resolve_checkpoint, unpermute_rope_rows
from pd.engine.sample.params import SamplingParams

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer_parts():
    return train_tokenizer()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_equals_transformers_gguf_loader(tmp_path, cache_dir, tokenizer_parts, kind):
    tokens, merges = tokenizer_parts
    source = hf_model(kind, len(tokens))
    path = write_gguf(tmp_path / f"tiny-{kind}.gguf", source, tokens, merges, arch=kind)
    directory = resolve_checkpoint(path)
    assert directory.parent == cache_dir / "gguf"

    # Q/K rows are back in Hugging Face order: F32 tensors equal the source model's exactly.
    converted = load_file(str(directory / "model.safetensors"))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(converted[name], source.state_dict()[name]), name
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference.state_dict()[name]), name
    assert ("lm_head.weight" in converted) == (kind == "qwen2")  # tied embeddings stay tied

    # (the torch backend: the loaded model's own weights are compared below, not the fused path's panels)
    engine = Engine(EngineConfig(model_path=str(path), block_size=4, num_blocks=128, attention_backend="torch"))
    prompt = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(CORPUS[1]).ids
    got = engine.generate_sync({"a": prompt}, SamplingParams(max_tokens=12, ignore_eos=True))["a"]
    assert_all_free(engine.kv_cache_manager)
    full = prompt + got
    with torch.no_grad():
        want = reference(torch.tensor([full])).logits[0]
    torch.testing.assert_close(engine.runner.model.reference_logits(full), want, atol=1e-5, rtol=0)
    assert want[len(prompt) - 1:-1].argmax(-1).tolist() == got


def test_tokenizer_files_equal_transformers_gguf_tokenizer(tmp_path, cache_dir, tokenizer_parts):
    tokens, merges = tokenizer_parts
    path = write_gguf(tmp_path / "tiny.gguf", hf_model("llama", len(tokens)), tokens, merges)
    directory = resolve_checkpoint(path)
    mine = Tokenizer.from_file(str(directory / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = CORPUS + ["<|im_start|>user\nHi 42<|im_end|>\n", "  spaces\n\n\ttabs  ", "unseen w\u00f6rds \u00e7a 9876"]
    for text in texts:
        ids = mine.encode(text).ids
        assert ids == reference(text, add_special_tokens=True)["input_ids"], text
        assert mine.decode(ids, skip_special_tokens=False) == text
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert config["add_bos_token"] is False and "<|im_start|>" in config["chat_template"]
    assert json.loads((directory / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert json.loads((directory / "config.json").read_text())["eos_token_id"] == 2


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    permuted = llama_cpp_permute(weight, 6)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_rope_rows(permuted, 6), weight)


def test_conversion_is_cached_and_redone_when_the_file_changes(tmp_path, cache_dir, tokenizer_parts):
    tokens, merges = tokenizer_parts
    path = write_gguf(tmp_path / "tiny.gguf", hf_model("llama", len(tokens)), tokens, merges)
    first = resolve_checkpoint(path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint(path) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    second = resolve_checkpoint(path)
    assert second != first and (second / "config.json").is_file()
    assert sorted(p.name for p in (cache_dir / "gguf").iterdir() if p.is_dir()) == sorted([first.name, second.name])


def test_concurrent_workers_share_one_conversion(tmp_path, cache_dir, tokenizer_parts):
    tokens, merges = tokenizer_parts
    path = write_gguf(tmp_path / "tiny.gguf", hf_model("llama", len(tokens)), tokens, merges)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDKV_CACHE_DIR=str(cache_dir))
    code = "import sys; from pd.engine.model.gguf import resolve_checkpoint; print(resolve_checkpoint(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1
    assert [p.name for p in (cache_dir / "gguf").iterdir() if p.is_dir()] == [Path(outs.pop()).name]
    assert load_checkpoint(path).config.num_layers == 2


def test_cli_converts_into_a_directory(tmp_path, tokenizer_parts):
    tokens, merges = tokenizer_parts
    path = write_gguf(tmp_path / "tiny.gguf", hf_model("llama", len(tokens)), tokens, merges)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pd.engine.model.gguf", str(path), str(out)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]
    again = subprocess.run([sys.executable, "-m", "pd.engine.model.gguf", str(path), str(out)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "not empty" in again.stderr


REFUSED = {
    "architecture": (dict(arch="gemma"), r"general\.architecture: 'gemma'"),
    "rope-scaling": (dict(extra_kv={"llama.rope.scaling.type": "linear"}), r"llama\.rope\.scaling\.type: 'linear'"),
    "rope-freqs": (dict(extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)}), r"rope_freqs\.weight"),
    "tokenizer-model": (dict(tokenizer_model="t5"), r"tokenizer\.ggml\.model: 't5'"),
    "pre-tokenizer": (dict(pre="deepseek-llm"), r"tokenizer\.ggml\.pre: 'deepseek-llm'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_gguf_is_refused_naming_the_key(tmp_path, cache_dir, tokenizer_parts, case):
    tokens, merges = tokenizer_parts
    kwargs, message = REFUSED[case]
    path = write_gguf(tmp_path / "bad.gguf", hf_model("llama", len(tokens)), tokens, merges, **kwargs)
    with pytest.raises(GGUFError, match=message):
        Engine(EngineConfig(model_path=str(path), num_blocks=16))
    assert not any(p.is_dir() for p in (cache_dir / "gguf").iterdir())  # nothing half-converted left behind
