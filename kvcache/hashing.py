"""Chained block hashes for the prefix cache.

The hash of full block i covers (hash of block i-1, the block's token ids, its
extra keys), so one hash names a whole prefix. Extra keys are the LoRA name
(every block) and the cache salt (first block only), in that order.

Serialisation is canonical and never pickle: parent digest bytes, then the
token ids as little-endian int64, then each extra key as a tag byte, a 4-byte
little-endian length and UTF-8 bytes. The chain's first parent (`none_hash`)
comes from `seed` (argument, else env `PDKV_HASH_SEED`), so processes that share
a seed agree on every hash; with no seed a per-process random value is used
(like vLLM without PYTHONHASHSEED): hashes then only mean something inside
that process.
"""
from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from typing import TYPE_CHECKING
from collections.abc import Callable, Sequence

if TYPE_CHECKING:
    from kvcache.request import Request

HASH_SEED_ENV = "PDKV_HASH_SEED"
ALGORITHMS = ("sha256", "xxhash")

_LITTLE = sys.byteorder == "little"
_TAG_LORA = b"\x01"
_TAG_SALT = b"\x02"
_RANDOM_SEED = os.urandom(32)  # one per process so every hasher in it agrees


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(algorithm: str) -> Callable[[bytes], bytes]:
    """The digest function for `algorithm` ("sha256" or "xxhash" = xxh3-128)."""
    if algorithm == "sha256":
        return _sha256
    if algorithm == "xxhash":
        try:
            import xxhash
        except ImportError as e:  # optional dependency
            raise ValueError("hash algorithm 'xxhash' needs the xxhash package") from e
        return xxhash.xxh3_128_digest
    raise ValueError(f"Unsupported hash algorithm {algorithm!r}; use one of {ALGORITHMS}")


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (OverflowError if out of range)."""
    arr = array("q", token_ids)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def _pack_str(tag: bytes, value: str) -> bytes:
    raw = value.encode("utf-8")
    return tag + struct.pack("<I", len(raw)) + raw


def encode_extra_keys(lora_name: str | None, cache_salt: str | None) -> bytes:
    """Canonical bytes of a block's extra keys (pass the salt for block 0 only)."""
    out = _pack_str(_TAG_LORA, lora_name) if lora_name else b""
    if cache_salt:
        out += _pack_str(_TAG_SALT, cache_salt)
    return out


def extra_keys_for_block(request: Request, start_token_idx: int) -> tuple | None:
    """Extra keys of the block starting at `start_token_idx`: (lora, salt) or None."""
    keys: list[str] = []
    if request.lora_name:
        keys.append(request.lora_name)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


class BlockHasher:
    """Hashes a request's newly completed full blocks.

    Guarantees: the same (seed, algorithm, block_size, tokens, LoRA, salt)
    always gives the same hashes; partial trailing blocks are never hashed;
    calling it again only hashes blocks completed since the previous call.
    """

    __slots__ = ("block_size", "algorithm", "none_hash", "_fn")

    def __init__(self, block_size: int = 16, algorithm: str = "sha256", seed: str | None = None) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.algorithm = algorithm
        self._fn = get_hash_fn(algorithm)
        if seed is None:
            seed = os.environ.get(HASH_SEED_ENV)
        seed_bytes = b"pdkv-seed:" + (seed.encode("utf-8") if seed is not None else _RANDOM_SEED)
        self.none_hash: bytes = self._fn(seed_bytes)

    def hash_block_tokens(self, parent_hash: bytes | None, token_ids: Sequence[int],
                          lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
        """Hash of one block given its parent (None for the first block); pass
        `cache_salt` only for the first block, as the request hasher does."""
        return self._fn((parent_hash or self.none_hash) + pack_token_ids(token_ids)
                        + encode_extra_keys(lora_name, cache_salt))

    def __call__(self, request: Request) -> list[bytes]:
        """Hashes of the full blocks of `request` not hashed yet (in order)."""
        bs = self.block_size
        hashes = request.block_hashes
        start = len(hashes) * bs
        tokens = request.all_token_ids
        end = len(tokens) // bs * bs
        if end <= start:
            return []
        tail = encode_extra_keys(request.lora_name, None)
        first_tail = encode_extra_keys(request.lora_name, request.cache_salt) if start == 0 else tail
        raw = pack_token_ids(tokens[start:end])
        step = bs * 8
        fn = self._fn
        parent = hashes[-1] if hashes else self.none_hash
        out: list[bytes] = []
        append = out.append
        pos = 0
        n = len(raw)
        if start == 0:
            parent = fn(parent + raw[0:step] + first_tail)
            append(parent)
            pos = step
        while pos < n:
            parent = fn(parent + raw[pos:pos + step] + tail)
            append(parent)
            pos += step
        return out


class CoarseHashView:
    """Read-only view of fine hashes at a coarser block size.

    Coarse block i ends where fine block (i+1)*scale-1 ends; since hashes chain,
    that fine hash already names the whole coarse prefix.
    """

    __slots__ = ("_hashes", "_scale")

    def __init__(self, hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> None:
        if block_size % hash_block_size:
            raise ValueError(f"block size {block_size} is not a multiple of hash block size {hash_block_size}")
        self._hashes = hashes
        self._scale = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._hashes) // self._scale

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError("coarse hash index out of range")
        return self._hashes[(idx + 1) * self._scale - 1]

    def __iter__(self):
        s = self._scale
        h = self._hashes
        for i in range(len(self)):
            yield h[(i + 1) * s - 1]


def hashes_at_block_size(hashes: Sequence[bytes], hash_block_size: int, block_size: int):
    """`hashes` itself when sizes match, else a CoarseHashView."""
    if block_size == hash_block_size:
        return hashes
    return CoarseHashView(hashes, hash_block_size, block_size)
