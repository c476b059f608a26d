"""Transfer benchmark: the ZMQ connector's data paths beside a raw loopback socket.

Two processes: this one is the consumer, a child process is the producer
(started as `--serve-producer`, its ports reported as one JSON line, nothing
pickled). The child also serves a raw TCP socket (plain `sendall` of the same page bytes,
received with `recv_into` into preallocated memory), so both are measured in
the same run, alternating, on the same noisy machine.

    python -m pd.tools.transfer_bench                      # 64 x 256 KiB, tcp and shm
    python -m pd.tools.transfer_bench --blocks 64 --page-kib 256 --reps 30 --json
    python -m pd.tools.transfer_bench --staged --paths tcp,shm,shm_staged   # through the staging ring

Reported per data path (the `data_path` setting, and the path its streams took: `shm` is
shm_mapped for these CPU pools, shm_staged with --staged): GB/s of a bulk pull (median), raw socket GB/s, their
ratio, one-block latency (`load()` called -> page landed and verified by the
stream thread; the engine polls for it, so no waiter wake-up is included) and
the raw socket's one-block round trip (4-byte request -> page received).
"""
from __future__ import annotations

import argparse
import json
import select
import socket
import statistics
import subprocess
import sys
import time

SECRET = b"bench-secret-not-for-production!"
COMPAT = "bench"


def _fill(pool, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=g))


def _staging(staged: bool):
    from connectors.zmq.paths.staging_ring import DEFAULT_STAGING, StagingShape

    return StagingShape(stage_host_pools=True) if staged else DEFAULT_STAGING


def _producer_main(num_blocks: int, page_bytes: int, shm_chunk_bytes: int, staged: bool) -> None:
    """The child: serves until stdin closes or says anything."""
    import threading

    import torch

    torch.set_num_threads(1)
    from pd.engine.kv.page_pool import PagePool
    from connectors.zmq.producer.producer import Producer, ProducerConfig

    pool = PagePool(num_blocks + 1, page_bytes)
    _fill(pool, 1)
    prod = Producer(ProducerConfig(engine_id="bench-P", secret=SECRET, compat_hash=COMPAT, lease_s=3600,
                                   shm_chunk_bytes=shm_chunk_bytes, staging=_staging(staged)), pool)
    prod.start()
    prod.add_lease("bench", list(range(1, num_blocks + 1)), lease_s=3600)
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(raw, pool), daemon=True).start()
    print(json.dumps({"port": prod.port, "raw_port": raw.getsockname()[1]}), flush=True)
    sys.stdin.readline()
    prod.shutdown()


def _raw_server(srv: socket.socket, pool) -> None:
    host = memoryview(pool.buffer.numpy()).cast("B")
    page = pool.page_size_bytes
    while True:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = bytearray(4)
        try:
            while True:
                if c.recv_into(req, 4) != 4:
                    break
                n = int.from_bytes(req, "big")
                c.sendall(host[page : page * (n + 1)])  # pages 1..n, one plain sendall
        except OSError:
            pass
        c.close()


class _RawClient:
    def __init__(self, port: int, nbytes: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(nbytes)  # preallocated
        self.view = memoryview(self.buf)

    def fetch(self, num_pages: int, page_bytes: int) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(num_pages.to_bytes(4, "big"))
        want, got = num_pages * page_bytes, 0
        while got < want:
            got += self.sock.recv_into(self.view[got:want], want - got)
        return time.perf_counter() - t0


def _measure(path: str, args, ports, pool) -> dict:
    import random

    import torch

    from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
    from connectors.zmq.consumer.consumer_config import ConsumerConfig, DataPath

    page = args.page_kib * 1024
    cons = Consumer(ConsumerConfig(engine_id=f"bench-D-{path}", secret=SECRET, compat_hash=COMPAT,
                                   data_path=DataPath(path), num_tcp_streams=args.streams, notify_done=False,
                                   staging=_staging(args.staged),
                                   **({} if args.spin_us is None else {"spin_us": args.spin_us})), pool)
    cons.start()
    remote = RemoteAddr("bench-P", "127.0.0.1", ports[0])
    raw = _RawClient(ports[1], args.blocks * page)
    src = list(range(1, args.blocks + 1))
    dst = src[:]
    random.Random(0).shuffle(dst)  # different block ids on each side

    def pull(s, d) -> float:
        # Timed from `load()` to the moment the stream thread verified the last page
        # (LoadResult.seconds): what the engine, which polls get_finished, waits for.
        job = cons.load("bench", remote, "bench", s, d)
        if not job.done.wait(30) or job.result is None or not job.result.ok:
            raise RuntimeError(f"{path} load failed: {job.result}")
        cons.take_finished()
        return job.result.seconds

    for _ in range(3):  # warm-up: handshake, connections, page faults
        pull(src, dst)
        raw.fetch(args.blocks, page)
    bulk, raw_bulk, one, raw_one = [], [], [], []
    for _ in range(args.reps):
        raw_bulk.append(raw.fetch(args.blocks, page))
        bulk.append(pull(src, dst))
    for _ in range(args.reps * 3):
        raw_one.append(raw.fetch(1, page))
        one.append(pull(src[:1], dst[:1]))
    # bytes must be exact: compare the landed pages with the producer's fill
    g = torch.Generator().manual_seed(1)
    ref = torch.randint(0, 256, (args.blocks + 1, page), dtype=torch.uint8, generator=g)
    if not all(torch.equal(pool.buffer[d], ref[s]) for s, d in zip(src, dst, strict=True)):
        raise RuntimeError(f"{path}: landed pages differ from the source")
    taken = sorted(set(cons.data_paths().get("bench-P", [])))  # what the setting became (after any fallback)
    cons.shutdown()
    raw.sock.close()
    nbytes = args.blocks * page
    gbps = nbytes / statistics.median(bulk) / 1e9
    raw_gbps = nbytes / statistics.median(raw_bulk) / 1e9
    return {
        "path": path,
        "taken": taken,
        "blocks": args.blocks,
        "page_bytes": page,
        "gbps": round(gbps, 3),
        "raw_gbps": round(raw_gbps, 3),
        "ratio": round(gbps / raw_gbps, 3),
        "latency_us": round(statistics.median(one) * 1e6, 1),
        "raw_latency_us": round(statistics.median(raw_one) * 1e6, 1),
    }


def _median_run(results: list[dict]) -> dict:
    """Per key, the median over runs (ratio: median of the per-run ratios, both from the same run)."""
    out = dict(results[0])
    for key in ("gbps", "raw_gbps", "ratio", "latency_us", "raw_latency_us"):
        out[key] = round(statistics.median(r[key] for r in results), 3)
    out["latency_ratio"] = round(statistics.median(r["latency_us"] / r["raw_latency_us"] for r in results), 3)
    out["runs"] = len(results)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--streams", type=int, default=4, help="parallel tcp data streams")
    ap.add_argument("--paths", default="tcp,shm")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="consumer: poll for a pull's answer without sleeping for up to this long "
                         "(0: never; default: ConsumerConfig's)")
    ap.add_argument("--shm-chunk-kib", type=int, default=8192, help="shared-memory staging half size")
    ap.add_argument("--runs", type=int, default=3, help="measurements per path; the median run is reported")
    ap.add_argument("--json", action="store_true", help="one JSON line per data path")
    ap.add_argument("--staged", action="store_true",
                    help="both sides stage their CPU pools through the staging ring, as CUDA pools do: "
                         "checks the pipeline runs end to end without a GPU; its copies are then CPU memcpys, "
                         "so its GB/s say nothing about a GPU")
    ap.add_argument("--serve-producer", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.serve_producer:
        _producer_main(args.blocks, args.page_kib * 1024, args.shm_chunk_kib * 1024, args.staged)
        return

    import torch

    torch.set_num_threads(1)
    from pd.engine.kv.page_pool import PagePool

    cmd = [sys.executable, "-m", "pd.tools.transfer_bench", "--serve-producer", "--blocks", str(args.blocks),
           "--page-kib", str(args.page_kib), "--shm-chunk-kib", str(args.shm_chunk_kib)]
    proc = subprocess.Popen(cmd + (["--staged"] if args.staged else []), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError("producer process did not start")
        info = json.loads(line)
        ports = (info["port"], info["raw_port"])
        pool = PagePool(args.blocks + 1, args.page_kib * 1024)
        runs: dict[str, list[dict]] = {path: [] for path in args.paths.split(",")}
        for _ in range(args.runs):  # alternate the paths so both see the same machine
            for path in runs:
                runs[path].append(_measure(path, args, ports, pool))
        for path, results in runs.items():
            r = _median_run(results)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"{path:4s} ({'/'.join(r['taken'])}) {r['gbps']:6.2f} GB/s  "
                      f"raw socket {r['raw_gbps']:6.2f} GB/s  "
                      f"ratio {r['ratio']:.2f}   "
                      f"one block {r['latency_us']:7.1f} us  raw round trip {r['raw_latency_us']:7.1f} us "
                      f"(x{r['latency_ratio']:.2f}, median of {r['runs']} runs)", flush=True)
    finally:
        proc.stdin.close()  # the child's readline returns: it shuts down
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
