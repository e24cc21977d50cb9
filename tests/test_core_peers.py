"""Several gateways' cores sharing their parts (`bouncer.core.sharing.peers`), with explicit time."""

from __future__ import annotations

import json

import pytest
from tests.core_helpers import admission_of, dispatched, info, make_core, observe_idle, tenant

from bouncer.core.fleet.cache_salt import salt_root, salted
from bouncer.core.outcomes import Dispatch, Terminal
from bouncer.core.sharing.peers import HEAD_ORDER_SLACK_S, FleetShares, GatewayShare, ReplicaLoad

FIGURES = ("inflight_blocks", "unstarted", "queued_prefill_tokens", "queued_prefill_pairs", "pending_context",
           "decoding", "decode_context")


def exchange(cores, now):
    """One sync: every core sees the others' parts as they are now."""
    shares = [c.own_share(now) for c in cores]
    events = []
    for i, c in enumerate(cores):
        events.append(c.peers(shares[:i] + shares[i + 1:], now))
    return events


def test_each_replica_counts_the_other_gateways_load_and_gives_back_only_its_own():
    a, b = make_core(replicas=1), make_core(replicas=1)
    sent = dispatched(a.offer(info(prompt=800), 0.0)) + dispatched(a.offer(info(prompt=300), 0.0))
    assert len(sent) == 2
    a.started(sent[0].request_id, 0.5)  # one decodes, one still waits for its prefill
    (name,) = a.replicas
    ra, rb = a.replicas[name], b.replicas[name]
    alone = {f: getattr(ra, f) for f in FIGURES}
    exchange([a, b], 1.0)
    assert {f: getattr(rb, f) for f in FIGURES} == alone  # b counts a's requests as its own figures
    assert rb.requests_in_flight == 2 and not rb.inflight  # but holds none of them
    assert rb.own_load() == ReplicaLoad()  # and gives back nothing of them
    assert a.own_share(1.0).replicas[name].requests == 2
    # a's requests end: the next sync takes them out of b's figures again
    for d in sent:
        a.finished(d.request_id, 2.0, Terminal.COMPLETED, 10)
    exchange([a, b], 2.0)
    assert {f: getattr(rb, f) for f in FIGURES} == {f: 0 for f in FIGURES}
    assert rb.requests_in_flight == 0


def test_two_gateways_fill_a_replica_once_when_they_share_and_twice_when_they_do_not():
    def fill(share: bool) -> int:
        policy = {"max_inflight_per_replica": 4}
        cores = [make_core(replicas=1, policy=policy), make_core(replicas=1, policy=policy)]
        sent = 0
        for step in range(10):
            now = step * 0.1
            for c in cores:
                sent += len(dispatched(c.offer(info(prompt=50, max_tokens=20), now)))
            if share:
                sent += sum(len(dispatched(e)) for e in exchange(cores, now))
        return sent

    assert fill(share=True) == 4
    assert fill(share=False) == 8


def test_a_head_waits_for_a_sooner_one_of_its_tenant_at_another_gateway():
    shares = FleetShares(window_s=10.0, slack_tokens=8192)
    key = ("m", 0, "a")
    other = GatewayShare(queued={key: (1.0, 1)})  # its head must go within a second
    shares.seen([other], now=100.0)
    assert shares.holds(key, head_urgency=101.0 + HEAD_ORDER_SLACK_S + 0.1, now=100.0)
    assert not shares.holds(key, head_urgency=101.0 + HEAD_ORDER_SLACK_S - 0.1, now=100.0)  # a near-tie goes
    assert not shares.holds(("m", 1, "a"), head_urgency=200.0, now=100.0)  # another band is not ordered with it


def test_a_tenant_served_ahead_of_one_queued_elsewhere_is_held_until_that_one_catches_up():
    shares = FleetShares(window_s=10.0, slack_tokens=1000)
    ahead, behind = ("m", 0, "bursty"), ("m", 0, "steady")
    shares.served(ahead, 5000, now=0.0)
    shares.seen([GatewayShare(served={behind: 3000.0}, queued={behind: (5.0, 1)})], now=0.0)
    assert shares.holds(ahead, head_urgency=1.0, now=0.0)  # leads by 2000 > 1000
    shares.seen([GatewayShare(served={behind: 4500.0}, queued={behind: (5.0, 1)})], now=0.0)
    assert not shares.holds(ahead, head_urgency=1.0, now=0.0)  # within the slack
    # nobody queued elsewhere: nothing to give way to, however far ahead
    shares.seen([GatewayShare(served={behind: 0.0})], now=0.0)
    assert not shares.holds(ahead, head_urgency=1.0, now=0.0)


def test_a_tenant_ahead_of_one_waiting_for_room_elsewhere_is_held_by_any_lead():
    # the other gateway's steady tenant had its turn and its head waits for room: the bursty
    # tenant here, served more, does not take that room with its smaller requests meanwhile
    shares = FleetShares(window_s=10.0, slack_tokens=8192)
    ahead, behind = ("m", 0, "bursty"), ("m", 0, "steady")
    shares.served(ahead, 1500, now=0.0)
    waiting = GatewayShare(served={behind: 1000.0}, queued={behind: (5.0, 1)}, room=[behind])
    shares.seen([waiting], now=0.0)
    assert shares.holds(ahead, head_urgency=1.0, now=0.0)  # leads by 500, under the slack
    assert not shares.holds(behind, head_urgency=1.0, now=0.0)  # the one behind is never held so
    shares.seen([GatewayShare(served={behind: 2000.0}, queued={behind: (5.0, 1)}, room=[behind])], now=0.0)
    assert not shares.holds(ahead, head_urgency=1.0, now=0.0)  # not ahead of it
    shares.seen([GatewayShare(served={behind: 1000.0}, queued={behind: (5.0, 1)})], now=0.0)
    assert not shares.holds(ahead, head_urgency=1.0, now=0.0)  # its head no longer waits for room


def test_a_head_that_had_its_turn_and_waits_for_room_is_in_the_share_for_the_hold():
    core = make_core(tenants=[tenant("big"), tenant("small")], replicas=1, kv_blocks=200,
                     policy={"fair_hold_s": 2.0, "telemetry": {"staleness_s": 1e9}})
    assert dispatched(core.offer(info("small", prompt=1500, max_tokens=10), 0.0))  # most of the KV
    assert not dispatched(core.offer(info("big", prompt=2000, max_tokens=10), 0.0))  # no room for it
    assert core.own_share(0.5).room == [("m", 0, "big")]
    assert core.own_share(2.5).room == []  # held no longer than fair_hold_s


def test_served_tokens_decay_with_the_window_and_fade_out_of_the_share():
    shares = FleetShares(window_s=10.0, slack_tokens=0)
    key = ("m", 0, "a")
    shares.served(key, 1000.0, now=0.0)
    assert shares.fleet_served(key, 10.0) == pytest.approx(1000.0 / 2.718281828, rel=1e-6)
    assert shares.own(10.0)[key] == pytest.approx(367.88, rel=1e-3)
    assert key not in shares.own(100.0)  # decayed below a token: dropped


@pytest.mark.parametrize("slack, heavy_share", [(200, 0.75), (1e12, 0.5)])
def test_weighted_shares_follow_weights_across_gateways(slack, heavy_share):
    """A weight-3 tenant on one gateway and a weight-1 tenant on another, both always queued on
    one replica that takes one request at a time: served tokens split 3:1 (each gateway also
    seeing its own completions first: without the shares, a slack no lead reaches, 1:1). The
    in-flight limit holds every request alike, so no head holds room for its size here."""
    policy = {"max_inflight_per_replica": 1, "fleet_shares_slack_tokens": slack}
    tenants = [tenant("heavy", weight=3.0), tenant("light", weight=1.0)]
    cores = [make_core(replicas=1, policy=policy, tenants=tenants),
             make_core(replicas=1, policy=policy, tenants=tenants)]
    served = {"heavy": 0, "light": 0}
    running: dict[str, tuple[int, str]] = {}  # request id -> (its core, its tenant)
    now = 0.0
    for name, c in (("heavy", cores[0]), ("light", cores[1])):
        for _ in range(1000):  # more than 300 steps serve: both stay queued
            for e in c.offer(info(name, prompt=90, max_tokens=10), now):
                if isinstance(e, Dispatch):
                    running[e.request_id] = (cores.index(c), name)
    for step in range(300):
        now = 0.01 * (step + 1)
        events = []
        for rid, (i, name) in list(running.items()):
            del running[rid]
            served[name] += 100
            events.append((i, cores[i].finished(rid, now, Terminal.COMPLETED, 10)))
        events += list(enumerate(exchange(cores, now)))
        for i, evs in events:
            for e in evs:
                if isinstance(e, Dispatch):
                    running[e.request_id] = (i, e.tenant)
    total = served["heavy"] + served["light"]
    assert served["heavy"] / total == pytest.approx(heavy_share, abs=0.05)


def test_a_gateways_share_crosses_the_wire_unchanged():
    share = GatewayShare({"r0": ReplicaLoad(3, 40, 5, 1, ((0, 1), (2, 0)), 700, 9000, 1200, 2, 800)},
                         {("m", 0, "a"): 123.5}, {("m", 0, "a"): (0.75, 3), ("m", 1, "b"): (2.0, 1)},
                         {"m": (12.5, None, 3.0)}, {"m": [[10, 1.0, 0.5, None, None, 2.0]]},
                         {"a": (4.5, 0), "b": (None, 2)}, {"m": [("s1", "r0", 12), ("s2", None, 0)]},
                         [(7, "r0", [2**63 + 5, 12, 13])], [("m", 0, "a")])
    assert GatewayShare.from_wire(json.loads(json.dumps(share.to_wire()))) == share


def test_a_part_from_a_gateway_that_shares_no_breakers_agents_prefixes_or_room_still_reads():
    wire = GatewayShare({"r0": ReplicaLoad(1)}).to_wire()
    del wire["breakers"], wire["agents"], wire["prefixes"], wire["room"]  # as a gateway before them writes it
    assert GatewayShare.from_wire(wire) == GatewayShare({"r0": ReplicaLoad(1)})


BREAKER = {"breaker": {"failures": 2, "window_s": 10, "open_s": 5}}


def _fail(core, now):
    (d,) = dispatched(core.offer(info(), now))
    core.finished(d.request_id, now + 0.1, Terminal.FAILED, reason="upstream_timeout")


def test_a_breaker_open_at_one_gateway_refuses_the_tenant_at_every_gateway_until_it_half_opens():
    two = [tenant("a"), tenant("other")]
    a, b = make_core(policy=BREAKER, tenants=two), make_core(policy=BREAKER, tenants=two)
    _fail(a, 0.0)
    _fail(a, 1.0)  # a's breaker opens at 1.1, for 5 s
    exchange([a, b], 2.0)
    r = b.offer(info(), 2.0)
    assert [(e.refusal.reason, round(e.refusal.retry_after, 2)) for e in r] == [("circuit_open", 4.1)]
    assert b.precheck(info(), 2.0).refusal.reason == "circuit_open"  # before its prompt is even tokenized
    assert dispatched(b.offer(info(tenant_name="other"), 2.0))  # other tenants untouched
    observe_idle(b, 6.5)
    exchange([a, b], 6.5)  # a's breaker lets a probe through now: b may send again
    assert dispatched(b.offer(info(), 6.5))


def test_failures_count_over_every_gateway_toward_the_threshold():
    a, b = make_core(policy=BREAKER), make_core(policy=BREAKER)
    _fail(a, 0.0)  # one failure each: alone neither gateway would trip
    exchange([a, b], 0.5)
    _fail(b, 1.0)
    assert b.offer(info(), 1.5)[0].refusal.reason == "circuit_open"
    exchange([a, b], 2.0)
    assert a.offer(info(), 2.0)[0].refusal.reason == "circuit_open"


AGENTS = {"agents": {"initial": 2, "max": 2, "idle_timeout_s": 5}}


def test_the_agent_window_bounds_the_fleets_agents_and_an_agent_keeps_its_slot_and_home_at_another_gateway():
    a, b = make_core(policy=AGENTS), make_core(policy=AGENTS)
    first = dispatched(a.offer(info(session_id="s1"), 0.0)) + dispatched(a.offer(info(session_id="s2"), 0.0))
    assert len(first) == 2
    homes = {d.request_id: d.replica for d in first}
    exchange([a, b], 0.1)
    assert b.snapshot(0.1)["models"]["m"]["agents"] == {"window": 2.0, "active": 2, "active_elsewhere": 2,
                                                         "subagents": 0}
    assert not dispatched(b.offer(info(session_id="s3"), 0.2))  # the window is full fleet-wide: s3 waits
    (step,) = dispatched(b.offer(info(session_id="s1"), 0.3))  # s1 holds its slot: its next step goes
    assert step.replica == homes[first[0].request_id]  # to where its context lives
    alone = make_core(policy=AGENTS)  # without sharing, b would have let s3 in beside a's two
    assert dispatched(alone.offer(info(session_id="s3"), 0.2))
    # a's agents idle out and its part says so: b's waiting agent takes the slot
    for d in first:
        a.finished(d.request_id, 1.0, Terminal.COMPLETED, 10)
    b.finished(step.request_id, 1.0, Terminal.COMPLETED, 10)
    observe_idle(a, 7.0)
    events = exchange([a, b], 7.0)[1] + observe_idle(b, 7.0)
    assert [admission_of(b, d).info.session_id for d in dispatched(events)] == ["s3"]


def test_a_gateway_keeps_room_for_a_top_band_whose_requests_all_arrive_at_another():
    """The top band's requests reach gateway a only; b, serving band 0, leaves the prefill room
    a top-band request needs once it has seen a's part, as one gateway does for both."""
    tenants = [tenant("top", priority=10, slo={"ttft_s": 1.0}), tenant("low", priority=0, slo={"ttft_s": 30.0})]
    a, b = make_core(tenants=tenants, replicas=1), make_core(tenants=tenants, replicas=1)
    dispatched(a.offer(info("top", prompt=100), 0.0))
    assert b.models["m"].band_slos.protected(0, 0.1) == (float("inf"), float("inf"))
    exchange([a, b], 0.1)
    assert b.models["m"].band_slos.protected(0, 0.2)[0] == pytest.approx(1.0)
    assert b.models["m"].band_slos.protected(10, 0.2)[0] == float("inf")  # nothing above the top band


def test_a_band_waits_while_a_higher_band_queues_at_another_gateway():
    shares = FleetShares(window_s=10.0, slack_tokens=0)
    shares.seen([GatewayShare(queued={("m", 10, "top"): (0.5, 2)})], now=0.0)
    assert shares.outranked("m", 0) and shares.outranked("m", -1)
    assert not shares.outranked("m", 10) and not shares.outranked("other-model", 0)


def test_a_newcomers_wait_counts_what_the_other_gateways_queue_and_their_dispatch_rates():
    from bouncer.core.flow.backlog import ahead, fleet_ahead

    core = make_core(tenants=[tenant("a"), tenant("b")], replicas=1, policy={"max_inflight_per_replica": 1})
    dispatched(core.offer(info("a"), 0.0))  # the replica's one slot
    for _ in range(4):
        core.offer(info("a"), 0.0)
    flow = core.models["m"].flow
    shares = FleetShares(window_s=10.0, slack_tokens=0)
    shares.enabled = True
    shares.seen([GatewayShare(queued={("m", 0, "a"): (1.0, 6), ("m", 0, "b"): (1.0, 2), ("m", 10, "x"): (1.0, 3)},
                              rates={"m": (4.0, 5.0, 6.0)})], now=0.0)
    assert ahead(flow, 0, "a") == 4  # alone: its own four, the band's only tenant
    # fleet-wide: 3 of a higher band, then a's 10 queued, draining at its half of the band's two
    assert fleet_ahead(flow, 0, "a", shares) == 3 + 10 * 2
    assert fleet_ahead(flow, 0, "c", shares) == 3 + 12  # a tenant queued nowhere: behind the whole band
    assert shares.rates_elsewhere("m") == (4.0, 5.0, 6.0)


def test_what_one_gateway_sent_a_replica_reaches_the_others_prefix_index_once_and_only_its_new_blocks():
    a, b = make_core(), make_core()
    exchange([a, b], 0.0)  # sharing from now on: a logs what it is first to send
    first = list(range(100, 110))
    (d,) = dispatched(a.offer(info(prompt=160, block_digests=first), 0.1))
    assert d.cache_salt  # indexed, and shared, under its tenant's salt (`cache_isolation`)
    root = salt_root(d.cache_salt)
    assert b.replicas[d.replica].prefix.match(salted(first, root), 0.1) == 0
    exchange([a, b], 0.12)
    assert b.replicas[d.replica].prefix.match(salted(first, root), 0.12) == 10  # b routes it there too
    assert b.replicas[d.replica].prefix.match(first, 0.12) == 0  # not for another tenant
    exchange([a, b], 0.14)  # the entry is still in a's part (KEEP_S): recorded once, not again
    assert len(b.peer_prefixes._applied) == 1
    # the conversation's next turn extends it: only its new blocks are logged
    (d2,) = dispatched(a.offer(info(prompt=240, block_digests=first + [110, 111, 112, 113, 114]), 0.2))
    assert d2.replica == d.replica
    assert [e[2] for e in a.own_share(0.2).prefixes][-1] == salted([110, 111, 112, 113, 114], root)
    assert a.own_share(0.2 + 1.0).prefixes == []  # older than KEEP_S: out of the part


def test_a_gateway_that_shares_nothing_logs_nothing():
    alone = make_core()
    dispatched(alone.offer(info(prompt=160, block_digests=list(range(10))), 0.0))
    assert alone.sent_prefixes.recent(0.0) == []


def test_a_dispatch_that_nearly_fills_a_replica_is_claimed_and_waits_again_when_another_gateway_filled_it():
    """Claims (`bouncer.core.sharing.claims`): two gateways each see room for one more request on a
    replica between syncs. The one whose claim fails holds its request again, with the replica
    as full as the other made it, and sends it once that request ends."""
    from bouncer.core.sharing import claims

    a, b = make_core(replicas=1, kv_blocks=100), make_core(replicas=1, kv_blocks=100)
    exchange([a, b], 0.0)  # they share state from here on
    (name,) = a.replicas
    first = dispatched(a.offer(info(prompt=560, max_tokens=80), 0.1))  # 40 blocks of 100
    assert len(first) == 1 and first[0].claim is None  # far from full: no round trip
    elsewhere = dispatched(b.offer(info(prompt=560, max_tokens=80), 0.1))  # b has not seen a's
    assert len(elsewhere) == 1
    (second,) = dispatched(a.offer(info(prompt=560, max_tokens=80), 0.2))
    # a's view: 40 of 92 usable blocks held, this one 40 more: 12 left, under a quarter of the replica
    assert second.claim == (40, 0, 12)
    others = b.replicas[name].inflight_blocks - b.replicas[name].peers.blocks
    assert others == 40 and not claims.holds(second.claim, others)
    assert dispatched(a.unclaimed(second.request_id, others, 0.2)) == []  # held: the replica is full
    assert a.view.queued == 1 and len(a.replicas[name].inflight) == 1
    assert claims.holds(second.claim, 12) and not claims.holds(second.claim, 13)
    b.finished(elsewhere[0].request_id, 0.5, Terminal.COMPLETED, 80)
    events = exchange([a, b], 0.6)[0]  # b's request gone from a's view: room again
    again = dispatched(events)
    assert [d.request_id for d in again] == [second.request_id] and again[0].claim is not None
