"""What a validated config still needs before the gateway can run it: files loaded, keys indexed.

The config's schema (`bouncer.config`) checks shapes and values; this checks what only the
machine can tell, chiefly that every tokenizer file exists and loads (and, with tracing on, that
its exporter's modules are whole). `bouncer config check`,
`bouncer serve` and `/admin/reload` all go through `prepare`, so a file that passes the check
also starts and reloads; a reload builds all of this before it swaps anything.
"""

from __future__ import annotations

from dataclasses import dataclass

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
