"""A gateway in front of real `bouncer engine` servers, all on loopback, for end-to-end tests."""

from __future__ import annotations

from bouncer.config import key_digest
from bouncer.tokenizer import default_tokenizer_path
from conftest import start_engine, start_gateway
from servers import poll_until


def tenant(name: str, priority: int = 0, **kw) -> dict:
    return {"name": name, "api_keys_sha256": [key_digest(name)], "priority": priority, **kw}


class Fleet:
    """Engines + gateway. `key` for a tenant is its name."""

    def __init__(self, bg_loop, tenants: list[dict], engines: int = 1, policy: dict | None = None,
                 engine_kwargs: dict | None = None, speed: float = 1.0, limits: dict | None = None,
                 admin_key: str | None = "admin", model: dict | None = None, extra: dict | None = None):
        self.bg_loop = bg_loop
        self.engines = []
        self._cleanups = []
        for _ in range(engines):
            base, server, cleanup = start_engine(bg_loop, speed=speed, **(engine_kwargs or {}))
            self.engines.append((base, server))
            self._cleanups.append(cleanup)
        config = {
            "admin_keys_sha256": [key_digest(admin_key)] if admin_key else [],
            "tenants": tenants,
            "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                        "max_model_len": 8192,
                        "backends": [{"url": base, "name": f"e{i}"} for i, (base, _) in enumerate(self.engines)],
                        **(model or {})}],
            "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}, **(policy or {})},
        }
        if limits:
            config["limits"] = limits
        config.update(extra or {})  # more top-level settings (objectives, say)
        self.config = config
        self.url, self.gateway, cleanup = start_gateway(bg_loop, config)
        self._cleanups.append(cleanup)
        # wait until every replica has been scraped once, so the core sees a fresh fleet
        poll_until(lambda: self.call(lambda: all(r.telemetry is not None for r in self.gateway.core.replicas.values())),
                   what="first scrape")

    def call(self, fn):
        return self.bg_loop.call(fn)

    def close(self):
        for cleanup in reversed(self._cleanups):
            cleanup()
