"""Chained block hashes: canonical, seeded, extra keys, kept current on append."""
import hashlib
import subprocess
import sys

import pytest

from kvcache import BlockHasher, Request
from kvcache.hashing import CoarseHashView, pack_token_ids


def test_chain_matches_manual_block_hashes():
    h = BlockHasher(4, seed="abc")
    req = Request("r", list(range(10)), block_hasher=h)
    assert len(req.block_hashes) == 2  # partial trailing block is never hashed
    b0 = h.hash_block_tokens(None, [0, 1, 2, 3])
    b1 = h.hash_block_tokens(b0, [4, 5, 6, 7])
    assert req.block_hashes == [b0, b1]
    assert b0 == hashlib.sha256(h.none_hash + pack_token_ids([0, 1, 2, 3])).digest()


def test_append_keeps_hashes_current():
    h = BlockHasher(4, seed="abc")
    req = Request("r", list(range(6)), block_hasher=h)
    whole = Request("w", list(range(13)), block_hasher=h)
    req.append_output_token_ids(6)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7, 8, 9, 10, 11, 12])
    assert req.block_hashes == whole.block_hashes and len(whole.block_hashes) == 3
    assert req.output_token_ids == [6, 7, 8, 9, 10, 11, 12]
    assert req.all_token_ids == list(range(13)) and req.num_tokens == 13


def test_seed_decides_the_chain():
    a, b, c = BlockHasher(4, seed="1"), BlockHasher(4, seed="1"), BlockHasher(4, seed="2")
    toks = list(range(8))
    assert Request("x", toks, block_hasher=a).block_hashes == Request("y", toks, block_hasher=b).block_hashes
    assert Request("x", toks, block_hasher=a).block_hashes[0] != Request("x", toks, block_hasher=c).block_hashes[0]


def test_seed_from_environment_agrees_across_processes(monkeypatch):
    code = ("from kvcache import BlockHasher, Request;"
            "print(Request('r', list(range(8)), block_hasher=BlockHasher(4)).block_hashes[-1].hex())")
    env_out = []
    for _ in range(2):
        env = {"PDKV_HASH_SEED": "shared", "PATH": "/usr/bin:/bin"}
        env_out.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True, cwd=".").stdout.strip())
    assert env_out[0] == env_out[1]
    monkeypatch.setenv("PDKV_HASH_SEED", "shared")
    assert BlockHasher(4).none_hash == BlockHasher(4, seed="shared").none_hash


def test_unseeded_hashers_agree_within_a_process(monkeypatch):
    monkeypatch.delenv("PDKV_HASH_SEED", raising=False)
    assert BlockHasher(4).none_hash == BlockHasher(4).none_hash


def test_cache_salt_changes_only_the_first_block():
    h = BlockHasher(4, seed="s")
    toks = list(range(12))
    plain = Request("a", toks, block_hasher=h).block_hashes
    salted = Request("b", toks, block_hasher=h, cache_salt="tenant-1").block_hashes
    other = Request("c", toks, block_hasher=h, cache_salt="tenant-2").block_hashes
    assert all(p != s for p, s in zip(plain, salted))  # chain carries the change
    assert salted[0] != other[0]
    assert salted[0] == h.hash_block_tokens(None, toks[:4], cache_salt="tenant-1")
    assert salted[1] == h.hash_block_tokens(salted[0], toks[4:8])


def test_lora_name_is_an_extra_key_on_every_block():
    h = BlockHasher(4, seed="s")
    toks = list(range(8))
    base = Request("a", toks, block_hasher=h).block_hashes
    lora = Request("b", toks, block_hasher=h, lora_name="adapter").block_hashes
    assert lora[0] == h.hash_block_tokens(None, toks[:4], lora_name="adapter")
    assert lora[1] == h.hash_block_tokens(lora[0], toks[4:], lora_name="adapter")
    assert lora != base
    # the lora name and the salt are distinguishable keys
    assert h.hash_block_tokens(None, toks[:4], lora_name="x") != h.hash_block_tokens(None, toks[:4], cache_salt="x")


def test_xxhash_algorithm_gives_128_bit_digests():
    pytest.importorskip("xxhash")
    h = BlockHasher(4, algorithm="xxhash", seed="s")
    req = Request("r", list(range(8)), block_hasher=h)
    assert [len(x) for x in req.block_hashes] == [16, 16]
    assert req.block_hashes != Request("r", list(range(8)), block_hasher=BlockHasher(4, seed="s")).block_hashes


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="Unsupported hash algorithm"):
        BlockHasher(4, algorithm="pickle")
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(OverflowError):
        Request("r", [2 ** 70, 1, 2, 3], block_hasher=BlockHasher(4, seed="s"))
    with pytest.raises(ValueError):
        Request("r", [])


def test_request_without_hasher_has_no_hashes():
    req = Request("r", list(range(40)))
    req.append_output_token_ids(5)
    assert req.block_hashes == []


def test_coarse_view_takes_last_fine_hash_of_each_coarse_block():
    fine = [bytes([i]) for i in range(7)]
    view = CoarseHashView(fine, 2, 6)
    assert len(view) == 2
    assert view[0] == fine[2] and view[1] == fine[5] and view[-1] == fine[5]
    assert list(view) == [fine[2], fine[5]] and view[0:2] == [fine[2], fine[5]]
    with pytest.raises(IndexError):
        view[2]
    with pytest.raises(ValueError):
        CoarseHashView(fine, 4, 6)
