"""Checks that every query of deploy/grafana/pdkv-dashboard.json names a metric a live router really exports.

Run by tests/e2e/test_pd_1p1d.py on its real 1P1D deployment (Ray, worker actors, ZMQ KV
transfer, HTTP), which serves a few more completions here, streamed and not; the router's /metrics (which carries the workers'
figures too, from its last poll) is scraped before, between and after. Then:
every metric a query names is declared in the exposition with the type the query
assumes (rate over counters and histogram series, histogram_quantile over
`_bucket`, plain selectors over gauges); every one has samples, except the few
that only a fault brings (`ONLY_ON_FAULTS`, each still declared); and every panel
whose metrics all have samples shows data when the dashboard's own queries are
evaluated over the scrapes (pd.tools.dashboard_render).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import requests

from pd.tools.dashboard_render.cli import ScrapeTarget, collect_scrapes, read_scrapes
from pd.tools.dashboard_render.data import iter_panels, load_dashboard, panel_data
from pd.tools.dashboard_render.promql import Node, RangeCall, Scrape, Selector, expand, parse

from tests.helpers.e2e import PROMPTS, complete, stream_events, wait_all_free, worker_reports

# Counted only when something goes wrong (or, for mispredictions, when the index guessed wrong).
ONLY_ON_FAULTS = {"pdkv_kv_transfer_failures_total", "pdkv_kv_transfer_handshakes_refused_total",
                  "pdkv_worker_failures_total", "pdkv_prefix_hit_mispredictions_total",
                  "pdkv_kv_index_resyncs_total"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _scrape(url: str) -> Scrape:
    worker_reports(url)  # a worker poll now: /metrics carries the workers' figures as of the last poll
    resp = requests.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200, resp.text[:200]
    return Scrape.parse(time.time(), resp.text), resp.text


def _uses(node: Node, ranged: bool = False) -> list[tuple[str, bool]]:
    """(metric name, whether it is read over a range) for every selector in the query."""
    if isinstance(node, Selector):
        return [(node.name, ranged)]
    if isinstance(node, RangeCall):
        return [(node.selector.name, True)]
    children = [getattr(node, f) for f in ("expr", "left", "right") if hasattr(node, f)]
    return [use for child in children for use in _uses(child, ranged)]


def _declared_type(name: str, types: dict[str, str]) -> str | None:
    if name in types:
        return types[name]
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and types.get(name.removesuffix(suffix)) == "histogram":
            return f"histogram{suffix}"
    return None


def check_dashboard_queries(router: str) -> None:
    """Every query names a metric `router` exports, with samples and data (see the module docstring)."""
    dashboard = load_dashboard()
    variables = {"model": ".+", "__rate_interval": "10m"}
    panels = [p for p in iter_panels(dashboard) if p["type"] != "row"]
    uses = {p["id"]: [u for t in p["targets"] for u in _uses(parse(expand(t["expr"], variables)))] for p in panels}
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            metric = re.fullmatch(r"label_values\((\S+), (\w+)\)", v["query"])
            assert metric, v["query"]
            uses[f"${v['name']}"] = [(metric.group(1), False)]

    scrapes = [_scrape(router)[0]]
    for i, prompt in enumerate(PROMPTS * 2):
        if i % 2:
            assert stream_events(router, prompt, ignore_eos=True)[-1] == "[DONE]"
        else:
            complete(router, prompt, ignore_eos=True)
        if i % 4 == 3:
            scrapes.append(_scrape(router)[0])
    wait_all_free(router)
    last, text = _scrape(router)
    scrapes.append(last)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))

    names = {name for used in uses.values() for name, _ in used}
    assert ONLY_ON_FAULTS <= names  # the exemption names only metrics the dashboard reads
    for where, used in uses.items():
        for name, ranged in used:
            kind = _declared_type(name, types)
            assert kind is not None, f"{where}: {name} is not in the router's /metrics"
            if ranged:
                assert kind == "counter" or kind.startswith("histogram"), f"{where}: rate() over {kind} {name}"
            elif where == "$model":  # label_values() reads any series
                assert kind in ("gauge", "counter"), (where, name, kind)
            else:
                assert kind == "gauge", f"{where}: {name} ({kind}) read without rate()"
            if name.endswith("_bucket"):
                assert kind == "histogram_bucket", name
    missing = sorted(n for n in names - ONLY_ON_FAULTS if n not in last.samples)
    assert missing == [], f"declared but no samples after real requests: {missing}"

    run_variables = {"model": ".+", "__rate_interval": f"{int(last.t - scrapes[0].t) + 60}s"}
    for panel in panels:
        if all(name in last.samples for name, _ in uses[panel["id"]]):
            assert panel_data(panel, scrapes, run_variables).has_data, panel["title"]


def check_render_tool(router: str, tmp_path: Path) -> None:
    """pd.tools.dashboard_render scrapes the live router and saves what it read."""
    saved = tmp_path / "scrapes.jsonl"
    complete(router, PROMPTS[0])
    scrapes = collect_scrapes(ScrapeTarget(router, interval_s=0.5, duration_s=2.0, wait_s=10.0), saved)
    assert len(scrapes) >= 2 and all(s.samples["pdkv_requests_total"] for s in scrapes)
    assert [s.t for s in read_scrapes(saved)] == [s.t for s in scrapes]

