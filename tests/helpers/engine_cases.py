"""Tiny models, engine configs and prompt sets shared by the engine tests."""
import contextlib
import dataclasses
import random
from collections.abc import Iterator

import torch

from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig
from pd.engine.kv.layout import KVLayout
from pd.engine.model.llama import CausalLM, build_model
from pd.engine.kv.page_pool import PagePool
from pd.engine.runner.model_runner import ModelRunner

FULL_MODEL = ModelConfig(num_layers=2)
HYBRID_MODEL = ModelConfig(num_layers=3, layer_types=("full_attention", "sliding_attention", "full_attention"),
                           sliding_window=12)
MODELS = {"full": FULL_MODEL, "hybrid": HYBRID_MODEL}


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """torch's intra-op threads set to `n` for the block, then back to what they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def engine_config(model: ModelConfig, **kw) -> EngineConfig:
    """The engine the tests compare against: the torch reference backend unless `attention_backend` says
    otherwise (EngineConfig's own default, `auto`, is the fused CPU path where it is valid)."""
    defaults = dict(model=model, seed=11, block_size=4, num_blocks=1200, max_num_batched_tokens=512, max_num_seqs=64,
                    attention_backend="torch")
    defaults.update(kw)
    return EngineConfig(**defaults)


def mixed_prompts(n: int = 32, lo: int = 1, hi: int = 150, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"req{i}": [rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for i in range(n)}


@dataclasses.dataclass
class FusedRunnerCase:
    """A fused-backend runner over a seeded model, with random prompts, a disjoint block table per
    prompt (12 blocks of 4 tokens per group) and each prompt's dense reference logits."""

    model: CausalLM
    runner: ModelRunner
    prompts: list[list[int]]
    tables: list[tuple[list[int], ...]]
    refs: list[torch.Tensor]

    @classmethod
    def build(cls, cfg: ModelConfig, lengths: tuple[int, ...], seed: int) -> "FusedRunnerCase":
        model = build_model(cfg, seed=9)
        layout = KVLayout(cfg, 4)
        runner = ModelRunner(model, layout, PagePool(80, layout.page_size_bytes), attention_backend="fused")
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
        num_groups = len(layout.groups)
        tables = [tuple(list(range(1 + (i * num_groups + g) * 12, 13 + (i * num_groups + g) * 12))
                        for g in range(num_groups)) for i in range(len(lengths))]
        return cls(model, runner, prompts, tables, [model.reference_logits(p) for p in prompts])
