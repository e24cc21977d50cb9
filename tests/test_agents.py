"""Agent-level admission: the AIMD window on active agents, pauses at step boundaries only,
the fan-out cap, and the core holding new agents (never refusing them) while the window is full."""

from __future__ import annotations

import pytest

from bouncer.config import AgentWindowConfig
from bouncer.core.agents.gate import session_key
from bouncer.core.agents.window import AgentWindow
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Terminal
from core_helpers import admission_of, dispatched, info, make_core, observe_idle, rejected, tenant


def window(**kw) -> AgentWindow:
    return AgentWindow(AgentWindowConfig(**{"initial": 4, "update_interval_s": 1.0, **kw}))


def test_window_follows_aimd_on_scripted_signals():
    w = window(initial=4, max=10)
    w.step(kv_usage=0.1, hit_rate=0.9)  # memory to spare: +alpha
    assert w.window == 6
    w.step(kv_usage=0.3, hit_rate=0.05)  # between U_low and U_high: hold
    assert w.window == 6
    w.step(kv_usage=0.7, hit_rate=0.5)  # full, but the prefixes are being reused: hold
    assert w.window == 6
    w.step(kv_usage=0.7, hit_rate=0.1)  # full of prefixes nobody reuses: thrashing, x beta
    assert w.window == 3
    w.step(kv_usage=0.7, hit_rate=None)  # no lookups measured: no evidence of thrashing
    assert w.window == 3
    for _ in range(10):
        w.step(kv_usage=0.9, hit_rate=0.0)
    assert w.window == 1  # floored at min
    for _ in range(10):
        w.step(kv_usage=0.0, hit_rate=None)
    assert w.window == 10  # capped at max


def test_observe_takes_hit_rate_from_counter_deltas_once_per_interval():
    w = window(initial=8)
    w.observe(0.9, prefix_queries=1000, prefix_hits=900, now=0.0)  # first sample: no rate yet
    assert w.window == 8
    w.observe(0.9, prefix_queries=2000, prefix_hits=950, now=0.5)  # within the interval: ignored
    assert w.window == 8
    w.observe(0.9, prefix_queries=2000, prefix_hits=950, now=1.0)  # 50 hits of 1,000 lookups: 5%
    assert w.window == 4
    w.observe(0.9, prefix_queries=3000, prefix_hits=1900, now=2.0)  # 95%: reused, hold
    assert w.window == 4


def test_thrashing_does_not_shrink_the_window_below_the_agents_the_pool_holds():
    w = window(initial=16)
    for i, blocks in enumerate((5_000, 6_000, 7_000)):  # three agents, 6,000 blocks on average
        w.dispatched(f"a{i}", 0.0, blocks)
    assert w.agents_that_fit(pool_blocks=50_000) == 8
    assert w.agents_that_fit(pool_blocks=None) == 0  # pool size unknown: no floor
    w.observe(0.9, prefix_queries=1000, prefix_hits=0, now=0.0, pool_blocks=50_000)
    w.observe(0.9, prefix_queries=2000, prefix_hits=0, now=1.0, pool_blocks=50_000)  # no reuse
    assert w.window == 8  # 16 x 0.5, at the floor
    w.observe(0.9, prefix_queries=3000, prefix_hits=0, now=2.0, pool_blocks=50_000)
    assert w.window == 8  # still thrashing, but 8 agents' contexts fit: it holds
    w.observe(0.9, prefix_queries=4000, prefix_hits=0, now=3.0, pool_blocks=20_000)  # pool shrank
    assert w.window == 4


def test_new_agents_wait_while_the_window_is_full_and_active_ones_keep_going():
    w = window(initial=2, idle_timeout_s=10)
    for s in ("a", "b"):
        assert w.may_dispatch(s, 0.0)
        w.dispatched(s, 0.0)
    assert not w.may_dispatch("c", 0.0)
    w.finished("a", 1.0)
    assert w.may_dispatch("a", 2.0)  # a's next step: a is still active
    assert not w.may_dispatch("c", 2.0)
    assert w.next_expiry() == pytest.approx(11.0)
    assert w.may_dispatch("c", 11.5)  # a idled past the timeout: its slot is free


def test_a_shrinking_window_pauses_agents_only_between_steps_latest_started_first():
    w = window(initial=3)
    for t, s in enumerate(("a", "b", "c")):
        w.dispatched(s, float(t))
    w.window = 1  # the pool started thrashing
    # every agent has a step in flight: nothing is interrupted, but no new step may join
    assert all(w.active[s].inflight == 1 for s in "abc")
    assert not w.may_dispatch("d", 3.0)
    for s in "abc":
        w.finished(s, 4.0)
    # between steps: only the earliest-started agent may go on; b and c pause
    assert w.may_dispatch("a", 4.0)
    assert not w.may_dispatch("b", 4.0) and not w.may_dispatch("c", 4.0)


def test_one_agent_fans_out_at_most_max_parallel_steps():
    w = window(max_parallel=2)
    w.dispatched("a", 0.0)
    assert w.may_dispatch("a", 0.0)
    w.dispatched("a", 0.0)
    assert not w.may_dispatch("a", 0.0)
    w.finished("a", 1.0)
    assert w.may_dispatch("a", 1.0)


def test_core_holds_a_new_agent_until_the_window_has_room():
    core = make_core(policy={"agents": {"initial": 1, "max": 1, "idle_timeout_s": 5}})
    first = dispatched(core.offer(info(session_id="agent-1"), 0.0))
    assert first
    held = core.offer(info(session_id="agent-2"), 0.1)
    assert not dispatched(held) and not rejected(held) and core.view.queued == 1  # waits, is not refused
    # agent-1's next step goes at once, ahead of the waiting agent
    assert dispatched(core.offer(info(session_id="agent-1"), 0.2))
    for adm in list(core.permits):
        core.finished(adm.request_id, 1.0, Terminal.COMPLETED)
    assert core.view.queued == 1  # agent-1 is between steps, still active
    assert core.next_wakeup() == pytest.approx(6.0)  # when agent-1 times out
    events = observe_idle(core, 6.5)  # a fresh scrape; the idle agent has timed out by now
    assert [admission_of(core, d).info.session_id for d in dispatched(events)] == ["agent-2"]
    snap = core.snapshot(6.5)["models"]["m"]["agents"]
    assert snap == {"window": 1.0, "active": 1, "active_elsewhere": 0, "subagents": 0}


def test_requests_without_a_session_are_not_held_by_the_window():
    core = make_core(policy={"agents": {"initial": 1, "max": 1}})
    assert dispatched(core.offer(info(session_id="agent-1"), 0.0))
    assert dispatched(core.offer(info(), 0.1))  # no session: plain admission
    assert dispatched(core.offer(info(user="end-user-7"), 0.2))  # `user` is not a session by default
    observe_idle(core, 0.3)


def test_an_idle_agent_is_gone_at_exactly_its_expiry_time():
    """The core wakes at next_expiry(); the agent must be expired then, or the wake-up repeats
    forever at the same instant (43.2767... + 30 - 43.2767... < 30 in floating point)."""
    w = window(idle_timeout_s=30.0)
    w.dispatched("a", 43.27670679050534)
    w.finished("a", 43.27670679050534)
    w.expire(w.next_expiry())
    assert not w.active and w.next_expiry() is None


def test_an_agent_with_a_step_queued_at_the_gateway_is_not_idle():
    w = window(idle_timeout_s=10)
    w.dispatched("a", 0.0)
    w.finished("a", 1.0)
    w.expire(20.0, waiting={"a"})  # its next step waits in our queue: it is waiting on us
    assert w.is_active("a") and w.next_expiry(waiting={"a"}) is None
    w.expire(20.0)
    assert not w.is_active("a") and w.is_returning("a")


def test_an_agent_that_idled_out_is_remembered_for_memory_s():
    w = window(idle_timeout_s=10, memory_s=100)
    for s in ("a", "b"):
        w.dispatched(s, 0.0)
        w.finished(s, 0.0)
    w.expire(10.0)
    assert w.is_returning("a") and w.is_returning("b")
    w.dispatched("a", 50.0)  # back: active again, no longer returning
    assert w.is_active("a") and not w.is_returning("a")
    w.expire(110.0)
    assert not w.is_returning("b")  # forgotten: it would count as a new agent


def test_room_counts_the_contexts_of_the_agents_living_on_a_replica():
    w = window(idle_timeout_s=10)
    w.dispatched("a", 0.0, blocks=600, replica="r0")
    w.dispatched("b", 0.0, blocks=300, replica="r1")
    assert w.room("r0", 1000) == 400 and w.room("r1", 1000) == 700
    assert w.room("r0", None) == float("inf")  # pool size unknown: no limit
    w.dispatched("a", 1.0, blocks=200, replica="r1")  # moved: its context is built anew on r1
    assert w.home("a") == "r1" and w.room("r0", 1000) == 1000 and w.room("r1", 1000) == 500
    w.dispatched("a", 2.0, blocks=250, replica="r1")  # its context grew
    assert w.room("r1", 1000) == 450
    for s in ("a", "a", "a", "b"):  # its three steps and b's one end
        w.finished(s, 3.0)
    w.expire(13.0)  # idled out: their contexts may be evicted
    assert w.room("r1", 1000) == 1000 and not w.living


def _step(core, session, prompt, now, digests):
    return core.offer(info(session_id=session, prompt=prompt, max_tokens=100, block_digests=digests), now)


def _keep_busy(core, now, replicas=2):
    """A short request without a session on each replica, left running: a replica that runs
    nothing takes a new agent whatever the contexts living there, so tests of room keep them busy."""
    busy = [d for _ in range(replicas) for d in dispatched(core.offer(info(prompt=100, max_tokens=100), now))]
    assert len({d.replica for d in busy}) == replicas
    for d in busy:
        core.started(d.request_id, now, measured=False)  # decoding: no prefill queued ahead of the next


def test_an_agents_steps_wait_for_its_home_replica_rather_than_recompute_elsewhere():
    core = make_core(policy={"max_inflight_per_replica": 1})
    ctx = list(range(100, 350))  # a 4,000-token context
    [first] = dispatched(_step(core, "agent-1", 4000, 0.0, ctx))
    home = first.replica
    # a fan-out step while the first runs: its home is full (one in flight), the other replica
    # is idle, but there it would compute the whole context again
    held = _step(core, "agent-1", 4100, 0.1, ctx + [999])
    assert not dispatched(held) and not rejected(held) and core.view.queued == 1
    events = core.finished(first.request_id, 1.0, Terminal.COMPLETED)
    assert [d.replica for d in dispatched(events)] == [home]


def test_a_new_agent_goes_only_where_the_living_agents_leave_room_for_its_context():
    core = make_core(kv_blocks=1000, max_model_len=16_384, policy={"agents": {"idle_timeout_s": 5}})
    homes = []
    for i, s in enumerate(("agent-1", "agent-2")):  # 12,000 tokens: 750 blocks of a replica's 1,000
        [d] = dispatched(_step(core, s, 12_000, 0.0, list(range(1000 * i, 1000 * i + 750))))
        homes.append(d.replica)
        core.finished(d.request_id, 0.5, Terminal.COMPLETED)
    assert len(set(homes)) == 2  # one agent's context per replica
    _keep_busy(core, 0.6)
    # each replica holds an agent's context between its steps
    held = _step(core, "agent-3", 12_000, 1.0, list(range(5000, 5750)))
    assert not dispatched(held) and not rejected(held)
    events = observe_idle(core, 6.0)  # agent-1 and agent-2 idled out: their contexts may go
    assert [admission_of(core, d).info.session_id for d in dispatched(events)] == ["agent-3"]


# 4,000 tokens a step at 0.085 s: a 12,000-token prompt is predicted to start in 0.255 s
STEPS = {"step_time": {"a": 0.005, "b": 2e-5, "c": 0.0, "max_batched_tokens": 4000}}


def test_a_new_agent_waits_for_room_only_while_its_deadline_allows_then_goes_where_it_fits_now():
    # live, under a 10 s TTFT SLO, new agents held for room past their deadline expired in the
    # queue: keeping the living agents' contexts is worth a wait, not the request
    core = make_core(kv_blocks=1000, max_model_len=16_384, model=STEPS,
                     tenants=[tenant("a", slo={"ttft_s": 2.0})], policy={"agents": {"idle_timeout_s": 60}})
    for i, s in enumerate(("agent-1", "agent-2")):  # one 750-block context on each replica
        [d] = dispatched(_step(core, s, 12_000, 0.0, list(range(1000 * i, 1000 * i + 750))))
        core.finished(d.request_id, 0.5, Terminal.COMPLETED)
    _keep_busy(core, 0.6)
    held = _step(core, "agent-3", 12_000, 1.0, list(range(5000, 5750)))
    assert not dispatched(held) and not rejected(held)
    # it may wait until 2.32 (its 2 s SLO less twice its predicted 0.34 s, beside a decoding
    # request): the first half of that for room, then it goes where it fits now
    assert not dispatched(core.tick(1.6)) and core.view.queued == 1
    [d] = dispatched(core.tick(1.7))
    assert admission_of(core, d).info.session_id == "agent-3" and d.predicted_ttft_s == pytest.approx(0.34)


def test_an_agents_step_that_its_home_cannot_start_in_time_goes_where_it_can():
    # its context cached at home is worth a wait, not the request: refused as late at home, it
    # would be lost where another replica starts it in time by computing the context again
    core = make_core(max_model_len=65_536, kv_blocks=10_000, model=STEPS,
                     tenants=[tenant("a", slo={"ttft_s": 0.5}), tenant("bulk")])
    ctx = list(range(100, 350))
    [first] = dispatched(_step(core, "agent-1", 4000, 0.0, ctx))
    core.started(first.request_id, 0.1)
    core.finished(first.request_id, 0.2, Terminal.COMPLETED)
    [bulk] = dispatched(core.offer(info("bulk", prompt=30_000, max_tokens=10,
                                        block_digests=list(range(5000, 6875))), 0.3))
    assert bulk.replica == first.replica  # its home now has 30,000 tokens of prefill queued
    [d] = dispatched(_step(core, "agent-1", 4100, 0.4, ctx + [999]))
    assert d.replica != first.replica and d.predicted_ttft_s == pytest.approx(0.17)  # 0.69 s at home


def test_a_new_agent_without_a_ttft_slo_waits_for_room_until_its_queue_ttl():
    core = make_core(kv_blocks=1000, max_model_len=16_384, model=STEPS, tenants=[tenant("a", queue_ttl_s=10)],
                     policy={"agents": {"idle_timeout_s": 60}})
    for i, s in enumerate(("agent-1", "agent-2")):
        [d] = dispatched(_step(core, s, 12_000, 0.0, list(range(1000 * i, 1000 * i + 750))))
        core.finished(d.request_id, 0.5, Terminal.COMPLETED)
    _keep_busy(core, 0.6)
    held = _step(core, "agent-3", 12_000, 1.0, list(range(5000, 5750)))
    assert not dispatched(held) and not rejected(held) and not dispatched(core.tick(10.9))
    [expired] = rejected(core.tick(11.0))
    assert expired.refusal.reason == "ttl_expired"


def test_a_new_agent_with_a_ttft_slo_is_not_refused_for_room_while_the_window_has_a_slot_for_it():
    # live, a burst of new agents got 529 "the window has 36 free slots; the replicas lack room
    # for new contexts": room holds a step with a TTFT SLO half its time at most, so it waits
    core = make_core(kv_blocks=1000, max_model_len=16_384, model=STEPS, tenants=[tenant("a", slo={"ttft_s": 2.0})],
                     policy={"agents": {"idle_timeout_s": 120}})
    for i, t in enumerate((0.0, 20.0, 40.0)):  # three agents start, one per 20 s: 400-block contexts
        observe_idle(core, t)
        [d] = dispatched(_step(core, f"agent-{i}", 6400, t, list(range(1000 * i, 1000 * i + 400))))
        core.finished(d.request_id, t + 0.5, Terminal.COMPLETED)
    _keep_busy(core, 40.6)
    # 750 blocks fit beside none of them
    held = _step(core, "agent-3", 12_000, 41.0, list(range(5000, 5750)))
    assert not dispatched(held) and not rejected(held) and not observe_idle(core, 41.5)
    # queued until 42.49 (its 2 s SLO less twice its predicted 0.255 s), half of it for room
    [d] = dispatched(observe_idle(core, 41.9))
    assert admission_of(core, d).info.session_id == "agent-3"


def test_an_active_agents_step_leaves_its_full_home_when_its_deadline_nears():
    core = make_core(model=STEPS, tenants=[tenant("a", slo={"ttft_s": 2.0})],
                     policy={"max_inflight_per_replica": 1})
    ctx = list(range(100, 350))
    [first] = dispatched(_step(core, "agent-1", 4000, 0.0, ctx))
    held = _step(core, "agent-1", 4100, 0.1, ctx + [999])  # its home runs the first step
    # queued until 1.76 at most (its 2 s SLO less twice its predicted 0.17 s: the whole context
    # computed again on the idle replica), half of that waiting at home
    assert not dispatched(held) and not core.tick(0.9)
    [moved] = dispatched(core.tick(0.95))
    assert moved.replica != first.replica


def test_a_returning_agents_step_goes_before_a_new_agents():
    core = make_core(policy={"agents": {"initial": 1, "max": 1, "idle_timeout_s": 5}})
    [a1] = dispatched(core.offer(info(session_id="agent-1"), 0.0))
    core.finished(a1.request_id, 0.5, Terminal.COMPLETED)
    observe_idle(core, 6.0)  # agent-1 idles out, half-way through its session
    [a2] = dispatched(core.offer(info(session_id="agent-2"), 6.0))
    assert not dispatched(core.offer(info(session_id="agent-3"), 7.0))  # new: waits for the window
    assert not dispatched(core.offer(info(session_id="agent-1"), 8.0))  # back: waits too, but ahead
    core.finished(a2.request_id, 8.5, Terminal.COMPLETED)
    events = observe_idle(core, 14.0)  # agent-2 idled out
    assert [admission_of(core, d).info.session_id for d in dispatched(events)] == ["agent-1"]


def test_a_new_agent_waiting_for_a_slot_is_never_refused_on_a_guess_of_its_wait():
    # refusing a new agent costs its whole session: refused at once on the rate agents had taken
    # a slot, new agents were turned away that a request cap served (issue 51)
    core = make_core(tenants=[tenant("a", queue_ttl_s=10)],
                     policy={"agents": {"initial": 1, "max": 1, "idle_timeout_s": 5}})
    for i, t in enumerate((0.0, 5.5, 11.0)):  # three agents take the one slot in turn, one per ~4 s
        if t:
            observe_idle(core, t)  # the previous one idled out
        [d] = dispatched(core.offer(info(session_id=f"agent-{i}"), t))
        core.finished(d.request_id, t + 0.5, Terminal.COMPLETED)
    for s in ("agent-3", "agent-4", "agent-5"):  # agent-2 holds the slot: they wait, however many
        events = core.offer(info(session_id=s), 12.0)
        assert not dispatched(events) and not rejected(events)
    # an agent coming back mid-session waits too, ahead of the new ones
    events = core.offer(info(session_id="agent-0"), 12.0)
    assert not dispatched(events) and not rejected(events) and core.view.queued == 4
    # agent-2 idles out: agent-0 takes the slot, and each new agent waits out its TTL
    assert [admission_of(core, d).info.session_id for d in dispatched(observe_idle(core, 16.6))] == ["agent-0"]
    assert not rejected(core.tick(21.9))
    expired = rejected(core.tick(22.0))
    assert sorted(e.refusal.reason for e in expired) == ["ttl_expired"] * 3


def test_a_replica_that_runs_nothing_takes_a_new_agent_no_replica_has_room_for():
    # contexts that may be reused are worth keeping while the replica is busy with others, not
    # an idle replica: held for room alone, replicas ran idle 16% of the time at 256 agents
    core = make_core(replicas=1, kv_blocks=1000, max_model_len=16_384, policy={"agents": {"idle_timeout_s": 60}})
    for i, t in enumerate((0.0, 1.0, 2.0)):  # three agents live there: 750 of 1,000 blocks
        [d] = dispatched(_step(core, f"agent-{i}", 4_000, t, list(range(1000 * i, 1000 * i + 250))))
        core.finished(d.request_id, t + 0.5, Terminal.COMPLETED)
    [d] = dispatched(_step(core, "agent-new", 12_000, 3.0, list(range(5000, 5750))))  # it runs nothing
    assert admission_of(core, d).info.session_id == "agent-new"
    # while it runs that step, another new agent waits for room
    assert not dispatched(_step(core, "agent-newer", 12_000, 3.5, list(range(6000, 6750))))


def test_agents_waiting_for_a_slot_take_it_in_order_a_long_context_is_not_passed_over():
    core = make_core(replicas=1, kv_blocks=1000, max_model_len=16_384, policy={"agents": {"idle_timeout_s": 5}})
    [a1] = dispatched(_step(core, "agent-1", 9_000, 0.0, list(range(560))))
    core.finished(a1.request_id, 0.5, Terminal.COMPLETED)  # agent-1 lives there, between steps
    _keep_busy(core, 0.6, replicas=1)
    assert not dispatched(_step(core, "agent-2", 12_000, 1.0, list(range(1000, 1750))))  # does not fit yet
    # a short context behind it would fit beside agent-1, but would keep agent-2 waiting for ever
    assert not dispatched(_step(core, "agent-3", 1_000, 2.0, list(range(2000, 2062))))
    events = observe_idle(core, 6.0)  # agent-1 idled out: agent-2 first (agent-3 then waits for its prefill)
    assert [admission_of(core, d).info.session_id for d in dispatched(events)] == ["agent-2"]


def test_a_subagent_runs_in_its_parents_slot_and_keeps_the_parent_active():
    w = window(initial=1, max=1, idle_timeout_s=10)
    w.dispatched("a", 0.0)
    w.finished("a", 1.0)  # a's step called its Task tool: it waits for the subagent's result
    assert w.may_dispatch("a/0", 1.0, parent="a")  # the family's only step in flight: it goes
    w.dispatched("a/0", 1.0, parent="a")
    assert w.holders() == 1 and not w.may_dispatch("b", 1.0)  # no slot of its own, none for b either
    w.expire(30.0)  # a sent nothing for 29 s, but its subagent runs: a is not idle
    assert w.is_active("a") and w.next_expiry() is None
    w.finished("a/0", 40.0, parent="a")
    assert w.next_expiry() == pytest.approx(50.0)  # idle from its subagent's last step


def test_further_branches_go_only_while_the_batch_has_slack():
    w = window(initial=2, max=2, max_parallel=8)
    w.dispatched("a", 0.0)
    w.finished("a", 0.0)
    w.dispatched("a/0", 0.0, parent="a")  # the fan-out's first branch
    assert w.may_dispatch("a/1", 0.0, parent="a")  # a free slot, KV low: a second branch may run beside it
    w.kv_usage = 0.9
    assert not w.may_dispatch("a/1", 0.0, parent="a")  # the pool is full: branches run one at a time
    w.kv_usage = 0.1
    w.dispatched("b", 0.0)  # the window is full: another agent may be waiting for a slot
    assert not w.may_dispatch("a/1", 0.0, parent="a")
    w.finished("a/0", 5.0, parent="a")
    assert w.may_dispatch("a/1", 5.0, parent="a")  # the family has nothing in flight: its next branch goes


def test_a_subagent_whose_parent_holds_no_slot_takes_one_in_the_parents_name():
    w = window(initial=1, max=1)
    assert w.may_dispatch("p/0", 0.0, parent="p")
    w.dispatched("p/0", 0.0, parent="p")
    assert w.is_active("p") and w.holders() == 1
    assert not w.may_dispatch("q/0", 0.0, parent="q")  # q's family would need a second slot


def test_the_core_admits_a_subagents_step_by_its_header_as_a_branch_of_its_parent():
    core = make_core(policy={"agents": {"initial": 1, "max": 1, "max_parallel": 4}})
    assert dispatched(core.offer(info(session_id="agent-1"), 0.0))
    held = core.offer(info(session_id="agent-2"), 0.1)
    assert not dispatched(held) and core.view.queued == 1  # the window is full
    for adm in list(core.permits):  # agent-1's step ends calling its Task tools
        core.finished(adm.request_id, 0.15, Terminal.COMPLETED)
    first = dispatched(core.offer(info(session_id="agent-1/task-1", parent_session_id="agent-1"), 0.2))
    assert first and admission_of(core, first[0]).parent_session == session_key("a", "agent-1")  # its slot
    # a second subagent while another agent waits for a slot: it waits behind the first one
    second = core.offer(info(session_id="agent-1/task-2", parent_session_id="agent-1"), 0.3)
    assert not dispatched(second) and core.view.queued == 2
    snap = core.snapshot(0.3)["models"]["m"]["agents"]
    assert snap == {"window": 1.0, "active": 1, "active_elsewhere": 0, "subagents": 1}


def test_with_a_separator_a_session_id_names_its_root_agent_as_the_subagents_parent():
    # WEKA's kv-cache-tester sends no x-parent-session-id: its subagents' ids are PARENT:AGENT,
    # a subagent's subagent's PARENT:AGENT:AGENT
    core = make_core(policy={"agents": {"initial": 1, "max": 1, "subagent_separator": ":"}})
    assert dispatched(core.offer(info(session_id="conv-1"), 0.0))
    for adm in list(core.permits):
        core.finished(adm.request_id, 0.1, Terminal.COMPLETED)
    for i, sid in enumerate(("conv-1:explore", "conv-1:explore:grep")):  # one after the other
        rid = dispatched(core.offer(info(session_id=sid), 0.2 + i / 10))
        assert rid and admission_of(core, rid[0]).parent_session == session_key("a", "conv-1")  # its slot
        assert core.snapshot(0.2 + i / 10)["models"]["m"]["agents"] == {
            "window": 1.0, "active": 1, "active_elsewhere": 0, "subagents": i + 1}  # both stay till idle
        core.finished(rid[0].request_id, 0.25 + i / 10, Terminal.COMPLETED)
    # another agent's subagent needs a slot for its family: the window (1) is full
    assert not dispatched(core.offer(info(session_id="conv-2:explore"), 0.5))
    assert core.view.queued == 1


def test_a_session_id_that_starts_with_the_separator_has_no_root_and_is_an_agent_of_its_own():
    core = make_core(policy={"agents": {"initial": 2, "max": 2, "subagent_separator": ":"}})
    rid = dispatched(core.offer(info(session_id=":odd"), 0.0))
    assert rid and admission_of(core, rid[0]).parent_session is None


def test_without_a_separator_a_session_id_is_never_split():
    core = make_core(policy={"agents": {"initial": 2, "max": 2}})
    rid = dispatched(core.offer(info(session_id="conv-1:explore"), 0.0))
    assert rid and admission_of(core, rid[0]).parent_session is None


def test_an_active_agents_step_displaces_new_agents_from_its_tenants_full_queue():
    """Refusing an active agent's step fails its session midway, every step done for it lost; a
    new agent waiting for a slot has done nothing yet. So where the tenant's queue is full, the
    step takes the place of the newest new agent's request (529 `evicted`), and a new agent's
    request is refused as before (`tenant_queue_full`)."""
    core = make_core(replicas=1, policy={"agents": {"initial": 1, "max": 1, "idle_timeout_s": 60},
                                         "queues": {"tenant_max_requests": 2}})
    assert dispatched(core.offer(info(session_id="agent-1"), 0.0))  # it holds the window's slot
    core.observe("m/0", Telemetry(at=0.05, kv_usage=0.99, running=10, waiting=0), 0.05)  # full: all waits
    second, third = info(session_id="agent-2"), info(session_id="agent-3")
    assert core.offer(second, 0.1) == [] and core.offer(third, 0.2) == []  # new agents wait for a slot
    [r] = rejected(core.offer(info(session_id="agent-4"), 0.3))
    assert r.refusal.reason == "tenant_queue_full"  # the queue is full, and it ranks no higher
    [r] = rejected(core.offer(info(session_id="agent-1"), 0.4))  # the active agent's next step
    assert (r.request_id, r.refusal.reason, r.refusal.status) == (third.request_id, "evicted", 529)
    queued = sorted(a.info.session_id for band in core.models["m"].flow.bands.values()
                    for q in band.queues.values() for a in q)
    assert queued == ["agent-1", "agent-2"]
