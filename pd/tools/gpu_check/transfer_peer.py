"""gpu_check's producer process: a CUDA page pool behind a Producer, and a raw loopback socket.

Run by `pd.tools.gpu_check.transfer` as `python -m pd.tools.gpu_check.transfer_peer`; it
talks JSON lines on stdin/stdout (nothing pickled):
- first line {"num_blocks", "page_bytes", "seed"}: the pool is filled on the GPU from
  `seed` (the CUDA generator: the parent regenerates the same bytes to check what
  landed), a Producer (every data path offered) and a raw TCP server start; answers
  {"port", "raw_port"};
- {"cmd": "lease", "rid", "ids"}: a lease on those blocks; answers {"ok": true, "sealed": bool} once
  its digests are sealed (bounded by SEAL_WAIT_S): the figures are those of a pull that finds its
  lease sealed, as one does when D pulls a little after P's prefill ended;
- {"cmd": "quit"}: answers {"ok": true} and exits.
The raw server answers a 4-byte length n with n bytes from pinned host memory (one
`sendall`): the wire stage of the host path alone, process to process.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import torch

SEAL_WAIT_S = 10.0


def fill(num_blocks: int, page_bytes: int, seed: int, device: str = "cuda") -> torch.Tensor:
    """The pool's bytes: the same in every process on the same GPU and torch."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, page_bytes), dtype=torch.uint8, device=device, generator=gen)


def _raw_server(srv: socket.socket, host: memoryview) -> None:
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = bytearray(4)
        try:
            while conn.recv_into(req, 4) == 4:
                conn.sendall(host[: int.from_bytes(req, "big")])
        except OSError:
            pass
        conn.close()


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    from connectors.zmq.paths.cuda_staging import fences_for
    from connectors.zmq.producer.producer import Producer, ProducerConfig
    from pd.engine.kv.page_pool import PagePool

    first = json.loads(sys.stdin.readline())
    device = first.get("device", "cuda")  # "cpu": a dry run of the check's own logic
    pool = PagePool(first["num_blocks"], first["page_bytes"], device=device)
    pool.buffer.copy_(fill(first["num_blocks"], first["page_bytes"], first["seed"], device))
    fences_for(pool).mark_written()  # as the engine does after a forward
    prod = Producer(ProducerConfig(engine_id="check-P", secret=bytes.fromhex(first["secret"]),
                                   compat_hash="gpu-check", lease_s=600.0), pool)
    prod.start()
    host = torch.empty(first["raw_bytes"], dtype=torch.uint8, pin_memory=device == "cuda")
    srv = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(srv, memoryview(host.numpy()).cast("B")), daemon=True).start()
    _reply({"port": prod.port, "raw_port": srv.getsockname()[1], "pid": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "lease":
                prod.add_lease(cmd["rid"], cmd["ids"])
                deadline = time.monotonic() + SEAL_WAIT_S
                while not prod.leases.is_sealed(cmd["rid"]) and time.monotonic() < deadline:
                    time.sleep(0.005)
                _reply({"ok": True, "sealed": prod.leases.is_sealed(cmd["rid"])})
            else:
                break
    finally:
        prod.shutdown()
    _reply({"ok": True})


if __name__ == "__main__":
    main()
