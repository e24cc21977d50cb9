"""llm-d's request vocabulary, so a team can swap llm-d's picker for Bouncer without changing its
clients: an inference objective (a lower band), a fairness id (a tenant for keyless requests),
and the TTL and SLO headers, each only tightening what the tenant's config allows. The core's
rules here; the proxy end to end below; the picker through Envoy in test_endpoint_picker.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from bouncer.config import key_digest, parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.outcomes import Reason, Reject
from bouncer.gateway.request_parsing import request_head
from bouncer.openai_wire import ApiError
from core_helpers import admission_of, dispatched, info, make_config, observe_idle, tenant
from gateway_setup import Fleet
from gateway_setup import tenant as keyed_tenant


def _core(**config) -> AdmissionCore:
    core = AdmissionCore(parse_config({**make_config([tenant("a", 5), tenant("gate", 0, fairness_ids=["team-x"])]),
                                       "objectives": [{"name": "batch", "priority": -1},
                                                      {"name": "critical", "priority": 50}],
                                       "access": {"trust_fairness_id": True}, **config}), 0.0)
    observe_idle(core, 0.0)
    return core


def test_an_objective_lowers_a_request_s_band_and_never_raises_it():
    core = _core()
    batch = dispatched(core.offer(info("a", objective="batch"), 0.0))
    assert admission_of(core, batch[0]).priority == -1
    critical = dispatched(core.offer(info("a", objective="critical"), 0.0))
    assert admission_of(core, critical[0]).priority == 5  # the tenant's own band: an objective only lowers


def test_an_objective_the_config_does_not_list_is_refused_400():
    core = _core()
    [refused] = core.offer(info("a", objective="vip"), 0.0)
    assert isinstance(refused, Reject) and refused.refusal.reason is Reason.INVALID_PARAMETER
    assert refused.refusal.status == 400 and refused.refusal.param == "x-llm-d-inference-objective"


def test_a_fairness_id_names_a_tenant_only_for_a_request_whose_key_names_none():
    core = _core()
    keyless = info("a", fairness_id="team-x")
    keyless.key_digest = None
    assert admission_of(core, dispatched(core.offer(keyless, 0.0))[0]).tenant == "gate"
    keyed = dispatched(core.offer(info("a", fairness_id="team-x"), 0.0))  # a's key: a's, whatever the header
    assert admission_of(core, keyed[0]).tenant == "a"
    unknown = info("a", fairness_id="team-y")
    unknown.key_digest = None
    [refused] = core.offer(unknown, 0.0)
    assert isinstance(refused, Reject) and refused.refusal.reason is Reason.UNAUTHENTICATED


def test_a_fairness_id_listed_for_two_tenants_is_a_config_error():
    with pytest.raises(ValueError, match="fairness id"):
        parse_config({**make_config([tenant("a", fairness_ids=["x"]), tenant("b", fairness_ids=["x"])]),
                      "access": {"trust_fairness_id": True}})


def test_fairness_ids_without_trusting_the_header_are_a_config_error():
    """The header is the client's own word: naming tenants by it needs a gateway in front that
    authenticates and sets it, said in the config."""
    with pytest.raises(ValueError, match="trust_fairness_id"):
        parse_config(make_config([tenant("a", fairness_ids=["x"])]))


def test_an_untrusted_fairness_id_names_no_tenant():
    """Without `access.trust_fairness_id`, a keyless request naming a tenant's fairness id is
    that of no tenant (401), or the default tenant's where one is configured: never the one it
    named (a client could otherwise run as any tenant, in its band, on its quota)."""
    core = AdmissionCore(parse_config(make_config([tenant("a", 5), tenant("b", 0)])), 0.0)
    observe_idle(core, 0.0)
    forged = info("a", fairness_id="a")
    forged.key_digest = None
    [refused] = core.offer(forged, 0.0)
    assert isinstance(refused, Reject) and refused.refusal.reason is Reason.UNAUTHENTICATED
    core = AdmissionCore(parse_config({**make_config([tenant("a", 5), tenant("b", 0)]), "default_tenant": "b"}), 0.0)
    observe_idle(core, 0.0)
    assert admission_of(core, dispatched(core.offer(forged, 0.0))[0]).tenant == "b"


def test_llm_d_s_ttl_and_slo_headers_tighten_like_bouncer_s_own():
    body = {"model": "m", "prompt": "hi"}
    head = request_head("r", "completion", body, {"x-llm-d-inference-ttl": "1m30s", "x-bouncer-ttl-ms": "120000",
                                                  "x-llm-d-slo-ttft-ms": "800", "x-llm-d-slo-tpot-ms": "50",
                                                  "x-llm-d-inference-objective": "batch",
                                                  "x-llm-d-inference-fairness-id": "team-x"}, None)
    assert (head.ttl_s, head.ttft_slo_s, head.tpot_slo_s) == (90.0, 0.8, 0.05)
    assert (head.objective, head.fairness_id) == ("batch", "team-x")
    old = request_head("r", "completion", body, {"x-gateway-inference-objective": "batch",
                                                 "x-gateway-inference-fairness-id": "team-x"}, None)
    assert (old.objective, old.fairness_id) == ("batch", "team-x")  # the deprecated aliases
    for bad in ("30", "soon", "-1s", "0ms"):
        with pytest.raises(ApiError, match="x-llm-d-inference-ttl"):
            request_head("r", "completion", body, {"x-llm-d-inference-ttl": bad}, None)


def _post(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    body = json.dumps({"model": "demo-llm", "max_tokens": 2, "prompt": "hi"}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_proxy_honours_the_vocabulary_end_to_end(bg_loop):
    f = Fleet(bg_loop, [keyed_tenant("alice", 10), {"name": "gate", "api_keys_sha256": [key_digest("unused")],
                                                     "priority": 3, "fairness_ids": ["team-x"]}],
              extra={"objectives": [{"name": "batch", "priority": -1}], "access": {"trust_fairness_id": True}})
    try:
        code, _ = _post(f.url, {"Authorization": "Bearer admin", "x-llm-d-inference-objective": "batch"})
        assert code == 401  # the admin key names no tenant
        assert _post(f.url, {"Authorization": "Bearer alice", "x-llm-d-inference-objective": "batch"})[0] == 200
        assert _post(f.url, {"x-llm-d-inference-fairness-id": "team-x"})[0] == 200
        code, err = _post(f.url, {"Authorization": "Bearer alice", "x-llm-d-inference-objective": "vip"})
        assert code == 400 and err["error"]["param"] == "x-llm-d-inference-objective"
        decisions = f.call(lambda: dict(f.gateway.core.stats.decisions))
        assert decisions[("admitted", "-", "-", "alice", -1)] == 1  # alice's request, in the objective's band
        assert decisions[("admitted", "-", "-", "gate", 3)] == 1  # the keyless one, its fairness id's tenant
    finally:
        f.close()
