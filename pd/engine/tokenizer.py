"""Tokenizers behind one small interface.

`ByteTokenizer` maps text to its UTF-8 bytes (ids 0-255) followed by named
special tokens (ids 256+). A real tokenizer can fill the same `Tokenizer`
protocol later. Prompts may also arrive as lists of token ids, which
`as_token_ids` validates against the vocabulary.
"""
from __future__ import annotations

from typing import Protocol, Sequence

DEFAULT_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<unk>")


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes plus special tokens.

    Guarantees: `decode(encode(s, add_bos=False)) == s` for every str `s`;
    ids are < `vocab_size`; decoding tolerates byte sequences cut mid-character
    (replacement character), so streaming partial outputs never raises.
    """

    NUM_BYTES = 256

    def __init__(self, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS):
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError("special tokens must be unique")
        self.special_tokens = tuple(special_tokens)
        self.special_ids = {name: self.NUM_BYTES + i for i, name in enumerate(self.special_tokens)}
        self.vocab_size = self.NUM_BYTES + len(self.special_tokens)
        self.bos_token_id = self.special_ids.get("<bos>")
        self.eos_token_id = self.special_ids.get("<eos>")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        pending = bytearray()
        for tok in token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"token id {tok} outside vocabulary of size {self.vocab_size}")
            if tok < self.NUM_BYTES:
                pending.append(tok)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(self.special_tokens[tok - self.NUM_BYTES])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    # --- MINIMAL STUB (openai branch): the real chat-template tokenizer lands from another branch;
    # the lead merges this with the real `render_chat`. Simple built-in template, no BOS in the text.
    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """`<|role|>\ncontent\n` per message, then `<|assistant|>\n` when a reply is wanted."""
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


# --- MINIMAL STUB (openai branch): the real `load_tokenizer` (checkpoint tokenizer.json / GGUF)
# comes from another branch; until the merge every path keeps today's byte tokenizer.
def load_tokenizer(path: str | None) -> ByteTokenizer:
    """The tokenizer for a model checkpoint at `path` (None: the random test model's ByteTokenizer)."""
    return ByteTokenizer()


def as_token_ids(prompt: str | Sequence[int], tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """A prompt given as text or as token ids -> validated token ids."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} outside vocabulary of size {vocab_size}")
    return ids
