"""pdkv as a Ray Serve application, for KubeRay's RayService (long-running serving).

    serveConfigV2:
      applications:
        - name: pdkv
          import_path: pd.deploy.serve_app:build
          args: {config: deploy/gpu-2p2d-k8s.yaml}

One Serve replica owns one pdkv `Deployment` (the worker actors and the router
on its own port, `router.port`); Serve keeps that replica alive, restarts it
when `check_health` fails, and tears it down on an upgrade. Clients talk to the
pdkv router directly (the Kubernetes Service points at it), not through Serve's
proxy: the router streams tokens itself. The replica asks for the custom
resource `pdkv_router`, which only the head node offers, so the router's port
is always on the head pod. `router.api_key` comes from the environment
(PDKV_API_KEY, set from a Kubernetes Secret); the config file holds no key.
"""
from __future__ import annotations

import logging
import os


from pd.cluster.config import DeployConfig
from pd.cluster.config_file import read_config_file

logger = logging.getLogger(__name__)

API_KEY_ENV = "PDKV_API_KEY"
ADMIN_KEY_ENV = "PDKV_ADMIN_KEY"
ROUTER_RESOURCE = "pdkv_router"


def config_from_file(path: str) -> DeployConfig:
    """The deployment config at `path`, with `router.api_key` from PDKV_API_KEY and
    `router.admin_key` from PDKV_ADMIN_KEY when those are set."""
    data = read_config_file(path)  # bounded: size, aliases, nesting (pd.cluster.config_file)
    for field, env in (("api_key", API_KEY_ENV), ("admin_key", ADMIN_KEY_ENV)):
        key = os.environ.get(env)
        if key:
            data.setdefault("router", {})[field] = key
    return DeployConfig.from_dict(data)


class PdkvService:
    """A Serve replica holding one running pdkv deployment.

    Guarantees: the router answers on `router.port` while the replica is healthy;
    `check_health` fails (and Serve replaces the replica) once no worker of a
    needed role is healthy; the deployment is stopped when the replica goes."""

    def __init__(self, config_path: str) -> None:
        from pd.deploy.launch import Deployment

        self._deployment = Deployment(config_from_file(config_path))
        self.url = self._deployment.start()
        logger.info("pdkv router serving at %s", self.url)

    def check_health(self) -> None:
        router = self._deployment.router
        if router is None:
            raise RuntimeError("pdkv router is not running")
        if not router.readiness.ready:  # (start() waited for it; a replica never serves before)
            raise RuntimeError(f"pdkv router not ready: {router.readiness.report()}")
        self._deployment.run_coro(router.poll_workers(), 30.0)
        roles = {w.endpoint.role for w in router.pool.all() if w.healthy}
        needed = {w.endpoint.role for w in router.pool.all()}
        if roles != needed:
            raise RuntimeError(f"pdkv: no healthy worker for {sorted(r.value for r in needed - roles)}")

    async def __call__(self, request) -> dict:
        return {"router": self.url, "workers": len(self._deployment.workers)}

    def __del__(self) -> None:
        deployment = getattr(self, "_deployment", None)
        if deployment is not None:
            deployment.stop()


def build(args: dict):
    """Serve application builder (`import_path: pd.deploy.serve_app:build`, `args: {config: PATH}`)."""
    from ray import serve

    if "config" not in args:
        raise ValueError("serve app args: 'config' (a deploy/*.yaml path) is required")
    service = serve.deployment(num_replicas=1, max_ongoing_requests=4, health_check_period_s=10,
                               health_check_timeout_s=60, graceful_shutdown_timeout_s=30,
                               ray_actor_options={"num_cpus": 1, "resources": {ROUTER_RESOURCE: 1}})(PdkvService)
    return service.bind(args["config"])
