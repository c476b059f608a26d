"""gpu_check: the transformers side of the engine comparison, on the engine's own weights and prompts.

`to_hf_model` builds the transformers model (Llama / Qwen2 / Mistral class from
the engine's `ModelConfig.to_hf_dict`) and loads the engine model's state dict
into it: the parameter names are the same (pd/engine/model/llama.py follows
HF's layout), so both sides compute with identical weights. `measure_hf` times
`generate` with a static cache; on CUDA transformers then compiles the decode
step (torch.compile, "reduce-overhead": CUDA graphs), as its docs recommend
for fast generation. Prefill is not compiled (transformers compiles decode
only), so only one shape per batch size is compiled. Prompts are of one
length per batch, so no padding enters either side.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from pd.engine.model.llama import CausalLM


@dataclasses.dataclass(frozen=True)
class HFTiming:
    """One batch through transformers: time to the first token, decode rate, the tokens it produced."""

    first_token_s: float
    decode_tokens_per_s: float
    tokens: list[list[int]]


def to_hf_model(model: CausalLM, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers causal LM with exactly `model`'s weights, on `device` in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = model.config.to_hf_dict()
    model_type = hf.pop("model_type")
    for key in ("architectures", "torch_dtype"):
        hf.pop(key, None)
    config = AutoConfig.for_model(model_type, **hf)
    config.architectures = [model.config.architecture]
    hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: t.detach().to(dtype) for name, t in model.state_dict().items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    # transformers may keep rotary buffers of its own (computed from the config, not loaded)
    missing = [m for m in missing if not m.endswith("inv_freq") and not (
        model.config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"the engine's weights do not map onto {type(hf_model).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    return hf_model.to(device).eval()


def _generate(hf_model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, compile_decode: bool) -> torch.Tensor:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static", disable_compile=not compile_decode,
                              pad_token_id=0, eos_token_id=None, bos_token_id=None)
    with torch.inference_mode():
        return hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)


def _timed(fn) -> tuple[float, torch.Tensor]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def measure_hf(hf_model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, compile_decode: bool = True,
               warmups: int = 2, repeats: int = 2) -> HFTiming:
    """Greedy `generate` of `new_tokens` for the batch `prompts` (one length), static cache.

    The first-token time is a `generate` of one token (prefill and one sample); the decode rate is
    (new_tokens - 1) * batch over the difference between a full run and that one. `warmups` full runs
    come first (they compile and record the CUDA graphs); each time is the best of `repeats` runs.
    """
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the comparison uses prompts of one length (no padding on either side)")
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (one prefill token, then decode)")
    device = next(hf_model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    for _ in range(warmups):
        _generate(hf_model, ids, new_tokens, compile_decode)
    # the best of `repeats` runs each: a one-off stall (another process, a page fault) must not decide
    first_s = min(_timed(lambda: _generate(hf_model, ids, 1, compile_decode))[0] for _ in range(repeats))
    runs = [_timed(lambda: _generate(hf_model, ids, new_tokens, compile_decode)) for _ in range(repeats)]
    full_s, out = min(runs, key=lambda run: run[0])
    decode_s = full_s - first_s
    if decode_s <= 0:
        raise ValueError(f"decode time not measurable: {new_tokens} tokens took {full_s:.4f} s, one took "
                         f"{first_s:.4f} s (generate more tokens)")
    tokens = out[:, ids.shape[1]:].tolist()
    return HFTiming(first_s, (new_tokens - 1) * len(prompts) / decode_s, tokens)


def hf_greedy_tokens(hf_model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens per prompt (each alone: no padding), eager, for the agreement check."""
    device = next(hf_model.parameters()).device
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        out.append(_generate(hf_model, ids, new_tokens, compile_decode=False)[0, len(prompt):].tolist())
    return out
