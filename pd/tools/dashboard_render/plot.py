"""Draws a Grafana dashboard's evaluated panels into one PNG, laid out by their grid positions.

Grafana's grid is 24 columns wide and counts heights in 30-pixel units; here a
column is WIDTH_IN / 24 inches and a height unit UNIT_IN inches, so the picture
keeps the dashboard's arrangement. Timeseries panels draw their series with
the panel's unit on the y axis and the legend below, as Grafana does; stat
panels show their last value over a faint sparkline; heatmap panels turn a
`sum by (le) (rate(..._bucket))` query into per-bucket rates over time. Rows
are headers; a row collapsed in Grafana is drawn open and says so.
"""
from __future__ import annotations

import io
import math

from pd.tools.dashboard_render.data import PanelData, iter_panels

WIDTH_IN = 20.0
UNIT_IN = 0.3
DPI = 80
PALETTE_COLOURS = 128
BACKGROUND, PANEL, GRID, TEXT, DIM = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e9a"
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a", "#37872d",
           "#c4162a", "#1f60c4", "#8f3bb8")
_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_value(value: float, unit: str) -> str:
    """A value in the panel's Grafana unit (s, percentunit, Bps, reqps, short)."""
    if math.isnan(value):
        return "No data"
    if unit == "s":
        if value == 0:
            return "0 s"
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value * 1e9:.3g} ns"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    suffix = {"Bps": "B/s", "reqps": " req/s"}.get(unit, "")
    for scale, prefix in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{suffix.strip()}" if suffix else f"{value / scale:.3g}{prefix}"
    return f"{value:.3g} {suffix.strip()}".strip() if suffix else f"{value:.3g}"


def draw(dashboard: dict, data: list[PanelData], times_s: list[float], title: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_id = {id(d.panel): d for d in data}
    panels = list(iter_panels(dashboard))
    height_units = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig_h = height_units * UNIT_IN + 0.5
    fig = plt.figure(figsize=(WIDTH_IN, fig_h), facecolor=BACKGROUND)
    fig.text(0.006, 1 - 0.12 / fig_h, title, color=TEXT, fontsize=11, va="top", weight="bold")

    def rect(panel: dict, pad: float = 0.05) -> tuple[float, float, float, float]:
        g = panel["gridPos"]
        left = g["x"] / 24 + pad / WIDTH_IN
        top = (0.5 + g["y"] * UNIT_IN + pad) / fig_h
        return left, 1 - top - (g["h"] * UNIT_IN - 2 * pad) / fig_h, g["w"] / 24 - 2 * pad / WIDTH_IN, \
            (g["h"] * UNIT_IN - 2 * pad) / fig_h

    for panel in panels:
        if panel.get("type") == "row":
            left, bottom, width, height = rect(panel)
            note = "   (collapsed in Grafana)" if panel.get("collapsed") else ""
            fig.text(left, bottom + height / 2, panel.get("title", "") + note, color=TEXT, fontsize=11,
                     va="center", weight="bold")
            continue
        left, bottom, width, height = rect(panel)
        fig.patches.append(matplotlib.patches.Rectangle((left, bottom), width, height, transform=fig.transFigure,
                                                        facecolor=PANEL, edgecolor=GRID, linewidth=0.8, zorder=-10))
        fig.text(left + 0.08 / WIDTH_IN, bottom + height - 0.06 / fig_h, panel.get("title", ""), color=TEXT,
                 fontsize=9, va="top", weight="bold")
        d = by_id.get(id(panel))
        if d is None:
            continue
        kind = panel.get("type")
        if kind == "stat":
            _stat(fig, d, times_s, (left, bottom, width, height), fig_h)
        elif kind == "heatmap":
            _heatmap(fig, d, times_s, (left, bottom, width, height), fig_h)
        else:
            _timeseries(fig, d, times_s, (left, bottom, width, height), fig_h)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, facecolor=BACKGROUND)
    plt.close(fig)
    _save_small(buffer, out)


def _save_small(buffer: io.BytesIO, out: str) -> None:
    """The PNG with its colours reduced to a palette: a dashboard has few, and the file shrinks several-fold."""
    from PIL import Image

    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=PALETTE_COLOURS).save(out, format="PNG", optimize=True)


def _unit(panel: dict) -> str:
    return panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")


def _axes(fig, box, fig_h: float, legend_rows: int):
    left, bottom, width, height = box
    legend_h = (0.16 * legend_rows + 0.05) / fig_h
    ax = fig.add_axes((left + 0.62 / WIDTH_IN, bottom + 0.28 / fig_h + legend_h, width - 0.75 / WIDTH_IN,
                       height - 0.62 / fig_h - legend_h), facecolor=PANEL)
    ax.tick_params(colors=DIM, labelsize=8, length=2)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.grid(True, color=GRID, linewidth=0.5)
    return ax


def _no_data(fig, box) -> None:
    left, bottom, width, height = box
    fig.text(left + width / 2, bottom + height / 2, "No data", color=DIM, fontsize=10, ha="center", va="center")


def _timeseries(fig, d: PanelData, times_s: list[float], box, fig_h: float) -> None:
    from matplotlib.ticker import FuncFormatter

    series = [s for s in d.series if any(math.isfinite(v) for v in s.values)]
    if not series:
        _no_data(fig, box)
        return
    ncol = max(1, min(len(series), int(box[2] * WIDTH_IN / 2.2)))
    ax = _axes(fig, box, fig_h, math.ceil(len(series) / ncol))
    unit = _unit(d.panel)
    defaults = d.panel.get("fieldConfig", {}).get("defaults", {})
    stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
    base = [0.0] * len(times_s)
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        values = [v if math.isfinite(v) else math.nan for v in s.values]
        if stacked:
            values = [b + (0.0 if math.isnan(v) else v) for b, v in zip(base, values, strict=True)]
            ax.fill_between(times_s, base, values, color=color, alpha=0.25, linewidth=0)
            base = values
        ax.plot(times_s, values, color=color, linewidth=1.2, label=s.legend)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    if "min" in defaults:
        ax.set_ylim(bottom=defaults["min"])
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"] * 1.02)
    ax.set_xlim(times_s[0], times_s[-1])
    ax.set_xlabel("s", color=DIM, fontsize=7, labelpad=0)
    legend = ax.legend(loc="upper left", bbox_to_anchor=(0, -0.12 * 8 * UNIT_IN / (box[3] * fig_h)), ncol=ncol,
                       fontsize=8, frameon=False, handlelength=1.2, borderaxespad=0, columnspacing=1.0)
    for text in legend.get_texts():
        text.set_color(TEXT)


def _stat(fig, d: PanelData, times_s: list[float], box, fig_h: float) -> None:
    left, bottom, width, height = box
    values = d.series[0].values if d.series else [math.nan] * len(times_s)
    finite = [(t, v) for t, v in zip(times_s, values, strict=True) if math.isfinite(v)]
    if not finite:
        _no_data(fig, box)
        return
    ax = fig.add_axes((left, bottom, width, height * 0.45), facecolor="none")
    ax.axis("off")
    ax.fill_between([t for t, _ in finite], [v for _, v in finite], color=PALETTE[0], alpha=0.18, linewidth=0)
    ax.set_xlim(times_s[0], times_s[-1])
    ax.set_ylim(bottom=min(0.0, min(v for _, v in finite)))
    fig.text(left + width / 2, bottom + height * 0.42, format_value(finite[-1][1], _unit(d.panel)),
             color=PALETTE[0], fontsize=22, ha="center", va="center", weight="bold")


def _heatmap(fig, d: PanelData, times_s: list[float], box, fig_h: float) -> None:
    bounds = []
    for s in d.series:
        try:
            bounds.append((float(s.legend), s.values))
        except ValueError:
            continue
    bounds.sort()
    if len(bounds) < 2:
        _no_data(fig, box)
        return
    # cumulative per-le rates -> per-bucket rates, per scrape
    cells = [[max(0.0, (v if math.isfinite(v) else 0.0) - (p if math.isfinite(p) else 0.0))
              for v, p in zip(values, bounds[i - 1][1] if i else [0.0] * len(values), strict=True)]
             for i, (_, values) in enumerate(bounds)]
    used = [i for i, row in enumerate(cells) if any(c > 0 for c in row)]
    if not used:
        _no_data(fig, box)
        return
    rows = range(used[0], used[-1] + 1)
    ax = _axes(fig, box, fig_h, 0)
    edges_t = times_s + [times_s[-1] + (times_s[-1] - times_s[-2] if len(times_s) > 1 else 1.0)]
    ax.pcolormesh(edges_t, list(range(len(rows) + 1)), [cells[i] for i in rows], cmap="inferno", shading="flat")
    ax.set_yticks([k + 0.5 for k in range(len(rows))])
    ax.set_yticklabels([("+Inf" if math.isinf(bounds[i][0]) else format_value(bounds[i][0], "s")) for i in rows],
                       fontsize=6)
    ax.set_xlabel("s (colour: requests/s per bucket, by upper bound)", color=DIM, fontsize=7, labelpad=0)
