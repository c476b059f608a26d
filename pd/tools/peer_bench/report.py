"""The peer benchmark's printed table, TTFT breakdown and chart (pd/tools/peer_bench/cli.py)."""
from __future__ import annotations

import math

from pd.tools.ttft_breakdown import format_stages

LLAMA = "llama-server F32"
LLAMA_Q4 = "llama-server Q4_1"  # the package GGUF as it is (8-bit activations in its dot products)
LLAMA_SERVERS = (LLAMA, LLAMA_Q4)


def _ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.0f} ms"


def _x(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.2f}x"


def format_table(results: dict[str, dict[int, dict]]) -> str:
    head = f"{'server':<18} {'c':>3} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9}" \
           f" {'prompt':>6} {'out':>4} {'failed':>6}"
    lines = [head, "-" * len(head)]
    for server, per_c in results.items():
        for c in sorted(per_c):
            f = per_c[c]
            lines.append(f"{server:<18} {c:>3} {f['tokens_per_s']:>7.1f} {_ms(f['ttft_p50_s']):>9} "
                         f"{_ms(f['ttft_p90_s']):>9} {_ms(f['tpot_p50_s']):>9} {_ms(f['tpot_p90_s']):>9} "
                         f"{f['prompt_tokens_mean']:>6.0f} {f['output_tokens_per_request']:>4.0f} {f['num_failed']:>6}")
    for server, per_c in results.items():
        for c in sorted(per_c):
            if per_c[c].get("errors"):
                lines.append(f"  failed requests, {server} c={c}: {'; '.join(per_c[c]['errors'])}")
    return "\n".join(lines)


def format_markdown(results: dict[str, dict[int, dict]]) -> str:
    """The table of docs/cpu-performance.md: tokens/s (TTFT p50) per server and c."""
    cs = sorted({c for per_c in results.values() for c in per_c})
    lines = ["| server | " + " | ".join(f"c={c} tok/s (TTFT p50)" for c in cs) + " |",
             "|---|" + "---|" * len(cs)]
    for server, per_c in results.items():
        cells = [f"{per_c[c]['tokens_per_s']:.0f} ({per_c[c]['ttft_p50_s']:.2f} s)" if c in per_c else "-" for c in cs]
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_ratios(ratio_table: dict[str, dict[int, dict]], baseline: str) -> str:
    if not ratio_table:
        return f"ratios: this run has no pdkv and {baseline} figures side by side"
    lines = [f"ratios against {baseline} (throughput: above 1 is faster; TTFT/TPOT: below 1 is lower)"]
    for server, per_c in ratio_table.items():
        cells = [f"c={c}: throughput {_x(r['throughput_x'])}, TTFT p50 {_x(r['ttft_p50_x'])}, "
                 f"TPOT p50 {_x(r['tpot_p50_x'])}" for c, r in sorted(per_c.items())]
        lines.append(f"  {server} / {baseline}: " + "; ".join(cells))
    return "\n".join(lines)


def format_engine(engine: dict[int, dict], shares: dict[str, dict[int, float]], threads: int,
                  peak_gflops: float | None = None) -> str:
    if not engine:
        return "engine in-process: not run"
    gemm = [(c, v["gemm_gflops"]) for c, v in sorted(engine.items()) if "gemm_gflops" in v]
    gemm_line = ("  its projections (flops per token x tokens/s): " + ", ".join(
        f"c={c} {g:.1f} GFLOP/s" + (f" ({100 * g / peak_gflops:.0f}%)" if peak_gflops else "") for c, g in gemm)
        + (f" of a {peak_gflops:.0f} GFLOP/s torch.mm 2048^3 peak" if peak_gflops else "")) if gemm else None
    lines = ["engine in-process (same prompts, output length and concurrency, fed straight to one engine, "
             f"{threads} torch threads): " + ", ".join(f"c={c} {v['tokens_per_s']:.1f} tok/s (TTFT p50 "
                                                       f"{_ms(v['ttft_p50_s'])})" for c, v in sorted(engine.items()))]
    if gemm_line:
        lines.append(gemm_line)
    for server, per_c in shares.items():
        if server in LLAMA_SERVERS:
            continue
        lines.append(f"  {server} served / in-process: "
                     + ", ".join(f"c={c} {s * 100:.0f}%" for c, s in sorted(per_c.items()) if not math.isnan(s)))
    return "\n".join(lines)


def format_breakdown(results: dict[str, dict[int, dict]]) -> str:
    lines = ["TTFT breakdown (router's pdkv_timing, p50 per stage over the measured requests):"]
    if all(server in LLAMA_SERVERS for server in results):
        return "TTFT breakdown: no pdkv server in this run"
    for server, per_c in results.items():
        if server in LLAMA_SERVERS:
            continue
        for c in sorted(per_c):
            b = per_c[c].get("breakdown")
            if not b:
                lines.append(f"  {server} c={c}: no breakdown (the router sent no pdkv_timing)")
                continue
            cached = b.get("cached_tokens_p50")
            lines.append(f"  {server} c={c} ({b['num_requests']} requests): {format_stages(b)}; server TTFT p50 "
                         f"{_ms(b.get('server_ttft_p50_s'))}; cached prompt tokens p50 "
                         f"{'-' if cached is None else f'{cached:.0f}'}")
    return "\n".join(lines)


def plot(results: dict[str, dict[int, dict]], engine_rates: dict[int, float], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for server, per_c in results.items():
        cs = sorted(per_c)
        ax_tp.plot(cs, [per_c[c]["tokens_per_s"] for c in cs], marker="o", label=server)
        ax_ttft.plot(cs, [per_c[c]["ttft_p50_s"] * 1e3 for c in cs], marker="o", label=server)
    if engine_rates:
        cs = sorted(engine_rates)
        ax_tp.plot(cs, [engine_rates[c] for c in cs], linestyle="--", color="grey", label="engine in-process")
    all_cs = sorted({c for per_c in results.values() for c in per_c})
    for ax, label in ((ax_tp, "output tokens/s"), (ax_ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_cs, [str(c) for c in all_cs])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streamed requests (c)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
