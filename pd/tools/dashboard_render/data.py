"""The pdkv Grafana dashboard's panels, evaluated over scrapes: what pd.tools.dashboard_render draws.

`panel_data` runs each of a panel's targets (its PromQL, with the dashboard's
template variables filled in) at every scrape and names each resulting series
by the target's `legendFormat`, as Grafana does.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

from pd.tools.dashboard_render.promql import Scrape, evaluate_range, expand, parse

DEFAULT_DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "pdkv-dashboard.json"


@dataclasses.dataclass(frozen=True)
class Series:
    legend: str
    values: list[float]  # one per scrape, NaN where the query had no value


@dataclasses.dataclass(frozen=True)
class PanelData:
    panel: dict
    series: list[Series]

    @property
    def has_data(self) -> bool:
        return any(not math.isnan(v) for s in self.series for v in s.values)


def load_dashboard(path: str | Path = DEFAULT_DASHBOARD) -> dict:
    with open(path) as f:
        dashboard = json.load(f)
    if not isinstance(dashboard, dict) or not isinstance(dashboard.get("panels"), list):
        raise ValueError(f"{path}: not a Grafana dashboard (no panels list)")
    return dashboard


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel in order, rows included, a collapsed row's own panels right after it."""
    for panel in dashboard["panels"]:
        yield panel
        if panel.get("type") == "row":
            yield from panel.get("panels", [])


def variables_for(scrapes: list[Scrape], model: str = ".+", rate_interval_s: float | None = None) -> dict[str, str]:
    """Values for the dashboard's template variables: `$model` (a regex, like Grafana's All) and
    `$__rate_interval`."""
    if rate_interval_s is None:
        gaps = [b.t - a.t for a, b in pairwise(scrapes)]
        rate_interval_s = 4 * statistics.median(gaps) if gaps else 60.0
    return {"model": model, "__rate_interval": f"{max(1, math.ceil(rate_interval_s))}s"}


def panel_data(panel: dict, scrapes: list[Scrape], variables: dict[str, str]) -> PanelData:
    """The panel's targets evaluated at every scrape, one Series per resulting label set."""
    series = []
    for target in panel.get("targets", []):
        if target.get("hide"):
            continue
        result = evaluate_range(parse(expand(target["expr"], variables)), scrapes)
        for labels, values in sorted(result.items()):
            series.append(Series(_legend(target.get("legendFormat", ""), dict(labels)), values))
    return PanelData(panel, series)


def _legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt or fmt == "__auto":
        shown = {k: v for k, v in labels.items() if k not in ("__name__", "model_name")}
        return ", ".join(f"{k}={v}" for k, v in shown.items()) or "value"
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value).replace("{{ " + key + " }}", value)
    return out
