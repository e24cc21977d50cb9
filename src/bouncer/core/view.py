"""The core as its shells may read it: counts, queues and replicas, never its private fields.

The gateway (metrics, /admin/state, its scrapers), the simulator and the benchmarks read the core
through `CoreView` only. Everything it returns is a copy or an immutable value, except `stats`,
whose counters the core keeps and the shells only read.
"""

from __future__ import annotations

from dataclasses import dataclass

from bouncer.core.agents.gate import WindowGate
from bouncer.core.finaliser import CoreStats
from bouncer.core.fleet.demand import DemandEstimate
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.saturation import ceiling
from bouncer.core.intake import checks
from bouncer.core.learning import feedback
from bouncer.core.outcomes import Refusal
from bouncer.core.parts import CoreParts
from bouncer.core.requests import RequestInfo


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    name: str
    model: str
    url: str | None
    configured_blocks: int | None
    removed: bool
    healthy: bool
    drift_reported: bool  # its engine has counted fewer requests than we have in flight there, for a while
    unseen_by_engine: int


@dataclass(frozen=True, slots=True)
class QueuedInfo:
    tenant: str
    band: int
    predicted_late: bool  # found unable to meet its TTFT SLO (and not acted on)


class CoreView:
    def __init__(self, core: CoreParts) -> None:
        self._core = core

    @property
    def stats(self) -> CoreStats:
        return self._core.stats

    @property
    def inflight(self) -> int:
        return len(self._core.permits)

    def inflight_ids(self) -> list[str]:
        return [adm.request_id for adm in self._core.permits]

    @property
    def queued(self) -> int:
        return sum(len(ms.flow) for ms in self._core.models.values())

    def predicted_output(self, tenant: str, info: RequestInfo) -> int:
        """The output a request of `tenant` is expected to have: its tenant's learned mean on its
        model (no margin), within the max_tokens it runs with, for each sequence it asks for.
        What a quota reserves."""
        c = self._core
        t, ms = c.tenants.get(tenant), c.models.get(info.model)
        if t is None or ms is None:
            return 0
        max_tokens = checks.context_budget(info, t, ms.cfg)
        if isinstance(max_tokens, Refusal):
            return 0
        return feedback.mean_output(c.tenants.output_models[tenant], c.policy, info.model, max_tokens) * info.sequences

    def tenant_of(self, key_digest: str | None, fairness_id: str | None) -> str | None:
        """The tenant a request with this key (and fairness id) would be, as `offer` finds it;
        None: it is refused as unauthenticated."""
        t = self._core.tenants.identify(key_digest, fairness_id)
        return t.name if t is not None else None

    def rate_headroom(self, tenant: str, now: float) -> tuple[tuple[float, float, float] | None,
                                                              tuple[float, float, float] | None]:
        """What `tenant`'s request and token buckets hold now: (level, burst, rate) each, None
        where it has no such limit (what the `x-ratelimit-*` headers say)."""
        if tenant not in self._core.tenants.by_name:
            return None, None
        return self._core.gate.rate_limits.headroom(tenant, now)

    def tenant_bands(self) -> dict[str, int]:
        """Each configured tenant's priority band."""
        return {t.name: t.priority for t in self._core.config.tenants}

    def pressures(self, now: float) -> list[tuple[str, float | None, float | None, bool]]:
        """Each outside signal: (name, its last value, its age in seconds, whether it sheds now)."""
        return [(name, s.value, None if s.at is None else now - s.at, s.shedding(now))
                for name, s in self._core.pressures.items()]

    def replica_names(self, live_only: bool = False) -> list[str]:
        return [name for name, r in self._core.replicas.items() if not (live_only and r.removed)]

    def replica(self, name: str) -> ReplicaInfo:
        r = self._core.replicas[name]
        return ReplicaInfo(r.name, r.model, r.url, r.configured_blocks, r.removed, r.healthy, r.drift_reported,
                           r.unseen_by_engine)

    def queued_request(self, request_id: str) -> QueuedInfo | None:
        for ms in self._core.models.values():
            adm = ms.flow.get(request_id)
            if adm is not None:
                return QueuedInfo(adm.tenant, adm.priority, adm.predicted_infeasible)
        return None

    def snapshot(self, now: float) -> dict:
        core = self._core
        retries = core.finaliser.retries
        out = {"inflight": self.inflight, "queued": self.queued, "permits_reclaimed": core.stats.reclaimed,
               "models": {}, "retries_remembered": None if retries is None else len(retries)}
        for name, ms in core.models.items():
            view = PoolView(ms.replicas, core.policy, now)
            window = ms.agents.window if isinstance(ms.agents, WindowGate) else None
            out["models"][name] = {
                "draining": ms.draining,
                "agents": None if window is None else {"window": window.window, "active": window.holders(),
                                                        "active_elsewhere": window.holders_elsewhere(),
                                                        "subagents": window.subagents()},
                "saturation": round(core.saturation.saturation(view), 4),
                "queued": len(ms.flow),
                "bands": {b.priority: {"queued": b.count, "tokens": b.tokens,
                                       "ceiling": ceiling(core.policy, b.priority),
                                       "tenants": {q.tenant: q.count for q in b.queues.values() if q.count}}
                          for b in ms.flow.bands_desc()},
                "step_time": _step_time_snapshot(ms),
                # the replicas its offered traffic needs, and the protected bands' alone (autoscaling)
                "demand": {scope: est.as_dict() for scope, est in self.demand(name, now, view).items()},
                "ttft_margins": ms.ttft_margins.snapshot(),  # per band: observed/predicted TTFT, QUANTILE
                "standing_queues": ms.standing.snapshot(now),  # (band, tenant) planned on standing_queue_share
                "replicas": {r.name: _replica_snapshot(r, view, now) for r in ms.replicas.values()},
            }
        return out

    def demand(self, model: str, now: float, view: PoolView | None = None) -> dict[str, DemandEstimate]:
        """The model's demand signal as `/metrics` exports it, for scopes `all` and `protected`
        (`bouncer.core.fleet.demand`); `view`: its pool at `now`, where the caller has it."""
        core = self._core
        ms = core.models[model]
        usable = (view or PoolView(ms.replicas, core.policy, now)).any_usable()
        default = core.policy.expected_output_default
        return {scope: ms.demand_estimate(now, default, scope == "protected", not usable)
                for scope in ("all", "protected")}

    def queue_ages(self, now: float) -> dict[str, dict[int, dict[str, float]]]:
        """How long the oldest queued request of each tenant in each band has waited, per model
        (a scan of every queued request: for the recorder's samples, not for every call)."""
        out: dict[str, dict[int, dict[str, float]]] = {}
        for name, ms in self._core.models.items():
            bands = out[name] = {}
            for b in ms.flow.bands_desc():
                ages = {q.tenant: now - min(a.arrival for a in q) for q in b.queues.values() if q.count}
                if ages:
                    bands[b.priority] = ages
        return out


def _step_time_snapshot(ms) -> dict:
    """The model's step time: learned (with how much it has seen), given, or off."""
    if ms.learner is not None:
        return ms.learner.snapshot()
    step = ms.step_time
    if step is None or step.mode == "off":
        return {"mode": "off"}
    a, b, c, d, e = step.coefficients((0.0,) * 5)
    return {"mode": "given", "coefficients": {"a": a, "b": b, "c": c, "d": d, "e": e},
            "max_batched_tokens": step.max_batched_tokens}


def _finite(limit: float) -> float | None:
    return None if limit == float("inf") else round(limit, 1)


def _replica_snapshot(r: ReplicaState, view: PoolView, now: float) -> dict:
    fresh = view.is_fresh(r)
    p = r.prefix
    index = {"mode": "precise" if p.events_live(now) else "approximate", "approx_blocks": len(p.approx)}
    if p.precise is not None:
        index.update(precise_blocks=len(p.precise), kv_events=p.precise.events, unplaced_blocks=p.precise.unplaced)
    return {"url": r.url, "healthy": r.healthy, "fresh": fresh, "answering": view.answering(r),
            "busy": r.busy, "removed": r.removed,
            "inflight": len(r.inflight), "inflight_elsewhere": r.peers.requests,
            "inflight_unseen_by_engine": r.unseen_by_engine,
            "inflight_drift": r.drift_reported, "capacity_blocks": r.capacity_blocks,
            "projected_kv_usage": round(r.projected_usage(now, fresh), 4),
            "telemetry_age_s": None if r.telemetry is None else round(r.telemetry_age(now), 3),
            # the engine's own figures at its last scrape
            "scraped": None if r.telemetry is None else {"kv_usage": r.telemetry.kv_usage,
                                                          "running": r.telemetry.running,
                                                          "waiting": r.telemetry.waiting},
            "prefix_index": index,
            # the TPOT guard's limits (None: not cut; the prefill limit is also bounded by
            # policy.prefill_busy_tokens)
            "limits": {"inflight": _finite(r.concurrency_limit), "prefill_tokens": _finite(r.prefill_limit)},
            "latency": None if r.latency is None else {"ttft_factor": round(r.latency.ttft_factor, 3),
                                                        "tpot_factor": round(r.latency.tpot_factor, 3)}}
