"""Bouncer's configuration: one YAML file, validated once, with errors that name the bad field.

Polarity is the same everywhere: a higher integer priority is more important; below zero is
sheddable. Times are seconds, sizes are tokens unless a name says otherwise.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bouncer.quotas.settings import OverflowTarget, Price, Quotas, TenantQuota

EngineKind = Literal["vllm", "sglang", "tgi", "llamacpp", "openai"]
# The policies a config may name. `bouncer.core.registry` maps each name to its implementation and
# checks, when imported, that it implements exactly these: a new policy is a name here and a line there.
FairnessName = Literal["round-robin", "wdrr"]
OrderingName = Literal["edf", "fcfs"]
SaturationDetectorName = Literal["utilization"]
RouterName = Literal["round-robin", "least-loaded", "llmd-scorers", "sglang-cache-aware", "prefix-aware"]
MAX_RECORDER_SAMPLES = 100_000  # the flight recorder's ring: an hour at 36 ms, a day at 0.9 s


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def key_digest(api_key: str) -> str:
    """API keys are stored and compared as SHA-256 hex digests, never in clear."""
    return hashlib.sha256(api_key.encode()).hexdigest()


class RateLimit(_Strict):
    """A tenant's rate limits, token buckets: past one, its requests are refused (429 with
    Retry-After) before they queue. With `shared_state`, enforced once for all gateways."""

    requests_per_s: float | None = Field(None, gt=0, description="sustained request rate, requests per second; "
                                                                 "unset: no request limit")
    request_burst: int | None = Field(None, ge=1, description="the request bucket's size, requests; default 2 s "
                                                              "of requests_per_s")
    tokens_per_min: float | None = Field(None, gt=0, description="sustained token rate, tokens per minute, each "
                                                                 "request counting prompt + max_tokens; unset: no "
                                                                 "token limit")
    token_burst: int | None = Field(None, ge=1, description="the token bucket's size, tokens; default 10 s worth of "
                                                            "tokens_per_min")


class SLO(_Strict):
    """A tenant's latency targets, which its requests are queued, refused and placed against;
    a request may tighten them (x-bouncer-ttft-ms, x-bouncer-tpot-ms), never loosen them."""

    ttft_s: float | None = Field(None, gt=0, description="time to first token, seconds from arrival at the gateway; "
                                                         "unset: no TTFT target")
    tpot_s: float | None = Field(None, gt=0, description="time per output token after the first (a request's mean), "
                                                         "seconds; unset: no TPOT target")
    on_infeasible: Literal["refuse", "best-effort"] = Field(
        "refuse", description="a request predicted to miss its TTFT SLO: refuse it (429 deadline_infeasible), "
                              "or serve it without a deadline in policy.best_effort_priority's band")


class Tenant(_Strict):
    """Who sends requests: a tenant is known by its API keys and has a band (its priority), a
    weight inside the band, limits and latency targets."""

    name: str = Field(min_length=1, description="the tenant's name in metrics, logs and errors; unique")
    api_keys_sha256: list[str] = Field(min_length=1, description="SHA-256 hex digests of the API keys (Authorization: "
                                                                 "Bearer KEY) that are this tenant's (`bouncer config "
                                                                 "hash-key KEY`); a key belongs to one tenant")
    priority: int = Field(0, description="its band: higher is more important and dispatched first; below 0 is "
                                         "sheddable (refused first under load)")
    weight: float = Field(1.0, gt=0, description="fair share inside its band, relative to the band's other tenants' "
                                                 "(tokens served, policy.fairness)")
    rate_limit: RateLimit = Field(RateLimit(), description="request and token rate limits; unset: none")
    max_tokens_default: int = Field(512, ge=1, description="max_tokens of a request that sets none, tokens")
    max_tokens_cap: int = Field(4096, ge=1, description="a larger max_tokens is cut to this, tokens")
    context_cap: int | None = Field(None, ge=1, description="prompt + max_tokens ceiling, tokens (tightened while "
                                                            "the pool is under pressure, policy."
                                                            "context_pressure_start); unset: the model's "
                                                            "max_model_len")
    kv_share: float = Field(0.0, ge=0, le=1, description="fraction of the pool's KV reserved for this tenant, lent "
                                                         "to others while it does not use it; the tenants' shares "
                                                         "add up to 1 at most")
    slo: SLO = Field(SLO(), description="latency targets; unset: none")
    queue_ttl_s: float | None = Field(None, gt=0, description="longest a request may wait queued, seconds (then 503 "
                                                              "with Retry-After); default: policy.default_ttl_s")
    models: list[str] = Field(default_factory=list, description="names of the models it may use; empty means all")
    fairness_ids: list[str] = Field(default_factory=list, description="values of x-llm-d-inference-fairness-id that "
                                                                      "name this tenant for a request whose API key "
                                                                      "names no tenant; read only with "
                                                                      "access.trust_fairness_id (a gateway in front "
                                                                      "that authenticates clients sets the header)")
    cache_group: str | None = Field(None, min_length=1, description="tenants of one cache group share their cached "
                                                                    "prompt prefixes on the engines (a shared system "
                                                                    "prompt stays shared); default: its own name, "
                                                                    "a cache of its own (`cache_isolation`)")
    quota: TenantQuota | None = Field(None, description="what it may spend per hour, day, week or month, and what "
                                                        "happens past it (`quotas` says where spend is kept); "
                                                        "unset: its groups' limits only, refused past them")
    overflow: bool = Field(False, description="its requests a model would refuse for load (saturated, queue full, "
                                              "TTL expired, deadline infeasible, no replica) go to the model's "
                                              "overflow targets instead")

    @field_validator("api_keys_sha256")
    @classmethod
    def _hex_digests(cls, keys: list[str]) -> list[str]:
        return _digests(keys)

    @model_validator(mode="after")
    def _default_within_cap(self) -> Tenant:
        if self.max_tokens_default > self.max_tokens_cap:
            raise ValueError("max_tokens_default must not exceed max_tokens_cap")
        return self


class KVGeometryConfig(_Strict):
    """The model's KV-cache geometry, which turns a backend's kv_cache_gb into blocks: KV bytes
    per token = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes."""

    layers: int = Field(ge=1, description="transformer layers")
    kv_heads: int = Field(ge=1, description="KV heads per layer (with GQA the KV heads, not the attention heads)")
    head_dim: int = Field(ge=1, description="elements per head")
    dtype_bytes: int = Field(2, ge=1, description="bytes per KV element (2: fp16 or bf16, 1: fp8)")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


class Backend(_Strict):
    """One replica of a model: an engine's OpenAI-compatible HTTP server."""

    url: str = Field(description="the engine's base URL, http:// or https:// (its /v1 API and /metrics)")
    name: str | None = Field(None, description="the replica's name in metrics, logs and /admin/state; default "
                                               "MODEL/INDEX")
    kv_blocks: int | None = Field(None, ge=1, description="KV-cache blocks (of block_size tokens) on the replica; "
                                                          "unset: scraped (vLLM's cache_config_info) or from "
                                                          "kv_cache_gb")
    kv_cache_gb: float | None = Field(None, gt=0, description="KV-cache memory, GB (10^9 bytes); blocks = bytes / "
                                                              "(the model's kv bytes per token x block_size)")
    kv_offload_blocks: int = Field(0, ge=0, description="host-memory KV blocks (vLLM --kv-offloading-size); the "
                                                        "approximate prefix index covers them too")
    kv_events: str | None = Field(None, description="the engine's KV-event publisher (vLLM --kv-events-config "
                                                    "endpoint), e.g. tcp://10.0.0.5:5557; makes the prefix "
                                                    "index precise")
    kv_events_topic: str = Field("", description="ZMQ topic to subscribe to (vLLM's default is empty: all)")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="disaggregated serving: a prefill worker computes prompts and hands their KV to a "
                            "decode worker; a model's backends are either all `both` or prefill and decode workers")

    @field_validator("kv_events")
    @classmethod
    def _zmq(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError("kv_events must be a ZMQ endpoint such as tcp://host:5557")
        return endpoint

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("backend url must start with http:// or https://")
        return url.rstrip("/")


class DnsDiscovery(_Strict):
    """Replicas from DNS: a Kubernetes headless Service's A or AAAA records (one per ready pod,
    at `port`), or its SRV records (each with its own port)."""

    name: str = Field(min_length=1, description="the name to resolve, e.g. vllm.inference.svc.cluster.local "
                                                "(SRV: _http._tcp.vllm.inference.svc.cluster.local)")
    record: Literal["A", "AAAA", "SRV"] = Field("A", description="A (IPv4) or AAAA (IPv6) addresses at `port`, or "
                                                                 "SRV records naming host and port")
    port: int | None = Field(None, ge=1, le=65535, description="the engines' port (A and AAAA; SRV records carry "
                                                                "their own)")
    scheme: Literal["http", "https"] = Field("http", description="the engines' URL scheme")
    server: str | None = Field(None, description="a resolver as HOST:PORT (or HOST, port 53); default: the "
                                                 "system's (/etc/resolv.conf, as a pod's is)")

    @model_validator(mode="after")
    def _port(self) -> DnsDiscovery:
        if self.record != "SRV" and self.port is None:
            raise ValueError(f"dns discovery of {self.record} records needs the engines' port")
        if self.record == "SRV" and self.port is not None:
            raise ValueError("dns discovery of SRV records takes each replica's port from its record: leave port out")
        return self


class FileDiscovery(_Strict):
    """Replicas from a watched file (a Kubernetes ConfigMap mounted in the pod), YAML or JSON: a
    list of URLs, of backend mappings (`url` and any of a backend's fields), or Prometheus
    file_sd groups (`targets: [host:port, ...]`)."""

    path: str = Field(min_length=1, description="the file, re-read when it changes")
    scheme: Literal["http", "https"] = Field("http", description="the URL scheme of file_sd targets (host:port)")


class Discovery(_Strict):
    """A model's replicas found while the gateway runs instead of listed: re-read every
    `interval_s` (and sooner after a failure). A replica that appears is scraped and gets work
    once its telemetry is fresh; one that disappears finishes what it holds and gets nothing new.
    An answer that fails or comes back empty keeps the last known set for `keep_last_s`, and says
    so (log, `bouncer_discovery_stale`, /admin/state)."""

    dns: DnsDiscovery | None = Field(None, description="from DNS records")
    file: FileDiscovery | None = Field(None, description="from a watched file")
    interval_s: float = Field(10.0, gt=0, le=3600, description="seconds between lookups")
    keep_last_s: float = Field(300.0, ge=0, description="seconds a failed or empty lookup keeps the last known "
                                                        "replicas before the model has none")
    kv_blocks: int | None = Field(None, ge=1, description="each found replica's KV-cache blocks (unset: scraped "
                                                          "or from kv_cache_gb)")
    kv_cache_gb: float | None = Field(None, gt=0, description="each found replica's KV-cache memory, GB")
    kv_offload_blocks: int = Field(0, ge=0, description="each found replica's host-memory KV blocks")
    kv_events_port: int | None = Field(None, ge=1, le=65535, description="each found replica's KV-event publisher "
                                                                          "port (tcp://ITS-HOST:PORT)")
    kv_events_topic: str = Field("", description="ZMQ topic to subscribe to")

    @model_validator(mode="after")
    def _one_source(self) -> Discovery:
        if (self.dns is None) == (self.file is None):
            raise ValueError("discovery takes one source: dns or file")
        return self

    @property
    def source(self) -> str:
        """The source in words, for logs and /admin/state."""
        if self.dns is not None:
            at = f" @{self.dns.server}" if self.dns.server else ""
            return f"dns {self.dns.record} {self.dns.name}{at}"
        return f"file {self.file.path}"  # type: ignore[union-attr]


StepTimeMode = Literal["learned", "given", "off"]


class StepTimeConfig(_Strict):
    """The engine's step time, a + b x batched tokens + c x context tokens read + d x attention
    pairs of prompt chunks (the simulator's engine model, docs/benchmarks/engine-model.md), from which TTFT
    and TPOT are predicted per replica and corrected online from what the gateway observes.
    `learned` (the default) fits the coefficients from the model's own requests
    (bouncer/core/learning/step_time_learner.py), with any given here as the prior; `given` uses them as
    stated; `off` predicts nothing (no SLO feasibility, TPOT hold or band protection)."""

    mode: StepTimeMode = Field("learned", description="learned (a, b, c, d if stated are the prior), given "
                                                      "(needs a and b), or off; default: given when a is stated, "
                                                      "else learned")
    a: float | None = Field(None, gt=0, description="seconds per step")
    b: float | None = Field(None, ge=0, description="seconds per batched token")
    c: float | None = Field(None, ge=0, description="seconds per context token attention reads")
    max_batched_tokens: int = Field(8192, ge=1, description="the engine's --max-num-batched-tokens: tokens "
                                                                 "one step computes at most")
    d: float | None = Field(None, ge=0, description="seconds per attention pair (a prompt token computed, a token "
                                                    "before it): prefill attention's compute, quadratic in the prompt")
    e: float | None = Field(None, ge=0, description="seconds of a first token outside the prefill steps (the step "
                                                    "under way, HTTP, event loops); learned, 0 when given")

    @model_validator(mode="before")
    @classmethod
    def _default_mode(cls, data: object) -> object:
        if isinstance(data, dict) and "mode" not in data and data.get("a") is not None:
            return {**data, "mode": "given"}  # coefficients stated, as before learning existed
        return data

    @model_validator(mode="after")
    def _mode(self) -> StepTimeConfig:
        if self.mode == "given" and (self.a is None or self.b is None):
            raise ValueError("step_time mode 'given' needs a and b (or leave them out to have them learned)")
        if self.mode == "learned" and 0 in (self.b, self.c, self.d, self.e):
            raise ValueError("a learned step time's prior needs every coefficient it states > 0")
        return self

    def coefficients(self, default: tuple[float, ...]) -> tuple[float, float, float, float, float]:
        """a, b, c, d, e: those stated, the rest from `default` (given: 0 for c, d and e)."""
        stated = (self.a, self.b, self.c, self.d, self.e)
        return tuple(v if v is not None else dv for v, dv in zip(stated, default, strict=True))  # type: ignore[return-value]


class DemandConfig(_Strict):
    """The demand signal an autoscaler reads (`bouncer_demand_replicas`): the replicas the offered
    traffic needs, refused requests included (bouncer/core/fleet/demand.py has the formula)."""

    window_s: float = Field(30.0, gt=0, le=3600, description="seconds over which arrivals and their mix are "
                                                             "averaged (exponentially): longer is steadier, slower")
    max_num_seqs: int = Field(256, ge=1, description="the engines' --max-num-seqs: the largest batch a replica runs "
                                                     "(a full KV cache or the TPOT SLO may cap it lower)")


class ModelConfig(_Strict):
    """A model the gateway serves, and the replicas that serve it."""

    name: str = Field(min_length=1, description="served model name clients ask for")
    engine: EngineKind = Field("vllm", description="the backends' engine, which says which metrics to scrape for "
                                                   "their load and KV (openai: none, a liveness probe; load from "
                                                   "the gateway's own accounting)")
    backends: list[Backend] = Field(default_factory=list, description="the replicas: all role `both`, or prefill "
                                                                      "and decode workers (or `discovery`)")
    discovery: Discovery | None = Field(None, description="find the replicas (role `both`) while running, from DNS or "
                                                          "a watched file, instead of listing them in `backends`")
    tokenizer: str | None = Field(None, description="the model's tokenizer.json path, so prompt token counts and "
                                                    "prefix blocks match the engine's; unset: an estimate of one "
                                                    "token per 4 UTF-8 bytes")
    tokenizer_cache_tokens: int = Field(4_000_000, ge=0, description="token ids of chat messages kept (4 bytes "
                                        "each), so a conversation sent again costs only its new messages; 0: off")
    max_model_len: int = Field(8192, ge=16, description="the model's context length, tokens: prompt + max_tokens "
                                                        "must fit (the engine's --max-model-len)")
    block_size: int = Field(16, ge=1, description="tokens per KV block (the engine's --block-size)")
    media_tokens: int = Field(1024, ge=0, description="prompt tokens each image, audio clip or video of a chat "
                                                      "message counts for admission (a model's count depends on "
                                                      "it and on the media: 576 an image for LLaVA-1.5, 256 for "
                                                      "Gemma 3); what a request is charged is the engine's own")
    kv: KVGeometryConfig | None = Field(None, description="the KV geometry, needed for a backend's kv_cache_gb")
    step_time: StepTimeConfig = Field(default_factory=StepTimeConfig,
                                      description="latency prediction (SLO feasibility, the TPOT hold): the engine's "
                                                  "step time, learned by default")
    upstream_model: str | None = Field(None, description="name the backends serve it under; default: name")
    hold_without_replicas_s: float = Field(0.0, ge=0, le=3600, description="seconds a request waits for a "
                                           "replica while the model has none that answers (scaled to zero, or "
                                           "every one starting), instead of 503 no_backend at once; past it, 503 "
                                           "no_backend. A client's shorter TTL still holds; its TTFT SLO is not "
                                           "planned on")
    demand: DemandConfig = Field(default_factory=DemandConfig, description="the demand signal for autoscalers: "
                                 "the replicas what arrives needs, from the step time")
    price: Price | None = Field(None, description="what its tokens cost, for quotas in usd")
    overflow: list[OverflowTarget] = Field(default_factory=list, description="where requests it would refuse go "
                                           "instead, in order (tenants with `overflow: true`, and those diverted "
                                           "for quota)")

    @field_validator("step_time", mode="before")
    @classmethod
    def _default_step_time(cls, value: object) -> object:
        return {} if value is None else value  # `step_time: null` is the default: learned

    @model_validator(mode="after")
    def _roles(self) -> ModelConfig:
        if self.discovery is not None:
            if self.backends:
                raise ValueError(f"model {self.name!r}: list its backends or find them by discovery, not both")
            return self
        if not self.backends:
            raise ValueError(f"model {self.name!r}: needs backends (at least one) or discovery")
        roles = {b.role for b in self.backends}
        if roles != {"both"} and roles != {"prefill", "decode"}:
            raise ValueError(f"model {self.name!r}: backends are either all role `both` (colocated) or prefill "
                             f"and decode workers, at least one of each (got {', '.join(sorted(roles))})")
        return self

    @property
    def disaggregated(self) -> bool:
        return bool(self.backends) and self.backends[0].role != "both"

    def with_backends(self, backends: list[Backend]) -> ModelConfig:
        """This model with the replicas its discovery found (already validated, one by one)."""
        return self.model_copy(update={"backends": backends})


class Queues(_Strict):
    """The gateway's waiting room, one per model: how many requests and prompt tokens may wait
    in all, per band and per tenant. At a cap, a newcomer evicts the lowest sheddable request
    queued below its band, or is refused with Retry-After."""

    max_requests: int = Field(2000, ge=0, description="requests queued in the whole waiting room")
    max_tokens: int = Field(4_000_000, ge=0, description="prompt tokens queued in the whole waiting room, tokens")
    band_max_requests: int = Field(1000, ge=0, description="requests queued in one priority band")
    tenant_max_requests: int = Field(256, ge=0, description="requests one tenant may have queued in a band "
                                                            "(429 tenant_queue_full past it)")
    tenant_max_tokens: int = Field(1_000_000, ge=0, description="prompt tokens one tenant may have queued in a band, "
                                                                "tokens (429 tenant_queue_full past it)")


class Telemetry(_Strict):
    """How the gateway reads each replica's load (the engine's /metrics), and what a replica whose
    reading is too old counts as."""

    scrape_interval_s: float = Field(0.25, gt=0, description="seconds between scrapes of each replica's metrics")
    staleness_s: float = Field(2.0, gt=0, description="telemetry older than this, seconds, makes a replica count as "
                                                      "on_stale says")
    on_stale: Literal["fail-closed", "fail-open"] = Field(
        "fail-closed", description="a replica with stale telemetry: fail-closed counts it saturated, fail-open "
                                   "judges it by the gateway's own accounting alone")
    alive_from_streams: bool = Field(True, description="a replica streaming tokens to the gateway's requests is "
                                                       "answering though its scrape is late or timed out: usable, "
                                                       "judged by the gateway's own accounting (fail-closed then "
                                                       "refuses only when an engine really stops answering)")


class Breaker(_Strict):
    """Each tenant's circuit breaker. A failure is a request of the tenant that ran into the
    context limit (a runaway) or timed out upstream; while open, the tenant's requests are
    refused, until one probe is let through and succeeds."""

    failures: int = Field(5, ge=1, description="failures (requests) within window_s that open the breaker")
    window_s: float = Field(30.0, gt=0, description="the sliding window failures are counted in, seconds")
    open_s: float = Field(15.0, gt=0, description="seconds open before one probe is let through")


class Saturation(_Strict):
    """Fleet saturation, which the band ceilings are compared with (1: saturated). llm-d's
    utilization detector: max(queue / queue threshold, KV / KV threshold) per replica, averaged
    over the replicas; llm-d's defaults are 5 and 0.8. Bouncer runs the pool hotter (vLLM
    preempts only at 100% KV) and leaves the margin to the band ceilings: sheddable bands stop at
    0.8 of this."""

    detector: SaturationDetectorName = Field("utilization", description="the saturation detector "
                                                                         "(bouncer.core.registry)")
    queue_depth_threshold: float = Field(8.0, gt=0, description="requests waiting in a replica's engine that make it "
                                                                "saturated (1)")
    kv_threshold: float = Field(0.95, gt=0, le=1, description="KV usage (fraction of the replica's blocks) that "
                                                              "makes it saturated (1)")



class Routing(_Strict):
    """Where admitted requests go. `prefix-aware` (Bouncer's) ranks replicas by a cost in units of
    `prefill_busy_tokens`: queue_weight x prefill tokens queued there + prefix_weight x this
    prompt's tokens not cached there + kv_weight x KV usage. The replica holding the longest cached
    prefix keeps the request unless its predicted TTFT (prefill work ahead plus its own) exceeds
    the cheapest replica's by more than sticky_margin (relative) plus sticky_slack_tokens."""

    router: RouterName = Field("prefix-aware", description="the router (bouncer.core.registry)")
    queue_weight: float = Field(1.0, ge=0, description="weight of the prefill tokens queued on a replica in its "
                                                       "cost (per prefill_busy_tokens)")
    prefix_weight: float = Field(1.0, ge=0, description="weight of this prompt's tokens not cached on a replica "
                                                        "(per prefill_busy_tokens)")
    kv_weight: float = Field(1.0, ge=0, description="weight of a replica's projected KV usage (a fraction)")
    sticky_margin: float = Field(1.0, ge=0, description="relative TTFT excess (a fraction of the cheapest replica's "
                                                        "predicted TTFT) at which a warm replica loses its claim")
    sticky_slack_tokens: int = Field(8192, ge=0, description="absolute prefill-token excess always tolerated "
                                                             "(one step's batch at vLLM's default budget)")
    kv_events_staleness_s: float = Field(10.0, gt=0, description="no KV event this long (seconds) after sending "
                                                                 "work there: fall back to the approximate index")
    # sglang-cache-aware, with the SGLang model gateway's defaults (docs/advanced_features/sgl_model_gateway.md)
    cache_threshold: float = Field(0.3, ge=0, le=1, description="sglang-cache-aware: share of the prompt a "
                                                                "worker's prefix match must cover to win")
    balance_abs_threshold: int = Field(64, ge=0, description="sglang-cache-aware: requests in flight by which the "
                                                             "most loaded worker must exceed the least (and by "
                                                             "balance_rel_threshold) for the least loaded to win")
    balance_rel_threshold: float = Field(1.5, ge=1, description="sglang-cache-aware: and the ratio, most over least "
                                                                "loaded, it must exceed")



class AgentWindowConfig(_Strict):
    """Agent-level admission (bouncer/core/agents/window.py): a window on active agents, AIMD on pool KV
    usage and prefix-cache hit rate. Defaults are the CONCUR paper's (alpha 2, beta 0.5, U_low
    0.2, U_high 0.5, H 0.2). Sessions come from `x-session-id`; with session_from_user the
    OpenAI `user` field counts too (off by default: chat apps set it per end user, and those are
    not agents whose steps share a growing prefix). A subagent's steps name their parent in
    `x-parent-session-id` and run in its slot; with subagent_separator, a session id
    `ROOT<separator>...` sent without that header names one too (WEKA's kv-cache-tester sends
    `PARENT:AGENT`)."""

    enabled: bool = Field(True, description="requests with x-session-id are steps of agents, admitted through the "
                                            "window; off: plain requests")
    session_from_user: bool = Field(False, description="the OpenAI `user` field names a session too")
    subagent_separator: str | None = Field(
        None, min_length=1, description="a session id ROOT<separator>REST with no x-parent-session-id is a subagent "
        "of the agent ROOT, in its slot (kv-cache-tester: ':'); off by default: ids may hold it for other reasons")
    initial: int = Field(16, ge=1, description="active agents allowed at start")
    min: int = Field(1, ge=1, description="active agents the window never shrinks below")
    max: int = Field(4096, ge=1, description="active agents the window never grows past")
    alpha: float = Field(2.0, gt=0, description="additive increase, agents per update, while pool KV usage < u_low")
    beta: float = Field(0.5, gt=0, lt=1, description="multiplicative decrease, a factor per update, while "
                                                     "thrashing (KV usage > u_high and hit rate < h_thresh)")
    u_low: float = Field(0.2, ge=0, le=1, description="pool KV usage (fraction) below which the window grows")
    u_high: float = Field(0.5, ge=0, le=1, description="pool KV usage (fraction) above which a low hit rate shrinks "
                                                       "the window; subagents' extra branches run only below it")
    h_thresh: float = Field(0.2, ge=0, le=1, description="prefix-cache hit rate (fraction) below which full KV is "
                                                         "thrashing")
    update_interval_s: float = Field(1.0, gt=0, description="seconds between the window's AIMD updates")
    idle_timeout_s: float = Field(30.0, gt=0, description="an agent with no step for this long, seconds, is no "
                                                          "longer active and frees its slot")
    memory_s: float = Field(86400.0, ge=0, description="an agent that idled out is remembered this long, seconds: "
                            "when it comes back, its steps go before those of new agents")
    max_remembered: int = Field(100_000, ge=0, description="agents that idled out remembered at most (the oldest "
                                                           "are forgotten first): a flood of one-step sessions costs "
                                                           "this much memory, no more")
    max_parallel: int = Field(8, ge=1, description="steps of one agent in flight at once, its subagents' included "
                              "(fan-out cap)")

    @model_validator(mode="after")
    def _ordered(self) -> AgentWindowConfig:
        if self.min > self.max or not self.min <= self.initial <= self.max:
            raise ValueError("need min <= initial <= max")
        if self.u_low > self.u_high:
            raise ValueError("u_low must not exceed u_high")
        return self


class Retries(_Strict):
    """How a client's retry of a request is treated. SDK clients say when they retry (openai-python
    and openai-node send `x-stainless-retry-count`); the gateway knows the request again by its
    tenant, model, prompt and max_tokens."""

    deadline: Literal["fresh", "first-attempt"] = Field(
        "first-attempt",
        description="first-attempt: a retry keeps its first attempt's TTFT deadline (what its user waits by), and "
                    "once that has passed it is what its tenant's slo.on_infeasible says: refused (429 "
                    "retry_past_deadline) or run best-effort, behind every request that can still meet its SLO; "
                    "fresh: a retry is a new request with its own deadline")
    remember_s: float = Field(120.0, gt=0, description="how long a request's first attempt is remembered, "
                                                            "seconds")
    max_remembered: int = Field(100_000, ge=1, description="most first attempts remembered (the oldest go first)")


class Policy(_Strict):
    """How the core admits, queues, orders and places requests, for every model."""

    kv_reservation: Literal["overcommit", "reserve"] = Field(
        "overcommit", description="the KV a request is planned to hold: overcommit, its prompt and its tenant's "
                                  "learned expected output; reserve, its prompt and all of max_tokens")
    kv_busy_threshold: float = Field(0.92, gt=0, le=1, description="projected KV usage (fraction of the replica's "
                                                                   "blocks) that marks a replica busy")
    kv_resume_threshold: float = Field(0.85, gt=0, le=1, description="a busy replica is usable again once its "
                                                                     "projected KV usage (fraction) is below this")
    top_band_kv_threshold: float = Field(0.97, gt=0, le=1, description="projected KV usage the highest band that "
                                                                       "sends, above band 0, may fill a replica "
                                                                       "to, past its busy mark: the others stop "
                                                                       "at kv_busy_threshold, leaving it headroom "
                                                                       "their long answers cannot take (below "
                                                                       "kv_busy_threshold: kv_busy_threshold)")
    prefill_busy_tokens: int = Field(8192, ge=1, description="queued prefill tokens that mark a replica full for "
                                                               "now: about one engine step (vLLM's default budget), "
                                                               "so backlogs wait in the gateway, where they are "
                                                               "ordered by priority and fairness (sheddable "
                                                               "requests' prefill alone does not mark it full for "
                                                               "bands >= 0)")
    max_inflight_per_replica: int = Field(1024, ge=1, description="requests in flight on one replica at most")
    fairness: FairnessName = Field("wdrr", description="how a band's tenants share it: wdrr (weighted deficit "
                                                       "round-robin in tokens) or round-robin "
                                                       "(bouncer.core.registry)")
    wdrr_quantum_tokens: int = Field(4096, ge=1, description="credit a tenant gets per WDRR turn, tokens, times its "
                                                             "weight")
    fair_hold_s: float = Field(5.0, ge=0, description="a tenant whose turn it is and whose queue head finds no "
                                                      "replica with room holds its band's room that long, seconds: "
                                                      "the others do not take it with smaller requests meanwhile "
                                                      "(0: they always may)")
    fleet_shares_window_s: float = Field(10.0, gt=0, description="with several gateways sharing state: tenants' "
                                                                 "served tokens decay with this time constant, "
                                                                 "seconds, so "
                                                                 "weighted shares across gateways hold over the "
                                                                 "recent past")
    fleet_shares_slack_tokens: float = Field(8192, ge=0, description="with several gateways sharing state: a "
                                                                     "tenant is held back while its served tokens "
                                                                     "over weight lead a tenant of its band queued "
                                                                     "at another gateway by more than this, tokens")
    ordering: OrderingName = Field("edf", description="which queued request goes first: edf (earliest TTFT "
                                                       "deadline) or fcfs (arrival order) (bouncer.core.registry)")
    default_ttl_s: float = Field(30.0, gt=0, description="longest a request may wait queued, seconds, where its "
                                                         "tenant sets no queue_ttl_s (then 503 with Retry-After)")
    band_ceilings: dict[int, float] = Field(default_factory=dict,
                                            description="saturation ceiling per priority band (band: ceiling): the "
                                                        "fleet saturation under which the band dispatches")
    default_ceiling: float = Field(1.0, gt=0, description="saturation ceiling for band 0 unless band_ceilings lists "
                                                          "it")
    priority_ceiling: float = Field(1.2, gt=0, description="saturation ceiling for bands above 0 not listed in "
                                                            "band_ceilings: protected traffic may run the pool "
                                                            "hotter")
    project_recent_dispatches: bool = Field(True, description="add what was sent since a replica's last scrape to "
                                                              "its scraped KV usage")
    sheddable_ceiling: float = Field(0.8, gt=0, description="saturation ceiling for bands below zero not listed in "
                                                            "band_ceilings")
    context_pressure_start: float = Field(0.8, ge=0, le=1, description="pool KV usage (fraction) above which context "
                                                                       "caps tighten: the prompt + max_tokens a "
                                                                       "request may dispatch with shrinks linearly "
                                                                       "from its cap toward "
                                                                       "context_pressure_min_fraction of it at full "
                                                                       "usage; longer ones wait")
    context_pressure_min_fraction: float = Field(0.25, gt=0, le=1, description="share of a context cap (a tenant's "
                                                                               "context_cap or max_model_len) left "
                                                                               "at full pool usage")
    drain_queue_cap: int = Field(64, ge=0, description="requests held per model while draining")
    upstream_refusal_cooldown_s: float = Field(0.5, ge=0, description="seconds a replica that refused a request "
                                                                      "rests, doubled for each refusal in a row (none "
                                                                      "started there between), or as long as its "
                                                                      "Retry-After says, up to "
                                                                      "upstream_refusal_cooldown_max_s")
    upstream_refusal_cooldown_max_s: float = Field(30.0, ge=0, description="the longest rest after refusals, "
                                                                          "seconds, whatever the doubling or a "
                                                                          "Retry-After")
    upstream_refusal_retries: int = Field(3, ge=1, description="a replica that refused this many requests in a row "
                                                               "while running none of ours refuses everything; a "
                                                               "request that every usable replica refuses so ends "
                                                               "with 503 upstream_refused")
    permit_lease_s: float = Field(60.0, gt=0, description="an admitted request's permit lives this many seconds "
                                                          "unless "
                                                          "the shell renews it (it does while the request runs); "
                                                          "one never renewed is reclaimed and counted, so a lost "
                                                          "permit costs a slot for a while, not for ever")
    inflight_drift_s: float = Field(30.0, gt=0, description="a replica's engine reporting fewer requests than the "
                                                            "gateway has in flight there for this long, "
                                                            "seconds, is reported")
    ttl_within_slo: bool = Field(True, description="a queued request expires once waiting longer would make it late: "
                                                   "its TTFT SLO minus its band's margin x the best predicted TTFT "
                                                   "at arrival (without a step-time model, slo_queue_fraction of "
                                                   "the SLO)")
    refuse_infeasible: bool = Field(True, description="act on requests predicted to miss their TTFT SLO (queue "
                                                      "wait + predicted TTFT on the best replica; without a "
                                                      "step-time model: wait > slo_queue_fraction of the SLO) as "
                                                      "their tenant's slo.on_infeasible says; off: only flag them")
    ttft_safety_factor: float = Field(2.0, ge=1, description="until its band's margin is measured (the p90 of its "
                                                             "observed / predicted TTFT over 32 first tokens or "
                                                             "more, core/learning/ttft_margin.py), a queued request's "
                                                             "budget leaves room for this many times its best "
                                                             "predicted TTFT: it is refused at arrival, or leaves "
                                                             "the queue, that much earlier")
    standing_queue_share: float = Field(0.7, gt=0, le=1, description="while a tenant's queue in a band stands (its "
                                                                     "mean wait over an interval was more than half "
                                                                     "its TTFT SLO: sustained overload, where a "
                                                                     "longer queue serves no more, only later), its "
                                                                     "newcomers are planned on this share of what "
                                                                     "their SLO leaves; sheddable bands never "
                                                                     "stand (bouncer/core/flow/standing_queue.py; "
                                                                     "1: off)")
    best_effort_priority: int = Field(-1, description="band of requests served best-effort after their deadline "
                                                      "was found infeasible")
    tpot_hold: bool = Field(True, description="hold a request while sending it would raise a replica's predicted "
                                              "TPOT past the strictest TPOT SLO running there (needs a step time: "
                                              "given, or learned and warm)")
    ttft_reserve_fraction: float = Field(0.25, ge=0, le=1, description="a lower band's request is held where it "
                                                                       "would push the predicted TTFT of a higher "
                                                                       "band's next request past this share of "
                                                                       "that band's TTFT SLO (0: off; needs "
                                                                       "a step time)")
    tpot_reserve_fraction: float = Field(0.3, ge=0, lt=1, description="while a higher band sends, a lower band's "
                                                                      "request joins a batch only while its "
                                                                      "predicted TPOT stays this share below the "
                                                                      "higher band's TPOT target, leaving room for "
                                                                      "that band's next requests (0: off; needs "
                                                                      "a step time)")
    slo_queue_fraction: float = Field(0.6, gt=0, le=1, description="share of the TTFT SLO a request may spend "
                                                                   "queued; the rest is for prefill")
    tpot_guard: bool = Field(True, description="per replica, cut the in-flight limit when completed requests "
                                               "ran slower than their TPOT SLO, or the queued prefill it "
                                               "takes where short answers did (AIMD)")
    tpot_guard_margin: float = Field(0.9, gt=0, le=1, description="the TPOT guard's target: the strictest TPOT SLO "
                                                                  "x this (a fraction)")
    tpot_guard_increase: float = Field(0.25, gt=0, description="requests added to the in-flight limit per fast "
                                                               "completion")
    min_inflight_per_replica: int = Field(4, ge=1, description="requests: the TPOT guard never cuts a replica's "
                                                               "in-flight limit below this")
    expected_output_default: int = Field(256, ge=1, description="output tokens a request is expected to produce "
                                                                "before any of its tenant's requests has finished "
                                                                "(then learned)")
    queues: Queues = Field(Queues(), description="the waiting room's caps")
    retries: Retries = Field(Retries(), description="how a client's retry of a request is treated")
    routing: Routing = Field(Routing(), description="which replica an admitted request goes to")
    agents: AgentWindowConfig = Field(AgentWindowConfig(), description="the active-agent window (requests with "
                                                                       "x-session-id)")
    telemetry: Telemetry = Field(Telemetry(), description="scraping the replicas, and what stale telemetry means")
    breaker: Breaker = Field(Breaker(), description="each tenant's circuit breaker")
    saturation: Saturation = Field(Saturation(), description="how fleet saturation is computed")



    @model_validator(mode="after")
    def _hysteresis(self) -> Policy:
        if self.kv_resume_threshold > self.kv_busy_threshold:
            raise ValueError("kv_resume_threshold must not exceed kv_busy_threshold")
        return self


class Limits(_Strict):
    """Limits on a request's shape, checked first: past one, it is refused (400, 413 for the body)."""

    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body, bytes (413 past it)")
    max_n: int = Field(1, ge=1, description="largest `n`, completions per request")
    max_best_of: int = Field(1, ge=1, description="largest `best_of`, candidates per request")
    max_stop: int = Field(4, ge=0, description="most stop sequences in `stop`")
    max_tokens_min: int = Field(1, ge=1, description="smallest max_tokens a request may ask for, tokens")


class Listen(_Strict):
    """The gateway's own HTTP server, and how long it waits for slow or idle clients."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's line and headers must arrive within "
                                                            "this many seconds of its first byte (else 408, closed)")
    body_timeout_s: float = Field(30.0, gt=0, description="its body within this many seconds of its headers (else "
                                                          "408)")
    idle_timeout_s: float = Field(75.0, gt=0, description="a keep-alive connection with no request this many "
                                                          "seconds is closed")
    send_timeout_s: float = Field(30.0, gt=0, description="a client that takes none of its answer for this many "
                                                          "seconds (its connection's send buffer full) is cut off: "
                                                          "its request ends as cancelled, its permit goes back, and "
                                                          "it pays for what was generated")
    max_connections: int = Field(4096, ge=1, description="open client connections; one more is answered 503 and "
                                                         "closed")
    drain_s: float = Field(60.0, ge=0, description="after SIGTERM (a pod stopping): /ready answers 503 while the "
                                                   "requests queued and in flight finish, for up to this many "
                                                   "seconds; then the gateway exits")


class Objective(_Strict):
    """An inference objective (llm-d's `InferenceObjective`): a name clients send in
    `x-llm-d-inference-objective` to run a request in a lower band than its tenant's."""

    name: str = Field(min_length=1, description="as sent in x-llm-d-inference-objective (or x-gateway-inference-"
                                                "objective)")
    priority: int = Field(description="its band; a request runs in the lower of this and its tenant's priority")


class PickerTLS(_Strict):
    """TLS on the picker's gRPC port, and who may speak to it: with `client_ca_file`, only a client
    (Envoy) presenting a certificate that CA signed (mutual TLS). `bouncer envoy-config
    --picker-ca --picker-client-cert --picker-client-key` writes Envoy's side."""

    cert_file: str = Field(description="the picker's certificate chain, PEM")
    key_file: str = Field(description="its private key, PEM")
    client_ca_file: str | None = Field(None, description="the CA that signs the certificates Envoy presents, PEM: "
                                                         "without one, a client is refused; unset: TLS, any client")


class PickerFront(_Strict):
    """`bouncer serve --mode epp`: Envoy's external processor (the Gateway API Inference
    Extension's endpoint picker) instead of the HTTP proxy; `listen` then serves only /metrics,
    /admin, /ui, /health and /ready."""

    host: str = Field("127.0.0.1", description="address the ext_proc gRPC server listens on")
    port: int = Field(9002, ge=0, le=65535, description="its port (llm-d's picker uses 9002); the gRPC health "
                                                        "service answers there too")
    advertise: str | None = Field(None, description="HOST:PORT at which Envoy reaches this picker (default: host:port; "
                                                   "with several pickers, the address `bouncer envoy-config --picker` "
                                                   "names it by, so each request's access log entry comes back here)")
    answers_read_whole: int = Field(1, ge=0, description="answers read to their end at once, for their usage (output "
                                                         "lengths, TPOT); every other answer is read to its first "
                                                         "chunk only (Envoy's buffered setup; full duplex reads all). "
                                                         "Each chunk of one read whole costs a gRPC round trip, in "
                                                         "its client's way: a new one begins at most every 0.1 s")
    tls: PickerTLS | None = Field(None, description="TLS (and, with a client CA, mutual TLS) on the gRPC port; "
                                                    "unset: plain connections, which anyone who reaches the port "
                                                    "may use to route or end requests: bind it where only Envoy "
                                                    "reaches it")
    end_unseen_after_s: float = Field(3600.0, gt=0, description="a routed request whose end Envoy's access log never "
                                                                "reported (an Envoy that died with it in flight) is "
                                                                "given up on after this many seconds: its permit goes "
                                                                "back, counted in bouncer_picker_ends_unseen_total")


def _digests(keys: list[str]) -> list[str]:
    for k in keys:
        if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
            raise ValueError("each key must be a lowercase SHA-256 hex digest (64 chars); "
                             "see `bouncer config hash-key`")
    return keys


class Access(_Strict):
    """Who may read the endpoints that are not generation: by default anyone may read /metrics
    (which names every tenant and its traffic) and /v1/models."""

    metrics_keys_sha256: list[str] = Field(default_factory=list, description="non-empty: /metrics needs one of "
                                                                             "these keys or an admin key")
    models_need_key: bool = Field(False, description="/v1/models needs a tenant's key and lists the models that "
                                                     "tenant may use")
    viewer_keys_sha256: list[str] = Field(default_factory=list, description="keys that may read the flight "
                                                                            "recorder (/admin/timeline, the page at "
                                                                            "/ui) and nothing else of /admin")
    trust_fairness_id: bool = Field(False, description="x-llm-d-inference-fairness-id (or x-gateway-inference-"
                                                       "fairness-id) names a tenant (its `fairness_ids`) for a request "
                                                       "whose API key names none. Only behind a gateway that "
                                                       "authenticates every client and sets the header itself, "
                                                       "replacing any a client sent: otherwise any client could name "
                                                       "any tenant. Off: the header is ignored")

    @field_validator("metrics_keys_sha256", "viewer_keys_sha256")
    @classmethod
    def _hex_digests(cls, keys: list[str]) -> list[str]:
        return _digests(keys)


class Recorder(_Strict):
    """The flight recorder: a sample of the gateway's decisions and the fleet's state every
    `step_s`, the last `horizon_s` of them kept in memory (/admin/timeline, /ui)."""

    enabled: bool = Field(True, description="take samples; off: /admin/timeline and /ui have none")
    step_s: float = Field(0.25, ge=0.05, le=60.0, description="seconds between samples")
    horizon_s: float = Field(900.0, gt=0.0, le=86400.0, description=f"seconds of samples kept in memory; "
                                                                    f"horizon_s / step_s is at most "
                                                                    f"{MAX_RECORDER_SAMPLES:,} samples")

    @model_validator(mode="after")
    def _bounded(self) -> Recorder:
        if self.horizon_s / self.step_s > MAX_RECORDER_SAMPLES:
            raise ValueError(f"horizon_s / step_s = {self.horizon_s / self.step_s:.0f} samples: at most "
                             f"{MAX_RECORDER_SAMPLES} (a longer step, or a shorter horizon)")
        if self.horizon_s < self.step_s:
            raise ValueError("horizon_s must hold at least one step_s")
        return self


class Logging(_Strict):
    """The gateway's log lines, on standard error."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="the least severe level logged")
    format: Literal["logfmt", "json", "text"] = Field("logfmt", description="logfmt and json: one structured line "
                                                                            "per event")
    access_log: bool = Field(True, description="one line per request: tenant, band, outcome, layer, reason, "
                                               "queue wait, TTFT, tokens")


class SchedulePoint(_Strict):
    at: str = Field(pattern=r"^([01]\d|2[0-3]):[0-5]\d$", description="HH:MM, UTC: the value holds from then on")
    value: float = Field(description="the signal's value from `at` on")


class PressureSource(_Strict):
    """Where an outside signal's value comes from. `file`: a file holding a number, or JSON with
    `field` (its age is the file's age); `http`: a GET answering a number, or JSON with `field`
    (its age: since the poll, or since `timestamp_field`, epoch seconds, where given);
    `schedule`: values by UTC time of day, each from its `at` on (always fresh)."""

    kind: Literal["file", "http", "schedule"] = Field(description="where the value comes from")
    path: str | None = Field(None, description="file: the file holding the value")
    url: str | None = Field(None, description="http: the URL a GET reads the value from")
    field: str | None = Field(None, description="a dotted path into a JSON answer, e.g. data.intensity")
    timestamp_field: str | None = Field(None, description="http: a dotted path into the JSON answer to the time "
                                                          "the value is from, epoch seconds; unset: the poll's time")
    schedule: list[SchedulePoint] = Field(default_factory=list, description="schedule: the values by UTC time of day")

    @model_validator(mode="after")
    def _complete(self) -> PressureSource:
        if self.kind == "file" and not self.path:
            raise ValueError("a file source needs path")
        if self.kind == "http" and not (self.url and self.url.startswith(("http://", "https://"))):
            raise ValueError("an http source needs an http:// or https:// url")
        if self.kind == "schedule" and not self.schedule:
            raise ValueError("a schedule source needs at least one point")
        return self


class Pressure(_Strict):
    """A pressure from outside the cluster (grid carbon intensity, an energy price): while its
    value is above `shed_above`, the listed bands and tenants are refused (503
    `outside_pressure`), until it falls below `resume_below`."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="the signal's name in metrics (the "
                                                                          "signal label), logs and refusals; unique")
    source: PressureSource = Field(description="where its value comes from")
    poll_s: float = Field(30.0, ge=0.1, le=86400.0, description="seconds between reads of the source (and the "
                                                                "Retry-After of its refusals)")
    stale_s: float = Field(120.0, gt=0.0, description="a value older than this, seconds, is stale: on_stale "
                                                      "decides")
    on_stale: Literal["fail-open", "fail-closed"] = Field(
        "fail-open", description="with no fresh value (before the first poll too): fail-open sheds nothing, "
                                 "fail-closed sheds as if the value were high")
    shed_above: float = Field(description="while the value is above this (in the signal's own unit, e.g. "
                                          "gCO2/kWh), its bands and tenants are shed")
    resume_below: float | None = Field(None, description="shedding stops once the value is below this (hysteresis); "
                                                         "default shed_above")
    bands: list[int] = Field(default_factory=list, description="tenants of these priorities are shed")
    tenants: list[str] = Field(default_factory=list, description="and these tenants, by name")

    @model_validator(mode="after")
    def _sheds_something(self) -> Pressure:
        if not self.bands and not self.tenants:
            raise ValueError("name the bands or tenants it sheds")
        if self.resume_below is not None and self.resume_below > self.shed_above:
            raise ValueError("resume_below must not be above shed_above")
        return self


class Tracing(_Strict):
    """OpenTelemetry traces, sent over OTLP/gRPC: a span per request (the proxy front) with its
    admission, its upstream call and its first token, continuing the client's W3C `traceparent`
    and handing the upstream call's to the engine."""

    endpoint: str = Field(description="the collector's OTLP/gRPC endpoint, http://HOST:4317 (https:// for TLS)")
    service_name: str = Field("bouncer", min_length=1, description="service.name of the spans")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of requests traced, drawn by the gateway "
                                                             "(a client's traceparent is continued, its sampled flag "
                                                             "not obeyed unless follow_client_sampling)")
    follow_client_sampling: bool = Field(False, description="a client's traceparent decides whether its request is "
                                                            "traced (sampled or not): only for clients trusted not "
                                                            "to mark every request sampled, each exported at the "
                                                            "gateway's cost")
    headers: dict[str, str] = Field(default_factory=dict, description="headers sent with each export (a "
                                                                      "collector's auth)")

    @field_validator("endpoint")
    @classmethod
    def _url(cls, endpoint: str) -> str:
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// URL, e.g. http://otel-collector:4317")
        return endpoint


class SharedState(_Strict):
    """State several gateways share, in Redis: with it set, N gateways behind one load balancer
    enforce each tenant's rate limits once for all of them, not once each, count each other's
    requests on every replica, and keep tenants' weighted shares across them."""

    url: str = Field(description="redis://[user:password@]host:port/db (rediss:// for TLS)")
    key_prefix: str = Field("bouncer:", min_length=1, description="every key Bouncer writes starts with it")
    lease_s: float = Field(10.0, gt=0.5, le=600.0, description="a gateway that has not renewed its presence in "
                                                               "this many seconds is no longer counted")
    timeout_ms: float = Field(50.0, gt=0.0, le=10_000.0, description="a Redis call slower than this, milliseconds, "
                                                                     "is a failure")
    sync_ms: float = Field(20.0, ge=1.0, le=5_000.0, description="how often, milliseconds, this gateway publishes "
                                                                "its part of "
                                                                "the fleet's load and tenants' service and reads "
                                                                "the others' (one Redis call, off the request path)")
    on_unavailable: Literal["fail-open", "fail-closed"] = Field(
        "fail-open", description="with Redis unreachable: fail-open decides locally, each gateway with its share "
                                 "of every limit (limit / gateways last seen); fail-closed refuses rate-limited "
                                 "tenants' requests with 503 and Retry-After. Both return to shared state by "
                                 "themselves once Redis answers again")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("a redis://, rediss:// or unix:// URL")
        return url


class BouncerConfig(_Strict):
    """The whole file."""

    listen: Listen = Field(Listen(), description="the gateway's HTTP server: address, port, client timeouts")
    picker: PickerFront = Field(PickerFront(), description="the endpoint-picker front (`bouncer serve --mode epp`)")
    admin_keys_sha256: list[str] = Field(default_factory=list, description="SHA-256 hex digests of the keys that "
                                                                           "may call /admin/* (`bouncer config "
                                                                           "hash-key KEY`); empty: /admin is off")
    access: Access = Field(Access(), description="who may read /metrics, /v1/models and the flight recorder")
    logging: Logging = Field(Logging(), description="log level and format, the access log")
    tenants: list[Tenant] = Field(min_length=1, description="who may send requests")
    default_tenant: str | None = Field(None, description="the tenant of requests that present no key or one no "
                                                         "tenant lists (load testers that hard-code a key); unset: "
                                                         "those get 401")
    models: list[ModelConfig] = Field(min_length=1, description="the models served, and their replicas")
    policy: Policy = Field(Policy(), description="admission, queueing, placement and prediction, for every model")
    limits: Limits = Field(Limits(), description="limits on a request's shape")
    recorder: Recorder = Field(Recorder(), description="the flight recorder")
    shared_state: SharedState | None = Field(None, description="several gateways: what they share, in Redis; "
                                                               "unset: this gateway alone")
    pressure: list[Pressure] = Field(default_factory=list, description="outside signals that shed bands or tenants")
    objectives: list[Objective] = Field(default_factory=list, description="inference objectives clients may name "
                                                                          "(llm-d's vocabulary); one not listed is "
                                                                          "refused (400)")
    tracing: Tracing | None = Field(None, description="OpenTelemetry traces of requests; unset: none")
    quotas: Quotas | None = Field(None, description="where tenants' spend over hours, days, weeks and months is "
                                                    "kept, and groups' limits; needed by any tenant `quota`")
    cache_isolation: bool = Field(True, description="each tenant's prompt prefixes are cached apart on engines that "
                                                    "take a cache salt (vLLM): the gateway sets `cache_salt` on "
                                                    "every request, its tenant's (or `cache_group`'s), overwriting a "
                                                    "client's; off: tenants share cached prefixes, and a prompt that "
                                                    "hits another tenant's answers faster (CVE-2025-46570)")
    keys_file: str | None = Field(None, description="a YAML file of API-key digests kept apart from the config (a "
                                                    "mounted Kubernetes Secret): `tenants: {NAME: [sha256, ...]}`, "
                                                    "`admin`, `metrics` and `viewer` lists; added to those the "
                                                    "config lists, read at start and on every reload")

    @model_validator(mode="before")
    @classmethod
    def _keys_from_file(cls, data: object) -> object:
        if not isinstance(data, dict) or not data.get("keys_file"):
            return data
        return _with_keys(data, str(data["keys_file"]))

    @field_validator("admin_keys_sha256")
    @classmethod
    def _hex_digests(cls, keys: list[str]) -> list[str]:
        return _digests(keys)

    @model_validator(mode="after")
    def _cross_checks(self) -> BouncerConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        keys = [k for t in self.tenants for k in t.api_keys_sha256]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key is listed for more than one tenant")
        models = {m.name for m in self.models}
        if len(models) != len(self.models):
            raise ValueError("model names must be unique")
        for t in self.tenants:
            for m in t.models:
                if m not in models:
                    raise ValueError(f"tenant {t.name!r} allows unknown model {m!r}")
        if sum(t.kv_share for t in self.tenants) > 1.0:
            raise ValueError("tenant kv_share values add up to more than 1")
        if self.default_tenant is not None and self.default_tenant not in names:
            raise ValueError(f"default_tenant {self.default_tenant!r} is not a tenant")
        fairness_ids = [f for t in self.tenants for f in t.fairness_ids]
        if len(set(fairness_ids)) != len(fairness_ids):
            raise ValueError("a fairness id is listed for more than one tenant")
        if fairness_ids and not self.access.trust_fairness_id:
            raise ValueError("tenants' fairness_ids need access.trust_fairness_id: true, and that only behind a "
                             "gateway that authenticates clients and sets x-llm-d-inference-fairness-id itself "
                             "(a client's own header would name any tenant)")
        objectives = [o.name for o in self.objectives]
        if len(set(objectives)) != len(objectives):
            raise ValueError("objective names must be unique")
        signals = [p.name for p in self.pressure]
        if len(set(signals)) != len(signals):
            raise ValueError("pressure signal names must be unique")
        for p in self.pressure:
            for t in p.tenants:
                if t not in names:
                    raise ValueError(f"pressure {p.name!r} sheds unknown tenant {t!r}")
        self._check_quotas(set(names), models)
        return self

    def _check_quotas(self, tenants: set[str], models: set[str]) -> None:
        q = self.quotas
        groups = q.groups if q is not None else []
        limits = [lim for t in self.tenants if t.quota for lim in t.quota.limits] + \
            [lim for g in groups for lim in g.limits]
        stored = q is not None and (q.url is not None or self.shared_state is not None)
        if (limits or any(t.quota for t in self.tenants)) and not stored:
            raise ValueError("tenant quotas need `quotas` with a Redis `url` (or `shared_state`) where spend is kept")
        if any(lim.unit == "usd" for lim in limits):
            unpriced = [m.name for m in self.models if m.price is None]
            if unpriced:
                raise ValueError(f"quotas in usd need a `price` on every model (none on {', '.join(unpriced)})")
        seen: dict[tuple[str, str], str] = {}
        for g in groups:
            for t in g.tenants:
                if t not in tenants:
                    raise ValueError(f"quota group {g.name!r} lists unknown tenant {t!r}")
                if (t, g.level) in seen:
                    raise ValueError(f"tenant {t!r} is in two {g.level} groups ({seen[(t, g.level)]!r}, {g.name!r})")
                seen[(t, g.level)] = g.name
        if len({(g.level, g.name) for g in groups}) != len(groups):
            raise ValueError("quota group names must be unique per level")
        for m in self.models:
            names = [o.name for o in m.overflow]
            if len(set(names)) != len(names):
                raise ValueError(f"model {m.name!r}: overflow target names must be unique")
            for o in m.overflow:
                if o.model is not None and (o.model not in models or o.model == m.name):
                    raise ValueError(f"model {m.name!r}: overflow target {o.name!r} names "
                                     + ("itself" if o.model == m.name else f"unknown model {o.model!r}"))

    def tenant_by_key(self) -> dict[str, Tenant]:
        return {k: t for t in self.tenants for k in t.api_keys_sha256}

    def with_model(self, model: ModelConfig) -> BouncerConfig:
        """This config with `model` in place of the one of its name (a discovery's new replicas)."""
        return self.model_copy(update={"models": [model if m.name == model.name else m for m in self.models]})


class ConfigError(ValueError):
    pass


KEYS_FILE_LISTS = {"admin": ("admin_keys_sha256",), "metrics": ("access", "metrics_keys_sha256"),
                   "viewer": ("access", "viewer_keys_sha256")}


def _with_keys(data: dict, path: str) -> dict:
    """`data` (a config not yet validated) with the digests of `keys_file` added."""
    try:
        keys = yaml.safe_load(pathlib.Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"keys_file {path}: {exc}") from None
    keys = {} if keys is None else keys
    if not isinstance(keys, dict) or set(keys) - {"tenants", *KEYS_FILE_LISTS}:
        raise ValueError(f"keys_file {path}: a mapping of tenants (NAME: [digests]), admin, metrics and viewer")
    data = {**data}
    for name, where in KEYS_FILE_LISTS.items():
        digests = keys.get(name) or []
        if not isinstance(digests, list):
            raise ValueError(f"keys_file {path}: {name}: a list of digests")
        if len(where) == 1:
            data[where[0]] = _union(data.get(where[0], []), digests)
        else:
            section = {**data.get(where[0], {})}
            section[where[1]] = _union(section.get(where[1], []), digests)
            data[where[0]] = section
    tenants = keys.get("tenants") or {}
    if not isinstance(tenants, dict):
        raise ValueError(f"keys_file {path}: tenants: a mapping of tenant names to lists of digests")
    listed = {t.get("name") for t in data.get("tenants", []) if isinstance(t, dict)}
    if unknown := sorted(set(tenants) - listed):
        raise ValueError(f"keys_file {path}: keys for tenants the config does not list: {', '.join(unknown)}")
    for name, digests in tenants.items():
        if not isinstance(digests, list):
            raise ValueError(f"keys_file {path}: tenants: {name}: a list of digests")
    data["tenants"] = [{**t, "api_keys_sha256": _union(t.get("api_keys_sha256", []), tenants[t["name"]])}
                       if isinstance(t, dict) and t.get("name") in tenants else t for t in data.get("tenants", [])]
    return data


def _union(listed: list, added: list) -> list:
    """`listed`, then those of `added` it lacks (a config dumped and read again is the same config)."""
    return [*listed, *(k for k in added if k not in listed)]


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def parse_config(data: dict, source: str = "config") -> BouncerConfig:
    try:
        return BouncerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(source, exc)) from None


def load_config(path: str | pathlib.Path) -> BouncerConfig:
    text = pathlib.Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return parse_config(data, str(path))


EXAMPLE_CONFIG = """\
# Bouncer configuration. Validate with `bouncer config check FILE`.
# Priorities: higher is more important; below 0 is sheddable (refused first under load).

listen:
  host: 127.0.0.1
  port: 8000
  header_timeout_s: 10       # a request's headers must arrive within this of its first byte (else 408)
  body_timeout_s: 30         # and its body within this after them
  idle_timeout_s: 75         # keep-alive connections idle this long are closed
  max_connections: 4096      # one more is answered 503 too_many_connections

# SHA-256 of the key that may call /admin/* (`bouncer config hash-key KEY`).
admin_keys_sha256: []

access:
  metrics_keys_sha256: []    # non-empty: /metrics (which names every tenant) needs one of these or an admin key
  models_need_key: false     # true: /v1/models needs a tenant's key and lists its models
  viewer_keys_sha256: []     # may read the flight recorder (/ui, /admin/timeline), nothing else of /admin

# The flight recorder: a sample every step_s (decisions by reason, queues and waits per band and
# tenant, each replica's KV and queues), the last horizon_s kept in memory, about 1-3 kB a sample
# by the number of tenants and replicas (/admin/timeline says how much it holds). Seen at /ui.
recorder: {enabled: true, step_s: 0.25, horizon_s: 900}

# Several gateways behind one load balancer: tenants' rate limits are kept in Redis, so together
# they let through each limit once, not once per gateway (one Redis call per rate-limited
# request); and every sync_ms each gateway publishes its requests on each replica and its
# tenants' service, and counts the others' (a killed gateway's stop counting within lease_s);
# a dispatch that would nearly fill a replica claims it there first (one atomic call), so two
# gateways never fill its last room at once.
# on_unavailable: fail-open (each gateway its share of each limit while Redis is away)
# or fail-closed (503 with Retry-After for rate-limited tenants); both recover by themselves.
# shared_state: {url: "redis://127.0.0.1:6379/0", key_prefix: "bouncer:", lease_s: 10,
#                timeout_ms: 50, sync_ms: 20, on_unavailable: fail-open}

# OpenTelemetry traces of requests over OTLP/gRPC (admission, the upstream call, the first token),
# continuing the client's traceparent and handing it to the engine. Tracing every request costs
# CPU (docs/operations/tracing.md): sample_ratio keeps a share of the traces clients do not decide.
# tracing: {endpoint: "http://otel-collector:4317", service_name: bouncer, sample_ratio: 1.0}

# API-key digests kept apart from this file (a mounted Kubernetes Secret), added to those above:
# keys_file: /etc/bouncer/keys/keys.yaml   # {tenants: {NAME: [sha256, ...]}, admin: [...]}

# Pressure from outside the cluster: while a polled value is above shed_above, the listed bands
# and tenants are refused (503 outside_pressure), until it falls below resume_below. Sources:
# file (a number, or JSON with field), http (the same, by GET), schedule (values by UTC time).
# pressure:
#   - name: carbon
#     source: {kind: http, url: "http://carbon-feed.internal/now", field: data.intensity}
#     poll_s: 60
#     stale_s: 600
#     on_stale: fail-open         # no fresh value (before the first poll too): shed nothing
#     shed_above: 400             # gCO2/kWh
#     resume_below: 350
#     bands: [-1]

# Quotas over hours, days, weeks or months (tokens or usd at the models' prices), kept in Redis:
# a request reserves its expected cost at admission and settles what it used. A tenant's own are
# under `quota:` (below, commented); groups of tenants share theirs. docs/operations/quotas-and-overflow.md
# quotas:
#   url: "redis://127.0.0.1:6379/0"   # default: shared_state.url
#   time_zone: UTC
#   groups:
#     - {name: acme, level: org, tenants: [interactive, batch], limits: [{window: month, unit: usd, limit: 500}]}

logging: {level: info, format: logfmt, access_log: true}   # format: logfmt | json | text

# default_tenant: batch      # requests with no key, or a key no tenant lists, go to this tenant (else 401)

tenants:
  - name: interactive
    api_keys_sha256: ["<sha256 of the tenant's API key>"]
    priority: 10             # band; dispatched before lower bands
    weight: 1.0              # fair share among tenants of the same band (tokens, WDRR)
    rate_limit: {requests_per_s: 50, tokens_per_min: 2000000}
    max_tokens_default: 512  # when the request sets none
    max_tokens_cap: 2048     # larger asks are clamped to this
    context_cap: 8192        # prompt + max_tokens; tightens when the pool is under pressure
    kv_share: 0.3            # 30% of the pool's KV reserved for it; lent to others while idle
    slo: {ttft_s: 1.0, tpot_s: 0.1}   # requests may tighten these: x-bouncer-ttft-ms, x-bouncer-tpot-ms
    queue_ttl_s: 10          # queued longer than this: 503 with Retry-After
  - name: batch
    api_keys_sha256: ["<sha256 of another key>"]
    priority: -1             # sheddable
    slo: {ttft_s: 30, on_infeasible: best-effort}   # too late for 30 s: served without a deadline
    # quota: {limits: [{window: day, unit: total_tokens, limit: 50000000}], over: demote}   # then band -1
    # overflow: true         # what the pool would refuse for load goes to the model's overflow targets

models:
  - name: llama-3.1-8b
    engine: vllm             # vllm | sglang | tgi | llamacpp | openai (which metrics to scrape)
    upstream_model: meta-llama/Llama-3.1-8B-Instruct
    tokenizer: /models/llama-3.1-8b/tokenizer.json
    tokenizer_cache_tokens: 4000000   # messages' token ids kept (16 MB): a session's next step tokenizes its new ones
    max_model_len: 8192
    block_size: 16
    kv: {layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2}   # GQA: KV heads, not attention heads
    # step time = a + b x batched tokens + c x context tokens + d x attention pairs
    # (docs/benchmarks/engine-model.md): TTFT and TPOT are predicted per replica from it. Learned from the
    # model's own requests by default (see /admin/state); a, b, c, d here are then the prior.
    # mode: given uses them as stated; mode: off predicts nothing.
    step_time: {mode: learned, max_batched_tokens: 8192}   # the engine's --max-num-batched-tokens
    # price: {input_per_million: 0.20, output_per_million: 0.60}   # for quotas in usd
    # What it would refuse for load (tenants with overflow: true), in order: another model of this
    # config, or an external OpenAI-compatible endpoint with its own key, model name and rate limit.
    # overflow:
    #   - {name: provider, url: "https://api.provider.example", api_key_env: PROVIDER_API_KEY,
    #      upstream_model: meta-llama/Llama-3.1-8B-Instruct, requests_per_s: 20}
    backends:
      - url: http://10.0.0.11:8000   # KV blocks are scraped from vllm:cache_config_info
        kv_events: tcp://10.0.0.11:5557   # vLLM --kv-events-config publisher: a precise prefix index
      - url: http://10.0.0.12:8000
        kv_cache_gb: 52              # or stated: blocks = bytes / (kv bytes per token x block_size)
        kv_offload_blocks: 100000    # host-memory KV (vLLM --kv-offloading-size), if any
      # Disaggregated serving (vLLM / llm-d P/D): backends are all `role: both` (the default) or
      # prefill and decode workers, at least one of each, engines started with a KV connector:
      # - {url: http://10.0.0.21:8000, role: prefill}
      # - {url: http://10.0.0.31:8000, role: decode}
    # Or, instead of backends, find the replicas while running (no reload when pods come and go):
    # a Kubernetes headless Service's A records (or SRV, or a watched file of URLs); a failed or
    # empty lookup keeps the last known replicas for keep_last_s.
    # discovery:
    #   dns: {name: vllm-llama-3-1-8b.inference.svc.cluster.local, port: 8000}
    #   interval_s: 10
    #   keep_last_s: 300

policy:
  kv_reservation: overcommit   # overcommit: reserve the learned expected output; reserve: max_tokens
  kv_busy_threshold: 0.92      # projected KV usage that marks a replica busy...
  kv_resume_threshold: 0.85    # ...until it falls below this (hysteresis)
  top_band_kv_threshold: 0.97  # the highest band that sends (above 0) fills past the busy mark to this
  prefill_busy_tokens: 8192    # queued prefill that makes a replica full for now (about one engine step)
  fairness: wdrr               # wdrr (tokens) | round-robin
  fair_hold_s: 5               # a tenant's turn whose head finds no room holds it that long from smaller requests
  ordering: edf                # edf (earliest TTFT deadline) | fcfs
  default_ttl_s: 30
  refuse_infeasible: true      # 429 deadline_infeasible when queue wait + predicted TTFT > the TTFT SLO
  ttft_safety_factor: 2        #   (the predicted TTFT x each band's measured error, p90; x this until measured)
  standing_queue_share: 0.7    # a tenant's queue that stands (sustained overload) plans newcomers on 70% of the SLO
  tpot_hold: true              # hold a request that would slow a replica past its strictest TPOT SLO
  ttft_reserve_fraction: 0.25  # while a higher band sends, lower bands keep prefill queues short enough
                               #   for its next request to start within 25% of its TTFT SLO
  tpot_reserve_fraction: 0.3   #   and join batches only while their predicted TPOT stays 30% under its target
  sheddable_ceiling: 0.8       # bands below 0 dispatch only while fleet saturation < 0.8
  band_ceilings: {10: 1.2}     # the top band may run the pool hotter
  telemetry: {scrape_interval_s: 0.25, staleness_s: 2.0, on_stale: fail-closed}
  permit_lease_s: 60           # a permit the gateway stops renewing (a bug) is reclaimed after this
  upstream_refusal_cooldown_s: 0.5   # a backend that refuses for load rests this long (or its Retry-After)
  queues: {max_requests: 2000, tenant_max_requests: 256}
  retries:
    deadline: first-attempt    # first-attempt | fresh: an SDK client's retry (x-stainless-retry-count, same
                               #   prompt) keeps its first attempt's TTFT deadline; past it, slo.on_infeasible
  routing:
    router: prefix-aware       # round-robin | least-loaded | llmd-scorers | sglang-cache-aware | prefix-aware
    sticky_margin: 1.0         # a warm replica keeps a request while its predicted TTFT is within
    sticky_slack_tokens: 8192  #   (1 + margin) x the cheapest replica's + slack (prefill tokens)
    kv_events_staleness_s: 10  # no KV event this long after sending work: use the approximate index
  agents:                      # requests with x-session-id are steps of an agent
    enabled: true
    initial: 16                # active agents allowed; AIMD: +alpha below u_low KV usage,
    alpha: 2                   #   x beta above u_high when the prefix hit rate is below h_thresh
    beta: 0.5
    u_low: 0.2
    u_high: 0.5
    h_thresh: 0.2
    idle_timeout_s: 30         # an agent with no step for this long frees its slot
    memory_s: 86400            # ...and is remembered a day: back, it goes before new agents
    max_parallel: 8            # one agent's steps in flight at once, its subagents' (x-parent-session-id) too
    # subagent_separator: ":"  # session id "ROOT:..." with no x-parent-session-id: a subagent of ROOT
                               #   (WEKA's kv-cache-tester names its subagents so)
"""
