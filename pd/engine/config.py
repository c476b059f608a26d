"""Engine configuration: a frozen dataclass validated once (the model's shape is model/config.py)."""
from __future__ import annotations

import dataclasses

import torch

from pd.engine.attention.capabilities import DEFAULT_ATTENTION_BACKEND, check_choice
from pd.engine.model.config import DTYPES, ModelConfig

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


def check_device(device: str) -> None:
    """'cpu', 'cuda' or 'cuda:N', and a CUDA device must exist on this machine.

    Raises ValueError at config time, so a GPU deployment on a machine
    without CUDA fails at startup with this message, not inside a forward.
    """
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                             "use device 'cpu' or run on a GPU node")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights.

    Either `model_path` (a local HF-style directory or a .gguf file) or `model`
    (random init with `seed`) defines the model; `dtype`, when set, is the serving dtype
    of either (a checkpoint is converted on load). The page pool holds `num_blocks` pages
    when given, else as many as `kv_cache_bytes` allows.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    model_path: str | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_bytes: int = 64 * 1024 * 1024
    num_blocks: int | None = None
    max_model_len: int | None = None  # None: model.max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0  # >0: chunk prefills to at most this many tokens per step
    # a step's fixed cost, counted in prompt tokens (> 0): a burst of waiting prompts holding T tokens is
    # admitted about ceil(sqrt(T * it)) tokens a step, whole prompts, so its first prompts answer early
    # (pd/engine/sched/admission.py); 0: each step admits all that max_num_batched_tokens allows
    step_overhead_tokens: int = 0
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    full_sequence_must_fit: bool = False
    kv_load_failure_policy: str = "recompute"
    kv_audit_rate: float = 0.0  # share of landed remote loads whose last full block is recomputed (runner/kv_audit.py)
    kv_audit_tolerance: float | None = None  # the audit's max relative |difference|; 0: bitwise; None: by dtype
    hash_algorithm: str = "sha256"
    dtype: str | None = None  # None: the checkpoint's (model_path) or model.dtype
    hash_seed: str | None = None  # None: env PDKV_HASH_SEED, else per-process random (hashes mean nothing outside)
    enable_kv_events: bool = False  # record prefix-cache events for `Engine.kv_event_sink`
    device: str = "cpu"
    # one of attention/capabilities.py ATTENTION_BACKENDS (the deploy config's default too: on CUDA triton, on
    # the CPU fused where each can run, else torch); the C++ kernel is built on first use
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    engine_id: str = "engine-0"
    # decode steps replay CUDA graphs (one per batch-size bucket, captured at start) where the device is CUDA
    # and the backend allows it (triton); False: every step eager, for debugging. No effect on the CPU.
    cuda_graphs: bool = True
    # sample on the device with one host copy a step (sample/batched.py); None: on every device but the CPU
    device_sampler: bool | None = None
    # ids the tokenizer can decode are [0, tokenizer_vocab_size): a padded embedding (model.vocab_size larger)
    # serves, and ids at or above this bound are never sampled. None: every id of the model.
    tokenizer_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.step_overhead_tokens < 0:
            raise ValueError(f"step_overhead_tokens must be >= 0, got {self.step_overhead_tokens}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}")
        if not 0.0 <= self.kv_audit_rate <= 1.0:  # (also refuses NaN)
            raise ValueError(f"kv_audit_rate must be in [0, 1], got {self.kv_audit_rate}")
        if self.kv_audit_tolerance is not None and not 0.0 <= self.kv_audit_tolerance <= 1.0:
            raise ValueError(f"kv_audit_tolerance must be in [0, 1] (relative) or None, got {self.kv_audit_tolerance}")
        check_choice(self.attention_backend)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_device(self.device)
        if self.tokenizer_vocab_size is not None:
            # (a checkpoint's vocabulary is known once it is loaded: the runner checks it against that)
            bound = self.tokenizer_vocab_size if self.model_path else self.model.vocab_size
            if not 0 < self.tokenizer_vocab_size <= bound:
                raise ValueError(f"the tokenizer's vocabulary ({self.tokenizer_vocab_size} ids) must be positive and "
                                 f"at most the model's (vocab_size {bound})")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.model.max_position_embeddings
