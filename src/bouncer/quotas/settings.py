"""The config's quota sections: limits over calendar windows, groups of tenants, prices, and the
overflow targets a model may send what it would refuse to. `bouncer.config` holds them in
place (a tenant's `quota`, a model's `price` and `overflow`, the file's `quotas`)."""

from __future__ import annotations

import zoneinfo
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Unit = Literal["prompt_tokens", "completion_tokens", "total_tokens", "usd"]
WindowKind = Literal["hour", "day", "week", "month"]
OverQuotaAction = Literal["refuse", "demote", "divert"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _known_zone(name: str | None) -> str | None:
    if name is not None:
        try:
            zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {name!r} (an IANA name, e.g. UTC or Europe/Paris)") from exc
    return name


class Price(_Strict):
    """What a model's tokens cost, for quotas in money (unit `usd`)."""

    input_per_million: float = Field(ge=0, description="USD per million prompt tokens")
    output_per_million: float = Field(ge=0, description="USD per million completion tokens")

    def cost(self, prompt_tokens: float, completion_tokens: float) -> float:
        return (prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million) / 1e6


class QuotaLimit(_Strict):
    """At most `limit` of `unit` per calendar `window`; the window resets at its start in
    `time_zone` (a month on the 1st at 00:00, a week on Monday at 00:00)."""

    window: WindowKind = Field(description="hour, day, week (from Monday) or month")
    unit: Unit = Field("total_tokens", description="what is counted: prompt_tokens, completion_tokens, total_tokens, "
                                                   "or usd (at the models' prices)")
    limit: float = Field(gt=0, description="the most that may be spent in one window, in `unit`")
    time_zone: str | None = Field(None, description="IANA time zone the window is in; default: quotas.time_zone")
    shadow: bool = Field(False, description="counted and reported (metrics, /admin/state, `bouncer quota show`, "
                                            "bouncer_quota_shadow_over_total for each request past it) but never "
                                            "enforced: a budget being rolled out")

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, name: str | None) -> str | None:
        return _known_zone(name)


class TenantQuota(_Strict):
    """A tenant's own limits, and what happens to its requests once any limit that applies to it
    (its own or a group's) is spent."""

    limits: list[QuotaLimit] = Field(default_factory=list, description="its own limits (its groups' apply too)")
    over: OverQuotaAction = Field("refuse", description="past a limit: refuse (429 quota_exhausted, Retry-After "
                                                       "the window's reset), demote (served in demote_band, "
                                                       "sheddable, until the window resets), or divert (sent to "
                                                       "the model's overflow targets; refused where it has none)")
    demote_band: int = Field(-1, lt=0, description="the band its requests run in while over (sheddable: below 0)")


class QuotaGroup(_Strict):
    """Tenants that share limits: an organisation, a team. A tenant belongs to at most one group
    per level."""

    name: str = Field(min_length=1, description="the group's name in metrics and `bouncer quota`")
    level: str = Field("org", min_length=1, description="its level (org, team, ...): a tenant is in one group "
                                                        "per level at most")
    tenants: list[str] = Field(min_length=1, description="its tenants, by name")
    limits: list[QuotaLimit] = Field(min_length=1, description="what its tenants may spend together")


class Quotas(_Strict):
    """Where spend is kept (Redis: exact across gateways; make it durable with appendonly yes),
    and the groups' limits. Tenants' own limits are on each tenant (`quota`)."""

    url: str | None = Field(None, description="redis://... where spend is kept; default: shared_state.url")
    key_prefix: str = Field("bouncer:", min_length=1, description="every key written starts with it")
    time_zone: str = Field("UTC", description="the windows' time zone where a limit names none")
    lease_s: float = Field(60.0, ge=1, le=3600, description="a reservation its gateway stops renewing (it died) is "
                                                            "given back after this long, seconds")
    timeout_ms: float = Field(1000.0, gt=0, le=10_000, description="a Redis call slower than this, milliseconds, "
                                                                    "is a failure (spend is money: it waits longer "
                                                                    "than the shared rate limits do)")
    on_unavailable: Literal["fail-open", "fail-closed"] = Field(
        "fail-open", description="Redis unreachable: fail-open admits and writes the spend once Redis is back; "
                                 "fail-closed refuses limited tenants' requests (503 shared_state_unavailable)")
    groups: list[QuotaGroup] = Field(default_factory=list, description="groups of tenants with shared limits")

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, name: str) -> str:
        return _known_zone(name)  # type: ignore[return-value]

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("a redis://, rediss:// or unix:// URL")
        return url


class OverflowTarget(_Strict):
    """Where a model's requests go that it would refuse for load (saturated, queue full, TTL
    expired, deadline infeasible) or for quota (`over: divert`), for tenants with `overflow: true`:
    another model of this config, or an external OpenAI-compatible endpoint."""

    name: str = Field(min_length=1, description="the target's name in metrics, logs and the access line")
    model: str | None = Field(None, description="another model of this config (a Bouncer pool), admitted there as "
                                                "usual (never diverted again)")
    url: str | None = Field(None, description="an external endpoint's base URL (its /v1/... API), http(s)://")
    api_key_env: str | None = Field(None, description="the environment variable holding its API key (sent as "
                                                      "Authorization: Bearer)")
    upstream_model: str | None = Field(None, description="the model name it serves; default: the request's")
    requests_per_s: float | None = Field(None, gt=0, description="at most this many requests per second sent there "
                                                                 "(per gateway); unset: no limit")
    burst: int | None = Field(None, ge=1, description="its bucket's size; default 2 s of requests_per_s")
    price: Price | None = Field(None, description="what its tokens cost, for quotas in usd; default: the model's")

    @model_validator(mode="after")
    def _one_kind(self) -> OverflowTarget:
        if (self.model is None) == (self.url is None):
            raise ValueError(f"overflow target {self.name!r}: name either a `model` of this config or a `url`")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"overflow target {self.name!r}: url must be http:// or https://")
        if self.model is not None and (self.api_key_env or self.upstream_model):
            raise ValueError(f"overflow target {self.name!r}: api_key_env and upstream_model are for a `url` target")
        return self
