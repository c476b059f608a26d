"""Which data path a consumer's streams take: chosen once per producer session from this side's
`data_path` setting and the producer's WELCOME (`choose_path`), then per stream at ATTACH
(`RECEIVERS` / `server_for`); a stream whose path cannot attach falls back along
`PathReceiver.fallback`, and says why in the log. How a stream reaches its pool's pages in host
memory (in place, or through the pinned staging ring) is chosen once too: `page_access_for`.

The setting's words (what a deployment writes) and the paths' words (what the code and the
logs say) differ on purpose where one word covers two paths:

| `data_path` | same host, CPU pool | same host, CUDA pool | same node, both GPU pools | other host |
|---|---|---|---|---|
| `auto` | shm_mapped | shm_staged | cuda_ipc | tcp |
| `shm` | shm_mapped | shm_staged | shm_staged | tcp (warned) |
| `shm_staged` | shm_staged | shm_staged | shm_staged | tcp (warned) |
| `cuda_ipc` | cuda_ipc, then shm_mapped | cuda_ipc | cuda_ipc | tcp (warned) |
| `tcp` | tcp | tcp | tcp | tcp |

(`auto` and `shm` take the same-host paths only when the producer offers shared memory.)
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import socket

from connectors.pages import KVPages
from connectors.zmq.paths.base import PathName, PathReceiver, PathServer, ServeSettings
from connectors.zmq.paths.cuda_ipc import CudaIpcReceiver, CudaIpcServer
from connectors.zmq.paths.page_access import InPlacePages, PageAccess
from connectors.zmq.paths.shm_mapped import ShmMappedReceiver, ShmMappedServer
from connectors.zmq.paths.shm_staged import ShmStagedReceiver, ShmStagedServer
from connectors.zmq.paths.staging_ring import DEFAULT_STAGING, StagedPages, StagingShape
from connectors.zmq.paths.tcp import TcpReceiver, TcpServer

logger = logging.getLogger(__name__)


class DataPath(str, enum.Enum):
    """The `data_path` setting: what a deployment asks for (see the table above)."""

    AUTO = "auto"  # same node, both pools on GPUs: cuda_ipc; same host: shared memory; else tcp
    CUDA_IPC = "cuda_ipc"  # the producer's CUDA pool mapped here, pages copied device to device; falls back to shm
    TCP = "tcp"
    SHM = "shm"  # shm_mapped for a CPU pool (falls back to shm_staged), shm_staged for a CUDA pool
    SHM_STAGED = "shm_staged"  # always through a staging segment


SERVERS: dict[PathName, type[PathServer]] = {
    PathName.TCP: TcpServer, PathName.SHM_MAPPED: ShmMappedServer, PathName.SHM_STAGED: ShmStagedServer,
    PathName.CUDA_IPC: CudaIpcServer}
RECEIVERS: dict[PathName, type[PathReceiver]] = {
    PathName.TCP: TcpReceiver, PathName.SHM_MAPPED: ShmMappedReceiver, PathName.SHM_STAGED: ShmStagedReceiver,
    PathName.CUDA_IPC: CudaIpcReceiver}


@dataclasses.dataclass(frozen=True)
class PathChoice:
    """A session's path, how many streams to open on it, and why it was picked (in words)."""

    path: PathName
    streams: int
    why: str


def choose_path(wanted: DataPath, welcome: dict, host_id: str, pool_device: str, num_tcp_streams: int,
                num_shm_streams: int) -> PathChoice:
    """The path of a producer session's data streams, given the setting and its WELCOME."""
    same_host = welcome["host_id"] == host_id
    offers_device = welcome.get("device") is True
    offers_shm = welcome["shm"] is True

    def pick(path: PathName, why: str) -> PathChoice:
        return PathChoice(path, num_tcp_streams if path is PathName.TCP else num_shm_streams, why)

    if wanted is DataPath.TCP:
        return pick(PathName.TCP, "asked for")
    if not same_host:
        return pick(PathName.TCP, "the producer is on another host")
    if wanted is DataPath.CUDA_IPC:
        return pick(PathName.CUDA_IPC, "asked for (same node)")
    on_gpu = pool_device == "cuda"
    if wanted is DataPath.AUTO and on_gpu and offers_device:
        return pick(PathName.CUDA_IPC, "same node, both pools on GPUs")
    if not offers_shm:
        return pick(PathName.TCP, "same host, but the producer offers no shared memory")
    if wanted is DataPath.SHM_STAGED:
        return pick(PathName.SHM_STAGED, "asked for (same host)")
    if on_gpu:
        why = "same host; our pool is on a GPU, " + ("so the pages are staged" if wanted is DataPath.SHM else
                                                    "the producer's is not (or it offers no device pool)")
        return pick(PathName.SHM_STAGED, why)
    return pick(PathName.SHM_MAPPED, "same host, our pool on the CPU: the producer's pool is mapped")


def log_choice(choice: PathChoice, wanted: DataPath, engine_id: str) -> None:
    """Says what `wanted` became for this producer, and why; a same-host path asked for and not
    taken is a warning."""
    level = logging.INFO
    if choice.path is PathName.TCP and wanted in (DataPath.SHM, DataPath.SHM_STAGED, DataPath.CUDA_IPC):
        level = logging.WARNING
    logger.log(level, "KV data path to %s: %s (data_path %s: %s), %d stream(s)", engine_id, choice.path.value,
               wanted.value, choice.why, choice.streams)


def page_access_for(pool: KVPages, staging: StagingShape = DEFAULT_STAGING) -> PageAccess:
    """How a stream reaches the pool's pages in host memory: a CPU pool's in place, a CUDA pool's
    (or a CPU pool's staged on purpose, in tests and --staged benchmarks) through the staging ring."""
    if pool.device.type == "cpu" and not staging.stage_host_pools:
        return InPlacePages(pool)
    return StagedPages(pool, staging)


def server_for(attach: dict, conn: socket.socket, pool: KVPages, access: PageAccess,
               settings: ServeSettings) -> PathServer:
    """The producer's half of the path an ATTACH names (a name it does not know: tcp)."""
    try:
        name = PathName(attach["mode"])
    except ValueError:
        name = PathName.TCP
    settings = dataclasses.replace(settings, checksums=attach.get("checksums") is True)
    return SERVERS[name](conn, pool, access, settings)
