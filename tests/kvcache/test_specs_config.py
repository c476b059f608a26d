"""Specs, groups, config validation and memory budget -> num_blocks."""
import pytest

from kvcache import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, RequestStatus,
                     SlidingWindowSpec, num_blocks_for_budget)


def test_page_sizes():
    fa = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    assert fa.page_size_bytes == 2 * 16 * 2 * 64 * 4
    bf = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    assert bf.page_size_bytes == fa.page_size_bytes // 2
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16", sliding_window=128)
    assert sw.page_size_bytes == 2 * 16 * 2 * 64 * 2
    m = MambaSpec(block_size=16, shapes=((4, 8), (3,)), dtypes=("float32", "float16"))
    assert m.page_size_bytes == 4 * 8 * 4 + 3 * 2
    assert (fa.kind, sw.kind, m.kind) == ("full_attention", "sliding_window", "mamba")
    assert (fa.sliding_window_size, sw.sliding_window_size) == (None, 128)


def test_sliding_window_admission_cap():
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=128)
    # window-1 held tokens + one batch of new ones, +1 for an unaligned window start
    assert sw.max_admission_blocks_per_request(256, 8192) == -(-(127 + 256) // 16) + 1
    assert sw.max_admission_blocks_per_request(8192, 100) == -(-100 // 16) + 1


def test_specs_are_frozen_and_validated():
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
    with pytest.raises(Exception):
        fa.block_size = 8
    with pytest.raises(ValueError):
        FullAttentionSpec(block_size=0, num_kv_heads=1, head_size=1, dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float13")
    with pytest.raises(ValueError):
        SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=0)
    with pytest.raises(ValueError):
        MambaSpec(block_size=16, shapes=((1,),), dtypes=("float32", "float32"))
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        MambaSpec(block_size=16, shapes=((1,),), dtypes=("float32",), mamba_cache_mode="align")


def test_config_validation_and_derived_sizes():
    fa = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float32")
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=8, dtype="float32", sliding_window=64)
    groups = (KVCacheGroupSpec(["a", "b"], fa), KVCacheGroupSpec(("c",), sw))
    cfg = KVCacheConfig(num_blocks=10, groups=groups)
    assert cfg.groups[0].layer_names == ("a", "b")
    assert cfg.scheduler_block_size == 32 and cfg.default_hash_block_size == 16
    assert cfg.page_size_bytes == max(fa.page_size_bytes * 2, sw.page_size_bytes)
    with pytest.raises(ValueError, match="more than one group"):
        KVCacheConfig(num_blocks=10, groups=(KVCacheGroupSpec(("a",), fa), KVCacheGroupSpec(("a",), sw)))
    with pytest.raises(ValueError):
        KVCacheConfig(num_blocks=0, groups=groups)
    with pytest.raises(ValueError):
        KVCacheGroupSpec((), fa)


def test_num_blocks_for_budget():
    fa = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    groups = (KVCacheGroupSpec(("l0", "l1"), fa),)
    page = fa.page_size_bytes * 2
    assert num_blocks_for_budget(page * 100 + page - 1, groups) == 100
    with pytest.raises(ValueError):
        num_blocks_for_budget(page, groups)
    with pytest.raises(ValueError):
        num_blocks_for_budget(10 ** 9, ())


def test_request_status_order():
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert all(RequestStatus.is_finished(s) for s in RequestStatus if s.name.startswith("FINISHED"))
    assert [s.name for s in RequestStatus][:4] == ["WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED"]
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_ABORTED) == "abort"
