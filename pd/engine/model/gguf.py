"""GGUF files as Hugging Face checkpoint directories: converted once, then cached.

pdkv's engine and tokenizer read only Hugging Face directories. A `.gguf`
path is turned into one by `resolve_checkpoint`: the tensors are dequantized
(numpy, `gguf.quants.dequantize`) to float32 `model.safetensors`, the
architecture metadata becomes `config.json`, and the `tokenizer.ggml.*`
metadata becomes tokenizer.json / tokenizer_config.json (chat template
included) / generation_config.json (see `pd.engine.text.gguf_tokenizer`). The
engine then casts the float32 weights to the serving dtype.

llama.cpp's converter permutes the rows of the Llama Q and K projections
(per head, it interleaves the two rotary halves for its own rope kernel);
`unpermute_rope_rows` restores Hugging Face's rotate-half order.

Guarantees: a converted directory appears under its final name only when
complete (built aside, then renamed), and concurrent workers converting the
same file wait on one lock instead of colliding; the cache key covers the
file's path, size and mtime and the converter version, so a changed file is
converted again; metadata pdkv does not implement (another architecture,
rope scaling, a tokenizer it cannot reproduce) is refused, naming the key.
The cache is verified before it is served (`pd.engine.model.model_cache`): each
file's size and xxh3 digest are recorded at conversion and checked at every
resolve, and an entry that differs (truncated, zeroed, no manifest) is logged,
naming the file, and converted again; scratch directories of dead conversions
are removed; a full disk is a `GGUFError` naming the cache directory.

CLI: `python -m pd.engine.model.gguf IN.gguf OUT_DIR`.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from pd.engine.text.gguf_tokenizer import GGUFTokenizerError, write_tokenizer_files
from pd.engine.model.files import locate_model
from pd.engine.model.model_cache import (OUT_OF_SPACE, cache_root, manifest_problem, scratch_dir, sweep_dead_scratch,
                                         write_manifest)

logger = logging.getLogger(__name__)

CONVERTER_VERSION = "1"  # bump when the conversion's output changes, to invalidate caches
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFError(ValueError):
    """A GGUF file pdkv cannot serve exactly; the message names the metadata key or tensor."""


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A Hugging Face directory for `path`: `path` itself unless it is a .gguf file,
    else its cached conversion (converted now if needed).

    The cache lives in `$PDKV_CACHE_DIR/gguf`, else `$XDG_CACHE_HOME/pdkv/gguf`, else
    `~/.cache/pdkv/gguf`. Raises GGUFError for a file pdkv cannot serve or a cache it cannot write.
    """
    src = locate_model(path)
    if src.suffix.lower() != ".gguf":
        return src
    if not src.is_file():
        raise GGUFError(f"{src}: no such GGUF file")
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()
    root = cache_root() / "gguf"
    final = root / f"{src.stem}-{st.st_size}-{key[:16]}"
    sweep_dead_scratch(root)  # what killed conversions left (of any model)
    if (final / "config.json").is_file() and manifest_problem(final) is None:
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{final.name}.lock", "w")
    except OSError as exc:
        raise GGUFError(f"{root}: cannot write the converted model cache ({exc.strerror}); "
                        "set PDKV_CACHE_DIR to a writable directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker converting the same file: wait for it
        if final.exists():
            problem = manifest_problem(final)
            if problem is None:
                return final
            logger.warning("the converted cache of %s is not what was converted: %s; converting it again",
                           src.name, problem)
            _discard(final)
        logger.info("converting %s into %s (once)", src, final)
        _convert_aside(src, final)
    return final


def convert_gguf(src: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the Hugging Face directory of the GGUF file `src` into `out_dir` (created)."""
    import gguf

    src, out = Path(src), Path(out_dir)
    reader = gguf.GGUFReader(str(src))
    meta = {name: field for name, field in reader.fields.items()}

    def get(key: str, default: Any = None) -> Any:
        return _field_value(meta[key], key) if key in meta else default

    arch = get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"general.architecture: {arch!r} is not supported (one of {sorted(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    config = _hf_config(get, arch, tied="output.weight" not in names)
    out.mkdir(parents=True, exist_ok=True)
    try:
        special = write_tokenizer_files(get, out, config["max_position_embeddings"])
    except GGUFTokenizerError as exc:
        raise GGUFError(str(exc)) from exc
    config.update(special)
    if config["vocab_size"] != len(get("tokenizer.ggml.tokens")):
        raise GGUFError(f"{arch}.vocab_size: {config['vocab_size']} but tokenizer.ggml.tokens has "
                        f"{len(get('tokenizer.ggml.tokens'))} entries")
    tensors = _hf_tensors(reader, config, permuted_qk=arch == "llama")
    from safetensors.numpy import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": src.name})
    os.chmod(out / "model.safetensors", 0o644)  # the writer creates it private; a cache is shared
    (out / "config.json").write_text(json.dumps(config, indent=2))
    logger.info("converted %s: %d tensors, %s", src.name, len(tensors), config["architectures"][0])
    return out


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head it stores rotary pair (i, i + D/2) as rows
    (2i, 2i + 1); Hugging Face's rotate-half layout wants the two halves as blocks."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if rows % num_heads or head_dim % 2:
        raise GGUFError(f"Q/K projection of {rows} rows does not split into {num_heads} heads of even size")
    tail = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *tail).swapaxes(1, 2).reshape(weight.shape)


def _convert_aside(src: Path, final: Path, manifest: bool = True) -> None:
    """Convert into a sibling scratch directory, then rename: `final` is complete or absent."""
    scratch = scratch_dir(final)
    try:
        try:
            convert_gguf(src, scratch)
            if manifest:
                write_manifest(scratch)  # what resolve_checkpoint verifies before serving it
        except OSError as exc:
            if exc.errno in OUT_OF_SPACE:
                raise GGUFError(f"{final.parent}: no space left to convert {src.name} into ({exc.strerror}); "
                                "free some, or set PDKV_CACHE_DIR to a larger disk") from None
            raise
        try:
            os.rename(scratch, final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race to a complete copy: fine
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(scratch)


def _discard(directory: Path) -> None:
    """Moves a bad cache entry out of its name (at once), then deletes it; a deletion cut short
    leaves a scratch directory that the next resolve sweeps."""
    trash = scratch_dir(directory)
    os.rename(directory, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _field_value(field, key: str) -> Any:
    """One metadata value as Python (str, int, float, bool or a list of them)."""
    from gguf import GGUFValueType

    kind = field.types[0]
    try:
        if kind == GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            if not len(field.data):
                return []
            return np.concatenate([field.parts[i] for i in field.data]).tolist()
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]][0].item()
    except (UnicodeDecodeError, IndexError) as exc:
        raise GGUFError(f"{key}: unreadable value ({exc})") from exc


def _hf_config(get, arch: str, tied: bool) -> dict[str, Any]:
    def need(name: str) -> Any:
        value = get(f"{arch}.{name}")
        if value is None:
            raise GGUFError(f"{arch}.{name}: missing")
        return value

    scaling = get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{arch}.rope.scaling.type: {scaling!r} is not implemented (only plain rope)")
    factor = get(f"{arch}.rope.scaling.factor")
    if factor not in (None, 0.0, 1.0):
        raise GGUFError(f"{arch}.rope.scaling.factor: {factor!r} is not implemented")
    if get(f"{arch}.expert_count"):
        raise GGUFError(f"{arch}.expert_count: mixture-of-experts models are not supported")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(get(f"{arch}.attention.key_length") or hidden // heads)
    if int(get(f"{arch}.attention.value_length") or head_dim) != head_dim:
        raise GGUFError(f"{arch}.attention.value_length: differs from the key length {head_dim}")
    rope_dim = int(get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"{arch}.rope.dimension_count: {rope_dim} (partial rotary) is not implemented; "
                        f"head dim is {head_dim}")
    theta = _float32(get(f"{arch}.rope.freq_base") or 10000.0)
    tokens = get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get(f"{arch}.context_length") or 4096),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def _float32(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06. Its shortest float32 spelling
    is the value the model was trained with (the original config.json's)."""
    return float(str(np.float32(value)))


def _hf_tensors(reader, config: dict[str, Any], permuted_qk: bool) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    num_layers = config["num_hidden_layers"]
    out: dict[str, np.ndarray] = {}
    unknown = []
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, num_layers)
        if name is None:
            unknown.append(tensor.name)
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise GGUFError(f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized "
                            f"({exc})") from exc
        expected = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(expected)
        if permuted_qk and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            values = unpermute_rope_rows(values, config["num_attention_heads"])
        elif permuted_qk and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            values = unpermute_rope_rows(values, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(values)
    if unknown:
        # e.g. rope_freqs.weight (llama3-style rope scaling): not something to drop silently.
        raise GGUFError(f"tensors pdkv does not implement: {sorted(unknown)}")
    return out


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and int(layer) < num_layers and suffix in LAYER_TENSORS:
        return f"model.layers.{int(layer)}.{LAYER_TENSORS[suffix]}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.engine.model.gguf",
                                     description="Convert a GGUF file into a Hugging Face checkpoint directory.")
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path, help="created; must not exist or be empty")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.out_dir.exists() and any(args.out_dir.iterdir()):
        parser.error(f"out_dir {args.out_dir} exists and is not empty")
    if args.out_dir.exists():
        args.out_dir.rmdir()
    args.out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        _convert_aside(args.gguf_file, args.out_dir, manifest=False)
    except (GGUFError, OSError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
