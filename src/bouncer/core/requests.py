"""A request as the core sees it: sizes, identity and deadlines, no bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class OverQuota(NamedTuple):
    """A spent quota (`bouncer.quotas`), found by the shell before the offer: what its tenant's
    requests get while it lasts (the core acts on it: `bouncer.core.intake.quota`)."""

    action: str  # refuse, demote or divert (a tenant's `quota.over`)
    band: int  # demote: the band it runs in
    resets_in_s: float  # until every spent window that applies has reset
    limit: str  # which limit, for the message: "tenant acme: 2000000 total_tokens per day (2026-12-05 UTC)"


RetryKey = tuple[str, str, int, int | None]  # tenant, model, prompt digest, max_tokens as asked (`intake.retries`)


@dataclass(slots=True)
class RequestInfo:
    """What the gateway (or the simulator) knows of a request before admission."""

    request_id: str
    key_digest: str | None  # SHA-256 of the presented API key, None if none was sent
    model: str
    prompt_tokens: int
    max_tokens: int | None  # as asked; None: the tenant default applies
    block_digests: list[int] = field(default_factory=list)
    n: int = 1
    best_of: int | None = None
    num_stop: int = 0
    ttl_s: float | None = None  # client's shorter TTL (x-bouncer-ttl-ms)
    ttft_slo_s: float | None = None  # client's own SLOs (x-bouncer-ttft-ms / -tpot-ms)
    tpot_slo_s: float | None = None
    session_id: str | None = None  # x-session-id: the agent this request is a step of
    parent_session_id: str | None = None  # x-parent-session-id: a subagent's, the agent that launched it
    user: str | None = None  # the OpenAI `user` field
    retry_count: int | None = None  # x-stainless-retry-count: the client's earlier attempts at this request
    prompt_digest: int | None = None  # the whole prompt's hash: a retry sends the same
    # at most prompt_tokens, known before tokenizing (its text's bytes over the longest token's),
    # for the precheck: a request that would overfill its tenant's queued tokens even so is refused
    min_prompt_tokens: int = 0
    fairness_id: str | None = None  # x-llm-d-inference-fairness-id: names a tenant where its key names none
    objective: str | None = None  # x-llm-d-inference-objective: a configured objective, a lower band
    replicas: frozenset[str] | None = None  # only these may serve it (an endpoint picker's subset hint)
    over_quota: OverQuota | None = None  # its tenant's quota is spent, as the shell found before the offer
    diverted_from: str | None = None  # diverted here from this model's pool: never diverted again
    cache_salt: str | None = None  # its tenant's cache salt, once `block_digests` are salted with it

    @property
    def sequences(self) -> int:
        """Sequences the engine generates for it (`n`, or `best_of` candidates): each is its own
        answer, charged and held in KV as one."""
        return max(self.n, self.best_of or 1)


# An agent's step goes before other requests of its tenant: an active agent's first (its prefix is
# warm), then a returning agent's (its session is under way), then the rest in the queue's order.
STEP_ACTIVE, STEP_RETURNING, STEP_OTHER = 0, 1, 2


@dataclass(slots=True, eq=False)
class Admission:
    """A request that passed the cheap layers: its tenant, band and sizes are fixed."""

    info: RequestInfo
    tenant: str
    priority: int
    max_tokens: int  # after defaults and clamping
    expected_output: int  # what KV is reserved for (learned, capped by max_tokens)
    arrival: float
    deadline: float  # TTL: leaves the queue at this time
    ttft_deadline: float | None  # arrival + TTFT SLO
    ttft_slo: float | None = None  # the TTFT it was promised: its tenant's, or a client header's if tighter
    context_limit: int = 0  # the model's max_model_len: a completion that reaches it is a runaway
    tpot_slo: float | None = None  # the same for TPOT
    replica: str | None = None  # set when dispatched (disaggregated: the prefill worker, then the decode worker)
    decode_replica: str | None = None  # disaggregated: the decode worker chosen with the prefill worker
    prefill_replica: str | None = None  # disaggregated: where its prompt was computed, once handed over
    mean_output: int = 0  # disaggregated: its tenant's mean output, what its decode worker's ledger counts
    dispatched_at: float | None = None
    first_token_at: float | None = None
    blocks: int = 0  # projected KV blocks reserved on its replica
    prefill_tokens: int = 0  # uncached prompt tokens it adds to its replica's prefill queue
    first_new_block: int = 0  # of its block digests, the first its replica's prefix index did not hold
    seq: int = 0  # arrival order, for FCFS ties
    session: str | None = None  # the agent it is a step of, when agent-level admission applies
    parent_session: str | None = None  # a subagent's step: the agent in whose slot it runs
    queue_rank: int = STEP_OTHER  # STEP_ACTIVE, STEP_RETURNING or STEP_OTHER: its place in its tenant's queue
    best_effort: bool = False  # its deadline was found infeasible (or passed); it runs in the best-effort band
    retry_key: RetryKey | None = None  # how its client's retries are known again (policy.retries)
    predicted_infeasible: bool = False  # found unable to meet its TTFT SLO (refused, demoted, or let through)
    lease_until: float = 0.0  # its permit is reclaimed after this unless the shell renews it
    rate_charge: int = 0  # tokens its tenant's rate limits were charged (refunded if it is refused later)
    breaker_probe: bool = False  # the one request a half-open breaker let through: its outcome decides
    room_wait_since: float | None = None  # when, at its tenant's turn, it first found no replica with room
    # uncorrected predictions made at dispatch, to correct the replica's predictor by
    ttft_raw: float | None = None
    ttft_predicted: float | None = None  # corrected: what the core decided by (bouncer.core.learning.ttft_margin)
    tpot_raw: float | None = None
    # what a learned step time is fitted by (bouncer.core.learning.step_time_learner): the TTFT terms at
    # dispatch, the decode batch and context when its first token came, and whether that time
    # was measured (a stream) or is only when the whole answer came
    ttft_terms: tuple[float, float, float, float, float] | None = None
    decode_start: tuple[int, int] | None = None
    first_token_measured: bool = True

    @property
    def request_id(self) -> str:
        return self.info.request_id

    @property
    def cost_tokens(self) -> int:
        """What fairness charges: prompt plus expected output, in tokens."""
        return self.info.prompt_tokens + self.expected_output
