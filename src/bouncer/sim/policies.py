"""Gateway policies for the fleet simulator: Bouncer's own core, and the peers' baselines.

Each baseline follows the peer's documented algorithm and defaults (sources cited per class;
docs/benchmarks/method.md, "Baselines", lists them). All are driven through the same `GatewayPolicy`
interface as Bouncer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import xxhash

from bouncer.config import BouncerConfig, key_digest, parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.arrivals import Exemption
from bouncer.core.fleet.permits import LocalPermits
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.prefix_index import ApproxPrefixIndex
from bouncer.core.fleet.replica import ReplicaState, Telemetry
from bouncer.core.fleet.routing import RoundRobinRouter, Router, cached_tokens
from bouncer.core.flow.dispatch import blocks_and_prefill
from bouncer.core.journey import Claim as ClaimStep
from bouncer.core.journey import Go, Journey, Outcome, Refuse, Step
from bouncer.core.outcomes import Claim, Reason, Terminal
from bouncer.core.requests import Admission, RequestInfo
from bouncer.core.sharing.peers import GatewayShare
from bouncer.core.stores import Stores
from bouncer.sim.fleet import Dispatched, PolicyEvent, Refused, SimRequest
from bouncer.sim.quotas import SimQuotas

SIM_MODEL = "sim-llm"


def prompt_digest(req: SimRequest) -> int:
    """What stands for the hash of a simulated request's prompt: its id (a retry is the same
    request, so the same prompt). Stable across runs, unlike `hash()` of a string."""
    return xxhash.xxh3_64_intdigest(req.rid.encode())


class CorePolicy:
    """Bouncer's admission core, as the gateway runs it. Also the base of baselines that are
    the same machinery with a peer's parameters (llm-d flow control). `advises_clients`: its
    refusals carry Retry-After and `x-should-retry`, as Bouncer's gateway sends them; llm-d's EPP
    sends neither (no Retry-After anywhere in its repository: notes on peers), so its clients
    fall back on their own backoff."""

    def __init__(self, name: str, config: BouncerConfig, exemption: Exemption | None = None,
                 advises_clients: bool = True, stores: Stores | None = None, quota_epoch: float = 0.0) -> None:
        """`quota_epoch`: where the config has quotas, the wall-clock time of simulated second 0."""
        self.name = name
        self.advises_clients = advises_clients
        self.quotas = SimQuotas(config, quota_epoch) if config.quotas is not None else None  # `sim.quotas`
        # routes as config.policy.routing says; `stores`: what it shares with other gateways
        self.core = AdmissionCore(config, 0.0, stores, exemption=exemption)
        # what follows each decision, as the gateway runs it (`bouncer.core.journey`); an
        # external overflow endpoint is outside the simulated fleet, and refuses as the pool would
        self.journey = Journey(self.core, self.quotas, relays=False)
        self._keys = {t.name: t.api_keys_sha256[0] for t in config.tenants}
        # several gateways sharing state (`sim.several_gateways`): a dispatch's claim, checked there
        # (None: it holds; else the blocks the others hold on its replica)
        self.claimer: Callable[[str, Claim], int | None] | None = None
        # what a replica found later looks like (`set_replicas`): the config's first backend
        self._template = config.models[0].backends[0]

    @property
    def claimer(self) -> Callable[[str, Claim], int | None] | None:
        return self._claimer

    @claimer.setter
    def claimer(self, claimer: Callable[[str, Claim], int | None] | None) -> None:
        self._claimer = claimer
        self.journey.claims = claimer is not None

    @property
    def replica_names(self) -> list[str]:
        return self.core.view.replica_names()

    @property
    def queued(self) -> int:
        return self.core.view.queued

    def _convert(self, steps: list[Step], now: float) -> list[PolicyEvent]:
        out: list[PolicyEvent] = []
        for step in steps:
            if isinstance(step, Go):
                d = step.dispatch
                out.append(Dispatched(d.request_id, d.replica, d.decode_replica, d.cache_salt))
            elif isinstance(step, ClaimStep):
                others = self._claimer(step.dispatch.replica, step.dispatch.claim)  # type: ignore[misc,arg-type]
                out.extend(self._convert(self.journey.claimed(step.dispatch, others, now), now))
            elif isinstance(step, Refuse):
                e, r = step.reject, step.reject.refusal
                advice = self.advises_clients
                out.append(Refused(e.request_id, r.status, f"{r.layer.value}/{r.reason}",
                                   r.retry_after if advice else None, final=e.terminal is Terminal.EXPIRED,
                                   should_retry=r.should_retry if advice else True))
            # (`Relay` never comes: this driver does not relay; `Reclaimed`: its request ends as usual)
        return out

    def _info(self, req: SimRequest) -> RequestInfo:
        # as an OpenAI SDK client sends it: each attempt says how many came before
        # (x-stainless-retry-count), and a retry carries the same prompt
        return RequestInfo(request_id=req.attempt_id, key_digest=self._keys[req.tenant], model=SIM_MODEL,
                           prompt_tokens=req.prompt_len, max_tokens=req.max_tokens, block_digests=req.block_digests,
                           ttft_slo_s=req.ttft_slo, tpot_slo_s=req.tpot_slo, session_id=req.session,
                           parent_session_id=req.parent_session,
                           retry_count=req.attempt - 1, prompt_digest=prompt_digest(req))

    def offer(self, req: SimRequest, now: float) -> list[PolicyEvent]:
        info = self._info(req)
        if self.quotas is not None:
            info.over_quota = self.quotas.reserve(info.request_id, req.tenant, info.model, info.prompt_tokens,
                                                  self.core.view.predicted_output(req.tenant, info), now)
        return self._convert(self.journey.offer(info, now), now)

    def tick(self, now):
        return self._convert(self.journey.steps(self.core.tick(now), now), now)

    def next_wakeup(self):
        return self.core.next_wakeup()

    def started(self, attempt_id, now):
        self.journey.started(attempt_id, now)

    def handed_over(self, attempt_id, now):
        return self._convert(self.journey.handed_over(attempt_id, now), now)

    def finished(self, attempt_id, now, completed, completion_tokens):
        out = Outcome(Terminal.COMPLETED, None, completion_tokens) if completed \
            else Outcome(Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED, completion_tokens)
        return self._convert(self.journey.finished(attempt_id, now, out), now)

    def cancel(self, attempt_id, now):
        return self._convert(self.journey.cancel(attempt_id, now), now)

    def engine_refused(self, attempt_id, now):
        return self._convert(self.journey.requeue(attempt_id, now), now)

    def observe(self, replica: str, telemetry: Telemetry, now: float):
        self.journey.renew(now)  # what runs keeps its permit
        return self._convert(self.journey.steps(self.core.observe(replica, telemetry, now), now), now)

    def kv_events(self, replica: str, stored: list[tuple[str, int]], removed: list[tuple[str, int]],
                  now: float) -> None:
        self.core.kv_digests(replica, stored, removed, now)

    def set_replicas(self, names: list[str], now: float) -> list[PolicyEvent]:
        """The replicas there are now (a provisioner's), found as discovery finds them: like the
        ones the config listed, under these names."""
        model = self.core.config.models[0]
        backends = [self._template.model_copy(update={"name": n, "url": f"http://sim-{n}"}) for n in names]
        return self._convert(self.journey.steps(self.core.set_backends(model.with_backends(backends), now), now), now)

    def peers(self, others: list[GatewayShare], now: float) -> list[PolicyEvent]:
        """Several gateways (`bouncer.sim.several_gateways`): the others' parts of the shared state."""
        return self._convert(self.journey.steps(self.core.peers(others, now), now), now)


class _Passthrough:
    """Base of baselines with no waiting room: each request goes to a replica or is refused."""

    name = "passthrough"

    def __init__(self, replicas: list[str]) -> None:
        self.replica_names = replicas
        self.queued = 0
        self._where: dict[str, str] = {}

    def tick(self, now):
        return []

    def next_wakeup(self):
        return None

    def started(self, attempt_id, now):
        pass

    def handed_over(self, attempt_id, now):
        return []

    def finished(self, attempt_id, now, completed, completion_tokens):
        self._where.pop(attempt_id, None)
        return []

    def cancel(self, attempt_id, now):
        return []

    def engine_refused(self, attempt_id, now):
        self._where.pop(attempt_id, None)
        return [Refused(attempt_id, 503, "engine/queue_full", None)]  # vLLM sends no Retry-After

    def observe(self, replica, telemetry, now):
        return []

    def kv_events(self, replica, stored, removed, now):
        pass  # these baselines route without the engines' KV events

    def _dispatch(self, req: SimRequest, replica: str) -> list[PolicyEvent]:
        self._where[req.attempt_id] = replica
        return [Dispatched(req.attempt_id, replica)]


class NoAdmission(_Passthrough):
    """`none`: no gateway admission; each engine queues FCFS without bound. Routing is
    round-robin unless another router is named: then this is that router deployed on its own
    (the SGLang gateway's cache_aware policy, say), sending every request somewhere at once. The
    router sees the fleet as the gateway's core would (own in-flight accounting, scraped
    telemetry, a prefix index of what it sent) but never holds or refuses."""

    name = "none"
    PREFILL_SCALE = 16384  # normaliser for routers that weigh queued prefill tokens (two engine steps)

    def __init__(self, replicas: list[str], router: Router | None = None, capacity_blocks: int | None = None,
                 block_size: int = 16, offload_blocks: int = 0) -> None:
        super().__init__(replicas)
        self.router = router or RoundRobinRouter()
        self.fleet = {name: ReplicaState(name, SIM_MODEL, None, capacity_blocks, block_size) for name in replicas}
        for r in self.fleet.values():
            r.offload_blocks = offload_blocks
            r.sync_capacity()
        self.permits = LocalPermits()  # the core's own in-flight accounting, for the router to read

    def offer(self, req, now):
        adm = Admission(RequestInfo(req.attempt_id, None, SIM_MODEL, req.prompt_len, req.max_tokens,
                                    block_digests=req.block_digests),
                        req.tenant, req.priority, req.max_tokens, req.output_len, now, math.inf, None)
        serving = {name: r for name, r in self.fleet.items() if not r.removed}
        if not serving:  # scaled to zero: no engine to queue at
            return [Refused(req.attempt_id, 503, "gateway/no_backend", None)]
        cached = {name: cached_tokens(r, adm, now) for name, r in serving.items()}
        r = self.router.choose(adm, list(serving.values()), PoolView(serving, None, now), self.PREFILL_SCALE,
                               [], cached)
        blocks_and_prefill(adm, r, cached)
        r.prefix.record(req.block_digests, now)
        self.permits.grant(adm, r, now, math.inf)
        return self._dispatch(req, r.name)

    def started(self, attempt_id, now):
        adm = self.permits.get(attempt_id)
        if adm is not None:
            self.permits.started(adm, self.fleet[adm.replica], now)

    def finished(self, attempt_id, now, completed, completion_tokens):
        self.permits.release(attempt_id, self.fleet)
        return super().finished(attempt_id, now, completed, completion_tokens)

    def engine_refused(self, attempt_id, now):
        self.finished(attempt_id, now, False, 0)
        return super().engine_refused(attempt_id, now)

    def observe(self, replica, telemetry, now):
        self.fleet[replica].observe(telemetry)
        return []

    def kv_events(self, replica, stored, removed, now):
        self.fleet[replica].prefix.apply_digests(stored, removed, now)

    def set_replicas(self, names: list[str], now: float) -> list[PolicyEvent]:
        """New replicas get work from now on; a replica gone gets nothing new (what it holds
        finishes there, its accounting kept until then)."""
        template = next(iter(self.fleet.values()), None)
        for name in names:
            if name not in self.fleet:
                r = self.fleet[name] = ReplicaState(name, SIM_MODEL, None, template.configured_blocks if template
                                                    else None, template.block_size if template else 16)
                r.offload_blocks = template.offload_blocks if template else 0
                r.sync_capacity()
        for name, r in self.fleet.items():
            r.removed = name not in names
        self.replica_names = list(names)
        return []


class VllmQueueCap(NoAdmission):
    """`vllm-queue-cap`: round-robin to engines started with `--max-num-queued-reqs` /
    `--max-num-queued-tokens`; the engine refuses the excess with 503 and no Retry-After
    (vllm/config/scheduler.py; tests/v1/engine/test_admission_control.py). The caps themselves are
    set on the simulated engines (FleetConfig), since vLLM's default is no cap."""

    name = "vllm-queue-cap"


class TgiCap(_Passthrough):
    """`tgi-cap`: TGI's router admits up to `--max-concurrent-requests` (default 128) per
    instance and refuses the rest at once with 429 "Model is overloaded" (launcher/src/main.rs,
    router/src/infer/mod.rs); a round-robin load balancer in front."""

    name = "tgi-cap"
    MAX_CONCURRENT = 128

    def __init__(self, replicas: list[str]) -> None:
        super().__init__(replicas)
        self._rr = itertools.cycle(replicas)
        self._count = dict.fromkeys(replicas, 0)

    def offer(self, req, now):
        replica = next(self._rr)
        if self._count[replica] >= self.MAX_CONCURRENT:
            return [Refused(req.attempt_id, 429, "tgi/overloaded", None)]
        self._count[replica] += 1
        return self._dispatch(req, replica)

    def finished(self, attempt_id, now, completed, completion_tokens):
        replica = self._where.pop(attempt_id, None)
        if replica is not None:
            self._count[replica] -= 1
        return []

    def engine_refused(self, attempt_id, now):
        self.finished(attempt_id, now, False, 0)
        return [Refused(attempt_id, 503, "engine/queue_full", None)]


class DynamoBusy(_Passthrough):
    """`dynamo-busy`: Dynamo's KV router with busy thresholds and no queue. A worker is busy when
    its active decode blocks exceed `--active-decode-blocks-threshold` of its KV blocks (0.85
    here; unset by default) or its active prefill tokens exceed a threshold (here 1x the engine's
    max_num_batched_tokens, i.e. `--active-prefill-tokens-threshold-frac 1.0`); when every worker
    is busy the request is refused with 529 and no Retry-After (docs/design-docs/request-rejection.md,
    lib/llm/src/http/service/error.rs). Otherwise the cheapest worker wins: cost =
    prefill_load_scale x max(new prefill tokens - overlap credit x cached tokens, 0) + active decode
    blocks, both scales 1.0 (router-concepts.md). Active load is the router's own accounting."""

    name = "dynamo-busy"
    DECODE_BLOCKS_THRESHOLD = 0.85

    def __init__(self, replicas: list[str], capacity_blocks: int, block_size: int, prefill_threshold: int) -> None:
        super().__init__(replicas)
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.prefill_threshold = prefill_threshold
        self._blocks = dict.fromkeys(replicas, 0)
        self._prefill = dict.fromkeys(replicas, 0)
        self._req: dict[str, tuple[int, int]] = {}  # attempt -> (blocks, prefill tokens not started)
        self._index = {r: ApproxPrefixIndex(capacity_blocks) for r in replicas}

    def offer(self, req, now):
        best, best_cost, best_cached = None, float("inf"), 0
        for r in self.replica_names:
            if self._blocks[r] / self.capacity > self.DECODE_BLOCKS_THRESHOLD \
                    or self._prefill[r] > self.prefill_threshold:
                continue
            cached = self._index[r].match(req.block_digests) * self.block_size
            cost = max(req.prompt_len - cached, 0) + self._blocks[r]
            if cost < best_cost:
                best, best_cost, best_cached = r, cost, cached
        if best is None:
            return [Refused(req.attempt_id, 529, "dynamo/all_workers_busy", None)]
        blocks = -(-(req.prompt_len + req.output_len) // self.block_size)
        prefill = max(req.prompt_len - best_cached, 0)
        self._blocks[best] += blocks
        self._prefill[best] += prefill
        self._req[req.attempt_id] = (blocks, prefill)
        self._index[best].record(req.block_digests)
        return self._dispatch(req, best)

    def started(self, attempt_id, now):
        replica = self._where.get(attempt_id)
        if replica is not None and attempt_id in self._req:
            blocks, prefill = self._req[attempt_id]
            self._prefill[replica] -= prefill
            self._req[attempt_id] = (blocks, 0)

    def finished(self, attempt_id, now, completed, completion_tokens):
        replica = self._where.pop(attempt_id, None)
        blocks, prefill = self._req.pop(attempt_id, (0, 0))
        if replica is not None:
            self._blocks[replica] -= blocks
            self._prefill[replica] -= prefill
        return []

    def engine_refused(self, attempt_id, now):
        self.finished(attempt_id, now, False, 0)
        return [Refused(attempt_id, 503, "engine/queue_full", None)]


def tenant_config(name: str, priority: int, weight: float = 1.0, **kw) -> dict:
    return {"name": name, "api_keys_sha256": [key_digest(name)], "priority": priority, "weight": weight, **kw}


def core_config(tenants: list[dict], replicas: int | dict[str, str], kv_blocks: int, block_size: int,
                max_model_len: int, policy: dict, offload_blocks: int = 0, step_time: dict | None = None,
                max_num_seqs: int | None = None, pools: dict[str, list[str]] | None = None,
                extra: dict | None = None, cache_isolation: bool = False) -> BouncerConfig:
    """`replicas`: how many (colocated, named r0...), or each one's name and role
    (`FleetConfig.roles`); `step_time`: the models' step_time config (a profile's
    `step_time_config` states it as given; without it, latency prediction is off: the baselines
    that use the core predict none); `max_num_seqs`: the engines', as an operator states it for the
    demand signal. `pools`: more models (`bench overflow`), each served by these of the replicas
    (the rest are SIM_MODEL's); `extra`: more of the config (quotas, a model's overflow targets
    under `models`: {name: {...}}). `cache_isolation` (the config's, on by default in production)
    is off unless asked for: the scenarios' tenants draw their prompts from the same traces, so
    what they share is the workload's making, and the peers' policies share it too; what
    isolating tenants costs is measured on its own (`bench run --scenario prefix`, docs/benchmarks/routing.md)."""
    roles = replicas if isinstance(replicas, dict) else {f"r{i}": "both" for i in range(replicas)}
    pools = {SIM_MODEL: [n for n in roles if not any(n in p for p in (pools or {}).values())], **(pools or {})}
    extra = dict(extra or {})
    more = extra.pop("models", {})
    return parse_config({
        "tenants": tenants,
        "models": [{"name": model, "max_model_len": max_model_len, "block_size": block_size,
                    "step_time": step_time or {"mode": "off"},
                    **({"demand": {"max_num_seqs": max_num_seqs}} if max_num_seqs else {}),
                    "backends": [{"url": f"http://sim-{name}", "name": name, "kv_blocks": kv_blocks,
                                  "kv_offload_blocks": offload_blocks, "role": roles[name]} for name in names],
                    **more.get(model, {})}
                   for model, names in pools.items()],
        "policy": policy,
        "cache_isolation": cache_isolation,
        **extra,
    }, "simulated gateway")


# Bouncer's own policy in the simulator: the shipped defaults (bouncer/config.py, tuned once for
# every scenario, no per-scenario knobs), with waiting-room bounds sized for the simulated fleet.
def merged(base: dict, changes: dict) -> dict:
    """`base` (a policy, nested as in the config) with `changes` (`--set`) over it, key by key."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


BOUNCER_POLICY = {
    "queues": {"max_requests": 5000, "band_max_requests": 5000, "tenant_max_requests": 2000,
               "tenant_max_tokens": 20_000_000, "max_tokens": 50_000_000},
}

# llm-d flow control (feature gate on) with its documented defaults: utilization detector
# max(queue/5, kv/0.8) averaged over endpoints, stale metrics (200 ms) count as saturated,
# round-robin fairness, FCFS, 60 s TTL, sheddable refused when saturated, per-band 5,000-request
# queues, no per-request KV fit check (peers.md section 2.1).
LLMD_POLICY = {
    "fairness": "round-robin",
    "ordering": "fcfs",
    "default_ttl_s": 60.0,
    "kv_busy_threshold": 1.0,
    "kv_resume_threshold": 1.0,
    "prefill_busy_tokens": 10**9,
    "default_ceiling": 1.0,
    "sheddable_ceiling": 1.0,
    "band_ceilings": {},
    "saturation": {"queue_depth_threshold": 5, "kv_threshold": 0.8},
    "telemetry": {"staleness_s": 0.2, "on_stale": "fail-closed", "alive_from_streams": False},
    "queues": {"max_requests": 10**6, "band_max_requests": 5000, "tenant_max_requests": 10**6,
               "tenant_max_tokens": 10**12, "max_tokens": 10**12},
    "max_inflight_per_replica": 10**6,
    "context_pressure_start": 1.0,
    "priority_ceiling": 1.0,
    # llm-d reads scraped metrics as they are; these are Bouncer's own additions, off here
    "project_recent_dispatches": False,
    "ttl_within_slo": False,  # llm-d's TTL is its own (60 s), not the request's SLO
    "refuse_infeasible": False,
    "tpot_guard": False,
    "tpot_hold": False,
    "tpot_reserve_fraction": 0.0,
    "retries": {"deadline": "fresh"},  # a retry is a new request to llm-d
    "routing": {"router": "llmd-scorers"},
}
