"""Prompts for `pd.loadgen`: datasets and the tokenizer that measures prompt lengths.

Datasets (names as `vllm bench serve` spells them where vLLM has one):
- `random`: prompts of `--random-input-len` tokens (+ `--random-prefix-len` shared
  tokens), outputs of `--random-output-len`, both drawn uniformly from
  [len*(1-r), len*(1+r)] with r = `--random-range-ratio`;
- `prefix_repetition`: `--prefix-repetition-num-prefixes` shared prefixes of
  `--prefix-repetition-prefix-len` tokens, each prompt one of them plus a
  `--prefix-repetition-suffix-len` suffix;
- `sharegpt`: a ShareGPT-format JSON file (`--dataset-path`): a list of
  `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`;
  the first turn is the prompt, the second's length the output length
  (or `--sharegpt-output-len`);
- `custom`: JSONL, one `{"prompt": ..., "output_tokens": N}` per line;
- `multi_turn` (pdkv): conversations of `--multi-turn-num-turns` turns; each
  turn resends the whole history, so later turns hit the prefix cache.

Lengths are counted with `--tokenizer DIR` (a Hugging Face tokenizer directory,
read with the `tokenizers` library from its `tokenizer.json`) or, without one,
with pdkv's byte tokenizer (one token per UTF-8 byte plus BOS).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import string
from pathlib import Path
from typing import Protocol

DATASET_NAMES = ("random", "prefix_repetition", "sharegpt", "custom", "multi_turn")
_WORDS = ["".join(random.Random(i).choices(string.ascii_lowercase, k=1 + i % 7)) for i in range(512)]


class LengthTokenizer(Protocol):
    """What the datasets need from a tokenizer: count a prompt's tokens, cut it to a count."""

    name: str

    def count(self, text: str) -> int: ...

    def truncate(self, text: str, num_tokens: int) -> str: ...


class ByteLengths:
    """pdkv's byte tokenizer: one token per UTF-8 byte, plus BOS."""

    name = "pdkv-byte"

    def count(self, text: str) -> int:
        return len(text.encode()) + 1

    def truncate(self, text: str, num_tokens: int) -> str:
        return text.encode()[:max(0, num_tokens - 1)].decode(errors="ignore")


class HFLengths:
    """A Hugging Face tokenizer directory (its `tokenizer.json`), via the `tokenizers` library."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        path = Path(directory)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
        self._tok = Tokenizer.from_file(str(path))
        self.name = str(directory)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text).ids)

    def truncate(self, text: str, num_tokens: int) -> str:
        for _ in range(4):  # re-encoding a cut can merge or split a token: converge in a few steps
            enc = self._tok.encode(text)
            if len(enc.ids) <= num_tokens:
                return text
            ends = [end for (_, end), special in zip(enc.offsets, enc.special_tokens_mask, strict=True) if not special]
            excess = len(enc.ids) - num_tokens
            if excess >= len(ends):
                return ""
            text = text[:ends[len(ends) - 1 - excess]]
        return text


def load_tokenizer(directory: str | None) -> LengthTokenizer:
    return HFLengths(directory) if directory else ByteLengths()


@dataclasses.dataclass
class SampleRequest:
    """One request to send: a prompt (completions) or messages (chat), with its lengths.

    `conversation` / `turn` are set for `multi_turn`: turn k of a conversation
    is sent only after turn k-1 answered, with that answer in its history."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    messages: list[dict] | None = None
    conversation: int | None = None
    turn: int = 0


def _text(rng: random.Random, tok: LengthTokenizer, num_tokens: int) -> str:
    """Random words measuring `num_tokens` tokens with `tok` (BOS included)."""
    if num_tokens <= 1:
        return ""
    words, num_chars = [], 0
    while num_chars < 8 * num_tokens:  # enough characters for any tokenizer; cut below
        words.append(rng.choice(_WORDS))
        num_chars += len(words[-1]) + 1
    text = tok.truncate(" ".join(words), num_tokens)
    return text[:-1] + "a" if text.endswith(" ") else text  # a cut at a word's end: keep the length


def _lengths(rng: random.Random, base: int, ratio: float) -> int:
    lo, hi = max(1, math.floor(base * (1 - ratio))), max(1, math.ceil(base * (1 + ratio)))
    return rng.randint(lo, hi)


def _random(args, rng: random.Random, tok: LengthTokenizer) -> list[SampleRequest]:
    prefix = _text(rng, tok, args.random_prefix_len + 1) if args.random_prefix_len else ""
    out = []
    for _ in range(args.num_prompts):
        body = _text(rng, tok, _lengths(rng, args.random_input_len, args.random_range_ratio) + 1)
        prompt = f"{prefix} {body}" if prefix else body
        out.append(SampleRequest(prompt, tok.count(prompt),
                                 _lengths(rng, args.random_output_len, args.random_range_ratio)))
    return out


def _prefix_repetition(args, rng: random.Random, tok: LengthTokenizer) -> list[SampleRequest]:
    prefixes = [_text(rng, tok, args.prefix_repetition_prefix_len + 1)
                for _ in range(args.prefix_repetition_num_prefixes)]
    out = []
    for i in range(args.num_prompts):
        suffix = _text(rng, tok, args.prefix_repetition_suffix_len + 1)
        prompt = f"{prefixes[i % len(prefixes)]} {suffix}" if suffix else prefixes[i % len(prefixes)]
        out.append(SampleRequest(prompt, tok.count(prompt), args.prefix_repetition_output_len))
    rng.shuffle(out)
    return out


def _sharegpt(args, rng: random.Random, tok: LengthTokenizer) -> list[SampleRequest]:
    path = _require_path(args)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not JSON ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations")
    rows = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
            continue
        prompt, answer = str(turns[0].get("value") or ""), str(turns[1].get("value") or "")
        output_len = args.sharegpt_output_len or tok.count(answer) - 1
        if prompt and output_len >= 1:
            rows.append(SampleRequest(prompt, tok.count(prompt), output_len))
    if not rows:
        raise ValueError(f"--dataset-path {path}: no conversation with a prompt and an answer")
    if not args.disable_shuffle:
        rng.shuffle(rows)
    return [dataclasses.replace(rows[i % len(rows)]) for i in range(args.num_prompts)]


def _custom(args, rng: random.Random, tok: LengthTokenizer) -> list[SampleRequest]:
    path = _require_path(args)
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: each line must be an object with a string 'prompt'")
        output_len = int(item.get("output_tokens") or args.random_output_len)
        rows.append(SampleRequest(item["prompt"], tok.count(item["prompt"]), output_len))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [dataclasses.replace(rows[i % len(rows)]) for i in range(args.num_prompts)]


def _multi_turn(args, rng: random.Random, tok: LengthTokenizer) -> list[SampleRequest]:
    """Each turn's own user text; the history is added when the turn is sent."""
    num_turns = args.multi_turn_num_turns
    out = []
    for i in range(args.num_prompts):
        text = _text(rng, tok, _lengths(rng, args.random_input_len, args.random_range_ratio) + 1)
        out.append(SampleRequest(text, tok.count(text), _lengths(rng, args.random_output_len, args.random_range_ratio),
                                 conversation=i // num_turns, turn=i % num_turns))
    return out


def _require_path(args) -> Path:
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    path = Path(args.dataset_path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {path}: no such file")
    return path


_BUILDERS = {"random": _random, "prefix_repetition": _prefix_repetition, "sharegpt": _sharegpt,
             "custom": _custom, "multi_turn": _multi_turn}


def make_dataset(args, tok: LengthTokenizer) -> list[SampleRequest]:
    """`args.num_prompts` requests from the dataset `args.dataset_name`, seeded by `args.seed`."""
    if args.dataset_name in ("random", "prefix_repetition", "multi_turn") and args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} takes no --dataset-path")
    return _BUILDERS[args.dataset_name](args, random.Random(args.seed), tok)


def render_history(history: list[dict]) -> str:
    """A chat history as one completions prompt (for `multi_turn` on the completions backend)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in history) + "\nassistant:"
