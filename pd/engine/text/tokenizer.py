"""Tokenizers behind one small interface, and the loader that picks one.

`ByteTokenizer` maps text to its UTF-8 bytes (ids 0-255) followed by named
special tokens (ids 256+); it serves the random-weight test models.
`HFTokenizer` reads a Hugging Face checkpoint directory (`tokenizer.json`,
`tokenizer_config.json`, `generation_config.json`, `chat_template.jinja`)
through the `tokenizers` library. `load_tokenizer` is the one way router and
workers build either, so both sides agree on ids, stop ids and chat prompts.
Prompts may also arrive as lists of token ids, which `valid_token_ids` validates;
`text_tokenizer` is what an engine encodes text prompts with (the checkpoint's own).
"""
from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Sequence

from pd.engine.text.chat_template import ChatTemplate, ChatTemplateError
from pd.engine.text.vocab import BYTE_SPECIAL_TOKENS, NUM_BYTES

DEFAULT_SPECIAL_TOKENS = BYTE_SPECIAL_TOKENS

# Our own template for the byte-level test models: plain text markers, no special-token strings
# (the byte tokenizer encodes text as bytes only; `encode_chat` adds the BOS id itself).
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation (the checkpoint's stop ids)
    special_token_ids: frozenset[int]  # ids that `decode(..., skip_special_tokens=True)` drops

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes plus special tokens.

    Guarantees: `decode(encode(s, add_special_tokens=False)) == s` for every
    str `s`; ids are < `vocab_size`; decoding tolerates byte sequences cut
    mid-character (replacement character), so decoding partial outputs never raises.
    """

    NUM_BYTES = NUM_BYTES

    def __init__(self, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS):
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError("special tokens must be unique")
        self.special_tokens = tuple(special_tokens)
        self.special_ids = {name: self.NUM_BYTES + i for i, name in enumerate(self.special_tokens)}
        self.special_token_ids = frozenset(self.special_ids.values())
        self.vocab_size = self.NUM_BYTES + len(self.special_tokens)
        self.bos_token_id = self.special_ids.get("<bos>")
        self.eos_token_id = self.special_ids.get("<eos>")
        self.eos_token_ids: tuple[int, ...] = () if self.eos_token_id is None else (self.eos_token_id,)
        self.chat_template = ChatTemplate(BYTE_CHAT_TEMPLATE, {}, origin="ByteTokenizer")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
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

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=True)


_GIL_FREE_ENCODE_CHARS = 16 * 1024  # texts this long are encoded without holding the GIL
_SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class HFTokenizer:
    """A checkpoint directory's own tokenizer, special tokens, stop ids and chat template.

    Guarantees: ids from `encode` are < `vocab_size`; `decode` raises
    ValueError for ids outside the vocabulary and otherwise never raises
    (a cut UTF-8 character decodes to U+FFFD); `eos_token_ids` holds
    `generation_config.json`'s `eos_token_id` (int or list; `config.json`'s
    when there is no generation config) plus the tokenizer's EOS token;
    `encode(text)` adds BOS/EOS as transformers does (`tokenizer.json`'s
    post-processor; the config's `add_bos_token` / `add_eos_token` flags when
    it has none); `encode_chat` adds none, since chat templates write their own.
    """

    def __init__(self, backend: Any, config: dict, stop_ids: Sequence[int], chat_template: str | None,
                 origin: str = "checkpoint"):
        self._backend = backend
        self.origin = origin
        added = backend.get_added_tokens_decoder()
        self.vocab_size = max([backend.get_vocab_size(with_added_tokens=True)] + [i + 1 for i in added])
        texts = {field: _token_text(config.get(field), field) for field in _SPECIAL_TOKEN_FIELDS}
        self.special_tokens = {k: v for k, v in texts.items() if v is not None}
        named = {field: self._token_id(text, field) for field, text in self.special_tokens.items()}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, dict):
            extra = list(extra.values())
        extra_ids = {self._token_id(_token_text(t, "additional_special_tokens") or "", "additional_special_tokens")
                     for t in extra}
        self.special_token_ids = frozenset({i for i, t in added.items() if t.special} | set(named.values())
                                           | extra_ids)
        self.bos_token_id = named.get("bos_token")
        self.eos_token_id = named.get("eos_token")
        stops = list(dict.fromkeys(stop_ids))
        if self.eos_token_id is not None and self.eos_token_id not in stops:
            stops.append(self.eos_token_id)
        if self.eos_token_id is None and stops:
            self.eos_token_id = stops[0]
        bad = [i for i in stops if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{origin}: eos_token_id {bad} outside the tokenizer's vocabulary of {self.vocab_size}")
        self.eos_token_ids = tuple(stops)
        # As transformers 5 does, tokenizer.json's post-processor decides which special tokens `encode` adds;
        # the add_bos_token / add_eos_token flags only fill in for a tokenizer.json without one.
        self._explicit_bos_eos = backend.post_processor is None and (
            "add_bos_token" in config or "add_eos_token" in config)
        self.add_bos_token = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.add_eos_token = bool(config.get("add_eos_token", False)) and self.eos_token_id is not None
        self.chat_template = (None if chat_template is None
                              else ChatTemplate(chat_template, self.special_tokens, origin=f"{origin} chat template"))

    def _token_id(self, text: str, field: str) -> int:
        token_id = self._backend.token_to_id(text)
        if token_id is None:
            raise ValueError(f"{self.origin}: tokenizer_config.json {field} {text!r} is not in tokenizer.json")
        return token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer as Backend

        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"model.path {root}: missing tokenizer.json (needed for the tokenizer)")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception for a malformed file
            raise ValueError(f"{tokenizer_file}: not a valid tokenizers file: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")
        if "eos_token_id" in generation:
            stop_ids = _id_list(generation["eos_token_id"], root / "generation_config.json")
        else:
            stop_ids = _id_list(_read_json(root / "config.json").get("eos_token_id"), root / "config.json")
        return cls(backend, config, stop_ids, _chat_template_source(root, config), origin=str(root))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if not self._explicit_bos_eos:
            return self._encode_ids(text, add_special_tokens)
        ids: list[Any] = self._encode_ids(text, False)  # the ids below are set whenever their flag is
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token:
            ids.append(self.eos_token_id)
        return ids

    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < _GIL_FREE_ENCODE_CHARS:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        # `encode_batch` runs without the GIL (`encode` holds it): a long text tokenized on a thread
        # then leaves the process's event loop free. Same ids either way.
        return list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside vocabulary of size {self.vocab_size}")
        if skip_special_tokens:  # our own filter: the config may name specials tokenizer.json does not flag
            ids = [t for t in ids if t not in self.special_token_ids]
        return self._backend.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.origin}: the checkpoint has no chat template (no chat_template.jinja "
                                    "and no chat_template in tokenizer_config.json)")
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def load_tokenizer(model_path: str | Path | None) -> Tokenizer:
    """The tokenizer for a model: `ByteTokenizer` without a checkpoint, else the directory's own."""
    if model_path is None:
        return ByteTokenizer()
    from pd.engine.model.files import locate_model

    path = locate_model(model_path)
    if path.is_dir():
        return HFTokenizer.from_dir(path)
    if path.is_file() and path.suffix == ".gguf":  # its tokenizer lives in the GGUF's metadata
        from pd.engine.model.gguf import resolve_checkpoint  # converts once into a cached directory

        return HFTokenizer.from_dir(Path(resolve_checkpoint(path)))
    if path.exists():
        raise ValueError(f"model.path {path}: expected a checkpoint directory with tokenizer.json or a .gguf "
                         "file, got another file")
    raise FileNotFoundError(f"model.path {path}: no such directory")


def _read_json(path: Path) -> dict:
    """An optional JSON config file: {} when absent, a clear error when malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _id_list(value: Any, origin: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{origin}: eos_token_id must be an int or a list of ints, got {value!r}")
    return list(values)


def _token_text(value: Any, field: str) -> str | None:
    """A special token as configs write it: a string, or an AddedToken object with `content`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json {field}: expected a string or an object with 'content', got {value!r}")


def _chat_template_source(root: Path, config: dict) -> str | None:
    """`chat_template.jinja` wins over `tokenizer_config.json`'s `chat_template`, as in transformers."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{root}: tokenizer_config.json chat_template: expected a string or a list of "
                     "{name, template} with a 'default' entry")


def valid_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` as a list of ints in [0, vocab_size), converted once (a list of ints is kept as it is);
    ValueError for an empty prompt or an id outside the vocabulary."""
    if type(ids) is not list or not all(type(t) is int for t in ids):
        ids = [operator.index(t) for t in ids]  # ints (numpy's too), never a float cut to an int
    if not ids:
        raise ValueError("prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise ValueError(f"prompt token ids {bad[:5]} outside vocabulary of size {vocab_size}")
    return ids


def text_tokenizer(model_path: str | Path | None) -> Tokenizer:
    """The tokenizer an engine encodes text prompts with: the checkpoint's own (`load_tokenizer`), the
    byte tokenizer without a checkpoint; ValueError naming the checkpoint when it has none that loads."""
    try:
        return load_tokenizer(model_path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"a text prompt needs the checkpoint's tokenizer, and {model_path} has none that "
                         f"loads ({exc}); pass token ids, or give the engine a tokenizer") from exc
