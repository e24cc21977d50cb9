"""Small configs and drivers for testing the admission core with explicit time."""

from __future__ import annotations

import itertools

from bouncer.config import key_digest, parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Dispatch, Reject
from bouncer.core.requests import RequestInfo

_ids = itertools.count()


def tenant(name: str, priority: int = 0, **kw) -> dict:
    return {"name": name, "api_keys_sha256": [key_digest(f"key-{name}")], "priority": priority, **kw}


def make_config(tenants: list[dict] | None = None, replicas: int = 2, kv_blocks: int = 1000, policy=None,
                max_model_len: int = 8192, limits=None, model: dict | None = None) -> dict:
    """`model`: more settings of the one model, `m`."""
    return {
        "tenants": tenants or [tenant("a")],
        "models": [{"name": "m", "max_model_len": max_model_len, "block_size": 16,
                    "backends": [{"url": f"http://127.0.0.1:{9000 + i}", "kv_blocks": kv_blocks}
                                 for i in range(replicas)], **(model or {})}],
        "policy": policy or {},
        **({"limits": limits} if limits else {}),
    }


def make_core(now: float = 0.0, fresh: bool = True, **kw) -> AdmissionCore:
    core = AdmissionCore(parse_config(make_config(**kw)), now)
    if fresh:
        observe_idle(core, now)
    return core


def observe_idle(core: AdmissionCore, now: float, kv_usage: float = 0.0, waiting: int = 0) -> list:
    events = []
    for name in list(core.replicas):
        events += core.observe(name, Telemetry(at=now, kv_usage=kv_usage, running=0, waiting=waiting), now)
    return events


def info(tenant_name: str = "a", prompt: int = 100, max_tokens: int | None = 100, model: str = "m",
         **kw) -> RequestInfo:
    return RequestInfo(request_id=f"r{next(_ids)}", key_digest=key_digest(f"key-{tenant_name}"), model=model,
                       prompt_tokens=prompt, max_tokens=max_tokens, **kw)


def dispatched(events) -> list[Dispatch]:
    return [e for e in events if isinstance(e, Dispatch)]


def rejected(events) -> list[Reject]:
    return [e for e in events if isinstance(e, Reject)]


def admission_of(core: AdmissionCore, d: Dispatch):
    """The admitted request behind a Dispatch event, while it holds its permit (the core's own
    record: for tests of the core's internals)."""
    adm = core.permits.get(d.request_id)
    assert adm is not None, f"{d.request_id} holds no permit"
    return adm
