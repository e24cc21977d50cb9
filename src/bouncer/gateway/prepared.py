"""What a validated config still needs before the gateway can run it: files loaded, keys indexed.

The config's schema (`bouncer.config`) checks shapes and values; this checks what only the
machine can tell, chiefly that every tokenizer file exists and loads (and, with tracing on, that
its exporter's modules are whole). `bouncer config check`,
`bouncer serve` and `/admin/reload` all go through `prepare`, so a file that passes the check
also starts and reloads; a reload builds all of this before it swaps anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bouncer.config import BouncerConfig, ConfigError, ModelConfig
from bouncer.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class Prepared:
    config: BouncerConfig
    models: dict[str, ModelConfig]
    tokenizers: dict[str, PromptTokenizer | None]  # None: the stated estimate (no tokenizer configured)
    admin_keys: frozenset[str]
    metrics_keys: frozenset[str]  # keys that may read /metrics (admin keys may too); empty: anyone
    viewer_keys: frozenset[str]  # keys that may read the flight recorder (admin keys may too)


Front = Literal["proxy", "picker"]


def check_front(config: BouncerConfig, front: Front, source: str = "config") -> None:
    """What a front cannot do with a config, refused at start and at every reload alike."""
    if front != "picker":
        return
    problems = []
    if any(b.role != "both" for m in config.models for b in m.backends):
        problems.append("the endpoint picker cannot serve a disaggregated model (Envoy sends a request to one "
                        "replica; the prefill hop needs the proxy)")
    if any(m.overflow for m in config.models):
        problems.append("the endpoint picker cannot divert to overflow targets (Envoy sends the request's body "
                        "unchanged to the endpoint picked; the model name and key an overflow needs take the proxy)")
    if problems:
        raise ConfigError("\n".join([f"{source}: invalid configuration", *(f"  {p}" for p in problems)]))


def check_reload(running: BouncerConfig, config: BouncerConfig) -> None:
    """What a reload may not change (it takes a restart): where shared state, traces and spend go,
    and where an overflow target's API key is sent. A key read from the environment goes only to
    the URL start-up sent it to: an admin key can change the config, not send the process's
    secrets elsewhere."""
    if config.shared_state != running.shared_state:
        raise ConfigError("shared_state changed: that takes a restart (the gateway's state moves)")
    if config.tracing != running.tracing:
        raise ConfigError("tracing changed: that takes a restart")
    if (config.quotas is None) != (running.quotas is None) or (
            config.quotas is not None and running.quotas is not None
            and (config.quotas.url, config.quotas.key_prefix) != (running.quotas.url, running.quotas.key_prefix)):
        raise ConfigError("quotas added, removed or moved to another store: that takes a restart")
    sent = {(o.api_key_env, o.url) for m in running.models for o in m.overflow if o.api_key_env}
    for m in config.models:
        for o in m.overflow:
            if o.api_key_env and (o.api_key_env, o.url) not in sent:
                raise ConfigError(f"model {m.name!r}: overflow target {o.name!r} would send ${o.api_key_env} to "
                                  f"{o.url}, where the running config does not: that takes a restart")


def prepare(config: BouncerConfig, source: str = "config") -> Prepared:
    tokenizers: dict[str, PromptTokenizer | None] = {}
    errors = []
    for i, m in enumerate(config.models):
        if not m.tokenizer:
            tokenizers[m.name] = None
            continue
        try:
            tokenizers[m.name] = PromptTokenizer(m.tokenizer, segment_cache=m.tokenizer_cache_tokens > 0,
                                                 segment_cache_tokens=m.tokenizer_cache_tokens)
        except ValueError as exc:
            errors.append(f"  models.{i}.tokenizer: {exc}")
    if config.tracing is not None:
        from bouncer.gateway.tracing import protos_overwritten  # the SDK only where tracing is on

        if (why := protos_overwritten()) is not None:
            errors.append(f"  {why}")
    if errors:
        raise ConfigError("\n".join([f"{source}: invalid configuration", *errors]))
    admin = frozenset(config.admin_keys_sha256)
    return Prepared(config, {m.name: m for m in config.models}, tokenizers, admin,
                    frozenset(config.access.metrics_keys_sha256), frozenset(config.access.viewer_keys_sha256))
