"""A device fault in a step (what torch raises for CUDA out of memory or an illegal memory access,
raised by the fault points `engine.device_oom` / `engine.device_error`) fails every request of that
step and no other, frees their blocks, and stops the engine before it computes anything again
(real engine, real model, real pool; the classification also against torch's own exception types)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from tests.helpers.engine_cases import FULL_MODEL, engine_config

from connectors.links.faults import FaultSpecError
from kvcache.audit import assert_all_free, check_invariants
from pd.cluster.fault_rules import parse_worker_faults
from pd.engine.engine import Engine
from pd.engine.outputs import FinishReason
from pd.engine.sample.params import SamplingParams
from pd.engine.step_isolation import DEVICE_ERROR, DEVICE_OOM, DeviceFault, is_device_fault

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = {f"r{i}": [3 + i, 40, 41, 42, 43 + i, 7] for i in range(4)}


def test_device_errors_are_told_from_other_errors():
    assert is_device_fault(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_device_fault(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    if hasattr(torch, "AcceleratorError"):
        assert is_device_fault(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))  # older torch: plain
    for other in (RuntimeError("device lost"), ValueError("CUDA error"), KeyError("x"), RuntimeError("shape")):
        assert not is_device_fault(other), other


@pytest.mark.parametrize("point", [DEVICE_OOM, DEVICE_ERROR])
def test_device_fault_fails_its_step_only_and_stops_the_engine(point):
    engine = Engine(engine_config(FULL_MODEL, max_num_seqs=2))  # a step holds r0 and r1; r2, r3 wait
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, PARAMS)
    engine.fault_marks.mark("r0", point)
    outputs = engine.step()
    failed = {o.request_id: o for o in outputs if o.finished}
    assert set(failed) == {"r0", "r1"}, failed  # r1 shared the step: no retry on a poisoned device
    for out in failed.values():
        assert out.finish_reason is FinishReason.ERROR and "device failed" in out.error
        assert ("OutOfMemoryError" if point == DEVICE_OOM else "illegal memory access") in out.error
    fault = engine.fault_marks.device_fault
    assert isinstance(fault, DeviceFault) and fault.request_ids == {"r0", "r1"}
    check_invariants(engine.kv_cache_manager)
    assert_all_free(engine.kv_cache_manager)  # their blocks are freed; r2 and r3 were never allocated
    with pytest.raises(DeviceFault):  # the next step ends before anything runs on the device
        engine.step()
    assert all(engine.scheduler.requests[rid].request.num_computed_tokens == 0 for rid in ("r2", "r3"))
    for rid in ("r2", "r3"):  # (a restarted process would not have them either)
        engine.scheduler.abort_request(rid)
    assert_all_free(engine.kv_cache_manager)


def test_device_fault_ends_the_loop_and_the_others_hear_why():
    engine = Engine(engine_config(FULL_MODEL, max_num_seqs=1))
    deaths: list[BaseException] = []
    engine.on_death = deaths.append
    engine.fault_marks.mark("r0", DEVICE_ERROR)

    async def one(rid: str):
        outs = []
        try:
            async for out in engine.generate(rid, PROMPTS[rid], PARAMS):
                outs.append(out)
        except RuntimeError as exc:
            return exc
        return outs

    async def main():
        return await asyncio.gather(*(one(rid) for rid in PROMPTS))

    try:
        results = dict(zip(PROMPTS, asyncio.run(main()), strict=True))
    finally:
        engine.shutdown()
    assert results["r0"][-1].finish_reason is FinishReason.ERROR and "device failed" in results["r0"][-1].error
    for rid in ("r1", "r2", "r3"):  # waiting behind it: never computed, told the engine stopped on a device fault
        assert isinstance(results[rid], RuntimeError) and isinstance(results[rid].__cause__, DeviceFault), results
    assert isinstance(engine.dead, DeviceFault) and deaths == [engine.dead]


def test_fault_plans_take_the_device_points():
    plan = parse_worker_faults("engine.device_oom:kill:after=1, engine.device_error:kill")
    assert [r.point for r in plan.rules] == ["engine.device_oom", "engine.device_error"]
    with pytest.raises(FaultSpecError, match="engine points take kill only"):
        parse_worker_faults("engine.device_error:delay:1")
