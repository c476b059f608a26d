"""Per-shape choice between the packed kernel and torch's GEMM (pd/engine/cpu/gemm_tuning.py)."""
from __future__ import annotations

import json

import pytest
import torch

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu import gemm_tuning
from pd.engine.cpu.packed_linear import NEVER, PackedLinear, num_panels, pack_into, torch_mm_from_packed

module = cpu_kernels.load()
pytestmark = pytest.mark.skipif(module is None or not module.packed_gemm_available(),
                                reason="C++ toolchain or AVX2/FMA unavailable")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return pack_into(weight, torch.empty(num_panels(weight.shape[0]), weight.shape[1], 16))


@pytest.mark.parametrize("m,k,n,with_bias", [(1, 64, 260, True), (70, 576, 960, False), (33, 100, 17, True),
                                             (200, 1536, 48, False)])
def test_torch_path_on_panels_matches_float64(m, k, n, with_bias):
    """Padded last panel or not, with or without a bias: the torch path reads the panels right and stays at
    float32 rounding."""
    gen = torch.Generator().manual_seed(m + k + n)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = torch_mm_from_packed(x, _packed(weight), n, bias)
    assert got.shape == (m, n) and got.is_contiguous()
    assert float((got.double() - exact).abs().max()) <= 1e-4 * k ** 0.5


def test_a_packed_linear_takes_the_torch_path_from_its_crossover_on():
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer = PackedLinear(_packed(weight), 64, 48, bias)
    x = torch.randn(2, 10, 64, generator=gen)
    assert layer.torch_from_rows == NEVER
    packed_out = layer(x)
    layer.torch_from_rows = 20
    assert torch.allclose(layer(x), packed_out, atol=1e-5)  # 20 rows: the torch path
    assert torch.equal(layer(x[:1]), module.packed_linear(x[0], layer.packed, 48, bias).view(1, 10, 48))


def test_crossovers_are_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(gemm_tuning, "ROW_LADDER", (32, 64))
    calls: list[tuple[int, int]] = []
    measure = gemm_tuning.measure_crossover
    monkeypatch.setattr(gemm_tuning, "measure_crossover",
                        lambda k, n: calls.append((k, n)) or measure(k, n, ladder=(32, 64)))
    first = gemm_tuning.crossovers({(64, 48), (96, 32)})
    assert sorted(calls) == [(64, 48), (96, 32)]
    assert all(rows in (32, 64, NEVER) for rows in first.values())
    table = json.loads((tmp_path / "kernels" / "gemm_tuning.json").read_text())
    assert len(table) == 1 and set(next(iter(table.values()))) == {"64x48", "96x32"}
    assert gemm_tuning.crossovers({(64, 48)}) == {(64, 48): first[(64, 48)]}  # from the table
    assert len(calls) == 2


def test_tuning_off_keeps_every_projection_packed(monkeypatch):
    monkeypatch.setenv("PDKV_GEMM_TUNING", "off")
    assert gemm_tuning.crossovers({(576, 576), (576, 49152)}) == {(576, 576): NEVER, (576, 49152): NEVER}
