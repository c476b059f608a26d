"""Greedy next tokens that read a quarter of the lm_head: an int8 screen, then exact float32 candidates.

At small batch a decode step reads every weight once, and SmolLM2-135M's tied lm_head is 113 MB of
its 540 MB. A greedy token needs only the argmax of the float32 logits, so `GreedyHead` keeps an
int8 copy of the lm_head (one scale per output row, 28 MB) and, per hidden row h (kernel:
`screened_argmax` in cpu_argmax.cpp):

1. approximate logits a[n] = scale[n] * (h . q[n]), reading the int8 panels;
2. a bound |a[n] - f[n]| <= |h|_2 * coef[n], where f[n] is h . w[n] computed by the float32 kernel
   in any summation order: coef[n] = e[n] + 2.5 * gamma_K * (|w[n]|_2 + e[n]), e[n] = |w[n] -
   scale[n] q[n]|_2 (Cauchy-Schwarz for the int8 rounding; gamma_K = K u / (1 - K u), u = 2^-24,
   the float32 rounding of a K-term sum, once for the screen and once for the exact value), with a
   1% margin, rounded up to float32;
3. the candidates are the n with a[n] + bound[n] >= max_m(a[m] - bound[m]). The argmax of f is
   among them (it scores at least that floor, every other row at most its own a + bound); each
   candidate's panel of 16 outputs is computed in float32, and the token is the candidate with the
   largest f, the lowest index on a tie, as `torch.argmax`.

So the token is the argmax of float32 logits, as the full lm_head would give; what changes is only
which summation order computes the winners' logits (the one-row tile's, where the full GEMM's tile
depends on the batch size). On SmolLM2 decodes, 3 panels (median; 9 at p90) of 3072 were
computed in float32. Rows that are not finite get their full logits from the caller.
`PDKV_GREEDY_SCREEN=off` turns the screen off (every row then computes its full logits).
"""
from __future__ import annotations

import logging
import os

import torch

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.packed_linear import PackedLinear

logger = logging.getLogger(__name__)

_ENV = "PDKV_GREEDY_SCREEN"
_U = 2.0 ** -24  # float32 unit roundoff
_PANELS_PER_PASS = 256  # quantized in slices, so the float64 copy stays small
ROWS_PER_CALL = 32  # rows per kernel call: its buffer holds rows x vocabulary floats (6 MB for SmolLM2)


def screen_enabled() -> bool:
    return os.environ.get(_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


class GreedyHead:
    """The exact greedy tokens of a packed float32 lm_head (no bias), screened through int8.

    Guarantees: `tokens(h, n)[i]` is the index of the largest float32 logit of row i among ids
    [0, n) (the lowest on a tie; ids from n on, a padded vocabulary's, are never chosen), or None
    where the row is not finite (the caller then computes that row's logits). The
    lm_head's panels are read, never written; the int8 copy is made once, here.
    """

    def __init__(self, head: PackedLinear):
        if head.bias is not None:
            raise ValueError("the int8 screen covers an lm_head without bias")
        packed = head.packed  # (P, K, 16): packed[p, k, j] = W[16 p + j, k]
        self.packed, self.out_features = packed, head.out_features
        num_panels, k, width = packed.shape
        gamma = k * _U / (1 - k * _U)
        self.q = torch.empty(packed.shape, dtype=torch.int8)
        scale = torch.empty(num_panels, width, dtype=torch.float32)
        coef = torch.empty(num_panels, width, dtype=torch.float64)
        for p0 in range(0, num_panels, _PANELS_PER_PASS):
            part = packed[p0:p0 + _PANELS_PER_PASS].double()
            s = (part.abs().amax(dim=1) / 127).float()  # per output row; its float32 value is the one used
            safe = torch.where(s > 0, s, torch.ones_like(s)).double()
            q = torch.where(s[:, None, :] > 0, (part / safe[:, None, :]).round(), torch.zeros_like(part))
            q = q.clamp_(-127, 127)
            err = (part - q * s.double()[:, None, :]).norm(dim=1)
            self.q[p0:p0 + _PANELS_PER_PASS] = q.to(torch.int8)
            scale[p0:p0 + _PANELS_PER_PASS] = s
            coef[p0:p0 + _PANELS_PER_PASS] = (err + 2.5 * gamma * (part.norm(dim=1) + err)) * 1.01
        self.scale = scale.reshape(-1).contiguous()
        coef32 = coef.float()
        self.coef = torch.where(coef32.double() < coef, torch.nextafter(coef32, torch.tensor(float("inf"))),
                                coef32).reshape(-1).contiguous()

    def tokens(self, hidden: torch.Tensor, num_ids: int | None = None) -> list[int | None]:
        """Greedy token among ids [0, num_ids) (default: every output) per row of `hidden` (R, K)
        float32; None where the row is not finite. Rows go
        to the kernel `ROWS_PER_CALL` at a time: its approximate logits (rows x vocabulary floats) stay
        in a buffer the calling thread keeps, so that buffer stays small."""
        module = cpu_kernels.load()
        n_out = self.out_features if num_ids is None else min(num_ids, self.out_features)
        out: list[int | None] = []
        for r0 in range(0, hidden.shape[0], ROWS_PER_CALL):
            rows = module.screened_argmax(hidden[r0:r0 + ROWS_PER_CALL].contiguous(), self.q, self.scale, self.coef,
                                          self.packed, n_out)
            out += [t if t >= 0 else None for t in rows.tolist()]
        return out


def greedy_head_for(lm_head: object) -> GreedyHead | None:
    """A GreedyHead over `lm_head` where it applies (a packed float32 lm_head without bias, the
    screen not turned off), else None."""
    if not screen_enabled():
        logger.info("greedy tokens: full float32 logits (%s=off)", _ENV)
        return None
    if not isinstance(lm_head, PackedLinear) or lm_head.bias is not None:
        return None
    head = GreedyHead(lm_head)
    logger.info("greedy tokens: int8 screen of the lm_head (%.0f MB), exact float32 candidates",
                head.q.numel() / 1e6)
    return head
