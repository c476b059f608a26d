"""Incremental detokenisation with stop strings, for streamed completions.

`TextStream` receives token ids as they arrive and hands out the text that is
safe to show: text that cannot be the start of a stop string and does not end
in a cut UTF-8 character.

Guarantees: the concatenation of everything `push` and `flush` return equals
the final completion text: the full decoded output, cut just before the first
stop string when one appears (the stop string itself is never shown);
after a stop string is found, `stopped` is True and further pushes return "".
"""
from __future__ import annotations

from collections.abc import Sequence

from pd.engine.tokenizer import Tokenizer

_CUT_CHAR = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self._num_emitted = 0  # characters of the decoded text already handed out
        self.stopped = False
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    def push(self, token_ids: Sequence[int]) -> str:
        """New safe text after appending `token_ids`."""
        if self.stopped:
            return ""
        self._token_ids.extend(token_ids)
        text = self._tokenizer.decode(self._token_ids)
        if self._stop:
            start = max(0, self._num_emitted - self._hold)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit(text[: min(hits)])
        safe = len(text)
        while safe > self._num_emitted and text[safe - 1] == _CUT_CHAR:
            safe -= 1  # maybe a character cut mid-bytes: wait for the rest
        safe = max(self._num_emitted, safe - self._hold)
        return self._emit(text[:safe])

    def flush(self) -> str:
        """Everything still held back, once the output is complete."""
        if self.stopped:
            return ""
        return self._emit(self._tokenizer.decode(self._token_ids))

    def _emit(self, text: str) -> str:
        new = text[self._num_emitted:]
        self._num_emitted = len(text)
        self.text = text
        return new
