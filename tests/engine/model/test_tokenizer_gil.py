"""A long text is tokenized without holding the GIL, so the router's event loop runs meanwhile.

The router tokenizes large prompts on a pool thread (pd.router.completions); that frees its event loop
only if the tokenizer lets go of the GIL. `tokenizers`' `encode` keeps it for the whole text, its
`encode_batch` does not: `HFTokenizer.encode` takes the second for long texts, with the same ids.
"""
from __future__ import annotations

import threading
import time

from test_hf_tokenizer import CORPUS, checkpoint, llama_style, tok  # noqa: F401 - the fixtures

from pd.engine.text import tokenizer as tokenizer_module
from pd.engine.text.tokenizer import load_tokenizer

LONG = "".join(CORPUS) * 400  # about 90k characters


def test_long_texts_get_the_same_ids(tok, llama_style, monkeypatch):  # noqa: F811
    tokenizers = (tok, load_tokenizer(str(llama_style)))  # a post-processor's specials; add_bos_token's
    got = {(t.origin, special): t.encode(LONG, add_special_tokens=special)
           for t in tokenizers for special in (False, True)}
    monkeypatch.setattr(tokenizer_module, "_GIL_FREE_ENCODE_CHARS", 1 << 40)  # now every text goes through `encode`
    for t in tokenizers:
        for special in (False, True):
            assert got[t.origin, special] == t.encode(LONG, add_special_tokens=special), (t.origin, special)


def test_long_text_is_encoded_without_the_gil(tok):  # noqa: F811
    """While a thread encodes, this thread must keep running: its longest wait for the GIL stays far
    below the encoding's duration (with the GIL held, it waits the whole encoding)."""
    took: list[float] = []

    def encode() -> None:
        start = time.perf_counter()
        tok.encode(LONG)
        took.append(time.perf_counter() - start)

    for _ in range(2):  # the first call warms the tokenizer's caches
        worker = threading.Thread(target=encode)
        longest_wait, last = 0.0, time.perf_counter()
        worker.start()
        while worker.is_alive():
            time.sleep(0.001)
            now = time.perf_counter()
            longest_wait, last = max(longest_wait, now - last), now
        worker.join()
    assert longest_wait < took[-1] / 2, (longest_wait, took)
