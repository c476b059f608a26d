import pytest
import torch

from pd.engine.sample.params import SamplingParams
from pd.engine.sample.sampler import filter_logits, sample, make_generator
from pd.engine.text.tokenizer import ByteTokenizer, valid_token_ids


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "héllo wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert tok.vocab_size == 260
    # cut mid-character: no exception
    assert tok.decode(list("✓".encode())[:2]) == "\ufffd"


def test_valid_token_ids_validates_and_converts_once():
    ids = [1, 2]
    assert valid_token_ids(ids, 260) is ids  # a list of ints is kept as it is
    assert valid_token_ids((1, 2), 260) == [1, 2] and valid_token_ids(torch.tensor([3, 4]), 260) == [3, 4]
    with pytest.raises(ValueError, match="outside"):
        valid_token_ids([999], 260)
    with pytest.raises(ValueError, match="outside"):
        valid_token_ids([1, -1], 260)
    with pytest.raises(ValueError, match="empty"):
        valid_token_ids([], 260)
    with pytest.raises(TypeError):
        valid_token_ids([1.5], 260)  # never cut to an int


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    assert SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)


def test_greedy_and_seeded_sampling():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    assert sample(logits, [greedy] * 3, [None] * 3) == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits[:1], [p], [g])[0] for g in [make_generator(p)] for _ in range(20)]
    g2 = make_generator(p)
    b = [sample(logits[:1], [p], [g2])[0] for _ in range(20)]
    assert a == b  # same seed, same draws


def test_top_k_top_p_filter():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)).isfinite()
    assert kept.tolist() == [True, True, False, False, False]
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.5)).isfinite()
    assert kept.tolist() == [True, False, False, False, False]
    gen = torch.Generator().manual_seed(1)
    draws = {sample(logits[None], [SamplingParams(temperature=2.0, top_k=2)], [gen])[0] for _ in range(50)}
    assert draws == {0, 1}
