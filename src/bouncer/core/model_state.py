"""One model's state in the core: its waiting room, its replicas, its agents, its bands' SLOs."""

from __future__ import annotations

import dataclasses

from bouncer.config import BouncerConfig, ModelConfig, Policy, StepTimeConfig
from bouncer.core.agents.gate import AgentGate, NoAgents
from bouncer.core.fleet.decode_room import DecodeLedger
from bouncer.core.fleet.demand import Demand, DemandEstimate
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.backlog import Backlog, BacklogStore
from bouncer.core.flow.band_slos import BandSLOs
from bouncer.core.flow.fairness import CreditStore
from bouncer.core.flow.ordering import OrderingPolicy
from bouncer.core.flow.queues import FairnessPolicy, FlowQueues
from bouncer.core.flow.standing_queue import StandingQueues
from bouncer.core.learning.latency import LatencyPredictor
from bouncer.core.learning.step_time import StepTimeModel
from bouncer.core.learning.step_time_learner import GENERIC_PRIOR, StepTimeLearner
from bouncer.core.learning.ttft_margin import TtftMargins
from bouncer.core.sharing.peers import FleetShares

# What a model with no replica reads while requests wait for one: enough for an autoscaler's
# target of 0.5-1 demand per replica to ask for one (ceil(0.5 / target) = 1), not two (a held
# request read as 1.0 asked a 0.8 target for 2)
WAITING_FLOOR = 0.5


class ModelState:
    __slots__ = ("cfg", "flow", "draining", "looped_at", "replicas", "agents", "tpot_target", "band_slos",
                 "backlog", "step_time", "learner", "ttft_margins", "standing", "demand")

    def __init__(self, cfg: ModelConfig, flow: FlowQueues, backlog: BacklogStore,
                 shares: FleetShares | None = None) -> None:
        self.cfg = cfg
        self.flow = flow
        self.draining = False
        self.looped_at = float("-inf")  # when its dispatch loop last ran (`Dispatcher.run`)
        self.replicas: dict[str, ReplicaState] = {}
        self.agents: AgentGate = NoAgents()
        self.tpot_target: float | None = None  # strictest TPOT SLO of its tenants, with margin
        self.band_slos = BandSLOs()
        self.backlog = Backlog(cfg.name, flow, self.replicas, backlog, shares)
        self.step_time: StepTimeConfig | None = None  # the config the predictors below were built from
        self.learner: StepTimeLearner | None = None  # the step-time fit its replicas share, when learned
        self.ttft_margins = TtftMargins()  # how far its TTFT predictions are off, per band
        self.standing = StandingQueues()  # which of its tenants' queues stand (sustained overload)
        self.demand = Demand(cfg.demand.window_s)  # what arrives, for autoscalers

    def reconfigure(self, m: ModelConfig, config: BouncerConfig, fairness: FairnessPolicy, ordering: OrderingPolicy,
                    credit: CreditStore, agents: AgentGate, registry: dict[str, ReplicaState]) -> None:
        """A (re)loaded config: policies swapped in (queues re-ordered at once under a new
        ordering; credit kept under one fairness policy means nothing to another), its
        tenants' strictest TPOT SLO, its replicas."""
        p = config.policy
        self.cfg = m
        if self.flow.fairness.name != fairness.name:
            for band in self.flow.bands.values():
                for q in band.queues.values():
                    credit.reset((m.name, band.priority, q.tenant))
        self.flow.fairness = fairness
        if self.flow.ordering.name != ordering.name:
            self.flow.reorder(ordering)
        self.agents = agents
        if m.demand.window_s != self.demand.window_s:
            self.demand = Demand(m.demand.window_s)
        slos = [t.slo.tpot_s for t in config.tenants if t.slo.tpot_s and (not t.models or m.name in t.models)]
        self.tpot_target = min(slos) * p.tpot_guard_margin if slos else None
        self.sync_replicas(p, registry)

    def sync_replicas(self, policy: Policy, registry: dict[str, ReplicaState]) -> None:
        """Its replicas as its config lists them (new ones also entered in `registry`, the core's
        by name); a replica no longer listed finishes its work and gets nothing new. A replica's
        latency corrections, and a learned step time, survive a reload that keeps the model's
        step-time config."""
        m = self.cfg
        rebuild = m.step_time != self.step_time
        if rebuild:
            self.step_time = m.step_time
            self.learner = _learner(m.step_time)
        listed = set()
        for i, b in enumerate(m.backends):
            name = backend_name(m.name, i, b.name)
            listed.add(name)
            r = self.replicas.get(name)
            if r is None:
                r = self.replicas[name] = registry[name] = ReplicaState(name, m.name, b.url, _backend_blocks(m, b),
                                                                        m.block_size)
            r.url, r.configured_blocks, r.removed = b.url, _backend_blocks(m, b), False
            r.role = b.role
            if b.role == "decode" and r.decode_ledger is None:
                r.decode_ledger = DecodeLedger()
            r.offload_blocks = b.kv_offload_blocks
            r.prefix.events_staleness_s = policy.routing.kv_events_staleness_s
            if rebuild or r.predictor is None and m.step_time.mode != "off":
                r.predictor = _predictor(m.step_time, self.learner)
            r.sync_capacity()
        for name, r in list(self.replicas.items()):
            if name not in listed:
                r.removed = True
                if not r.inflight:
                    # drained: forgotten, so replicas that come and go (discovery) do not pile
                    # up; one still finishing work is forgotten at a later sync
                    del self.replicas[name]
                    registry.pop(name, None)

    def demand_estimate(self, now: float, default_output: int, protected: bool = False,
                        without_replicas: bool = False) -> DemandEstimate:
        """The replicas its offered traffic needs (`bouncer.core.fleet.demand`), priced by its step
        time: learned once warm, else the prior it learns from (a model scaled to zero has
        served nothing yet, and its demand must still read above zero). `without_replicas`: it
        has no replica that answers; then anything waiting needs one, however little it is: it
        reads at least `WAITING_FLOOR` for as long as anything waits."""
        step = self.learner.model if self.learner is not None else None
        if step is None:
            config = self.cfg.step_time
            step = _stated(config, (0.0,) * 5 if config.mode == "given" else GENERIC_PRIOR)
        sizes = [r.capacity_blocks * r.block_size for r in self.replicas.values()
                 if r.capacity_blocks and not r.removed and r.role != "prefill"]
        kv_tokens = sum(sizes) / len(sizes) if sizes else None
        est = self.demand.estimate(now, step, self.cfg.demand.max_num_seqs, kv_tokens, self.tpot_target,
                                   default_output, protected)
        if without_replicas and est.replicas < WAITING_FLOOR:
            waiting = sum(b.count for b in self.flow.bands_desc() if b.priority >= 0 or not protected)
            if waiting:
                return dataclasses.replace(est, replicas=WAITING_FLOOR)
        return est


def _learner(step: StepTimeConfig) -> StepTimeLearner | None:
    if step.mode != "learned":
        return None
    return StepTimeLearner(step.coefficients(GENERIC_PRIOR), step.max_batched_tokens)


def _predictor(step: StepTimeConfig, learner: StepTimeLearner | None) -> LatencyPredictor | None:
    if step.mode == "off":
        return None
    if learner is not None:
        return LatencyPredictor(learner=learner)
    return LatencyPredictor(_stated(step, (0.0,) * 5))


def _stated(step: StepTimeConfig, default: tuple[float, ...]) -> StepTimeModel:
    """The step time the config states, `default` for the coefficients it leaves out."""
    a, b, c, d, e = step.coefficients(default)
    return StepTimeModel(a, b, c, step.max_batched_tokens, d, e)


def next_wakeup(models: dict[str, ModelState], replicas: dict[str, ReplicaState]) -> float | None:
    """When the core's `tick` must run next at the latest: the earliest queue TTL, or the end of
    a replica's rest after a refusal while work is queued for it, or an idle agent freeing its
    slot."""
    # (plain loops: the simulator asks after every event it handles)
    wake = None
    for ms in models.values():
        d = ms.flow.next_deadline()
        if d is not None and (wake is None or d < wake):
            wake = d
        if len(ms.flow):
            t = ms.agents.next_wakeup(ms.flow.waiting_sessions)
            if t is not None and (wake is None or t < wake):
                wake = t
    for r in replicas.values():
        t = r.cooldown_until
        if t is not None and (wake is None or t < wake) and len(models[r.model].flow):
            wake = t
    return wake


def backend_name(model: str, index: int, explicit: str | None) -> str:
    return explicit or f"{model}/{index}"


def _backend_blocks(model: ModelConfig, backend) -> int | None:
    if backend.kv_blocks:
        return backend.kv_blocks
    if backend.kv_cache_gb and model.kv:
        return int(backend.kv_cache_gb * 1e9 / model.kv.bytes_per_token) // model.block_size
    return None
