"""The deployments `pd.tools.pd_bench` compares, each worker in a process of its own, pinned.

- `colocated`: one worker (role both) on both cores, with two torch threads;
- `1p1d` (and `1p1d-<streaming>` where the config has `transfer.streaming`): P on one core and
  D on the other, one torch thread each: the same cores and total threads as colocated.
Per link: `loopback` (the shipped `data_path: auto`, shared memory on one host) and
`emulated` (`transfer.emulated_link`: tcp through a relay of the given bandwidth and latency).
The real Router runs in the benchmark's process (on a private event-loop thread, unpinned,
the same for every deployment), and loopback HTTP joins it to the workers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from pathlib import Path

from pd.cluster.config import DeployConfig, TransferSection, load_deploy_config
from pd.cluster.roles import Role
from pd.tools.pinned_deployment import PinnedDeployment, WorkerPlan


@dataclasses.dataclass(frozen=True)
class Variant:
    """One deployment of the comparison."""

    name: str  # e.g. colocated, 1p1d, 1p1d-chunk
    link: str  # loopback or emulated (colocated: no link)
    streaming: str | None = None  # transfer.streaming, where the config has it

    @property
    def label(self) -> str:
        return self.name if self.name == "colocated" else f"{self.name} {self.link}"


def streaming_modes() -> tuple[str, ...]:
    """The `transfer.streaming` modes beside `off` this version has (none before streaming exists)."""
    field = TransferSection.model_fields.get("streaming")
    if field is None:
        return ()
    return tuple(mode for mode in typing.get_args(field.annotation) if mode != "off")


def variants(links: tuple[str, ...]) -> list[Variant]:
    out = [Variant("colocated", "none")]
    for link in links:
        out.append(Variant("1p1d", link, "off" if streaming_modes() else None))
        out += [Variant(f"1p1d-{mode}", link, mode) for mode in streaming_modes()]
    return out


def deploy_config(variant: Variant, base: Path, bandwidth_mbps: float, latency_ms: float,
                  planner: dict | None = None) -> DeployConfig:
    """The variant's config from `base`; `planner` (`router.planner` fields, e.g. `mode`,
    `local_prefill_max_tokens`) says where a 1P1D request prefills: a short chat may prefill on
    D instead of queueing behind a document on P."""
    data = json.loads(load_deploy_config(base).to_json())
    data["topology"]["mode"] = "colocated" if variant.name == "colocated" else "disaggregated"
    data["router"].update(port=0, request_timeout_s=600.0, max_queued_requests=1024, health_interval_s=1.0)
    data["cache"]["kv_memory_mb"] = 512  # room for two chat streams beside two 2k-token documents
    data["scheduler"]["max_model_len"] = 2304
    data["transfer"].update(timeout_s=60.0, lease_s=60.0)
    if variant.link == "emulated":
        data["transfer"].update(data_path="tcp", emulated_link={"bandwidth_mbps": bandwidth_mbps,
                                                                "latency_ms": latency_ms})
    if variant.streaming is not None:
        data["transfer"]["streaming"] = variant.streaming
    if variant.name != "colocated":
        data["router"].setdefault("planner", {}).update(planner or {})
    return DeployConfig.from_dict(data)


def core_pair() -> tuple[int, int] | None:
    """Two cores this process may use (P on the first, D on the second), or None."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def worker_plans(variant: Variant) -> list[WorkerPlan]:
    cores = core_pair()
    if variant.name == "colocated":
        return [WorkerPlan("colocated-0", Role.BOTH, cores, 2)]
    return [WorkerPlan("prefill-0", Role.PREFILL, cores[:1] if cores else None, 1),
            WorkerPlan("decode-0", Role.DECODE, cores[1:] if cores else None, 1)]


def deployment(variant: Variant, config: DeployConfig) -> PinnedDeployment:
    """A variant's workers (pinned as its plan says) and its Router; a context manager."""
    return PinnedDeployment(config, worker_plans(variant), variant.label)
