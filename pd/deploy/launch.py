"""Starts a P/D deployment on Ray: `python -m pd.launch --config deploy/<name>.yaml`.

With `--address` or `RAY_ADDRESS` it joins that Ray cluster; with neither it
starts an embedded local Ray instance. It starts the worker actors, then the
router (in this process, on its own event-loop thread), waits until a worker of each
needed role has answered the router's health probe (else it exits 1 and says which did
not), prints the router's URL and serves until SIGINT/SIGTERM, to it, to its process group or to each of its
processes: it then exits within 10 s and leaves no process behind (`pd.deploy.teardown`).
`--run-load` instead runs a short load (`pd.tools.loadgen`) against the fresh deployment,
prints the report and the KV pool audit of every worker ("N of M workers audited": a worker
that gives no audit fails the run, as does a pool not all free) and exits.

`--check-config` validates the file, every value and the model it names, then exits (0 valid,
2 with one `error:` line) without starting Ray; a config that is not valid gets the same line and
status 2 from every other mode, before Ray starts (`pd.deploy.config_check`). A disaggregated CPU
deployment whose workers all run on this machine gets one `notice:` line on stderr first: what P/D
costs where P and D share the cores, and whether short prompts stay on D (`pd.deploy.one_box`).

`Deployment` is the same thing as a library object (tests, benchmarks):
`start()` returns the URL, `stop()` tears everything down and is idempotent.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time

import ray


from pd.deploy.placement import (StartedWorker, release_placement, reserve_for, resource_shortfall, start_workers,
                       stop_workers)
from pd.cluster.admin_key import generate_admin_key
from pd.cluster.config import ConfigError, DeployConfig
from pd.deploy.config_check import error_line, load_checked_config
from pd.deploy.one_box import one_box_notice, usable_cores
from pd.deploy.pool_audit import PoolAuditReport, audit_once, settled
from pd.deploy.restarts import WorkerRestarts
from pd.deploy.samples import print_sample_answers
from pd.deploy.teardown import ShutdownGuard
from pd.engine.model.gguf import resolve_checkpoint
from pd.router.readiness import NotReady
from pd.router.server import Router

logger = logging.getLogger(__name__)

ROUTER_START_TIMEOUT_S = 60.0
# how long the workers, started and listening, get to answer the router's first health probes
READY_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 1800.0
# a signalled stop: requests in progress get DRAIN_S, everything (workers, Ray) ends within STOP_DEADLINE_S,
# and the process exits within 10 s of the signal whatever was signalled (see pd.deploy.teardown)
DRAIN_S = 2.0
STOP_DEADLINE_S = 5.5
WORKER_SETUP_HOOK = "pd.deploy.teardown.die_with_parent"  # run by each Ray worker process of an embedded Ray


class Deployment:
    """Workers as Ray actors plus a router on a private event-loop thread.

    `start()` returns only once a worker of each needed role has answered the router's health
    probe (else it raises `pd.router.readiness.NotReady`, naming them, after `READY_TIMEOUT_S`).
    Invariant: after `stop()` no actor of this deployment is alive and the
    router's port is closed, whatever state `start()` reached.
    """

    def __init__(self, config: DeployConfig, secret: str | None = None) -> None:
        self.config = config
        self.secret = secret or secrets.token_hex(32)
        self.workers: list[StartedWorker] = []
        self.placement = None  # the workers' placement group (topology.placement), or one per gang with TP > 1
        self.router: Router | None = None
        self.restarts: WorkerRestarts | None = None
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        if not ray.is_initialized():
            raise RuntimeError("ray.init() must run before Deployment.start()")
        try:
            self.placement = reserve_for(self.config)
            self.workers = start_workers(self.config, self.secret, pg=self.placement)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="pd-router", daemon=True)
            self._thread.start()
            self.router = Router(self.config, [w.endpoint for w in self.workers], self.secret)
            self.url = self.run_coro(self.router.start(), ROUTER_START_TIMEOUT_S)
            self.run_coro(self.router.wait_ready(READY_TIMEOUT_S), READY_TIMEOUT_S + 10.0)
            # workers Ray restarts (max_restarts) come back into the rotation at their new URL
            self.restarts = WorkerRestarts(self.router, self.workers, self.config.router.health_interval_s)
            self.run_coro(self.restarts.start(), 10.0)
        except BaseException:
            self.stop()
            raise
        return self.url

    def run_coro(self, coro, timeout_s: float):
        """Runs a coroutine on the router's loop from any other thread."""
        assert self._loop is not None, "the router is not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def audit_pools(self, timeout_s: float = 15.0) -> PoolAuditReport:
        """Every worker's pool audit (`pd.deploy.pool_audit`), asked again until every pool is all
        free and every worker answered (or the ones that did not are out of the rotation), or
        `timeout_s` passes (P workers free their blocks a moment after D reports its pull done)."""
        deadline = time.monotonic() + timeout_s
        router = self.router
        assert router is not None, "the router is not started"
        while True:
            report = self.run_coro(audit_once(router), router.recovery.stats_timeout_s + 10.0)
            in_rotation = {w.endpoint.worker_id for w in router.pool.all() if w.healthy}
            if settled(report, in_rotation) or time.monotonic() > deadline:
                return report
            time.sleep(0.2)

    def pool_audits(self, timeout_s: float = 15.0) -> dict[str, dict]:
        """The audits of the workers that answered (`audit_pools` says which did not)."""
        return self.audit_pools(timeout_s).audits

    def stop(self, drain_s: float = 2.0) -> None:
        """`drain_s`: how long requests in progress get to finish (see `Router.stop`)."""
        if self.restarts is not None and self._loop is not None:
            try:
                self.run_coro(self.restarts.stop(), 10.0)
            except Exception:  # noqa: BLE001 - keep tearing down
                logger.exception("restart watch stop failed")
            self.restarts = None
        if self.router is not None and self._loop is not None:
            try:
                self.run_coro(self.router.stop(drain_s), drain_s + 8.0)
            except Exception:  # noqa: BLE001 - keep tearing down
                logger.exception("router stop failed")
            self.router = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10.0)
            self._loop.close()
            self._loop = None
        if self.workers:
            stop_workers([w.actor for w in self.workers])
            self.workers = []
        release_placement(self.placement)
        self.placement = None

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def init_ray(address: str | None, num_cpus: int | None = None, object_store_mb: int | None = None) -> None:
    """Joins the named cluster, or starts an embedded local instance."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    store = object_store_mb * 1024 * 1024 if object_store_mb else None
    # each worker process dies with its raylet, even when this launcher and the raylet are SIGKILLed (teardown)
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=store, include_dashboard=False,
             logging_level=logging.WARNING, runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK})


def shutdown_ray() -> None:
    """Leaves the cluster joined by `init_ray` (or stops the embedded instance)."""
    ray.shutdown()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pd.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="deployment YAML (see deploy/)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate --config (the file, every value, and the model it names where it is "
                             "readable here) without starting Ray; exit 0 when valid, else 2 with one error line")
    parser.add_argument("--print-config-schema", action="store_true",
                        help="print the deployment YAML's JSON Schema and exit")
    parser.add_argument("--generate-admin-key", action="store_true",
                        help="print a new random admin key (256 bits) for router.admin_key and exit")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else local)")
    parser.add_argument("--port", type=int, default=None, help="override router.port")
    parser.add_argument("--host", default=None, help="override router.host")
    parser.add_argument("--num-cpus", type=int, default=None, help="embedded Ray only: CPUs (default: all)")
    parser.add_argument("--object-store-mb", type=int, default=None, help="embedded Ray only: object store size")
    parser.add_argument("--run-load", action="store_true", help="run a short load, print the report and exit")
    parser.add_argument("--num-prompts", type=int, default=32, help="with --run-load")
    parser.add_argument("--request-rate", default="inf", help="with --run-load")
    parser.add_argument("--result-json", default=None, help="with --run-load")
    parser.add_argument("--plot", default=None, help="with --run-load")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if not args.config and not args.print_config_schema and not args.generate_admin_key:
        parser.error("--config is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.print_config_schema:
        print(json.dumps(DeployConfig.json_schema(), indent=2))
        return 0
    if args.generate_admin_key:
        print(generate_admin_key())
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # every config problem: one line, exit status 2, before Ray starts (pd.deploy.config_check)
        config = load_checked_config(args.config, args.port, args.host,
                                     workers_here=not (args.address or os.environ.get("RAY_ADDRESS")))
    except ConfigError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    notice = one_box_notice(config, usable_cores(), workers_here=not (args.address or os.environ.get("RAY_ADDRESS")))
    if notice is not None:  # P and D share this machine's cores: what that costs, and what the config does about it
        print(notice, file=sys.stderr, flush=True)
    if args.check_config:
        print(f"{args.config}: valid", flush=True)
        return 0
    os.environ.setdefault("PDKV_LOG_LEVEL", args.log_level.upper())  # inherited by local Ray workers
    shutdown = ShutdownGuard()
    shutdown.install()  # before Ray starts: its processes' orphans re-parent to this one
    init_ray(args.address, args.num_cpus, args.object_store_mb)
    shutdown.install()  # again: ray.init put its own SIGTERM handler (abort, no cleanup) in this process
    if not (args.address or os.environ.get("RAY_ADDRESS")):
        # an embedded instance never grows: fail now rather than wait for resources that cannot come
        short = resource_shortfall(config, ray.cluster_resources())
        if short is not None:
            ray.shutdown()
            print(f"error: {short}", file=sys.stderr)
            return 2
    deployment = Deployment(config)
    try:
        try:
            url = _start_or_stop_request(deployment, shutdown)
        except NotReady as exc:  # the workers started but never answered the router
            print(f"error: the router cannot serve: {exc}", file=sys.stderr)
            return 1
        if url is None:
            return 0
        topo = config.topology
        shape = (f"{topo.num_prefill}P{topo.num_decode}D" if topo.mode.value == "disaggregated"
                 else f"colocated x{topo.num_colocated}")
        print(f"pdkv router ({shape}, model {config.model.name}) serving at {url}", flush=True)
        if args.run_load:
            rc = _run_load(url, args, config)
            if config.model.path:
                print_sample_answers(url, config)
            report = deployment.audit_pools()  # every worker of the deployment: an audit of fewer is a failure
            for line in report.lines():
                print(line, flush=True)
            return rc if report.clean else 1
        print("press Ctrl-C to stop", flush=True)
        while not shutdown.requested.wait(0.5):
            shutdown.track()  # Ray's processes, remembered while they are still our descendants
        print("shutting down", flush=True)
        return 0
    finally:
        _stop_bounded(deployment, shutdown)


def _start_or_stop_request(deployment: Deployment, shutdown: ShutdownGuard) -> str | None:
    """Starts the deployment; None when a stop was asked for first (a start can take minutes)."""
    result: dict = {}
    done = threading.Event()

    def start() -> None:
        try:
            result["url"] = deployment.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=start, name="pd-start", daemon=True).start()
    while not done.wait(0.2):
        shutdown.track()
        if shutdown.requested.is_set():
            return None
    if "error" in result:
        raise result["error"]
    return result["url"]


def _stop_bounded(deployment: Deployment, shutdown: ShutdownGuard) -> None:
    """The clean stop (drain, workers, Ray) within STOP_DEADLINE_S of now; past it, or when it
    leaves processes behind (Ray's, after a signal to the whole group), they are killed. A stop
    that did not finish ends the process here: Ray's exit hooks would wait on the same dead peers."""
    deadline = time.monotonic() + STOP_DEADLINE_S
    shutdown.track()

    def clean_stop() -> None:
        deployment.stop(drain_s=DRAIN_S)
        ray.shutdown()

    finished = shutdown.run_bounded(clean_stop, deadline)
    num_killed = shutdown.kill_remaining()
    if num_killed:
        logger.warning("killed %d process(es) the clean stop left behind", num_killed)
    if not finished:
        sys.stdout.flush()
        logging.shutdown()
        os._exit(0 if shutdown.requested.is_set() else 1)


def _run_load(url: str, args: argparse.Namespace, config: DeployConfig) -> int:
    """Runs `python -m pd.loadgen` against the deployment, in its own process.

    Not in this process: here the router's event loop would share the GIL with
    the load generator's, read the workers' token lines late and in batches, and
    the client would see tokens arrive in bursts that the server never made.

    A real checkpoint gets a chat load (the questions of deploy/chat-prompts.jsonl,
    greedy, through /v1/chat/completions); the random-weight test model gets
    completions with shared prefixes and ignore_eos."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this launch's pdkv
    common = ["--base-url", url, "--num-prompts", str(args.num_prompts), "--request-rate", args.request_rate,
              "--max-concurrency", "8", "--seed", "0", "--temperature", "0",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm"]
    if config.model.path:
        load_args = common + ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                              "--dataset-name", "custom", "--dataset-path",
                              os.path.join(root, "deploy", "chat-prompts.jsonl"),
                              "--tokenizer", str(resolve_checkpoint(config.model.path))]  # counts tokens as served
    else:
        load_args = common + ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "32",
                              "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "4",
                              "--prefix-repetition-output-len", "16", "--ignore-eos"]
    if args.result_json:
        load_args += ["--save-result", "--save-detailed", "--result-filename", args.result_json]
    if args.plot:
        load_args += ["--plot", args.plot]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    api_key = next(iter(config.router.tenant_keys().values()), None)  # the first tenant's (api_key, else api_keys)
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # in the environment, not on a command line others can read
    if config.router.admin_key:
        env["PDKV_ADMIN_KEY"] = config.router.admin_key  # the load run's metrics scrape refreshes /pd/workers
    try:
        return subprocess.run([sys.executable, "-m", "pd.loadgen", *load_args], env=env,
                              timeout=LOAD_TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        print(f"error: the load run took more than {LOAD_TIMEOUT_S:.0f} s", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
