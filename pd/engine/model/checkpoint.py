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
from collections.abc import Callable
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
    model = build_model(cfg, seed=None, device=device)
    params = model.state_dict(keep_vars=True)
    fill_from_checkpoint(path, model, {name: tuple(p.shape) for name, p in params.items()})
    return model


# (dim, start, stop) of a full tensor: the part of it one tensor-parallel rank holds
SliceOf = Callable[[str], "tuple[int, int, int] | None"]


def fill_from_checkpoint(path: str | os.PathLike, model: CausalLM, full_shapes: dict[str, tuple[int, ...]],
                         slice_of: SliceOf | None = None) -> None:
    """Fills `model`'s tensors (HF names) from the checkpoint at `path`.

    `full_shapes`: every tensor the checkpoint must hold, with its full shape (a file tensor of another
    shape is refused). `slice_of(name)`: the part of a full tensor `model` holds, read alone from the
    file (safetensors' `get_slice`: a tensor-parallel rank never reads the other ranks' rows); None:
    the whole tensor. A name in `full_shapes` that `model` lacks (a rank without the LM head) is skipped.
    """
    path = checkpoint_dir(path)
    cfg = model.config
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    # HF's names, each a tensor to fill: a parameter, or a view of a fused one (q|k|v, gate|up)
    params = model.state_dict(keep_vars=True)
    expected = set(full_shapes)
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")  # tied: optional in the file
    loaded: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    unknown: list[str] = []
    misshaped: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in full_shapes:
                    unknown.append(f"{name} (in {file.name})")
                    continue
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                if shape != tuple(full_shapes[name]):
                    misshaped.append(f"{name}: file {shape} vs model {tuple(full_shapes[name])}")
                    continue
                seen.add(name)
                if name in params:
                    loaded[name] = _read(part, shape, None if slice_of is None else slice_of(name))
    missing = sorted(expected - seen)
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
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise CheckpointError(f"{name}: the part read {tuple(tensor.shape)} does not fit the model's "
                                      f"{tuple(params[name].shape)}")
            params[name].copy_(tensor.to(dtype=params[name].dtype))
    logger.info("loaded %d tensors from %d file(s) in %s", len(loaded), len(files), path)


def _read(part, shape: tuple[int, ...], piece: tuple[int, int, int] | None) -> torch.Tensor:
    """The whole tensor, or rows start:stop along dim (only those bytes are read)."""
    if piece is None:
        return part[:]
    dim, start, stop = piece
    index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
    return part[index]


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
