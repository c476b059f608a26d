"""`python -m pd.launch` with `device: cuda` where the embedded Ray instance has no GPU: a clear, early error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error; this machine has CUDA")
def test_cuda_topology_on_a_machine_without_gpus_fails_at_startup(tmp_path):
    config = tmp_path / "gpu.yaml"
    config.write_text("topology:\n  mode: disaggregated\n  num_prefill: 1\n  num_decode: 1\n  device: cuda\n"
                      "  placement: spread\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)  # embedded local Ray
    proc = subprocess.run([sys.executable, "-m", "pd.launch", "--config", str(config), "--port", "0", "--num-cpus", "1",
                           "--object-store-mb", "80", "--log-level", "WARNING"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "needs 2 GPU (2 workers x 1), the Ray cluster has 0" in proc.stderr
    assert "serving at" not in proc.stdout


def test_engine_config_refuses_cuda_without_cuda_and_bad_device_names():
    from pd.engine.config import EngineConfig

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available on this machine"):
            EngineConfig(device="cuda")
    for bad in ("gpu", "cpu:0", "cuda:x", "CUDA"):
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
            EngineConfig(device=bad)


def test_the_config_schema_shows_the_fractional_gpu_share_and_the_pool_from_it():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pd.launch", "--print-config-schema"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    topology = json.loads(proc.stdout)["$defs"]["TopologySection"]["properties"]
    share = topology["gpus_per_worker"]
    assert share["default"] == 1.0 and share["exclusiveMinimum"] == 0 and share["maximum"] == 1
    assert "0.5 puts two workers (P and D) on one GPU" in share["description"]
    assert "size each worker's KV pool from its GPU share" in topology["gpu_memory_fraction"]["description"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error; this machine has CUDA")
def test_the_one_gpu_deployment_on_a_machine_without_gpus_names_the_one_gpu_it_needs():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)  # embedded local Ray
    proc = subprocess.run([sys.executable, "-m", "pd.launch", "--config", "deploy/gpu-1p1d-one-gpu.yaml", "--port",
                           "0", "--num-cpus", "4", "--object-store-mb", "80", "--log-level", "WARNING"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "needs 1 GPU (2 workers at 0.5 GPU each, 2 per GPU), the Ray cluster has 0" in proc.stderr
    assert "serving at" not in proc.stdout
