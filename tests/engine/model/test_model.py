"""The paged forward matches a plain dense forward of the same weights."""
import pytest
import torch

from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.kv.layout import KVLayout
from pd.engine.model.llama import build_model
from pd.engine.runner.model_runner import ModelRunner
from pd.engine.sched.output import ScheduledChunk

HYBRID = ModelConfig(num_layers=3, layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=12)
FULL = ModelConfig(num_layers=2)
ALL_SLIDING = ModelConfig(num_layers=2, layer_types=("sliding_attention",) * 2, sliding_window=7)


def _tables(lengths, layout, block_size):
    """Distinct, shuffled block ids per request and group (ids unique across groups)."""
    gen = torch.Generator().manual_seed(5)
    need = [(n + block_size - 1) // block_size for n in lengths]
    total = sum(need) * len(layout.groups)
    ids = (torch.randperm(total, generator=gen) + 1).tolist()
    tables = []
    for n in need:
        tables.append(tuple([ids.pop() for _ in range(n)] for _ in layout.groups))
    return tables, total + 1


def _run_chunked(cfg, lengths, chunk, block_size=4, dtype_tol=1e-5):
    model = build_model(cfg, seed=3)
    layout = KVLayout(cfg, block_size)
    tables, num_blocks = _tables(lengths, layout, block_size)
    runner = ModelRunner(model, layout, PagePool(num_blocks, layout.page_size_bytes), attention_backend="torch")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    done = [0] * len(prompts)
    worst = 0.0
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks = []
        for i, p in enumerate(prompts):
            n = min(chunk, len(p) - done[i])
            if n:
                chunks.append(ScheduledChunk(str(i), p[done[i]:done[i] + n], done[i], tables[i], True))
                done[i] += n
        logits = runner.model.compute_logits(runner.final_hidden(chunks))
        for row, c in zip(logits, chunks):
            ref = model.reference_logits(prompts[int(c.request_id)][: c.start + len(c.token_ids)])[-1]
            worst = max(worst, (ref - row).abs().max().item())
    return worst


@pytest.mark.parametrize("cfg", [FULL, HYBRID, ALL_SLIDING], ids=["full", "hybrid", "sliding"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_paged_logits_match_dense_reference(cfg, chunk):
    assert _run_chunked(cfg, [1, 5, 17, 30, 41], chunk) < 1e-5


def test_every_position_matches_in_one_prefill():
    cfg = HYBRID
    model = build_model(cfg, seed=9)
    layout = KVLayout(cfg, 4)
    runner = ModelRunner(model, layout, PagePool(40, layout.page_size_bytes), attention_backend="torch")
    prompt = list(range(50, 80))
    tables = (list(range(1, 9)), list(range(9, 17)))
    # decode one token at a time: each step's logits row is the reference row at that position
    ref = model.reference_logits(prompt)
    for pos in range(len(prompt)):
        row = runner.model.compute_logits(runner.final_hidden([ScheduledChunk("r", [prompt[pos]], pos, tables, True)]))[0]
        assert torch.allclose(row, ref[pos], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.15), ("float16", 0.02)])
def test_low_precision_dtypes_run_paged(dtype, tol):
    cfg = ModelConfig(num_layers=2, dtype=dtype)
    assert build_model(cfg).model.embed_tokens.weight.dtype == cfg.torch_dtype
    assert _run_chunked(cfg, [3, 20], 8) < tol


def test_seeded_init_is_deterministic():
    a = build_model(FULL, seed=1).reference_logits([1, 2, 3])
    b = build_model(FULL, seed=1).reference_logits([1, 2, 3])
    c = build_model(FULL, seed=2).reference_logits([1, 2, 3])
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_config_validation():
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(num_layers=1, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig(num_layers=2, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="int8")


def test_stale_nan_bytes_in_unwritten_slots_do_not_leak():
    """Slots past a request's end (block tail) may hold garbage, e.g. after a failed load."""
    cfg = FULL
    model = build_model(cfg, seed=3)
    layout = KVLayout(cfg, 4)
    pool = PagePool(20, layout.page_size_bytes)
    pool.buffer.view(torch.float32).fill_(float("nan"))
    runner = ModelRunner(model, layout, pool, attention_backend="torch")
    prompt = list(range(10, 17))  # 7 tokens: the second block's last slot is never written
    tables = ([3, 5],)
    runner.model.compute_logits(runner.final_hidden([ScheduledChunk("a", prompt[:5], 0, tables, True)]))
    row = runner.model.compute_logits(runner.final_hidden([ScheduledChunk("a", prompt[5:], 5, tables, True)]))[0]
    assert torch.allclose(row, model.reference_logits(prompt)[-1], atol=1e-5, rtol=0)
