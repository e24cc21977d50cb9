"""What a model's traffic needs: the replicas that would serve what arrives, for an autoscaler.

The count an autoscaler usually reads (engines' waiting requests) is what Bouncer keeps small by
holding and refusing, so it hides the demand Bouncer turns away. This reads the arrivals instead,
refused ones included, each counted once (a client's retry, `x-stainless-retry-count` > 0, is
the same demand again), and prices them with the step-time model:

    replicas = offered requests/s x engine-seconds per request

where a request of p prompt and o output tokens costs one replica, running a batch of B,

    a o / B  +  b ((1 - h) p + o)  +  c (p + o/2) o  +  d (1 - h^2) p^2 / 2

its share of the o decode steps' fixed cost, its tokens computed, the context its decode steps
read (p at the first, p + o at the last), and its prefill's attention pairs; h is the share of
prompt tokens dispatched requests found cached where they went (a prefix cache hit costs no
prefill: computing tokens hp..p is (1 - h^2) p^2 / 2 pairs). B is the batch the
replica runs at full load: `max_num_seqs`, or fewer when its KV cache holds fewer of these
requests (each holds p + o/2 tokens, time-weighted over its decode), or fewer when the strictest
TPOT SLO of the model's tenants caps a decode step (a + b B (1 + p/o) + c B (p + o/2) <= TPOT:
each step also carries the batch's prefill, p/o tokens per request per step).

The mix is kept per tenant (and band: protected or not), since what is refused is not a random
sample of what arrives (a flooding tenant is turned away at the door before its prompts are
counted): each tenant's arrivals are priced at its own prompts (those tokenized) and its own
answers' lengths (o, o^2 of its completed requests; a tenant with none yet is priced at the
model's), and E[(p + o/2) o] is taken as E[p] E[o] + E[o^2] / 2. Arrivals are exponentially
weighted over `window_s`, which is what keeps the signal from flapping; a tenant's prompts and
answers over its last requests (weights halving every `HALF_LIFE`), so what it looks like stays
known while it is refused. `protected` prices the
bands >= 0 alone (what the non-sheddable traffic needs, refusals of sheddable bands aside).
Each gateway counts its own arrivals: with several, the fleet's demand is the sum of theirs.

Pure: the shells read `estimate(now, ...)`; nothing here reads the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bouncer.core.learning.step_time import StepTimeModel

# Sums are decayed in steps of this much time at least, not at every addition: one exp per step
# rather than per arrival (the offer path's cost), at most exp(0.5 / 30) - 1 = 1.7% of weight too
# much for what came within the last step
DECAY_STEP_S = 0.5


class _Decayed:
    """Sums that forget with time constant `tau`: each value's weight is exp(-age / tau), its age
    counted in steps of `DECAY_STEP_S`."""

    __slots__ = ("tau", "sums", "at")

    def __init__(self, tau: float, size: int) -> None:
        self.tau = tau
        self.sums = [0.0] * size
        self.at: float | None = None  # when `sums` were last decayed

    def add(self, values: tuple[float, ...], now: float) -> None:
        s = self.read(now)
        for i, v in enumerate(values):
            s[i] += v

    def read(self, now: float) -> list[float]:
        at = self.at
        if at is None:
            self.at = now
        elif now - at >= DECAY_STEP_S:
            f = math.exp((at - now) / self.tau)
            s = self.sums
            for i in range(len(s)):
                s[i] *= f
            self.at = now
        return self.sums


class _Recent:
    """A count, a sum of x and a sum of a second quantity over the last requests rather than the
    last seconds: each request's weight halves every `HALF_LIFE` requests. What a tenant's
    requests look like stays known while it is refused (its flood turned away at the door leaves
    no answers behind)."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums = [0.0, 0.0, 0.0]

    def add(self, x: float, second: float) -> None:
        s = self.sums
        s[0] = s[0] * _KEEP + 1.0
        s[1] = s[1] * _KEEP + x
        s[2] = s[2] * _KEEP + second


HALF_LIFE = 100  # requests
_KEEP = 0.5 ** (1 / HALF_LIFE)


class _Flow:
    """One tenant's traffic in one scope: its first attempts (over time); the prompts of those
    tokenized (count, p, p^2 / 2) and its completed answers' lengths (count, o, o^2), over its
    last requests."""

    __slots__ = ("arrived", "prompts", "answers")

    def __init__(self, tau: float) -> None:
        self.arrived = _Decayed(tau, 1)
        self.prompts = _Recent()
        self.answers = _Recent()


# a tenant's answers are its own once this many have completed; before, the model's
OWN_ANSWERS = 3.0
FORGET_BELOW = 1e-6  # a flow whose arrivals have decayed below this is dropped


@dataclass(frozen=True, slots=True)
class DemandEstimate:
    replicas: float  # what the offered traffic needs
    offered_rps: float  # first attempts per second, refused ones included
    cost_s: float  # engine-seconds per request at batch `batch`
    batch: float  # the batch a replica runs at full load on this mix
    prompt_tokens: float  # the mix's mean prompt
    output_tokens: float  # and mean output
    prefix_hit_rate: float  # of prompt tokens, among dispatched requests

    def as_dict(self) -> dict:
        return {"replicas": round(self.replicas, 4), "offered_rps": round(self.offered_rps, 4),
                "cost_s": round(self.cost_s, 6), "batch": round(self.batch, 2),
                "prompt_tokens": round(self.prompt_tokens, 1), "output_tokens": round(self.output_tokens, 1),
                "prefix_hit_rate": round(self.prefix_hit_rate, 4)}


class Demand:
    """One model's offered traffic, per (tenant, protected)."""

    __slots__ = ("window_s", "flows", "cached", "since")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.flows: dict[tuple[str, bool], _Flow] = {}
        self.cached = _Decayed(window_s, 2)  # prompt tokens dispatched, and those found cached
        self.since: float | None = None  # the first arrival: a rate over less than the window is scaled up

    def _flow(self, tenant: str, protected: bool) -> _Flow:
        f = self.flows.get((tenant, protected))
        if f is None:
            f = self.flows[(tenant, protected)] = _Flow(self.window_s)
        return f

    def arrived_first(self, tenant: str, protected: bool, now: float) -> None:
        """A first attempt reached the model (before any layer that may refuse it)."""
        if self.since is None:
            self.since = now
        self._flow(tenant, protected).arrived.read(now)[0] += 1.0

    def sized(self, tenant: str, protected: bool, prompt_tokens: int, now: float) -> None:
        """A first attempt's prompt, once tokenized."""
        p = float(prompt_tokens)
        self._flow(tenant, protected).prompts.add(p, p * p / 2)

    def completed(self, tenant: str, protected: bool, output_tokens: int, now: float) -> None:
        o = float(output_tokens)
        self._flow(tenant, protected).answers.add(o, o * o)

    def dispatched(self, prompt_tokens: int, prefill_tokens: int, now: float) -> None:
        """A request went to a replica, which holds all but `prefill_tokens` of its prompt."""
        self.cached.add((float(prompt_tokens), float(prompt_tokens - prefill_tokens)), now)

    def hit_rate(self, now: float) -> float:
        prompt, cached = self.cached.read(now)
        return min(1.0, max(0.0, cached / prompt)) if prompt > 0 else 0.0

    def estimate(self, now: float, step: StepTimeModel, max_num_seqs: int, kv_tokens: float | None,
                 tpot_s: float | None, default_output: int, protected: bool = False) -> DemandEstimate:
        """`kv_tokens`: one replica's KV cache (None: unknown, the batch is `max_num_seqs`'s);
        `tpot_s`: the decode step the strictest TPOT SLO allows (None: none); `default_output`:
        the answer length assumed before any has completed."""
        # the model's own prompts and answers, for a tenant with none of either yet
        model_p = [0.0] * 3
        model_o = [0.0] * 3
        rows = []
        for key, f in list(self.flows.items()):
            arrived, prompts, answers = f.arrived.read(now)[0], f.prompts.sums, f.answers.sums
            if arrived < FORGET_BELOW:  # nothing from it for 14 windows: what it sent is forgotten
                del self.flows[key]
                continue
            model_p = [m + v for m, v in zip(model_p, prompts, strict=True)]
            model_o = [m + v for m, v in zip(model_o, answers, strict=True)]
            if arrived and (key[1] or not protected):
                rows.append((arrived, prompts, answers))
        if not rows or self.since is None:
            return DemandEstimate(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        o_default = (float(default_output), float(default_output) ** 2)
        # the mix: each tenant's mean prompt and answer moments, weighted by its arrivals
        total = p1 = p2 = o1 = o2 = po = 0.0
        for arrived, prompts, answers in rows:
            tp1, tp2 = _means(prompts, model_p, FORGET_BELOW, (0.0, 0.0))
            to1, to2 = _means(answers, model_o, OWN_ANSWERS, o_default)
            to1 = max(1.0, to1)
            total += arrived
            p1 += arrived * tp1
            p2 += arrived * tp2
            o1 += arrived * to1
            o2 += arrived * to2
            po += arrived * tp1 * to1
        p, pairs, o, o_sq, p_o = p1 / total, p2 / total, o1 / total, o2 / total, po / total
        ctx_o = p_o + o_sq / 2  # E[(p + o/2) o]: the context a request's decode steps read
        held = ctx_o / o  # tokens a request holds, averaged over its decode steps
        batch = float(max_num_seqs)
        if kv_tokens:
            batch = min(batch, kv_tokens / held)
        if tpot_s is not None:
            per_request = step.b * (1 + p / o) + step.c * held
            if per_request > 0:
                batch = min(batch, (tpot_s - step.a) / per_request)
        batch = max(1.0, batch)
        h = self.hit_rate(now)
        cost = step.a * o / batch + step.b * ((1 - h) * p + o) + step.c * ctx_o + step.d * (1 - h * h) * pairs
        filled = 1.0 - math.exp(-max(now - self.since, self.window_s * 0.05) / self.window_s)
        rate = total / (self.window_s * filled)
        return DemandEstimate(rate * cost, rate, cost, batch, p, o, h)


def _means(own: list[float], model: list[float], enough: float, default: tuple[float, float]) -> tuple[float, float]:
    """A flow's means of x and of its second sum (`own`: count, sum of x, sum of the second),
    from its own once it has `enough` (decayed) of them, else the model's, else `default`."""
    if own[0] >= enough:
        return own[1] / own[0], own[2] / own[0]
    if model[0] > FORGET_BELOW:
        return model[1] / model[0], model[2] / model[0]
    return default
