"""Per-tenant fairness at the edge: one tenant (an API key, or a client address when the server has no
keys) may hold at most ``max_requests`` router requests in flight and ``max_tokens`` queued tokens, so no
client can take the router's whole queue (``router.max_pending_requests``, which still caps everyone).

A request's cost is counted after it is planned, before anything is queued: one router request per
choice (``n`` x prompts), and per choice its prompt tokens plus its ``max_tokens`` (what it may occupy
at most). Over a limit it is a 429 with Retry-After naming that limit; a request that alone exceeds a
limit could never run, so it is a 400 instead. The cost is released when the answer is done or abandoned.
Not thread-safe: the server's event loop owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.http.errors import RETRY_AFTER_S, ApiError


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold at once; 0 turns a limit off."""

    max_requests: int = 256
    max_tokens: int = 1 << 22


class Lease:
    """What one admitted request holds of its tenant's quota; ``release()`` is idempotent."""

    def __init__(self, quotas: TenantQuotas, tenant: str, num_requests: int, num_tokens: int) -> None:
        self.quotas, self.tenant = quotas, tenant
        self.num_requests, self.num_tokens = num_requests, num_tokens
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.quotas._give_back(self)


class TenantQuotas:
    """The requests and tokens each tenant holds now; tenants holding nothing are forgotten."""

    def __init__(self, limits: TenantLimits) -> None:
        self.limits = limits
        self.num_requests: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}

    def check_room(self, tenant: str) -> None:
        """429 if ``tenant`` is at its request limit already (cheap: before the body is planned)."""
        limit = self.limits.max_requests
        held = self.num_requests.get(tenant, 0)
        if limit and held >= limit:
            raise self._full(
                f"{held} requests in flight", f"server.max_requests_per_key ({limit})", "requests"
            )

    def acquire(self, tenant: str, num_requests: int, num_tokens: int) -> Lease:
        """Admit a request of ``num_requests`` router requests and ``num_tokens`` tokens, or raise
        ApiError: 400 if it alone exceeds a limit, 429 (Retry-After) if the tenant's holdings would."""
        max_requests, max_tokens = self.limits.max_requests, self.limits.max_tokens
        if max_requests and num_requests > max_requests:
            raise ApiError(
                400,
                f"this request is {num_requests} sequences (n x prompts); "
                f"server.max_requests_per_key is {max_requests}",
                "n",
            )
        if max_tokens and num_tokens > max_tokens:
            raise ApiError(
                400,
                f"this request needs {num_tokens} tokens (prompt + max_tokens, per sequence); "
                f"server.max_tokens_per_key is {max_tokens}",
                "max_tokens",
            )
        held_requests = self.num_requests.get(tenant, 0)
        held_tokens = self.num_tokens.get(tenant, 0)
        if max_requests and held_requests + num_requests > max_requests:
            raise self._full(
                f"{held_requests} requests in flight",
                f"server.max_requests_per_key ({max_requests})",
                "requests",
            )
        if max_tokens and held_tokens + num_tokens > max_tokens:
            raise self._full(
                f"{held_tokens} tokens queued", f"server.max_tokens_per_key ({max_tokens})", "tokens"
            )
        self.num_requests[tenant] = held_requests + num_requests
        self.num_tokens[tenant] = held_tokens + num_tokens
        return Lease(self, tenant, num_requests, num_tokens)

    def _give_back(self, lease: Lease) -> None:
        requests = self.num_requests.get(lease.tenant, 0) - lease.num_requests
        tokens = self.num_tokens.get(lease.tenant, 0) - lease.num_tokens
        if requests <= 0:
            self.num_requests.pop(lease.tenant, None)
            self.num_tokens.pop(lease.tenant, None)
        else:
            self.num_requests[lease.tenant], self.num_tokens[lease.tenant] = requests, tokens

    @staticmethod
    def _full(held: str, limit: str, what: str) -> ApiError:
        return ApiError(
            429,
            f"this API key has {held}; the limit is {limit}: retry when some finish",
            code=f"key_{what}_limit",
            retry_after_s=RETRY_AFTER_S,
        )
