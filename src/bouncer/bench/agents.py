"""`bouncer bench run --scenario agents`: agentic sessions in a closed loop.

Real Claude Code sessions (WEKA's traces, data/traces/weka-claude-code) replayed as agents:
each step is a request whose prompt extends the previous step's (contexts of ~90k tokens), sent
its think time after the previous step finished. `sessions` agents run at all times; when one
ends (or fails) a fresh replay of another session starts. Swept from a few agents to far more
than the KV pool holds, this shows thrashing: admitted one request at a time, agents evict each
other's prefixes and recompute them. Sessions with subagents (`--trace
data/traces/weka-claude-code/subagents`) replay them as child agents (`SessionReplay`), whose
steps name their parent (`x-parent-session-id` in the gateway).

Policies:
- `none`: no admission, round-robin routing, engines queue FCFS;
- `request-cap`: a request-level concurrency cap sized to the KV pool (KV tokens per replica over
  the mean step context), otherwise Bouncer's core with its agent window off;
- `bouncer`: Bouncer's shipped defaults, the agent window included.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import time

from bouncer.core.stores import Stores
from bouncer.sim.fleet import FleetConfig, FleetSim, SimRequest
from bouncer.sim.policies import BOUNCER_POLICY, CorePolicy, NoAdmission, core_config, merged, tenant_config
from bouncer.sim.profiles import get_profile
from bouncer.sim.scenarios import WEKA_SESSIONS
from bouncer.sim.several_gateways import Gateways, GatewaySetup
from bouncer.sim.traces import AgentSession, AgentStep, SessionDigests, load_weka

AGENT_POLICIES = ("none", "request-cap", "bouncer")
MAX_MODEL_LEN = 131_072
MAX_PROMPT = 120_000  # longer steps (21% of them) are cut to their leading 120k tokens
MAX_OUTPUT = 4096
STEP_TIMEOUT_S = 900.0
TENANT = "agents"
WINDOW_S = 300.0  # hit rate over time is reported per window


@dataclasses.dataclass(eq=False)
class _Agent:
    """One agent being replayed: a session, or one of its subagents (`parent`)."""
    name: str
    session: AgentSession
    digests: SessionDigests
    parent: _Agent | None = None
    waited: bool = False  # its parent's next step waits for it
    step: int = 0  # the next step to send
    prev_blocks: int = 0  # digests of the previous completed step: what this one could reuse
    running_subagents: int = 0  # waited-for subagents not yet done: a step that waits waits for them
    held: bool = False  # its next step is due when the last of them is done
    family: int = 1  # (of a session) its agents not yet done, itself included

    @property
    def root(self) -> _Agent:
        return self if self.parent is None else self.parent.root


Sends = list[tuple[float, SimRequest]]  # (delay from now, request)


class SessionReplay:
    """`sessions` replays of sessions drawn from `pool` at all times, closed-loop; a subagent
    starts its offset after the parent's step that launched it ended, runs its own steps, and the
    parent's step that waits for it goes the trace's pause after the last of them is done. A
    session is done when it and all its subagents are; a step that fails for good fails its
    session (the steps done for it are wasted) and another session starts."""

    def __init__(self, pool: list[AgentSession], block_size: int, seed: int, name_parents: bool = True) -> None:
        self.pool = pool
        self.name_parents = name_parents  # False: subagents' steps say nothing of their parent (as plain agents)
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.agents: dict[str, _Agent] = {}
        self.counter = iter(range(10**9))
        self.done = {"sessions": 0, "failed_sessions": 0, "failed_midway": 0, "steps_wasted": 0, "steps": 0,
                     "steps_of_completed": 0, "prefix_recomputed": 0}

    def first(self, sessions: int) -> list[SimRequest]:
        out = []
        for i in range(sessions):
            out += [req for _, req in self.start(0.0, i * 1e-3)]
        return out

    def start(self, now: float, delay: float = 0.0) -> Sends:
        session = self.pool[self.rng.randrange(len(self.pool))]
        name = f"{session.name}#{next(self.counter)}"
        return self._begin(_Agent(name, session, SessionDigests(name, session.block_tokens)), now, delay)

    def under_way(self) -> int:
        """Sessions that completed steps and were not done when the run ended."""
        return sum(1 for a in self.agents.values() if a.parent is None and a.step)

    def follow(self, req: SimRequest, now: float) -> Sends:
        """What a step's outcome leads to (FleetSim.run_sessions)."""
        agent = self.agents.get(req.session)  # type: ignore[arg-type]
        if agent is None:  # a step of a session that already failed
            return []
        if req.outcome != "completed":
            self._fail(agent.root)
            return self.start(now)
        done = self.done
        done["steps"] += 1
        cached = req.engine_req.num_cached_tokens if req.engine_req is not None else 0
        reusable = min(agent.prev_blocks * self.block_size, req.prompt_len - 1)
        done["prefix_recomputed"] += max(0, reusable - cached)  # its own context, evicted and computed again
        agent.prev_blocks = len(req.block_digests)
        out = self._launch(agent, agent.step, now, 0.0)
        agent.step += 1
        return out + self._next(agent, now, 0.0)

    def _begin(self, agent: _Agent, now: float, delay: float) -> Sends:
        """`agent` starts `delay` from now: the subagents it launches first, then its first step."""
        self.agents[agent.name] = agent
        return self._launch(agent, -1, now, delay) + self._next(agent, now, delay)

    def _launch(self, agent: _Agent, after_step: int, now: float, delay: float) -> Sends:
        """The subagents `agent` launches when its step `after_step` ends (`delay` from now)."""
        out = []
        for i, sub in enumerate(agent.session.subagents):
            if sub.after_step == after_step:
                child = _Agent(f"{agent.name}/{i}", sub.session,
                               SessionDigests(agent.root.name, sub.session.block_tokens),  # the session's id space
                               parent=agent, waited=sub.waited)
                agent.root.family += 1
                agent.running_subagents += sub.waited
                out += self._begin(child, now, delay + sub.offset_s)
        return out

    def _next(self, agent: _Agent, now: float, delay: float) -> Sends:
        """`agent`'s next step (none left: it is done once its subagents are), or it waits for them."""
        if agent.step == len(agent.session.steps):
            return [] if agent.running_subagents else self._finish(agent, now)
        step = agent.session.steps[agent.step]
        if step.after_subagents_s is not None and agent.running_subagents:
            agent.held = True
            return []
        wait = delay + step.think_s
        return [(wait, self._request(agent, now + wait))]

    def _finish(self, agent: _Agent, now: float) -> Sends:
        """`agent` completed its last step and its waited-for subagents are done."""
        del self.agents[agent.name]
        root = agent.root
        root.family -= 1
        out = []
        parent = agent.parent
        if parent is not None and agent.waited:
            parent.running_subagents -= 1
            if not parent.running_subagents:
                if parent.held:
                    parent.held = False
                    wait = parent.session.steps[parent.step].after_subagents_s or 0.0
                    out.append((wait, self._request(parent, now + wait)))
                elif parent.step == len(parent.session.steps):
                    out += self._finish(parent, now)
        if root.family == 0:
            self.done["sessions"] += 1
            self.done["steps_of_completed"] += root.session.all_steps()
            out += self.start(now)
        return out

    def _fail(self, root: _Agent) -> None:
        """A step of `root`'s session failed for good; its agents' steps still in flight are
        ignored when they end."""
        family = [a for a in self.agents.values() if a.root is root]
        done = self.done
        done["failed_sessions"] += 1
        steps = sum(a.step for a in family)
        if steps:  # it failed in the middle: the steps done for it were wasted
            done["failed_midway"] += 1
            done["steps_wasted"] += steps
        for a in family:
            del self.agents[a.name]

    def _request(self, agent: _Agent, at: float) -> SimRequest:
        step = agent.session.steps[agent.step]
        prompt = min(step.prompt_len, MAX_PROMPT)
        return SimRequest(rid=f"{agent.name}/{agent.step}", tenant=TENANT, priority=0, arrival=at, prompt_len=prompt,
                          output_len=min(step.output_len, MAX_OUTPUT), max_tokens=MAX_OUTPUT,
                          block_digests=agent.digests.of(step, MAX_PROMPT), ttft_slo=None, tpot_slo=None,
                          timeout_s=STEP_TIMEOUT_S, max_retries=2, session=agent.name,
                          parent_session=agent.parent.name if agent.parent is not None and self.name_parents
                          else None)


def _count_subagents(session: AgentSession) -> int:
    return sum(1 + _count_subagents(s.session) for s in session.subagents)


def _steps(session: AgentSession) -> list[AgentStep]:
    """Its steps and its subagents'."""
    return [*session.steps, *(s for sub in session.subagents for s in _steps(sub.session))]


def _policy(name: str, replicas: int, blocks: int, block_size: int, cap: int, step_time: dict,
            stores: Stores | None = None, policy_set: dict | None = None):
    names = [f"r{i}" for i in range(replicas)]
    if name == "none":
        if policy_set:
            raise ValueError("policy settings apply to bouncer and request-cap, not none")
        return NoAdmission(names)
    tenants = [tenant_config(TENANT, 0, queue_ttl_s=STEP_TIMEOUT_S, max_tokens_cap=MAX_OUTPUT,
                             max_tokens_default=MAX_OUTPUT)]
    policy = dict(BOUNCER_POLICY)
    if name == "request-cap":
        policy.update(max_inflight_per_replica=cap, agents={"enabled": False})
    elif name != "bouncer":
        raise ValueError(f"unknown policy {name!r} for the agents scenario; known: {', '.join(AGENT_POLICIES)}")
    if policy_set:
        policy = merged(policy, policy_set)
    return CorePolicy(name, core_config(tenants, replicas, blocks, block_size, MAX_MODEL_LEN, policy,
                                        step_time=step_time), stores=stores)


def run(policy: str, sessions: int, duration_s: float = 3600.0, replicas: int = 2, seed: int = 0,
        trace: str | None = None, profile: str = "llama-3.1-8b-h100", name_parents: bool = True,
        gateways: GatewaySetup | None = None, policy_set: dict | None = None) -> dict:
    """One closed-loop run. `name_parents=False` sends subagents' steps without
    `x-parent-session-id`, so the window sees each subagent as an agent of its own. `gateways`:
    several gateways (bouncer and request-cap), each agent's steps through one of them (its
    session's, as a load balancer hashing the session header keeps them). `policy_set` changes
    policy settings (nested, as in the config's `policy`)."""
    pool = load_weka(trace or WEKA_SESSIONS)
    prof = dataclasses.replace(get_profile(profile), max_model_len=MAX_MODEL_LEN)
    steps = [s for a in pool for s in _steps(a)]
    mean_context = sum(min(s.prompt_len, MAX_PROMPT) + min(s.output_len, MAX_OUTPUT) for s in steps) / len(steps)
    cap = max(1, int(prof.kv_tokens / mean_context))
    cfg = FleetConfig(replicas=replicas, profile=prof, seed=seed)
    if gateways is not None and gateways.count > 1:
        if policy == "none":
            raise ValueError("--gateways runs several admission cores: none has none")
        gw = Gateways(gateways, lambda stores: _policy(policy, replicas, prof.num_blocks, prof.block_size, cap,
                                                       prof.step_time_config, stores, policy_set))
    else:
        gw = _policy(policy, replicas, prof.num_blocks, prof.block_size, cap, prof.step_time_config,
                     policy_set=policy_set)
    sim = FleetSim(cfg, gw, gw.replica_names)
    replay = SessionReplay(pool, prof.block_size, seed, name_parents)
    wall0 = time.perf_counter()
    reached = sim.run_sessions(replay.first(sessions), replay.follow, duration_s)
    wall = time.perf_counter() - wall0
    done = replay.done
    counters = [e.counters for e in sim.engines.values()]
    queries = sum(c.prefix_cache_queries for c in counters)
    hits = sum(c.prefix_cache_hits + c.external_prefix_cache_hits for c in counters)
    preempt_recomputed = sum(c.recomputed_tokens for c in counters)
    over_time = []
    last = {"t": 0.0, "prefix_queries": 0, "prefix_hits": 0}
    for x in sim.samples:
        if x["t"] - last["t"] >= WINDOW_S or x is sim.samples[-1]:
            dq = x["prefix_queries"] - last["prefix_queries"]
            over_time.append({"t": x["t"], "prefix_hit_rate": (x["prefix_hits"] - last["prefix_hits"]) / dq
                              if dq else None, "kv_usage_mean": x["kv_usage_mean"]})
            last = x
    hours = duration_s / 3600.0
    return {
        "scenario": "agents", "trace": pathlib.Path(trace or WEKA_SESSIONS).name,
        "policy": policy, "sessions": sessions, "replicas": replicas, "seed": seed,
        "gateways": (gateways or GatewaySetup()).describe(), "policy_set": policy_set or {},
        "duration_s": duration_s, "sim_seconds": reached, "wall_seconds": wall,
        "request_cap_per_replica": cap if policy == "request-cap" else None,
        "sessions_completed": done["sessions"], "sessions_failed": done["failed_sessions"],
        "sessions_failed_midway": done["failed_midway"], "steps_of_failed_sessions": done["steps_wasted"],
        # under way when the run ended: their steps count in steps/h, not yet in sessions/h
        "sessions_under_way": replay.under_way(),
        "sessions_completed_per_hour": done["sessions"] / hours,
        "steps_completed": done["steps"], "steps_completed_per_hour": done["steps"] / hours,
        # a finite run completes short sessions first: this against the trace's mean shows how much
        "steps_per_completed_session": done["steps_of_completed"] / done["sessions"] if done["sessions"] else None,
        "steps_per_session_in_trace": sum(a.all_steps() for a in pool) / len(pool),
        "subagents_in_trace": sum(_count_subagents(a) for a in pool),
        "engine_busy": sum(c.busy_time for c in counters) / (len(counters) * reached) if reached else 0.0,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "recomputed_tokens": done["prefix_recomputed"] + preempt_recomputed,
        "prefix_recomputed_tokens": done["prefix_recomputed"], "preemption_recomputed_tokens": preempt_recomputed,
        "preemptions": sum(c.num_preemptions for c in counters),
        "prefix_hit_rate_over_time": over_time,
        "agent_window": next(iter(gw.core.view.snapshot(reached)["models"].values()))["agents"]["window"]
        if policy == "bouncer" else None,
    }
