"""Latency prediction per replica: the TTFT and TPOT a request would see if sent there now.

The engine's step time is modelled as vLLM v1 runs it (the same model as `bouncer.sim.profiles`):

    step_time = a + b * batched_tokens + c * context_tokens + d * attention_pairs

(`attention_pairs`: for each prompt chunk computed in the step, the pairs of one of its tokens
and one token before it, which attention's compute grows with: quadratic in the prompt) and the
scheduler fills each step's token budget with one token per decoding request first, then
chunks of waiting prompts, in order. So a request dispatched now waits for the prefill work ahead
of it (the uncached prompt tokens sent there that have not produced a first token yet) and then
its own, at (budget - decoding requests) prefill tokens per step:

    TTFT ~ ceil((prefill ahead + own uncached) / prefill tokens per step) * step_time
           + d * (attention pairs of the prefill ahead and its own)

Once decoding, every step carries the batch it joined plus the prefill chunks of the requests
that keep arriving. With `p` uncached prompt tokens arriving per second, a step of time `s`
carries `p * s` of them, so s = a + b * (n + p * s) + c * ctx, hence

    TPOT ~ (a + b * n + c * ctx) / (1 - b * p)

The coefficients are given in the config or learned from the model's own requests
(`bouncer.core.learning.step_time_learner`), shared by the model's replicas. Each replica adds what they
miss there (scheduling gaps, KV waits, network) as two correction factors, moved towards
observed / predicted after every first token (TTFT) and every completed stream (TPOT): the
gateway sees both on each request.
The factors are geometric moving averages, clamped so one outlier cannot swing them far.
"""

from __future__ import annotations

import math

from bouncer.core.learning.step_time import StepTimeModel
from bouncer.core.learning.step_time_learner import StepTimeLearner

CORRECTION_WEIGHT = 0.05  # each observation moves log(factor) 5% of the way to log(observed / predicted)
CORRECTION_MIN, CORRECTION_MAX = 0.2, 5.0
PREFILL_RATE_TAU_S = 10.0  # time constant of the arriving-prefill rate TPOT looks at
MIN_OBSERVED_S = 1e-4  # below this an observation says nothing about step times


def prefill_steps(budget: int, prefill_ahead: int, own_prefill: int, decoding: int) -> tuple[int, int]:
    """Engine steps until a request's first token, and the tokens each batches: the prefill work
    ahead and its own, at (budget - decoding requests) prefill tokens per step."""
    per_step = max(1, budget - decoding)
    work = prefill_ahead + max(1, own_prefill)  # at least its last prompt token is computed
    return math.ceil(work / per_step), min(budget, decoding + work)


def prefill_pairs(prompt_tokens: int, uncached: int) -> int:
    """Attention pairs of computing a prompt's last `uncached` tokens: each attends to itself
    and every token before it."""
    return uncached * (2 * prompt_tokens - uncached + 1) // 2


class LatencyPredictor:
    """Predicted TTFT and TPOT on one replica, corrected online. Pure: every call takes the
    replica's load as numbers and `now`. Its step-time model is the one configured (`given`) or
    its model's learner's current fit (`bouncer.core.learning.step_time_learner`), shared by the model's
    replicas; `model` is None while a learner is still warming up."""

    def __init__(self, given: StepTimeModel | None = None, learner: StepTimeLearner | None = None) -> None:
        if (given is None) == (learner is None):
            raise ValueError("a latency predictor has either a given step-time model or a learner")
        self.given = given
        self.learner = learner
        self.budget = given.max_batched_tokens if given is not None else learner.max_batched_tokens  # type: ignore[union-attr]
        self.ttft_factor = 1.0
        self.tpot_factor = 1.0
        self._rate_acc = 0.0  # exponentially decayed sum of dispatched prefill tokens
        self._rate_at = 0.0
        # a step's share left to decoding (`raw_tpot`), and the `now`, model and prefill rate it is of
        self._free, self._free_now, self._free_model = 1.0, -math.inf, None
        self._free_at, self._free_acc = -math.inf, 0.0

    @property
    def model(self) -> StepTimeModel | None:
        return self.given if self.learner is None else self.learner.model

    # -- the model ---------------------------------------------------------------------------------
    def raw_ttft(self, prefill_ahead: int, own_prefill: int, decoding: int, decode_context: int,
                 pairs: int = 0) -> float:
        """Uncorrected TTFT (s) after dispatch: the prefill work ahead, then its own (`pairs`:
        the attention pairs of both)."""
        # `prefill_steps` and `StepTimeModel.step` written out: this runs for every replica on
        # every offer and placement, the core's hottest arithmetic
        m = self.given if self.learner is None else self.learner.model
        budget = m.max_batched_tokens  # type: ignore[union-attr]
        per_step = budget - decoding if budget - decoding > 1 else 1
        work = prefill_ahead + (own_prefill if own_prefill > 1 else 1)
        batched = decoding + work if decoding + work < budget else budget
        return (math.ceil(work / per_step) * (m.a + m.b * batched + m.c * decode_context)  # type: ignore[union-attr]
                + m.d * pairs + m.e)  # type: ignore[union-attr]

    def ttft_terms(self, prefill_ahead: int, own_prefill: int, decoding: int, decode_context: int,
                   pairs: int = 0) -> tuple[float, float, float, float, float]:
        """raw_ttft as the coefficients' multipliers: raw_ttft = terms . (a, b, c, d, e)."""
        steps, batched = prefill_steps(self.budget, prefill_ahead, own_prefill, decoding)
        return (steps, steps * batched, steps * decode_context, pairs, 1.0)

    def raw_tpot(self, decoding: int, decode_context: int, now: float) -> float:
        """Uncorrected TPOT (s) of a batch of `decoding` requests reading `decode_context` tokens,
        with prefill chunks arriving at the recent rate."""
        m = self.given if self.learner is None else self.learner.model
        # the share of a step left to decoding, kept while `now`, the rate and the model stay: it
        # is asked for every replica on every placement, most of them at one `now`
        if (now != self._free_now or m is not self._free_model or self._free_at != self._rate_at
                or self._free_acc != self._rate_acc):
            self._free_now, self._free_model, self._free_at, self._free_acc = now, m, self._rate_at, self._rate_acc
            self._free = 1.0 - min(0.9, m.b * self.prefill_rate(now))  # type: ignore[union-attr]  # not all prefill
        return (m.a + m.b * decoding + m.c * decode_context) / self._free  # type: ignore[union-attr]  # as m.step

    def ttft(self, prefill_ahead: int, own_prefill: int, decoding: int, decode_context: int,
             pairs: int = 0) -> float:
        return self.ttft_factor * self.raw_ttft(prefill_ahead, own_prefill, decoding, decode_context, pairs)

    def tpot(self, decoding: int, decode_context: int, now: float) -> float:
        return self.tpot_factor * self.raw_tpot(decoding, decode_context, now)

    # -- what it learns from -------------------------------------------------------------------------
    def dispatched(self, prefill_tokens: int, now: float) -> None:
        self._rate_acc = self._decayed(now) + prefill_tokens
        self._rate_at = now

    def prefill_rate(self, now: float) -> float:
        """Uncached prompt tokens sent here per second, recently."""
        return self._decayed(now) / PREFILL_RATE_TAU_S

    def _decayed(self, now: float) -> float:
        dt = now - self._rate_at
        return self._rate_acc * math.exp(-dt / PREFILL_RATE_TAU_S) if dt > 0 else self._rate_acc

    def observe_ttft(self, raw_predicted: float, observed: float) -> None:
        self.ttft_factor = corrected(self.ttft_factor, raw_predicted, observed)

    def observe_tpot(self, raw_predicted: float, observed: float) -> None:
        self.tpot_factor = corrected(self.tpot_factor, raw_predicted, observed)


def corrected(factor: float, raw_predicted: float, observed: float) -> float:
    """A correction factor moved towards observed / predicted."""
    if raw_predicted <= 0 or observed < MIN_OBSERVED_S:
        return factor
    target = observed / raw_predicted
    log_f = (1 - CORRECTION_WEIGHT) * math.log(factor) + CORRECTION_WEIGHT * math.log(target)
    return min(CORRECTION_MAX, max(CORRECTION_MIN, math.exp(log_f)))
