"""pdkv's engine against Hugging Face `generate()`, side by side, on the same weights and prompts.

`side_by_side` runs interleaved rounds of one batch through each (best of N, on the
wall clock and on process CPU time) and compares their greedy tokens. `bench_vs_hf_model`
does it for a real checkpoint (`--model PATH`, any spelling `model.path` accepts in a
deploy YAML): the engine is built by the worker's own wiring (`engine_config_for`, so
block size, dtype and attention backend are the serving defaults) and transformers loads
the same weights from the same directory (for a GGUF: its cached Hugging Face conversion).
"""
from __future__ import annotations

import time

import torch

from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams

# Chat questions of varied length (rendered with the checkpoint's own chat template).
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Explain photosynthesis in simple words.",
    "What is 17 times 23?",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water at sea level, in Celsius and in Fahrenheit?",
    "Give me a short recipe for pancakes.",
    "What does a CPU do in a computer, and how is it different from a GPU?",
    "Translate 'good morning' into Spanish, French and German.",
    "What is the difference between weather and climate?",
    "List the planets of the solar system in order from the sun.",
    "How do vaccines help the immune system fight disease?",
    "Summarize the plot of Cinderella in two sentences.",
    "What is a prime number? Give five examples.",
    "Why do we have seasons on Earth?",
    "Suggest a name for a small bakery that sells bread and coffee in a mountain village.",
    "What is the largest ocean?",
    "How does a bicycle stay upright when it is moving?",
    "Explain what a black hole is to a ten-year-old child who loves space and rockets.",
    "What are the health benefits of drinking water?",
    "Write one sentence about the ocean.",
    "What is machine learning? Answer in a short paragraph with one everyday example.",
    "How many minutes are there in a day?",
    "Why do cats purr?",
    "Describe the water cycle step by step: evaporation, condensation, precipitation and collection.",
    "What language is spoken in Brazil?",
    "Give three tips for studying effectively before an exam, and explain why each one works.",
    "What is the tallest mountain in the world, and in which mountain range is it?",
    "Hello! How are you today?",
)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
PHASES = ("ours_prefill", "ours_decode", "hf_first", "hf_total")


def side_by_side(eng: Engine, hf, prompts: dict[str, list[int]], pad_id: int, max_new: int, rounds: int) -> dict:
    """Interleaved rounds of `prompts` (greedy, `max_new` tokens each, EOS ignored) through
    `eng` and `hf`; the best time of each phase and both sides' tokens of the last round.

    HF's decode time is generate(max_new) minus generate(1) on the same left-padded batch.
    """
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    ids = list(prompts.values())
    width = max(len(p) for p in ids)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    hf.generation_config.eos_token_id = None  # like ignore_eos: every request makes max_new tokens
    gen_kw = dict(do_sample=False, pad_token_id=pad_id)
    # warm-up both (first calls allocate, pick kernels, build the C++ decode kernel)
    eng.generate_sync({"warm": ids[0][:16]}, SamplingParams(max_tokens=4, ignore_eos=True))
    with torch.inference_mode():
        hf.generate(input_ids=input_ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=4, **gen_kw)
    # Interleaved rounds, best of each: other processes on the machine slow either side at random.
    # Wall time and process CPU time are both kept: the CPU time does not count the moments other
    # processes held the cores, so it is the steadier figure on a shared box.
    best = {(c, k): float("inf") for c in CLOCKS for k in PHASES}
    for r in range(rounds):
        ours: dict[str, list[int]] = {rid: [] for rid in prompts}
        for rid, p in prompts.items():
            eng.add_request(f"{rid}@{r}", p, params)
        t0 = {c: f() for c, f in CLOCKS.items()}
        while any(not toks for toks in ours.values()):  # prefill phase: until every request has its first token
            for o in eng.step():
                ours[o.request_id.split("@")[0]].extend(o.new_token_ids)
        t1 = {c: f() for c, f in CLOCKS.items()}
        while eng.has_unfinished_requests():  # decode phase
            for o in eng.step():
                ours[o.request_id.split("@")[0]].extend(o.new_token_ids)
        t2 = {c: f() for c, f in CLOCKS.items()}
        with torch.inference_mode():
            h0 = {c: f() for c, f in CLOCKS.items()}
            hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=1, **gen_kw)
            h1 = {c: f() for c, f in CLOCKS.items()}
            out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new, **gen_kw)
            h2 = {c: f() for c, f in CLOCKS.items()}
        for c in CLOCKS:
            for key, value in (("ours_prefill", t1[c] - t0[c]), ("ours_decode", t2[c] - t1[c]),
                               ("hf_first", h1[c] - h0[c]), ("hf_total", h2[c] - h1[c])):
                best[(c, key)] = min(best[(c, key)], value)
    hf_tokens = dict(zip(prompts, out[:, width:].tolist(), strict=True))
    return {"best": best, "ours": ours, "hf": hf_tokens}


def summarize(run: dict, num_requests: int, max_new: int, rounds: int, prompt_lens: str) -> dict:
    """Decode and end-to-end tokens/s of both sides, their ratios, and how many greedy outputs agree."""
    best, ours, hf_tokens = run["best"], run["ours"], run["hf"]
    same = sum(ours[rid] == hf_tokens[rid] for rid in ours)
    total = num_requests * max_new
    decoded = num_requests * (max_new - 1)
    result = {"num_requests": num_requests, "prompt_lens": prompt_lens, "max_new_tokens": max_new,
              "greedy_outputs_identical": f"{same}/{num_requests}", "rounds": rounds}
    for c in CLOCKS:
        ours_e2e = best[(c, "ours_prefill")] + best[(c, "ours_decode")]
        hf_decode_s = max(best[(c, "hf_total")] - best[(c, "hf_first")], 1e-9)  # generate(N) minus generate(1)
        result[c] = {
            "ours_decode_tokens_per_s": decoded / best[(c, "ours_decode")],
            "hf_decode_tokens_per_s": decoded / hf_decode_s,
            "decode_ratio": hf_decode_s / best[(c, "ours_decode")],
            "ours_e2e_tokens_per_s": total / ours_e2e, "hf_e2e_tokens_per_s": total / best[(c, "hf_total")],
            "e2e_ratio": best[(c, "hf_total")] / ours_e2e, "ours_s": ours_e2e, "hf_s": best[(c, "hf_total")],
        }
    return result


def divergences(hf, prompts: dict[str, list[int]], ours: dict[str, list[int]], theirs: dict[str, list[int]],
                limit: int = 8) -> list[dict]:
    """For each request whose greedy tokens differ (at most `limit`): the first differing position
    and HF's top-1 minus top-2 logit there (a margin near 0 is a float32 near-tie, not a bug)."""
    found: list[dict] = []
    for rid, mine in ours.items():
        other = theirs[rid]
        pos = next((i for i, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b), None)
        if pos is None:
            continue
        entry = {"request": rid, "first_divergence": pos, "pdkv_token": mine[pos], "hf_token": other[pos]}
        if len(found) < limit:
            with torch.inference_mode():
                logits = hf(input_ids=torch.tensor([prompts[rid] + other[:pos]])).logits[0, -1].float()
            top = logits.topk(2)
            entry["hf_top1_top2_margin"] = float(top.values[0] - top.values[1])
            entry["hf_logit_gap_hf_vs_pdkv_token"] = float(logits[other[pos]] - logits[mine[pos]])
        found.append(entry)
    return found


def serving_engine(model_path: str, num_requests: int) -> Engine:
    """An engine for `model_path` built exactly as a colocated worker builds it (pd.worker.wiring),
    with the deploy-config defaults: block size 16, float32, attention_backend auto. Prefix caching
    is off so that later rounds prefill as much as the first (decode is unaffected either way)."""
    from pd.cluster.config import DeployConfig
    from pd.cluster.roles import Role
    from pd.worker.wiring import engine_config_for
    from pd.worker.worker import WorkerSpec

    config = DeployConfig.from_dict({
        "model": {"path": model_path, "name": "bench"},
        "cache": {"kv_memory_mb": 512, "enable_prefix_caching": False},
        "scheduler": {"max_num_seqs": num_requests, "max_num_batched_tokens": 1024, "max_model_len": 2048},
        "topology": {"mode": "colocated"},
    })
    return Engine(engine_config_for(WorkerSpec("bench", Role.BOTH, config, "bench-secret-0123456789")))


def bench_vs_hf_model(model_path: str, num_requests: int, max_new: int, rounds: int) -> dict:
    """`side_by_side` on a real checkpoint with chat-rendered questions; see the module docstring."""
    from transformers import AutoModelForCausalLM  # optional extra: pip install 'pdkv[bench]'

    from pd.engine.model.gguf import resolve_checkpoint
    from pd.engine.text.tokenizer import load_tokenizer

    hf_dir = resolve_checkpoint(model_path)  # a GGUF: its cached Hugging Face conversion (made once)
    tokenizer = load_tokenizer(model_path)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_requests)]
    prompts = {f"q{i}": tokenizer.encode_chat([{"role": "user", "content": q}]) for i, q in enumerate(questions)}
    eng = serving_engine(model_path, num_requests)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    try:
        run = side_by_side(eng, hf, prompts, pad_id, max_new, rounds)
        backend = eng.runner.description
    finally:
        eng.shutdown()
    lens = [len(p) for p in prompts.values()]
    result = summarize(run, num_requests, max_new, rounds, f"{min(lens)}-{max(lens)}")
    result.update({"model_path": model_path, "hf_dir": str(hf_dir), "attention_backend": backend,
                   "torch_threads": torch.get_num_threads(),
                   "divergences": divergences(hf, prompts, run["ours"], run["hf"])})
    return result
