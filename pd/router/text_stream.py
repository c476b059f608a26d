"""Incremental detokenisation with stop strings, for streamed completions.

`TextStream` receives token ids as they arrive and hands out the text that is
safe to show: text that does not end in a cut UTF-8 character and cannot be
the start of a stop string.

Each push decodes only a short window of tokens: the text of the new tokens
is `decode(window + new) minus decode(window)`, where the window starts at a
token boundary where everything before it decoded to whole characters. So
byte-level BPE pieces of one character wait for each other, a decoder that
treats the first token specially (leading-space stripping) sees the same first
token as a full decode, and the cost per push does not grow with the output.

Guarantees: the concatenation of everything `push` and `flush` return equals
the non-streamed completion text, whatever the split into pushes: the full
decoded output (special tokens skipped by default), cut just before the
earliest occurrence of any stop string (the stop string itself is never
shown); after a stop string is found, `stopped` is True and further pushes
return "". Text before the end never contains a replacement character that
completing a cut character would remove.

An id the tokenizer cannot decode (a worker whose model's padded vocabulary
was not masked, a peer of another version) shows as no text, as the
`tokenizers` library decodes an id it does not know, and is logged once per
stream: it never fails the request. `token_ids` still holds every id.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from pd.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_CUT_CHAR = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(dict.fromkeys(stop))
        self._stop_heads = frozenset(s[0] for s in self._stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._token_ids: list[int] = []
        self._text_ids: list[int] = []  # the ids the tokenizer decodes (all of them, unless a worker erred)
        self._num_unknown = 0
        # (these two index _text_ids)
        self._window_start = 0  # tokens before this decoded to whole characters and are in `_decoded`
        self._read_end = 0  # tokens before this have their text in `_decoded`
        self._decoded: list[str] = []  # confirmed text, in pieces
        self._pending = ""  # confirmed text not yet handed out (may start a stop string)
        self._emitted: list[str] = []
        self.stopped = False

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int]) -> str:
        """New safe text after appending `token_ids`."""
        if self.stopped:
            return ""
        self._token_ids.extend(token_ids)
        self._keep_known(token_ids)
        self._pending += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Everything still held back, once the output is complete (stop strings still apply)."""
        if self.stopped:
            return ""
        self._pending += self._decode_new(final=True)
        return self._release(final=True)

    def _keep_known(self, token_ids: Sequence[int]) -> None:
        vocab_size = self._tokenizer.vocab_size
        known = [t for t in token_ids if 0 <= t < vocab_size]
        if len(known) != len(token_ids):
            if not self._num_unknown:
                bad = next(t for t in token_ids if not 0 <= t < vocab_size)
                logger.warning("token id %d is outside the tokenizer's vocabulary of %d ids: shown as no text "
                               "(the worker should never sample it)", bad, vocab_size)
            self._num_unknown += len(token_ids) - len(known)
        self._text_ids.extend(known)

    @property
    def num_unknown(self) -> int:
        """Ids received that the tokenizer cannot decode (shown as no text)."""
        return self._num_unknown

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past `_read_end`, or "" while it may end in a cut character."""
        ids = self._text_ids
        if self._read_end == len(ids):
            return ""
        decode = self._tokenizer.decode
        before = decode(ids[self._window_start:self._read_end], self._skip_special)
        after = decode(ids[self._window_start:], self._skip_special)
        if not final and (after.endswith(_CUT_CHAR) or len(after) < len(before)):
            return ""  # a character cut mid-bytes: wait for the rest
        if not after.startswith(before):
            # the decoder rewrote the window's text; the full decode is the reference (rare, costs O(n))
            full = decode(ids, self._skip_special)
            shown = "".join(self._decoded)
            new = full[len(shown):] if full.startswith(shown) else ""
        else:
            new = after[len(before):]
        self._decoded.append(new)
        self._window_start, self._read_end = self._read_end, len(ids)
        return new

    def _release(self, final: bool) -> str:
        """Hand out pending text up to the first stop string, keeping back what may still start one."""
        pending = self._pending
        if self._stop:
            hit = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
            open_start = len(pending) if final else self._earliest_open_start(pending)
            if hit >= 0 and hit <= open_start:
                self.stopped = True
                return self._emit(pending[:hit], rest="")
            safe = open_start if hit < 0 else min(open_start, hit)
        else:
            safe = len(pending)
        return self._emit(pending[:safe], rest=pending[safe:])

    def _earliest_open_start(self, text: str) -> int:
        """The first index where a stop string could begin but not yet end (len(text) if none)."""
        for start in range(max(0, len(text) - self._longest_stop + 1), len(text)):
            if text[start] not in self._stop_heads:
                continue
            tail = text[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stop):
                return start
        return len(text)

    def _emit(self, out: str, rest: str) -> str:
        self._pending = rest
        if out:
            self._emitted.append(out)
        return out
