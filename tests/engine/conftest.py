"""Fixtures for the engine tests (helpers live in tests/helpers/engine_cases.py)."""
import pytest
import torch
from tests.helpers.engine_cases import MODELS, torch_threads

from pd.engine.model.config import ModelConfig

# Tiny models: one intra-op thread is faster than two, and far faster when
# other processes compete for the cores (OpenMP threads spin-wait on each other).
torch.set_num_threads(1)


@pytest.fixture(params=sorted(MODELS))
def model_config(request) -> ModelConfig:
    return MODELS[request.param]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The packed GEMM's kernels on one thread and on two (their chunked split over the threads)."""
    with torch_threads(request.param) as n:
        yield n
