"""The tenants a core knows, as the config last named them, and what it keeps per tenant.

- each tenant's cache salt (`fleet.cache_salt`);
- who a request is: its API key's digest names a tenant, or a fairness id a trusted gateway set
  (`access.trust_fairness_id`), or the configured default tenant takes it (`identify`);
- each tenant's circuit breaker, kept across reloads that leave its settings alone;
- each tenant's output lengths as learned per model (`feedback.expected_output` reads them);
- its rate limits, configured in the rate-limit store (which keeps their levels);
- whether it is demoted past its quota, until when (`intake.quota.Demotions`).

The dicts are shared by reference with the parts that read them (the finaliser reads the
breakers, placement the tenants): a reload refills them in place.
"""

from __future__ import annotations

from bouncer.config import BouncerConfig, Tenant
from bouncer.core.fleet.cache_salt import salt_of, salt_root
from bouncer.core.intake.breaker import CircuitBreaker
from bouncer.core.intake.quota import Demotions
from bouncer.core.intake.rate_limit import RateLimitStore
from bouncer.core.learning.output_length import OutputLengthModel


class TenantBook:
    def __init__(self, rate_limits: RateLimitStore) -> None:
        self.by_name: dict[str, Tenant] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.output_models: dict[str, dict[str, OutputLengthModel]] = {}  # tenant -> model -> learned lengths
        self._by_key: dict[str, Tenant] = {}
        self._default: Tenant | None = None
        self._rate_limits = rate_limits
        self.demotions = Demotions()  # tenants past their quota, demoted (`intake.quota`)

    def reconfigure(self, config: BouncerConfig, now: float) -> None:
        """The config's tenants. A tenant's breaker restarts only when its settings change, its
        learned output lengths never (a tenant named again keeps them)."""
        self._by_key = config.tenant_by_key()
        # a client's header is its own word: only a gateway that authenticates may name a tenant by it
        self._by_fairness_id = {f: t for t in config.tenants for f in t.fairness_ids} \
            if config.access.trust_fairness_id else {}
        self._objectives = {o.name: o.priority for o in config.objectives}
        self._default = next((t for t in config.tenants if t.name == config.default_tenant), None)
        # each tenant's cache salt, and the root it mixes into block digests (`fleet.cache_salt`)
        self.cache_salts = {t.name: salt_of(t.cache_group or t.name) for t in config.tenants} \
            if config.cache_isolation else {}
        self.salt_roots = {name: salt_root(salt) for name, salt in self.cache_salts.items()}
        b = config.policy.breaker
        self.by_name.clear()
        for t in config.tenants:
            self.by_name[t.name] = t
            self._rate_limits.configure(t.name, t.rate_limit, now)
            current = self.breakers.get(t.name)
            if current is None or (current.threshold, current.window_s, current.open_s) != (b.failures, b.window_s,
                                                                                            b.open_s):
                self.breakers[t.name] = CircuitBreaker(b.failures, b.window_s, b.open_s)
            self.output_models.setdefault(t.name, {})

    def identify(self, key_digest: str | None, fairness_id: str | None = None) -> Tenant | None:
        """The tenant a request's API key (its SHA-256) names, else the one its fairness id
        names (`Tenant.fairness_ids`, where the config trusts the header), else the default
        tenant, if any."""
        return (self._by_key.get(key_digest) if key_digest else None) or \
            (self._by_fairness_id.get(fairness_id) if fairness_id else None) or self._default

    def as_asked(self, t: Tenant, objective: str | None) -> Tenant | None:
        """`t` in the band its request's objective asks, where that is lower than its own (an
        objective never raises one); None for an objective the config does not list."""
        if objective is None:
            return t
        priority = self._objectives.get(objective)
        if priority is None:
            return None
        return t if priority >= t.priority else t.model_copy(update={"priority": priority})

    def get(self, name: str) -> Tenant | None:
        return self.by_name.get(name)

    def weight(self, name: str) -> float:
        """Its fair-share weight; 1 for a tenant no longer configured (its requests still finish)."""
        t = self.by_name.get(name)
        return t.weight if t is not None else 1.0
