"""Who a request is, what it may reach, and which prefix cache it shares.

`Tenancy` is built once from the router config and the deployment secret. It
sorts a request's path into client (`/v1/`), admin (`/pd/`, and `/metrics`
with `metrics_auth`, which is on by default once any API key is set) or open
(`/health`, ...) and checks its bearer key:

- client paths take an API key (`router.api_key`, tenant id "default", or any
  of `router.api_keys`) when any is configured; `tenant(request)` names the
  key's tenant for the endpoints;
- admin paths take `router.admin_key` alone: an API key there gets 403, any
  other key 401. With API keys but no admin key the admin paths are closed
  (403); with no key at all the deployment is open, as before keys existed;
- keys are compared in constant time, every configured key each time;
- an address whose keys failed too often waits (429, Retry-After)
  (pd.router.auth_throttle), unless its request holds a strong key (128+
  estimated bits, `pd.cluster.admin_key`: the admin key always, an API key
  when it is one): such a key is compared first, in constant time, and goes
  through as if no one had failed. A weak key or a wrong one from a throttled
  address gets the 429 unread, so the 200 a right guess would get never tells a
  guesser which of its guesses at a weak key was right; guessing a strong key is
  hopeless at any rate, so letting it through costs nothing. Each 401 and each
  such 429 is counted on /metrics;
- the address is the client's behind `router.trusted_proxies`
  (pd.router.client_address), else the TCP peer's.

Cache salts (`cache_salt`): `prefix_cache_isolation` left unset is per_api_key
once two or more API keys are set (`RouterSection.cache_isolation`). With `shared` the
client's `cache_salt` is used as given (vLLM's semantics: two requests share
cached blocks only with equal salts, none meaning "no salt"). With
`per_api_key` every tenant's salt is an HMAC-SHA256 of the deployment secret
over its tenant id (never its key) and the client's salt, if any: one tenant's
prompts never hit another tenant's blocks, whatever salts clients send, and
a tenant's own salt still separates its requests further.
"""
from __future__ import annotations

import hashlib
import hmac
import logging

from typing import TYPE_CHECKING

from aiohttp import web

from pd.cluster.admin_key import weakness
from pd.cluster.router_config import RouterSection
from pd.router.auth_throttle import AuthThrottle
from pd.router.client_address import ClientAddress
from pd.router.openai_api import APIError

if TYPE_CHECKING:
    from pd.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_SALT_CONTEXT = b"pdkv-cache-salt\x00"
CLIENT_KEY = web.RequestKey("pdkv_client_address", str)  # a request's resolved client address, once resolved


class Tenancy:
    def __init__(self, config: RouterSection, secret: str, metrics_auth: bool | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        """`metrics_auth` overrides the config's (None: `config.metrics_protected`); `metrics`, when
        given, counts failed and throttled authentications."""
        metrics_auth = config.metrics_protected if metrics_auth is None else metrics_auth
        self._api_keys = [(tenant_id, f"Bearer {key}".encode()) for tenant_id, key in config.tenant_keys().items()]
        # keys a throttled address may still use: guessing them is hopeless (module docstring)
        self._strong = {tenant_id for tenant_id, key in config.tenant_keys().items() if weakness(key) is None}
        self.client_address = ClientAddress(config.trusted_proxies, config.forwarded_header)
        self._admin = f"Bearer {config.admin_key}".encode() if config.admin_key else None
        self._admin_paths = ("/pd/", "/metrics") if metrics_auth else ("/pd/",)
        self.per_api_key = config.cache_isolation == "per_api_key"
        self._secret = secret.encode()
        self.throttle = AuthThrottle(config.auth_throttle)
        self._metrics = metrics

    def authorize(self, request: web.Request) -> APIError | None:
        """None when the request may go on; else the refusal to send."""
        path = request.path
        if path.startswith("/v1/"):
            if not self._api_keys:
                return None
            key_kind = "api_key"
        elif path.startswith(self._admin_paths) and (self._admin is not None or self._api_keys):
            key_kind = "admin_key"
        else:
            return None
        address = self.address(request)
        wait_s = self.throttle.retry_after_s(address)
        if wait_s is not None and not self._holds_strong_key(request):
            # a weak or wrong key waits unread: were a right weak key let through, 200 against 429 would
            # tell the guesser which guess was right
            if self._metrics is not None:
                self._metrics.record_auth_throttled()
            return APIError(429, f"too many failed authentications from this address; retry after {wait_s} s",
                            err_type="rate_limit_error", code="auth_rate_limited", headers={"Retry-After": str(wait_s)})
        refused = self._check_client(request) if key_kind == "api_key" else self._check_admin(request, path)
        if refused is not None and refused.status == 401:
            self.throttle.record_failure(address)
            if self.throttle.retry_after_s(address) is not None:  # this failure filled the bucket: once per episode
                via = f" (via proxy {request.remote})" if address != request.remote else ""
                logger.warning("too many failed authentications from %s%s: throttled", address, via)
            if self._metrics is not None:
                self._metrics.record_auth_failure(key_kind)
        return refused

    def address(self, request: web.Request) -> str | None:
        """The request's client address (pd.router.client_address), resolved once per request."""
        if CLIENT_KEY not in request:
            request[CLIENT_KEY] = self.client_address.of(request) or ""
        return request[CLIENT_KEY] or None

    def _holds_strong_key(self, request: web.Request) -> bool:
        """Whether the request's key is the admin key or a strong API key; every key is compared, each
        in constant time, so the time taken does not say which (or whether one) matched."""
        given = _header(request)
        admin = self._admin is not None and given is not None and hmac.compare_digest(given, self._admin)
        return admin | (self._tenant_of(given) in self._strong)

    def _check_client(self, request: web.Request) -> APIError | None:
        if self._tenant_of(_header(request)) is None:
            return APIError(401, "invalid or missing API key", code="invalid_api_key")
        return None

    def _check_admin(self, request: web.Request, path: str) -> APIError | None:
        given = _header(request)
        if self._admin is not None and given is not None and hmac.compare_digest(given, self._admin):
            return None
        if self._admin is not None and self._tenant_of(given) is not None:
            return APIError(403, "this endpoint takes the admin key (router.admin_key), not an API key",
                            err_type="permission_error", code="admin_key_required")
        if self._admin is None:
            hint = " (or set router.metrics_auth: false)" if path.startswith("/metrics") else ""
            return APIError(403, f"admin endpoints are closed: router.admin_key is not set{hint}",
                            err_type="permission_error", code="admin_key_required")
        return APIError(401, "invalid or missing admin key", code="invalid_api_key")

    def tenant(self, request: web.Request) -> str | None:
        """The tenant id of the request's API key (None: no key, or none configured)."""
        return self._tenant_of(_header(request)) if self._api_keys else None

    def _tenant_of(self, given: bytes | None) -> str | None:
        found = None
        for tenant_id, expected in self._api_keys:  # every key, so the time does not say which matched
            if given is not None and hmac.compare_digest(given, expected):
                found = tenant_id
        return found

    def cache_salt(self, tenant_id: str | None, client_salt: str | None) -> str | None:
        """The salt a request's prompt is hashed with (module docstring)."""
        if not self.per_api_key or tenant_id is None:
            return client_salt
        message = _SALT_CONTEXT + tenant_id.encode() + b"\x00"
        if client_salt is not None:
            message += b"\x01" + client_salt.encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def _header(request: web.Request) -> bytes | None:
    try:
        return request.headers.get("Authorization", "").encode("utf-8")
    except UnicodeEncodeError:  # a non-UTF-8 header arrives as surrogate escapes: no key of ours
        return None
