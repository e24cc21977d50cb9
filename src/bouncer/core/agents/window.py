"""Agent-level admission: how many agents may be active at once (after CONCUR).

An agent is a session (`x-session-id`) whose steps arrive one after another, each a longer prompt
that shares the previous step's prefix. Admitting requests one at a time lets too many agents be
active at once: their contexts no longer fit the KV pool, each step finds its prefix evicted and
recomputes it, and throughput collapses (thrashing). So a window W bounds the *active agents*:

- an agent becomes active with its first admitted step and stays active until it idles past
  `idle_timeout_s` (agents send no "done"; a pause for tool use is shorter than the timeout);
- W follows AIMD on engine signals, checked every `update_interval_s`: +alpha while pool KV
  usage is below U_low; x beta when usage is above U_high *and* the prefix-cache hit rate is
  below H (memory is full of prefixes nobody reuses: thrashing); held otherwise;
- W never falls below the number of agents whose contexts the pool holds at once (pool KV
  blocks over the mean KV blocks of the active agents' latest steps). Below that, misses are
  not thrashing: the window only idles replicas. CONCUR's thresholds assume an agent is a small
  fraction of the pool; with 90k-token contexts one agent is a quarter of a replica, KV usage
  is above U_high whenever three run, and every interval without reuse halved W far below
  what fits;
- a new agent waits while the window is full; an active agent's next step is never held by the
  window, except when W has shrunk below the active count: then the agents that started last are
  paused at their next step boundary (never mid-generation) until there is room again;
- one agent may have at most `max_parallel` steps in flight, its subagents' included;
- a subagent (`x-parent-session-id` naming the agent that launched it) runs as a *branch* of its
  parent, in its parent's slot: it takes no slot of its own, and its parent is not idle while it
  runs (a parent waits minutes for its subagents' results). A family's first step in flight
  always may go, as an active agent's next step; every further branch only while the batch has
  slack: a free slot in the window and pool KV usage below U_high (TAPER's rule: extra branches
  are worth running only on capacity nobody else is waiting for). So a fan-out of twelve runs
  its subagents one after another when other agents wait for slots, and all at once when none
  do. Measured in the `agents` scenario on sessions with subagents (docs/benchmarks/agents.md). Live,
  with contexts that keep KV usage above U_high, branches held for slack expire in the queue;
  letting a branch with a TTFT SLO go after half its time in the queue, or holding branches only
  while the pool thrashes, was tried and left out: subagents' steps gained what the agents' own
  lost (docs/benchmarks/agents.md, "Agents under WEKA's kv-cache-tester");
- an agent whose next step waits in the gateway's queue is not idle: it is waiting on us, and
  expiring it there would give its slot away and send its step anywhere, prefix lost;
- an agent lives on one replica, its *home*: the one that ran its latest step and holds its
  context. A new agent is placed only where the contexts of the agents already living there
  leave room for its own (`room`), so the agents of a replica keep their prefixes between
  steps (a window on the pool's total alone let one replica take more agents than it holds
  while another ran half-empty);
- keeping those contexts is worth a wait, not the request. A step with a TTFT SLO goes to
  another replica with room when its place cannot start it in time (refused as late, it would be
  lost), and waits for its place (its home, or room beside the agents living on a replica) half
  its time in the queue at most, then goes wherever there is room (`agent_gate.waited_half`):
  its SLO leaves no time for the agents living there to idle out (`idle_timeout_s`); held to
  their places, new agents expired in the queue and active agents' steps were refused as late
  at a busy home. A step without a TTFT SLO waits for its place until its queue TTL: bounding
  that wait too placed new agents beside busy ones, evicting their contexts;
- an agent that idled out is remembered for `memory_s`: when it comes back its session is
  half done, so its step goes before those of agents not yet started. Left behind new agents,
  such steps outwaited their clients' timeouts and their sessions failed in the middle, the
  work already done for them wasted;
- agents waiting for a slot take it in their order (the core passes over none of them);
- a new agent held back waits, while its queue TTL allows, and is never refused on a guess of
  its wait: refusing a new agent costs its whole session, and a guess of its wait turned away
  agents whose replica would soon have run idle (docs/benchmarks/agents.md);
- a new agent that no replica has room for (`room`) goes to a replica that runs nothing,
  whatever the contexts living there: they are worth keeping while the replica is busy with
  others, but an idle replica is pure loss (`WindowGate.where`; held for room alone, replicas
  ran idle while a request cap that thrashed completed more sessions);
- with several gateways sharing state, each tells the others the agents holding a slot there,
  with their homes and contexts (`own_agents`), and counts theirs (`seen_elsewhere`): the window
  bounds the fleet's agents, not each gateway's (N gateways alone let N windows of agents in,
  and the pool thrashes again); an agent active at another gateway keeps its slot and its home
  when a step of it comes here; and the agents living on a replica leave room for a new one
  counted over every gateway.

What each of these rules bought, and the alternatives tried, measured: docs/benchmarks/agents.md.
Pure: every method takes `now`. One instance per model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container
from dataclasses import dataclass

from bouncer.config import AgentWindowConfig


@dataclass(slots=True)
class _Agent:
    started_at: float  # when it became active: the last started are paused first
    last_seen: float  # last step admitted or finished
    inflight: int = 0
    blocks: int = 0  # KV blocks of its latest step: its context
    home: str | None = None  # the replica that ran its latest step, where its context is
    parent: str | None = None  # a subagent: the agent in whose slot it runs
    branches: int = 0  # its subagents' steps in flight (of an agent that holds a slot)


class AgentWindow:
    def __init__(self, cfg: AgentWindowConfig) -> None:
        self.cfg = cfg
        self.window = float(cfg.initial)
        self.active: dict[str, _Agent] = {}
        self._next_update: float | None = None
        self._last_counts: tuple[float, float] | None = None  # cumulative (queries, hits) at the last update
        self.ended: dict[str, float] = {}  # agents that idled out -> when, oldest first; kept memory_s, max_remembered
        self.living: Counter[str] = Counter()  # replica -> KV blocks of the active agents' contexts there
        self._subagents = 0  # of `active`, the subagents: they hold no slot
        self.kv_usage = 0.0  # the pool's, as last observed: the slack extra branches need
        # the agents holding a slot at other gateways: session -> (home, blocks), as last seen
        self._elsewhere: dict[str, tuple[str | None, int]] = {}
        self._living_elsewhere: Counter[str] = Counter()  # replica -> KV blocks of those not active here
        self._both = 0  # sessions holding a slot here and at another gateway (counted once)

    # -- queries from the dispatch loop ---------------------------------------------------------
    def is_active(self, session: str) -> bool:
        return session in self.active or session in self._elsewhere

    def holders(self) -> int:
        """Agents holding a slot of the window, at every gateway."""
        return len(self.active) - self._subagents + self.holders_elsewhere()

    def free_slots(self) -> int:
        """Slots of the window no agent holds."""
        return max(0, max(self.cfg.min, int(self.window)) - self.holders())

    def holders_elsewhere(self) -> int:
        """Of `holders`, those that hold their slot only at other gateways."""
        return len(self._elsewhere) - self._both

    def subagents(self) -> int:
        """Subagents active here (they run in their parents' slots)."""
        return self._subagents

    def is_returning(self, session: str) -> bool:
        """An agent that idled out within `memory_s`: its session is under way."""
        return session in self.ended

    def home(self, session: str) -> str | None:
        """The replica holding the context of an active agent."""
        agent = self.active.get(session)
        if agent is not None:
            return agent.home
        elsewhere = self._elsewhere.get(session)
        return elsewhere[0] if elsewhere is not None else None

    def room(self, replica: str, capacity_blocks: int | None) -> float:
        """KV blocks of `replica` (of `capacity_blocks`, None where unknown: no limit) that the
        contexts of the agents living there, at every gateway, leave for another."""
        if not capacity_blocks:
            return float("inf")
        return capacity_blocks - self.living[replica] - self._living_elsewhere[replica]

    def may_dispatch(self, session: str, now: float, waiting: Container[str] = (), parent: str | None = None) -> bool:
        """Whether a step of `session` (a subagent of `parent`, if given) may be dispatched now;
        `waiting`: the sessions with a step queued at the gateway."""
        self.expire(now, waiting)
        limit = max(self.cfg.min, int(self.window))
        family = session if parent is None else parent
        agent = self.active.get(family)
        if agent is None and family in self._elsewhere:  # its slot is held at another gateway
            return True
        if agent is None:  # a new agent (or a subagent whose parent holds no slot: it takes one for it)
            return self.holders() < limit
        busy = agent.inflight + agent.branches
        if busy >= self.cfg.max_parallel:
            return False
        if parent is not None and busy:  # a further branch: only on capacity nobody waits for
            return self.holders() < limit and self.kv_usage < self.cfg.u_high
        if busy == 0 and self.holders() > limit:
            # between steps and over the window: the most recently started agents pause first
            rank = sum(1 for a in self.active.values() if a.parent is None and a.started_at < agent.started_at)
            return rank < limit
        return True

    # -- lifecycle ------------------------------------------------------------------------------
    def dispatched(self, session: str, now: float, blocks: int = 0, replica: str | None = None,
                   parent: str | None = None) -> None:
        if parent is not None:
            self._take_slot(parent, now).branches += 1
            agent = self.active.get(session)
            if agent is None:
                agent = self.active[session] = _Agent(now, now, parent=parent)
                self._subagents += 1
        else:
            agent = self._take_slot(session, now)
        agent.inflight += 1
        agent.last_seen = now
        self._unhome(agent)
        if replica != agent.home:  # moved: its context is built anew there
            agent.home, agent.blocks = replica, 0
        agent.blocks = max(agent.blocks, blocks)
        if agent.home is not None:
            self.living[agent.home] += agent.blocks

    def _take_slot(self, session: str, now: float) -> _Agent:
        agent = self.active.get(session)
        if agent is None:
            self.ended.pop(session, None)
            agent = self.active[session] = _Agent(now, now)
            if session in self._elsewhere:
                self._both += 1
        agent.last_seen = now
        return agent

    def _unhome(self, agent: _Agent) -> None:
        if agent.home is not None:
            self.living[agent.home] -= agent.blocks
            if not self.living[agent.home]:
                del self.living[agent.home]

    def finished(self, session: str, now: float, parent: str | None = None) -> None:
        agent = self.active.get(session)
        if agent is not None:
            agent.inflight = max(0, agent.inflight - 1)
            agent.last_seen = now
        family = self.active.get(parent) if parent is not None else None
        if family is not None:
            family.branches = max(0, family.branches - 1)
            family.last_seen = now

    def expire(self, now: float, waiting: Container[str] = ()) -> None:
        """Agents idle past the timeout are no longer active (remembered for `memory_s`); an
        agent with a step in `waiting` (queued at the gateway) is not idle."""
        timeout = self.cfg.idle_timeout_s
        # the same expression as next_expiry, so a wake-up at that time always finds it expired
        idle = [s for s, a in self.active.items()
                if not a.inflight and not a.branches and a.last_seen + timeout <= now and s not in waiting]
        for s in idle:
            agent = self.active.pop(s)
            self._unhome(agent)
            if agent.parent is None:
                self.ended[s] = now
                if s in self._elsewhere:
                    self._both -= 1
            else:
                self._subagents -= 1
        ended = self.ended
        while ended:
            oldest = next(iter(ended))  # insertion order is expiry order
            if ended[oldest] + self.cfg.memory_s > now and len(ended) <= self.cfg.max_remembered:
                break
            del ended[oldest]

    # -- several gateways ---------------------------------------------------------------------------
    def own_agents(self) -> list[tuple[str, str | None, int]]:
        """The agents holding a slot here, for the others: (session, home, KV blocks)."""
        return [(s, a.home, a.blocks) for s, a in self.active.items() if a.parent is None]

    def seen_elsewhere(self, agents: list[tuple[str, str | None, int]]) -> None:
        """The agents holding a slot at the other gateways, as last seen (replacing the view
        before: an agent idled out there, or a gateway gone, no longer counts)."""
        self._elsewhere = {session: (home, blocks) for session, home, blocks in agents}
        living: Counter[str] = Counter()
        both = 0
        for session, (home, blocks) in self._elsewhere.items():
            agent = self.active.get(session)
            if agent is not None and agent.parent is None:
                both += 1  # counted here: its context lives where this gateway last sent it
            elif home is not None:
                living[home] += blocks
        self._living_elsewhere, self._both = living, both

    def next_expiry(self, waiting: Container[str] = ()) -> float | None:
        """When the next idle agent times out (a dispatch opportunity)."""
        if not self.active:  # (no agents: asked after every event the simulator handles)
            return None
        times = [a.last_seen + self.cfg.idle_timeout_s for s, a in self.active.items()
                 if not a.inflight and not a.branches and s not in waiting]
        return min(times) if times else None

    # -- the window -----------------------------------------------------------------------------
    def observe(self, kv_usage: float, prefix_queries: float | None, prefix_hits: float | None,
                now: float, pool_blocks: int | None = None) -> None:
        """Pool KV usage, cumulative prefix-cache counters and KV blocks (summed over the model's
        replicas; None where not every replica reports them)."""
        self.kv_usage = kv_usage
        if self._next_update is not None and now < self._next_update:
            return
        self._next_update = now + self.cfg.update_interval_s
        hit_rate = None
        if prefix_queries is not None and prefix_hits is not None:
            if self._last_counts is not None:
                dq = prefix_queries - self._last_counts[0]
                dh = prefix_hits - self._last_counts[1]
                hit_rate = dh / dq if dq > 0 else None
            self._last_counts = (prefix_queries, prefix_hits)
        self.step(kv_usage, hit_rate, self.agents_that_fit(pool_blocks))

    def agents_that_fit(self, pool_blocks: int | None) -> int:
        """How many agents of the active agents' mean context the pool holds at once."""
        contexts = [a.blocks for a in self.active.values() if a.blocks]
        if not pool_blocks or not contexts:
            return 0
        return int(pool_blocks * len(contexts) / sum(contexts))

    def step(self, kv_usage: float, hit_rate: float | None, fit: int = 0) -> None:
        """One AIMD step. Without a hit rate (no reuse measured) only the increase applies. `fit`:
        the agents the pool holds at once, below which W does not go."""
        c = self.cfg
        floor = float(min(c.max, max(c.min, fit)))
        if kv_usage < c.u_low:
            self.window = min(float(c.max), self.window + c.alpha)
        elif kv_usage > c.u_high and hit_rate is not None and hit_rate < c.h_thresh:
            self.window = self.window * c.beta
        self.window = max(floor, self.window)
