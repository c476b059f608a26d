"""deploy/grafana/pdkv-dashboard.json against Grafana's dashboard schema, and the dashboard's own rules.

The schema is the grafana-foundation-sdk's: its models are generated from Grafana's
dashboard schema (the CUE kinds), with one decoder per panel plugin and data source.
The dashboard must (1) decode into those models losing nothing (a key the schema
does not know, or one in the wrong place, is dropped on the way back out) and (2)
have every decoded value of the type and enum its field declares. Then the
dashboard's own rules: unique ids, panels on the 24-column grid without overlap,
every query on the `$datasource` variable, every selector filtered by `$model`,
every query inside the PromQL subset that pd.tools.dashboard_render evaluates.
"""
from __future__ import annotations

import copy
import enum
import json
import types
import typing
from pathlib import Path

import pytest
from grafana_foundation_sdk.cog import runtime as cog_runtime
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from pd.tools.dashboard_render.data import iter_panels, load_dashboard
from pd.tools.dashboard_render.promql import QueryError, expand, parse, selectors

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdkv-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

register_default_plugins()


def _decode(data: dict) -> Dashboard:
    return Dashboard.from_json(copy.deepcopy(data))


def _lost(original, round_trip, path: str = "$") -> list[str]:
    """Paths of `original` that are missing or changed in `round_trip` (which may add defaults)."""
    if isinstance(original, dict):
        if not isinstance(round_trip, dict):
            return [path]
        return [p for k, v in original.items()
                for p in ([f"{path}.{k}"] if k not in round_trip else _lost(v, round_trip[k], f"{path}.{k}"))]
    if isinstance(original, list):
        if not isinstance(round_trip, list) or len(original) != len(round_trip):
            return [path]
        pairs = enumerate(zip(original, round_trip, strict=True))
        return [p for i, (a, b) in pairs for p in _lost(a, b, f"{path}[{i}]")]
    return [] if original == round_trip else [path]


def _type_errors(value, hint, path: str) -> list[str]:
    """Where a decoded model value does not have the type its schema field declares."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return []
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and hasattr(a, "to_json") and isinstance(value, a)]
        if models:  # a decoded model (Panel or RowPanel, ...): checked as the one it was decoded into
            return _type_errors(value, models[0], path)
        if value is not None:
            args = tuple(a for a in args if a is not type(None))
        tries = [_type_errors(value, arg, path) for arg in args]
        return [] if any(not t for t in tries) else min(tries, key=len)
    if hint is type(None):
        return [] if value is None else [f"{path}: {value!r} is not null"]
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} not in {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        return [e for i, item in enumerate(value) for e in _type_errors(item, args[0], f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is not an object"]
        return [e for k, item in value.items() for e in _type_errors(item, args[1], f"{path}.{k}")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return [] if value in {m.value for m in hint} else [f"{path}: {value!r} not one of {[m.value for m in hint]}"]
    if hint is bool:
        return [] if isinstance(value, bool) else [f"{path}: {value!r} is not a boolean"]
    if hint in (int, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (hint is float or value == int(value))
        return [] if ok else [f"{path}: {value!r} is not {hint.__name__}"]
    if hint is str:
        return [] if isinstance(value, str) else [f"{path}: {value!r} is not a string"]
    if hint is object:  # plugin-typed fields (panel options, custom field config): decoded by the plugin's model
        return _model_errors(value, path) if hasattr(value, "to_json") else []
    if isinstance(hint, type):
        if isinstance(value, cog_runtime.UnknownDataquery):
            return [f"{path}: a query no data source plugin decodes: {value.data}"]
        return _model_errors(value, path) if isinstance(value, hint) else [f"{path}: {value!r} is not {hint.__name__}"]
    return []


def _model_errors(model, path: str) -> list[str]:
    hints = typing.get_type_hints(type(model))
    return [e for name, hint in hints.items() for e in _type_errors(getattr(model, name), hint, f"{path}.{name}")]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard(DASHBOARD)


def test_dashboard_decodes_into_grafanas_schema_losing_nothing(dashboard):
    round_trip = json.loads(json.dumps(_decode(dashboard), cls=JSONEncoder))
    assert _lost(dashboard, round_trip) == []


def test_every_decoded_value_has_its_schema_type(dashboard):
    assert _model_errors(_decode(dashboard), "dashboard") == []


def test_the_schema_checks_catch_what_grafana_would_not_read(dashboard):
    """The two checks above can fail: an unknown key, a misplaced one, a wrong type, a bad enum."""
    broken = copy.deepcopy(dashboard)
    panel = next(p for p in broken["panels"] if p["type"] == "timeseries")
    panel["gridPos"]["height"] = 8
    panel["targets"][0]["expression"] = panel["targets"][0]["expr"]
    panel["options"]["legend"]["position"] = "bottom"
    round_trip = json.loads(json.dumps(_decode(broken), cls=JSONEncoder))
    assert len(_lost(broken, round_trip)) == 3
    typed = copy.deepcopy(dashboard)
    panel = next(p for p in typed["panels"] if p["type"] == "timeseries")
    panel["gridPos"]["w"] = "8"
    panel["options"]["legend"]["displayMode"] = "sideways"
    typed["graphTooltip"] = 7
    assert len(_model_errors(_decode(typed), "dashboard")) == 3


def test_ids_unique_and_panels_on_the_grid_without_overlap(dashboard):
    panels = list(iter_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] >= 1, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_every_query_uses_the_datasource_variable_and_the_dashboards_promql_subset(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["datasource"] == DATASOURCE
    panels = [p for p in iter_panels(dashboard) if p["type"] != "row"]
    assert len(panels) >= 30
    for panel in panels:
        assert panel["datasource"] == DATASOURCE and panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE
            query = parse(expand(target["expr"], {"model": "$model", "__rate_interval": "1m"}))
            for selector in selectors(query):
                assert any(m.label == "model_name" and m.op == "=~" and m.value == "$model"
                           for m in selector.matchers), (panel["title"], target["expr"])


def test_the_issues_panels_are_there(dashboard):
    """TTFT / TPOT / ITL histograms, queue depth, KV usage, prefix hit rate per worker, transfer
    bytes/s and failures by cause, planner decisions, index state, the TTFT stages, the vLLM twins."""
    exprs = " ".join(t["expr"] for p in iter_panels(dashboard) for t in p.get("targets", []))
    for needle in ("histogram_quantile(0.99, sum by (le) (rate(pdkv_time_to_first_token_seconds_bucket",
                   "pdkv_inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                   "pdkv_worker_num_waiting", "pdkv_worker_kv_usage_ratio",
                   "sum by (worker) (rate(pdkv_worker_prefix_cache_hits_total",
                   "rate(pdkv_kv_transfer_bytes_recv_total", "sum by (cause) (rate(pdkv_kv_transfer_failures_total",
                   "sum by (kind, reason) (rate(pdkv_planner_decisions_total", "pdkv_kv_event_batches_total",
                   "pdkv_ttft_stage_seconds_bucket", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                   "pdkv_kv_audit_mismatched_total", "pdkv_kv_audit_worst_diff"):
        assert needle in exprs, needle


def test_a_query_outside_the_subset_is_refused_clearly():
    for bad in ('topk(3, pdkv_requests_total)', 'rate(pdkv_requests_total)', 'sum(pdkv_x{a~"b"})',
                'pdkv_requests_total offset 5m'):
        with pytest.raises(QueryError):
            parse(bad)
    with pytest.raises(QueryError, match=r"\$nope"):
        expand('pdkv_x{a=~"$nope"}', {"model": ".+"})
