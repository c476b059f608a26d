"""The Hugging Face tokenizer files of a GGUF file's `tokenizer.ggml.*` metadata.

Writes tokenizer.json (built with the `tokenizers` library), tokenizer_config.json
(special tokens, BOS/EOS flags, the chat template) and generation_config.json
(BOS/EOS/pad ids, end-of-turn ids as extra stops).

Guarantees: the vocabulary keeps the GGUF's token ids; control tokens become
special added tokens (never split, skippable on decode); a tokenizer model or
pre-tokenizer that pdkv cannot reproduce exactly is refused, naming the key.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType values

# llama.cpp's pre-tokenizer names -> how to split before byte-level BPE.
#   gpt2:   the GPT-2 regex only;
#   smollm: digits one by one first (llama.cpp groups it with stablelm2/qwen2's "\p{N}" split), then GPT-2's regex.
SUPPORTED_PRE = ("gpt2", "smollm")


class GGUFTokenizerError(ValueError):
    """Tokenizer metadata pdkv cannot turn into an exact Hugging Face tokenizer; names the key."""


def write_tokenizer_files(get: Callable[[str, Any], Any], out_dir: Path, context_length: int | None) -> dict[str, Any]:
    """Writes the three files into `out_dir`; returns the special token ids
    ({"bos_token_id": ..., "eos_token_id": ..., "pad_token_id": ...}) for config.json.

    `get(key, default)` reads one GGUF metadata value.
    """
    model = get("tokenizer.ggml.model", None)
    if model != "gpt2":
        raise GGUFTokenizerError(f"tokenizer.ggml.model: {model!r} is not supported (only 'gpt2', byte-level BPE)")
    pre = get("tokenizer.ggml.pre", None)
    if pre not in SUPPORTED_PRE:
        raise GGUFTokenizerError(f"tokenizer.ggml.pre: {pre!r} is not supported (one of {list(SUPPORTED_PRE)})")
    tokens: list[str] = get("tokenizer.ggml.tokens", None)
    merges: list[str] = get("tokenizer.ggml.merges", None)
    if not tokens:
        raise GGUFTokenizerError("tokenizer.ggml.tokens: missing")
    if not merges:
        raise GGUFTokenizerError("tokenizer.ggml.merges: missing")
    types: list[int] = get("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"tokenizer.ggml.token_type: {len(types)} entries for {len(tokens)} tokens")
    if len(set(tokens)) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.tokens: duplicate token strings; ids would not round-trip")

    ids = {name: get(f"tokenizer.ggml.{name}_token_id", None)
           for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    for name, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GGUFTokenizerError(f"tokenizer.ggml.{name}_token_id: {token_id} outside the vocabulary")
    add_bos = bool(get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
    if add_bos and ids["bos"] is None:
        raise GGUFTokenizerError("tokenizer.ggml.add_bos_token: true but tokenizer.ggml.bos_token_id is missing")
    if add_eos and ids["eos"] is None:
        raise GGUFTokenizerError("tokenizer.ggml.add_eos_token: true but tokenizer.ggml.eos_token_id is missing")

    tokenizer = _build(tokens, merges, types, pre, ids, add_bos, add_eos)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def token(name: str) -> str | None:
        return tokens[ids[name]] if ids[name] is not None else None

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = get("tokenizer.chat_template", None)
    if template is not None:
        tokenizer_config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))

    special = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"]}
    stops = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    stops = list(dict.fromkeys(stops))
    generation = {k: v for k, v in special.items() if v is not None}
    if len(stops) > 1:
        generation["eos_token_id"] = stops  # end-of-turn tokens stop generation too
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return special


def _build(tokens: list[str], merges: list[str], types: list[int], pre: str, ids: dict[str, int | None],
           add_bos: bool, add_eos: bool):
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    pairs = []
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise GGUFTokenizerError(f"tokenizer.ggml.merges[{i}]: {merge!r} is not 'left right'")
        pairs.append((left, right))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Byte-level BPE covers every byte, so no unknown token is ever needed.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    if add_bos or add_eos:
        on_ids = {n: tid for n, on in (("bos", add_bos), ("eos", add_eos)) if on and (tid := ids[n]) is not None}
        bos = f"{tokens[on_ids['bos']]}:0 " if add_bos else ""
        eos = f" {tokens[on_ids['eos']]}:0" if add_eos else ""
        specials = [(tokens[i], i) for i in on_ids.values()]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos}$B:1{eos}",
            special_tokens=specials)
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.tokens: added tokens changed the vocabulary size")
    return tokenizer
