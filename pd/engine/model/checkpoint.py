"""Load and write Hugging Face-style checkpoints (config.json + *.safetensors).

A `.gguf` file is accepted wherever a directory is: it is converted once into
a cached Hugging Face directory (`pd.engine.model.gguf.resolve_checkpoint`).

Tensor names follow the Llama layout that Qwen2 and Mistral share. Loading is
strict: an unknown tensor, a missing tensor or a tensor of the wrong shape is
an error naming every offender, and nothing half-loaded is returned.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pd.engine.model.config import ModelConfig
from pd.engine.model.hf_config import model_config_from_hf
from pd.engine.model.llama import CausalLM, build_model

logger = logging.getLogger(__name__)

# Buffers some exporters write that carry no weights we need.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory that does not describe the model it claims to."""


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The Hugging Face directory of `path`: itself, or the cached conversion of a .gguf file."""
    from pd.engine.model.gguf import resolve_checkpoint  # reads gguf files only when given one

    return Path(resolve_checkpoint(path))


def load_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of the checkpoint at `path`, in `dtype` (default: the config's).

    Raises CheckpointError naming the config field pdkv does not implement.
    """
    config_file = checkpoint_dir(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} not found")
    try:
        hf = json.loads(config_file.read_text())
        if not isinstance(hf, dict):
            raise ValueError("expected a JSON object")
        return model_config_from_hf(hf, dtype=dtype)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{config_file}: {exc}") from exc


def load_checkpoint(path: str | os.PathLike, dtype: str | None = None, device: str = "cpu") -> CausalLM:
    """The model stored in `path` (a directory or a .gguf file), in `dtype` (default: the config's)."""
    path = checkpoint_dir(path)
    cfg = load_config(path, dtype)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    model = build_model(cfg, seed=None, device=device)
    # HF's names, each a tensor to fill: a parameter, or a view of a fused one (q|k|v, gate|up)
    params = model.state_dict(keep_vars=True)
    expected = set(params)
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")  # tied: optional in the file
    loaded: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    misshaped: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    unknown.append(f"{name} (in {file.name})")
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    misshaped.append(f"{name}: file {tuple(tensor.shape)} vs model {tuple(params[name].shape)}")
                    continue
                loaded[name] = tensor
    missing = sorted(expected - set(loaded))
    problems = []
    if unknown:
        problems.append(f"unknown tensors: {sorted(unknown)}")
    if missing:
        problems.append(f"missing tensors: {missing}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {misshaped}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match {cfg.architecture}: " + "; ".join(problems))
    with torch.no_grad():
        for name, tensor in loaded.items():
            params[name].copy_(tensor.to(dtype=params[name].dtype))
    logger.info("loaded %d tensors from %d file(s) in %s", len(loaded), len(files), path)
    return model


def save_checkpoint(model: CausalLM, path: str | os.PathLike, max_shard_bytes: int | None = None) -> list[Path]:
    """Write `model` in HF layout; returns the safetensors files written.

    With `max_shard_bytes`, tensors are split over several files plus a
    `model.safetensors.index.json`, as large HF checkpoints are.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    tensors = {
        name: t.detach().contiguous().clone()
        for name, t in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {t: fname for fname, shard in zip(names, shards, strict=True) for t in shard}
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    written = []
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        written.append(out / fname)
    return written
