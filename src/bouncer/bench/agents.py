"""`bouncer bench run --scenario agents`: agentic sessions in a closed loop (issue #6).

Real Claude Code sessions (WEKA's traces, data/traces/weka-claude-code) replayed as agents:
each step is a request whose prompt extends the previous step's (contexts of ~90k tokens), sent
its think time after the previous step finished. `sessions` agents run at all times; when one
ends (or fails) a fresh replay of another session starts. Swept from a few agents to far more
than the KV pool holds, this shows thrashing: admitted one request at a time, agents evict each
other's prefixes and recompute them.

Policies:
- `none`: no admission, round-robin routing, engines queue FCFS;
- `request-cap`: a request-level concurrency cap sized to the KV pool (KV tokens per replica over
  the mean step context), otherwise Bouncer's core with its agent window off;
- `bouncer`: Bouncer's shipped defaults, the agent window included.
"""

from __future__ import annotations

import dataclasses
import random
import time

from bouncer.sim.fleet import FleetConfig, FleetSim, SimRequest
from bouncer.sim.policies import BOUNCER_POLICY, CorePolicy, NoAdmission, core_config, tenant_config
from bouncer.sim.profiles import get_profile
from bouncer.sim.scenarios import WEKA_SESSIONS
from bouncer.sim.traces import AgentSession, SessionDigests, load_weka

AGENT_POLICIES = ("none", "request-cap", "bouncer")
MAX_MODEL_LEN = 131_072
MAX_PROMPT = 120_000  # longer steps (21% of them) are cut to their leading 120k tokens
MAX_OUTPUT = 4096
STEP_TIMEOUT_S = 900.0
TENANT = "agents"
WINDOW_S = 300.0  # hit rate over time is reported per window


@dataclasses.dataclass
class _Replay:
    session: AgentSession
    digests: SessionDigests
    step: int = 0
    prev_blocks: int = 0  # digests of the previous completed step: what this one could reuse


def _policy(name: str, replicas: int, blocks: int, block_size: int, cap: int, step_time: dict):
    names = [f"r{i}" for i in range(replicas)]
    if name == "none":
        return NoAdmission(names)
    tenants = [tenant_config(TENANT, 0, queue_ttl_s=STEP_TIMEOUT_S, max_tokens_cap=MAX_OUTPUT,
                             max_tokens_default=MAX_OUTPUT)]
    policy = dict(BOUNCER_POLICY)
    if name == "request-cap":
        policy.update(max_inflight_per_replica=cap, agents={"enabled": False})
    elif name != "bouncer":
        raise ValueError(f"unknown policy {name!r} for the agents scenario; known: {', '.join(AGENT_POLICIES)}")
    return CorePolicy(name, core_config(tenants, replicas, blocks, block_size, MAX_MODEL_LEN, policy,
                                        step_time=step_time))


def run(policy: str, sessions: int, duration_s: float = 3600.0, replicas: int = 2, seed: int = 0,
        trace: str | None = None, profile: str = "llama-3.1-8b-h100") -> dict:
    pool = load_weka(trace or WEKA_SESSIONS)
    prof = dataclasses.replace(get_profile(profile), max_model_len=MAX_MODEL_LEN)
    mean_context = sum(min(s.prompt_len, MAX_PROMPT) + min(s.output_len, MAX_OUTPUT)
                       for a in pool for s in a.steps) / sum(len(a.steps) for a in pool)
    cap = max(1, int(prof.kv_tokens / mean_context))
    cfg = FleetConfig(replicas=replicas, profile=prof, seed=seed)
    gw = _policy(policy, replicas, prof.num_blocks, prof.block_size, cap, prof.step_time_config)
    sim = FleetSim(cfg, gw, gw.replica_names)
    rng = random.Random(seed)
    replays: dict[str, _Replay] = {}
    counter = iter(range(10**9))
    done = {"sessions": 0, "failed_sessions": 0, "failed_midway": 0, "steps_wasted": 0, "steps": 0,
            "steps_of_completed": 0, "prefix_recomputed": 0}

    def request(name: str, r: _Replay, now: float) -> SimRequest:
        step = r.session.steps[r.step]
        prompt = min(step.prompt_len, MAX_PROMPT)
        out = min(step.output_len, MAX_OUTPUT)
        return SimRequest(rid=f"{name}/{r.step}", tenant=TENANT, priority=0, arrival=now, prompt_len=prompt,
                          output_len=out, max_tokens=MAX_OUTPUT, block_digests=r.digests.of(step, MAX_PROMPT),
                          ttft_slo=None, tpot_slo=None, timeout_s=STEP_TIMEOUT_S, max_retries=2, session=name)

    def start(now: float) -> SimRequest:
        session = pool[rng.randrange(len(pool))]
        name = f"{session.name}#{next(counter)}"
        r = replays[name] = _Replay(session, SessionDigests(name, session.block_tokens))
        return request(name, r, now)

    def follow(req: SimRequest, now: float):
        r = replays[req.session]
        if req.outcome != "completed":
            done["failed_sessions"] += 1
            if r.step:  # it failed in the middle: the steps done for it were wasted
                done["failed_midway"] += 1
                done["steps_wasted"] += r.step
            del replays[req.session]
            return None
        done["steps"] += 1
        cached = req.engine_req.num_cached_tokens if req.engine_req is not None else 0
        reusable = min(r.prev_blocks * cfg.profile.block_size, req.prompt_len - 1)
        done["prefix_recomputed"] += max(0, reusable - cached)  # its own context, evicted and computed again
        r.prev_blocks = len(req.block_digests)
        r.step += 1
        if r.step == len(r.session.steps):
            done["sessions"] += 1
            done["steps_of_completed"] += r.step
            del replays[req.session]
            return None
        return r.session.steps[r.step].think_s, request(req.session, r, now)

    wall0 = time.perf_counter()
    reached = sim.run_sessions(start, follow, sessions, duration_s)
    wall = time.perf_counter() - wall0
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
        "scenario": "agents", "policy": policy, "sessions": sessions, "replicas": replicas, "seed": seed,
        "duration_s": duration_s, "sim_seconds": reached, "wall_seconds": wall,
        "request_cap_per_replica": cap if policy == "request-cap" else None,
        "sessions_completed": done["sessions"], "sessions_failed": done["failed_sessions"],
        "sessions_failed_midway": done["failed_midway"], "steps_of_failed_sessions": done["steps_wasted"],
        # under way when the run ended: their steps count in steps/h, not yet in sessions/h
        "sessions_under_way": sum(1 for r in replays.values() if r.step),
        "sessions_completed_per_hour": done["sessions"] / hours,
        "steps_completed": done["steps"], "steps_completed_per_hour": done["steps"] / hours,
        # a finite run completes short sessions first: this against the trace's mean shows how much
        "steps_per_completed_session": done["steps_of_completed"] / done["sessions"] if done["sessions"] else None,
        "steps_per_session_in_trace": sum(len(a.steps) for a in pool) / len(pool),
        "engine_busy": sum(c.busy_time for c in counters) / (len(counters) * reached) if reached else 0.0,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "recomputed_tokens": done["prefix_recomputed"] + preempt_recomputed,
        "prefix_recomputed_tokens": done["prefix_recomputed"], "preemption_recomputed_tokens": preempt_recomputed,
        "preemptions": sum(c.num_preemptions for c in counters),
        "prefix_hit_rate_over_time": over_time,
        "agent_window": next(iter(gw.core.view.snapshot(reached)["models"].values()))["agents"]["window"]
        if policy == "bouncer" else None,
    }
