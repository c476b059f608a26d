"""The dashboard renderer's PromQL evaluator, on expositions that prometheus_client itself wrote.

Each scrape is `generate_latest` of a real registry at a stated time; the
expected figures follow from the observations the test made, by Prometheus's
rules (rate over the range, histogram_quantile's linear interpolation within the
bucket). Then the CLI draws the real dashboard from saved scrapes of pdkv's own
`RouterMetrics`.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pd.router.metrics import RouterMetrics, WorkerFigures
from pd.tools.dashboard_render.data import iter_panels, load_dashboard
from pd.tools.dashboard_render.promql import Scrape, evaluate, parse

REPO = Path(__file__).resolve().parents[2]


class Target:
    """A registry standing in for one process, scraped at chosen times."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("req", "requests", ("outcome",), registry=self.registry)
        self.hits = Counter("hits", "hits", ("worker",), registry=self.registry)
        self.queries = Counter("queries", "queries", ("worker",), registry=self.registry)
        self.latency = Histogram("lat_seconds", "latency", buckets=(0.1, 0.5, 1.0), registry=self.registry)
        self.queue = Gauge("queue", "queue", ("worker",), registry=self.registry)

    def scrape(self, t: float) -> Scrape:
        return Scrape.parse(t, generate_latest(self.registry).decode())


def _at(query: str, scrapes: list[Scrape], at: int = -1) -> dict:
    value = evaluate(parse(query), scrapes, at % len(scrapes))
    return {tuple(v for _, v in labels): x for labels, x in value.items()} if isinstance(value, dict) else value


def test_rate_sum_by_and_division():
    t = Target()
    for outcome in ("ok", "error_429"):
        t.requests.labels(outcome)  # a labelled series exists (at 0) from its first use: before the first scrape
    for worker in ("p0", "d0"):
        t.hits.labels(worker), t.queries.labels(worker)
    scrapes = [t.scrape(100.0)]
    t.requests.labels("ok").inc(30)
    t.requests.labels("error_429").inc(5)
    t.hits.labels("p0").inc(10)
    t.queries.labels("p0").inc(40)
    t.queries.labels("d0").inc(20)
    t.queue.labels("p0").set(3)
    t.queue.labels("d0").set(4)
    scrapes.append(t.scrape(110.0))
    assert _at("sum by (outcome) (rate(req_total[1m]))", scrapes) == {("ok",): 3.0, ("error_429",): 0.5}
    assert _at('sum(rate(req_total{outcome!="ok"}[1m]))', scrapes) == {(): 0.5}
    assert _at('sum(rate(req_total{outcome=~"error_.*"}[1m])) * 60', scrapes) == {(): 30.0}
    assert _at("sum by (worker) (rate(hits_total[1m])) / sum by (worker) (rate(queries_total[1m]))",
               scrapes) == {("p0",): 0.25, ("d0",): 0.0}
    assert _at("sum by (worker) (queue)", scrapes) == {("p0",): 3.0, ("d0",): 4.0}
    assert _at("max(queue) - 1", scrapes) == {(): 3.0}
    assert _at("increase(req_total[20s])", scrapes)[("ok",)] == pytest.approx(60.0)  # 3/s over the 20 s range
    assert _at("rate(req_total[5s])", scrapes) == {}  # one scrape in (105, 110]: no rate
    assert _at("rate(req_total[1m])", scrapes, at=0) == {}  # the first scrape alone


def test_counter_reset_and_irate():
    t = Target()
    t.requests.labels("ok").inc(100)
    scrapes = [t.scrape(0.0)]
    t.requests.labels("ok").inc(20)
    scrapes.append(t.scrape(10.0))
    restarted = Target()  # the process restarted: its counter starts again from zero
    restarted.requests.labels("ok").inc(6)
    scrapes.append(restarted.scrape(20.0))
    # increases: 20, then 6 after the reset, over 20 s
    assert _at("rate(req_total[1m])", scrapes) == {("ok",): pytest.approx(26 / 20)}
    assert _at("irate(req_total[1m])", scrapes) == {("ok",): pytest.approx(6 / 10)}


def test_histogram_quantile_interpolates_as_prometheus_does():
    t = Target()
    t.latency.observe(0.05)  # before the window
    scrapes = [t.scrape(0.0)]
    for value, times in ((0.05, 4), (0.3, 4), (0.7, 2)):
        for _ in range(times):
            t.latency.observe(value)
    scrapes.append(t.scrape(10.0))
    # in the window, buckets (cumulative) 0.1: 4, 0.5: 8, 1.0: 10, +Inf: 10 (per 10 s)
    quantile = "histogram_quantile({q}, sum by (le) (rate(lat_seconds_bucket[1m])))"
    assert _at(quantile.format(q=0.5), scrapes)[()] == pytest.approx(0.1 + 0.4 * (5 - 4) / 4)
    assert _at(quantile.format(q=0.9), scrapes)[()] == pytest.approx(0.5 + 0.5 * (9 - 8) / 2)
    assert _at(quantile.format(q=0.25), scrapes)[()] == pytest.approx(0.1 * 2.5 / 4)
    mean = "sum(rate(lat_seconds_sum[1m])) / sum(rate(lat_seconds_count[1m]))"
    assert _at(mean, scrapes)[()] == pytest.approx((4 * 0.05 + 4 * 0.3 + 2 * 0.7) / 10)
    for _ in range(30):
        t.latency.observe(5.0)  # beyond the last finite bucket
    scrapes.append(t.scrape(20.0))
    assert _at(quantile.format(q=0.99), scrapes)[()] == 1.0  # the +Inf bucket: its lower bound, as Prometheus
    idle = [t.scrape(30.0), t.scrape(40.0)]
    assert math.isnan(_at(quantile.format(q=0.5), idle)[()])  # no observations in the window


def _router_scrapes(path: Path) -> None:
    """Saved scrapes of pdkv's RouterMetrics, recorded as a router records a few requests."""
    stats = {"p0": {"kv_usage": 0.0, "num_running": 0, "num_waiting": 0, "prefix_cache_queries": 0,
                    "prefix_cache_hits": 0, "transfer": {"bytes_sent": 0}},
             "d0": {"kv_usage": 0.0, "num_running": 0, "num_waiting": 0, "prefix_cache_queries": 0,
                    "prefix_cache_hits": 0, "transfer": {"bytes_recv": 0, "failures": {}}}}
    metrics = RouterMetrics("m", lambda: [WorkerFigures(w, "prefill" if w == "p0" else "decode", True, s)
                                          for w, s in stats.items()])
    with open(path, "w") as f:
        for step in range(6):
            for _ in range(step):
                metrics.record_outcome("ok")
                metrics.record_tokens(1, 0.02 * step, first=True)
                metrics.record_tokens(3, 0.005, first=False)
                metrics.record_plan("remote", "fixed")
            for w in stats.values():
                w["kv_usage"] = step / 10
                w["prefix_cache_queries"] += 64 * step
                w["prefix_cache_hits"] += 16 * step
            stats["d0"]["transfer"]["bytes_recv"] += 1_000_000 * step
            f.write(json.dumps({"t": 1000.0 + 2 * step, "text": metrics.render().decode()}) + "\n")


def test_cli_draws_the_dashboard_from_saved_scrapes(tmp_path):
    scrapes, out = tmp_path / "scrapes.jsonl", tmp_path / "dash.png"
    _router_scrapes(scrapes)
    proc = subprocess.run([sys.executable, "-m", "pd.tools.dashboard_render", "--scrapes", str(scrapes),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    num_panels = sum(p["type"] != "row" for p in iter_panels(load_dashboard()))
    summary = proc.stdout.splitlines()[0]
    assert summary.startswith(f"{num_panels} panels, ") and summary.endswith(str(out)), proc.stdout
    empty = proc.stdout.split("no data: ", 1)[1] if "no data: " in proc.stdout else ""
    for recorded in ("Time to first token", "Requests by outcome", "KV cache usage", "Prefix cache hit rate",
                     "KV transfer throughput", "Planner decisions"):
        assert recorded not in empty.split(", "), proc.stdout


def test_cli_refuses_bad_input_clearly(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 1, "text": "x 1\\n"}\nnot json\n')
    proc = subprocess.run([sys.executable, "-m", "pd.tools.dashboard_render", "--scrapes", str(bad),
                           "--out", str(tmp_path / "x.png")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"{bad}:2: not a saved scrape" in proc.stderr
    one = tmp_path / "one.jsonl"
    one.write_text('{"t": 1, "text": "x 1\\n"}\n')
    proc = subprocess.run([sys.executable, "-m", "pd.tools.dashboard_render", "--scrapes", str(one),
                           "--out", str(tmp_path / "x.png")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "rates need at least two" in proc.stderr
