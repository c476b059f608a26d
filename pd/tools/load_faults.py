"""Load and faults at once, on a real Ray deployment: `python -m pd.tools.load_faults`.

It starts a 1P2D deployment (default `deploy/local.yaml`, the tiny random model, greedy),
records each prompt's tokens on the undisturbed deployment, then for `--duration-s` runs
`--clients` streaming clients while it
- SIGKILLs a decode worker (`--kill-after-s` into the load),
- holds `--junk` unauthenticated connections on the prefill worker's data port,
- sends unauthenticated REFUSE frames with varied reasons to its side channel (`--refuse-rate`/s),
- holds `--router-idle` idle connections on the router's port (past its connection cap the
  router closes the least recently used; the holder opens them again),
and samples the RSS of the router (this process) and of every worker. It prints a short report:
requests by status, how many were token-identical to the reference, RSS before / peak / after per
process, and the pools' audit; it exits 1 when the run broke the contract of
`pd.tools.load_faults_report`.

The clients and the unauthenticated traffic run in a process of their own
(`pd.tools.load_faults_driver`), so the router's event loop shares no GIL with them.

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
from typing import Any

import requests

from pd.cluster.config import ConfigError, DeployConfig, load_deploy_config
from pd.deploy.launch import Deployment, init_ray, shutdown_ray
from pd.tools.load_faults_report import LoadFaultsReport, RSSTrack

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
HTTP_TIMEOUT_S = 60.0
RSS_SAMPLE_S = 0.2
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
        if self.num_junk < 0 or self.refuse_rate < 0 or self.num_router_idle < 0:
            raise ValueError("num_junk, refuse_rate and num_router_idle must be >= 0")


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
    def __init__(self, tracks: dict[str, RSSTrack]) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.tracks, self.stop = tracks, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(RSS_SAMPLE_S):
            for track in self.tracks.values():
                mb = read_rss_mb(track.pid)
                if mb is not None:
                    track.observe(mb)


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

    def get(self, worker_id: str, path: str) -> dict:
        resp = requests.get(f"{self.urls[worker_id]}{path}", headers=self._headers, timeout=HTTP_TIMEOUT_S)
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
    proc = subprocess.Popen([sys.executable, "-m", "pd.tools.load_faults_driver"], stdin=subprocess.PIPE,
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
    refused_before = workers.get(producers[0], "/internal/stats")["transfer"].get("handshakes_refused", {})
    loads_before = {wid: workers.get(wid, "/internal/stats")["transfer"] for wid in survivors}

    events = _RouterEvents()
    router_logger = logging.getLogger("pd.router")
    router_logger.addHandler(events)
    if router_logger.getEffectiveLevel() > logging.WARNING:
        router_logger.setLevel(logging.WARNING)  # the counted records are warnings (the console's handler filters)
    sampler = _RSSSampler(tracks)
    sampler.start()
    spec = {"url": dep.url, "prompts": prompts, "max_tokens": settings.max_tokens,
            "num_clients": settings.num_clients, "duration_s": settings.duration_s,
            "request_timeout_s": settings.request_timeout_s, "api_key": api_key,
            "kv_host": dep.config.transfer.host, "data_port": ports["data"], "num_junk": settings.num_junk,
            "side_port": ports["side_channel"], "refuse_rate": settings.refuse_rate,
            "router_host": dep.url.split("//", 1)[1].rsplit(":", 1)[0], "router_port": int(dep.url.rsplit(":", 1)[1]),
            "num_router_idle": settings.num_router_idle}
    proc = _start_driver(spec)
    report = LoadFaultsReport(num_clients=settings.num_clients, duration_s=settings.duration_s, rows=[],
                              reference=reference, rss=tracks, max_rss_growth_mb=settings.max_rss_growth_mb,
                              victim=settings.victim)
    try:
        started = _read_event(proc, 120.0)
        assert started.get("event") == "started", started
        t_load = time.monotonic()
        time.sleep(settings.kill_after_s)
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

    report.pools = dep.pool_audits(timeout_s=30.0)
    sampler.stop.set()
    sampler.join(5)
    for track in tracks.values():
        track.after_mb = read_rss_mb(track.pid)
        if track.after_mb is not None:
            track.observe(track.after_mb)
    refused_after = workers.get(producers[0], "/internal/stats")["transfer"].get("handshakes_refused", {})
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


if __name__ == "__main__":
    sys.exit(main())
