"""What the core learns from the requests it let through.

- Latency: each replica's predictor (`bouncer.core.latency`) is corrected by what its requests
  showed: observed / predicted TTFT at the first token, TPOT at the end. The uncorrected
  predictions are kept on the request at dispatch (`at_dispatch`), to correct by.
- Output lengths: KV is reserved for the output expected of a tenant on a model
  (`bouncer.core.output_length`), learned from its completions.
- Each replica's in-flight limit (AIMD, `adapt_inflight_limit`): the TPOT guard cuts it when
  completed requests ran slower than their TPOT SLO; a limit cut by a backend's refusals grows
  back with completions.
"""

from __future__ import annotations

from bouncer.config import Policy
from bouncer.core.fleet import ReplicaState
from bouncer.core.output_length import OutputLengthModel
from bouncer.core.requests import Admission


def expected_output(models: dict[str, OutputLengthModel], policy: Policy, model: str, max_tokens: int) -> int:
    """The output a request of this tenant (`models`: its learned lengths) reserves KV for."""
    if policy.kv_reservation == "reserve":
        return max_tokens
    m = models.get(model)
    return m.expected(max_tokens) if m else min(max_tokens, policy.expected_output_default)


def learn_output(models: dict[str, OutputLengthModel], policy: Policy, model: str, completion_tokens: int) -> None:
    models.setdefault(model, OutputLengthModel(policy.expected_output_default)).observe(completion_tokens)


def at_dispatch(adm: Admission, r: ReplicaState, now: float) -> None:
    """What it is predicted to see there, uncorrected, kept to correct the predictor by."""
    if r.latency is not None:
        adm.ttft_raw = r.predict_ttft(adm, adm.prefill_tokens, raw=True)
        adm.tpot_raw = r.predict_tpot(adm, now, raw=True)
        r.latency.dispatched(adm.prefill_tokens, now)


def first_token(adm: Admission, r: ReplicaState, now: float) -> None:
    r.idle_refusals = 0  # it ran something: not a replica that refuses everything
    if r.latency is not None and adm.ttft_raw is not None:
        r.latency.observe_ttft(adm.ttft_raw, now - adm.dispatched_at)  # type: ignore[operator]


def completed(adm: Admission, r: ReplicaState, now: float, completion_tokens: int) -> None:
    if r.latency is not None and adm.tpot_raw is not None and adm.first_token_at is not None \
            and completion_tokens > 1:
        r.latency.observe_tpot(adm.tpot_raw, (now - adm.first_token_at) / (completion_tokens - 1))


def adapt_inflight_limit(policy: Policy, model_tpot_target: float | None, r: ReplicaState, adm: Admission,
                         now: float, tokens: int) -> None:
    """AIMD on a replica's in-flight limit. The TPOT guard drives it by the decode speed its
    completed requests saw: each request slower than its own TPOT SLO (x tpot_guard_margin;
    without one, the strictest among this model's tenants) cuts the limit to 80% of what was in
    flight (at most once per second); each fast one adds `tpot_guard_increase`. Its own SLO, not
    the strictest: a standard request running at its own 150 ms is no sign of trouble, and the
    TPOT hold already keeps batches within the strictest SLO running on each replica. A limit cut
    by refusals (`placement.rest`) grows back by the same step per completion."""
    p = policy
    target = adm.tpot_slo * p.tpot_guard_margin if adm.tpot_slo else model_tpot_target
    guarded = p.tpot_guard and target is not None and adm.first_token_at is not None and tokens >= 2
    if guarded and (now - adm.first_token_at) / (tokens - 1) > target:  # type: ignore[operator]
        if now - r.last_cut >= 1.0:
            r.concurrency_limit = max(p.min_inflight_per_replica,
                                      min(r.concurrency_limit, len(r.inflight) + 1) * 0.8)
            r.last_cut = now
    elif (guarded or r.refusals_cut_limit) and r.concurrency_limit < p.max_inflight_per_replica:
        r.concurrency_limit += p.tpot_guard_increase
