"""The Hugging Face tokenizer files of a GGUF file's `tokenizer.ggml.*` metadata.

Writes tokenizer.json (built with the `tokenizers` library), tokenizer_config.json
(special tokens, BOS/EOS flags, the chat template) and generation_config.json
(BOS/EOS/pad ids, end-of-turn ids as extra stops).

Two tokenizer kinds (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE from the file's merges (SmolLM2, Qwen2, Llama 3);
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral), as llama.cpp
  runs it: spaces become "▁", every text piece gets a leading "▁" (also the
  text after a special token, as SentencePiece encodes each piece on its own), the
  adjacent pair whose joined piece scores highest merges first, and a character
  outside the vocabulary becomes its UTF-8 bytes' `<0xXX>` tokens. The merges
  come from `tokenizer.ggml.scores` when the file has none. transformers' own
  GGUF loader differs in one place: it puts the leading "▁" only at the very
  start of the text, not after special tokens.

Guarantees: the vocabulary keeps the GGUF's token ids; control tokens become
special added tokens (never split, skippable on decode); a tokenizer model or
pre-tokenizer that pdkv cannot reproduce exactly is refused, naming the key.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # gguf.TokenType values
SUPPORTED_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
SPACE = "\u2581"  # SentencePiece's visible space

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
    if model not in SUPPORTED_MODELS:
        kinds = ", ".join(f"{k!r} ({v})" for k, v in SUPPORTED_MODELS.items())
        raise GGUFTokenizerError(f"tokenizer.ggml.model: {model!r} is not supported (one of {kinds})")
    tokens: list[str] = get("tokenizer.ggml.tokens", None)
    if not tokens:
        raise GGUFTokenizerError("tokenizer.ggml.tokens: missing")
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
    # llama.cpp adds a BOS to a SentencePiece vocabulary whose file does not say otherwise
    add_bos = bool(get("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
    if add_bos and ids["bos"] is None:
        raise GGUFTokenizerError("tokenizer.ggml.add_bos_token: true but tokenizer.ggml.bos_token_id is missing")
    if add_eos and ids["eos"] is None:
        raise GGUFTokenizerError("tokenizer.ggml.add_eos_token: true but tokenizer.ggml.eos_token_id is missing")

    if model == "gpt2":
        tokenizer = _byte_level_bpe(get, tokens)
        special_kinds: tuple[int, ...] = (CONTROL,)
    else:
        tokenizer = _sentencepiece_bpe(get, tokens, types, ids)
        special_kinds = (CONTROL, UNKNOWN)  # llama.cpp matches <unk> in the text whole, as a control token
    _add_special_tokens(tokenizer, tokens, types, special_kinds, ids, add_bos, add_eos, model == "gpt2")
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


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise GGUFTokenizerError(f"tokenizer.ggml.merges[{i}]: {merge!r} is not 'left right'")
        pairs.append((left, right))
    return pairs


def _byte_level_bpe(get: Callable[[str, Any], Any], tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre = get("tokenizer.ggml.pre", None)
    if pre not in SUPPORTED_PRE:
        raise GGUFTokenizerError(f"tokenizer.ggml.pre: {pre!r} is not supported (one of {list(SUPPORTED_PRE)})")
    merges: list[str] = get("tokenizer.ggml.merges", None)
    if not merges:
        raise GGUFTokenizerError("tokenizer.ggml.merges: missing")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Byte-level BPE covers every byte, so no unknown token is ever needed.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(merges), unk_token=None, fuse_unk=False,
                                     byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(get: Callable[[str, Any], Any], tokens: list[str], types: list[int],
                       ids: dict[str, int | None]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    merges: list[str] | None = get("tokenizer.ggml.merges", None)
    if merges:
        pairs = _merge_pairs(merges)
    else:
        scores: list[float] | None = get("tokenizer.ggml.scores", None)
        if not scores:
            raise GGUFTokenizerError("tokenizer.ggml.scores: missing (a 'llama' tokenizer without "
                                     "tokenizer.ggml.merges needs the scores to rank its merges)")
        if len(scores) != len(tokens):
            raise GGUFTokenizerError(f"tokenizer.ggml.scores: {len(scores)} entries for {len(tokens)} tokens")
        pairs = _merges_from_scores(tokens, scores, types)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = tokens[ids["unknown"]] if ids["unknown"] is not None else None
    missing_bytes = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing_bytes and unk is None:
        raise GGUFTokenizerError(f"tokenizer.ggml.unknown_token_id: missing, and the vocabulary lacks the byte "
                                 f"token <0x{missing_bytes[0]:02X}>: some text would have no token")
    # A character outside the vocabulary becomes its bytes' <0xXX> tokens (unk if one is missing).
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer runs on each text piece between special tokens, so each piece gets its own
    # leading space, as llama.cpp and SentencePiece (one piece at a time) do.
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    tokenizer.pre_tokenizer = None  # SentencePiece merges across the whole piece: no word split
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the added leading space is not part of the text
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges that replay SentencePiece's rule "join the adjacent pair whose joined piece is in the
    vocabulary with the highest score": every split of a normal token into two vocabulary pieces,
    best joined score first (ties by token id)."""
    pieces = {tok for tok, kind in zip(tokens, types, strict=True) if kind == NORMAL}
    ranked = []
    for token_id, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer, tokens: list[str], types: list[int], special_kinds: tuple[int, ...],
                        ids: dict[str, int | None], add_bos: bool, add_eos: bool, byte_level: bool) -> None:
    from tokenizers import AddedToken, processors

    if add_bos or add_eos:
        on_ids = {n: tid for n, on in (("bos", add_bos), ("eos", add_eos)) if on and (tid := ids[n]) is not None}
        bos = f"{tokens[on_ids['bos']]}:0 " if add_bos else ""
        eos = f" {tokens[on_ids['eos']]}:0" if add_eos else ""
        specials = [(tokens[i], i) for i in on_ids.values()]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos}$B:1{eos}",
            special_tokens=specials)
    elif byte_level:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types, strict=True) if k in special_kinds]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.tokens: added tokens changed the vocabulary size")
