"""Autoscaling in the simulator: the HPA-like provisioner's arithmetic, engines that join and
leave a running fleet, and one short burst where the signal decides (`bouncer bench autoscaling`,
docs/benchmarks/autoscaling.md has the full runs)."""

from __future__ import annotations

import pytest

from bouncer.bench.autoscaling import Workload, run
from bouncer.bench.goodput import fleet_config, make_policy
from bouncer.sim.fleet import FleetSim
from bouncer.sim.profiles import DEFAULT_PROFILE
from bouncer.sim.provisioner import Provisioner, Signal
from bouncer.sim.scenarios import get_scenario
from bouncer.sim.workloads import steady_requests


class _Fleet:
    """What the provisioner sees of a fleet: its engines, those serving, and adding and retiring."""

    def __init__(self, n: int) -> None:
        self.engines = {f"r{i}": None for i in range(n)}
        self.retiring: set[str] = set()

    def serving(self) -> list[str]:
        return [n for n in self.engines if n not in self.retiring]

    def add_engine(self, name: str, now: float) -> None:
        self.engines[name] = None

    def retire(self, name: str, now: float) -> None:
        del self.engines[name]  # drains at once here


def test_the_provisioner_scales_up_at_once_within_the_hpa_step_and_down_only_after_its_window():
    value = {"v": 8.0}
    p = Provisioner(Signal("x", lambda fleet, now: value["v"], target=0.8), min_replicas=1, max_replicas=16,
                    startup_s=300, interval_s=15, scale_down_window_s=300)
    fleet = _Fleet(2)
    p.step(fleet, 0.0)  # wants ceil(8 / 0.8) = 10: at most max(2 x 2, 2 + 4) = 6 at once
    assert p.history[-1]["desired"] == 6 and len(fleet.serving()) == 2 and p.paid(fleet) == 6
    p.step(fleet, 15.0)  # 6 -> 10 (the starting ones count as there)
    assert p.paid(fleet) == 10
    for t in range(20, 300, 5):
        p.step(fleet, float(t))
    assert len(fleet.serving()) == 2  # nothing ready before its start-up is over
    p.step(fleet, 315.0)
    assert len(fleet.serving()) == 10
    # paid from the moment it was asked for: 2 for 15 s, 6 from 0, 4 more from 15
    assert p.replica_seconds == pytest.approx(6 * 315 + 4 * 300)
    value["v"] = 0.5  # wants 1; the window still remembers 10 for 300 s
    for t in range(330, 600, 15):
        p.step(fleet, float(t))
        assert len(fleet.serving()) == 10
    for t in range(600, 700, 15):
        p.step(fleet, float(t))
    assert len(fleet.serving()) == 1


def _joined_and_left(policy_name: str):
    """r0 alone; r1 joins at 60 s; r0 is taken out at 120 s."""
    scenario = get_scenario("surge", 300)
    requests = steady_requests(scenario.tenants, scenario.load(), 12.0, 300.0, 0)
    cfg = fleet_config(policy_name, 1, DEFAULT_PROFILE, 0, scenario)
    policy = make_policy(policy_name, scenario, cfg)
    fleet = FleetSim(cfg, policy, policy.replica_names)
    seen = {}

    def change(now: float) -> None:
        if now == 60.0:
            fleet.add_engine("r1", now)
        if now == 120.0:
            fleet.retire("r0", now)
        seen[now] = (sorted(fleet.serving()), sorted(fleet.engines))
    fleet.record(10.0, change)
    return requests, fleet, fleet.run(requests), seen


@pytest.mark.parametrize("policy_name", ["bouncer", "none"])
def test_engines_join_and_leave_a_running_fleet_and_nothing_is_lost(policy_name):
    requests, fleet, result, seen = _joined_and_left(policy_name)
    assert result.lost == 0
    assert seen[70.0] == (["r0", "r1"], ["r0", "r1"])
    assert seen[200.0] == (["r1"], ["r1"])  # r0 finished what it held and is gone
    assert "r0" in fleet.retired and fleet.retired["r0"].counters.request_success["length"] > 0
    late = [r for r in requests if r.arrival > 130 and r.replica is not None]
    assert late and all(r.replica == "r1" for r in late)


def test_behind_admission_the_engines_queue_says_nothing_and_the_demand_signal_grows_the_fleet():
    """A short burst of the standard and batch bands: behind Bouncer, an autoscaler on the
    engines' waiting requests sees an empty queue and shrinks the fleet; on the demand signal it
    grows it, and the protected band keeps its SLO."""
    w = Workload("burst", 900.0, 2, 1.6, lambda t: 10.0 if 300 <= t < 330 else 1.0, 10.0, burst=(300.0, 330.0))
    on_demand = run(w, "bouncer", "demand", startup_s=120)
    on_queue = run(w, "bouncer", "waiting", startup_s=120)
    assert on_demand["lost"] == on_queue["lost"] == 0
    assert on_queue["max_paid"] <= 2 < on_demand["max_paid"]
    assert on_demand["tenants"]["interactive"]["attainment"] >= 0.99
    assert on_demand["goodput_rps"] > on_queue["goodput_rps"]
