"""Placement: a replica with room for a request now, predicted in time, ranked by the router.
In a disaggregated fleet that replica is a prefill worker, and a decode worker must also be
predicted to have room when the prefill ends (`bouncer.core.fleet.decode_room`), or the request waits:
it is never sent to prefill without a place to decode.

Layer 3 of a request's life. The pool-wide checks come first (`pool_admits`: long requests wait
while the pool is under pressure; tenants' KV shares), then each replica's room (`room`, a pure
query: KV headroom, prefill queue, the TPOT hold, the TTFT and TPOT reserves of higher bands, the
in-flight limit), then the deadline (only replicas predicted to meet it), then the router.
A replica's busy mark (hysteresis) and the end of its rest after a refusal are moved by `place`,
once, before its room is asked. The prompt tokens each replica holds are computed once per placement
and handed to everything that reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bouncer.config import ModelConfig, Policy, Tenant
from bouncer.core.agents.gate import AgentGate
from bouncer.core.fleet.blocks import num_blocks
from bouncer.core.fleet.decode_room import choose_decode
from bouncer.core.fleet.permits import PermitStore
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.fleet.routing import Router, cached_tokens
from bouncer.core.learning.latency import prefill_pairs
from bouncer.core.outcomes import RETRY_AFTER_MIN_S, Layer, Reason, Refusal
from bouncer.core.requests import Admission


class Room(enum.Enum):
    YES = "yes"
    LATER = "later"  # usable but full for now (KV, prefill queue): only a warm prefix may justify sending it there
    # not this one, a smaller one may fit: its prefill would eat into a higher band's TTFT reserve,
    # or its context would slow the batch past a TPOT promised there
    SMALLER = "smaller"
    NO = "no"  # a brake that holds every cold request alike (the busy mark, in-flight limits)


class Held(enum.Enum):
    """Why a request is held (`Placement.place`)."""

    # no replica has room for its size now (KV, prefill queue, a higher band's TTFT reserve, the
    # TPOT hold): room frees as work drains, and smaller requests would take it meanwhile
    ROOM = "room"
    # a rule holds it that holds the others alike or lets them go first: the busy mark and
    # in-flight limits (warm requests pass them), long requests while the pool is under
    # pressure, KV shares, the agent window
    RULE = "rule"


@dataclass(frozen=True, slots=True)
class Late:
    """No replica can serve the request within its TTFT deadline."""

    by_s: float  # predicted lateness on the best replica


INF = float("inf")


class HeldForRoom:
    """Cold requests of one band that one dispatch run found no room for: a larger one finds none
    either, for the same reason (`find`), without asking each replica's `room`.

    Under overload most of a run is spent on heads that will wait: on ServeGen's m-large pool at
    load 2, 131k placements in 20 s held their request against 3k that sent one. Within a run the
    clock stands still and grants only take room; for a request no replica holds a prefix of,
    every check of `room` grows with its size (KV blocks needed, prefill queued, the TTFT
    reserve, the batch's predicted TPOT: step-time coefficients are kept >= 0) or with a
    tighter TPOT SLO, and the brakes that are not about size hold every cold request alike."""

    __slots__ = ("_shapes",)
    MAX_SHAPES = 8  # held requests remembered per run (the first: each look-up reads them all)

    def __init__(self) -> None:
        self._shapes: list[tuple[int, int, float, Held]] = []  # (prompt, expected output, TPOT SLO, why)

    def find(self, adm: Admission) -> Held | None:
        """Why `adm` (cold, of this band) is held, if it is no smaller than one held already."""
        prompt, output, tpot = adm.info.prompt_tokens, adm.expected_output, adm.tpot_slo or INF
        for p, o, t, why in self._shapes:
            if prompt >= p and output >= o and tpot <= t:
                return why
        return None

    def add(self, adm: Admission, why: Held) -> None:
        if len(self._shapes) < self.MAX_SHAPES:
            self._shapes.append((adm.info.prompt_tokens, adm.expected_output, adm.tpot_slo or INF, why))


def kv_limit(policy: Policy, priority: int, protected: tuple[float, float]) -> float:
    """The projected KV usage a request of band `priority` may fill a replica to, `protected`
    the SLOs of the higher bands that send (`BandSLOs.protected`). The highest band that sends,
    above 0, goes past the busy mark to `top_band_kv_threshold`; the others stop at
    `kv_busy_threshold`. Nothing is preempted: a lower band's request, once in, holds its blocks
    to its end, and a reasoning answer's grow for minutes. On ServeGen's DeepSeek-R1 pool the
    top band, held by the busy mark until the lower band's answers drained the replica to
    `kv_resume_threshold`, had 87% of its requests within SLO at load 2 and 76% at load 3,
    against 95% alone (docs/benchmarks/where-bouncer-loses.md)."""
    if priority > 0 and protected[0] == INF and protected[1] == INF:
        return max(policy.kv_busy_threshold, policy.top_band_kv_threshold)
    return policy.kv_busy_threshold


def update_busy(r: ReplicaState, usage: float, policy: Policy) -> None:
    """Its busy mark follows its KV usage with hysteresis: busy at kv_busy_threshold, usable
    again under kv_resume_threshold."""
    if r.busy and usage < policy.kv_resume_threshold:
        r.busy = False
    elif not r.busy and usage >= policy.kv_busy_threshold:
        r.busy = True


def room(r: ReplicaState, adm: Admission, cached: int, usage: float, protected: tuple[float, float],
         kv: float, policy: Policy, now: float) -> Room:
    """Whether `r` (usable, not resting) can take `adm` now, `cached` of its prompt tokens being
    cached there, at KV `usage`, `protected` the TTFT and TPOT SLOs of a higher band it must
    leave room for, and `kv` the KV usage its band may fill the replica to (`kv_limit`)."""
    p = policy
    protected_ttft, protected_tpot = protected
    # (each read once: this runs for every replica on every placement, the core's hottest call)
    lat = r.latency
    inflight = r.requests_in_flight
    # A request whose prefix is cached here is warm: it adds little prefill and few new blocks,
    # and the checks below (predicted TPOT, the KV it still needs) look at what it adds. The
    # coarse brakes (the busy mark's hysteresis, the TPOT guard's in-flight limit) would only
    # send it to a cold replica to compute its whole prompt again.
    warm = cached > 0 and lat is not None
    # the busy mark holds the bands that stop at it; the one let past it (`kv_limit`) is held
    # by the KV it needs alone, even where it runs nothing of ours
    past_mark = r.busy and kv > p.kv_busy_threshold
    if (r.busy and not warm and not past_mark) or inflight >= p.max_inflight_per_replica:
        return Room.NO
    if inflight >= r.concurrency_limit and not warm:
        return Room.NO
    tpot = None  # the TPOT of the batch it would join, where something asks for it
    if p.tpot_hold and inflight and lat is not None and r.role != "prefill":
        # the batch it would join must stay within the strictest TPOT promised there, and
        # while a higher band sends, leave room in it for that band's next requests
        limit = min(min(r.tpot_slos, default=INF), adm.tpot_slo or INF) * p.tpot_guard_margin
        if protected_tpot < INF:
            limit = min(limit, protected_tpot * p.tpot_guard_margin * (1 - p.tpot_reserve_fraction))
        if limit < INF and (tpot := r.predict_tpot(adm, now)) > limit:  # type: ignore[operator]
            return Room.SMALLER
    uncached = adm.info.prompt_tokens - cached
    if lat is not None and p.ttft_reserve_fraction > 0 and protected_ttft < INF:
        # keep the prefill queue short enough for a higher band's next request to start in time
        pairs = r.queued_prefill_pairs + prefill_pairs(adm.info.prompt_tokens, uncached)
        if lat.ttft(r.queued_prefill_tokens + uncached, 1, r.decoding, r.decode_context, pairs) \
                > protected_ttft * p.ttft_reserve_fraction:
            return Room.SMALLER
    # the blocks it still needs: its cached prefix is in the pool already (counted in usage
    # while others use it; where it sits evictable, this underestimates, and the engine may
    # have to preempt: measured, rarely)
    cap = r.capacity_blocks
    # a prefill worker holds the prompt only: the answer is generated on a decode worker
    output = 0 if r.role == "prefill" else adm.expected_output
    need = num_blocks(adm.info.prompt_tokens - cached + output, r.block_size) / cap if cap else 0.0
    if (inflight or past_mark) and usage + need > kv:
        return Room.LATER
    # while a higher band sends, leave it the KV that what runs here is still growing into
    if inflight and lat is not None and (protected_ttft < INF or protected_tpot < INF) \
            and outgrows(r, adm, usage + need, output, kv, tpot, p, now):
        return Room.LATER
    # its prefill queue is full (what it holds cached adds no prefill work there): about one
    # engine step, or less where the TPOT guard found steps too long for short answers
    # (`feedback.adapt_limits`). Sheddable work queued there does not make others wait: it was
    # let in to use spare capacity, and a request held behind it would still wait for that
    # prefill, then often be refused as late (in rogue-tenant: the SLA tenant's long prompts,
    # behind the free tier's, at load 0.5).
    if r.queued_prefill_tokens and r.queued_prefill_tokens + uncached > min(p.prefill_busy_tokens, r.prefill_limit) \
            and (adm.priority < 0 or r.unstarted_at_or_above(0)):
        return Room.LATER
    return Room.YES


def outgrows(r: ReplicaState, adm: Admission, usage: float, output: int, kv: float, tpot: float | None,
             policy: Policy, now: float) -> bool:
    """Whether `r`'s KV usage, `usage` with `adm` in, rising as it has lately (`kv_growth`) would
    pass the top band's limit (the headroom past the busy mark is the top band's, `kv_limit`)
    before `adm`'s answer, `output` tokens at the batch's TPOT (`tpot`, predicted here if not
    given), is done. Answers grow their KV a token a step and nothing is preempted, so a replica
    that lower bands filled from cold with long answers passes its busy mark only after they
    were let in: on DeepSeek-R1 at load 3 its KV reached 1.0, the engine queued the top band's
    requests, and the top band had 85.7% within SLO against 95.7% alone. In a steady state the
    usage holds still (answers end as fast as new ones grow) and this holds nothing back; nor
    does a trend read from scrapes that stopped coming."""
    if r.kv_growth <= 0 or now - r.telemetry.heard_at > policy.telemetry.staleness_s:  # type: ignore[union-attr]
        return False
    if tpot is None:
        tpot = r.predict_tpot(adm, now)
    return usage + r.kv_growth * output * tpot > max(kv, policy.top_band_kv_threshold)  # type: ignore[operator]


def rest(r: ReplicaState, policy: Policy, now: float, retry_after: float | None) -> None:
    """A replica refused a request: it gets nothing for `upstream_refusal_cooldown_s` (doubled
    for each refusal in a row while it runs nothing of ours: then it is not merely full), or for
    as long as its own Retry-After asked (both bounded); and no more in flight than it holds
    now, until completions let it grow."""
    p = policy
    if not r.requests_in_flight:
        r.idle_refusals += 1
    span = p.upstream_refusal_cooldown_s * 2 ** min(20, max(0, r.idle_refusals - 1))
    if retry_after is not None:
        span = max(span, retry_after)
    r.cooldown_until = now + min(p.upstream_refusal_cooldown_max_s, span)
    r.concurrency_limit = max(1.0, min(r.concurrency_limit, r.requests_in_flight))
    r.refusals_cut_limit = True


def nowhere_to_go(replicas: dict[str, ReplicaState], adm: Admission, policy: Policy, now: float) -> Refusal | None:
    """Why no replica will take a request a backend just refused (503 upstream_refused), or None:
    every usable one refuses everything (`upstream_refusal_retries` refusals in a row while
    running none of ours), or rests past the request's TTL."""
    usable = [r for r in replicas.values() if not r.removed and r.healthy]
    wake = min((r.cooldown_until or now for r in usable), default=None)
    if wake is not None and wake <= adm.deadline and not all(r.idle_refusals >= policy.upstream_refusal_retries
                                                             for r in usable):
        return None
    return Refusal(Layer.UPSTREAM, Reason.UPSTREAM_REFUSED, "no backend will take this request: they refuse it "
                   "for load, or rest longer than its queue TTL",
                   max(RETRY_AFTER_MIN_S, (wake or now + RETRY_AFTER_MIN_S) - now))


class Placement:
    """Where requests of one core go. Reads the policy, the tenants' KV shares and what their
    permits hold; changes nothing but the replicas' marks."""

    def __init__(self, policy: Policy, router: Router, tenants: dict[str, Tenant], permits: PermitStore) -> None:
        self.policy = policy
        self.router = router
        self.tenants = tenants  # name -> config, for context caps
        self.kv_shares = [(name, t.kv_share) for name, t in tenants.items() if t.kv_share > 0]
        self.permits = permits

    def best_ttft(self, replicas: dict[str, ReplicaState], adm: Admission, view: PoolView) -> float | None:
        """The lowest TTFT predicted for `adm` on a usable replica, were it sent now (None
        without a step-time model)."""
        subset = adm.info.replicas
        ttfts = [ttft for r in view.prompt_workers() if subset is None or r.name in subset
                 if (ttft := r.predict_ttft(adm, adm.info.prompt_tokens - cached_tokens(r, adm, view.now)))
                 is not None]
        return min(ttfts) if ttfts else None

    def place(self, model: ModelConfig, replicas: dict[str, ReplicaState], adm: Admission, view: PoolView,
              protected: tuple[float, float], kv: float, agents: AgentGate, acts_on_late: bool,
              held_for_room: HeldForRoom | None = None) -> tuple[ReplicaState, dict[str, int]] | Late | Held:
        """A replica for `adm` (with the prompt tokens each replica holds), Late when none would
        start it in time (waiting would not help: the deadline nears as fast as the work ahead
        drains), or Held: hold it, and why. In time: its predicted TTFT there, with what is queued there,
        is within its deadline. (Not times its band's margin, `bouncer.core.learning.ttft_margin`: that
        refused requests with a fair chance, costing up to 10% of goodput in the simulator.)
        `kv`: what its band may fill a replica to (`kv_limit`, the same for the whole band).
        `held_for_room`: the cold requests of its band this dispatch run held (read and added to)."""
        now = view.now
        if not self._pool_admits(model, replicas, adm, view, kv):
            return Held.RULE
        subset = adm.info.replicas
        cached = {r.name: cached_tokens(r, adm, now) for r in replicas.values()}
        # (one kept to a subset is no smaller than another only within that subset)
        cold = held_for_room is not None and adm.session is None and subset is None and not any(cached.values())
        known = held_for_room.find(adm) if cold else None  # type: ignore[union-attr]
        candidates: list[ReplicaState] = []
        # usable, but full for now (prefill queue, KV headroom): only a replica
        # holding this prompt's prefix may still get it, if the router's stickiness gate allows
        backlogged: list[ReplicaState] = []
        sized = False  # some replica lacks room for its size only (`Held.ROOM`)
        policy = self.policy
        for r in replicas.values():
            if not view.usable(r) or r.role == "decode":
                continue
            if subset is not None and r.name not in subset:
                continue
            if r.cooldown_until is not None:  # resting after a refusal, until the end of its rest
                if now < r.cooldown_until:
                    continue
                r.cooldown_until = None
            usage = view.usage(r)
            update_busy(r, usage, policy)  # (marks moved as for any placement, held or not)
            if known is not None:
                continue
            fit = room(r, adm, cached[r.name], usage, protected, kv, policy, now)
            if fit is Room.YES:
                candidates.append(r)
            elif fit is Room.LATER:
                backlogged.append(r)
                sized = True
            elif fit is Room.SMALLER:
                sized = True
        instead: list[ReplicaState] = []  # an agent's step: where it may go if its place would start it late
        if adm.session is not None and agents.enabled:
            where = agents.where(adm, candidates, backlogged, cached, replicas, now)  # type: ignore[union-attr]
            if where is None:
                return Held.RULE
            candidates, backlogged, instead = where
        if known is not None:
            return known
        if not candidates:
            why = Held.ROOM if sized else Held.RULE
            if cold:
                held_for_room.add(adm, why)  # type: ignore[union-attr]
            return why
        if adm.ttft_deadline is not None and candidates[0].latency is not None:
            budget = adm.ttft_deadline - now
            timely = _in_time(adm, candidates, instead, cached, budget)
            if isinstance(timely, float):
                if acts_on_late:
                    return Late(timely)
                adm.predicted_infeasible = True  # only flagged: it goes where the router says
            else:
                candidates = timely
                backlogged = [r for r in backlogged
                              if (r.predict_ttft(adm, adm.info.prompt_tokens - cached[r.name]) or 0.0) <= budget]
        chosen = self.router.choose(adm, candidates, view, self.policy.prefill_busy_tokens, backlogged, cached)
        if model.disaggregated:
            decode = self._decode_worker(replicas, adm, chosen, cached, view)
            if decode is None:
                return Held.ROOM
            adm.decode_replica = decode.name
        return chosen, cached

    def _decode_worker(self, replicas: dict[str, ReplicaState], adm: Admission, prefill: ReplicaState,
                       cached: dict[str, int], view: PoolView) -> ReplicaState | None:
        """The decode worker predicted to have room for `adm` when its prefill on `prefill` ends."""
        workers = [r for r in replicas.values() if r.role == "decode" and view.usable(r)]
        ttft = prefill.predict_ttft(adm, adm.info.prompt_tokens - cached[prefill.name]) or 0.0
        return choose_decode(workers, adm.info.prompt_tokens, adm.mean_output or adm.expected_output,
                             prefill.block_size, view.now + ttft, self.policy.kv_busy_threshold, view.now)

    def _pool_admits(self, model: ModelConfig, replicas: dict[str, ReplicaState], adm: Admission,
                     view: PoolView, kv: float) -> bool:
        """The checks that look at the whole pool: context squeeze under pressure, KV shares.
        `kv`: what its band may fill a replica to (`kv_limit`). Under the busy mark, a band let
        past it is squeezed as the others are below theirs: its pressure counts from as far
        under its own limit. (Counted from the busy mark, the top band's long prompts on
        DeepSeek-R1 waited in a pool at 0.83 with room to 0.97, until their TTL was spent: all
        22 of its misses at load 2 not made alone.) Past the mark, what is left is that band's
        own headroom, and the squeeze there shares it between its long requests and its short
        ones, as for every band: counted from its own limit there too, the long prompts took it
        and the short ones were refused as late (DeepSeek-R1 at load 3: 92.8% against 93.7%)."""
        p = self.policy
        total = adm.info.prompt_tokens + adm.max_tokens
        pressure = view.pool_usage()
        if pressure < p.kv_busy_threshold:
            pressure -= max(0.0, kv - p.kv_busy_threshold)
        if pressure > p.context_pressure_start:
            t = self.tenants[adm.tenant]
            cap = t.context_cap or model.max_model_len
            squeeze = min(1.0, (pressure - p.context_pressure_start) / max(1e-9, 1 - p.context_pressure_start))
            if total > cap * (1 - (1 - p.context_pressure_min_fraction) * squeeze):
                return False  # long requests wait while the pool is under pressure
        return self._within_kv_share(model, replicas, adm, view)

    def _within_kv_share(self, model: ModelConfig, replicas: dict[str, ReplicaState], adm: Admission,
                         view: PoolView) -> bool:
        """Tenants' KV shares reserve part of the pool; what a tenant does not use is lent out,
        but a borrower may not take the part other tenants have reserved and not yet used."""
        shares = self.kv_shares
        if not shares:
            return True
        caps = [r.capacity_blocks for r in view.usable_replicas()]
        if not caps or not all(caps):
            return True
        pool = sum(caps)  # type: ignore[arg-type]
        used = sum(r.inflight_blocks for r in replicas.values())
        reserved_idle = sum(max(0.0, share * pool - self.permits.tenant_blocks(name))
                            for name, share in shares if name != adm.tenant)
        need = num_blocks(adm.info.prompt_tokens + adm.expected_output, model.block_size)
        return used + need <= pool * self.policy.kv_busy_threshold - reserved_idle or used == 0


def _in_time(adm: Admission, candidates: list[ReplicaState], instead: list[ReplicaState], cached: dict[str, int],
             budget: float) -> list[ReplicaState] | float:
    """The candidates that would start `adm` within `budget` seconds (where its agent's place
    would start it late, those of `instead`); none: how late the best of them all would be."""
    ttfts = [r.predict_ttft(adm, adm.info.prompt_tokens - cached[r.name]) or 0.0 for r in candidates]
    in_time = [r for r, ttft in zip(candidates, ttfts, strict=True) if ttft <= budget]
    if not in_time and instead:
        more = [r.predict_ttft(adm, adm.info.prompt_tokens - cached[r.name]) or 0.0 for r in instead]
        in_time = [r for r, ttft in zip(instead, more, strict=True) if ttft <= budget]
        ttfts += more
    return in_time if in_time else float(min(ttfts) - budget)
