"""How strong `router.admin_key` must be, how its strength is estimated, and a key that is strong.

The admin key opens `/pd/*` and a protected `/metrics`: a guessed admin key reads every
worker's figures and every tenant's load. It must hold at least `MIN_LENGTH` characters and
an estimated `MIN_ENTROPY_BITS` bits. The estimate (`estimated_entropy_bits`) assumes the key
was drawn at random, one character at a time, from the smallest alphabet that explains it:

- the character classes it uses (hex digits alone: 16; else lowercase 26, uppercase 26,
  digits 10, other printable ASCII 33, anything else 128, summed over the classes present);
- or, when the key shows far fewer distinct characters than a random draw from those classes
  would (more than 3 standard deviations below the mean), the alphabet size whose random draw
  of the key's length would show as many distinct characters as the key does on average
  (`zzzz...` draws from one character, whatever its class);
- a character that extends a run of step -1, 0 or +1 past its fourth (the fifth and later of
  `aaaaa`, `abcde`, `edcba`) counts nothing.

Bits = (characters that count) x log2(alphabet). A random key gets its full due: 32 random
hex digits (exactly 128 bits) pass unless their draw happens to hold a run such as `12345`
or few distinct digits (about 1 in 300); 64 hex digits and `generate_admin_key()`'s 43 URL-safe characters
(256 bits) pass with room to spare.
"""
from __future__ import annotations

import math
import secrets
import string

MIN_LENGTH = 32
MIN_ENTROPY_BITS = 128.0
GENERATE_HINT = ("generate one with `python -m pd.launch --generate-admin-key` "
                 "(or: python -c 'import secrets; print(secrets.token_urlsafe(32))')")

_HEX = frozenset(string.digits + "abcdef"), frozenset(string.digits + "ABCDEF")
_CLASSES = ((frozenset(string.ascii_lowercase), 26), (frozenset(string.ascii_uppercase), 26),
            (frozenset(string.digits), 10), (frozenset(string.punctuation + " "), 33))
_OTHER_CLASS_SIZE = 128  # non-ASCII or control characters: a generous alphabet, since no class names them


def generate_admin_key() -> str:
    """A fresh admin key: 32 random bytes, URL-safe base64 (43 characters, 256 bits), always accepted."""
    while True:  # a random draw that looks patterned is possible in principle; never in practice
        key = secrets.token_urlsafe(32)
        if weakness(key) is None:
            return key


def weakness(key: str) -> str | None:
    """None when `key` is strong enough for `router.admin_key`; else why not (never the key itself)."""
    bits = estimated_entropy_bits(key)
    if len(key) >= MIN_LENGTH and bits >= MIN_ENTROPY_BITS:
        return None
    return (f"too weak: {len(key)} characters and about {bits:.0f} bits of estimated entropy; the admin key needs "
            f"at least {MIN_LENGTH} characters and {MIN_ENTROPY_BITS:.0f} bits; {GENERATE_HINT}")


def estimated_entropy_bits(key: str) -> float:
    """The key's entropy if it was drawn at random from the alphabet that explains it (module docstring)."""
    if not key:
        return 0.0
    length, distinct, alphabet = len(key), len(set(key)), _class_alphabet(key)
    if distinct < _plausible_distinct_floor(alphabet, length):
        alphabet = min(alphabet, _alphabet_from_distinct(length, distinct))
    return _counted_characters(key) * math.log2(alphabet) if alphabet > 1 else 0.0


def _class_alphabet(key: str) -> float:
    chars = set(key)
    if any(chars <= hex_digits for hex_digits in _HEX):
        return 16.0
    size = sum(n for members, n in _CLASSES if chars & members)
    if any(not any(c in members for members, _ in _CLASSES) for c in chars):
        size += _OTHER_CLASS_SIZE
    return float(size)


def _plausible_distinct_floor(alphabet: float, length: int) -> float:
    """Three standard deviations below the mean count of distinct characters in `length` random draws
    from `alphabet` characters (balls into bins: occupied bins)."""
    miss, miss2 = (1.0 - 1.0 / alphabet) ** length, (1.0 - 2.0 / alphabet) ** length
    mean = alphabet * (1.0 - miss)
    variance = alphabet * (alphabet - 1.0) * miss2 + alphabet * miss - alphabet ** 2 * miss ** 2
    return mean - 3.0 * math.sqrt(max(variance, 0.0))


def _alphabet_from_distinct(length: int, distinct: int) -> float:
    """The alphabet size A whose random draw of `length` characters shows `distinct` distinct ones on
    average: A * (1 - (1 - 1/A) ** length) = distinct (inf when every character differs)."""
    if distinct >= length:
        return math.inf
    if distinct <= 1:
        return float(distinct)

    def shown(size: float) -> float:
        return size * (1.0 - (1.0 - 1.0 / size) ** length)

    low, high = float(distinct), float(distinct)
    while shown(high) < distinct:  # shown() rises with the alphabet toward `length`
        high *= 2.0
    for _ in range(60):
        middle = (low + high) / 2.0
        low, high = (middle, high) if shown(middle) < distinct else (low, middle)
    return high


def _counted_characters(key: str) -> int:
    """Characters minus those extending a run of step -1, 0 or +1 past its fourth character."""
    codes = [ord(c) for c in key]
    counted = min(len(codes), 4)
    for i in range(4, len(codes)):
        steps = {codes[j] - codes[j - 1] for j in (i, i - 1, i - 2, i - 3)}
        if not (len(steps) == 1 and abs(steps.pop()) <= 1):
            counted += 1
    return counted
