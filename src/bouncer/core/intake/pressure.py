"""Pressure from outside the cluster: a polled number (grid carbon intensity, an energy price)
that sheds configured bands or tenants while it is high.

The shell polls each signal's source and reports what it read with the time the value is from
(`PressureSignal.observe`); the core only compares. While the value is above `shed_above`, the
signal is high and new requests of the bands and tenants it names are refused at the precheck,
before anything is tokenized; it stays high until the value falls below `resume_below`, so a
value hovering at the threshold does not flap. A value older than `stale_s` (or none yet, before
the first poll) is stale, and then `on_stale` decides: fail-open sheds nothing, fail-closed sheds
as if high. Cognitora's carbon gate does the same with a single threshold, failing open until its
first successful poll.
"""

from __future__ import annotations

from bouncer.config import Pressure, Tenant
from bouncer.core.outcomes import Layer, Reason, Refusal


class PressureSignal:
    def __init__(self, cfg: Pressure) -> None:
        self.cfg = cfg
        self.value: float | None = None
        self.at: float | None = None  # when the value is from
        self.high = False

    def reconfigure(self, cfg: Pressure) -> None:
        """New thresholds keep the last value, judged again by them."""
        self.cfg = cfg
        if self.value is not None:
            self.high = False
            self._judge(self.value)

    def observe(self, value: float, at: float) -> None:
        if self.at is not None and at < self.at:
            return  # older than what is held
        self.value, self.at = value, at
        self._judge(value)

    def _judge(self, value: float) -> None:
        cfg = self.cfg
        if value > cfg.shed_above:
            self.high = True
        elif value < (cfg.shed_above if cfg.resume_below is None else cfg.resume_below):
            self.high = False

    def stale(self, now: float) -> bool:
        return self.at is None or now - self.at > self.cfg.stale_s

    def shedding(self, now: float) -> bool:
        if self.stale(now):
            return self.cfg.on_stale == "fail-closed"
        return self.high

    def sheds(self, tenant: Tenant) -> bool:
        return tenant.priority in self.cfg.bands or tenant.name in self.cfg.tenants

    def refusal(self, tenant: Tenant, now: float) -> Refusal | None:
        if not self.sheds(tenant) or not self.shedding(now):
            return None
        cfg = self.cfg
        why = (f"{cfg.name} is {self.value:g}, above {cfg.shed_above:g}" if not self.stale(now)
               else f"{cfg.name} has no fresh value (on_stale: fail-closed)")
        # the value can change at the next poll at the earliest
        return Refusal(Layer.FLOW, Reason.OUTSIDE_PRESSURE, f"tenant {tenant.name!r} is shed while {why}", cfg.poll_s)


def pressure_refusal(signals: dict[str, PressureSignal], tenant: Tenant, now: float) -> Refusal | None:
    for signal in signals.values():
        refusal = signal.refusal(tenant, now)
        if refusal is not None:
            return refusal
    return None


def reconfigured(signals: dict[str, PressureSignal], configs: list[Pressure]) -> dict[str, PressureSignal]:
    """The signals of a new config: a signal that keeps its name keeps its last value."""
    out = {}
    for cfg in configs:
        signal = signals.get(cfg.name)
        if signal is None:
            signal = PressureSignal(cfg)
        else:
            signal.reconfigure(cfg)
        out[cfg.name] = signal
    return out
