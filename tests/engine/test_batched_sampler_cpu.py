"""The batched device sampler against the semantics of pd/engine/sample/sampler.py, on the CPU."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.engine.sample import batched
from pd.engine.sample.batched import (BatchedSampler, RowRng, _nucleus_of_top, _nucleus_sorted, filter_rows,
                                     make_row_rng, uniform_noise)
from pd.engine.sample.params import SAMPLER_BYTES_PER_LOGIT, SamplingParams
from pd.engine.sample.sampler import filter_logits, sample

params_st = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
                      top_k=st.sampled_from([0, 1, 2, 5, 50]), top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05, 1e-9]),
                      seed=st.integers(0, 2**40))


def _logits(seed: int, rows: int, vocab: int, ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 3
    return x.round() if ties else x  # rounding makes many exact ties


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 6), vocab=st.integers(2, 40), ties=st.booleans(),
       poison=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]))
def test_greedy_rows_match_the_sampler(seed, rows, vocab, ties, poison):
    logits = _logits(seed, rows, vocab, ties)
    if poison is not None:
        logits[0, seed % vocab] = poison
    params = [SamplingParams()] * rows
    assert BatchedSampler().sample(logits, params, [None] * rows) == sample(logits, params, [None] * rows)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 60), ties=st.booleans(),
       params=st.lists(params_st, min_size=1, max_size=5))
def test_filtering_matches_filter_logits_row_by_row(seed, vocab, ties, params):
    logits = _logits(seed, len(params), vocab, ties).double()
    got = filter_rows(logits, torch.tensor([p.temperature for p in params], dtype=torch.float64),
                      torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params],
                                                                            dtype=torch.float64))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    top_k = torch.tensor([p.top_k for p in params])
    # what the sampler passes from the host (no sync) gives the same rows
    max_k = max((p.top_k if p.top_k < vocab else 0) for p in params)
    host = filter_rows(logits, temperature, top_k, top_p, max_k, [i for i, p in enumerate(params) if p.top_p < 1])
    assert torch.equal(host, got)
    # the sampler's float32: the same tokens kept but where a running mass lands within float32 rounding of
    # top_p (rounded logits make exact masses like 0.5 common, so compare there only on margin)
    single = filter_rows(logits.float(), temperature, top_k, top_p)
    for i, p in enumerate(params):
        want = filter_logits(logits[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), f"different tokens kept for {p}"
        torch.testing.assert_close(got[i], want, atol=1e-12, rtol=1e-12)
        kept = ~torch.isinf(want)
        probs = torch.softmax(want, dim=-1).sort(descending=True).values
        masses = probs.cumsum(0) - probs
        if p.top_p >= 1.0 or bool((masses - p.top_p).abs().min() > 1e-5):
            assert torch.equal(~torch.isinf(single[i]), kept), f"float32 keeps other tokens for {p}"
            torch.testing.assert_close(single[i][kept], want[kept].float(), atol=1e-5, rtol=1e-5)


def test_seeded_draws_depend_only_on_seed_and_logits_not_on_neighbours():
    logits = _logits(1, 6, 30)
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=0.7, top_k=5, seed=s) for s in (1, 2, 3)] + [SamplingParams()]
    sampler = BatchedSampler()
    alone = RowRng(1234)
    alone_tokens = [sampler.sample(logits[:1], [mine], [alone])[0] for _ in range(12)]
    crowded = RowRng(1234)
    crowded_tokens = []
    for step in range(12):  # the request moves between rows, among different neighbours each step
        row = step % 5
        batch = others[:row] + [mine] + others[row:]
        rngs = [make_row_rng(p) for p in batch]
        rngs[row] = crowded
        rows = torch.cat([logits[1:1 + row], logits[:1], logits[1 + row:5]])
        crowded_tokens.append(sampler.sample(rows, batch, rngs)[row])
    assert crowded_tokens == alone_tokens
    assert alone.draws == crowded.draws == 12
    assert len(set(alone_tokens)) > 1  # the draws advance (not one fixed token)
    again = RowRng(1234)
    assert [sampler.sample(logits[:1], [mine], [again])[0] for _ in range(12)] == alone_tokens


def test_draws_follow_the_filtered_distribution():
    """4,000 seeded rows of the same logits: token frequencies match softmax of the filtered scores."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]]).repeat(4000, 1)
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=0)
    tokens = BatchedSampler().sample(logits, [p] * 4000, [RowRng(seed) for seed in range(4000)])
    probs = torch.softmax(filter_logits(logits[0], p), dim=-1)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    expected = probs * 4000
    kept = probs > 0
    chi2 = float((((counts - expected) ** 2)[kept] / expected[kept]).sum())
    assert chi2 < 25.0, f"chi-square {chi2:.1f} over {int(kept.sum())} tokens"  # p < 1e-4 for <= 6 dof


def test_top_k_rows_are_not_sorted_and_only_top_p_rows_are(monkeypatch):
    """Top-k takes torch.topk of the largest k asked (not a sort of the vocabulary); a sort runs only over the
    rows with top_p < 1 (of their candidates, or of the whole row: test_top_p_rows_sort_the_vocabulary_...)."""
    sorted_rows = []
    real_sort = torch.sort

    def counting_sort(x, *args, **kwargs):
        sorted_rows.append(x.shape[0])
        return real_sort(x, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", counting_sort)
    logits = _logits(5, 6, 1000)
    params = [SamplingParams(temperature=0.9, top_k=k, seed=i) for i, k in enumerate((5, 40, 1, 7))]
    params += [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.8, seed=9)]
    tokens = BatchedSampler().sample(logits, params, [make_row_rng(p) for p in params])
    assert sorted_rows and set(sorted_rows) == {1}  # the one top-p row
    for i, p in enumerate(params[:4]):
        assert tokens[i] in set(torch.topk(logits[i], p.top_k).indices.tolist())
    assert tokens[4] == int(logits[4].argmax())


def test_sampling_temporaries_stay_within_the_memory_plans_bytes_per_logit():
    """The most live memory the sampler allocates at once, watched through a dispatch mode (each op's
    outputs counted until freed), over a batch of top-k, top-p and plain rows: at most
    SAMPLER_BYTES_PER_LOGIT bytes per logit of the batch, which pd/cluster/gpu_share.py reserves."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class PeakBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.storages = set()

        def _free(self, key, nbytes):
            self.storages.discard(key)
            self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and not func.is_view:
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key not in self.storages and storage.nbytes():
                        self.storages.add(key)
                        self.live += storage.nbytes()
                        weakref.finalize(storage, self._free, key, storage.nbytes())
            self.peak = max(self.peak, self.live)
            return out

    vocab = 5000
    mixed = [SamplingParams(temperature=0.8, top_k=50, seed=i) for i in range(8)]
    mixed += [SamplingParams(temperature=1.2, top_p=0.9, seed=i) for i in range(8)]
    mixed += [SamplingParams(temperature=1.0, seed=i) for i in range(4)] + [SamplingParams()] * 4
    nucleus = [SamplingParams(temperature=1.2, top_k=k, top_p=0.9, seed=k) for k in (0, 50) * 8]  # the worst
    for params in (mixed, nucleus):
        logits = _logits(6, len(params), vocab)
        with PeakBytes() as mode:
            BatchedSampler().sample(logits, params, [make_row_rng(p) for p in params])
        per_logit = mode.peak / logits.numel()
        assert 4 < per_logit <= SAMPLER_BYTES_PER_LOGIT, per_logit  # (the float64 sampler: about 50)


def test_noise_is_uniform_and_keyed_by_seed_and_draw():
    lo, hi = torch.tensor([5, 5, 6]), torch.tensor([0, 0, 0])
    u = uniform_noise(lo, hi, torch.tensor([0, 1, 0]), 50000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    torch.testing.assert_close(uniform_noise(lo[:1], hi[:1], torch.tensor([0]), 50000)[0], u[0], atol=0, rtol=0)


def test_ids_at_or_above_the_vocabulary_bound_are_never_sampled():
    logits = _logits(4, 64, 40)
    logits[:, 30:] += 100.0  # the padded ids would win every draw
    params = [SamplingParams()] * 32 + [SamplingParams(temperature=1.5, seed=i) for i in range(32)]
    rngs = [make_row_rng(p) for p in params]
    tokens = BatchedSampler(num_ids=30).sample(logits, params, rngs)
    assert max(tokens) < 30
    assert tokens[:32] == sample(logits[:32, :30], params[:32], [None] * 32)


def test_non_finite_rows_fall_back_to_greedy(caplog):
    logits = _logits(2, 2, 10)
    logits[0, 3] = float("nan")
    logits[0, 7] = 50.0
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)]
    with caplog.at_level("WARNING"):
        tokens = BatchedSampler().sample(logits, params, [RowRng(1), RowRng(2)])
    assert tokens[0] == 7 and "non-finite" in caplog.text
    assert 0 <= tokens[1] < 10


def test_bad_calls_are_refused():
    sampler = BatchedSampler()
    with pytest.raises(ValueError, match="one SamplingParams"):
        sampler.sample(torch.zeros(2, 4), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="no RowRng"):
        sampler.sample(torch.zeros(1, 4), [SamplingParams(temperature=1.0)], [None])
    with pytest.raises(ValueError):
        BatchedSampler(num_ids=0)
    assert make_row_rng(SamplingParams()) is None
    assert make_row_rng(SamplingParams(temperature=1.0, seed=9)) == RowRng(9)
    assert not math.isnan(sampler.sample(torch.zeros(1, 4), [SamplingParams(temperature=1.0, seed=1)],
                                         [RowRng(1)])[0])


@pytest.mark.parametrize("peaked", [True, False])
def test_top_p_rows_sort_the_vocabulary_only_when_the_nucleus_is_wide(monkeypatch, peaked):
    """A peaked row's nucleus lies among its largest scores: found from a `torch.topk` candidate set, with no
    sort as wide as the vocabulary; a flat row's nucleus is wide, and it is sorted whole. Either way the kept
    tokens are those of the whole-row sort, ties at the border included (by id), and so are the tokens drawn."""
    vocab = 4000
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn((4, vocab), generator=gen)
    if peaked:
        logits[:, :200] += 8.0 + 4.0 * torch.rand((4, 200), generator=gen)  # 200 tokens hold 99.8% of the mass
        logits[1, 40:60] = 30.0  # a tie group the nucleus ends inside: kept by lowest id
    else:
        logits = logits * 0.05
    top_p = [0.9, 0.52, 0.99, 0.3]
    for i, p in enumerate(top_p):  # no border within float32 rounding of a running mass
        probs = torch.softmax(logits[i].double(), dim=0).sort(descending=True).values
        assert bool(((probs.cumsum(0) - probs) - p).abs().min() > 1e-5)
    params = [SamplingParams(temperature=1.0, top_p=p, seed=i) for i, p in enumerate(top_p)]
    widths = []
    real_sort = torch.sort

    def counting_sort(x, *args, **kwargs):
        widths.append(x.shape[-1])
        return real_sort(x, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", counting_sort)
    tokens = BatchedSampler().sample(logits, params, [make_row_rng(p) for p in params])
    monkeypatch.undo()
    if peaked:
        assert widths and max(widths) < vocab, widths
    else:
        assert vocab in widths, widths
    monkeypatch.setattr(batched, "CANDIDATES", vocab)  # every top-p row sorted whole
    assert BatchedSampler().sample(logits, params, [make_row_rng(p) for p in params]) == tokens
    want = _nucleus_sorted(logits.clone(), torch.tensor(top_p))
    for size in (64, 512):
        got, settled = _nucleus_of_top(logits.clone(), torch.tensor(top_p), size)
        for i in range(4):
            if settled[i]:
                assert torch.equal(got[i], want[i]), f"row {i} keeps other tokens among {size} candidates"
        if peaked:
            assert bool(settled[1])
            assert torch.isfinite(got[1]).nonzero().flatten().tolist() == list(range(40, 51))  # 11 of the 20 tied
