"""Load and faults at once, on a real Ray deployment: `python -m pd.tools.load_faults`.

It starts a 1P2D deployment (default `deploy/local.yaml`, the tiny random model, greedy),
records each prompt's tokens on the undisturbed deployment, then for `--duration-s` runs
`--clients` streaming clients while it
- SIGKILLs a decode worker (`--kill-after-s` into the load),
- holds `--junk` unauthenticated connections on the prefill worker's data port,
- sends unauthenticated REFUSE frames with varied reasons to its side channel (`--refuse-rate`/s),
- holds `--router-idle` idle connections on the router's port (past its connection cap the
  router closes the least recently used; the holder opens them again),
- holds `--event-subscribers` never-reading subscribers on the prefill worker's KV event stream
  (half with the deployment secret, up to the worker's cap admitted; half plain, refused),
- sends `--poisoned` completions with poisoned sampling values (near-0 and subnormal
  temperature and top_p, huge top_k, extreme seeds), each of which must be answered 200,
and samples the RSS of the router (this process) and of every worker, which workers the router
has out of its rotation, and the KV event stream's subscriber count. It prints a short report:
requests by status, how many were token-identical to the reference, RSS before / peak / after per
process, and the pools' audit; it exits 1 when the run broke the contract of
`pd.tools.load_faults.report`.

The clients and the unauthenticated traffic run in a process of their own
(`pd.tools.load_faults.driver`), so the router's event loop shares no GIL with them.

    python -m pd.tools.load_faults [--clients 300 --duration-s 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable
from typing import Any

import requests

from pd.cluster.config import ConfigError, DeployConfig, load_deploy_config
from pd.deploy.launch import Deployment, init_ray, shutdown_ray
from pd.tools.load_faults.report import LoadFaultsReport, RSSTrack

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
HTTP_TIMEOUT_S = 60.0
RSS_SAMPLE_S = 0.2
STATS_EVERY = 5  # RSS samples per probe of the KV event stream's subscriber count
WORDS = ("fox", "dog", "river", "lamp", "cloud", "stone", "bird", "engine", "paper", "garden", "window", "clock")


@dataclasses.dataclass(frozen=True)
class LoadFaultsSettings:
    """One run's shape; the defaults are the full acceptance run (300 clients for 20 s)."""

    num_clients: int = 300
    duration_s: float = 20.0
    kill_after_s: float = 6.0
    victim: str = "decode-0"
    num_junk: int = 70
    refuse_rate: float = 300.0
    num_router_idle: int = 10_000
    num_event_subscribers: int = 100
    num_poisoned: int = 100
    num_prompts: int = 24
    max_tokens: int = 24
    request_timeout_s: float = 60.0
    max_rss_growth_mb: float = 256.0

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.kill_after_s < self.duration_s:
            raise ValueError(f"kill_after_s must be in [0, duration_s), got {self.kill_after_s}")
        for name in ("num_junk", "refuse_rate", "num_router_idle", "num_event_subscribers", "num_poisoned"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def make_prompts(num: int) -> list[str]:
    """Distinct prompts of 30-150 bytes, in families that share a prefix (prefix hits on D)."""
    out = []
    for i in range(num):
        family = WORDS[i % 4]
        tail = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(2 + i % 9))
        out.append(f"Request {family}: the {family} and the {WORDS[(i + 5) % len(WORDS)]} meet; {tail} (#{i})")
    return out


def default_config(path: str | Path = REPO / "deploy" / "local.yaml", num_decode: int = 2) -> DeployConfig:
    """1P`num_decode`D from a deploy YAML, with any free router port and a health poll fast
    enough to see the kill."""
    config = load_deploy_config(path)
    return config.replace(topology__mode="disaggregated", topology__num_prefill=1, topology__num_decode=num_decode,
                          router__port=0, router__health_interval_s=0.5, transfer__lease_s=5.0,
                          transfer__timeout_s=5.0)


def read_rss_mb(pid: int) -> float | None:
    """Resident set size from /proc (Linux), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class _RSSSampler(threading.Thread):
    """Every `RSS_SAMPLE_S`: each process's RSS, and the router's rotation (`left_rotation`: worker
    id -> seconds from `t0` it was first seen out); every `STATS_EVERY` samples `stats_probe`."""

    def __init__(self, tracks: dict[str, RSSTrack], dep: Deployment, stats_probe: Callable[[], object]) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.tracks, self.stop = tracks, threading.Event()
        self.dep, self.stats_probe = dep, stats_probe
        self.t0 = time.monotonic()
        self.left_rotation: dict[str, float] = {}

    def run(self) -> None:
        k = 0
        while not self.stop.wait(RSS_SAMPLE_S):
            for track in self.tracks.values():
                mb = read_rss_mb(track.pid)
                if mb is not None:
                    track.observe(mb)
            assert self.dep.router is not None
            for load in self.dep.router.pool.all():
                if not load.healthy:
                    self.left_rotation.setdefault(load.endpoint.worker_id, round(time.monotonic() - self.t0, 1))
            k += 1
            if k % STATS_EVERY == 0:
                try:
                    self.stats_probe()
                except (requests.RequestException, KeyError, TypeError) as exc:
                    logger.debug("stats probe failed: %s", exc)


class _RouterEvents(logging.Handler):
    """Counts the router's migrations and re-dispatches from its own log records."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.num_migrations = 0
        self.num_redispatches = 0

    def emit(self, record: logging.LogRecord) -> None:
        template = str(record.msg)
        if "continuing on another" in template:
            self.num_migrations += 1
        elif "retrying on another" in template:
            self.num_redispatches += 1


class _Workers:
    """The deployment's workers through their authenticated internal API."""

    def __init__(self, dep: Deployment) -> None:
        self.urls = {w.endpoint.worker_id: w.endpoint.url for w in dep.workers}
        self._headers = {"Authorization": f"Bearer {dep.secret}"}

    def get(self, worker_id: str, path: str, timeout_s: float = HTTP_TIMEOUT_S) -> dict:
        resp = requests.get(f"{self.urls[worker_id]}{path}", headers=self._headers, timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()


def _reference(url: str, headers: dict, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens on the undisturbed deployment (8 at a time)."""

    def one(prompt: str) -> list[int]:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True}
        resp = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
        resp.raise_for_status()
        return resp.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, prompts))


def _metrics_lines(url: str, headers: dict) -> int:
    resp = requests.get(f"{url}/metrics", headers=headers, timeout=HTTP_TIMEOUT_S)
    resp.raise_for_status()
    return len(resp.text.splitlines())


def _start_driver(spec: dict) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "pd.tools.load_faults.driver"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    return proc


def _read_event(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The driver's next JSON line, or an error naming the wait."""
    box: list = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not box or not box[0]:
        raise RuntimeError(f"the load driver sent nothing within {timeout_s:.0f} s (exit code {proc.poll()})")
    return json.loads(box[0])


def run_load_faults(dep: Deployment, settings: LoadFaultsSettings) -> LoadFaultsReport:
    """One run against a started 1PnD deployment (n >= 2); Ray is initialized by the caller."""
    assert dep.url is not None and dep.router is not None, "the deployment is not started"
    t_start = time.monotonic()
    workers = _Workers(dep)
    if settings.victim not in workers.urls:
        raise ValueError(f"victim {settings.victim!r} is not a worker of this deployment ({sorted(workers.urls)})")
    health = {wid: workers.get(wid, "/internal/health") for wid in workers.urls}
    producers = [wid for wid, h in health.items() if h.get("kv_ports")]
    if not producers:
        raise ValueError("the deployment has no prefill worker with KV ports")
    ports = health[producers[0]]["kv_ports"]
    survivors = [wid for wid, h in health.items() if h["role"] == "decode" and wid != settings.victim]
    if not survivors:
        raise ValueError("the run needs a second decode worker to migrate to")

    prompts = make_prompts(settings.num_prompts)
    api_key = dep.config.router.api_key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reference = _reference(dep.url, headers, prompts, settings.max_tokens)
    tracks = {"router": RSSTrack(os.getpid())} | {wid: RSSTrack(int(h["pid"])) for wid, h in health.items()}
    for track in tracks.values():
        track.before_mb = track.peak_mb = read_rss_mb(track.pid) or 0.0
    metrics_before = _metrics_lines(dep.url, headers)
    stats_before = workers.get(producers[0], "/internal/stats")
    refused_before = stats_before["transfer"].get("handshakes_refused", {})
    kv_before = stats_before.get("kv_events") or {}
    if settings.num_event_subscribers and not kv_before.get("endpoint"):
        raise ValueError(f"{producers[0]} publishes no KV events (prefix caching off?)")
    kv_seen = {"worker_id": producers[0], "before_subscribers": kv_before.get("num_subscribers", 0),
               "max_subscribers": kv_before.get("max_subscribers", 0),
               "peak_subscribers": kv_before.get("num_subscribers", 0)}

    def probe_subscribers() -> dict:
        info = workers.get(producers[0], "/internal/stats", timeout_s=5.0)["kv_events"]
        kv_seen["peak_subscribers"] = max(kv_seen["peak_subscribers"], info["num_subscribers"])
        return info
    loads_before = {wid: workers.get(wid, "/internal/stats")["transfer"] for wid in survivors}

    events = _RouterEvents()
    router_logger = logging.getLogger("pd.router")
    router_logger.addHandler(events)
    if router_logger.getEffectiveLevel() > logging.WARNING:
        router_logger.setLevel(logging.WARNING)  # the counted records are warnings (the console's handler filters)
    sampler = _RSSSampler(tracks, dep, probe_subscribers)
    sampler.start()
    spec = {"url": dep.url, "prompts": prompts, "max_tokens": settings.max_tokens,
            "num_clients": settings.num_clients, "duration_s": settings.duration_s,
            "request_timeout_s": settings.request_timeout_s, "api_key": api_key,
            "kv_host": dep.config.transfer.host, "data_port": ports["data"], "num_junk": settings.num_junk,
            "side_port": ports["side_channel"], "refuse_rate": settings.refuse_rate,
            "router_host": dep.url.split("//", 1)[1].rsplit(":", 1)[0], "router_port": int(dep.url.rsplit(":", 1)[1]),
            "num_router_idle": settings.num_router_idle, "events_endpoint": kv_before.get("endpoint", ""),
            "secret": dep.secret, "num_event_subscribers": settings.num_event_subscribers,
            "num_poisoned": settings.num_poisoned}  # the secret goes on stdin, never on a command line
    proc = _start_driver(spec)
    report = LoadFaultsReport(num_clients=settings.num_clients, duration_s=settings.duration_s, rows=[],
                              reference=reference, rss=tracks, max_rss_growth_mb=settings.max_rss_growth_mb,
                              victim=settings.victim)
    try:
        started = _read_event(proc, 120.0)
        assert started.get("event") == "started", started
        t_load = sampler.t0 = time.monotonic()
        time.sleep(settings.kill_after_s)
        kv_seen["at_kill_subscribers"] = probe_subscribers()["num_subscribers"]
        report.victim_in_flight_at_kill = next(w.num_in_flight for w in dep.router.pool.all()
                                               if w.endpoint.worker_id == settings.victim)
        os.kill(tracks[settings.victim].pid, signal.SIGKILL)
        report.killed_at_s = time.monotonic() - t_load
        result = _read_event(proc, settings.duration_s + settings.request_timeout_s + 60.0)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        router_logger.removeHandler(events)
    report.rows = result["rows"]
    report.junk = {"held": settings.num_junk, "min_open": result["junk_min_open"], "opened": result["junk_opened"],
                   "closed_by_peer": result["junk_closed_by_peer"]}
    report.refuse_sent = result["refuse_sent"]
    report.router_idle = {**result["router_idle"], "router": dep.router.conn_guard.figures()}
    report.num_migrations, report.num_redispatches = events.num_migrations, events.num_redispatches
    report.poisoned = result["poisoned"]

    report.pools = dep.pool_audits(timeout_s=30.0)
    sampler.stop.set()
    sampler.join(5)
    for track in tracks.values():
        track.after_mb = read_rss_mb(track.pid)
        if track.after_mb is not None:
            track.observe(track.after_mb)
    report.left_rotation = dict(sampler.left_rotation)
    stats_after = workers.get(producers[0], "/internal/stats")
    refused_after = stats_after["transfer"].get("handshakes_refused", {})
    kv_after = stats_after.get("kv_events") or {}
    kv_seen.update(after_subscribers=kv_after.get("num_subscribers", 0),
                   refused=kv_after.get("num_refused_subscribers", 0) - kv_before.get("num_refused_subscribers", 0))
    report.event_subscribers = {**result["event_subscribers"], "worker": kv_seen}
    report.refused_counted = {k: v - refused_before.get(k, 0) for k, v in refused_after.items()
                              if v != refused_before.get(k, 0)}
    for wid in survivors:
        after = workers.get(wid, "/internal/stats")["transfer"]
        report.transfer[wid] = {k: after.get(k, 0) - loads_before[wid].get(k, 0)
                                for k in ("loads_ok", "failures_total")}
    report.metrics_lines = (metrics_before, _metrics_lines(dep.url, headers))
    report.seconds = time.monotonic() - t_start
    return report


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = LoadFaultsSettings()
    parser = argparse.ArgumentParser(prog="python -m pd.tools.load_faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "deploy" / "local.yaml"),
                        help="deploy YAML; run as 1P2D (default: deploy/local.yaml, the tiny random model)")
    parser.add_argument("--clients", type=int, default=d.num_clients)
    parser.add_argument("--duration-s", type=float, default=d.duration_s)
    parser.add_argument("--kill-after-s", type=float, default=d.kill_after_s)
    parser.add_argument("--junk", type=int, default=d.num_junk, help="junk connections held on P's data port")
    parser.add_argument("--refuse-rate", type=float, default=d.refuse_rate, help="REFUSE frames a second")
    parser.add_argument("--router-idle", type=int, default=d.num_router_idle,
                        help="idle connections held on the router's port")
    parser.add_argument("--event-subscribers", type=int, default=d.num_event_subscribers,
                        help="never-reading subscribers on P's KV event stream (half with the secret)")
    parser.add_argument("--poisoned", type=int, default=d.num_poisoned,
                        help="completions with poisoned sampling values, spread over the run")
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--max-rss-growth-mb", type=float, default=d.max_rss_growth_mb)
    parser.add_argument("--num-cpus", type=int, default=None, help="embedded Ray: CPUs (default: all)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--log-level", default="ERROR", help="what is printed beside the report")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setLevel(args.log_level.upper())  # what is printed, whatever a logger lets through
    try:
        settings = LoadFaultsSettings(num_clients=args.clients, duration_s=args.duration_s,
                                      kill_after_s=args.kill_after_s, num_junk=args.junk,
                                      refuse_rate=args.refuse_rate, num_router_idle=args.router_idle,
                                      num_event_subscribers=args.event_subscribers, num_poisoned=args.poisoned,
                                      num_prompts=args.num_prompts,
                                      max_tokens=args.max_tokens, max_rss_growth_mb=args.max_rss_growth_mb)
        config = default_config(args.config)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("PDKV_LOG_LEVEL", args.log_level.upper())  # inherited by local Ray workers
    init_ray(None, args.num_cpus)
    try:
        with Deployment(config) as dep:
            report = run_load_faults(dep, settings)
    finally:
        shutdown_ray()
    print(report.format(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0 if not report.failures() else 1
