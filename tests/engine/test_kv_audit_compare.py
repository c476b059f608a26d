"""`pd.engine.runner.kv_audit.compare`: bitwise at tolerance 0, relative to each layer's K/V magnitude otherwise,
and the first differing layer named."""
from __future__ import annotations

import math

import torch

from pd.engine.runner.kv_audit import compare

LAYERS = [(0, 2, 4)]  # one group holding layers 0, 2 and 4


def page(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((3, 2, 16, 2, 8), generator=g) * 4).to(dtype)  # (layers, K/V, block, heads, dim)


def test_identical_pages_match_bitwise_at_any_tolerance():
    a = page()
    for tolerance in (0.0, 1e-4):
        result = compare([a.clone()], [a], tolerance, LAYERS)
        assert result.match and result.max_rel_diff == 0.0 and result.first_diff == ""


def test_a_rounding_difference_fails_bitwise_and_passes_a_relative_tolerance():
    a = page()
    b = a.clone()
    b[1, 1, 3, 0, 2] = torch.nextafter(b[1, 1, 3, 0, 2], torch.tensor(math.inf))  # one ulp, layer 2's V
    strict = compare([a], [b], 0.0, LAYERS)
    assert not strict.match and strict.first_diff == "layer 2 V"
    assert 0.0 < strict.max_rel_diff < 1e-6
    assert compare([a], [b], 1e-4, LAYERS).match


def test_a_shift_beyond_the_tolerance_names_the_first_layer_over_it():
    a = page()
    b = a.clone()
    b[2, 0] += 0.5  # layer 4's K, shifted as the fault plan does
    b[0, 1, 0, 0, 0] = torch.nextafter(b[0, 1, 0, 0, 0], torch.tensor(math.inf))  # layer 0's V: rounding only
    result = compare([a], [b], 1e-4, LAYERS)
    scale = float(b[2, 0].abs().max())
    assert not result.match and result.first_diff == "layer 4 K"
    assert math.isclose(result.max_rel_diff, 0.5 / scale, rel_tol=1e-3)


def test_nan_and_16_bit_pages():
    a = page(dtype=torch.bfloat16)
    b = a.clone()
    b[0, 0, 0, 0, 0] = float("nan")
    result = compare([a], [b], 0.05, LAYERS)
    assert not result.match and result.max_rel_diff == math.inf and result.first_diff == "layer 0 K"
    assert compare([a], [a.clone()], 0.0, LAYERS).match
