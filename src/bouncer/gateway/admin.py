"""The gateway's operator endpoints, each behind its keys: `/metrics` (open unless
`access.metrics_keys_sha256`), `/admin/state`, `/admin/drain`, `/admin/undrain`, `/admin/reload`
(admin keys), `/admin/timeline` (admin or viewer keys: the flight recorder).

They read the gateway (its core's view, connections, recorder) and change it only through its
own methods: a drain or undrain through the core, a reload through `ControlPlane.reconfigure`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import yaml
from aiohttp import web
from prometheus_client import generate_latest

from bouncer.config import BouncerConfig, ConfigError, key_digest, load_config, parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.outcomes import Event
from bouncer.gateway.connections import Limits
from bouncer.gateway.errors import plain_error
from bouncer.gateway.metrics import GatewayMetrics
from bouncer.gateway.prepared import Front, Prepared, check_front, check_reload, prepare
from bouncer.gateway.quota_keeper import QuotaKeeper
from bouncer.gateway.recording import GatewayRecorder
from bouncer.openai_wire import dumps
from bouncer.recorder.page import timeline_response


class Served(Protocol):
    """What the admin endpoints read and call of the control plane they serve (`control_plane.ControlPlane`)."""

    config: BouncerConfig
    config_path: str | None
    front: Front
    core: AdmissionCore
    clock: Callable[[], float]
    connections: Limits
    prepared: Prepared
    metrics: GatewayMetrics
    recorder: GatewayRecorder
    quotas: QuotaKeeper | None

    @property
    def serving(self) -> int: ...
    def apply(self, events: list[Event]) -> None: ...
    def reconfigure(self, prepared: Prepared) -> None: ...

log = logging.getLogger("bouncer.gateway")


def _key_denied(request: web.Request, allowed: frozenset[str]) -> web.Response | None:
    auth = request.headers.get("Authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not key or key_digest(key) not in allowed:
        return plain_error(401, "a key allowed here is required", "authentication_error", "unauthenticated")
    return None


class Admin:
    def __init__(self, gateway: Served) -> None:
        self.gw = gateway

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/admin/state", self.handle_state)
        app.router.add_post("/admin/drain", self.handle_drain)
        app.router.add_post("/admin/undrain", self.handle_undrain)
        app.router.add_post("/admin/reload", self.handle_reload)
        app.router.add_get("/admin/timeline", self.handle_timeline)

    # -- who may -----------------------------------------------------------------------------------
    def _admin_denied(self, request: web.Request) -> web.Response | None:
        admin_keys = self.gw.prepared.admin_keys
        if not admin_keys:
            return plain_error(403, "admin endpoints are disabled (no admin_keys_sha256)", "permission_error",
                               "admin_disabled")
        return _key_denied(request, admin_keys)

    def _viewer_denied(self, request: web.Request) -> web.Response | None:
        allowed = self.gw.prepared.admin_keys | self.gw.prepared.viewer_keys
        if not allowed:
            return plain_error(403, "the flight recorder is not readable (no admin_keys_sha256 or "
                               "access.viewer_keys_sha256)", "permission_error", "admin_disabled")
        return _key_denied(request, allowed)

    # -- endpoints ---------------------------------------------------------------------------------
    async def handle_metrics(self, request: web.Request) -> web.Response:
        allowed = self.gw.prepared.metrics_keys
        if allowed and (denied := _key_denied(request, allowed | self.gw.prepared.admin_keys)) is not None:
            return denied
        return web.Response(body=generate_latest(self.gw.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def handle_timeline(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._viewer_denied(request)) is not None:
            return denied
        if not self.gw.config.recorder.enabled:
            return plain_error(404, "the flight recorder is off (recorder.enabled: false)", "not_found_error",
                               "recorder_disabled")
        recorder = self.gw.recorder
        return await timeline_response(request, recorder.timeline, {"live": True, **recorder.stats()})

    async def handle_state(self, request: web.Request) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        gw = self.gw
        snap = gw.core.snapshot(gw.clock())
        snap["serving"] = gw.serving
        for name, (finder, _task) in gw.finders.by_model.items():
            snap["models"][name]["discovery"] = finder.status.as_dict(gw.clock())
        snap["connections"] = {"open": gw.connections.open, "refused": gw.connections.refused,
                               "header_timeouts": gw.connections.header_timeouts}
        if gw.quotas is not None:
            snap["quotas"] = {"lines": gw.quotas.report(), "store_degraded": gw.quotas.degraded,
                              "unsettled": gw.quotas.unsettled}
        return web.Response(body=dumps(snap), content_type="application/json")

    async def _model_from(self, request: web.Request) -> str | web.Response:
        """The model an admin call names (admin keys checked first), or the error answer."""
        if (denied := self._admin_denied(request)) is not None:
            return denied
        model = request.query.get("model")
        if model is None and request.can_read_body:
            try:
                data = await request.json()
            except ValueError:
                data = None
            model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str) or model not in self.gw.prepared.models:
            return plain_error(404, f"unknown model {model!r} (name it in ?model= or a JSON body's \"model\")",
                               "not_found_error", "model_not_found")
        return model

    async def handle_drain(self, request: web.Request) -> web.Response:
        model = await self._model_from(request)
        if isinstance(model, web.Response):
            return model
        self.gw.core.drain(model)
        log.info("model draining", extra={"event": "drain", "model": model})
        return web.json_response({"model": model, "draining": True})

    async def handle_undrain(self, request: web.Request) -> web.Response:
        model = await self._model_from(request)
        if isinstance(model, web.Response):
            return model
        gw = self.gw
        gw.apply(gw.core.undrain(model, gw.clock()))
        log.info("model undrained", extra={"event": "undrain", "model": model})
        return web.json_response({"model": model, "draining": False})

    async def handle_reload(self, request: web.Request) -> web.Response:
        """Apply a new config (YAML or JSON in the body, else the file the gateway started from)
        without dropping queued or in-flight requests. All or nothing: the new config is
        validated and prepared (tokenizers loaded) before anything is swapped."""
        if (denied := self._admin_denied(request)) is not None:
            return denied
        raw = await request.read()
        gw = self.gw
        try:
            if raw.strip():
                data = yaml.safe_load(raw)
                if not isinstance(data, dict):
                    raise ConfigError("reload body: the top level must be a mapping")
                config = parse_config(data, "reload body")
            elif gw.config_path:
                config = load_config(gw.config_path)
            else:
                raise ConfigError("send the new config in the body (no config file to re-read)")
            prepared = prepare(config, "reload")
            check_front(config, gw.front, "reload")  # what start-up refuses, a reload refuses too
            check_reload(gw.config, config)
        except (ConfigError, ValueError, yaml.YAMLError, OSError) as exc:
            log.warning("reload refused", extra={"event": "reload", "ok": False, "error": str(exc)})
            return plain_error(400, str(exc), "invalid_request_error", "invalid_config")
        gw.reconfigure(prepared)
        log.info("config reloaded", extra={"event": "reload", "ok": True, "models": len(config.models),
                                           "tenants": len(config.tenants)})
        return web.json_response({"reloaded": True, "models": list(prepared.models),
                                  "tenants": [t.name for t in config.tenants]})
