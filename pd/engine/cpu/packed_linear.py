"""Linear layers whose weights are held in the packed-panel layout of pd/engine/cpu/cpu_gemm.cpp.

On the CPU backend the weights are re-laid once, at load time, as panels of 16 output
columns ((N, K) -> (ceil(N/16), K, 16)), which the AVX-512 / AVX2 kernel streams at
close to the FMA peak where MKL's sgemm at decode shapes reaches half of it.
`packed_copy` builds the backend's own copy of the model whose `nn.Linear` / tied
`nn.Embedding` modules are the modules below, reading the same panels as `decode_layers`:
prefill (the per-layer path) and decode run the same GEMM, and the engine's model is
left as pd/engine/model/llama.py builds it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.model.llama import CausalLM

PANEL = 16  # output columns per panel (kPanel in cpu_gemm.cpp)
NEVER = 1 << 31  # a row count no batch reaches: the packed kernel always (pd/engine/cpu/gemm_tuning.py)
_NO_BIAS = torch.empty(0)


def num_panels(out_features: int) -> int:
    return -(-out_features // PANEL)


def pack_into(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copies `weight` (N, K) into `out` ((ceil(N/16), K, 16), contiguous), zero-padding the last panel."""
    n, k = weight.shape
    pad = num_panels(n) * PANEL - n
    padded = F.pad(weight, (0, 0, 0, pad)) if pad else weight
    return out.copy_(padded.view(-1, PANEL, k).transpose(1, 2))


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The (out_features, K) matrix held in `packed` (a copy)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features].clone()


def torch_mm_from_packed(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ (+ b) through torch's GEMM, W held as panels ((ceil(N/16), K, 16)): the panels are
    laid out as one (K, N_padded) matrix for the call (a transient copy the size of W)."""
    k = packed.shape[1]
    wt = packed.permute(1, 0, 2).reshape(k, -1)
    if bias is not None and wt.shape[1] == out_features:
        return torch.addmm(bias, x, wt)
    y = torch.mm(x, wt)[:, :out_features]
    return (y + bias if bias is not None else y).contiguous()



class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W held packed; a drop-in for the `nn.Linear` it replaces.

    Guarantees: same input/output shapes and `in_features` / `out_features` as
    nn.Linear; `state_dict()` has the same keys and values (the weight is
    unpacked on the way out); `weight` is a fresh unpacked copy (read-only use:
    the kernel reads `packed`). Float32 on the CPU only.
    """

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.torch_from_rows = NEVER  # from this many rows torch's GEMM is faster (set by gemm_tuning)

    @property
    def weight(self) -> torch.Tensor:
        return unpack(self.packed, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] >= self.torch_from_rows:
            y = torch_mm_from_packed(flat, self.packed, self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        bias = _NO_BIAS if self.bias is None else self.bias
        y = cpu_kernels.load().packed_linear(flat, self.packed, self.out_features, bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 - nn.Module's signature
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias


class PackedEmbedding(nn.Module):
    """Embedding lookup that reads the rows of a tied lm_head's panels (one copy of that matrix).

    Guarantees: the same rows as the `nn.Embedding` it replaces, and the same `state_dict()`.
    """

    def __init__(self, lm_head: PackedLinear):
        super().__init__()
        self.lm_head = [lm_head]  # a list: not registered twice as a submodule
        self.num_embeddings, self.embedding_dim = lm_head.out_features, lm_head.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.lm_head[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.lm_head[0]
        return cpu_kernels.load().packed_rows(head.packed, head.out_features, ids)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 - nn.Module's signature
        destination[prefix + "weight"] = self.weight


def packable(model: nn.Module) -> bool:
    """Whether `packed_copy` applies: q, k, v, gate and up each fill whole panels (the kernels of
    `decode_layers` find each projection's panels inside the fused q|k|v and gate|up)."""
    cfg = model.config
    d = cfg.resolved_head_dim
    return all(n % PANEL == 0 for n in (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size))


def _layer_shapes(cfg) -> list[tuple[int, ...]]:  # noqa: ANN001 - ModelConfig
    d, h, i = cfg.resolved_head_dim, cfg.hidden_size, cfg.intermediate_size
    qw, kw = cfg.num_heads * d, cfg.num_kv_heads * d
    bias = (qw + 2 * kw,) if cfg.attention_bias else (0,)
    return [(h,), (num_panels(qw + 2 * kw), h, PANEL), bias, (num_panels(h), qw, PANEL), (h,),
            (num_panels(2 * i), h, PANEL), (num_panels(h), i, PANEL)]


def packed_copy(model: CausalLM, allocate: Callable[[list[tuple[int, ...]]], list[torch.Tensor]]
                ) -> tuple[CausalLM, list[torch.Tensor]]:
    """A copy of `model` (a float32 CausalLM) over panels: every projection and the lm_head re-laid
    as panels in PackedLinear modules (a tied embedding reads the head's panels), the norms copied
    beside them; the embedding (untied), final norm and rotary tables are `model`'s own modules,
    shared. Returns the copy and the 7 tensors per layer that `decode_layers` takes (norms plain,
    q|k|v and gate|up fused, views of the same panels). `allocate(shapes)` returns the empty tensors
    to fill (one buffer for all, so they may share 2 MiB pages). `model` is left as it is."""
    cfg = model.config
    body = model.model
    with torch.device("meta"):
        twin = CausalLM(cfg)  # the structure only: every module holding weights is replaced below
    twin.requires_grad_(False)
    twin.model.rotary, twin.model.norm = body.rotary, body.norm
    shapes = [s for _ in body.layers for s in _layer_shapes(cfg)]
    head_shape = (num_panels(cfg.vocab_size), cfg.hidden_size, PANEL)
    buffers = allocate(shapes + [head_shape])
    weights: list[torch.Tensor] = []
    with torch.no_grad():
        for li, (layer, copy) in enumerate(zip(body.layers, twin.model.layers, strict=True)):
            norm1, qkv, bias, o, norm2, gate_up, down = buffers[7 * li: 7 * li + 7]
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            norm1.copy_(layer.input_layernorm.weight)
            norm2.copy_(layer.post_attention_layernorm.weight)
            copy.input_layernorm.weight = nn.Parameter(norm1, requires_grad=False)
            copy.post_attention_layernorm.weight = nn.Parameter(norm2, requires_grad=False)
            pack_into(torch.cat([p.weight for p in projections]), qkv)
            if bias.numel():
                bias.copy_(torch.cat([p.bias for p in projections]))
            pack_into(attn.o_proj.weight, o)
            pack_into(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up)
            pack_into(mlp.down_proj.weight, down)
            # the fused q|k|v and gate|up run as one GEMM each, as in the model
            copy.self_attn.qkv_proj = PackedLinear(qkv, cfg.hidden_size, sum(p.out_features for p in projections),
                                                   bias if bias.numel() else None)
            copy.self_attn.o_proj = PackedLinear(o, attn.o_proj.in_features, cfg.hidden_size, None)
            copy.mlp.gate_up_proj = PackedLinear(gate_up, cfg.hidden_size, 2 * cfg.intermediate_size, None)
            copy.mlp.down_proj = PackedLinear(down, cfg.intermediate_size, cfg.hidden_size, None)
            weights += [norm1, qkv, bias, o, norm2, gate_up, down]
        head = buffers[-1]
        pack_into(model.lm_head.weight, head)
        twin.lm_head = PackedLinear(head, cfg.hidden_size, cfg.vocab_size, None)
        twin.model.embed_tokens = PackedEmbedding(twin.lm_head) if cfg.tie_word_embeddings else body.embed_tokens
    return twin, weights
