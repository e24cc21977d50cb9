"""One timeline sample from the core: its counters as counts over the step, its state as gauges.

A sample is a plain dict, the same whether the gateway or the simulator took it:

    {"t": seconds (Unix time live, run time in the simulator),
     "counts": {"tenants": {tenant: {"arrived", "admitted", "completed", "slo_met", "slo_total",
                                     "refused:<reason>", "expired:<reason>", ...}}},
     "gauges": {"tenants": {tenant: {"band", "queued", "oldest_wait_s"}},
                "models": {model: {"saturation", "draining", "agents",
                                   "bands": {band: {"queued", "tokens", "ceiling", "oldest_wait_s",
                                                    "ttft_margin"}},
                                   "replicas": {replica: {"kv_usage", "running", "waiting",
                                                          "telemetry_age_s", "inflight", "projected_kv_usage",
                                                          "busy", "healthy", "ttft_factor", "tpot_factor"}}}},
                "inflight", "queued",
                "gateway": {...what only the shell knows: connections, requests being served}}}

Counts sum when samples are merged to a coarser step; gauges keep the last value. A count is
the change of a core counter since the previous sample, so the sampler keeps the counters it last
saw; a request ends under exactly one "<outcome>:<reason>" key (or "completed"), dispatches count
under "admitted".
"""

from __future__ import annotations

from collections import Counter

from bouncer.core.view import CoreView

ENDS_WITH_REASON = ("refused", "expired", "evicted", "cancelled", "failed", "diverted")
NOTES = ("admitted", "demoted", "requeued", "reclaimed")


class Sampler:
    def __init__(self) -> None:
        self._decisions: Counter = Counter()
        self._arrived: Counter = Counter()
        self._slo_met: Counter = Counter()
        self._slo_total: Counter = Counter()

    def sample(self, view: CoreView, now: float, t: float, gateway: dict | None = None) -> dict:
        """`now` is the core's clock; `t` the time the sample is stamped with."""
        stats = view.stats
        counts: dict[str, dict[str, int]] = {}

        def add(tenant: str, key: str, n: int) -> None:
            if n:
                per = counts.setdefault(tenant, {})
                per[key] = per.get(key, 0) + n

        for tenant, n in stats.arrived.items():
            add(tenant, "arrived", n - self._arrived[tenant])
        for (outcome, _layer, reason, tenant, _band), n in stats.decisions.items():
            delta = n - self._decisions[(outcome, _layer, reason, tenant, _band)]
            if not delta:
                continue
            if outcome in ENDS_WITH_REASON:
                add(tenant, f"{outcome}:{reason}", delta)
            else:  # completed, or a note that is not an end
                add(tenant, outcome, delta)
        for tenant, n in stats.slo_total.items():
            add(tenant, "slo_total", n - self._slo_total[tenant])
            add(tenant, "slo_met", stats.slo_met[tenant] - self._slo_met[tenant])
        self._decisions = stats.decisions.copy()
        self._arrived = stats.arrived.copy()
        self._slo_met = stats.slo_met.copy()
        self._slo_total = stats.slo_total.copy()

        snap = view.snapshot(now)
        ages = view.queue_ages(now)
        tenants: dict[str, dict] = {}
        models = {}
        for name, ms in snap["models"].items():
            bands = {}
            for band, b in ms["bands"].items():
                band_ages = ages.get(name, {}).get(band, {})
                margin = ms["ttft_margins"].get(band, {}).get("margin")
                bands[str(band)] = {"queued": b["queued"], "tokens": b["tokens"], "ceiling": b["ceiling"],
                                    "oldest_wait_s": _round(max(band_ages.values(), default=0.0)),
                                    "ttft_margin": margin}
                for tenant, queued in b["tenants"].items():
                    g = tenants.setdefault(tenant, {"queued": 0, "oldest_wait_s": 0.0})
                    g["queued"] += queued
                    g["oldest_wait_s"] = max(g["oldest_wait_s"], _round(band_ages.get(tenant, 0.0)))
            replicas = {}
            for rname, r in ms["replicas"].items():
                scraped = r["scraped"] or {}
                latency = r["latency"] or {}
                replicas[rname] = {"kv_usage": scraped.get("kv_usage"), "running": scraped.get("running"),
                                   "waiting": scraped.get("waiting"), "telemetry_age_s": r["telemetry_age_s"],
                                   "inflight": r["inflight"], "projected_kv_usage": r["projected_kv_usage"],
                                   "busy": r["busy"], "healthy": r["healthy"],
                                   "ttft_factor": latency.get("ttft_factor"), "tpot_factor": latency.get("tpot_factor")}
            models[name] = {"saturation": ms["saturation"], "draining": ms["draining"], "agents": ms["agents"],
                            "bands": bands, "replicas": replicas}
        for tenant, band in view.tenant_bands().items():
            tenants.setdefault(tenant, {"queued": 0, "oldest_wait_s": 0.0})["band"] = band
        gauges = {"tenants": tenants, "models": models, "inflight": snap["inflight"], "queued": snap["queued"]}
        if gateway:
            gauges["gateway"] = gateway
        return {"t": round(t, 3), "counts": {"tenants": counts}, "gauges": gauges}


def _round(seconds: float) -> float:
    return round(seconds, 3)
