"""The first layers a request meets, cheapest first: who it is, whether it is valid, whether it
fits the context, and whether its tenant may send now.

- who it is: `tenant_book.TenantBook.identify` (its key names a tenant, or the default takes it);
- `validate`: a known model its tenant may use; parameters within `limits`;
- `context_budget`: prompt + max_tokens within the model's and tenant's context, max_tokens
  defaulted and clamped;
- `rate_charge`: what the gate will charge it, known before the offer;
- `TenantGate`: the tenant's circuit breaker, then its rate limits. The gate takes from both (a
  breaker's half-open probe, a rate-limit charge); whatever a later layer refuses, the core's
  finaliser gives back.
"""

from __future__ import annotations

from bouncer.config import Limits, ModelConfig, Tenant
from bouncer.core.intake.breaker import CircuitBreaker
from bouncer.core.intake.rate_limit import RateLimitStore
from bouncer.core.outcomes import Layer, Reason, Refusal
from bouncer.core.requests import RequestInfo


def validate_model(name: str, tenant: Tenant, model: ModelConfig | None) -> Refusal | None:
    if model is None:
        return Refusal(Layer.VALIDATION, Reason.MODEL_NOT_FOUND, f"The model `{name}` does not exist.",
                       param="model")
    if tenant.models and name not in tenant.models:
        return Refusal(Layer.VALIDATION, Reason.MODEL_NOT_ALLOWED,
                       f"tenant {tenant.name!r} may not use model `{name}`", param="model")
    return None


def validate(info: RequestInfo, tenant: Tenant, model: ModelConfig | None, limits: Limits) -> Refusal | None:
    refusal = validate_model(info.model, tenant, model)
    if refusal is not None:
        return refusal
    bad = Reason.INVALID_PARAMETER
    if info.prompt_tokens < 1:
        return Refusal(Layer.VALIDATION, bad, "the prompt is empty", param="prompt")
    if info.n < 1 or info.n > limits.max_n:
        return Refusal(Layer.VALIDATION, bad, f"n must be between 1 and {limits.max_n}", param="n")
    if info.best_of is not None and (info.best_of < 1 or info.best_of > limits.max_best_of):
        return Refusal(Layer.VALIDATION, bad, f"best_of must be between 1 and {limits.max_best_of}", param="best_of")
    if info.num_stop > limits.max_stop:
        return Refusal(Layer.VALIDATION, bad, f"at most {limits.max_stop} stop sequences", param="stop")
    if info.max_tokens is not None and info.max_tokens < limits.max_tokens_min:
        return Refusal(Layer.VALIDATION, bad, f"max_tokens must be at least {limits.max_tokens_min}",
                       param="max_tokens")
    return None


def context_budget(info: RequestInfo, tenant: Tenant, model: ModelConfig) -> int | Refusal:
    """The max_tokens it runs with: its own (capped by its tenant's) or its tenant's default,
    cut to what the context leaves; or why the context cannot hold it."""
    max_tokens = tenant.max_tokens_default if info.max_tokens is None else min(info.max_tokens, tenant.max_tokens_cap)
    limit = min(model.max_model_len, tenant.context_cap or model.max_model_len)
    if info.prompt_tokens >= limit:
        return Refusal(Layer.CONTEXT, Reason.CONTEXT_LENGTH_EXCEEDED,
                       f"This model's maximum context length is {limit} tokens; the prompt has "
                       f"{info.prompt_tokens}.", param="messages")
    if info.prompt_tokens + max_tokens > limit:
        if info.max_tokens is not None and info.max_tokens <= tenant.max_tokens_cap:
            return Refusal(Layer.CONTEXT, Reason.CONTEXT_LENGTH_EXCEEDED,
                           f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{info.prompt_tokens + max_tokens} tokens ({info.prompt_tokens} in the prompt, "
                           f"{max_tokens} for the completion).", param="max_tokens")
        max_tokens = limit - info.prompt_tokens
    return max_tokens


def rate_charge(info: RequestInfo, tenant: Tenant, model: ModelConfig | None, limits: Limits) -> int | None:
    """What `TenantGate.enter` will charge this request's token bucket (prompt + max_tokens
    after the context budget), for a shell that fetches the rate verdict from a shared store
    before the offer; None where its tenant has no rate limit or an earlier layer refuses it."""
    if not (tenant.rate_limit.requests_per_s or tenant.rate_limit.tokens_per_min):
        return None
    if model is None or validate(info, tenant, model, limits) is not None:
        return None
    max_tokens = context_budget(info, tenant, model)
    return None if isinstance(max_tokens, Refusal) else token_charge(info, max_tokens)


def token_charge(info: RequestInfo, max_tokens: int) -> int:
    """What a request charges its tenant's token bucket: its prompt, and max_tokens for each
    sequence it asks for (`n`, `best_of`)."""
    return info.prompt_tokens + max_tokens * info.sequences


class TenantGate:
    """Its circuit breaker, then its rate limits."""

    def __init__(self, rate_limits: RateLimitStore) -> None:
        self.rate_limits = rate_limits

    def enter(self, tenant: Tenant, breaker: CircuitBreaker, tokens: int, now: float) -> tuple[Refusal | None, bool]:
        """(refusal or None, whether it holds the breaker's one half-open probe). Passing
        charges `tokens` (and one request) to the tenant's rate limits."""
        wait, probe = breaker.allow(now)
        if wait is not None:
            return _circuit_open(tenant, wait), False
        limited = self.rate_limits.take(tenant.name, tokens, now)
        if limited is not None:
            if probe:
                breaker.release_probe()
            return _rate_limited(tenant, *limited), False
        return None, probe

    def closed(self, tenant: Tenant, breaker: CircuitBreaker, now: float) -> Refusal | None:
        """What `enter` would refuse any request of `tenant` with, whatever its size, taking
        nothing (a request whose prompt is not tokenized yet): its breaker open, or a rate limit
        with nothing left."""
        wait = breaker.wait(now)
        if wait is not None:
            return _circuit_open(tenant, wait)
        limited = self.rate_limits.blocked(tenant.name, now)
        return None if limited is None else _rate_limited(tenant, *limited)


def _circuit_open(tenant: Tenant, wait: float) -> Refusal:
    return Refusal(Layer.RATE, Reason.CIRCUIT_OPEN, f"tenant {tenant.name!r} is paused after repeated upstream "
                   f"failures", wait)


def _rate_limited(tenant: Tenant, reason: Reason, wait: float) -> Refusal:
    if reason is Reason.SHARED_STATE_UNAVAILABLE:
        return Refusal(Layer.RATE, reason, f"tenant {tenant.name!r}'s rate limits are kept in the gateways' shared "
                       f"state, which is unreachable (shared_state.on_unavailable: fail-closed)", wait)
    return Refusal(Layer.RATE, reason, f"tenant {tenant.name!r} is over its {reason.split('_')[-1]} rate limit",
                   wait)
