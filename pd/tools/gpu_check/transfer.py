"""gpu_check, KV transfer: each data path CUDA pool -> CUDA pool, beside what the hardware does alone.

`measure_transfer()` (the section `check.py` composes; under a minute on an H200):
- the connector's paths, P in another process (`transfer_peer.py`), D here, one load of
  `PAGES_PER_LOAD` pages at a time: host-staged tcp, shared memory, the device path
  (CUDA IPC) with and without its checksums; each load checked byte for byte against the
  producer's bytes;
- the baselines: pinned device-to-host and host-to-device copies and their serial sum (one
  hop through host memory), and a plain device-to-device copy of the same pages;
- the host path's stages alone (staging D2H, the wire between the two processes, staging
  H2D), to see how much the pipeline overlaps them.
`render_transfer` writes its markdown lines, `transfer_ok` says whether it ran and every
byte was exact (and, asked to, whether the targets of `TARGETS` were met).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import select
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import torch

PAGE_BYTES = 2 * 1024 * 1024  # one block of a Llama-3-8B-sized KV page (32 layers x K,V x 8 heads x 128 x 16 x bf16)
PAGES_PER_LOAD = 256  # 512 MiB per load
SEED = 1234
# the acceptance ratios: host tcp vs the pinned serial copy, shm vs tcp, device path vs a plain D2D copy
TARGETS = {"host_tcp_vs_pinned_serial": 0.7, "shm_vs_tcp": 1.0, "device_vs_plain_d2d": 0.7}
PATHS = (("tcp", "tcp", False), ("shm", "shm", False), ("cuda_ipc", "cuda_ipc", False),
         ("cuda_ipc_checked", "cuda_ipc", True))


@dataclasses.dataclass(frozen=True)
class TransferRun:
    """What the section moves: `pages` of `page_bytes` per load, pools on `device` ("cpu" dry-runs the
    paths, the producer process and the checks without a GPU: no baselines, no stages)."""

    device: str = "cuda"
    pages: int = PAGES_PER_LOAD
    page_bytes: int = PAGE_BYTES
    reps: int = 3

    @property
    def num_blocks(self) -> int:
        return 2 * self.pages + 1  # the load's pages twice (source and destination ranges) and the null block

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def _timed(fn, reps: int) -> float:
    """Median seconds of fn() (synchronised around each call); one untimed warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_pinned_baseline(nbytes: int, reps: int = 5) -> dict:
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = _gbps(nbytes, _timed(lambda: host.copy_(dev, non_blocking=True), reps))
    h2d = _gbps(nbytes, _timed(lambda: dev.copy_(host, non_blocking=True), reps))
    return {"d2h_gbps": d2h, "h2d_gbps": h2d, "d2h_then_h2d_gbps": round(1.0 / (1.0 / d2h + 1.0 / h2d), 2),
            "bytes": nbytes}


def measure_plain_d2d(src: torch.Tensor, ids: list[int], dst_ids: list[int], reps: int = 5) -> dict:
    """A plain device-to-device copy of the load's bytes (one memcpy), and the same pages gathered by id."""
    nbytes = len(ids) * src.shape[1]
    dst = torch.empty_like(src)
    flat_src, flat_dst = src[ids[0] : ids[0] + len(ids)], dst[: len(ids)]
    s, d = torch.tensor(ids, device=src.device), torch.tensor(dst_ids, device=src.device)
    plain = _timed(lambda: flat_dst.copy_(flat_src, non_blocking=True), reps)
    gathered = _timed(lambda: dst.index_copy_(0, d, src.index_select(0, s)), reps)
    return {"plain_gbps": _gbps(nbytes, plain), "gather_by_id_gbps": _gbps(nbytes, gathered)}


def measure_staging_gather(num_blocks: int, reps: int = 5) -> dict:
    """GB/s of the staging ring's D2H pass over one load, contiguous vs scattered ids."""
    from connectors.zmq.paths.staging_ring import StagingRing, StagingShape
    from pd.engine.kv.page_pool import PagePool

    pool = PagePool(num_blocks, PAGE_BYTES, device="cuda")
    ring = StagingRing(pool, StagingShape())
    n = min(PAGES_PER_LOAD, num_blocks - 1)
    out: dict = {"pages_per_chunk": ring.rows, "slots": ring.slots}
    scattered = random.Random(0).sample(range(1, num_blocks), n)
    for name, ids in (("contiguous", list(range(1, n + 1))), ("scattered", scattered)):
        t = _timed(lambda ids=ids: [None for _ in ring.gather_chunks(ids)], reps)
        out[f"{name}_d2h_gbps"] = _gbps(n * PAGE_BYTES, t)
    return out


def _stage_times(pool, ids: list[int], raw_port: int, reps: int = 3) -> dict:
    """The host path's stages one at a time on the load's bytes: D2H through the ring, the wire
    (a raw loopback socket, process to process, pinned to pinned), H2D through the ring."""
    from connectors.zmq.paths.staging_ring import StagingRing, StagingShape

    ring = StagingRing(pool, StagingShape())
    nbytes = len(ids) * pool.page_size_bytes
    d2h = _timed(lambda: [None for _ in ring.gather_chunks(ids)], reps)

    def land() -> None:
        for a in range(0, len(ids), ring.rows):
            chunk = ids[a : a + ring.rows]
            ring.land(ring.landing_rows(len(chunk)), chunk)
        ring.settle()

    h2d = _timed(land, reps)
    sink = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    view = memoryview(sink.numpy()).cast("B")
    with socket.create_connection(("127.0.0.1", raw_port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def fetch() -> None:
            sock.sendall(nbytes.to_bytes(4, "big"))
            got = 0
            while got < nbytes:
                got += sock.recv_into(view[got:], nbytes - got)

        wire = _timed(fetch, reps)
    return {"d2h_ms": round(d2h * 1e3, 2), "wire_ms": round(wire * 1e3, 2), "h2d_ms": round(h2d * 1e3, 2),
            "serial_ms": round((d2h + wire + h2d) * 1e3, 2), "wire_gbps": _gbps(nbytes, wire)}


class _Peer:
    """transfer_peer.py in its own process; every read bounded."""

    def __init__(self, first: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "pd.tools.gpu_check.transfer_peer"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.call(first, timeout_s=120)
        self.info = self.last

    def call(self, obj: dict, timeout_s: float = 30) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"transfer peer gave no answer (rc={self.proc.poll()})")
        self.last: dict = json.loads(line)
        return self.last

    def close(self) -> None:
        try:
            self.call({"cmd": "quit"})
        except (OSError, RuntimeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _measure_path(run: TransferRun, peer: _Peer, pool, ref: torch.Tensor, path: str, checksums: bool, secret: bytes,
                  ids: list[int], dst_ids: list[int]) -> dict:
    from connectors.zmq.consumer.consumer import Consumer
    from connectors.zmq.consumer.consumer_config import ConsumerConfig, DataPath
    from connectors.zmq.consumer.loads import RemoteAddr

    cons = Consumer(ConsumerConfig(engine_id="check-D", secret=secret, compat_hash="gpu-check",
                                   data_path=DataPath(path), transfer_timeout_s=60.0, device_checksums=checksums),
                    pool)
    cons.start()
    remote = RemoteAddr("check-P", "127.0.0.1", peer.info["port"])
    seconds, exact = [], True
    try:
        for rep in range(run.reps + 1):  # the first load also pays the handshake: not counted
            rid = f"{path}-{int(checksums)}-{rep}"
            peer.call({"cmd": "lease", "rid": rid, "ids": ids})
            pool.buffer[dst_ids] = 0  # nothing left from the previous path or load
            _sync(run.device)
            job = cons.load(rid, remote, rid, ids, dst_ids)
            if not job.done.wait(120) or job.result is None or not job.result.ok:
                return {"error": f"load failed: {job.result}", "byte_exact": False}
            if rep:
                seconds.append(job.result.seconds)
            _sync(run.device)
            exact = exact and torch.equal(pool.buffer[dst_ids], ref[ids])
        used = cons.data_paths().get("check-P", [])
    finally:
        cons.shutdown()
    nbytes = len(ids) * run.page_bytes
    return {"gbps": _gbps(nbytes, statistics.median(seconds)), "ms": round(statistics.median(seconds) * 1e3, 2),
            "byte_exact": exact, "streams": used, "loads": len(seconds)}


@contextlib.contextmanager
def _producer_session(run: TransferRun) -> Iterator[tuple[_Peer, object, torch.Tensor, bytes]]:
    """The producer process, this side's pool, and the producer's bytes (made the same way)."""
    from pd.engine.kv.page_pool import PagePool
    from pd.tools.gpu_check.transfer_peer import fill

    secret = os.urandom(24)
    peer = _Peer({"num_blocks": run.num_blocks, "page_bytes": run.page_bytes, "seed": SEED, "secret": secret.hex(),
                  "raw_bytes": run.nbytes, "device": run.device})
    try:
        yield (peer, PagePool(run.num_blocks, run.page_bytes, device=run.device),
               fill(run.num_blocks, run.page_bytes, SEED, run.device), secret)
    finally:
        peer.close()


def measure_transfer(run: TransferRun | None = None) -> dict:
    """The transfer section: every path, the baselines, the stages and the ratios."""
    run = run or TransferRun()
    ids = list(range(1, run.pages + 1))
    dst_ids = list(range(run.pages + 1, run.num_blocks))  # consecutive: the copies are whole runs
    scattered = random.Random(1).sample(range(1, run.num_blocks), run.pages)
    section: dict = {"pages": run.pages, "page_bytes": run.page_bytes, "bytes_per_load": run.nbytes,
                     "device": run.device}
    with _producer_session(run) as (peer, pool, ref, secret):
        if run.device == "cuda":
            section["baseline"] = measure_pinned_baseline(run.nbytes)
            section["d2d"] = measure_plain_d2d(ref, ids, dst_ids)
            section["stages"] = _stage_times(pool, ids, peer.info["raw_port"])
        section["paths"] = {}
        runs = [(name, path, checksums, dst_ids) for name, path, checksums in PATHS]
        runs.append(("cuda_ipc_scattered", "cuda_ipc", False, scattered))
        for name, path, checksums, dst in runs:
            try:
                section["paths"][name] = _measure_path(run, peer, pool, ref, path, checksums, secret, ids, dst)
            except Exception as e:  # noqa: BLE001 -- one path failing is reported; the others still run
                section["paths"][name] = {"error": f"{type(e).__name__}: {e}"[:300], "byte_exact": False}
    section["ratios"] = transfer_ratios(section)
    return section


def transfer_ratios(section: dict) -> dict:
    """The acceptance ratios from the measured GB/s (None where a figure is missing)."""
    paths, base, d2d = section.get("paths", {}), section.get("baseline", {}), section.get("d2d", {})

    def ratio(a, b):
        return round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None

    stages = section.get("stages", {})
    return {"host_tcp_vs_pinned_serial": ratio(paths.get("tcp", {}).get("gbps"), base.get("d2h_then_h2d_gbps")),
            "shm_vs_tcp": ratio(paths.get("shm", {}).get("gbps"), paths.get("tcp", {}).get("gbps")),
            "device_vs_plain_d2d": ratio(paths.get("cuda_ipc", {}).get("gbps"), d2d.get("plain_gbps")),
            "device_checksums_cost": ratio(paths.get("cuda_ipc_checked", {}).get("ms"),
                                           paths.get("cuda_ipc", {}).get("ms")),
            "tcp_vs_serial_stages": ratio(stages.get("serial_ms"), paths.get("tcp", {}).get("ms"))}


def transfer_ok(section: dict, require_targets: bool = False) -> bool:
    """Every path ran and landed exact bytes (and, if asked, every target ratio was met)."""
    paths = section.get("paths", {})
    if "error" in section or not paths or any("error" in r or not r.get("byte_exact") for r in paths.values()):
        return False
    if require_targets:
        ratios = section.get("ratios") or transfer_ratios(section)
        return all(ratios.get(k) is not None and ratios[k] >= v for k, v in TARGETS.items())
    return True


def render_transfer(section: dict) -> list[str]:
    """The section as markdown lines."""
    if "error" in section:
        return ["## KV transfer", "", f"- error: {section['error']}"]
    kib = section.get("page_bytes", PAGE_BYTES) // 1024
    size = f"{kib // 1024} MiB" if kib % 1024 == 0 else f"{kib} KiB"
    lines = [f"## KV transfer, {section.get('device', 'cuda')} pool -> pool ({section.get('pages')} pages of {size} "
             "per load, "
             "P in another process)", "",
             "| path | GB/s | ms per load | byte-exact | streams |", "|---|---|---|---|---|"]
    for name, r in section.get("paths", {}).items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | False | |")
        else:
            lines.append(f"| {name} | {r.get('gbps')} | {r.get('ms')} | {r.get('byte_exact')} | "
                         f"{', '.join(r.get('streams', []))} |")
    base, d2d, st = section.get("baseline", {}), section.get("d2d", {}), section.get("stages", {})
    lines += [f"| pinned D2H copy | {base.get('d2h_gbps')} | | | |",
              f"| pinned H2D copy | {base.get('h2d_gbps')} | | | |",
              f"| pinned D2H then H2D, serial | {base.get('d2h_then_h2d_gbps')} | | | |",
              f"| plain D2D copy of the same pages | {d2d.get('plain_gbps')} | | | |",
              f"| D2D gather by block id (index_select + index_copy_) | {d2d.get('gather_by_id_gbps')} | | | |",
              "", f"- host path stages alone: D2H {st.get('d2h_ms')} ms, wire {st.get('wire_ms')} ms "
              f"({st.get('wire_gbps')} GB/s), H2D {st.get('h2d_ms')} ms; serial sum {st.get('serial_ms')} ms"]
    ratios = section.get("ratios") or transfer_ratios(section)
    for key, target in TARGETS.items():
        got = ratios.get(key)
        verdict = "unmeasured" if got is None else "met" if got >= target else "MISSED"
        lines.append(f"- {key.replace('_', ' ')}: **{got}** (target >= {target}: {verdict})")
    lines.append(f"- device path with checksums: {ratios.get('device_checksums_cost')}x the time without; "
                 f"tcp overlap: serial stages / pipelined = {ratios.get('tcp_vs_serial_stages')}")
    return lines


def measure_connector(path: str, reps: int = 3) -> dict:
    """One data path's GB/s and byte-exactness, P in another process (the older, per-path entry)."""
    run = TransferRun(reps=reps)
    with _producer_session(run) as (peer, pool, ref, secret):
        return _measure_path(run, peer, pool, ref, path, False, secret, list(range(1, run.pages + 1)),
                             list(range(run.pages + 1, run.num_blocks)))


def main(argv: list[str] | None = None) -> int:
    """`python -m pd.tools.gpu_check.transfer [--json PATH] [--cpu]`: the transfer section alone."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pd.tools.gpu_check.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the section as JSON here")
    parser.add_argument("--cpu", action="store_true", help="dry-run the paths on CPU pools (no GPU figures)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("error: the transfer section needs CUDA (or --cpu for a dry run)", file=sys.stderr)
        return 2
    run = TransferRun(device="cpu", pages=16, page_bytes=64 * 1024) if args.cpu else TransferRun()
    section = measure_transfer(run)
    print("\n".join(render_transfer(section)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(section, f, indent=2, sort_keys=True)
    return 0 if transfer_ok(section) else 1


if __name__ == "__main__":
    sys.exit(main())
