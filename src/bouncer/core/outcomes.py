"""What the core decides about a request, as typed values.

Every offered request ends in exactly one terminal outcome: completed, refused (with layer and
reason), expired, evicted, cancelled, or failed upstream. Turning an outcome into an HTTP status
happens in one place: `Refusal.status`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Layer(StrEnum):
    VALIDATION = "validation"  # 1: well-formed, authenticated, known model, parameters in range
    CONTEXT = "context"  # 2: prompt + max_tokens fit the context
    RATE = "rate"  # per-tenant rate limits and circuit breaker
    QUEUE = "queue"  # 4: waiting room bounds
    FLOW = "flow"  # 5: bands, shedding, TTL, eviction, drain
    SLO = "slo"  # deadline feasibility
    UPSTREAM = "upstream"  # the backend failed or refused


class Terminal(StrEnum):
    COMPLETED = "completed"
    REFUSED = "refused"
    EXPIRED = "expired"
    EVICTED = "evicted"
    CANCELLED = "cancelled"
    FAILED = "failed"


# HTTP status by reason; the reason names the cause so clients can tell "overloaded, retry soon"
# apart from "invalid, do not retry". 529 is "the fleet is saturated" (Anthropic's overloaded
# status, also Dynamo's), 429 is "you (the tenant) are over your limits".
STATUS_BY_REASON: dict[str, int] = {
    "invalid_request": 400,
    "invalid_parameter": 400,
    "context_length_exceeded": 400,
    "unauthenticated": 401,
    "model_not_allowed": 403,
    "model_not_found": 404,
    "body_too_large": 413,
    "rate_limited_requests": 429,
    "rate_limited_tokens": 429,
    "circuit_open": 429,
    "tenant_queue_full": 429,
    "deadline_infeasible": 429,
    "retry_past_deadline": 429,
    "queue_full": 529,
    "saturated": 529,
    "agent_window_full": 529,
    "evicted": 529,
    "ttl_expired": 503,
    "draining": 503,
    "no_backend": 503,
    "upstream_rejected": 400,  # the backend found the request invalid (its message is passed on)
    "upstream_refused": 503,  # every backend tried refused it for load, as many times as policy allows
    "upstream_error": 502,
    "upstream_timeout": 504,
    "request_timeout": 408,  # the client sent its headers or body too slowly
    "too_many_connections": 503,
    "internal_error": 500,  # a bug in the gateway: counted and logged, never expected
}


# refusals a retry of the same request cannot escape (it keeps its first attempt's deadline)
NEVER_RETRYABLE = frozenset({"retry_past_deadline"})


@dataclass(frozen=True, slots=True)
class Refusal:
    layer: Layer
    reason: str
    message: str
    retry_after: float | None = None  # seconds; set for every overload refusal
    param: str | None = None
    retryable: bool | None = None  # None: as its status says (overloads yes, invalid requests no)

    @property
    def status(self) -> int:
        return STATUS_BY_REASON[self.reason]

    @property
    def should_retry(self) -> bool:
        """Whether the same request may succeed if sent again (clients read x-should-retry)."""
        if self.retryable is not None:
            return self.retryable
        return self.reason not in NEVER_RETRYABLE and self.status in (429, 502, 503, 504, 529)

    @property
    def error_type(self) -> str:
        s = self.status
        if s == 401:
            return "authentication_error"
        if s == 403:
            return "permission_error"
        if s == 404:
            return "not_found_error"
        if s == 429:
            return "rate_limit_error"
        if s in (503, 529):
            return "overloaded_error"
        if s >= 500:
            return "api_error"
        return "invalid_request_error"
