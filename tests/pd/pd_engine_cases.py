"""Tiny models, engine configs and prompt sets shared by the engine tests."""
import random

from pd.engine.config import EngineConfig, ModelConfig

FULL_MODEL = ModelConfig(num_layers=2)
HYBRID_MODEL = ModelConfig(num_layers=3, layer_types=("full_attention", "sliding_attention", "full_attention"),
                           sliding_window=12)
MODELS = {"full": FULL_MODEL, "hybrid": HYBRID_MODEL}


def engine_config(model: ModelConfig, **kw) -> EngineConfig:
    defaults = dict(model=model, seed=11, block_size=4, num_blocks=1200, max_num_batched_tokens=512, max_num_seqs=64)
    defaults.update(kw)
    return EngineConfig(**defaults)


def mixed_prompts(n: int = 32, lo: int = 1, hi: int = 150, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"req{i}": [rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for i in range(n)}
