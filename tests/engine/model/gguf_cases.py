"""Tiny GGUF files written the way llama.cpp's converter writes them (for the GGUF tests).

`write_gguf` takes a transformers Llama/Qwen2 model and a byte-level BPE
tokenizer and writes a GGUF file: llama.cpp's tensor names, its Q/K row
permutation for the llama architecture (`llama_cpp_permute`, the converter's
documented layout), Q8_0 FFN weights, and the `tokenizer.ggml.*` metadata.
`train_sentencepiece` makes a Llama-style SentencePiece vocabulary (pieces,
scores, piece types, as llama.cpp's converter reads them) for the "llama"
tokenizer kind; its `SentencePieceProcessor` is the reference encoder.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "In 2024 there were 365 days, 12 months and 52 weeks; 3.14159 is pi.",
    "Hello, world! Hello again, world. It's a small world, isn't it?",
    "def add(x, y):\n    return x + y  # adds two numbers\n",
    "Caf\u00e9 na\u00efve \u00fcber stra\u00dfe \u65e5\u672c\u8a9e \U0001f916 emoji.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def train_tokenizer(vocab_size: int = 330) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges as 'left right') of a byte-level BPE with SmolLM's digit split."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def hf_model(kind: str, vocab_size: int):
    """A tiny transformers Llama (tied embeddings) or Qwen2 model with deterministic, well-scaled weights."""
    import torch
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    if kind == "llama":
        config = transformers.LlamaConfig(**common, head_dim=16, tie_word_embeddings=True)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            scale = 1.0 if "embed" in name else (0.1 if param.ndim == 1 else param.shape[1] ** -0.5)
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(torch.randn(param.shape, generator=gen) * scale + offset)
    return model.eval()


SPM_CONTROL = ["<|user|>", "<|assistant|>"]  # extra control pieces, as chat vocabularies have


def train_sentencepiece(vocab_size: int = 420):
    """(processor, tokens, scores, token types) of a SentencePiece BPE trained like Llama's: byte
    fallback, identity normalisation, whitespace kept, a dummy prefix; ids 0/1/2 are <unk>/<s>/</s>."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, control_symbols=SPM_CONTROL, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]

    def kind(i: int) -> int:  # gguf.TokenType, as llama.cpp's converter maps SentencePiece's piece types
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 5 if sp.is_unused(i) else 1

    return sp, tokens, scores, [kind(i) for i in range(len(tokens))]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows (i, i + D/2) of the rotate-half layout become (2i, 2i + 1)."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path: Path, hf_model, tokens: list[str], merges: list[str], arch: str = "llama",
               extra_kv=None, extra_tensors: dict[str, np.ndarray] | None = None,
               tokenizer_model: str = "gpt2", pre: str | None = "smollm", scores: list[float] | None = None,
               token_types: list[int] | None = None, add_bos: bool = False) -> Path:
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types or [3 if t in SPECIALS else 1 for t in tokens])
    if scores is not None:
        writer.add_token_scores(scores)
    if merges:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)

    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
             "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    state = hf_model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        array = tensor.detach().float().numpy()
        parts = name.split(".")
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        elif parts[1] == "layers":
            gguf_name = f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"
        else:
            gguf_name = f"{names[parts[1]]}.{parts[2]}"
        if arch == "llama" and parts[-2] == "q_proj":
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and parts[-2] == "k_proj":
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if gguf_name.split(".")[-2].startswith("ffn_") and array.ndim == 2:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
