"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameter names follow Hugging Face's Llama layout (`model.layers.N.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so `state_dict()` round-trips through a HF checkpoint
without renaming.

The model does not own a KV cache. Attention is delegated to a `LayerAttention`: the runner passes
an attention backend (pd/engine/attention/backend.py) that writes K/V into pages and reads them back
through block tables, with the step's metadata; `DenseAttention` is the plain, non-paged reference
used to check the paged path. This module is the model that runs: no backend changes its modules.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pd.engine.model.config import SLIDING_ATTENTION, ModelConfig


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
        if x.dtype == torch.float32:  # one fused op, same result
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 (as HF does) so low-precision dtypes stay stable.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.resolved_head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: LayerAttention,
                metadata: Any) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, self.layer_idx, metadata)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: LayerAttention,
                metadata: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        layer i ran (its K/V are written), e.g. to publish them."""
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, backend, metadata)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x)

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
    for name, param in sorted(model.named_parameters()):
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
