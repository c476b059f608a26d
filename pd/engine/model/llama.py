"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The state dict follows Hugging Face's Llama layout (`model.layers.N.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so it round-trips through a HF checkpoint without renaming, while a layer holds
q/k/v as one fused linear and gate/up as another (one GEMM each; the per-projection names are views).

The model does not own a KV cache. Attention is delegated to a `LayerAttention`: the runner passes
an attention backend (pd/engine/attention/backend.py) that writes K/V into pages and reads them back
through block tables, with the step's metadata; `DenseAttention` is the plain, non-paged reference
used to check the paged path. This module is the model that runs: no backend changes its modules.

Tensor parallelism (pd/engine/parallel/sharded_model.py) builds this same model over one rank's slices
(a config with the rank's heads and MLP width) and sets `Attention.reduce` / `MLP.reduce`: the sum of
the ranks' partial outputs of o_proj and down_proj. Unset (None, the default), nothing changes.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pd.engine.model.config import SLIDING_ATTENTION, ModelConfig
from pd.engine.model.layer_ops import TORCH_OPS, LayerOps, rms_norm


class LayerAttention(Protocol):
    """What a layer asks of attention (the attention backends' contract, seen from the model)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: Any) -> torch.Tensor:
        """q: (T, Hq, D), k/v: (T, Hkv, D) for this step's tokens -> (T, Hq, D); the K/V are kept
        (written to the backend's cache) before the queries attend to them."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF Llama convention), cos/sin computed per position in float32."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class ProjectionView:
    """One projection of a fused linear layer, read-only in spirit: `weight` and `bias` are views of rows
    [start, stop) of the fused layer's (no copy), and calling it runs that slice alone. Code that lays the
    per-projection weights out for its own kernels reads them here; the model runs the fused GEMM."""

    def __init__(self, fused: nn.Linear, start: int, stop: int):
        self.fused, self.start, self.stop = fused, start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.start:self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.fused.bias is None else self.fused.bias[self.start:self.stop]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _projection(fused: str, rows: Callable[[Any], tuple[int, int]]) -> Any:
    """A read-only property: rows `rows(module)` of the module's fused linear `fused`, as a ProjectionView."""
    return property(lambda module: ProjectionView(getattr(module, fused), *rows(module)))


def _fused_state_dict(module: nn.Module, fused: str, parts: tuple[tuple[str, int], ...]) -> None:
    """Makes `module`'s state dict name the per-projection tensors of its fused linear `fused` (HF's names,
    views of the fused tensor on save; concatenated into it on load), so checkpoints keep their layout."""

    def on_save(_module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        for kind in ("weight", "bias"):
            whole = state.pop(f"{prefix}{fused}.{kind}", None)
            if whole is None:
                continue
            start = 0
            for name, size in parts:
                state[f"{prefix}{name}.{kind}"] = whole[start:start + size]
                start += size

    def on_load(_module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any) -> None:
        for kind in ("weight", "bias"):
            names = [f"{prefix}{name}.{kind}" for name, _ in parts]
            if all(n in state for n in names):
                state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])

    module.register_state_dict_post_hook(on_save)
    module.register_load_state_dict_pre_hook(on_load)


class Attention(nn.Module):
    """Self-attention with q, k and v in one GEMM (`qkv_proj`, rows [q | k | v]); `q_proj`, `k_proj` and
    `v_proj` are views of it, and the state dict names them as HF does."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.resolved_head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        _fused_state_dict(self, "qkv_proj", (("q_proj", self.q_size), ("k_proj", self.kv_size),
                                             ("v_proj", self.kv_size)))
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # TP: all-reduce of o_proj's output

    q_proj = _projection("qkv_proj", lambda m: (0, m.q_size))
    k_proj = _projection("qkv_proj", lambda m: (m.q_size, m.q_size + m.kv_size))
    v_proj = _projection("qkv_proj", lambda m: (m.q_size + m.kv_size, m.q_size + 2 * m.kv_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: LayerAttention,
                metadata: Any, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        q, k = ops.rope(q, k, cos, sin)
        out = self.o_proj(backend.forward(q, k, v, self.layer_idx, metadata).reshape(t, self.q_size))
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    """SwiGLU with gate and up in one GEMM (`gate_up_proj`, rows [gate | up]); `gate_proj` and `up_proj`
    are views of it, and the state dict names them as HF does."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        _fused_state_dict(self, "gate_up_proj", (("gate_proj", cfg.intermediate_size),
                                                 ("up_proj", cfg.intermediate_size)))
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # TP: all-reduce of down_proj's output

    gate_proj = _projection("gate_up_proj", lambda m: (0, m.intermediate_size))
    up_proj = _projection("gate_up_proj", lambda m: (m.intermediate_size, 2 * m.intermediate_size))

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                backend: LayerAttention, metadata: Any,
                ops: LayerOps = TORCH_OPS) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with `residual` None), still to be added to the
        residual stream -> (this layer's output, the stream before it): each add is fused into the norm
        that follows it."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(self.self_attn(h, cos, sin, backend, metadata, ops), residual,
                                       norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class DecoderBody(nn.Module):
    """The `model.` prefix of HF names: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.resolved_head_dim, cfg.rope_theta)


class CausalLM(nn.Module):
    """Flat-token decoder: a step's tokens of all requests are one (T,) sequence.

    Guarantees: `forward` returns final hidden states (T, hidden) in the model
    dtype; `compute_logits` returns float32 logits; weights never change after
    construction/loading (inference only, no autograd).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, backend: LayerAttention,
                metadata: Any = None, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """`metadata`: the step's, handed to every layer's attention. `on_layer(i)`: called after
        layer i ran (its K/V are written), e.g. to publish them. The layers' small ops are the backend's
        `layer_ops` where it has them (fused kernels), else the torch reference (model/layer_ops.py)."""
        ops: LayerOps = getattr(backend, "layer_ops", TORCH_OPS)
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, backend, metadata, ops)
            if on_layer is not None:
                on_layer(i)
        norm = self.model.norm
        if residual is None:
            return ops.rms_norm(x, norm.weight, norm.eps)
        return ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Logits (T, vocab) of one sequence through plain dense attention (no pages)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        positions = torch.arange(ids.shape[0])
        hidden = self.forward(ids, positions, DenseAttention(self.config, positions))
        return self.compute_logits(hidden)


def init_random_weights(model: CausalLM, seed: int) -> CausalLM:
    """Deterministic random weights: same seed, same model, on every machine.

    Linear weights ~ N(0, 1/fan_in) so logits have O(1) spread (greedy ties
    between top tokens are then vanishingly rare), norms at 1.
    """
    gen = torch.Generator().manual_seed(seed)
    # a parameter under its first name only (a tied head is the embedding: drawn once)
    first_names = {name for name, _ in model.named_parameters()}
    # HF's tensor names (the fused q|k|v and gate|up filled per projection): the same draws as unfused
    for name, param in sorted(model.state_dict(keep_vars=True).items()):
        if isinstance(param, nn.Parameter) and name not in first_names:
            continue
        if name.endswith("norm.weight"):
            values = torch.ones(param.shape)
        elif name.endswith(".bias"):
            values = torch.randn(param.shape, generator=gen) * 0.02
        elif "embed_tokens" in name:
            values = torch.randn(param.shape, generator=gen)
        else:
            values = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1])
        param.data.copy_(values.to(param.dtype))
    return model


def build_model(cfg: ModelConfig, seed: int | None = 0, device: str | torch.device = "cpu") -> CausalLM:
    """A model in `cfg.dtype`, with seeded random weights when `seed` is not None."""
    model = CausalLM(cfg)
    if seed is not None:
        init_random_weights(model, seed)
    return model.to(device=device, dtype=cfg.torch_dtype).eval()


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     causal: bool = False) -> torch.Tensor:
    """Batched GQA attention.

    q: (B, Lq, Hq, D); k, v: (B, S, Hkv, D); mask: (B, Lq, S) bool, True = attend, or None with
    `causal` (query i sees keys 0..i; requires Lq == S). Every query row must attend to at least
    one key. Returns (B, Lq, Hq, D).
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None, :, :], is_causal=mask is None and causal,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def window_of(cfg: ModelConfig, layer_idx: int) -> int | None:
    """The attention window (in tokens, the query included) of a layer, or None for full attention."""
    return cfg.sliding_window if cfg.resolved_layer_types[layer_idx] == SLIDING_ATTENTION else None


class DenseAttention:
    """Reference attention for one sequence: causal (and windowed) over its own K/V, no cache."""

    def __init__(self, cfg: ModelConfig, positions: torch.Tensor):
        self.cfg = cfg
        delta = positions[:, None] - positions[None, :]
        self.causal = delta >= 0
        self.windowed = {}
        if cfg.sliding_window:
            self.windowed[cfg.sliding_window] = self.causal & (delta < cfg.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                metadata: Any = None) -> torch.Tensor:
        window = window_of(self.cfg, layer)
        mask = self.causal if window is None else self.windowed[window]
        return masked_attention(q[None], k[None], v[None], mask[None])[0]
