"""`python -m pd.tools.dashboard_render`: the Grafana dashboard's panels, drawn with matplotlib from scrapes.

Grafana is not everywhere pdkv runs, so this draws deploy/grafana/pdkv-dashboard.json
itself: it evaluates each panel's own queries (the PromQL subset of
`pd.tools.dashboard_render.promql`) at every scrape and lays the panels out by
their grid positions (pd.tools.dashboard_render.plot).

Two ways in:

    # scrape a running router every --interval-s until it goes away (or --duration-s):
    python -m pd.tools.dashboard_render --url http://127.0.0.1:8000 --save-scrapes run.jsonl --out dash.png
    # or draw scrapes saved by an earlier run:
    python -m pd.tools.dashboard_render --scrapes run.jsonl --out dash.png

Before each scrape the router is asked to poll its workers (/pd/workers?refresh=1,
with --admin-key or $PDKV_ADMIN_KEY where the deployment has one), so the
per-worker series are current. Saved scrapes are JSON lines: {"t": unix seconds,
"text": the exposition}. `$__rate_interval` is 4 scrape intervals (Grafana's
rule for a dashboard step below the scrape interval) unless --rate-interval-s says.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pd.tools.dashboard_render.data import DEFAULT_DASHBOARD, iter_panels, load_dashboard, panel_data, variables_for
from pd.tools.dashboard_render.promql import Scrape

logger = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ScrapeTarget:
    url: str
    admin_key: str | None = None
    interval_s: float = 2.0
    duration_s: float = 600.0
    wait_s: float = 300.0  # for the router to answer at all


# -- scrapes ----------------------------------------------------------------
def read_scrapes(path: str | Path) -> list[Scrape]:
    scrapes = []
    with open(path) as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                scrapes.append(Scrape.parse(float(record["t"]), str(record["text"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{num}: not a saved scrape ({exc})") from exc
    scrapes.sort(key=lambda s: s.t)
    return scrapes


def collect_scrapes(target: ScrapeTarget, save_path: str | Path | None = None) -> list[Scrape]:
    """Scrapes the router every interval until `duration_s` passed or the router stopped answering."""
    started = time.monotonic()
    texts: list[tuple[float, str]] = []
    save = open(save_path, "w") if save_path else None  # noqa: SIM115 - closed in finally
    try:
        while time.monotonic() - started < target.duration_s:
            began = time.monotonic()
            text = _scrape_once(target)
            if text is None:
                if texts:
                    logger.info("the router stopped answering; %d scrapes taken", len(texts))
                    break
                if time.monotonic() - started > target.wait_s:
                    raise TimeoutError(f"{target.url} did not answer /metrics within {target.wait_s:.0f}s")
            else:
                now = time.time()
                texts.append((now, text))
                if save is not None:
                    save.write(json.dumps({"t": now, "text": text}) + "\n")
                    save.flush()
            time.sleep(max(0.0, target.interval_s - (time.monotonic() - began)))
    finally:
        if save is not None:
            save.close()
    return [Scrape.parse(t, text) for t, text in texts]


def _scrape_once(target: ScrapeTarget) -> str | None:
    """The exposition, or None when the router does not answer (not up yet, or gone)."""
    headers = {"Authorization": f"Bearer {target.admin_key}"} if target.admin_key else {}
    try:
        _get(f"{target.url}/pd/workers?refresh=1", headers)
    except urllib.error.HTTPError as exc:  # e.g. 429 while another refresh runs: the last poll's figures
        log = logger.warning if exc.code in (401, 403) else logger.debug
        log("worker refresh answered %s (the admin key: --admin-key or $PDKV_ADMIN_KEY)", exc.code)
    except OSError:
        return None
    try:
        return _get(f"{target.url}/metrics", headers)
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{target.url}/metrics answered HTTP {exc.code}") from exc
    except OSError:
        return None


def _get(url: str, headers: dict[str, str]) -> str:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
        return resp.read().decode()


# -- CLI --------------------------------------------------------------------
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pd.tools.dashboard_render", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a running router's base URL, scraped until it goes away")
    source.add_argument("--scrapes", help="JSON lines of saved scrapes ({t, text})")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--dashboard", default=str(DEFAULT_DASHBOARD), help="Grafana dashboard JSON")
    p.add_argument("--save-scrapes", default=None, help="with --url: also write the scrapes here")
    p.add_argument("--interval-s", type=float, default=2.0, help="with --url: seconds between scrapes")
    p.add_argument("--duration-s", type=float, default=600.0, help="with --url: stop after this long")
    p.add_argument("--wait-s", type=float, default=300.0, help="with --url: how long the router may take to answer")
    p.add_argument("--admin-key", default=None,
                   help="the router's admin key, where it has one (default: $PDKV_ADMIN_KEY)")
    p.add_argument("--model", default=".+", help="value of the $model variable (a regex; default: all)")
    p.add_argument("--rate-interval-s", type=float, default=None, help="$__rate_interval (default: 4 intervals)")
    p.add_argument("--title", default=None, help="figure title (default: the dashboard's, and the time span)")
    args = p.parse_args(argv)
    if args.interval_s <= 0 or args.duration_s <= 0:
        p.error("--interval-s and --duration-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        dashboard = load_dashboard(args.dashboard)
        if args.url:
            admin_key = args.admin_key or os.environ.get("PDKV_ADMIN_KEY")  # not a default: --help would show it
            target = ScrapeTarget(args.url.rstrip("/"), admin_key, args.interval_s, args.duration_s, args.wait_s)
            scrapes = collect_scrapes(target, args.save_scrapes)
        else:
            scrapes = read_scrapes(args.scrapes)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(scrapes) < 2:
        print(f"error: {len(scrapes)} scrape(s); rates need at least two", file=sys.stderr)
        return 2
    from pd.tools.dashboard_render.plot import draw

    variables = variables_for(scrapes, args.model, args.rate_interval_s)
    data = [panel_data(p, scrapes, variables) for p in iter_panels(dashboard) if p.get("type") != "row"]
    span_s = scrapes[-1].t - scrapes[0].t
    title = args.title or (f"{dashboard.get('title', 'dashboard')}: {len(scrapes)} scrapes over {span_s:.0f} s, "
                           f"$__rate_interval = {variables['__rate_interval']}")
    draw(dashboard, data, [s.t - scrapes[0].t for s in scrapes], title, args.out)
    empty = [d.panel.get("title", "?") for d in data if not d.has_data]
    print(f"{len(data)} panels, {len(data) - len(empty)} with data, from {len(scrapes)} scrapes over {span_s:.0f} s "
          f"-> {args.out}")
    if empty:
        print(f"no data: {', '.join(empty)}")
    return 0
