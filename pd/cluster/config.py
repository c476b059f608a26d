"""Deployment configuration: one YAML file -> frozen, validated pydantic models.

A `DeployConfig` describes a whole P/D deployment: the model every worker
runs, its KV cache budget, the scheduler's limits, the topology (how many
prefill and decode workers, or colocated workers), the KV transfer settings
and the router's address.

Guarantees:
- every section is validated once, when the config is built; a bad value
  raises `ConfigError` naming the offending key by its path
  (`topology.num_prefill: ...`), so a typo in a YAML file never reaches a
  running worker;
- unknown keys are refused (they are almost always typos); types are strict
  (`yes` is a bool, `1` is not);
- `to_dict()` / `from_dict()` round-trip exactly, which is how the config
  crosses process boundaries (as JSON text, never pickle);
- `json_schema()` describes every section (`python -m pd.launch --print-config-schema`).
"""
from __future__ import annotations

import enum
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, Strict, ValidationError, field_serializer, field_validator, model_validator

from connectors.links.faults import FaultSpecError
from connectors.links.link_shape import LinkShape
from connectors.zmq.transfer_settings import DataPathName, StreamingName, TransferSettings
from pd.cluster.fault_rules import parse_worker_faults
from pd.cluster.router_config import ConnectionsSection, RouterSection  # noqa: F401  (sections of DeployConfig)
from pd.cluster.schema import FieldError, StrictModel, clip, describe
from pd.cluster.tracing_config import TracingSection
from pd.cluster.tp_config import TPSettings, tp_problem
from pd.cluster.architecture_config import MAX_POSITIONS, ArchitectureSection
from pd.cluster.config_file import ConfigFileError, one_line, read_config_file
from pd.engine.attention.capabilities import ATTENTION_BACKENDS, CAPABILITIES, DEFAULT_ATTENTION_BACKEND
from pd.engine.text.vocab import byte_vocab_problem

if TYPE_CHECKING:
    BackendName = str
else:  # the names attention/capabilities.py declares, as a Literal (the schema's enum, the error's list)
    BackendName = Literal[ATTENTION_BACKENDS]

DTYPES = ("float32", "bfloat16", "float16")
MAX_KV_MEMORY_MB = 16 << 20  # 16 TiB per worker: more than any machine has
MAX_WORKERS = 4096
MAX_MESSAGE_CHARS = 2000  # one config error line
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")  # a host name, an IPv4 or IPv6 address (auto included)
_TRANSFER = TransferSettings()  # the transfer defaults are the connector's own
# transfer.timeout_s is also each handshake's and socket I/O's timeout (up to 5 s): below this a pull's
# handshake cannot finish, so D can neither pull nor tell P it gave up, and P's blocks wait out the lease
MIN_TRANSFER_TIMEOUT_S = 1.0


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


# Enum fields take their values: YAML and JSON carry strings.
ModeField = Annotated[Mode, Strict(False)]
PlacementField = Annotated[Placement, Strict(False)]
FailurePolicyField = Annotated[FailurePolicy, Strict(False)]
Positive = Annotated[float, Field(gt=0)]
TcpPort = Annotated[int, Field(ge=0, le=65535, description="TCP port; 0 = any free one")]
NonEmpty = Annotated[str, Field(min_length=1)]


class ModelSection(StrictModel):
    """The model: seeded random weights (`path` empty) or a checkpoint directory.

    `architecture` holds a random-weight model's shape (`ArchitectureSection`: the engine's
    ModelConfig fields, typed and bounded, unknown keys refused; only the keys set are carried);
    with a `path` the checkpoint's config.json decides the shape (checked by pd.launch where it
    can read it, and by the workers where they run).
    """

    path: str | None = Field(None, max_length=4096,
                             description="HF-style checkpoint directory (checked where the workers run)")
    seed: int = Field(0, ge=-(1 << 63), lt=1 << 64)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="serving dtype, also for a checkpoint stored in another one")
    name: NonEmpty = Field("pdkv-tiny", max_length=256, description="the model id clients name")
    architecture: ArchitectureSection = Field(default_factory=ArchitectureSection,
                                              description="pd.engine.model.config.ModelConfig fields")
    attention_backend: BackendName = Field(
        DEFAULT_ATTENTION_BACKEND,
        description="attention: auto = on CUDA the Triton kernels (where triton is installed), on the CPU "
                    "the fused C++ kernel where valid (float32, a C++ compiler on the worker); else torch. "
                    "triton: CUDA only (pd/engine/attention/capabilities.py declares what each runs on)")
    cuda_graphs: bool = Field(True, description="on CUDA, decode steps replay CUDA graphs captured at start "
                                                "(one per batch-size bucket); false runs every step eagerly")

    @field_validator("path")
    @classmethod
    def _path_not_blank(cls, path: str | None) -> str | None:
        if path is not None and not path.strip():
            raise ValueError("must be a directory path or empty")
        if path is not None and "\x00" in path:
            raise ValueError("must not contain a NUL character")
        return path

    @field_serializer("architecture")
    def _only_what_was_set(self, architecture: ArchitectureSection) -> dict[str, Any]:
        return architecture.overrides()

    @model_validator(mode="after")
    def _random_weights_speak_bytes(self) -> ModelSection:
        # Without a checkpoint the workers and the router use the byte tokenizer: any other declared
        # vocabulary samples ids nobody can decode (or tokens with no embedding). A checkpoint's own
        # tokenizer is checked where the workers run (pd.worker.wiring), since its files live there.
        if self.path is None:
            problem = byte_vocab_problem(self.architecture.vocab_size)
            if problem is not None:
                raise FieldError("architecture", problem)
        return self


class CacheSection(StrictModel):
    """Per-worker KV cache: block size and the memory budget of its page pool."""

    block_size: int = Field(16, gt=0, le=1 << 16, description="tokens per KV block; a power of two")
    kv_memory_mb: float = Field(64.0, gt=0, le=MAX_KV_MEMORY_MB, description="the KV pool of each worker, MB")
    enable_prefix_caching: bool = True
    hash_algorithm: Literal["sha256", "xxhash"] = "sha256"

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a positive power of two, got {value}")
        return value


class SchedulerSection(StrictModel):
    max_num_seqs: int = Field(32, gt=0, le=1 << 16)
    max_num_batched_tokens: int = Field(512, gt=0, le=1 << 24)
    max_model_len: int = Field(1024, gt=1, le=MAX_POSITIONS)
    watermark: float = Field(0.01, ge=0.0, lt=1.0)
    # a step's fixed cost in prompt tokens: > 0 splits a burst of waiting prompts over a few steps
    # (pd/engine/sched/admission.py); 0: a step admits all the token budget allows
    step_overhead_tokens: int = Field(0, ge=0, le=1 << 16)


class TopologySection(TPSettings):
    """Which workers run where.

    Disaggregated: `num_prefill` P workers and `num_decode` D workers.
    Colocated: `num_colocated` workers that each prefill and decode (the baseline).
    Each worker spans its role's TP degree of ranks (`pd.cluster.tp_config`); the per-worker
    resources below (CPUs, threads, GPU share) are per rank.
    """

    mode: ModeField = Mode.DISAGGREGATED
    num_prefill: int = Field(1, ge=0, le=MAX_WORKERS)
    num_decode: int = Field(1, ge=0, le=MAX_WORKERS)
    num_colocated: int = Field(1, ge=0, le=MAX_WORKERS)
    # Only the spelling is checked here: the launcher may have no GPU while the workers do;
    # the worker's EngineConfig checks that CUDA really exists where it runs.
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="cuda: each worker asks Ray for gpus_per_worker of a GPU")
    gpus_per_worker: float = Field(1.0, gt=0, le=1, description=(
        "cuda only: the share of one GPU each worker asks Ray for, and may fill with its weights, activations "
        "and KV pool; 0.5 puts two workers (P and D) on one GPU; at most 1: a worker computes on one device"))
    gpu_memory_fraction: float | None = Field(None, gt=0, le=1, description=(
        "cuda only: size each worker's KV pool from its GPU share: the pool is this fraction of "
        "(gpus_per_worker x the GPU's memory) less the weights and an activation reserve, and "
        "cache.kv_memory_mb is not used; unset: the pool is cache.kv_memory_mb, checked at start to fit the share"))
    cpus_per_worker: float = Field(0.25, gt=0, le=64, description="what Ray reserves per worker rank (scheduling only)")
    # Ray sets OMP_NUM_THREADS=1 in an actor whose num_cpus is below 1, so without this a worker
    # computes on one thread whatever the machine has (`Worker.start` sets this).
    threads_per_worker: int | None = Field(
        None, ge=1, le=256, description="torch intra-op threads in each worker process (rank), used by torch and the "
        "fused CPU kernels; unset: max(1, round(cpus_per_worker))")
    placement: PlacementField = Placement.SPREAD

    @model_validator(mode="after")
    def _workers_for_mode(self) -> TopologySection:
        needed = ("num_prefill", "num_decode") if self.mode is Mode.DISAGGREGATED else ("num_colocated",)
        for name in needed:
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be >= 1 in {self.mode.value} mode")
        return self

    @model_validator(mode="after")
    def _gpu_share_on_cuda_only(self) -> TopologySection:
        # a GPU share on a cpu worker would be silently meaningless: refuse it rather than ignore it
        if self.device == "cpu" and self.gpus_per_worker != 1.0:
            raise FieldError("gpus_per_worker", "applies to device: cuda only (a cpu worker asks Ray for no GPU); "
                             "leave it at 1 or set device: cuda")
        if self.device == "cpu" and self.gpu_memory_fraction is not None:
            raise FieldError("gpu_memory_fraction", "applies to device: cuda only (a cpu worker's KV pool is "
                             "cache.kv_memory_mb); remove it or set device: cuda")
        if round(self.gpus_per_worker, 4) != self.gpus_per_worker:  # Ray counts GPU shares in 1/10000ths
            raise FieldError("gpus_per_worker",
                             f"at most 4 decimal places (Ray's precision), got {self.gpus_per_worker}")
        return self

    @property
    def resolved_threads_per_worker(self) -> int:
        """The torch threads a worker computes with (`threads_per_worker`, else from `cpus_per_worker`)."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        return max(1, round(self.cpus_per_worker))

    @property
    def num_workers(self) -> int:
        if self.mode is Mode.COLOCATED:
            return self.num_colocated
        return self.num_prefill + self.num_decode


class EmulatedLinkSection(StrictModel):
    """Tests and benchmarks only: a slow P<->D link on one machine (`connectors.links.emulated_link`).

    Each prefill worker puts its KV side channel and data port behind a relay on
    real sockets that paces each direction to `bandwidth_mbps` (shared by all of
    that worker's connections, like its NIC) and delays every byte by
    `latency_ms` one way; it offers no shared memory, so the KV bytes cross the
    link (`transfer.timeout_s` must still cover the slowest pull). Unset (the
    default): nothing is in the way.
    """

    bandwidth_mbps: float = Field(gt=0, le=100_000, description="each way, megabits per second")
    latency_ms: float = Field(0.0, ge=0, le=10_000, description="one way, added to every byte")

    def link_shape(self) -> LinkShape:
        return LinkShape(bandwidth_mbps=self.bandwidth_mbps, latency_ms=self.latency_ms)


class TransferSection(StrictModel):
    """KV transfer (ZMQ connector) settings shared by every worker; see `transfer_settings()`."""

    host: NonEmpty = Field("127.0.0.1", description="side channel + worker HTTP; auto = the Ray node's IP")
    port: TcpPort = _TRANSFER.port
    timeout_s: float = Field(_TRANSFER.timeout_s, ge=MIN_TRANSFER_TIMEOUT_S,
                             description="a whole KV pull; handshakes and I/O get less (at most 5 s)")
    lease_s: Positive = Field(_TRANSFER.lease_s, description="P keeps unpulled blocks this long without a heartbeat")
    kv_load_failure_policy: FailurePolicyField = FailurePolicy.RECOMPUTE
    kv_audit_rate: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False, description=(
        "share of disaggregated requests whose last pulled full KV block D recomputes and compares with what P "
        "sent, after the load (0 = off; e.g. 0.01). See docs/reliability-and-security.md"))
    kv_audit_tolerance: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False, description=(
        "the audit's largest accepted |difference| of a layer's K or V, relative to its largest |value| in the "
        "block; 0 = bitwise (batch-invariant kernels only); null = by KV dtype: 1e-4 for float32, 0.05 for "
        "bfloat16/float16"))
    data_path: DataPathName = Field(
        _TRANSFER.data_path, description="auto: cuda_ipc between GPU pools of one node (falls back to shm), "
                                       "shared memory on one host, else tcp")
    emulated_link: EmulatedLinkSection | None = Field(
        None, description="tests and benchmarks only: the P->D KV path crosses a link of this bandwidth and latency")
    streaming: StreamingName = Field(_TRANSFER.streaming, description=(
        "chunk: the router sends a request to P and D at once; P publishes the blocks each prefill step "
        "completed and D pulls them as they come; layer: the same, each step's blocks published slice by "
        "slice of layers as P's forward runs them (off: D pulls after P's whole prefill)"))
    stream_chunk_tokens: int = Field(_TRANSFER.stream_chunk_tokens, ge=16, le=1 << 20, description=(
        "with streaming: a streamed prompt's largest prefill step on P (tokens): more steps, more parts"))
    stream_layer_parts: int = Field(_TRANSFER.stream_layer_parts, ge=1, le=64, description=(
        "with streaming: layer: the most slices a page moves in (the largest divisor of its layers not above)"))

    @model_validator(mode="after")
    def _link_takes_tcp(self) -> TransferSection:
        if self.emulated_link is not None and self.data_path in ("shm", "cuda_ipc"):
            raise FieldError("data_path", "must be 'auto' or 'tcp' with an emulated_link (it carries tcp only)")
        return self

    def transfer_settings(self) -> TransferSettings:
        """The connector's settings; it derives every timeout of its own from them."""
        link = self.emulated_link.link_shape() if self.emulated_link is not None else None
        return TransferSettings(port=self.port, timeout_s=self.timeout_s, lease_s=self.lease_s,
                                data_path=self.data_path, emulated_link=link, streaming=self.streaming,
                                stream_chunk_tokens=self.stream_chunk_tokens,
                                stream_layer_parts=self.stream_layer_parts)


class FaultsSection(StrictModel):
    """Fault injection plans per worker role (tests only; see pd.cluster.fault_rules). Empty: none."""

    prefill: str = ""
    decode: str = ""
    colocated: str = ""

    @field_validator("prefill", "decode", "colocated")
    @classmethod
    def _plan_parses(cls, spec: str) -> str:
        if spec:
            try:
                parse_worker_faults(spec)
            except FaultSpecError as exc:
                raise ValueError(str(exc)) from None
        return spec


class DeployConfig(StrictModel):
    model: ModelSection = Field(default_factory=ModelSection)
    cache: CacheSection = Field(default_factory=CacheSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    topology: TopologySection = Field(default_factory=TopologySection)
    transfer: TransferSection = Field(default_factory=TransferSection)
    router: RouterSection = Field(default_factory=RouterSection)
    faults: FaultsSection = Field(default_factory=FaultsSection)
    tracing: TracingSection = Field(default_factory=TracingSection)  # pd.cluster.tracing_config

    @model_validator(mode="after")
    def _sections_agree(self) -> DeployConfig:
        if self.scheduler.max_model_len < self.cache.block_size:
            raise FieldError("scheduler.max_model_len", "must be at least one block (cache.block_size)")
        # what the backend declares it runs on (attention/capabilities.py; the engine's selector reads the
        # same), judged here without the worker's machine: device, dtype, block size
        capabilities = CAPABILITIES.get(self.model.attention_backend)
        why = capabilities and capabilities.why_not(self.topology.device, self.model.dtype,
                                                    block_size=self.cache.block_size)
        if why:
            raise FieldError("model.attention_backend", f"{why} (topology.device, model.dtype; use 'auto' or 'torch')")
        # (connectors/zmq/streaming/layer_slices.py publishes slices from inside the forward, off a host page pool)
        if self.transfer.streaming == "layer" and self.topology.device != "cpu":
            raise FieldError("transfer.streaming", "'layer' needs the KV pool in host memory (topology.device: "
                             f"cpu); here topology.device is {self.topology.device} (use 'chunk' or 'off')")
        if (tp_why := tp_problem(self)) is not None:
            raise FieldError(*tp_why)
        return self

    @model_validator(mode="after")
    def _strings_a_peer_can_use(self) -> DeployConfig:
        # a host or key that validates as a str but that no resolver or HTTP client can use would fail only
        # later, in a worker or in every request: a homoglyph host, a key with a character outside latin-1
        for name, host in (("router.host", self.router.host), ("transfer.host", self.transfer.host)):
            if not _HOST.fullmatch(host):
                raise FieldError(name, f"must be an IP address or an ASCII host name, got {clip(host, 40)}")
        keys = {f"router.api_keys.{tenant}" if tenant in self.router.api_keys else "router.api_key": key
                for tenant, key in self.router.tenant_keys().items()}
        if self.router.admin_key is not None:
            keys["router.admin_key"] = self.router.admin_key
        for name, key in keys.items():  # (the key itself is never echoed: it is a secret)
            if not all(" " <= ch <= "\xff" and ch != "\x7f" for ch in key):
                raise FieldError(name, "must be latin-1 text without control characters (an HTTP header "
                                 "carries nothing else); ASCII letters and digits are the safe choice")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> DeployConfig:
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"config: must be a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate({} if data is None else data)
        except ValidationError as exc:
            raise ConfigError(describe(exc, cls, where="config")) from None

    @classmethod
    def from_json(cls, text: str) -> DeployConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """JSON Schema (draft 2020-12) of the YAML file."""
        return cls.model_json_schema()

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


def load_deploy_config(path: str | Path) -> DeployConfig:
    """Reads and validates a YAML deployment config; every error is a ConfigError of one line that
    names the file and key (`pd.cluster.config_file` bounds what reading the file may cost)."""
    try:
        data = read_config_file(path)
    except ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return DeployConfig.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(one_line(f"{str(path)[:200]}: {exc}", MAX_MESSAGE_CHARS)) from None
