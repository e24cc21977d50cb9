"""What the other gateways hold and serve: the part of their state a gateway's decisions need.

Several gateways behind one load balancer each run their own core over one fleet. Two things
decide well only when counted fleet-wide:
- what each replica holds in flight (requests, KV blocks, prefill queued, decode context). Each
  gateway predicts TTFT and KV from these; counting only its own part, each of N gateways sees a
  replica about 1/N as loaded as it is, and together they overfill it.
- what each tenant of a band has been served. Weighted shares hold across gateways only if a
  gateway holds back a tenant served ahead of one that waits at another gateway: otherwise the
  gateway that frees room first (it sees its own completions at once) fills it again with its own
  tenants.

Each gateway hands out `GatewayShare`, its own part, on a period; the shell (the Redis link, or
the simulator's delayed bus) brings the others' back and the core takes their sum
(`AdmissionCore.peers`). What is seen of the others is a sync period and a round trip old, so it
is not a reservation: two gateways may both send to a replica within that moment. Where that
would overfill it (a dispatch leaving it nearly full), the dispatch is claimed first
(`bouncer.core.sharing.claims`).

Served tokens decay with a time constant (`window_s`), so shares are fair over the recent past
and a gateway that restarts (its part gone from the sum) leaves no debt that lasts: a tenant
whose part was lost is favoured for at most about one window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

ShareKey = tuple[str, int, str]  # model, band, tenant
# A head waits for a sooner one at another gateway only when that one must go this much sooner:
# near-ties go both, as the stale view cannot order them anyway. In `surge` at load 2 on three
# gateways (sync 20 ms, delay 2 ms): 85.2 req/s with 0, 88.8 with 0.1, 89.9 with 0.5, 81.1 with 2
# (where it no longer acts: one gateway starves); one gateway gets 93.6.
HEAD_ORDER_SLACK_S = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One gateway's requests in flight on one replica, as `ReplicaState` counts them."""

    requests: int = 0
    blocks: int = 0
    recent_blocks: int = 0  # dispatched after that gateway's last sample of the replica
    unstarted: int = 0
    unstarted_by_band: tuple[tuple[int, int], ...] = ()
    queued_prefill_tokens: int = 0
    queued_prefill_pairs: int = 0
    pending_context: int = 0
    decoding: int = 0
    decode_context: int = 0

    def __add__(self, other: ReplicaLoad) -> ReplicaLoad:
        bands = dict(self.unstarted_by_band)
        for band, n in other.unstarted_by_band:
            bands[band] = bands.get(band, 0) + n
        return ReplicaLoad(self.requests + other.requests, self.blocks + other.blocks,
                           self.recent_blocks + other.recent_blocks, self.unstarted + other.unstarted,
                           tuple(sorted(bands.items())),
                           self.queued_prefill_tokens + other.queued_prefill_tokens,
                           self.queued_prefill_pairs + other.queued_prefill_pairs,
                           self.pending_context + other.pending_context, self.decoding + other.decoding,
                           self.decode_context + other.decode_context)

    def to_wire(self) -> list:
        return [self.requests, self.blocks, self.recent_blocks, self.unstarted,
                [list(b) for b in self.unstarted_by_band], self.queued_prefill_tokens, self.queued_prefill_pairs,
                self.pending_context, self.decoding, self.decode_context]

    @classmethod
    def from_wire(cls, raw: list) -> ReplicaLoad:
        r, b, rb, u, bands, qpt, qpp, pc, d, dc = raw
        return cls(int(r), int(b), int(rb), int(u), tuple((int(k), int(n)) for k, n in bands), int(qpt), int(qpp),
                   int(pc), int(d), int(dc))


NO_LOAD = ReplicaLoad()


def urgency(adm) -> float:
    """When a queued request must go at the latest, the fleet-wide order of heads: its TTFT
    deadline, else its queue TTL (what `edf` orders by)."""
    return adm.ttft_deadline if adm.ttft_deadline is not None else adm.deadline


@dataclass(frozen=True, slots=True)
class GatewayShare:
    """One gateway's part: its load on each replica; what it served per (model, band, tenant),
    in tokens over the tenant's weight, decayed to the moment it was taken; the tenants queued
    there, each with how long its head request had until its `urgency` then (seconds, so that
    gateways' clocks need not agree) and how many it queued; and per model the rates its waiting
    room dispatched, saw leave, and completed (per second, None with too few to tell); per tenant
    its circuit breaker here (seconds it refuses the tenant or None, failures in its window); and
    per model the agents holding a slot here (session, home replica, KV blocks); and the blocks it
    was first to send to a replica lately (`bouncer.core.sharing.prefixes`); and the tenants whose
    head had its turn here and waits for room (`Dispatcher._holds_room`)."""

    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    served: dict[ShareKey, float] = field(default_factory=dict)
    queued: dict[ShareKey, tuple[float, int]] = field(default_factory=dict)
    rates: dict[str, tuple[float | None, float | None, float | None]] = field(default_factory=dict)
    bands: dict[str, list[list]] = field(default_factory=dict)  # model -> its recent bands (`BandSLOs.own`)
    breakers: dict[str, tuple[float | None, int]] = field(default_factory=dict)
    agents: dict[str, list[tuple[str, str | None, int]]] = field(default_factory=dict)
    prefixes: list[tuple[int, str, list[int]]] = field(default_factory=list)
    room: list[ShareKey] = field(default_factory=list)  # tenants whose head waits for room here (its turn)

    def to_wire(self) -> dict:
        return {"replicas": {name: load.to_wire() for name, load in self.replicas.items()},
                "served": [[m, b, t, v] for (m, b, t), v in self.served.items()],
                "queued": [[m, b, t, left, n] for (m, b, t), (left, n) in self.queued.items()],
                "rates": {m: list(r) for m, r in self.rates.items()}, "bands": self.bands,
                "breakers": [[t, wait, n] for t, (wait, n) in self.breakers.items()],
                "agents": {m: [list(a) for a in agents] for m, agents in self.agents.items()},
                "prefixes": [[seq, replica, digests] for seq, replica, digests in self.prefixes],
                "room": [list(key) for key in self.room]}

    @classmethod
    def from_wire(cls, raw: dict) -> GatewayShare:
        def rate(v):
            return None if v is None else float(v)

        return cls({name: ReplicaLoad.from_wire(v) for name, v in raw["replicas"].items()},
                   {(str(m), int(b), str(t)): float(v) for m, b, t, v in raw["served"]},
                   {(str(m), int(b), str(t)): (float(left), int(n)) for m, b, t, left, n in raw["queued"]},
                   {str(m): (rate(d), rate(dep), rate(c)) for m, (d, dep, c) in raw["rates"].items()},
                   {str(m): [list(b) for b in bands] for m, bands in raw["bands"].items()},
                   # absent from a gateway of a version before they were shared: none
                   {str(t): (rate(wait), int(n)) for t, wait, n in raw.get("breakers", ())},
                   {str(m): [(str(s), None if home is None else str(home), int(blocks)) for s, home, blocks in agents]
                    for m, agents in raw.get("agents", {}).items()},
                   [(int(seq), str(replica), [int(d) for d in digests])
                    for seq, replica, digests in raw.get("prefixes", ())],
                   [(str(m), int(b), str(t)) for m, b, t in raw.get("room", ())])


class FleetShares:
    """Fleet-wide order across gateways. A band waits while a higher one has requests queued at
    another gateway (`outranked`), as in one gateway. A tenant's head request is held back (`holds`):
    - while the same tenant, in the same band, has a head queued at another gateway that must go
      sooner (`urgency`, by more than HEAD_ORDER_SLACK_S): otherwise the gateway whose own request
      just finished sees the room first and fills it again, and a gateway with less in flight is
      served ever less (measured: one of three gateways got a sixth of the others' dispatches);
    - or while its fleet-wide served tokens over weight lead those of a tenant of its band queued
      at another gateway by more than `slack_tokens`: weighted shares across gateways;
    - or, by any amount, those of a tenant of its band whose head had its turn at another gateway
      and waits there for room: as in one gateway (`FairnessPolicy.pick`'s hold), its smaller
      requests would otherwise take that room as it frees. Measured on the `gateways` scenario
      with the live benchmark's engines, each tenant on its own gateway: see
      docs/benchmarks/several-gateways.md, "Several gateways".
    The request that must go soonest, of the tenant furthest behind, is never held, so some gateway
    may always go. An agent's step is not held for a sooner head of its tenant elsewhere: in one
    gateway too, agents of one tenant do not wait behind each other (the agent window, shared,
    orders them); held so, a gateway's active agents waited behind another's new agent that was
    itself waiting for room (docs/benchmarks/several-gateways.md). Inside one gateway the
    fairness policy (WDRR) orders tenants as before."""

    def __init__(self, window_s: float, slack_tokens: float) -> None:
        self.window_s = window_s
        self.slack = slack_tokens
        self.enabled = False  # set by a shell that shares state: no cost per dispatch otherwise
        self._own: dict[ShareKey, tuple[float, float]] = {}  # served here: (value, at)
        self._peers: dict[ShareKey, tuple[float, float]] = {}  # the others' sum, as last seen
        self._heads: dict[ShareKey, float] = {}  # the others' most urgent head per tenant, on this clock
        self._waiting_elsewhere: dict[tuple[str, int], list[str]] = {}  # (model, band) -> tenants queued at others
        self._top_band_elsewhere: dict[str, int] = {}  # model -> the highest band queued at another gateway
        self._counts: dict[tuple[str, int], list[tuple[str, int]]] = {}  # (model, band) -> (tenant, queued) elsewhere
        self._rates: dict[str, tuple[float, float, float]] = {}  # model -> the others' summed rates
        self._room: dict[tuple[str, int], list[str]] = {}  # (model, band) -> tenants waiting for room at others

    def _decayed(self, entry: tuple[float, float] | None, now: float) -> float:
        if entry is None:
            return 0.0
        value, at = entry
        return value * math.exp(-(now - at) / self.window_s) if now > at else value

    def served(self, key: ShareKey, tokens_over_weight: float, now: float) -> None:
        self._own[key] = (self._decayed(self._own.get(key), now) + tokens_over_weight, now)

    def fleet_served(self, key: ShareKey, now: float) -> float:
        return self._decayed(self._own.get(key), now) + self._decayed(self._peers.get(key), now)

    def outranked(self, model: str, band: int) -> bool:
        """A higher band has requests queued at another gateway: this band waits, as a lower band
        waits behind a higher one's queue in one gateway (strict priority, across gateways)."""
        top = self._top_band_elsewhere.get(model)
        return top is not None and top > band

    def holds(self, key: ShareKey, head_urgency: float | None, now: float) -> bool:
        """`head_urgency` None: the head is not ordered against the tenant's heads elsewhere
        (an agent's step, which the agent window orders)."""
        model, band, tenant = key
        others = self._waiting_elsewhere.get((model, band))
        if not others:
            return False
        sooner = self._heads.get(key)
        if sooner is not None and head_urgency is not None and sooner < head_urgency - HEAD_ORDER_SLACK_S:
            return True
        mine = self.fleet_served(key, now)
        behind = min((self.fleet_served((model, band, t), now) for t in others if t != tenant), default=None)
        if behind is not None and mine - behind > self.slack:
            return True
        waiting = self._room.get((model, band))
        return waiting is not None and any(t != tenant and self.fleet_served((model, band, t), now) < mine
                                           for t in waiting)

    def own(self, now: float) -> dict[ShareKey, float]:
        """What this gateway served, decayed to `now` (entries decayed to nothing are dropped)."""
        out = {}
        for key, entry in list(self._own.items()):
            value = self._decayed(entry, now)
            if value < 1.0:
                del self._own[key]
            else:
                out[key] = value
        return out

    def seen(self, others: Iterable[GatewayShare], now: float) -> None:
        """The other gateways' parts, as they were when taken (taken as of `now`: a sync period
        old at most, against a window of seconds and deadlines of a second or more)."""
        peers: dict[ShareKey, float] = {}
        heads: dict[ShareKey, float] = {}
        counts: dict[ShareKey, int] = {}
        rates: dict[str, list[float]] = {}
        for share in others:
            for key, value in share.served.items():
                peers[key] = peers.get(key, 0.0) + value
            for key, (left, n) in share.queued.items():
                at = now + left
                heads[key] = min(at, heads.get(key, at))
                counts[key] = counts.get(key, 0) + n
            for model, triple in share.rates.items():
                summed = rates.setdefault(model, [0.0, 0.0, 0.0])
                for i, r in enumerate(triple):
                    summed[i] += r or 0.0
        self._peers = {key: (value, now) for key, value in peers.items()}
        self._heads = heads
        waiting: dict[tuple[str, int], list[str]] = {}
        by_band: dict[tuple[str, int], list[tuple[str, int]]] = {}
        top: dict[str, int] = {}
        for (model, band, tenant), n in counts.items():
            waiting.setdefault((model, band), []).append(tenant)
            by_band.setdefault((model, band), []).append((tenant, n))
            top[model] = max(band, top.get(model, band))
        self._waiting_elsewhere, self._counts, self._top_band_elsewhere = waiting, by_band, top
        self._rates = {model: (d, dep, c) for model, (d, dep, c) in rates.items()}
        room: dict[tuple[str, int], list[str]] = {}
        for share in others:
            for model, band, tenant in share.room:
                room.setdefault((model, band), []).append(tenant)
        self._room = room

    # -- for the wait estimates (`bouncer.core.flow.backlog`) --------------------------------------------
    def queued_elsewhere(self, model: str, band: int) -> list[tuple[str, int]]:
        """(tenant, requests queued) at the other gateways, in one band."""
        return self._counts.get((model, band), [])

    def queued_above_elsewhere(self, model: str, band: int) -> int:
        return sum(n for (m, b), queued in self._counts.items() if m == model and b > band for _, n in queued)

    def rates_elsewhere(self, model: str) -> tuple[float, float, float]:
        """The others' dispatch, departure and completion rates, summed (0 where none said)."""
        return self._rates.get(model, (0.0, 0.0, 0.0))
