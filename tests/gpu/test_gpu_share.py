"""A worker's GPU share: the weights counted as the real model holds them, the KV pool planned to fit
beside them, and the errors that name what to change. The arithmetic runs on the CPU; the last test
plans the shipped one-GPU deployment on a real GPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pd.cluster.config import ConfigError, DeployConfig, load_deploy_config
from pd.cluster.gpu_share import (GIB, MIB, GpuBudget, GpuShareError, WorkerFootprint, gpus_needed, plan_kv_pool,
                                  weight_bytes, worker_kv_cache_bytes, workers_per_gpu)
from pd.cluster.roles import Role
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model
from pd.worker.wiring import engine_config_for

REPO = Path(__file__).resolve().parents[2]
H200_BYTES = 143_771_369_472  # what torch reports for one H200
CHECK_SHAPE = dict(vocab_size=260, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                   num_kv_heads=2, head_dim=64, dtype="bfloat16")


@pytest.mark.parametrize("model", [
    ModelConfig(),
    ModelConfig(attention_bias=True, tie_word_embeddings=True, dtype="bfloat16"),
    ModelConfig(hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=32, num_layers=3, dtype="float16"),
], ids=["tiny-fp32", "bias-tied-bf16", "gqa-headdim-fp16"])
def test_weight_bytes_are_what_the_built_model_holds(model):
    built = build_model(model, seed=None)
    assert weight_bytes(model) == sum(p.numel() * p.element_size() for p in built.parameters())


def test_two_half_shares_sized_from_the_fraction_fit_side_by_side_on_one_gpu():
    model = ModelConfig(**CHECK_SHAPE)
    footprint = WorkerFootprint.of(model, max_num_batched_tokens=4096, max_num_seqs=128, max_model_len=4096)
    plan = plan_kv_pool(GpuBudget(H200_BYTES, 0.5, 0.9), footprint, kv_memory_bytes=64 * MIB)
    used = footprint.weight_bytes + footprint.reserve_bytes + plan.pool_bytes
    assert used == int(H200_BYTES * 0.5 * 0.9)  # the fraction of the share, all of it planned
    assert 2 * used <= H200_BYTES  # P and D together
    assert plan.pool_bytes > 50 * GIB  # cache.kv_memory_mb (64 MiB) was not used
    assert "GPU share 0.5" in plan.describe() and "gpu_memory_fraction 0.9" in plan.describe()


def test_a_fraction_that_leaves_no_room_for_one_request_is_refused_with_the_numbers():
    model = ModelConfig(**CHECK_SHAPE)
    footprint = WorkerFootprint.of(model, max_num_batched_tokens=4096, max_num_seqs=128, max_model_len=4096)
    one_request = 24 * 2 * 2 * 64 * 2 * 4096  # layers x (K, V) x KV heads x head_dim x bf16 bytes x tokens
    with pytest.raises(GpuShareError, match=rf"gpu_memory_fraction 0.2 leaves 0 MiB for the KV pool, less than "
                                            rf"one scheduler.max_model_len request needs \({one_request // MIB} MiB\)"):
        plan_kv_pool(GpuBudget(8 * GIB, 0.5, 0.2), footprint, kv_memory_bytes=64 * MIB)


def test_kv_memory_mb_is_kept_when_it_fits_the_share_and_refused_when_it_does_not():
    model = ModelConfig(**CHECK_SHAPE)
    footprint = WorkerFootprint.of(model, max_num_batched_tokens=4096, max_num_seqs=128, max_model_len=4096)
    budget = GpuBudget(24 * GIB, 0.5)  # half of a 24 GiB card
    room = budget.share_bytes - footprint.weight_bytes - footprint.reserve_bytes
    assert plan_kv_pool(budget, footprint, room).pool_bytes == room
    with pytest.raises(GpuShareError, match=rf"cache.kv_memory_mb {(room + MIB) / MIB:g} does not fit beside them "
                                            rf"\(at most {room // MIB} fits\)"):
        plan_kv_pool(budget, footprint, room + MIB)


@pytest.mark.parametrize(("workers", "share", "gpus"), [
    (2, 0.5, 1.0), (3, 0.5, 2.0), (2, 0.6, 2.0), (3, 0.3333, 1.0), (4, 0.25, 1.0), (2, 1.0, 2.0), (5, 0.4, 3.0)])
def test_gpus_needed_packs_whole_shares_per_gpu(workers, share, gpus):
    assert gpus_needed(workers, share) == gpus
    assert workers_per_gpu(share) * share <= 1.0 + 1e-9


def _spec(config: DeployConfig):
    from pd.worker.worker import WorkerSpec

    return WorkerSpec("w", Role.BOTH, config, "s" * 32)


def test_a_cpu_worker_keeps_kv_memory_mb():
    config = DeployConfig.from_dict({"cache": {"kv_memory_mb": 12.5}, "topology": {"mode": "colocated"}})
    assert worker_kv_cache_bytes(config, {}) == int(12.5 * MIB)
    assert engine_config_for(_spec(config)).kv_cache_bytes == int(12.5 * MIB)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error; this machine has CUDA")
def test_a_cuda_worker_without_cuda_fails_with_the_engines_reason():
    config = load_deploy_config(REPO / "deploy" / "gpu-1p1d-one-gpu.yaml")
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):
        worker_kv_cache_bytes(config, dict(config.model.architecture, dtype=config.model.dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="plans a pool on a real GPU; CUDA is not available")
def test_the_one_gpu_deployment_plans_a_pool_inside_half_of_this_gpu():
    config = load_deploy_config(REPO / "deploy" / "gpu-1p1d-one-gpu.yaml").replace(topology__mode="colocated")
    engine_config = engine_config_for(_spec(config))
    total = torch.cuda.get_device_properties(0).total_memory
    model = ModelConfig(**dict(config.model.architecture, dtype=config.model.dtype))
    sched = config.scheduler
    footprint = WorkerFootprint.of(model, sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len)
    assert engine_config.kv_cache_bytes == int(total * 0.5 * 0.9) - footprint.weight_bytes - footprint.reserve_bytes


@pytest.mark.parametrize(("topology", "message"), [
    ({"gpus_per_worker": 0.5}, "topology.gpus_per_worker: applies to device: cuda only"),
    ({"gpu_memory_fraction": 0.9}, "topology.gpu_memory_fraction: applies to device: cuda only"),
    ({"device": "cuda", "gpus_per_worker": 2}, "topology.gpus_per_worker: input should be less than or equal to 1"),
    ({"device": "cuda", "gpus_per_worker": 0}, "topology.gpus_per_worker: input should be greater than 0"),
    ({"device": "cuda", "gpus_per_worker": 0.33333}, r"topology.gpus_per_worker: at most 4 decimal places"),
    ({"device": "cuda", "gpu_memory_fraction": 1.5}, "topology.gpu_memory_fraction: input should be less than or"),
])
def test_gpu_share_settings_are_validated_at_the_edge(topology, message):
    with pytest.raises(ConfigError, match=message):
        DeployConfig.from_dict({"topology": topology})


def test_gpu_share_defaults_keep_one_gpu_per_worker_and_the_configured_pool():
    topology = DeployConfig.from_dict({"topology": {"device": "cuda"}}).topology
    assert topology.gpus_per_worker == 1.0 and topology.gpu_memory_fraction is None
    shared = DeployConfig.from_dict({"topology": {"device": "cuda", "gpus_per_worker": 0.25}})
    assert DeployConfig.from_json(shared.to_json()) == shared  # crosses to the workers unchanged
