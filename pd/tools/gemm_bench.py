"""GEMM per shape: `python -m pd.tools.gemm_bench [--threads N] [--rows 1,2,4,8,32,512]`.

For each projection of a Llama-layout model (default: SmolLM2-135M's, hidden 576, 3 KV
heads of 64, SwiGLU 1536, vocab 49152) and each row count (decode batches and a prefill
chunk), the achieved GFLOP/s of the packed-panel GEMM (pd/engine/cpu/cpu_gemm.cpp, the one
the fused decode path uses; its ISA is printed) and of torch (oneDNN/MKL through
`torch.nn.functional.linear`) on the same float32 operands, beside the machine's measured
peak: a large square `torch.mm`. Small row counts are bound by memory bandwidth, so the
packed GEMM's rate of weight reads (GB/s) is printed too, beside a measured stream read (a
`torch.sum` over a buffer twice the last-level cache). Each timed call reads another copy of
the weight, from copies that together exceed that cache (`--warm`: one copy, as in cache), as a
decode step reads every layer's weights once. Best of `--repeats` timings each, so that
other processes on the machine count less.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.gemm_tuning import best_seconds
from pd.engine.cpu.packed_linear import num_panels, pack_into


def peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def cache_bytes() -> int:
    """The last-level cache's size (64 MiB where sysfs does not say)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as handle:
            text = handle.read().strip()
    except OSError:
        return 64 << 20
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text or 0) or 64 << 20


def stream_read_gbs(repeats: int = 5) -> float:
    """GB/s of a multi-threaded read (torch.sum) of a float32 buffer twice the last-level cache (<= 1 GiB)."""
    buf = torch.ones(min(2 * cache_bytes(), 1 << 30) // 4)
    return buf.numel() * 4 / best_seconds(buf.sum, repeats) / 1e9


def shape_gflops(rows: int, in_features: int, out_features: int, repeats: int, copies: int = 1) -> dict[str, float]:
    """GFLOP/s of torch and (where built) the packed GEMM; with the packed one also "packed_gbs", its
    weight reads in GB/s. Each call reads the next of `copies` copies of the weight."""
    x = torch.randn(rows, in_features)
    ws = [torch.randn(out_features, in_features) / in_features**0.5 for _ in range(copies)]
    flops = 2 * rows * in_features * out_features
    plain = itertools.cycle(ws)
    out = {"torch": flops / best_seconds(lambda: F.linear(x, next(plain)), repeats) / 1e9}
    module = cpu_kernels.load()
    if module is not None and module.packed_gemm_available():
        packed = itertools.cycle([pack_into(w, torch.empty(num_panels(out_features), in_features, 16)) for w in ws])
        del ws, plain
        no_bias = torch.empty(0)
        seconds = best_seconds(lambda: module.packed_linear(x, next(packed), out_features, no_bias), repeats)
        out["packed"] = flops / seconds / 1e9
        out["packed_gbs"] = 4 * in_features * out_features / seconds / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rows", default="1,2,4,8,32,512", help="comma-separated row counts (tokens per call)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--kv-width", type=int, default=192, help="KV heads x head dim")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warm", action="store_true", help="one copy of each weight (read from cache)")
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
                 "down": (args.intermediate, h), "lm_head": (h, args.vocab)}, rows, args.repeats, not args.warm)


SMOLLM2_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                  "lm_head": (576, 49152)}  # (in_features, out_features) of SmolLM2-135M


def print_table(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int, cold: bool = True) -> None:
    """The per-shape table: packed and torch GFLOP/s at each row count, beside the torch.mm peak, and the
    packed GEMM's weight reads (GB/s) beside a stream read's."""
    peak = peak_gflops()
    module = cpu_kernels.load()
    isa = module.packed_gemm_isa() if module is not None and module.packed_gemm_available() else "none"
    print(f"torch.mm 2048^3 peak: {peak:.0f} GFLOP/s ({torch.get_num_threads()} threads); packed GEMM: {isa}")
    stream = stream_read_gbs()
    budget = 2 * cache_bytes() if cold else 0
    print(f"stream read (torch.sum over {min(2 * cache_bytes(), 1 << 30) >> 20} MiB): {stream:.1f} GB/s; weights "
          + ("cold (copies over twice the last-level cache)" if cold else "warm (one copy)"))
    print(f"{'shape':<8} {'K x N':>12} {'rows':>5} {'packed':>8} {'torch':>8}  GFLOP/s (% of peak), faster; "
          "packed weight reads GB/s (% of stream)")
    for name, (k, n) in shapes.items():
        copies = max(1, min(1024, min(budget, 1 << 30) // (4 * k * n) + (1 if cold else 0)))
        for m in rows:
            g = shape_gflops(m, k, n, max(repeats, copies), copies)
            packed = g.get("packed")
            cells = f"{packed:8.1f}" if packed is not None else f"{'-':>8}"
            best = max(("packed", "torch"), key=lambda key: g.get(key, 0.0))
            reads = f"  {g['packed_gbs']:5.1f} GB/s ({100 * g['packed_gbs'] / stream:.0f}%)" if packed else ""
            print(f"{name:<8} {f'{k}x{n}':>12} {m:>5} {cells} {g['torch']:8.1f}  "
                  f"({100 * g[best] / peak:.0f}%) {best}{reads}", flush=True)

if __name__ == "__main__":
    main()
