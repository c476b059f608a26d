"""Shared settings of the GPU tests and their peer process (tests/helpers/gpu_peer.py)."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import torch

from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig

SECRET = b"gpu-test-secret-0123456789abcdef"
# "cpu" dry-runs the GPU tests' own logic on a machine without CUDA (the CUDA copies are then not exercised).
DEVICE = os.environ.get("PDKV_GPU_TEST_DEVICE", "cuda")
SKIP_REASON = "needs CUDA (GPU path of the connector and engine); PDKV_GPU_TEST_DEVICE=cpu dry-runs the test logic"
# run as a module from the repository root, so that it imports this checkout's packages and tests.helpers
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_config(hybrid: bool) -> ModelConfig:
    """A small float32 model; `hybrid` alternates full and sliding-window layers."""
    kw = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
              bos_token_id=1, eos_token_id=2)
    if hybrid:
        kw.update(layer_types=("full_attention", "sliding_attention") * 2, sliding_window=32)
    return ModelConfig(**kw)


def engine_config(model: ModelConfig, engine_id: str) -> EngineConfig:
    return EngineConfig(model=model, device=DEVICE, num_blocks=256, block_size=16, engine_id=engine_id,
                        max_num_batched_tokens=4096, attention_backend="torch")


def seeded_pages(num_blocks: int, page_bytes: int, seed: int) -> torch.Tensor:
    """The same random bytes in every process (CPU generator)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, page_bytes), generator=gen, dtype=torch.uint8)


class PeerProc:
    """gpu_peer.py in its own process; every read is bounded by a timeout."""

    def __init__(self, **first_line):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.gpu_peer"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self._send(first_line)

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 120.0) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"GPU peer gave no answer within {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"GPU peer exited (rc={self.proc.poll()})")
        return json.loads(line)

    def quit(self) -> dict:
        try:
            self._send({"cmd": "quit"})
            return self.read(60.0)
        finally:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pull_and_check_pages(cons, pool, port: int, src: list[int], dst: list[int], seed: int) -> None:
    """D pulls the peer's pages `src` into `dst` of `pool`: the load succeeds, the landed bytes are the
    peer's seeded pages, and no other page was touched."""
    from connectors.zmq.paths.cuda_staging import fences_for
    from connectors.zmq.consumer.loads import RemoteAddr

    job = cons.load("r", RemoteAddr("P", "127.0.0.1", port), "r", src, dst)
    assert job.done.wait(60), "load did not finish"
    assert job.result.ok, job.result
    fences_for(pool).order_reads_after_landing()  # what the engine does before its next forward
    num_blocks, page_bytes = pool.buffer.shape[0], pool.buffer[0].numel() * pool.buffer.element_size()
    expected = seeded_pages(num_blocks, page_bytes, seed)
    assert torch.equal(pool.buffer[dst].cpu(), expected[src])
    untouched = sorted(set(range(num_blocks)) - set(dst))
    assert int(pool.buffer[untouched].sum()) == 0
