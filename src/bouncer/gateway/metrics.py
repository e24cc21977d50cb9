"""The gateway's Prometheus metrics.

Counters and gauges that mirror core state are read from the core at scrape time (one source
of truth, nothing to keep in sync); latency histograms are observed by the shell as requests
move. Goodput, the number operators alert on, is `bouncer_slo_met_total / bouncer_slo_requests_total`
per tenant, also exported as `bouncer_slo_attainment_ratio`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bouncer.core.admission import AdmissionCore

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class _CoreCollector:
    """Read from the core at scrape time. Decisions and outcomes, queues, saturation, agents,
    each replica's state, KV events and goodput."""

    def __init__(self, core_ref: Callable[[], AdmissionCore], clock: Callable[[], float],
                 kv_event_stats: Callable[[], dict], connections: Callable[[], object | None]) -> None:
        self.core_ref = core_ref
        self.clock = clock
        self.kv_event_stats = kv_event_stats
        self.connections = connections

    def collect(self):
        view = self.core_ref().view
        snap = view.snapshot(self.clock())
        yield from self._counts(view, snap)
        yield from self._listener(view)
        yield from self._models(snap)
        yield from self._learning(snap)
        yield from self._replicas(snap)
        yield from self._kv_events()
        yield from self._slos(view)

    def _counts(self, view, snap):
        """What was decided and served: decisions, arrivals, tokens, permits."""
        stats = view.stats
        decisions = CounterMetricFamily(
            "bouncer_decisions", "Admission decisions and terminal outcomes by layer and reason.",
            labels=["outcome", "layer", "reason", "tenant", "band"])
        for (outcome, layer, reason, tenant, band), n in sorted(stats.decisions.items(), key=str):
            decisions.add_metric([outcome, layer, reason, tenant, "-" if band is None else str(band)], n)
        yield decisions
        yield CounterMetricFamily("bouncer_offered_requests", "Requests offered to admission.", value=stats.offered)
        arrivals = CounterMetricFamily("bouncer_arrivals", "Requests offered to admission, by tenant and its band "
                                       "(tenant \"-\": no valid key).", labels=["tenant", "band"])
        bands = view.tenant_bands()
        for tenant, n in sorted(stats.arrived.items()):
            arrivals.add_metric([tenant, str(bands[tenant]) if tenant in bands else "-"], n)
        yield arrivals
        served = CounterMetricFamily("bouncer_served_tokens", "Prompt and output tokens of completed requests, by "
                                     "tenant (fair shares are its rate over the sum).", labels=["tenant"])
        for tenant, n in sorted(stats.served_tokens.items()):
            served.add_metric([tenant], n)
        yield served
        yield GaugeMetricFamily("bouncer_inflight_requests", "Admitted requests holding a permit.",
                                value=snap["inflight"])
        yield CounterMetricFamily("bouncer_permits_reclaimed", "Permits taken back after their lease ran out "
                                  "unrenewed (each one a request the gateway lost track of).", value=stats.reclaimed)

    def _listener(self, view):
        """The client connections, and the outside pressure signals."""
        conns = self.connections()
        if conns is not None:
            yield GaugeMetricFamily("bouncer_connections_open", "Open client connections.", value=conns.open)
            yield CounterMetricFamily("bouncer_connections_refused", "Connections refused over listen.max_connections.",
                                      value=conns.refused)
            yield CounterMetricFamily("bouncer_header_timeouts", "Connections closed for headers that came too slowly.",
                                      value=conns.header_timeouts)
        signals = view.pressures(self.clock())
        if signals:
            value = GaugeMetricFamily("bouncer_pressure_value", "An outside signal's last value.", labels=["signal"])
            age = GaugeMetricFamily("bouncer_pressure_age_seconds", "How old the signal's last value is.",
                                    labels=["signal"])
            shedding = GaugeMetricFamily("bouncer_pressure_shedding", "1 while the signal sheds its bands and "
                                         "tenants (high, or stale with on_stale: fail-closed).", labels=["signal"])
            for name, v, a, shed in signals:
                if v is not None:
                    value.add_metric([name], v)
                    age.add_metric([name], a)
                shedding.add_metric([name], int(shed))
            yield value
            yield age
            yield shedding

    def _models(self, snap):
        """Each model's waiting room, saturation, agents and demand."""
        depth = GaugeMetricFamily("bouncer_queue_depth", "Queued requests.", labels=["model", "band"])
        queued_tokens = GaugeMetricFamily("bouncer_queue_tokens", "Queued prompt tokens.", labels=["model", "band"])
        sat = GaugeMetricFamily("bouncer_saturation", "Fleet saturation (>= 1 saturated).", labels=["model"])
        band_ceiling = GaugeMetricFamily("bouncer_band_ceiling", "The saturation under which a band dispatches.",
                                         labels=["model", "band"])
        draining = GaugeMetricFamily("bouncer_model_draining", "1 while a model is draining.", labels=["model"])
        agent_window = GaugeMetricFamily("bouncer_agent_window", "Active agents allowed (AIMD window).",
                                         labels=["model"])
        active_agents = GaugeMetricFamily("bouncer_active_agents", "Agents (sessions) active now, each holding a slot "
                                          "of the window (at every gateway sharing state).", labels=["model"])
        agents_elsewhere = GaugeMetricFamily("bouncer_active_agents_elsewhere", "Of bouncer_active_agents, those "
                                             "holding their slot only at other gateways.", labels=["model"])
        active_subagents = GaugeMetricFamily("bouncer_active_subagents", "Subagents (x-parent-session-id) active now, "
                                             "in their parents' slots.", labels=["model"])
        demand = GaugeMetricFamily("bouncer_demand_replicas", "Replicas the model's offered traffic needs "
                                   "(refused requests included, each counted once), from the step time: what an "
                                   "autoscaler should provide; scope protected: the bands >= 0 alone. Sum over "
                                   "gateways.", labels=["model", "scope"])
        offered = GaugeMetricFamily("bouncer_demand_offered_rps", "First attempts per second reaching the model, "
                                    "averaged over demand.window_s (the demand signal's rate).",
                                    labels=["model", "scope"])
        cost = GaugeMetricFamily("bouncer_demand_cost_seconds", "Engine-seconds one replica spends per request of "
                                 "the offered mix, at full batch (the demand signal's price).",
                                 labels=["model", "scope"])
        batch = GaugeMetricFamily("bouncer_demand_batch", "The batch a replica runs at full load on the offered mix "
                                  "(max_num_seqs, or what its KV cache or the TPOT SLO allows).",
                                  labels=["model", "scope"])
        mix = GaugeMetricFamily("bouncer_demand_tokens", "The offered mix's mean prompt and output tokens.",
                                labels=["model", "scope", "kind"])
        hits = GaugeMetricFamily("bouncer_demand_prefix_hit_rate", "Share of dispatched prompt tokens found in the "
                                 "prefix cache (their prefill costs nothing).", labels=["model"])
        for name, ms in snap["models"].items():
            for scope, est in ms["demand"].items():
                demand.add_metric([name, scope], est["replicas"])
                offered.add_metric([name, scope], est["offered_rps"])
                cost.add_metric([name, scope], est["cost_s"])
                batch.add_metric([name, scope], est["batch"])
                mix.add_metric([name, scope, "prompt"], est["prompt_tokens"])
                mix.add_metric([name, scope, "output"], est["output_tokens"])
            hits.add_metric([name], ms["demand"]["all"]["prefix_hit_rate"])
            for band, b in ms["bands"].items():
                depth.add_metric([name, str(band)], b["queued"])
                queued_tokens.add_metric([name, str(band)], b["tokens"])
                band_ceiling.add_metric([name, str(band)], b["ceiling"])
            sat.add_metric([name], ms["saturation"])
            draining.add_metric([name], 1.0 if ms["draining"] else 0.0)
            if ms["agents"] is not None:
                agent_window.add_metric([name], ms["agents"]["window"])
                active_agents.add_metric([name], ms["agents"]["active"])
                agents_elsewhere.add_metric([name], ms["agents"]["active_elsewhere"])
                active_subagents.add_metric([name], ms["agents"]["subagents"])
        yield from (demand, offered, cost, batch, mix, hits)
        yield depth
        yield queued_tokens
        yield sat
        yield band_ceiling
        yield draining
        yield agent_window
        yield active_agents
        yield agents_elsewhere
        yield active_subagents

    def _learning(self, snap):
        """What each model has learnt of its engines: step time, TTFT margins."""
        step = GaugeMetricFamily("bouncer_model_step_time_coefficient",
                                 "The engine step-time model the core predicts with (a: s per step, b: s per batched "
                                 "token, c: s per context token, d: s per attention pair): given, or learned.",
                                 labels=["model", "coefficient", "source"])
        for name, ms in snap["models"].items():
            st = ms["step_time"]
            for coefficient, value in (st.get("coefficients") or {}).items():
                step.add_metric([name, coefficient, st["mode"]], value)
        yield step
        margin = GaugeMetricFamily("bouncer_ttft_margin", "What a band's predicted TTFTs are multiplied by to plan "
                                   "its waits and dispatches with: the p90 of its observed / predicted TTFT "
                                   "(absent until 32 first tokens are in).", labels=["model", "band"])
        for name, ms in snap["models"].items():
            for band, m in ms["ttft_margins"].items():
                if m["margin"] is not None:
                    margin.add_metric([name, str(band)], m["margin"])
        yield margin

    def _replicas(self, snap):
        """Each replica as the core sees it."""
        age = GaugeMetricFamily("bouncer_replica_telemetry_age_seconds", "Age of the last good scrape.",
                                labels=["replica"])
        kv = GaugeMetricFamily("bouncer_replica_kv_usage", "Projected KV usage (scraped blended with own).",
                               labels=["replica"])
        busy = GaugeMetricFamily("bouncer_replica_busy", "1 while a replica is marked busy.", labels=["replica"])
        inflight = GaugeMetricFamily("bouncer_replica_inflight_requests", "Requests in flight per replica.",
                                     labels=["replica"])
        elsewhere = GaugeMetricFamily("bouncer_replica_inflight_elsewhere_requests",
                                      "Requests the other gateways sharing state have in flight per replica, as "
                                      "last seen (their part ends with their lease).", labels=["replica"])
        unseen = GaugeMetricFamily("bouncer_replica_inflight_unseen", "Requests the gateway has in flight on a "
                                   "replica that its engine did not count at the last scrape.", labels=["replica"])
        precise = GaugeMetricFamily("bouncer_replica_prefix_index_precise",
                                    "1 while the replica's prefix index follows its KV events.", labels=["replica"])
        blocks = GaugeMetricFamily("bouncer_replica_prefix_index_blocks", "Blocks in the replica's prefix index.",
                                   labels=["replica", "source"])
        correction = GaugeMetricFamily("bouncer_replica_latency_correction",
                                       "Observed / modelled latency the replica's predictor has learned "
                                       "(1 = the step-time model is right).", labels=["replica", "kind"])
        for ms in snap["models"].values():
            for rname, r in ms["replicas"].items():
                age.add_metric([rname], -1.0 if r["telemetry_age_s"] is None else r["telemetry_age_s"])
                kv.add_metric([rname], r["projected_kv_usage"])
                busy.add_metric([rname], 1.0 if r["busy"] else 0.0)
                inflight.add_metric([rname], r["inflight"])
                elsewhere.add_metric([rname], r["inflight_elsewhere"])
                unseen.add_metric([rname], r["inflight_unseen_by_engine"])
                idx = r["prefix_index"]
                precise.add_metric([rname], 1.0 if idx["mode"] == "precise" else 0.0)
                blocks.add_metric([rname, "approximate"], idx["approx_blocks"])
                if "precise_blocks" in idx:
                    blocks.add_metric([rname, "kv-events"], idx["precise_blocks"])
                if r["latency"] is not None:
                    correction.add_metric([rname, "ttft"], r["latency"]["ttft_factor"])
                    correction.add_metric([rname, "tpot"], r["latency"]["tpot_factor"])
        yield age
        yield kv
        yield busy
        yield inflight
        yield elsewhere
        yield unseen
        yield precise
        yield blocks
        yield correction

    def _kv_events(self):
        """The engines' KV-event feeds."""
        batches = CounterMetricFamily("bouncer_kv_event_batches", "KV-event batches received.", labels=["replica"])
        gaps = CounterMetricFamily("bouncer_kv_event_gaps", "KV-event batches missed (sequence gaps).",
                                   labels=["replica"])
        bad = CounterMetricFamily("bouncer_kv_event_malformed", "KV-event messages that did not decode.",
                                  labels=["replica"])
        for rname, st in sorted(self.kv_event_stats().items()):
            batches.add_metric([rname], st.batches)
            gaps.add_metric([rname], st.gaps)
            bad.add_metric([rname], st.malformed)
        yield batches
        yield gaps
        yield bad

    def _slos(self, view):
        """SLO attainment per tenant."""
        stats = view.stats
        met = CounterMetricFamily("bouncer_slo_met", "Completed requests within their TTFT and TPOT SLO (goodput).",
                                  labels=["tenant"])
        total = CounterMetricFamily("bouncer_slo_requests", "Completed requests that carry an SLO.",
                                    labels=["tenant"])
        ratio = GaugeMetricFamily("bouncer_slo_attainment_ratio", "Share of completed requests within SLO.",
                                  labels=["tenant"])
        for tenant, n in sorted(stats.slo_total.items()):
            m = stats.slo_met[tenant]
            met.add_metric([tenant], m)
            total.add_metric([tenant], n)
            ratio.add_metric([tenant], m / n if n else 1.0)
        yield met
        yield total
        yield ratio


class _SharedStateCollector:
    """The link to the gateways' shared Redis (`shared_state`), where one is configured."""

    def __init__(self, shared: Callable[[], object | None]) -> None:
        self.shared = shared

    def collect(self):
        link = self.shared()
        if link is None:
            return
        yield GaugeMetricFamily("bouncer_shared_state_up", "1 while the gateways' shared Redis answers; 0: this "
                                "gateway decides as shared_state.on_unavailable says.", value=int(link.available))
        yield GaugeMetricFamily("bouncer_shared_state_gateways", "Gateways sharing the rate limits, as last counted "
                                "(each one's share of every limit while Redis is away).", value=link.store.gateways)
        yield CounterMetricFamily("bouncer_shared_state_failures", "Redis calls that failed or timed out.",
                                  value=link.calls_failed)
        yield CounterMetricFamily("bouncer_shared_state_refunds_lost", "Rate-limit charges that could not be given "
                                  "back to Redis (it went away meanwhile).", value=link.refunds_lost)
        yield CounterMetricFamily("bouncer_shared_state_syncs", "Times this gateway published its part of the "
                                  "fleet's load and read the others'.", value=link.syncs)
        yield GaugeMetricFamily("bouncer_shared_state_peers", "Other gateways whose part of the fleet's load this "
                                "gateway counted at the last sync.", value=link.peers_seen)
        claims = CounterMetricFamily("bouncer_shared_state_claims", "Dispatches to a nearly full replica claimed "
                                     "on the shared state first: held, or refused (another gateway filled it first; "
                                     "the request waited again).", labels=["result"])
        for result, n in link.claims.items():
            claims.add_metric([result], n)
        yield claims


class _DiscoveryCollector:
    """Each discovered model's finder (`bouncer.gateway.discovery`)."""

    def __init__(self, finders: Callable[[], dict]) -> None:
        self.finders = finders

    def collect(self):
        finders = self.finders()
        if not finders:
            return
        replicas = GaugeMetricFamily("bouncer_discovery_replicas", "Replicas the model's discovery holds in force.",
                                     labels=["model"])
        stale = GaugeMetricFamily("bouncer_discovery_stale", "1 while the model's lookups fail or find nothing and "
                                  "the last known replicas are kept (for discovery.keep_last_s).", labels=["model"])
        lookups = CounterMetricFamily("bouncer_discovery_lookups", "DNS or file lookups made.", labels=["model"])
        failures = CounterMetricFamily("bouncer_discovery_failures", "Lookups that failed or found no replicas.",
                                       labels=["model"])
        changes = CounterMetricFamily("bouncer_discovery_changes", "Times the model's set of replicas changed.",
                                      labels=["model"])
        for model, (finder, _task) in sorted(finders.items()):
            s = finder.status
            replicas.add_metric([model], s.replicas)
            stale.add_metric([model], int(s.stale_since is not None))
            lookups.add_metric([model], s.lookups)
            failures.add_metric([model], s.failures)
            changes.add_metric([model], s.changes)
        yield from (replicas, stale, lookups, failures, changes)


class _QuotaCollector:
    """Tenants' and groups' spend in the windows now in force, as last read from the quota store
    (`bouncer.gateway.quota_keeper`, every few seconds)."""

    def __init__(self, quotas: Callable[[], object | None]) -> None:
        self.quotas = quotas

    def collect(self):
        keeper = self.quotas()
        if keeper is None:
            return
        labels = ["scope", "owner", "unit", "window"]
        families = [
            (GaugeMetricFamily("bouncer_quota_limit", "A quota's limit per window, in its unit (tokens or USD).",
                               labels=labels), "limit"),
            (GaugeMetricFamily("bouncer_quota_spent", "Settled spend in the current window.", labels=labels),
             "spent"),
            (GaugeMetricFamily("bouncer_quota_reserved", "Spend reserved by admitted requests not yet settled.",
                               labels=labels), "reserved"),
            (GaugeMetricFamily("bouncer_quota_remaining", "What is left in the current window: limit - spent - "
                               "reserved, at least 0.", labels=labels), "remaining"),
            (GaugeMetricFamily("bouncer_quota_resets_at_seconds", "When the current window ends, seconds since the "
                               "epoch.", labels=labels), "resets_at")]
        shadow = CounterMetricFamily("bouncer_quota_shadow_over", "Requests that found a shadow limit spent (counted, "
                                     "not enforced: what enforcing it would have refused, demoted or diverted).",
                                     labels=labels)
        for row in keeper.report():  # type: ignore[attr-defined]
            values = [row["scope"], row["owner"], row["unit"], row["window"]]
            for family, key in families:
                family.add_metric(values, row[key])
            if row["shadow"]:
                shadow.add_metric(values, row["shadow_over"])
        yield from (family for family, _ in families)
        yield shadow
        yield CounterMetricFamily("bouncer_quota_store_failures", "Calls to the quota store (Redis) that failed.",
                                  value=keeper.failures)  # type: ignore[attr-defined]
        yield GaugeMetricFamily("bouncer_quota_unsettled", "Requests whose spend waits for the quota store to "
                                "answer again (written once it does).",
                                value=keeper.unsettled)  # type: ignore[attr-defined]


class GatewayMetrics:
    """Observed by the gateway as requests move. Latency histograms and internal errors, in the
    registry /metrics serves, with the collectors above."""

    def __init__(self, core_ref: Callable[[], AdmissionCore], clock: Callable[[], float],
                 kv_event_stats: Callable[[], dict] = dict, connections: Callable[[], object | None] = lambda: None,
                 shared: Callable[[], object | None] = lambda: None, finders: Callable[[], dict] = dict,
                 quotas: Callable[[], object | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_QuotaCollector(quotas))
        self.registry.register(_CoreCollector(core_ref, clock, kv_event_stats, connections))
        self.registry.register(_SharedStateCollector(shared))
        self.registry.register(_DiscoveryCollector(finders))
        self.internal_errors = Counter("bouncer_internal_errors", "Requests answered 500: a bug in the gateway.",
                                       registry=self.registry)
        self.picker_ends_unseen = Counter(
            "bouncer_picker_ends_unseen", "Requests the endpoint picker routed whose end Envoy's access log never "
            "reported within picker.end_unseen_after_s (an Envoy that died with them in flight); their permits went "
            "back unmeasured.", registry=self.registry)
        self.picker_envoys_without_access_log = Gauge(
            "bouncer_picker_envoys_without_access_log", "Envoys that route requests through this endpoint picker "
            "and have not opened its access log (a bootstrap without it): the picker learns their requests' ends "
            "only where it reads their answers whole, and gives the others' permits back after "
            "picker.end_unseen_after_s.", registry=self.registry)
        self.queue_wait = Histogram("bouncer_queue_wait_seconds", "Time from arrival to dispatch.",
                                    ["tenant", "band"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("bouncer_ttft_seconds", "Time to first token seen by the gateway, from arrival.",
                              ["tenant"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("bouncer_tpot_seconds", "Mean time per output token after the first.",
                              ["tenant"], buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("bouncer_request_duration_seconds", "Arrival to last byte, admitted requests.",
                             ["tenant"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.overflow = Counter("bouncer_overflow_requests", "Requests diverted to an external overflow endpoint, by "
                                "how they ended there.", ["model", "target", "outcome"], registry=self.registry)
        self.loop_lag = Histogram("bouncer_event_loop_lag_seconds", "How late the gateway's event loop ran a timer "
                                  "set for every 0.1 s: time every request on this gateway waits for its turn.",
                                  buckets=LOOP_LAG_BUCKETS, registry=self.registry)
        self._children: dict[tuple, object] = {}  # labelled children, looked up once

    def observe_queue_wait(self, tenant: str, band: int, seconds: float) -> None:
        child = self._children.get(("wait", tenant, band))
        if child is None:
            child = self._children[("wait", tenant, band)] = self.queue_wait.labels(tenant, str(band))
        child.observe(seconds)

    def observe_completed(self, tenant: str, arrival: float, first_token_at: float | None, tpot: float | None,
                          now: float) -> None:
        children = self._children.get(("done", tenant))
        if children is None:
            children = self._children[("done", tenant)] = (self.ttft.labels(tenant), self.tpot.labels(tenant),
                                                           self.e2e.labels(tenant))
        ttft, tpot_h, e2e = children
        if first_token_at is not None:
            ttft.observe(first_token_at - arrival)
        if tpot is not None:
            tpot_h.observe(tpot)
        e2e.observe(now - arrival)
