"""GEMM per shape: `python -m pd.tools.gemm_bench [--threads N] [--rows 1,8,32,512]`.

For each projection of a Llama-layout model (default: SmolLM2-135M's, hidden 576, 3 KV
heads of 64, SwiGLU 1536, vocab 49152) and each row count (decode batches and a prefill
chunk), the achieved GFLOP/s of the packed-panel GEMM (pd/engine/cpu_gemm.cpp, the one
the fused decode path uses) and of torch (oneDNN/MKL through `torch.nn.functional.linear`)
on the same float32 operands, beside the machine's measured peak: a large square `torch.mm`.
Best of `--repeats` timings each, so that other processes on the machine count less.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pd.engine import cpu_kernels
from pd.engine.gemm_tuning import best_seconds
from pd.engine.packed_linear import num_panels, pack_into


def peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def shape_gflops(rows: int, in_features: int, out_features: int, repeats: int) -> dict[str, float]:
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features) / in_features**0.5
    flops = 2 * rows * in_features * out_features
    out = {"torch": flops / best_seconds(lambda: F.linear(x, w), repeats) / 1e9}
    module = cpu_kernels.load()
    if module is not None and module.packed_gemm_available():
        packed = pack_into(w, torch.empty(num_panels(out_features), in_features, 16))
        no_bias = torch.empty(0)
        seconds = best_seconds(lambda: module.packed_linear(x, packed, out_features, no_bias), repeats)
        out["packed"] = flops / seconds / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rows", default="1,8,32,512", help="comma-separated row counts (tokens per call)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--kv-width", type=int, default=192, help="KV heads x head dim")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error("--rows must be comma-separated integers")
    if min(rows) < 1 or min(args.hidden, args.kv_width, args.intermediate, args.vocab, args.repeats) < 1:
        ap.error("sizes, rows and --repeats must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    h = args.hidden
    print_table({"qkv": (h, h + 2 * args.kv_width), "o": (h, h), "gate_up": (h, 2 * args.intermediate),
                 "down": (args.intermediate, h), "lm_head": (h, args.vocab)}, rows, args.repeats)


SMOLLM2_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                  "lm_head": (576, 49152)}  # (in_features, out_features) of SmolLM2-135M


def print_table(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int) -> None:
    """The per-shape table: packed and torch GFLOP/s at each row count, beside the torch.mm peak."""
    peak = peak_gflops()
    print(f"torch.mm 2048^3 peak: {peak:.0f} GFLOP/s ({torch.get_num_threads()} threads)")
    print(f"{'shape':<8} {'K x N':>12} {'rows':>5} {'packed':>8} {'torch':>8}  GFLOP/s (% of peak), faster")
    for name, (k, n) in shapes.items():
        for m in rows:
            g = shape_gflops(m, k, n, repeats)
            packed = g.get("packed")
            cells = f"{packed:8.1f}" if packed is not None else f"{'-':>8}"
            best = max(g, key=lambda key: g[key])
            print(f"{name:<8} {f'{k}x{n}':>12} {m:>5} {cells} {g['torch']:8.1f}  "
                  f"({100 * g[best] / peak:.0f}%) {best}")


if __name__ == "__main__":
    main()
