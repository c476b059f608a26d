"""`pd.tools.route_bench`'s tables: one row per policy, and per seed the policies side by side
(prefix_aware's hits against the oracle's, its TTFT p50 / p90 against least_loaded's and
round_robin's). Pure functions of the rows `cli.summarize` makes."""
from __future__ import annotations

import math

from pd.tools.percentile import percentile

METHOD = ("What is real and what is simulated: the workers are real (the pdkv Worker, engine, ZMQ connector "
          "and KV event stream, each in a process of its own) and so is the router with its KV index; the model "
          "is simulated (`pdkv-small`: random weights, 4 layers, hidden 256, byte tokenizer, so replies are "
          "noise of the asked length) and so are the users (the workload's prompts, arrival times and aborts, "
          "drawn from the seed). All of it shares this machine's cores with whatever else runs on it.")


def format_table(rows: list[dict], bound: float) -> str:
    head = ("| policy | prefix hit rate | oracle (best P) | hit / oracle | choice loss | late loss | TTFT p50 s "
            "| TTFT p90 s | req/s | gen tok/s | blocks P->D | aborted | index exact |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head] + [f"| {r['policy']} | {r['hit_rate']:.3f} | {r['oracle']:.3f} | {hit_ratio(r):.3f} | "
                      f"{r['choice_loss']:.3f} | {r['late_loss']:.3f} | {r['ttft_p50_s']:.3f} | "
                      f"{r['ttft_p90_s']:.3f} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | "
                      f"{r['blocks_p_to_d']} | {r['aborted']} | {_exact(r)} |" for r in rows]
    lines.append(f"\nunbounded single-cache bound on the hit rate: {bound:.3f}")
    return "\n".join(lines)


def hit_ratio(row: dict) -> float:
    """The policy's actual hit rate over the oracle's (the best P's predicted hit at each dispatch)."""
    return row["hit_rate"] / row["oracle"] if row["oracle"] else float("nan")


def _exact(row: dict) -> str:
    checks = row.get("index_checks")
    if not checks:
        return "not checked"
    return f"{sum(checks)}/{len(checks)}" if not all(checks) else f"yes ({len(checks)} checks)"


def request_figures(records: list[dict]) -> dict:
    """Hit rates and TTFT percentiles over the given requests' records (a row's, or several rows'
    pooled): hits over all their prompt tokens, one percentile over all their TTFTs."""
    prompt = sum(r["prompt_tokens"] for r in records)
    ttfts = [r["ttft_s"] for r in records]
    return {"hit_rate": sum(r["cached_tokens"] for r in records) / prompt,
            "oracle": sum(r["best_hit"] for r in records) / prompt,
            "ttft_p50_s": percentile(ttfts, 50, math.nan), "ttft_p90_s": percentile(ttfts, 90, math.nan),
            "text_p90_s": percentile([r["text_s"] for r in records], 90, math.nan)}


def pooled(rows: list[dict]) -> dict:
    """One policy's rows of several seeds as one: its figures over every request of every seed (a p90
    over all of them, not a mean of per-seed p90s), its index checks all together."""
    records = [r for row in rows for r in row["records"]]
    return {"policy": rows[0]["policy"], "records": records, **request_figures(records),
            "index_checks": [ok for row in rows for ok in row.get("index_checks") or []]}


def format_summary(rows: list[dict]) -> str:
    """Per seed, and with several seeds also over all their requests pooled ("all seeds"), side by
    side: prefix_aware's hit / oracle and TTFT p50 / p90, with least_loaded's and round_robin's and the
    ratios prefix_aware / other (below 1: prefix_aware is faster), and the p90 ratio to least_loaded's
    measured to the first visible text instead of the first token."""
    lines = ["| seed | hit / oracle (prefix_aware) | TTFT p50 s pa / ll / rr | TTFT p90 s pa / ll / rr "
             "| p50 pa/ll | p90 pa/ll | p50 pa/rr | p90 pa/rr | first-text p90 pa/ll | index exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups = [(str(seed), {r["policy"]: r for r in rows if r["seed"] == seed})
              for seed in sorted({r["seed"] for r in rows})]
    if len(groups) > 1 and all("records" in r for r in rows):  # the workload as a whole: every seed's requests
        groups.append(("all seeds", {policy: pooled([r for r in rows if r["policy"] == policy])
                                     for policy in dict.fromkeys(r["policy"] for r in rows)}))
    for seed, by in groups:
        pa = by.get("prefix_aware")
        if pa is None:
            continue
        others = [by.get("least_loaded"), by.get("round_robin")]
        p50 = " / ".join(f"{r['ttft_p50_s']:.3f}" if r else "-" for r in [pa, *others])
        p90 = " / ".join(f"{r['ttft_p90_s']:.3f}" if r else "-" for r in [pa, *others])
        ratios = [f"{pa[k] / r[k]:.2f}" if r else "-" for r in others for k in ("ttft_p50_s", "ttft_p90_s")]
        ll = by.get("least_loaded")
        text = f"{pa['text_p90_s'] / ll['text_p90_s']:.2f}" if ll and "text_p90_s" in pa else "-"
        exact = all(all(r.get("index_checks") or [False]) for r in by.values())
        lines.append(f"| {seed} | {hit_ratio(pa):.3f} | {p50} | {p90} | {' | '.join(ratios)} | {text} | "
                     f"{'yes' if exact else 'NO'} |")
    return "\n".join(lines)
