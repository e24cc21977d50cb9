"""The parts of a core that its request path and its view read: a narrow, read-mostly interface.

`AdmissionCore` builds these parts and satisfies `CoreParts`; `arrivals` (a new request through
the layers) and `view` (what the shells may read) take a `CoreParts`, not the core itself, so
that the entry points import the path and the view, and neither imports the entry points back.
"""

from __future__ import annotations

from typing import Protocol

from bouncer.config import BouncerConfig, Policy
from bouncer.core.finaliser import CoreStats, Finaliser
from bouncer.core.fleet.permits import PermitStore
from bouncer.core.fleet.placement import Placement
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.dispatch import Dispatcher
from bouncer.core.flow.saturation import SaturationDetector
from bouncer.core.intake.checks import TenantGate
from bouncer.core.intake.pressure import PressureSignal
from bouncer.core.intake.tenant_book import TenantBook
from bouncer.core.model_state import ModelState
from bouncer.core.sharing.peers import FleetShares


class CoreParts(Protocol):
    config: BouncerConfig
    policy: Policy  # config.policy, as last reloaded
    models: dict[str, ModelState]
    replicas: dict[str, ReplicaState]
    tenants: TenantBook
    gate: TenantGate  # breaker, then rate limits
    pressures: dict[str, PressureSignal]
    saturation: SaturationDetector
    placement: Placement
    dispatcher: Dispatcher
    finaliser: Finaliser
    stats: CoreStats
    permits: PermitStore
    shares: FleetShares
