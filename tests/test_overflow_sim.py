"""Quotas and overflow in the simulator (`bouncer bench overflow`), on short runs: diverting to a
spare pool serves more within SLO than refusing, and demoting a tenant past its quota serves its
overflow without taking from the others."""

from __future__ import annotations

from bouncer.bench.quotas_overflow import demote, divert


def test_diverting_a_saturated_pools_refusals_to_a_spare_pool_serves_more_within_slo():
    refuse, spill = divert("refuse", 2.0, duration_s=120.0), divert("divert", 2.0, duration_s=120.0)
    assert refuse["diverted"] == 0 and spill["diverted"] > 0
    assert refuse["lost"] == spill["lost"] == 0
    assert spill["goodput_rps"] >= 1.3 * refuse["goodput_rps"], (spill["goodput_rps"], refuse["goodput_rps"])


def test_demoting_past_a_quota_serves_the_overflow_from_spare_capacity_only():
    runs = {p: demote(p, duration_s=600.0) for p in ("refuse", "demote")}
    refuse, demoted = runs["refuse"], runs["demote"]
    assert refuse["quota_spent_at_s"] is not None and refuse["quota_spent_at_s"] == demoted["quota_spent_at_s"]
    # past the quota: refused, the tenant's requests are turned away; demoted, many are served
    assert refuse["after"]["pt"]["completed"] <= 0.01 * refuse["after"]["pt"]["offered"]
    assert demoted["after"]["pt"]["within_slo"] >= 0.3 * demoted["after"]["pt"]["offered"]
    # ... without taking from the tenants within their shares
    for tenant in ("interactive", "standard"):
        assert demoted["after"][tenant]["attainment"] >= refuse["after"][tenant]["attainment"] - 0.01, tenant
    # and before it, the same for everyone (demotion changes nothing while in quota)
    assert demoted["before"]["pt"]["within_slo"] >= refuse["before"]["pt"]["within_slo"] - 5
