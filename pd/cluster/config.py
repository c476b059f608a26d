"""Deployment configuration: one YAML file -> frozen, validated dataclasses.

A `DeployConfig` describes a whole P/D deployment: the model every worker
runs, its KV cache budget, the scheduler's limits, the topology (how many
prefill and decode workers, or colocated workers), the KV transfer settings
and the router's address.

Guarantees:
- every section is a frozen dataclass validated once, in `__post_init__`;
  a bad value raises `ConfigError` naming the offending key (`topology.num_prefill`),
  so a typo in a YAML file never reaches a running worker;
- unknown keys are refused (they are almost always typos);
- `to_dict()` / `from_dict()` round-trip exactly, which is how the config
  crosses process boundaries (as JSON text, never pickle).
"""
from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A deployment config value is missing, mistyped or out of range."""


class Mode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


class Placement(str, enum.Enum):
    """How worker actors are reserved on the Ray cluster (one bundle per worker)."""

    SPREAD = "spread"  # one placement group, bundles over as many nodes as possible (P and D spread out)
    PACK = "pack"  # one placement group, bundles packed onto as few nodes as possible (same-host transfers)
    NONE = "none"  # no placement group: each actor is scheduled on its own (Ray SPREAD strategy)


class FailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The model: seeded random weights (`path` empty) or a checkpoint directory.

    `architecture` holds model-shape overrides (hidden size, layers, heads, ...)
    passed through to the engine's model config; the engine validates them.
    """

    path: str | None = None
    seed: int = 0
    dtype: str = "float32"
    name: str = "pdkv-tiny"
    architecture: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(bool(self.name), "model.name", "must be a non-empty string")
        _require(isinstance(self.architecture, dict), "model.architecture", "must be a mapping")
        # The path is checked where the workers run (it may exist only on GPU nodes), not here.
        _require(self.path is None or bool(self.path.strip()), "model.path", "must be a directory path or empty")


@dataclasses.dataclass(frozen=True)
class CacheSection:
    """Per-worker KV cache: block size and the memory budget of its page pool."""

    block_size: int = 16
    kv_memory_mb: float = 64.0
    enable_prefix_caching: bool = True
    hash_algorithm: str = "sha256"

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "cache.block_size", f"must be a positive power of two, got {self.block_size}")
        _require(self.kv_memory_mb > 0, "cache.kv_memory_mb", f"must be positive, got {self.kv_memory_mb}")
        _require(self.hash_algorithm in ("sha256", "xxhash"), "cache.hash_algorithm",
                 f"must be 'sha256' or 'xxhash', got {self.hash_algorithm!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerSection:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    watermark: float = 0.01

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "scheduler.max_num_seqs", "must be positive")
        _require(self.max_num_batched_tokens > 0, "scheduler.max_num_batched_tokens", "must be positive")
        _require(self.max_model_len > 1, "scheduler.max_model_len", "must be > 1")
        _require(0.0 <= self.watermark < 1.0, "scheduler.watermark", "must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TopologySection:
    """Which workers run where.

    Disaggregated: `num_prefill` P workers and `num_decode` D workers.
    Colocated: `num_colocated` workers that each prefill and decode (the baseline).
    """

    mode: Mode = Mode.DISAGGREGATED
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 1
    device: str = "cpu"  # cuda: each worker actor asks Ray for num_gpus=1 and runs on its own GPU
    cpus_per_worker: float = 0.25
    placement: Placement = Placement.SPREAD

    def __post_init__(self) -> None:
        # Only the spelling is checked here: the launcher may have no GPU while the workers do;
        # the worker's EngineConfig checks that CUDA really exists where it runs.
        _require(self.device in ("cpu", "cuda"), "topology.device", f"must be 'cpu' or 'cuda', got {self.device!r}")
        _require(self.placement in {p.value for p in Placement}, "topology.placement",
                 f"must be one of {[p.value for p in Placement]}, got {self.placement!r}")
        object.__setattr__(self, "placement", Placement(self.placement))
        _require(0 < self.cpus_per_worker <= 64, "topology.cpus_per_worker", "must be in (0, 64]")
        if self.mode is Mode.DISAGGREGATED:
            _require(self.num_prefill >= 1, "topology.num_prefill", "must be >= 1 in disaggregated mode")
            _require(self.num_decode >= 1, "topology.num_decode", "must be >= 1 in disaggregated mode")
        else:
            _require(self.num_colocated >= 1, "topology.num_colocated", "must be >= 1 in colocated mode")

    @property
    def num_workers(self) -> int:
        if self.mode is Mode.COLOCATED:
            return self.num_colocated
        return self.num_prefill + self.num_decode


@dataclasses.dataclass(frozen=True)
class TransferSection:
    """KV transfer (ZMQ connector) settings shared by every worker."""

    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 10.0
    lease_s: float = 30.0
    kv_load_failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE
    data_path: str = "auto"  # auto: shared memory to a producer on the same host, else tcp

    def __post_init__(self) -> None:
        _require(bool(self.host), "transfer.host", "must be a non-empty host name or address")
        _require(0 <= self.port <= 65535, "transfer.port", f"must be a TCP port (0 = any free), got {self.port}")
        _require(self.timeout_s > 0, "transfer.timeout_s", "must be positive")
        _require(self.lease_s > 0, "transfer.lease_s", "must be positive")
        _require(self.data_path in ("auto", "tcp", "shm"), "transfer.data_path", "must be 'auto', 'tcp' or 'shm'")


@dataclasses.dataclass(frozen=True)
class RouterSection:
    """The router's address, timeouts, request limits and admission control.

    Admission: at most `max_in_flight_per_worker` x (healthy decode or colocated workers)
    prompts run at once; up to `max_queued_requests` more wait (each at most
    `queue_timeout_s`); anything beyond is refused at once with 429 and `Retry-After`.
    """

    host: str = "127.0.0.1"  # explicit bind address; never an implicit 0.0.0.0
    port: int = 8000
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    api_key: str | None = None
    max_body_bytes: int = 1024 * 1024  # larger bodies get 413
    max_prompt_tokens: int | None = None  # None: scheduler.max_model_len - 1
    max_prompts_per_request: int = 16
    max_in_flight_per_worker: int = 32
    max_queued_requests: int = 64
    queue_timeout_s: float = 10.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        _require(bool(self.host), "router.host", "must be an explicit bind address (e.g. 127.0.0.1)")
        _require(self.max_body_bytes >= 1024, "router.max_body_bytes", "must be >= 1024")
        _require(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1, "router.max_prompt_tokens",
                 "must be >= 1 or empty")
        _require(self.max_prompts_per_request >= 1, "router.max_prompts_per_request", "must be >= 1")
        _require(self.max_in_flight_per_worker >= 1, "router.max_in_flight_per_worker", "must be >= 1")
        _require(self.max_queued_requests >= 0, "router.max_queued_requests", "must be >= 0")
        _require(self.queue_timeout_s > 0, "router.queue_timeout_s", "must be positive")
        _require(self.retry_after_s >= 1, "router.retry_after_s", "must be >= 1")
        _require(0 <= self.port <= 65535, "router.port", f"must be a TCP port (0 = any free), got {self.port}")
        _require(self.request_timeout_s > 0, "router.request_timeout_s", "must be positive")
        _require(self.connect_timeout_s > 0, "router.connect_timeout_s", "must be positive")
        _require(self.health_interval_s > 0, "router.health_interval_s", "must be positive")


@dataclasses.dataclass(frozen=True)
class FaultsSection:
    """Fault injection plans per worker role (tests only; see pd.worker.faults). Empty: none."""

    prefill: str = ""
    decode: str = ""
    colocated: str = ""

    def __post_init__(self) -> None:
        from pd.worker.faults import FaultSpecError, parse_worker_faults

        for role in ("prefill", "decode", "colocated"):
            spec = getattr(self, role)
            if spec:
                try:
                    parse_worker_faults(spec)
                except FaultSpecError as exc:
                    raise ConfigError(f"faults.{role}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class DeployConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    cache: CacheSection = dataclasses.field(default_factory=CacheSection)
    scheduler: SchedulerSection = dataclasses.field(default_factory=SchedulerSection)
    topology: TopologySection = dataclasses.field(default_factory=TopologySection)
    transfer: TransferSection = dataclasses.field(default_factory=TransferSection)
    router: RouterSection = dataclasses.field(default_factory=RouterSection)
    faults: FaultsSection = dataclasses.field(default_factory=FaultsSection)

    def __post_init__(self) -> None:
        _require(self.scheduler.max_model_len >= self.cache.block_size, "scheduler.max_model_len",
                 "must be at least one block (cache.block_size)")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=lambda v: v.value))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeployConfig:
        return _build(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> DeployConfig:
        return cls.from_dict(json.loads(text))

    def replace(self, **sections: Any) -> DeployConfig:
        """A copy with whole sections or `section__field` values replaced (validated again)."""
        data = self.to_dict()
        for key, value in sections.items():
            section, _, field = key.partition("__")
            if field:
                data[section][field] = value
            else:
                data[section] = value
        return DeployConfig.from_dict(data)


def _build(cls: type, data: Any, prefix: str):
    """Builds dataclass `cls` from a mapping, refusing unknown keys and wrong types."""
    where = prefix.rstrip(".") or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        ftype = fields[name].type
        kwargs[name] = _coerce(ftype, value, key)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


_SECTIONS = {
    "ModelSection": ModelSection, "CacheSection": CacheSection, "SchedulerSection": SchedulerSection,
    "TopologySection": TopologySection, "TransferSection": TransferSection, "RouterSection": RouterSection,
    "FaultsSection": FaultsSection,
}
_ENUMS = {"Mode": Mode, "FailurePolicy": FailurePolicy, "Placement": Placement}


def _coerce(ftype: str, value: Any, key: str) -> Any:
    """Checks `value` against the field's annotation (a string under postponed evaluation)."""
    if ftype in _SECTIONS:
        return _build(_SECTIONS[ftype], value, key + ".")
    if ftype in _ENUMS:
        enum_cls = _ENUMS[ftype]
        try:
            return enum_cls(value)
        except ValueError:
            raise ConfigError(f"{key}: must be one of {[m.value for m in enum_cls]}, got {value!r}") from None
    optional = ftype.endswith("| None")
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: must not be empty")
    base = ftype.replace("| None", "").strip()
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base == "str":
        ok = isinstance(value, str)
    elif base == "dict":
        ok = isinstance(value, dict)
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{key}: expected {base}, got {type(value).__name__} {value!r}")
    return value


def load_deploy_config(path: str | Path) -> DeployConfig:
    """Reads and validates a YAML deployment config; errors name the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return DeployConfig.from_dict(data or {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
