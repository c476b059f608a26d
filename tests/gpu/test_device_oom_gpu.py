"""A real out-of-memory on a GPU, from an oversized batch, does what the CPU fault plan simulates
(tests/engine/test_device_faults.py): the step fails its requests with a device-fault error, their blocks
are freed, and the engine stops before anything runs on the device again (a worker watching it then
reports itself unhealthy and restarts, as tests/reliability/test_engine_survival.py shows on the CPU).

The model's MLP is wide (2^20 units): a 40,960-token prompt needs over 240 GB of activations in one
step, more than any single GPU has, while its weights (3.2 GB in bfloat16) and an 8-token request fit.
"""
from __future__ import annotations

import pytest
import torch

from kvcache.audit import assert_all_free, check_invariants
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.outputs import FinishReason
from pd.engine.sample.params import SamplingParams
from pd.engine.step_isolation import DeviceFault

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a real GPU OOM)")]

HUGE_PROMPT = 40_960
WIDE = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=1 << 20, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position_embeddings=65_536, bos_token_id=1, eos_token_id=2)


def test_a_real_oversized_batch_oom_fails_its_step_and_stops_the_engine():
    engine = Engine(EngineConfig(model=WIDE, device="cuda", dtype="bfloat16", num_blocks=4096, block_size=16,
                                 max_num_batched_tokens=49_152, max_num_seqs=4, max_model_len=49_152,
                                 attention_backend="torch"))
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        assert engine.generate_sync({"warm": [5, 6, 7, 8, 9, 10, 11, 12]}, params)["warm"]  # a small batch fits
        engine.add_request("small", [5, 6, 7, 8, 9, 10, 11, 12], params)
        engine.add_request("huge", [3 + i % 500 for i in range(HUGE_PROMPT)], params)
        outputs = engine.step()  # both prompts in one step: its activations exceed the GPU
        failed = {o.request_id: o for o in outputs if o.finished}
        assert set(failed) == {"small", "huge"}, outputs
        for out in failed.values():
            assert out.finish_reason is FinishReason.ERROR and "OutOfMemoryError" in out.error, out.error
        assert isinstance(engine.fault_marks.device_fault, DeviceFault)
        check_invariants(engine.kv_cache_manager)
        assert_all_free(engine.kv_cache_manager)
        engine.add_request("after", [5, 6, 7], params)
        with pytest.raises(DeviceFault):  # nothing runs on that device again: the worker restarts instead
            engine.step()
    finally:
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
