"""The rule between a model's vocabulary and its tokenizer's, in one place.

A model scores `vocab_size` ids at every step; its tokenizer decodes ids
`[0, tokenizer vocab)`. The two may differ one way only:
- a model vocabulary larger than the tokenizer's is padding (checkpoints round
  their embedding up to a multiple of 64 or 128): it serves, and the engine never
  samples an id the tokenizer cannot decode (`EngineConfig.tokenizer_vocab_size`);
- a tokenizer larger than the model would hand the model ids it has no embedding
  for: a configuration error, refused before anything is served.

The random-weight test models speak the byte tokenizer (`BYTE_VOCAB_SIZE` ids),
so their declared vocabulary must be exactly that (the deploy config checks it).
This module imports nothing heavy: the deploy config uses it at validation.
"""
from __future__ import annotations

NUM_BYTES = 256
BYTE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<unk>")
BYTE_VOCAB_SIZE = NUM_BYTES + len(BYTE_SPECIAL_TOKENS)  # the byte tokenizer of the random-weight models


class VocabularyMismatch(ValueError):
    """The tokenizer knows more ids than the model has rows for."""


def check_vocabularies(tokenizer_vocab_size: int, model_vocab_size: int, tokenizer_origin: str,
                       model_origin: str) -> None:
    """Raises VocabularyMismatch, naming both vocabularies and where each comes from, when the
    tokenizer is larger than the model; a larger model (padding) passes."""
    if tokenizer_vocab_size > model_vocab_size:
        raise VocabularyMismatch(
            f"the tokenizer ({tokenizer_origin}) has {tokenizer_vocab_size} ids but the model ({model_origin}) "
            f"has vocab_size {model_vocab_size}: ids {model_vocab_size}..{tokenizer_vocab_size - 1} would have no "
            "embedding; a model vocabulary may be larger than its tokenizer's (padding), never smaller")


def byte_vocab_problem(declared: object) -> str | None:
    """Why a random-weight model's declared `vocab_size` does not fit the byte tokenizer it is
    served with (None when it fits: exactly `BYTE_VOCAB_SIZE`)."""
    if type(declared) is int and declared == BYTE_VOCAB_SIZE:
        return None
    return (f"a random-weight model (no model.path) is served with the byte tokenizer, which has "
            f"{BYTE_VOCAB_SIZE} ids ({NUM_BYTES} bytes + {len(BYTE_SPECIAL_TOKENS)} special tokens); "
            f"declare vocab_size: {BYTE_VOCAB_SIZE} in model.architecture (got vocab_size {_brief(declared)}), "
            "or give model.path a checkpoint with its own tokenizer")


def _brief(value: object) -> str:
    """A short spelling of `value` built without a long repr (a 5,000-digit integer, a 1 MB string)."""
    if type(value) is int:
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    return f"a {type(value).__name__}"
