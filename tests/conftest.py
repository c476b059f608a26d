"""Shared test configuration.

The pool-leak helper every KV test ends with is `kvcache.audit.assert_all_free`;
tests import it from there so there is exactly one definition.

Tests live in folders named after the package they test (tests/engine for pd/engine, tests/router,
tests/cluster, tests/worker, tests/tools, tests/deploy, tests/connectors, tests/kvcache), plus tests/e2e
(deployments on Ray), tests/reliability (faults, fuzzing, security), tests/triton (the kernels) and
tests/gpu (tests that need CUDA: the `gpu` marker) with the device scripts. Test folders hold no
__init__.py, so every test module's basename is unique across tests/. Helpers shared by several folders
are the package tests/helpers.
"""
import logging
import os

import pytest

if "TRITON_INTERPRET" not in os.environ:
    import torch

    # Triton fixes interpreter vs compiler when it is first imported: without CUDA its kernels can only
    # run interpreted (tests/triton), so say so before any test module imports it.
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

logging.getLogger("ray").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def ray_instance():
    """A fresh local Ray instance for one test module (its deployments share it), shut down after it."""
    import ray

    from tests.helpers.e2e import ray_init_kwargs

    ray.init(**ray_init_kwargs())
    try:
        yield
    finally:
        ray.shutdown()
