"""What the core learns from the requests it let through.

- Latency: each replica's predictor (`bouncer.core.learning.latency`) is corrected by what its requests
  showed: observed / predicted TTFT at the first token, TPOT at the end. The uncorrected
  predictions are kept on the request at dispatch (`at_dispatch`), to correct by; the corrected
  one too, for its band's TTFT margin (`bouncer.core.learning.ttft_margin`). A first token past its
  deadline is its band's miss (`band_slos.BandSLOs.missed`).
- Decode speed from the engines themselves, for a front that reads no answer past its first
  token (the endpoint picker's buffered setup): each scrape's inter-token latency, over the
  interval since the one before (`engine_decodes`).
- Output lengths: KV is reserved for the output expected of a tenant on a model
  (`bouncer.core.learning.output_length`), learned from its completions.
- Each replica's in-flight and prefill limits (AIMD, `adapt_limits`): the TPOT guard cuts one
  when a completed request ran slower than its TPOT SLO, by what the slowness points to; a limit
  cut by a backend's refusals grows back with completions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bouncer.config import Policy
from bouncer.core.fleet.replica import ReplicaState, Telemetry, decode_context
from bouncer.core.learning.latency import prefill_pairs
from bouncer.core.learning.output_length import OutputLengthModel
from bouncer.core.requests import Admission

if TYPE_CHECKING:
    from bouncer.core.model_state import ModelState

# An answer of fewer tokens has a TPOT of a few steps' length, which one step carrying a lot of
# prefill makes slow whatever the batch (ServeGen m-mid: every request slower than its TPOT SLO
# had 2-13 tokens). Cutting the in-flight limit for it shrinks every batch and fixes nothing.
SHORT_ANSWER_TOKENS = 16
PREFILL_LIMIT_FLOOR = 1024  # tokens: a step with less prefill than this is mostly fixed cost
# tokens per fast completion: from the floor back to vLLM's full step (8,192) in 3,584 of them
PREFILL_LIMIT_INCREASE = 2.0
# samples (tokens; TGI's, requests) an interval between two scrapes must hold for its mean
# inter-token latency to be a step time rather than one request's luck
ENGINE_ITL_MIN_SAMPLES = 8


def expected_output(models: dict[str, OutputLengthModel], policy: Policy, model: str, max_tokens: int) -> int:
    """The output a request of this tenant (`models`: its learned lengths) reserves KV for."""
    if policy.kv_reservation == "reserve":
        return max_tokens
    m = models.get(model)
    return m.expected(max_tokens) if m else min(max_tokens, policy.expected_output_default)


def mean_output(models: dict[str, OutputLengthModel], policy: Policy, model: str, max_tokens: int) -> int:
    """The mean output of this tenant's requests (`models`) on `model`, where `expected_output`
    adds a margin: what a decode worker's many requests hold on average (`decode_room`)."""
    if policy.kv_reservation == "reserve":
        return max_tokens
    m = models.get(model)
    return m.mean(max_tokens) if m else min(max_tokens, policy.expected_output_default)


def learn_output(models: dict[str, OutputLengthModel], policy: Policy, model: str, completion_tokens: int) -> None:
    models.setdefault(model, OutputLengthModel(policy.expected_output_default)).observe(completion_tokens)


def at_dispatch(adm: Admission, r: ReplicaState, now: float) -> None:
    """What it is predicted to see there, uncorrected, kept to correct the predictor by; and,
    where the step time is learned, the terms of its TTFT to fit it by."""
    p = r.predictor
    if p is None:
        return
    if r.latency is not None:
        adm.ttft_raw = r.predict_ttft(adm, adm.prefill_tokens, raw=True)
        adm.ttft_predicted = adm.ttft_raw * r.latency.ttft_factor if adm.ttft_raw is not None else None
        adm.tpot_raw = r.predict_tpot(adm, now, raw=True)
    if p.learner is not None:
        pairs = r.queued_prefill_pairs + prefill_pairs(adm.info.prompt_tokens, adm.prefill_tokens)
        adm.ttft_terms = p.ttft_terms(r.queued_prefill_tokens, adm.prefill_tokens, r.decoding, r.decode_context, pairs)
    p.dispatched(adm.prefill_tokens, now)


def first_token(adm: Admission, r: ReplicaState, ms: ModelState, now: float, measured: bool,
                prefill: ReplicaState | None = None) -> None:
    """Its first token came at `now` (`measured`), or its whole answer did (a non-streamed
    request: its prefill is over, but when it ended is not known). `ms`: its model's state;
    `prefill`: the prefill worker that computed its prompt, where its TTFT was predicted, when it
    was handed over to `r`, a decode worker."""
    decoder, r = r, prefill or r
    decoder.idle_refusals = r.idle_refusals = 0  # they ran something: not replicas that refuse everything
    adm.first_token_measured = measured
    if decoder.decode_ledger is not None:
        decoder.decode_ledger.first_token(adm.request_id, now)
    if not measured:
        return
    if adm.ttft_deadline is not None and now > adm.ttft_deadline and not adm.best_effort:
        ms.band_slos.missed(adm.priority, now)
    if adm.ttft_predicted is not None:
        ms.ttft_margins.observe(adm.priority, adm.ttft_predicted, now - adm.dispatched_at)  # type: ignore[operator]
    if r.latency is not None and adm.ttft_raw is not None:
        r.latency.observe_ttft(adm.ttft_raw, now - adm.dispatched_at)  # type: ignore[operator]
    learner = r.predictor.learner if r.predictor is not None else None
    if learner is not None and adm.ttft_terms is not None:
        learner.observe_ttft(adm.ttft_terms, now - adm.dispatched_at)  # type: ignore[operator]
        adm.decode_start = (decoder.decoding + 1, decoder.decode_context + decode_context(adm))  # itself included


def completed(adm: Admission, r: ReplicaState, now: float, completion_tokens: int) -> None:
    """Its answer ended (it is no longer counted on `r`)."""
    if adm.first_token_at is None or completion_tokens < 1:
        return
    learner = r.predictor.learner if r.predictor is not None else None
    # the batch it decoded in: the mean of the one it started in and the one it ended in (itself
    # counted in both)
    end = (r.decoding + 1, r.decode_context + decode_context(adm))
    if not adm.first_token_measured:
        if learner is not None and adm.ttft_terms is not None:
            learner.observe_whole(adm.ttft_terms, completion_tokens, end[0], end[1],
                                  now - adm.dispatched_at)  # type: ignore[operator]
        return
    if completion_tokens < 2:
        return
    tpot = (now - adm.first_token_at) / (completion_tokens - 1)
    if r.decode_ledger is not None:
        r.decode_ledger.observe_tpot(tpot)
    if r.latency is not None and adm.tpot_raw is not None:
        r.latency.observe_tpot(adm.tpot_raw, tpot)
    if learner is not None and adm.decode_start is not None:
        n, ctx = adm.decode_start
        learner.observe_tpot(round((n + end[0]) / 2), (ctx + end[1]) / 2, r.predictor.prefill_rate(now), tpot)  # type: ignore[union-attr]


def engine_decodes(r: ReplicaState, previous: Telemetry | None, batch_then: tuple[int, int], t: Telemetry,
                   now: float) -> None:
    """The engine's mean inter-token latency since its previous scrape, one decode observation
    for the step-time fit: the tokens of a step are one per sequence in the batch, each after
    that step's time, so the mean is the steps' time weighted by their batch. The batch is this
    gateway's count of what decodes there (the mean of it at the two scrapes), as for a request's
    own TPOT. An interval with too few samples, or nothing of ours decoding, says nothing."""
    learner = r.predictor.learner if r.predictor is not None else None
    if (learner is None or previous is None or t.itl_count is None or previous.itl_count is None
            or t.itl_sum is None or previous.itl_sum is None):
        return
    samples = t.itl_count - previous.itl_count
    if samples < ENGINE_ITL_MIN_SAMPLES:  # (negative: the engine restarted, its counters with it)
        return
    batch = (batch_then[0] + r.decoding) / 2
    if batch < 1:
        return
    learner.observe_tpot(round(batch), (batch_then[1] + r.decode_context) / 2,
                         r.predictor.prefill_rate(now), (t.itl_sum - previous.itl_sum) / samples)  # type: ignore[union-attr]


def adapt_limits(policy: Policy, model_tpot_target: float | None, r: ReplicaState, adm: Admission,
                 now: float, tokens: int) -> None:
    """The TPOT guard: AIMD on a replica's limits, by the decode speed its completed requests saw.
    A request slower than its own TPOT SLO (x tpot_guard_margin; without one, the strictest among
    this model's tenants) was slowed by one of two things:
    - a long answer, over many steps: too many requests decode together. The in-flight limit is
      cut to 80% of what was in flight (at most once per second);
    - a short one (under SHORT_ANSWER_TOKENS): a step that carried too much prefill. The prefill
      limit (the queued prefill tokens the replica takes, `placement.room`) is cut to what one
      step may batch within that request's TPOT SLO beside what decodes there, as the step-time
      model has it (halved without one yet), and at least PREFILL_LIMIT_FLOOR.
    Each fast one adds `tpot_guard_increase` to the in-flight limit and PREFILL_LIMIT_INCREASE
    tokens to the prefill limit. Its own SLO, not the strictest: a standard request running at
    its own 150 ms is no sign of trouble, and the TPOT hold already keeps batches within the
    strictest SLO running on each replica. A limit cut by refusals (`placement.rest`) grows back
    by the same step per completion."""
    p = policy
    target = adm.tpot_slo * p.tpot_guard_margin if adm.tpot_slo else model_tpot_target
    guarded = p.tpot_guard and target is not None and adm.first_token_at is not None and tokens >= 2
    slow = guarded and (now - adm.first_token_at) / (tokens - 1) > target  # type: ignore[operator]
    if slow and tokens < SHORT_ANSWER_TOKENS:
        fits = min(p.prefill_busy_tokens, r.prefill_limit)
        model = r.latency.model if r.latency is not None else None
        if model is None:  # no step-time model yet (a learner warming up)
            fits /= 2
        else:
            step_s: float = adm.tpot_slo or target  # type: ignore[assignment]
            fits = min(fits, model.batch_within(step_s, r.decode_context) - r.decoding)
        r.prefill_limit = max(PREFILL_LIMIT_FLOOR, fits)
        return
    if slow:
        if now - r.last_cut >= 1.0:
            r.concurrency_limit = max(p.min_inflight_per_replica,
                                      min(r.concurrency_limit, r.requests_in_flight + 1) * 0.8)
            r.last_cut = now
        return
    if (guarded or r.refusals_cut_limit) and r.concurrency_limit < p.max_inflight_per_replica:
        r.concurrency_limit += p.tpot_guard_increase
    if guarded and r.prefill_limit < p.prefill_busy_tokens:
        r.prefill_limit += PREFILL_LIMIT_INCREASE
