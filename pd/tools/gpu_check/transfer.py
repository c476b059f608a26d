"""gpu_check, KV transfer: the connector's GB/s CUDA pool -> CUDA pool beside pinned-copy baselines."""
from __future__ import annotations

import os
import random
import statistics
import time

import torch

PAGE_BYTES = 2 * 1024 * 1024  # one block of a Llama-3-8B-sized KV page (32 layers x K,V x 8 heads x 128 x 16 x bf16)
PAGES_PER_LOAD = 256  # 512 MiB per load


def _timed_copy(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Median GB/s of dst.copy_(src) (synchronised around each copy)."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    gbps = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        gbps.append(src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9)
    return statistics.median(gbps)


def measure_pinned_baseline(nbytes: int, reps: int = 5) -> dict:
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = _timed_copy(host, dev, reps)
    h2d = _timed_copy(dev, host, reps)
    return {"d2h_gbps": round(d2h, 2), "h2d_gbps": round(h2d, 2),
            "d2h_then_h2d_gbps": round(1.0 / (1.0 / d2h + 1.0 / h2d), 2), "bytes": nbytes}


def measure_staging_gather(num_blocks: int, reps: int = 5) -> dict:
    """GB/s of the connector's D2H staging copy for scattered vs contiguous block ids."""
    from connectors.zmq.cuda_staging import CudaStaging
    from pd.engine.kv.page_pool import PagePool

    pool = PagePool(num_blocks, PAGE_BYTES, device="cuda")
    staging = CudaStaging(pool)
    n = staging.rows_per_half
    out = {"pages_per_copy": n}
    scattered = random.Random(0).sample(range(1, num_blocks), n)
    for name, ids in (("contiguous", list(range(1, n + 1))), ("scattered", scattered)):
        staging.copy_to_host(ids)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            staging.copy_to_host(ids)
            times.append(time.perf_counter() - t0)
        out[f"{name}_d2h_gbps"] = round(n * PAGE_BYTES / statistics.median(times) / 1e9, 2)
    return out


def measure_connector(path: str, reps: int = 3) -> dict:
    """GB/s of whole loads (PAGES_PER_LOAD pages) CUDA pool -> CUDA pool through the connector."""
    from connectors.zmq.consumer import Consumer
    from connectors.zmq.consumer_config import ConsumerConfig, DataPath
    from connectors.zmq.loads import RemoteAddr
    from pd.engine.kv.page_pool import PagePool
    from connectors.zmq.producer import Producer, ProducerConfig

    secret = os.urandom(24)
    num_blocks = PAGES_PER_LOAD + 1
    src_pool = PagePool(num_blocks, PAGE_BYTES, device="cuda")
    dst_pool = PagePool(num_blocks, PAGE_BYTES, device="cuda")
    src_pool.buffer.random_(0, 256)
    torch.cuda.synchronize()
    prod = Producer(ProducerConfig(engine_id="check-P", secret=secret, compat_hash="gpu-check"), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="check-D", secret=secret, compat_hash="gpu-check",
                                   data_path=DataPath(path), transfer_timeout_s=60.0), dst_pool)
    cons.start()
    ids = list(range(1, num_blocks))
    dst_ids = list(reversed(ids))  # every page lands somewhere else: no accidental identity copy
    gbps, ok = [], True
    try:
        for rep in range(reps + 1):  # the first load also pays the handshake: not counted
            rid = f"check-{rep}"
            prod.add_lease(rid, ids)
            t0 = time.perf_counter()
            job = cons.load(rid, RemoteAddr("check-P", "127.0.0.1", prod.port), rid, ids, dst_ids)
            if not job.done.wait(120) or job.result is None or not job.result.ok:
                ok = False
                break
            if rep:
                gbps.append(len(ids) * PAGE_BYTES / (time.perf_counter() - t0) / 1e9)
        torch.cuda.synchronize()
        exact = ok and torch.equal(dst_pool.buffer[dst_ids], src_pool.buffer[ids])
    finally:
        cons.shutdown()
        prod.shutdown()
    return {"gbps": round(statistics.median(gbps), 2) if gbps else None, "byte_exact": exact,
            "bytes_per_load": len(ids) * PAGE_BYTES, "loads": len(gbps)}
