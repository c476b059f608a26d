"""The deploy config's tensor-parallel settings: the TP degree of each role, and their checks.

`TPSettings` is the part of `topology` that says how many ranks (processes, one device each) a
worker of each role spans: `prefill_tp`, `decode_tp`, `colocated_tp` (1: one process, today's
path) and `tp_timeout_s`, the collective timeout within which a gang notices a rank that hangs.
`topology.cpus_per_worker`, `threads_per_worker` and `gpus_per_worker` are per rank.

`tp_problem(config)` is what `DeployConfig` checks across sections, naming the key to change:
- each role's TP against `model.architecture` (`pd.engine.parallel.tp.check_tp`: TP divides the
  query heads, TP and the KV heads divide one another; and TP divides the MLP width; the message
  names both numbers and the role). A checkpoint's shape is checked where it is read
  (`pd.deploy.config_check`, the workers);
- TP > 1 refuses what cannot run sharded: `attention_backend: fused` (its C++ kernel takes a
  whole model's packed weights), `transfer.streaming: layer` (it publishes slices from inside
  the forward of one process), `transfer.kv_audit_rate` above 0 (the audit recomputes on rank 0
  alone), and a GPU share below 1 on cuda (NCCL refuses two ranks on one GPU);
- a TP above 1 for a role the mode does not run is refused rather than ignored.
This module imports no torch: the router validates configs too.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from pd.cluster.schema import StrictModel
from pd.engine.parallel.tp import check_tp

DeployConfig = Any  # (pd.cluster.config.DeployConfig, which imports this module: named here, not imported)

MAX_TP = 64  # ranks of one worker: more than any node has devices
ROLE_TP_KEYS = {"prefill": "prefill_tp", "decode": "decode_tp", "both": "colocated_tp"}
_ROLE_NAMES = {"prefill": "prefill", "decode": "decode", "both": "colocated"}


class TPSettings(StrictModel):
    """Tensor parallelism per role (topology keys); 1 everywhere is a worker of one process."""

    prefill_tp: int = Field(1, ge=1, le=MAX_TP, description=(
        "ranks (processes, one device each) of every prefill worker; >1: a gang of Ray actors packed on one node"))
    decode_tp: int = Field(1, ge=1, le=MAX_TP, description="ranks of every decode worker")
    colocated_tp: int = Field(1, ge=1, le=MAX_TP, description="ranks of every colocated worker")
    tp_timeout_s: float = Field(30.0, gt=0, le=3600, description=(
        "with TP > 1: a collective waits this long for a rank that hangs before the gang is taken out and "
        "restarted (a rank that dies is seen at once); above the longest step a rank may take"))

    def tp_of(self, role: str) -> int:
        """The TP degree of a worker of `role` ('prefill', 'decode' or 'both')."""
        return int(getattr(self, ROLE_TP_KEYS[role]))


def roles_in_use(config: DeployConfig) -> list[str]:
    """The roles (Role values) whose workers the topology starts."""
    return ["both"] if config.topology.mode.value == "colocated" else ["prefill", "decode"]


def tp_problem(config: DeployConfig) -> tuple[str, str] | None:
    """(dotted key, why) for the first TP setting that cannot run, or None (see the module docstring)."""
    topo = config.topology
    used = roles_in_use(config)
    for role, key in ROLE_TP_KEYS.items():
        if role not in used and topo.tp_of(role) > 1:
            return (f"topology.{key}", f"is {topo.tp_of(role)} but topology.mode {topo.mode.value} starts no "
                    f"{_ROLE_NAMES[role]} worker; leave it at 1")
    for role in used:
        tp, key = topo.tp_of(role), f"topology.{ROLE_TP_KEYS[role]}"
        if tp == 1:
            continue
        if config.model.path is None:  # random weights: the shape is known here
            arch = config.model.architecture
            try:
                check_tp(tp, arch.num_heads, arch.num_kv_heads, _ROLE_NAMES[role])
            except ValueError as exc:
                return key, f"{exc} (model.architecture)"
            if arch.intermediate_size % tp:
                return key, (f"{_ROLE_NAMES[role]} TP {tp} and an MLP intermediate size of {arch.intermediate_size}: "
                             "TP must divide the intermediate size (model.architecture)")
        if config.model.attention_backend == "fused":
            return key, (f"is {tp}: model.attention_backend 'fused' runs a whole model's packed weights in one "
                         "process and cannot run a shard; use 'auto' or 'torch' with TP > 1")
        if config.transfer.streaming == "layer":
            return key, (f"is {tp}: transfer.streaming 'layer' publishes KV slices from inside one process's "
                         "forward, and a gang's KV is spread over its ranks; use 'chunk' or 'off' with TP > 1")
        if config.transfer.kv_audit_rate > 0:
            return key, (f"is {tp}: transfer.kv_audit_rate recomputes a pulled block on rank 0 alone, which holds "
                         "only its own heads; set it to 0 with TP > 1")
        if topo.device == "cuda" and topo.gpus_per_worker != 1.0:
            return key, (f"is {tp}: each rank needs a GPU of its own (NCCL refuses two ranks on one GPU); "
                         f"set topology.gpus_per_worker to 1 (it is {topo.gpus_per_worker:g})")
    return None


def checkpoint_tp_problem(config: DeployConfig, num_heads: int, num_kv_heads: int) -> str | None:
    """Why a checkpoint of this shape cannot be split by the config's TP degrees (None when it can)."""
    for role in roles_in_use(config):
        tp = config.topology.tp_of(role)
        if tp > 1:
            try:
                check_tp(tp, num_heads, num_kv_heads, _ROLE_NAMES[role])
            except ValueError as exc:
                return f"topology.{ROLE_TP_KEYS[role]}: {exc} (config.json of model.path)"
    return None
