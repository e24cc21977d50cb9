"""What the core decides about a request, as typed, immutable values.

Every offered request ends in exactly one terminal outcome: completed, refused (with layer and
reason), expired, evicted, cancelled, failed upstream, or diverted (sent to an overflow target
instead of refused). Turning an outcome into an HTTP status
happens in one place: `Refusal.status`. The shells get decisions as events (`Dispatch`,
`Reject`, `Divert`, `Reclaimed`), immutable values (named tuples: cheap to make, once per request) that say
what to do and never let them reach into the core's state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Layer(StrEnum):
    VALIDATION = "validation"  # well-formed, authenticated, known model, parameters in range
    CONTEXT = "context"  # prompt + max_tokens fit the context
    RATE = "rate"  # per-tenant rate limits and circuit breaker
    QUEUE = "queue"  # waiting room bounds, usable backends
    FLOW = "flow"  # bands, shedding, TTL, eviction, drain, the agent window
    SLO = "slo"  # deadline feasibility
    UPSTREAM = "upstream"  # the backend failed or refused


class Terminal(StrEnum):
    COMPLETED = "completed"
    REFUSED = "refused"
    EXPIRED = "expired"
    EVICTED = "evicted"
    CANCELLED = "cancelled"
    FAILED = "failed"
    DIVERTED = "diverted"  # not served here: sent to an overflow target (`bouncer.core.fleet.overflow`)


class Reason(StrEnum):
    """Why a request was refused or ended; clients see it as the error's `code`."""

    INVALID_REQUEST = "invalid_request"
    INVALID_PARAMETER = "invalid_parameter"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNAUTHENTICATED = "unauthenticated"
    MODEL_NOT_ALLOWED = "model_not_allowed"
    MODEL_NOT_FOUND = "model_not_found"
    BODY_TOO_LARGE = "body_too_large"
    REQUEST_TIMEOUT = "request_timeout"  # the client sent its headers or body too slowly
    RATE_LIMITED_REQUESTS = "rate_limited_requests"
    RATE_LIMITED_TOKENS = "rate_limited_tokens"
    CIRCUIT_OPEN = "circuit_open"
    QUOTA_EXHAUSTED = "quota_exhausted"  # the tenant (or its group) spent a day's or month's quota (`bouncer.quotas`)
    SHARED_STATE_UNAVAILABLE = "shared_state_unavailable"  # the gateways' Redis is away, and the config fails closed
    OUTSIDE_PRESSURE = "outside_pressure"  # an outside signal (carbon, price) is high: its bands are shed
    TENANT_QUEUE_FULL = "tenant_queue_full"
    DEADLINE_INFEASIBLE = "deadline_infeasible"
    RETRY_PAST_DEADLINE = "retry_past_deadline"
    QUEUE_FULL = "queue_full"
    SATURATED = "saturated"
    EVICTED = "evicted"
    TTL_EXPIRED = "ttl_expired"
    DRAINING = "draining"
    NO_BACKEND = "no_backend"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    UPSTREAM_REJECTED = "upstream_rejected"  # the backend found the request invalid (its message is passed on)
    UPSTREAM_REFUSED = "upstream_refused"  # no backend will take it: they refuse it for load, or rest past its TTL
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    CLIENT_DISCONNECTED = "client_disconnected"  # how a cancelled request ended (not a refusal)
    INTERNAL_ERROR = "internal_error"  # a bug in the gateway: counted and logged, never expected


# HTTP status by reason; the reason names the cause so clients can tell "overloaded, retry soon"
# apart from "invalid, do not retry". 529 is "the fleet is saturated" (Anthropic's overloaded
# status, also Dynamo's), 429 is "you (the tenant) are over your limits".
STATUS_BY_REASON: dict[Reason, int] = {
    Reason.INVALID_REQUEST: 400,
    Reason.INVALID_PARAMETER: 400,
    Reason.CONTEXT_LENGTH_EXCEEDED: 400,
    Reason.UNAUTHENTICATED: 401,
    Reason.MODEL_NOT_ALLOWED: 403,
    Reason.MODEL_NOT_FOUND: 404,
    Reason.REQUEST_TIMEOUT: 408,
    Reason.BODY_TOO_LARGE: 413,
    Reason.RATE_LIMITED_REQUESTS: 429,
    Reason.RATE_LIMITED_TOKENS: 429,
    Reason.CIRCUIT_OPEN: 429,
    Reason.QUOTA_EXHAUSTED: 429,
    Reason.TENANT_QUEUE_FULL: 429,
    Reason.DEADLINE_INFEASIBLE: 429,
    Reason.RETRY_PAST_DEADLINE: 429,
    Reason.QUEUE_FULL: 529,
    Reason.SATURATED: 529,
    Reason.EVICTED: 529,
    Reason.TTL_EXPIRED: 503,
    Reason.DRAINING: 503,
    Reason.NO_BACKEND: 503,
    Reason.SHARED_STATE_UNAVAILABLE: 503,
    Reason.OUTSIDE_PRESSURE: 503,
    Reason.TOO_MANY_CONNECTIONS: 503,
    Reason.UPSTREAM_REJECTED: 400,
    Reason.UPSTREAM_REFUSED: 503,
    Reason.UPSTREAM_ERROR: 502,
    Reason.UPSTREAM_TIMEOUT: 504,
    Reason.INTERNAL_ERROR: 500,
}

RETRY_AFTER_MIN_S = 0.1  # sub-second values reach clients as `retry-after-ms` (the OpenAI SDKs read it)

# refusals a retry of the same request cannot escape (it keeps its first attempt's deadline)
NEVER_RETRYABLE = frozenset({Reason.RETRY_PAST_DEADLINE})
# A request refused or expired for these missed its TTFT SLO: its band counts a miss (`flow.band_slos`).
LATE_REASONS = frozenset({Reason.DEADLINE_INFEASIBLE, Reason.RETRY_PAST_DEADLINE, Reason.TTL_EXPIRED})


class Refusal(NamedTuple):
    layer: Layer
    reason: Reason
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


class Claim(NamedTuple):
    """With several gateways: what a dispatch asks of the state they share before it goes
    (`bouncer.core.sharing.claims`). The replica was placed on a view of the other gateways' load a sync
    old; the claim holds only if they have not added more there since than the room it left."""

    blocks: int  # the KV blocks this request will hold there (prompt and expected output)
    others_seen: int  # the blocks the other gateways held there, in the view it was placed on
    slack: int  # blocks the replica had left beyond this request, in that view


class Dispatch(NamedTuple):
    """Send this request to `replica` now."""

    request_id: str
    replica: str
    model: str
    tenant: str
    band: int  # its band when dispatched (lower than its tenant's if it was demoted)
    max_tokens: int  # after defaults and clamping: what to ask the engine for
    arrival: float
    dispatched_at: float
    predicted_ttft_s: float | None = None  # on that replica, corrected; None without a step-time model
    predicted_tpot_s: float | None = None
    predicted_late: bool = False  # found unable to meet its TTFT SLO and let through (not acted on)
    decode_replica: str | None = None  # disaggregated: the decode worker; `replica` is the prefill worker
    claim: Claim | None = None  # several gateways, the replica nearly full: claim it first (`core.claims`)
    cache_salt: str | None = None  # the engine's `cache_salt` for it: its tenant's (`fleet.cache_salt`)


class Reject(NamedTuple):
    """This request ends here with an error (refused, expired in the queue, or evicted)."""

    request_id: str
    refusal: Refusal
    terminal: Terminal
    tenant: str
    band: int | None


class Divert(NamedTuple):
    """Not served by this pool: send this request to the overflow target `target` (another
    model's pool, or an external endpoint) instead of refusing it with `refusal`, which is what a
    front that cannot divert answers."""

    request_id: str
    target: str
    refusal: Refusal
    tenant: str
    band: int | None
    max_tokens: int  # after defaults and clamping: what the target is asked for, as a replica would be


class Reclaimed(NamedTuple):
    """An admitted request's permit outlived its lease without the shell renewing it: the core
    took it back (a lost permit in the shell costs a slot for a while, not the fleet for ever)."""

    request_id: str
    tenant: str
    band: int
    replica: str
    age_s: float


Event = Dispatch | Reject | Divert | Reclaimed
