"""The router's section of a deployment config: its address, timeouts, limits, tenancy and
connection caps (validated once, like every section of `pd.cluster.config.DeployConfig`)."""
from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pd.cluster.admin_key import weakness
from pd.cluster.planner_config import PlannerSection
from pd.cluster.schema import FieldError, StrictModel

Positive = Annotated[float, Field(gt=0)]
TcpPort = Annotated[int, Field(ge=0, le=65535, description="TCP port; 0 = any free one")]
NonEmpty = Annotated[str, Field(min_length=1)]
TenantId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]


class ConnectionsSection(StrictModel):
    """What HTTP clients may hold open on the router and on each worker's HTTP API
    (pd.cluster.http_guard). A request's head must arrive whole within `header_timeout_s` of its
    first byte, its body within `body_timeout_s` of its head; a connection with no request in
    progress closes after `keepalive_timeout_s` (on a worker: `worker_keepalive_timeout_s`).
    Past `max_connections` (at most half the process's fd limit) or `max_connections_per_peer`
    from one address, a new connection closes the least recently used idle one first (or is
    refused when none is idle)."""

    header_timeout_s: Positive = 10.0
    body_timeout_s: Positive = 30.0
    keepalive_timeout_s: Positive = 15.0
    # longer than the router's own pooled keep-alive to its workers (aiohttp's client default, 15 s):
    # a worker must never close a connection the router is about to reuse
    worker_keepalive_timeout_s: float = Field(75.0, ge=20.0)
    max_connections: int = Field(8192, ge=16)
    max_connections_per_peer: int | None = Field(None, ge=1, description="empty: half of max_connections")

    @model_validator(mode="after")
    def _peer_cap_within_total(self) -> ConnectionsSection:
        if self.max_connections_per_peer is not None and self.max_connections_per_peer > self.max_connections:
            raise FieldError("max_connections_per_peer", "must not exceed max_connections")
        return self

    @property
    def peer_cap(self) -> int:
        return self.max_connections_per_peer or max(1, self.max_connections // 2)


class AuthThrottleSection(StrictModel):
    """How failed authentications back off, per client address (pd.router.auth_throttle): `burst`
    failures in a row, then one per 1/`per_s` seconds; past that every request from the address that
    needs a key gets 429 with Retry-After, a right weak key too (a strong one, 128+ estimated bits, is let
    through: pd.router.tenancy). The address is the client's behind `trusted_proxies`. At most
    `max_addresses` addresses are remembered (IPv6 grouped by /64); the one that failed least recently
    is forgotten first."""

    burst: int = Field(5, ge=1)
    per_s: Positive = Field(1.0, description="failures forgiven per second")
    max_addresses: int = Field(65536, ge=16)


class RouterSection(StrictModel):
    """The router's address, timeouts, request limits and admission control.

    Admission: at most `max_in_flight_per_worker` x (healthy decode or colocated workers)
    prompts run at once; up to `max_queued_requests` more wait (each at most
    `queue_timeout_s`); anything beyond is refused at once with 429 and `Retry-After`.
    """

    host: NonEmpty = Field("127.0.0.1", description="explicit bind address; never an implicit 0.0.0.0")
    port: TcpPort = 8000
    request_timeout_s: Positive = 120.0
    connect_timeout_s: Positive = 5.0
    health_interval_s: Positive = 2.0
    api_key: str | None = None  # one client key (its tenant id is "default"); api_keys names several
    # tenancy (pd.router.tenancy): tenant id -> API key; `admin_key` alone opens /pd/*, protected /metrics
    # and refreshes; per_api_key gives each tenant its own prefix cache (a salt derived from its id).
    # Empty isolation or metrics_auth: the safe choice for the keys set (`cache_isolation`, `metrics_protected`)
    api_keys: dict[TenantId, NonEmpty] = Field(default_factory=dict, description="tenant id -> API key")
    admin_key: NonEmpty | None = Field(None, description="32+ characters, 128+ bits (pd.cluster.admin_key)")
    prefix_cache_isolation: Literal["shared", "per_api_key"] | None = Field(
        None, description="empty: per_api_key with two or more API keys, else shared (then explicit)")
    report_cached_tokens: bool = Field(True, description="false: usage carries no prompt_tokens_details")
    report_route: bool = Field(False, description="true: responses carry pdkv_route (workers, predicted TTFTs)")
    first_token_from_prefill: bool = Field(True, description="P/D: P's first token goes to the client at once, D "
                                                             "goes on from it (not for seeded requests)")
    auth_throttle: AuthThrottleSection = Field(default_factory=AuthThrottleSection)
    # client addresses behind proxies (pd.router.client_address): a peer inside one of these networks has its
    # forwarded_header read (rightmost untrusted hop) for the auth throttle and the logs; empty: the peer's own
    trusted_proxies: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=1024, description="CIDRs of the proxies whose forwarded address is used")
    forwarded_header: Literal["x-forwarded-for", "forwarded"] = Field(
        "x-forwarded-for", description="the header the trusted proxies write (RFC 7239 `forwarded`: its for=)")
    refresh_min_interval_s: float = Field(1.0, ge=0.0, description="at most one ?refresh=1 poll per interval")
    max_body_bytes: int = Field(1024 * 1024, ge=1024, description="larger bodies get 413")
    max_prompt_tokens: int | None = Field(None, ge=1, description="empty: scheduler.max_model_len - 1")
    max_prompts_per_request: int = Field(16, ge=1)
    max_in_flight_per_worker: int = Field(32, ge=1)
    max_queued_requests: int = Field(64, ge=0)
    queue_timeout_s: Positive = 10.0
    retry_after_s: int = Field(1, ge=1)
    metrics_auth: bool | None = Field(None, description="GET /metrics requires the admin_key too; "
                                                         "empty: on when any API key is set")
    # worker choice (pd.router.choice): prefix_aware scores each worker by the formula `ttft_cost`,
    # hit_tokens - prefix_queue_weight * queued_tokens - prefix_running_weight * requests_in_flight
    policy: Literal["least_loaded", "round_robin", "prefix_aware"] = "least_loaded"
    prefix_queue_weight: float = Field(0.25, ge=0)  # measured: pd.router.choice.PrefixAware
    prefix_running_weight: float = Field(16.0, ge=0)
    kv_index_max_entries: int = Field(1_000_000, ge=1, description="router's prefix index cap, about 100 B each")
    # recovery (pd.router.recovery): a stream whose worker dies after tokens were sent continues on another
    # worker at most `migration_limit` times; a worker leaves the rotation after `max_failed_polls` failed
    # health polls and comes back after `num_readmit_probes` good ones in a row
    migration_limit: int = Field(2, ge=0)
    first_byte_timeout_s: Positive = Field(10.0,
                                           description="a worker's answer headers, separate from request_timeout_s")
    max_failed_polls: int = Field(2, ge=1)
    num_readmit_probes: int = Field(3, ge=1)
    readmit_interval_s: Positive = Field(0.25, description="probe pace of a worker out of the rotation")
    stats_timeout_s: Positive = 10.0
    planner: PlannerSection = Field(default_factory=PlannerSection)
    connections: ConnectionsSection = Field(default_factory=ConnectionsSection)

    def tenant_keys(self) -> dict[str, str]:
        """Every API key by tenant id (`api_key` is tenant "default")."""
        return ({"default": self.api_key} if self.api_key else {}) | dict(self.api_keys)

    @property
    def cache_isolation(self) -> Literal["shared", "per_api_key"]:
        """`prefix_cache_isolation`, or when unset per_api_key for two or more tenants (one tenant
        shares with nobody): a tenant must never read another's prompts unless `shared` is chosen."""
        if self.prefix_cache_isolation is not None:
            return self.prefix_cache_isolation
        return "per_api_key" if len(self.tenant_keys()) > 1 else "shared"

    @property
    def metrics_protected(self) -> bool:
        """`metrics_auth`, or when unset on with any API key: /metrics carries every worker's prefix
        cache hits, which would let one client learn what others sent."""
        return self.metrics_auth if self.metrics_auth is not None else bool(self.tenant_keys())

    @field_validator("admin_key")
    @classmethod
    def _admin_key_strong(cls, key: str | None) -> str | None:
        why = None if key is None else weakness(key)
        if why is not None:
            raise ValueError(why)
        return key

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, networks: list[str]) -> list[str]:
        for i, text in enumerate(networks):
            try:
                ipaddress.ip_network(text, strict=True)
            except ValueError as exc:
                raise ValueError(f"[{i}] {text!r} is not an IPv4/IPv6 network (a CIDR such as 10.0.0.0/8, "
                                 f"fd00::/8 or one address 192.0.2.7): {exc}") from None
        return networks

    @model_validator(mode="after")
    def _keys_apart(self) -> RouterSection:
        if self.api_key and self.api_keys.get("default", self.api_key) != self.api_key:
            raise FieldError("api_keys", "tenant id 'default' is api_key's; name the tenant otherwise")
        keys = list(self.tenant_keys().values())
        if len(set(keys)) != len(keys):
            raise FieldError("api_keys", "two tenants share one API key")
        if self.admin_key is not None and self.admin_key in keys:
            raise FieldError("admin_key", "must differ from every API key")
        if self.prefix_cache_isolation == "per_api_key" and not keys:
            raise FieldError("prefix_cache_isolation", "per_api_key needs api_key or api_keys")
        return self
