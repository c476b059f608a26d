"""Shared test configuration.

The pool-leak helper every KV test ends with is `kvcache.audit.assert_all_free`;
tests import it from there so there is exactly one definition.
"""
import logging
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    # Triton fixes interpreter vs compiler when it is first imported: without CUDA its kernels can only
    # run interpreted (tests/triton), so say so before any test module imports it.
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

logging.getLogger("ray").setLevel(logging.WARNING)
