"""Writes deploy/grafana/bouncer.json, the Grafana dashboard over Bouncer's metrics (and vLLM's,
for engine pressure), from the panel list below: edit the list, run this, commit both
(tests/test_dashboards.py checks the file is this script's output and that a real Prometheus
scraping the demo answers every query).

    .venv/bin/python scripts/grafana_dashboard.py
"""

from __future__ import annotations

import json
import pathlib

OUT = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "bouncer.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
R = "$__rate_interval"
T = 'tenant=~"$tenant"'
M = 'model=~"$model"'

# (row, [(title, unit, [(expr, legend), ...], description), ...])
ROWS = [
    ("Overview", [
        ("SLO attainment by tenant", "percentunit",
         [(f"sum by (tenant) (rate(bouncer_slo_met_total{{{T}}}[{R}])) / "
           f"sum by (tenant) (rate(bouncer_slo_requests_total{{{T}}}[{R}]))", "{{tenant}}")],
         "Completed requests within their TTFT and TPOT SLO (goodput over completions)."),
        ("Decisions by outcome", "reqps",
         [(f"sum by (outcome) (rate(bouncer_decisions_total{{{T}}}[{R}]))", "{{outcome}}")],
         "admitted counts dispatches; every request ends once as completed, refused, expired, evicted, cancelled, "
         "failed or diverted (sent to an overflow target)."),
        ("Refusals and other ends by reason", "reqps",
         [(f'sum by (outcome, reason) (rate(bouncer_decisions_total{{outcome!~"admitted|completed|requeued|demoted",'
           f"{T}}}[{R}]))", "{{outcome}} {{reason}}")],
         "What clients were told and why (the error code they see is the reason)."),
        ("In flight and queued", "short",
         [("sum(bouncer_inflight_requests)", "in flight (permits)"),
          (f"sum(bouncer_queue_depth{{{M}}})", "queued in the gateway")], ""),
    ]),
    ("Flow control", [
        ("Arrivals by band", "reqps", [(f"sum by (band) (rate(bouncer_arrivals_total[{R}]))", "band {{band}}")], ""),
        ("Arrivals by tenant", "reqps",
         [(f"sum by (tenant) (rate(bouncer_arrivals_total{{{T}}}[{R}]))", "{{tenant}}")], ""),
        ("Queue depth by band", "short", [(f"sum by (band) (bouncer_queue_depth{{{M}}})", "band {{band}}")], ""),
        ("Queued prompt tokens by band", "short",
         [(f"sum by (band) (bouncer_queue_tokens{{{M}}})", "band {{band}}")], ""),
        ("Queue wait p99 by band", "s",
         [(f"histogram_quantile(0.99, sum by (le, band) (rate(bouncer_queue_wait_seconds_bucket{{{T}}}[{R}])))",
           "band {{band}}")], "Arrival to dispatch, of the requests dispatched."),
        ("Share of served tokens by tenant", "percentunit",
         [(f"sum by (tenant) (rate(bouncer_served_tokens_total{{{T}}}[{R}])) / "
           f"scalar(sum(rate(bouncer_served_tokens_total[{R}])))", "{{tenant}}")],
         "Fairness: prompt and output tokens of completed requests."),
    ]),
    ("Saturation", [
        ("Pool saturation and band ceilings", "short",
         [(f"bouncer_saturation{{{M}}}", "{{model}} saturation"),
          (f"bouncer_band_ceiling{{{M}}}", "{{model}} ceiling band {{band}}")],
         "A band dispatches only while saturation is under its ceiling."),
        ("Agent window", "short",
         [(f"bouncer_agent_window{{{M}}}", "window"), (f"bouncer_active_agents{{{M}}}", "active agents"),
          (f"bouncer_active_subagents{{{M}}}", "active subagents")], ""),
        ("Demand: the replicas the traffic needs", "short",
         [(f"sum by (model, scope) (bouncer_demand_replicas{{{M}}})", "{{model}} {{scope}}")],
         "What an autoscaler should provide (refused requests included), summed over the gateways; "
         "scope protected: the bands >= 0 alone (docs/operations/autoscaling.md)."),
        ("Demand's inputs: offered rate and cost per request", "short",
         [(f'sum by (model) (bouncer_demand_offered_rps{{{M},scope="all"}})', "{{model}} first attempts/s"),
          (f'max by (model) (bouncer_demand_cost_seconds{{{M},scope="all"}})', "{{model}} engine-s per request")],
         ""),
    ]),
    ("Quotas and overflow", [
        ("Quota spent and remaining", "short",
         [("max by (scope, owner, unit, window) (bouncer_quota_spent)",
           "{{scope}} {{owner}} {{unit}}/{{window}} spent"),
          ("min by (scope, owner, unit, window) (bouncer_quota_remaining)",
           "{{scope}} {{owner}} {{unit}}/{{window}} remaining")],
         "Each tenant's and group's spend in the window now in force, as the gateways last read it from Redis "
         "(docs/operations/quotas-and-overflow.md)."),
        ("Diverted to overflow", "reqps",
         [(f'sum by (reason) (rate(bouncer_decisions_total{{outcome="diverted",{T}}}[{R}]))', "diverted: {{reason}}"),
          (f"sum by (target, outcome) (rate(bouncer_overflow_requests_total[{R}]))", "{{target}} {{outcome}}")],
         "Requests the pool would have refused (the reason) sent to an overflow target instead, and how those "
         "sent to an external endpoint ended there."),
    ]),
    ("Engines", [
        ("KV usage per replica", "percentunit",
         [("bouncer_replica_kv_usage", "{{replica}} (gateway: scraped with its own in-flight)"),
          ("vllm:kv_cache_usage_perc", "{{instance}} (engine)")], ""),
        ("Engine queues (vLLM)", "short",
         [("vllm:num_requests_running", "{{instance}} running"),
          ("vllm:num_requests_waiting", "{{instance}} waiting")], ""),
        ("Telemetry age", "s", [("bouncer_replica_telemetry_age_seconds", "{{replica}}")],
         "Age of the last good scrape of each replica (-1: never scraped)."),
        ("Busy replicas and the gateway's in-flight there", "short",
         [("bouncer_replica_busy", "{{replica}} busy"), ("bouncer_replica_inflight_requests", "{{replica}} in flight")],
         ""),
    ]),
    ("Latency", [
        ("TTFT p99 by tenant", "s",
         [(f"histogram_quantile(0.99, sum by (le, tenant) (rate(bouncer_ttft_seconds_bucket{{{T}}}[{R}])))",
           "{{tenant}}")], "From arrival at the gateway, queue wait included."),
        ("TPOT p99 by tenant", "s",
         [(f"histogram_quantile(0.99, sum by (le, tenant) (rate(bouncer_tpot_seconds_bucket{{{T}}}[{R}])))",
           "{{tenant}}")], ""),
        ("TTFT margin by band", "short", [(f"bouncer_ttft_margin{{{M}}}", "band {{band}}")],
         "p90 of observed over predicted TTFT: what the band's predictions are multiplied by."),
        ("Latency model corrections", "short",
         [("bouncer_replica_latency_correction", "{{replica}} {{kind}}")], "1 = the step-time model is right."),
    ]),
    ("Several gateways (shared_state)", [
        ("Shared Redis up, gateways counted", "short",
         [("bouncer_shared_state_up", "{{instance}} up"), ("bouncer_shared_state_gateways", "{{instance}} gateways"),
          ("bouncer_shared_state_peers", "{{instance}} parts read")],
         "up 0: this gateway decides as shared_state.on_unavailable says. gateways: those sharing the limits (each "
         "one's share while Redis is away); parts read: the others' load it counted at its last sync."),
        ("Shared state calls", "short",
         [(f"sum by (instance) (rate(bouncer_shared_state_syncs_total[{R}]))", "{{instance}} syncs /s"),
          (f"sum by (instance) (rate(bouncer_shared_state_failures_total[{R}]))", "{{instance}} failures /s"),
          (f"sum by (instance) (increase(bouncer_shared_state_refunds_lost_total[{R}]))",
           "{{instance}} refunds lost"),
          (f"sum by (instance, result) (rate(bouncer_shared_state_claims_total[{R}]))",
           "{{instance}} claims {{result}} /s")],
         "A sync publishes this gateway's part of the fleet's state and reads the others'. A claim: a dispatch "
         "to a nearly full replica reserved on the shared state first; refused: another gateway filled it first."),
        ("In flight per replica: this gateway and the others", "short",
         [("bouncer_replica_inflight_requests", "{{instance}} {{replica}} here"),
          ("bouncer_replica_inflight_elsewhere_requests", "{{instance}} {{replica}} elsewhere")],
         "What each gateway counts on a replica: its own requests, and the others' as last seen."),
        ("Active agents, of them elsewhere", "short",
         [(f"bouncer_active_agents{{{M}}}", "{{instance}} {{model}} active"),
          (f"bouncer_active_agents_elsewhere{{{M}}}", "{{instance}} {{model}} at other gateways")], ""),
    ]),
    ("Gateway health", [
        ("Permits", "short",
         [("sum(bouncer_inflight_requests)", "held"),
          (f"sum(increase(bouncer_permits_reclaimed_total[{R}]))", "reclaimed (lease ran out)")],
         "A reclaimed permit is a request the gateway lost track of: a bug."),
        ("Internal errors", "reqps", [(f"sum(rate(bouncer_internal_errors_total[{R}]))", "500s")], ""),
        ("Event-loop lag p99", "s",
         [(f"histogram_quantile(0.99, sum by (le, instance) (rate(bouncer_event_loop_lag_seconds_bucket[{R}])))",
           "{{instance}}")], "How late a 0.1 s timer fires in the gateway: what every request waits for its turn."),
        ("Connections", "short",
         [("sum(bouncer_connections_open)", "open"),
          (f"sum(rate(bouncer_connections_refused_total[{R}]))", "refused /s"),
          (f"sum(rate(bouncer_header_timeouts_total[{R}]))", "header timeouts /s")], ""),
        ("KV events", "short",
         [(f"sum by (replica) (rate(bouncer_kv_event_batches_total[{R}]))", "{{replica}} batches /s"),
          (f"sum by (replica) (rate(bouncer_kv_event_gaps_total[{R}]))", "{{replica}} gaps /s")], ""),
    ]),
]


def _variable(name: str, label: str, query: str) -> dict:
    return {"type": "query", "name": name, "label": label, "datasource": DS, "definition": query,
            "query": {"query": query, "refId": name}, "refresh": 2, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def dashboard() -> dict:
    panels = []
    y = 0
    next_id = 1
    for row, charts in ROWS:
        panels.append({"type": "row", "title": row, "id": next_id, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        next_id += 1
        y += 1
        for i, (title, unit, queries, description) in enumerate(charts):
            panels.append({
                "type": "timeseries", "title": title, "id": next_id, "datasource": DS, "description": description,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 0}},
                                "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [{"refId": chr(ord("A") + k), "datasource": DS, "expr": expr, "legendFormat": legend}
                            for k, (expr, legend) in enumerate(queries)],
            })
            next_id += 1
        y += 8 * ((len(charts) + 1) // 2)
    return {
        "title": "Bouncer: admission control", "uid": "bouncer-admission", "schemaVersion": 39, "version": 1,
        "editable": True, "graphTooltip": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "tags": ["bouncer", "llm", "admission"],
        "annotations": {"list": []},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus"},
            _variable("model", "Model", "label_values(bouncer_saturation, model)"),
            _variable("tenant", "Tenant", "label_values(bouncer_arrivals_total, tenant)"),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
