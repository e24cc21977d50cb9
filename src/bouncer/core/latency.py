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

The coefficients are a starting point: real engines add scheduling gaps, KV waits and network,
so each replica keeps two correction factors, moved towards observed / predicted after every
first token (TTFT) and every completed stream (TPOT): the gateway sees both on each request.
The factors are geometric moving averages, clamped so one outlier cannot swing them far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CORRECTION_WEIGHT = 0.05  # each observation moves log(factor) 5% of the way to log(observed / predicted)
CORRECTION_MIN, CORRECTION_MAX = 0.2, 5.0
PREFILL_RATE_TAU_S = 10.0  # time constant of the arriving-prefill rate TPOT looks at
MIN_OBSERVED_S = 1e-4  # below this an observation says nothing about step times


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    a: float  # s per step
    b: float  # s per batched token
    c: float  # s per context token attention reads
    max_batched_tokens: int  # the engine's per-step token budget (vLLM --max-num-batched-tokens)
    d: float = 0.0  # s per (prompt token computed, token before it) pair: prefill attention's compute

    def step(self, batched_tokens: float, context_tokens: float) -> float:
        return self.a + self.b * batched_tokens + self.c * context_tokens


def prefill_pairs(prompt_tokens: int, uncached: int) -> int:
    """Attention pairs of computing a prompt's last `uncached` tokens: each attends to itself
    and every token before it."""
    return uncached * (2 * prompt_tokens - uncached + 1) // 2


class LatencyPredictor:
    """Predicted TTFT and TPOT on one replica, corrected online. Pure: every call takes the
    replica's load as numbers and `now`."""

    def __init__(self, model: StepTimeModel) -> None:
        self.model = model
        self.ttft_factor = 1.0
        self.tpot_factor = 1.0
        self._rate_acc = 0.0  # exponentially decayed sum of dispatched prefill tokens
        self._rate_at = 0.0

    # -- the model ---------------------------------------------------------------------------------
    def raw_ttft(self, prefill_ahead: int, own_prefill: int, decoding: int, decode_context: int,
                 pairs: int = 0) -> float:
        """Uncorrected TTFT (s) after dispatch: the prefill work ahead, then its own (`pairs`:
        the attention pairs of both)."""
        m = self.model
        budget = m.max_batched_tokens
        per_step = max(1, budget - decoding)
        work = prefill_ahead + max(1, own_prefill)  # at least its last prompt token is computed
        steps = math.ceil(work / per_step)
        return steps * m.step(min(budget, decoding + work), decode_context) + m.d * pairs

    def raw_tpot(self, decoding: int, decode_context: int, now: float) -> float:
        """Uncorrected TPOT (s) of a batch of `decoding` requests reading `decode_context` tokens,
        with prefill chunks arriving at the recent rate."""
        m = self.model
        load = min(0.9, m.b * self.prefill_rate(now))  # a step cannot be all prefill
        return m.step(decoding, decode_context) / (1.0 - load)

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
