"""How a worker builds its engine and connector from the deployment config,
and how it reports their state.

This is the one place where the P/D layer meets the engine's and the
connector's constructors, so a change in either touches only this module.

Guarantees: `build_engine` returns a connector for prefill / decode roles
and none for the colocated role; the connector and the engine agree on the
block size, model identity and secret; `engine_stats(audit=True)` includes a
pool audit (`audit.all_free`, with the audit's message when not) taken
between steps; without it, stats take no lock (the router polls them often).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig
from pd.engine.text.tokenizer import load_tokenizer
from pd.engine.text.vocab import check_vocabularies
from pd.cluster.kv_wire import deployment_hash_seed, hashing_identity
from pd.cluster.gpu_share import worker_kv_cache_bytes
from pd.cluster.roles import Role

if TYPE_CHECKING:  # torch-heavy: imported when a worker really starts
    from connectors.base import KVConnector
    from connectors.zmq.connector import ZmqConnector
    from pd.engine.engine import Engine
    from pd.engine.parallel.group import TPGroup

logger = logging.getLogger(__name__)

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def engine_config_for(spec) -> EngineConfig:
    """DeployConfig (+ worker identity) -> EngineConfig; unknown architecture keys are refused, and so
    is a tokenizer larger than the model's vocabulary (`pd.engine.text.vocab`), before anything serves."""
    cfg = spec.config
    model = _model_config(cfg)
    _check_tp(cfg, model)
    tokenizer_vocab_size = _tokenizer_vocab_size(cfg, model)
    return EngineConfig(
        model=model,
        tokenizer_vocab_size=tokenizer_vocab_size,
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,  # the serving dtype, also for a checkpoint stored in another one
        attention_backend=cfg.model.attention_backend,
        cuda_graphs=cfg.model.cuda_graphs,
        seed=cfg.model.seed,
        block_size=cfg.cache.block_size,
        kv_cache_bytes=worker_kv_cache_bytes(cfg, dataclasses.asdict(model)),  # cuda: planned on the worker's GPU share
        max_model_len=cfg.scheduler.max_model_len,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        step_overhead_tokens=cfg.scheduler.step_overhead_tokens,
        enable_prefix_caching=cfg.cache.enable_prefix_caching,
        watermark=cfg.scheduler.watermark,
        kv_load_failure_policy=cfg.transfer.kv_load_failure_policy.value,
        kv_audit_rate=cfg.transfer.kv_audit_rate, kv_audit_tolerance=cfg.transfer.kv_audit_tolerance,
        hash_algorithm=cfg.cache.hash_algorithm,
        device=cfg.topology.device,
        engine_id=f"{spec.worker_id}-{uuid.uuid4().hex[:8]}",
        hash_seed=deployment_hash_seed(spec.secret),
        enable_kv_events=cfg.cache.enable_prefix_caching,
    )


def _model_config(cfg) -> ModelConfig:
    """The model the worker serves: the checkpoint's own config, else the declared architecture."""
    arch = cfg.model.architecture.overrides()  # the keys the file set; ModelConfig's defaults for the rest
    unknown = sorted(set(arch) - _MODEL_FIELDS)
    if unknown:
        raise ValueError(f"model.architecture: unknown key(s) {unknown}; known: {sorted(_MODEL_FIELDS)}")
    if cfg.model.path:
        from pd.engine.model.checkpoint import load_config  # torch-heavy

        return load_config(cfg.model.path, dtype=cfg.model.dtype)
    if "layer_types" in arch and arch["layer_types"] is not None:
        arch["layer_types"] = tuple(arch["layer_types"])
    arch["dtype"] = cfg.model.dtype
    arch.setdefault("max_position_embeddings", max(cfg.scheduler.max_model_len, 4096))
    return ModelConfig(**arch)


def _tokenizer_vocab_size(cfg, model: ModelConfig) -> int:
    """The ids the served tokenizer decodes (the router loads the same one); a tokenizer larger than
    the model is refused here with both numbers, a smaller one is padding and bounds the sampler."""
    tokenizer = load_tokenizer(cfg.model.path)
    where = f"model.path {cfg.model.path}" if cfg.model.path else "the byte tokenizer, no model.path"
    model_where = (f"config.json of model.path {cfg.model.path}" if cfg.model.path
                   else "model.architecture.vocab_size")
    check_vocabularies(tokenizer.vocab_size, model.vocab_size, where, model_where)
    if tokenizer.vocab_size < model.vocab_size:
        logger.info("model vocabulary %d padded past the tokenizer's %d ids: ids from %d on are never sampled",
                    model.vocab_size, tokenizer.vocab_size, tokenizer.vocab_size)
    return tokenizer.vocab_size


def _check_tp(cfg, model: ModelConfig) -> None:
    """A checkpoint's heads against the config's TP degrees (random weights were checked with the config)."""
    from pd.cluster.tp_config import checkpoint_tp_problem

    problem = checkpoint_tp_problem(cfg, model.num_heads, model.num_kv_heads)
    if problem is not None:
        raise ValueError(problem)


def check_model_vocabulary(cfg) -> int:
    """The tokenizer's id count once it fits the model (VocabularyMismatch otherwise), and the model's
    heads fit the config's TP degrees (ValueError otherwise): what every worker checks at start,
    callable before any worker starts where the checkpoint is readable."""
    model = _model_config(cfg)
    _check_tp(cfg, model)
    return _tokenizer_vocab_size(cfg, model)


def build_engine(spec, tp: TPGroup | None = None, gang_control: Any = None) -> tuple[Engine, KVConnector | None]:
    """(engine, connector or None) for a worker spec; the engine is not started. `tp`: rank 0's group of
    a TP gang (`pd.worker.gang`); None: one process, the engine built exactly as without TP.
    `gang_control`: the gang's `GangControl` (its ranks' agents register there), for a P or D gang: the
    connector then moves KV through every rank (`connectors/zmq/gang/`); the connector owns it from here."""
    from pd.engine.engine import Engine

    engine_config = engine_config_for(spec)
    connector: KVConnector | None = None
    if spec.role is not Role.BOTH:
        connector = _build_connector(spec, engine_config, tp.world_size if tp is not None else 1, gang_control)
    try:
        engine = Engine(engine_config, connector=connector) if tp is None else \
            Engine(engine_config, connector=connector, tp=tp)
    except BaseException:
        if connector is not None:
            connector.shutdown()
        raise
    return engine, connector


def _build_connector(spec, engine_config: EngineConfig, tp: int = 1, gang_control: Any = None) -> ZmqConnector:
    """The ZMQ connector for a prefill (producer) or decode (consumer) worker.

    Every worker of a deployment gets the same `model_id` and secret, so the
    connector's handshake accepts exactly the peers of this deployment. Its groups are the canonical
    ones (every KV head, what a TP 1 worker holds) at any TP, so any P TP meets any D TP; rank 0 of a
    gang (`tp` > 1) also gets its `GangSide`: every rank moves its own heads.
    """
    from connectors.zmq.connector import KVRole, ZmqConnector
    from connectors.zmq.gang.gang_side import GangSide
    from pd.engine.kv.layout import KVLayout

    cfg = spec.config
    groups = KVLayout(engine_config.model, engine_config.block_size).kv_cache_groups()
    role = KVRole.PRODUCER if spec.role is Role.PREFILL else KVRole.CONSUMER
    connector_config = cfg.transfer.transfer_settings().connector_config(
        engine_id=engine_config.engine_id, role=role, secret=spec.secret, model_id=_model_id(cfg), host=spec.host)
    gang = None
    if tp > 1:
        if gang_control is None:
            raise ValueError(f"a {spec.role.value} worker of TP {tp} needs its gang's control to move KV")
        heads, geometry = gang_heads(engine_config, tp, 0)
        gang = GangSide(tp, heads, geometry, gang_control, host=spec.host,
                        load_timeout_s=connector_config.transfer_timeout_s, faults=gang_faults(spec))
    return ZmqConnector(connector_config, groups, gang=gang)


def gang_heads(engine_config: EngineConfig, tp: int, rank: int) -> tuple[Any, Any]:
    """(RankHeads, HeadGeometry) of rank `rank` of a gang of `tp`: the KV heads it holds (the engine's
    split, `pd.engine.parallel.tp.TPShape`) and how its pages divide into them."""
    from connectors.zmq.gang.gang_side import geometry_from_groups
    from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads
    from pd.engine.kv.layout import KVLayout
    from pd.engine.parallel.tp import TPShape

    num_heads, head_dim, dtype = geometry_from_groups(
        KVLayout(engine_config.model, engine_config.block_size).kv_cache_groups())
    heads = TPShape(tp, num_heads).heads_of(rank)
    return RankHeads(rank, heads.start, len(heads)), HeadGeometry(len(heads), head_dim, dtype)


def gang_faults(spec) -> Any:
    """The role's fault plan when it names gang points (tests only: `connectors/zmq/gang/rank_faults.py`)."""
    from pd.cluster.fault_rules import parse_worker_faults

    plan = parse_worker_faults(getattr(spec.config.faults, spec.role.value))
    return plan if plan is not None and any(p.startswith("gang.") for p in plan.points()) else None


def _model_id(cfg) -> str:
    """Model identity for the connector's compatibility hash: same weights <=> same id."""
    m = cfg.model
    source = f"path={m.path}" if m.path else f"seed={m.seed}"
    return f"{m.name}|{source}|{m.dtype}|{json.dumps(m.architecture.overrides(), sort_keys=True)}"


def engine_stats(engine: Engine, connector: KVConnector | None, audit: bool = False) -> dict[str, Any]:
    stats = dict(engine.stats())
    stats["kv_usage"] = stats.get("kv_cache_usage", 0.0)
    stats["prefix_hit_rate"] = stats.get("prefix_cache_hit_rate", 0.0)
    stats["transfer"] = _transfer_stats(connector)
    if connector is not None and (source := connector.stream_source()) is not None:
        stats["kv_stream"] = source  # what the router names in a streamed request's decode-side params
    if audit:  # takes the engine's step lock: only when asked for, never on the routine poll
        stats["audit"] = dataclasses.asdict(engine.audit())
    return stats


def _transfer_stats(connector: KVConnector | None) -> dict:
    """The connector's transfer figures, plus a failure total that is always present."""
    if connector is None:
        return {}
    stats = dict(connector.stats())
    stats["failures_total"] = sum(stats.get("failures", {}).values())
    return stats



def kv_listen_ports(connector: KVConnector | None) -> dict[str, int] | None:
    """A producer's KV listening ports (side channel, data streams), or None on a worker that has none.
    Served only on the authenticated health endpoint: a fault harness aims junk at them."""
    return None if connector is None else connector.listen_ports()


def kv_hashing_identity(engine: Engine) -> dict:
    """The engine's prefix-cache hashing identity (see `pd.cluster.kv_wire.hashing_identity`)."""
    groups = [{"kind": g.spec.kind, "block_size": g.spec.block_size, "sliding_window": g.spec.sliding_window_size}
              for g in engine.kv_cache_manager.kv_cache_config.groups]
    return hashing_identity(engine.block_hasher, groups)
