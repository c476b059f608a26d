"""Read a Hugging Face `config.json` (Llama, Qwen2, Mistral) into a ModelConfig, strictly.

Guarantees: every field pdkv's model reads is taken from the dict with
transformers' own defaults for that architecture; every setting that would
change the model's maths and that pdkv does not implement (a rope type other
than "default", partial rotary, biases the model lacks, another activation,
quantized weights, an unknown architecture) raises `HFConfigError` naming the
field. Nothing is silently ignored that transformers would honour.
"""
from __future__ import annotations

from typing import Any

from pd.engine.model.config import DTYPES, FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

LLAMA, QWEN2, MISTRAL = "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"
MODEL_TYPES = {LLAMA: "llama", QWEN2: "qwen2", MISTRAL: "mistral"}
# transformers' defaults per architecture where they differ from ModelConfig's.
MAX_POSITIONS = {LLAMA: 2048, QWEN2: 32768, MISTRAL: 131072}
QWEN2_SLIDING_WINDOW = 4096
QWEN2_MAX_WINDOW_LAYERS = 28
MISTRAL_SLIDING_WINDOW = 4096
ROPE_KEYS = {"rope_type", "type", "rope_theta"}


class HFConfigError(ValueError):
    """A config.json field that pdkv cannot honour; the message names the field."""


def model_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of `hf`; `dtype` (the caller's choice) wins over the file's."""
    arch = _architecture(hf)
    _refuse_unimplemented(hf, arch)
    num_layers = _int(hf, "num_hidden_layers")
    num_heads = _int(hf, "num_attention_heads")
    layer_types, sliding_window = _attention_layout(hf, arch, num_layers)
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    head_dim = hf.get("head_dim")
    return ModelConfig(
        vocab_size=_int(hf, "vocab_size"),
        hidden_size=_int(hf, "hidden_size"),
        intermediate_size=_int(hf, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim) if head_dim is not None else None,
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings") or MAX_POSITIONS[arch]),
        layer_types=layer_types,
        sliding_window=sliding_window,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases in transformers; the key is pdkv's own, for its test models.
        attention_bias=bool(hf.get("attention_bias", True)) if arch == QWEN2 else False,
        dtype=_dtype(hf, dtype),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        architecture=arch,
    )


def _int(hf: dict[str, Any], key: str) -> int:
    if key not in hf or hf[key] is None:
        raise HFConfigError(f"{key}: missing")
    try:
        return int(hf[key])
    except (TypeError, ValueError):
        raise HFConfigError(f"{key}: expected an integer, got {hf[key]!r}") from None


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    if archs is None:
        by_type = {v: k for k, v in MODEL_TYPES.items()}
        if model_type not in by_type:
            raise HFConfigError(f"architectures: missing, and model_type {model_type!r} is not one of "
                                f"{sorted(by_type)}")
        return by_type[model_type]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in MODEL_TYPES:
        raise HFConfigError(f"architectures: {archs!r} is not supported; pdkv implements exactly one of "
                            f"{sorted(MODEL_TYPES)}")
    arch = archs[0]
    if model_type is not None and model_type != MODEL_TYPES[arch]:
        raise HFConfigError(f"model_type: {model_type!r} does not match architectures {archs!r} "
                            f"(expected {MODEL_TYPES[arch]!r})")
    return arch


def _refuse_unimplemented(hf: dict[str, Any], arch: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act: {act!r} is not implemented (only 'silu')")
    if hf.get("mlp_bias"):
        raise HFConfigError("mlp_bias: true is not implemented")
    if arch != QWEN2 and hf.get("attention_bias"):
        # transformers' Llama puts the bias on o_proj too; pdkv's attention has q/k/v biases only.
        raise HFConfigError(f"attention_bias: true is not implemented for {arch}")
    if hf.get("quantization_config"):
        raise HFConfigError("quantization_config: quantized checkpoints are not supported; "
                            "give a float checkpoint (or a .gguf file, which pdkv dequantizes)")
    factor = hf.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise HFConfigError(f"partial_rotary_factor: {factor!r} is not implemented (only 1.0)")


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_parameters (transformers 5) or rope_scaling + rope_theta (earlier); default rope only."""
    theta = hf.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise HFConfigError(f"{key}: expected a mapping, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise HFConfigError(f"{key}.rope_type: {rope_type!r} is not implemented (only 'default')")
        extra = sorted(set(params) - ROPE_KEYS)
        if key == "rope_parameters" and extra:
            # e.g. partial_rotary_factor, or a per-layer-type mapping: not plain default rope.
            raise HFConfigError(f"{key}.{extra[0]}: not implemented (default rope takes only rope_theta)")
        if "rope_theta" in params:
            if theta is not None and float(theta) != float(params["rope_theta"]):
                raise HFConfigError(f"{key}.rope_theta: {params['rope_theta']!r} disagrees with "
                                    f"rope_theta {theta!r}")
            theta = params["rope_theta"]
    return float(theta if theta is not None else 10000.0)


def _attention_layout(hf: dict[str, Any], arch: str, num_layers: int) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) as transformers applies them to this architecture."""
    given = hf.get("layer_types")
    if arch == QWEN2:
        # Qwen2Config: the window exists only with use_sliding_window; then layers from
        # max_window_layers on slide unless layer_types says otherwise.
        if not hf.get("use_sliding_window", False):
            if given is not None and SLIDING_ATTENTION in given:
                raise HFConfigError("layer_types: lists sliding_attention but use_sliding_window is false")
            return None, None
        window = hf.get("sliding_window", QWEN2_SLIDING_WINDOW)
        if window is None:
            return None, None
        if given is None:
            first = int(hf.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS))
            given = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    elif arch == MISTRAL:
        # MistralAttention uses config.sliding_window in every layer.
        window = hf.get("sliding_window", MISTRAL_SLIDING_WINDOW)
        if window is None:
            return None, None
        if given is not None and any(t != SLIDING_ATTENTION for t in given):
            raise HFConfigError("layer_types: Mistral slides in every layer; mixed layer types are not "
                                "what transformers runs")
        given = [SLIDING_ATTENTION] * num_layers
    else:
        # transformers' Llama has no window; layer_types + sliding_window is pdkv's own extension.
        window = hf.get("sliding_window")
        if given is None:
            return None, None
    if not isinstance(given, list | tuple) or len(given) != num_layers:
        raise HFConfigError(f"layer_types: expected {num_layers} entries, got {given!r}")
    bad = sorted({t for t in given if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
    if bad:
        raise HFConfigError(f"layer_types: {bad} not implemented (only {FULL_ATTENTION}, {SLIDING_ATTENTION})")
    if SLIDING_ATTENTION not in given:
        return tuple(given), None
    if not isinstance(window, int) or window <= 0:
        raise HFConfigError(f"sliding_window: expected a positive integer, got {window!r}")
    return tuple(given), window


def _dtype(hf: dict[str, Any], dtype: str | None) -> str:
    if dtype is not None:
        return dtype
    for key in ("dtype", "torch_dtype"):
        value = hf.get(key)
        if value is not None:
            if value not in DTYPES:
                raise HFConfigError(f"{key}: {value!r} is not one of {sorted(DTYPES)}")
            return value
    return "float32"
