"""Three gateways sharing a real Redis through its death and one of their own, as
`bouncer bench gateways` runs them (shorter): real `redis-server`, `bouncer engine` and `bouncer
serve` processes, the openai SDK with its retries spread over the gateways.

What a user must see: no 500 and no request without an answer; while Redis is away, fail-open
keeps serving the limited tenant within its limit (each gateway its share) and fail-closed refuses
it with 503 `shared_state_unavailable`, the unlimited tenant untouched either way; within 2 s of
Redis coming back every gateway shares again; and a gateway killed mid-stream is dropped by the
others within its lease, its clients' requests served by them.
"""

from __future__ import annotations

import pytest

from bouncer.bench import gateways_faults as gf

FAULTS = gf.Faults(redis_down_at=3.0, outage_s=5.0, kill_after_s=4.0, end_after_s=6.0)


def _tenant(result: dict, phase: str, tenant: str) -> dict:
    return result["phases"][phase]["tenants"][tenant]


def _common(result: dict) -> None:
    assert result["attempts_5xx_not_503"] == 0
    assert result["lost"] == 0
    # Redis back: all three hold each other's part again within 2 s
    assert result["shared_again_s_after_redis_back"] is not None
    assert result["shared_again_s_after_redis_back"] <= 2.0
    # killed: both survivors drop its part within its lease (plus the 0.05 s poll and a loaded machine)
    dropped = result["dead_gateway_dropped_s_after_kill"]
    assert dropped is not None and 0.0 < dropped <= gf.LEASE_S + 1.0
    for phase in ("redis back", "gateway killed"):  # streams cut by the kill were served elsewhere
        top = _tenant(result, phase, "top")
        assert top["outcomes"] == {"completed": top["offered"]}, (phase, top)
    assert _tenant(result, "gateway killed", "limited")["outcomes"].get("completed", 0) > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fail_open_serves_each_gateways_share_while_redis_is_away_and_survives_a_killed_gateway():
    result = gf.run("fail-open", FAULTS)
    _common(result)
    down = result["phases"]["redis down"]
    limited = down["tenants"]["limited"]
    assert "refused shared_state_unavailable" not in limited["outcomes"]
    # each gateway its third of the limit (three gateways each alone would admit three times it),
    # plus a burst each: the local buckets' (a third each) start full, so does the Redis started
    # again empty, and requests sent near the phase's ends are answered on retries across them
    seconds = down["to_s"] - down["from_s"]
    assert 0 < limited["admitted_per_s"] <= (gf.LIMIT_RPS * seconds + 3 * gf.LIMIT_RPS) / seconds
    top = _tenant(result, "redis down", "top")
    assert top["outcomes"] == {"completed": top["offered"]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fail_closed_refuses_the_limited_tenant_while_redis_is_away_and_recovers():
    result = gf.run("fail-closed", FAULTS)
    _common(result)
    limited = _tenant(result, "redis down", "limited")
    assert limited["outcomes"].get("refused shared_state_unavailable", 0) > limited["offered"] / 3
    assert "503" in limited["attempts_by_status"]
    top = _tenant(result, "redis down", "top")
    assert top["outcomes"] == {"completed": top["offered"]}
    # back: the limited tenant is admitted again, with no more 503s of that kind
    back = _tenant(result, "gateway killed", "limited")
    assert "refused shared_state_unavailable" not in back["outcomes"]
