"""Replicas found while the gateway runs: a model's `discovery:`, from DNS records or a watched file.

A Kubernetes Deployment's pods come and go (an autoscaler adds one, a node drains, a pod is
rescheduled to a new IP); a headless Service publishes the ready ones as DNS records, and a
ConfigMap mounted as a file can list them too. One `Finder` per discovered model looks them up
every `interval_s` and hands a set that differs from the last to the control plane, which syncs
the core's replicas (`AdmissionCore.set_backends`): a new one is scraped and gets work once its
telemetry is fresh, a gone one finishes what it holds and gets nothing new.

A lookup that fails (a timeout, a resolver down, a file that does not parse) or finds nothing
keeps the last known set for `keep_last_s`: a DNS hiccup must not empty a healthy pool, and a
pool really gone is noticed anyway, by its scrapes failing. Past that the model has no replicas.
Either way it is logged once per episode, counted, and shown in `/admin/state` and
`bouncer_discovery_stale`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.resolver
import yaml
from pydantic import ValidationError
from yarl import URL

from bouncer.config import Backend, BouncerConfig, Discovery, ModelConfig

log = logging.getLogger("bouncer.gateway")

LOOKUP_TIMEOUT_S = 5.0  # one lookup's limit (and less, for a shorter interval)
RETRY_FIRST_S = 0.5  # after a failure the next lookup comes sooner: 0.5 s, doubling up to interval_s
FILE_SETTLE_S = 0.05  # a file that changed is read again this much later, and believed if the same


class LookupFailed(Exception):
    """A lookup that gave no answer to trust; its message says why, for the log and /admin/state."""


@dataclass
class FinderStatus:
    """What a finder has done, for `/admin/state` and the metrics."""

    source: str
    replicas: int = 0  # in force now
    lookups: int = 0
    failures: int = 0  # lookups that failed or found nothing
    changes: int = 0  # times the set in force changed
    stale_since: float | None = None  # the first of the failed lookups in a row: the last set is kept since
    last_error: str | None = None

    def as_dict(self, now: float) -> dict:
        return {"source": self.source, "replicas": self.replicas, "lookups": self.lookups, "failures": self.failures,
                "changes": self.changes, "stale": self.stale_since is not None,
                "stale_for_s": None if self.stale_since is None else round(now - self.stale_since, 3),
                "last_error": self.last_error}


def _host_port(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass  # a name
    return f"{host}:{port}"


def found_backend(model: str, d: Discovery, url: str, **fields) -> Backend:
    """A found replica: the discovery's per-replica settings, then what the source says of it.
    Its name, `MODEL/HOST:PORT`, stays the same while it does: a list index would rename every
    replica after a gone one."""
    b = Backend(url=url, **{"kv_blocks": d.kv_blocks, "kv_cache_gb": d.kv_cache_gb,
                            "kv_offload_blocks": d.kv_offload_blocks, "kv_events_topic": d.kv_events_topic, **fields})
    host, port = _url_host_port(b.url)
    updates: dict = {}
    if b.name is None:
        updates["name"] = f"{model}/{_host_port(host, port)}"
    if b.kv_events is None and d.kv_events_port is not None:
        updates["kv_events"] = f"tcp://{_host_port(host, d.kv_events_port)}"
    return b.model_copy(update=updates) if updates else b


def _url_host_port(url: str) -> tuple[str, int]:
    u = URL(url)
    return u.host or "", u.port or (443 if u.scheme == "https" else 80)


# -- the sources -------------------------------------------------------------------------------
async def lookup_dns(model: str, d: Discovery, timeout: float) -> list[Backend]:
    cfg = d.dns
    assert cfg is not None
    resolver = dns.asyncresolver.Resolver(configure=cfg.server is None)
    if cfg.server is not None:
        host, sep, port = cfg.server.rpartition(":")
        if not sep or host.count(":") and not host.startswith("["):  # a bare IPv6 address, no port
            host, port = cfg.server, "53"
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port)
    try:
        answer = await resolver.resolve(cfg.name, cfg.record, lifetime=timeout, search=True)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return []  # no such records: an empty answer (the caller keeps the last set a while)
    except dns.exception.DNSException as exc:
        raise LookupFailed(f"{cfg.record} {cfg.name}: {type(exc).__name__}: {exc}") from None
    if cfg.record != "SRV":
        return [found_backend(model, d, f"{cfg.scheme}://{_host_port(a, cfg.port)}")  # type: ignore[arg-type]
                for a in sorted({r.address for r in answer})]
    # SRV: each target's address from the same resolver (the gateway's own may not know the
    # name); the replica keeps the target's name, `MODEL/TARGET:PORT`
    targets = sorted({(r.target.to_text(omit_final_dot=True), r.port) for r in answer})
    addresses = await asyncio.gather(*(_address(resolver, t, timeout) for t, _ in targets))
    return [found_backend(model, d, f"{cfg.scheme}://{_host_port(a, p)}", name=f"{model}/{_host_port(t, p)}")
            for (t, p), a in zip(targets, addresses, strict=True)]


async def _address(resolver: dns.asyncresolver.Resolver, name: str, timeout: float) -> str:
    """An SRV target's address: its A record, else its AAAA."""
    for record in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, record, lifetime=timeout)
            return min(r.address for r in answer)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except dns.exception.DNSException as exc:
            raise LookupFailed(f"SRV target {name}: {type(exc).__name__}: {exc}") from None
    raise LookupFailed(f"SRV target {name} has no A or AAAA record")


def lookup_file(model: str, d: Discovery) -> list[Backend]:
    cfg = d.file
    assert cfg is not None
    try:
        data = yaml.safe_load(Path(cfg.path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise LookupFailed(f"{cfg.path}: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise LookupFailed(f"{cfg.path}: the top level must be a list (URLs, backend mappings or file_sd groups)")
    found: dict[str, Backend] = {}
    for i, entry in enumerate(data):
        try:
            if isinstance(entry, str):
                backends = [found_backend(model, d, entry)]
            elif isinstance(entry, dict) and "targets" in entry:  # Prometheus file_sd: host:port targets
                targets = entry["targets"]
                if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                    raise LookupFailed(f"{cfg.path}: entry {i}: targets must be a list of host:port")
                backends = [found_backend(model, d, f"{cfg.scheme}://{t}") for t in targets]
            elif isinstance(entry, dict):
                fields = dict(entry)
                url = fields.pop("url", None)
                if not isinstance(url, str):
                    raise LookupFailed(f"{cfg.path}: entry {i}: a mapping needs a url (or file_sd's targets)")
                if fields.get("role", "both") != "both":
                    raise LookupFailed(f"{cfg.path}: entry {i}: found replicas serve whole requests (role both)")
                backends = [found_backend(model, d, url, **fields)]
            else:
                raise LookupFailed(f"{cfg.path}: entry {i}: a URL, a backend mapping or a file_sd group")
        except ValidationError as exc:
            errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'url'}: {e['msg']}" for e in exc.errors())
            raise LookupFailed(f"{cfg.path}: entry {i}: {errors}") from None
        for b in backends:
            if b.name in found and found[b.name] != b:
                raise LookupFailed(f"{cfg.path}: replica {b.name} is listed twice, differently")
            found[b.name] = b  # type: ignore[index]
    return sorted(found.values(), key=lambda b: b.name or "")


# -- one model's finder ------------------------------------------------------------------------
class Finder:
    """Looks up one model's replicas until cancelled; `on_change` gets each new set in force."""

    def __init__(self, model: ModelConfig, on_change: Callable[[list[Backend]], None],
                 clock: Callable[[], float], current: list[Backend] | None = None) -> None:
        assert model.discovery is not None
        self.model = model.name
        self.discovery = model.discovery
        self.on_change = on_change
        self.clock = clock
        # the set in force: None until a lookup found one (a reload hands over its predecessor's)
        self.current = current
        self.status = FinderStatus(model.discovery.source, replicas=len(current or ()))

    async def lookup(self) -> list[Backend]:
        d = self.discovery
        timeout = min(LOOKUP_TIMEOUT_S, max(1.0, d.interval_s))
        if d.dns is not None:
            return await lookup_dns(self.model, d, timeout)
        found = await asyncio.to_thread(lookup_file, self.model, d)  # a mounted volume may be slow
        if found != self.current:
            # a file written in place (not renamed over) can be read half-written, and a list cut
            # short still parses: a change counts once a second read, a moment later, agrees
            await asyncio.sleep(min(FILE_SETTLE_S, d.interval_s / 2))
            if await asyncio.to_thread(lookup_file, self.model, d) != found:
                raise LookupFailed(f"{d.file.path} changed as it was read: read again at the next lookup")  # type: ignore[union-attr]
        return found

    async def once(self) -> bool:
        """One lookup, acted on; True when it gave an answer to trust."""
        s = self.status
        s.lookups += 1
        try:
            found = await self.lookup()
            error = None if found else "the lookup found no replicas"
        except LookupFailed as exc:
            found, error = [], str(exc)
        now = self.clock()
        if error is None:
            if s.stale_since is not None:
                log.info("replicas found again", extra={"event": "discovery", "model": self.model,
                                                        "source": s.source, "replicas": len(found)})
            s.stale_since, s.last_error = None, None
            self._put(found)
            return True
        s.failures += 1
        s.last_error = error
        if s.stale_since is None:
            s.stale_since = now
            log.warning("discovery failed: the last known replicas are kept" if self.current else
                        "discovery failed: no replicas known yet", extra={
                "event": "discovery", "model": self.model, "source": s.source, "error": error,
                "replicas": len(self.current or ()), "keep_last_s": self.discovery.keep_last_s})
        if self.current and now - s.stale_since >= self.discovery.keep_last_s:
            log.error("discovery failed for longer than keep_last_s: the model has no replicas now", extra={
                "event": "discovery", "model": self.model, "source": s.source, "error": error,
                "dropped": len(self.current)})
            self._put([])
        return False

    def _put(self, found: list[Backend]) -> None:
        if found == self.current:
            return
        before = {b.name for b in self.current or ()}
        after = {b.name for b in found}
        self.current = found
        self.status.replicas = len(found)
        self.status.changes += 1
        log.info("replicas changed", extra={"event": "discovery", "model": self.model, "source": self.status.source,
                                            "added": sorted(after - before), "removed": sorted(before - after),
                                            "replicas": len(found)})
        self.on_change(found)

    async def run(self, first: bool | None = None) -> None:
        """Look up every interval_s; after a failure sooner (0.5 s, doubling up to the interval).
        `first`: what a lookup made just before (`once`) gave, else one is made now."""
        ok = await self.once() if first is None else first
        retry = RETRY_FIRST_S
        while True:
            if ok:
                retry, wait = RETRY_FIRST_S, self.discovery.interval_s
            else:
                wait = min(retry, self.discovery.interval_s)
                retry *= 2
            await asyncio.sleep(wait)
            ok = await self.once()


class Finders:
    """Every discovered model's finder, kept as the config in force says: one per model with
    `discovery:`, replaced when its settings change (the new one keeping the set the old one
    found until it finds one). `on_found(model, backends)` gets each new set."""

    def __init__(self, on_found: Callable[[str, list[Backend]], None], clock: Callable[[], float]) -> None:
        self.on_found = on_found
        self.clock = clock
        self.by_model: dict[str, tuple[Finder, asyncio.Task | None]] = {}

    async def start(self, config: BouncerConfig) -> None:
        """At start: each finder's first lookup before the gateway serves, so that it starts
        with its replicas; then their loops."""
        new = self._sync(config)
        self._run(new, list(await asyncio.gather(*(f.once() for f in new))))

    def follow(self, config: BouncerConfig) -> None:
        """A reloaded config (already `held`): finders started, replaced or stopped to match."""
        self._run(self._sync(config))

    def held(self, config: BouncerConfig) -> BouncerConfig:
        """`config` with the replicas its discovered models' finders hold (a file lists none)."""
        for m in config.models:
            finder = self.by_model.get(m.name, (None, None))[0]
            if m.discovery is not None and finder is not None and finder.current is not None:
                config = config.with_model(m.with_backends(finder.current))
        return config

    async def stop(self) -> None:
        tasks = [task for _, task in self.by_model.values() if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _sync(self, config: BouncerConfig) -> list[Finder]:
        wanted = {m.name: m for m in config.models if m.discovery is not None}
        for name, (finder, task) in list(self.by_model.items()):
            if name not in wanted or wanted[name].discovery != finder.discovery:
                if task is not None:
                    task.cancel()
                del self.by_model[name]
        new = []
        for name, m in wanted.items():
            if name not in self.by_model:
                finder = Finder(m, lambda found, name=name: self.on_found(name, found), self.clock,
                                list(m.backends) if m.backends else None)
                self.by_model[name] = (finder, None)
                new.append(finder)
        return new

    def _run(self, new: list[Finder], firsts: list[bool] | None = None) -> None:
        loop = asyncio.get_running_loop()
        for i, finder in enumerate(new):
            self.by_model[finder.model] = (finder, loop.create_task(finder.run(None if firsts is None else firsts[i])))
