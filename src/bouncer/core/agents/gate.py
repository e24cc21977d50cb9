"""The agent layer as the rest of the core sees it: one gate per model, a no-op when agents are off.

With `policy.agents.enabled`, `WindowGate` puts `bouncer.core.agents.window.AgentWindow` (the window, the
homes, the rules, all explained there) in the request path: it names a request's session and its
place in its tenant's queue, may hold an agent's next step, keeps an agent on its home replica, and
lets a replica that runs nothing take a new agent that no replica has room for. `NoAgents` does
none of it: requests get no session, so every agent branch of the core is skipped by the same
test (`adm.session`).
"""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

import xxhash

from bouncer.config import Policy
from bouncer.core.agents.window import AgentWindow
from bouncer.core.fleet.blocks import num_blocks
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.requests import STEP_ACTIVE, STEP_OTHER, STEP_RETURNING, Admission, RequestInfo


class Where(NamedTuple):
    """Where an agent's step may go (`WindowGate.where`)."""

    candidates: list[ReplicaState]  # its places with room now
    backlogged: list[ReplicaState]  # full for now: a warm prefix may still take it there
    instead: list[ReplicaState]  # with room but not its place: only if none of `candidates` is in time


class NoAgents:
    enabled = False
    window: AgentWindow | None = None

    def classify(self, adm: Admission) -> None:
        pass

    def names_a_session(self, info: RequestInfo) -> bool:
        return False

    def expire(self, now: float, waiting: Container[str]) -> None:
        pass

    def next_wakeup(self, waiting: Container[str]) -> float | None:
        return None

    def observe(self, view: PoolView, now: float) -> None:
        pass


class WindowGate:
    enabled = True

    def __init__(self, policy: Policy) -> None:
        self.window = AgentWindow(policy.agents)
        self.configure(policy)

    def configure(self, policy: Policy) -> None:
        self.window.cfg = policy.agents  # keeps its window and its active agents
        self.session_from_user = policy.agents.session_from_user
        self.subagent_separator = policy.agents.subagent_separator

    def classify(self, adm: Admission) -> None:
        """Its session (`x-session-id`, or `user` where configured), its parent's if it is a
        subagent's step (`x-parent-session-id`; with no session of its own it is its parent's
        step; or, with `subagent_separator`, the root of a session id `ROOT:...`: the family
        is the agent that started it, a subagent's subagent's too), and its rank in its
        tenant's queue: an active agent's step first (a subagent's whose parent is active too),
        then a returning agent's, then the rest."""
        info = adm.info
        own = self._own_session(info)
        parent = info.parent_session_id
        if parent is None and own is not None and self.subagent_separator is not None:
            root, sep, _ = own.partition(self.subagent_separator)
            if sep and root:
                parent = root
        if parent is not None and own is None:
            own = parent
        adm.session = session_key(adm.tenant, own) if own is not None else None
        if parent is not None and parent != own:
            adm.parent_session = session_key(adm.tenant, parent)
        if adm.session is not None:
            w, family = self.window, adm.parent_session or adm.session
            adm.queue_rank = (STEP_ACTIVE if w.is_active(family) else
                              STEP_RETURNING if w.is_returning(family) else STEP_OTHER)

    def names_a_session(self, info: RequestInfo) -> bool:
        """Whether `classify` would give a request with these headers a session: an agent's
        step (its own session, or its parent's)."""
        return self._own_session(info) is not None or info.parent_session_id is not None

    def _own_session(self, info: RequestInfo) -> str | None:
        return info.session_id or (info.user if self.session_from_user else None)

    def is_newcomer(self, adm: Admission) -> bool:
        """Its step would take a slot: its agent (its parent, for a subagent's) holds none."""
        return adm.session is not None and not self.window.is_active(adm.parent_session or adm.session)

    def may_dispatch(self, adm: Admission, now: float, waiting: Container[str]) -> bool:
        return self.window.may_dispatch(adm.session, now, waiting, adm.parent_session)  # type: ignore[arg-type]

    def where(self, adm: Admission, candidates: list[ReplicaState], backlogged: list[ReplicaState],
              cached: dict[str, int], replicas: dict[str, ReplicaState], now: float) -> Where | None:
        """Where an agent's step may go: an active agent's goes where its context is, or waits
        for room there (None: hold it), since computed again elsewhere its context would also
        evict another agent's; a new agent's (or one whose context is gone) only where the agents
        living there leave room for it, or, where none has, onto one that runs nothing (an idle
        replica is never kept idle for contexts that may be reused). Keeping those contexts is
        worth a wait, not the request: a step with a TTFT SLO goes to the other `candidates`
        (`Where.instead`) when none of its places would start it in time, and waits for one half
        its time in the queue at most (`waited_half`), then goes wherever there is room."""
        w = self.window
        home = w.home(adm.session)  # type: ignore[arg-type]
        if home is not None and cached[home] > 0:
            r = replicas[home]
            if r in candidates or r in backlogged:
                return Where([r], [], [c for c in candidates if c is not r])
            return Where(candidates, backlogged, []) if candidates and waited_half(adm, now) else None
        fits = [r for r in candidates if r.name == home or w.room(r.name, r.capacity_blocks)
                >= num_blocks(adm.info.prompt_tokens + adm.expected_output, r.block_size)]
        if not fits:  # where nothing runs, contexts that may be reused are not worth an idle replica
            fits = [r for r in candidates if not r.requests_in_flight]
        if not fits and waited_half(adm, now):
            return Where(candidates, backlogged, [])
        return Where(fits, backlogged, [r for r in candidates if r not in fits])

    def dispatched(self, adm: Admission, now: float) -> None:
        self.window.dispatched(adm.session, now, adm.blocks, adm.replica, adm.parent_session)  # type: ignore[arg-type]

    def finished(self, adm: Admission, now: float) -> None:
        self.window.finished(adm.session, now, adm.parent_session)  # type: ignore[arg-type]

    def expire(self, now: float, waiting: Container[str]) -> None:
        self.window.expire(now, waiting)

    def next_wakeup(self, waiting: Container[str]) -> float | None:
        """When an idle agent frees its slot (a dispatch opportunity)."""
        return self.window.next_expiry(waiting)

    def observe(self, view: PoolView, now: float) -> None:
        """The window's signals: pool KV usage, and the prefix-cache counters summed over the
        model's replicas (None unless every usable replica reports them)."""
        usable = [r.telemetry for r in view.usable_replicas() if r.telemetry is not None]
        queries = hits = None
        if usable and all(t.prefix_queries is not None and t.prefix_hits is not None for t in usable):
            queries = sum(t.prefix_queries for t in usable)  # type: ignore[misc]
            hits = sum(t.prefix_hits for t in usable)  # type: ignore[misc]
        sizes = [t.num_blocks for t in usable]
        pool_blocks = sum(sizes) if sizes and all(sizes) else None  # type: ignore[arg-type]
        self.window.observe(view.pool_usage(), queries, hits, now, pool_blocks)


def session_key(tenant: str, session: str) -> str:
    """How the window knows an agent: its tenant's and its own id together, hashed. Another
    tenant naming the same id names another agent (it can neither ride this one's slot and home
    nor fill its steps in flight), and an id of any length is 16 characters here and in what the
    gateways share."""
    digest = xxhash.xxh3_64_intdigest(tenant.encode() + b"\0" + session.encode("utf-8", "surrogatepass"))
    return f"{digest:016x}"


def waited_half(adm: Admission, now: float) -> bool:
    """Whether a step held for its agent's place must now go wherever there is room: it has a
    TTFT SLO and has waited half of its time in the queue (which that SLO bounds, leaving room
    for its predicted TTFT and that prediction's error: `deadlines.queue_budget`). Without a TTFT
    SLO its queue TTL is only how long it may wait, and it waits for its place
    (`bouncer.core.agents.window` says why)."""
    return adm.ttft_deadline is not None and now - adm.arrival >= adm.deadline - now


AgentGate = NoAgents | WindowGate


def make_gate(policy: Policy, current: AgentGate | None) -> AgentGate:
    """The gate a (re)loaded policy asks for; a window keeps its state across reloads."""
    if not policy.agents.enabled:
        return NoAgents()
    if isinstance(current, WindowGate):
        current.configure(policy)
        return current
    return WindowGate(policy)
