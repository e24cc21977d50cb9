"""One journey for a request (`bouncer.core.journey`), driven by the simulator and by the gateway.

The simulator's policy and the gateway's control plane both drive the same journey around the
core; these tests hold them to it. A simulated run is recorded at the simulator's policy (every
call it got, and every decision it gave), then replayed through the control plane's own driver
(its waiters, claims and finishes, on an injected clock): every decision must be the same.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from bouncer.bench import goodput, quotas_overflow
from bouncer.core.journey import Outcome, settlement
from bouncer.core.outcomes import Dispatch, Reason, Refusal, Terminal
from bouncer.gateway.control_plane import ControlPlane
from bouncer.gateway.parsed_request import Exchange
from bouncer.sim import scenarios
from bouncer.sim.fleet import Dispatched, Refused
from bouncer.sim.policies import CorePolicy


@dataclass
class Tape:
    policy: CorePolicy | None = None
    calls: list[tuple[str, float, Any]] = field(default_factory=list)
    decisions: list[tuple[int, str, str, str]] = field(default_factory=list)  # (call, attempt, kind, what)
    replayed_stats: dict = field(default_factory=dict)


def taped(tape: Tape):
    """A `CorePolicy` that writes what it is told and what it decides on `tape`."""

    class TapedPolicy(CorePolicy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tape.policy = self

        def _convert(self, steps, now):
            out = super()._convert(steps, now)
            i = len(tape.calls) - 1
            for ev in out:
                if isinstance(ev, Dispatched):
                    tape.decisions.append((i, ev.attempt_id, "go", ev.replica))
                else:
                    assert isinstance(ev, Refused)
                    tape.decisions.append((i, ev.attempt_id, "refuse", ev.reason))
            return out

        def offer(self, req, now):
            tape.calls.append(("offer", now, copy.copy(self._info(req))))
            return super().offer(req, now)

        def tick(self, now):
            tape.calls.append(("tick", now, None))
            return super().tick(now)

        def observe(self, replica, telemetry, now):
            tape.calls.append(("observe", now, (replica, telemetry)))
            return super().observe(replica, telemetry, now)

        def started(self, attempt_id, now):
            tape.calls.append(("started", now, attempt_id))
            super().started(attempt_id, now)

        def finished(self, attempt_id, now, completed, completion_tokens):
            tape.calls.append(("finished", now, (attempt_id, completed, completion_tokens)))
            return super().finished(attempt_id, now, completed, completion_tokens)

        def cancel(self, attempt_id, now):
            tape.calls.append(("cancel", now, attempt_id))
            return super().cancel(attempt_id, now)

        def engine_refused(self, attempt_id, now):
            tape.calls.append(("engine_refused", now, attempt_id))
            return super().engine_refused(attempt_id, now)

        def kv_events(self, replica, stored, removed, now):
            tape.calls.append(("kv_events", now, (replica, list(stored), list(removed))))
            super().kv_events(replica, stored, removed, now)

    return TapedPolicy


def replay_through_the_control_plane(policy: CorePolicy, tape: Tape) -> list[tuple[int, str, str, str]]:
    """The taped calls, made of a control plane on the same config, as its fronts make them."""
    clock = [0.0]
    decisions: list[tuple[int, str, str, str]] = []
    index = [0]

    async def run() -> None:
        plane = ControlPlane(policy.core.config, clock=lambda: clock[0])
        waiting: dict[str, asyncio.Task] = {}
        dispatched: dict[str, Dispatch] = {}
        exchanges: dict[str, Exchange] = {}

        async def served(rid: str, call) -> None:
            result = await call
            if isinstance(result, Refusal):
                decisions.append((index[0], rid, "refuse", f"{result.layer.value}/{result.reason}"))
            else:
                assert isinstance(result, Dispatch)
                dispatched[rid] = result
                decisions.append((index[0], rid, "go", result.replica))

        for i, (kind, now, args) in enumerate(tape.calls):
            index[0] = i
            clock[0] = now
            if kind == "offer":
                info = copy.copy(args)
                ex = exchanges[info.request_id] = Exchange(info.request_id, now, {})
                waiting[info.request_id] = asyncio.create_task(served(info.request_id, plane._served(
                    ex, lambda info=info, now=now: plane.journey.offer(info, now))))
            elif kind == "tick":
                plane.apply(plane.core.tick(now))
            elif kind == "observe":
                plane.journey.renew(now)
                plane.apply(plane.core.observe(*args, now))
            elif kind == "kv_events":
                plane.core.kv_digests(*args, now)
            elif kind == "started":
                plane.started(args, now)
            elif kind == "finished":
                rid, completed, tokens = args
                out = Outcome(Terminal.COMPLETED, None, tokens) if completed \
                    else Outcome(Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED, tokens)
                plane.finish(exchanges[rid], dispatched.pop(rid), out, True)
            elif kind == "cancel":  # its client left while it was held
                waiting.pop(args).cancel()
            elif kind == "engine_refused":
                waiting[args] = asyncio.create_task(served(args, plane.requeue(exchanges[args], None)))
            for _ in range(4):  # each waiting front hears its decision before time moves on
                await asyncio.sleep(0)
        for task in waiting.values():
            task.cancel()
        tape.replayed_stats = dict(plane.core.view.stats.decisions)

    asyncio.run(run())
    return decisions


def m_mid_at_load_3() -> set[str]:
    goodput.simulate("surge", "bouncer", 3.0, 0, 2, 8.0, str(scenarios.SERVEGEN_M_MID))
    return set()


def overflow_to_a_spare_pool() -> set[str]:
    r = quotas_overflow.divert("divert", 2.0, duration_s=120.0)
    assert r["diverted"] > 0
    return {"diverted"}


@pytest.mark.parametrize("run", [m_mid_at_load_3, overflow_to_a_spare_pool])
def test_a_recorded_run_decides_the_same_through_the_simulator_and_the_control_plane(run, monkeypatch, tmp_path):
    tape = Tape()
    for module in (goodput, quotas_overflow):
        monkeypatch.setattr(module, "CorePolicy", taped(tape))
    monkeypatch.setattr(goodput, "CACHE_DIR", tmp_path / "capacity")
    run()
    kinds = {k for k, _, _ in tape.calls}
    # the run went through the paths of the journey that a single gateway has
    assert {"offer", "tick", "observe", "started", "finished"} <= kinds, kinds
    sim = tape.decisions
    assert len({rid for _, rid, _, _ in sim}) > 1000
    assert {kind for _, _, kind, _ in sim} == {"go", "refuse"}
    assert tape.policy is not None
    gateway = replay_through_the_control_plane(tape.policy, tape)
    assert len(gateway) == len(sim)
    for a, b in zip(sorted(sim), sorted(gateway), strict=True):
        assert a == b
    # and both cores counted the same decisions
    assert tape.replayed_stats == dict(tape.policy.core.view.stats.decisions)


def test_settlement_is_one_rule_for_every_end():
    d = Dispatch("r", "r0", "m", "a", 0, 100, 0.0, 10.0, predicted_ttft_s=1.0, predicted_tpot_s=0.1)
    # the engine said: its usage, whatever else
    assert settlement(Outcome(Terminal.CANCELLED, None, 5, None, 40), 50, d, 10.0) == (40, 5)
    # a whole answer: the prompt as counted, the completion as seen
    assert settlement(Outcome(Terminal.COMPLETED, None, 7), 50, d, 10.0) == (50, 7)
    # a stream cut after its first token: what was streamed
    assert settlement(Outcome(Terminal.CANCELLED, None, 3, 11.5), 50, d, 12.0) == (50, 3)
    # a client that left before anything came: what the predictions say was done by then
    assert settlement(Outcome(Terminal.CANCELLED, None, 0), 50, d, 10.5) == (0, 0)
    assert settlement(Outcome(Terminal.CANCELLED, None, 0), 50, d, 11.55) == (50, 6)
    # an answer not seen (behind the picker): charged what it reserved
    assert settlement(Outcome(Terminal.COMPLETED, None, None), 50, d, 12.0) == (50, None)
    # failed before its answer began, or never dispatched: nothing
    assert settlement(Outcome(Terminal.FAILED, Reason.UPSTREAM_ERROR, 0), 50, d, 12.0) == (0, 0)
    assert settlement(Outcome(Terminal.CANCELLED, None, 0), 50, None, 12.0) == (0, 0)
