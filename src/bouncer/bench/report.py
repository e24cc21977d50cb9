"""`bouncer bench report`: result JSONs of `bouncer bench run` into Markdown tables and PNG plots.

Plots: goodput against load for every policy (the cliff), one panel per scenario; per-tenant SLO
attainment at the highest load; gateway queue and KV usage over time for one scenario at its
highest load, Bouncer against no admission. Scenarios whose runs compare routers (one admission
policy, several `--routing` or `--kv-events` variants) get a routing table instead: prefix hit
rate against the trace's infinite-cache bound, TTFT, and KV imbalance. Runs of the closed-loop
`agents` scenario get their own table (sessions and steps per hour, hit rate, recomputed tokens)
and a plot of the prefix-cache hit rate over time, one panel per concurrency. Runs on a
disaggregated fleet add a table of what its decode pool did (refusals after prefill, KV usage and
its swings, preemptions) and a plot of the decode pool's KV usage over time at the highest load.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POLICY_ORDER = ["none", "tgi-cap", "vllm-queue-cap", "llmd-flow-control", "dynamo-busy", "pd-current-load", "bouncer"]
AGENT_POLICY_ORDER = ["none", "request-cap", "bouncer"]
AGENT_POLICY_COLORS = {"none": "tab:blue", "request-cap": "tab:orange", "bouncer": "tab:green"}


def load_results(paths: list[str]) -> list[dict]:
    """The `bench run` results in `paths` (files, or folders of them). Another JSON file in a
    folder (a measurement saved beside its runs, e.g. `scripts/servegen_wall_ratio.py`'s) is
    skipped, and said so on stderr; one named alone is an error."""
    out = []
    for p in paths:
        folder = pathlib.Path(p).is_dir()
        for f in sorted(pathlib.Path(p).glob("*.json")) if folder else [pathlib.Path(p)]:
            result = json.loads(f.read_text())
            if not (isinstance(result, dict) and "scenario" in result and "policy" in result):
                if not folder:
                    raise SystemExit(f"{f} is not a `bouncer bench run` result (no scenario and policy)")
                print(f"skipped {f}: not a `bouncer bench run` result", file=sys.stderr)
                continue
            out.append(result)
    return out


def _fmt(x, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.1%}" if pct else f"{x:.2f}"


def goodput_table(results: list[dict], scenario: str, key: str = "goodput_rps", scale: float = 1.0) -> list[str]:
    rows = [r for r in results if r["scenario"] == scenario]
    loads = sorted({r["load"] for r in rows})
    by = {(r["policy"], r["load"]): r for r in rows}
    lines = ["| policy | " + " | ".join(f"load {x:g}" for x in loads) + " |", "|---|" + "---|" * len(loads)]
    for pol in [p for p in POLICY_ORDER if any(k[0] == p for k in by)]:
        cells = []
        for x in loads:
            r = by.get((pol, x))
            cells.append("-" if r is None else f"{r[key] * scale:.2f}")
        lines.append(f"| {pol} | " + " | ".join(cells) + " |")
    return lines


def prompt_goodput_table(results: list[dict], scenario: str) -> list[str]:
    """Goodput in prompt tokens (thousands a second), where every run of the scenario has it
    (results saved before it was recorded do not)."""
    rows = [r for r in results if r["scenario"] == scenario]
    if not all("goodput_prompt_tokens_per_s" in r for r in rows):
        return []
    return goodput_table(results, scenario, "goodput_prompt_tokens_per_s", 1e-3)


MAX_TENANT_COLUMNS = 6  # beyond this (a ServeGen pool of clients), tenants are shown by band


def tenant_groups(result: dict) -> dict[str, dict]:
    """The run's tenants; or, when there are too many to read side by side, one group per
    priority band: SLO attainment over all its requests, the worst tenant's TTFT p99, the summed
    token share."""
    tenants = result["tenants"]
    if len(tenants) <= MAX_TENANT_COLUMNS:
        return tenants
    groups: dict[str, dict] = {}
    for prio in sorted({t["priority"] for t in tenants.values()}, reverse=True):
        members = [t for t in tenants.values() if t["priority"] == prio]
        judged = [t for t in members if t["slo_attainment"] is not None]
        offered = sum(t["offered"] for t in judged)
        p99s = [t["ttft_p99_s"] for t in members if t["ttft_p99_s"] is not None]
        groups[f"band {prio} ({len(members)} tenants)"] = {
            "priority": prio, "offered": sum(t["offered"] for t in members),
            "slo_attainment": sum(t["slo_attainment"] * t["offered"] for t in judged) / offered if offered else None,
            "ttft_p99_s": max(p99s) if p99s else None,
            "served_token_share": sum(t["served_token_share"] or 0 for t in members)}
    return groups


def tenant_table(results: list[dict], scenario: str, load: float) -> list[str]:
    rows = {r["policy"]: r for r in results if r["scenario"] == scenario and r["load"] == load}
    if not rows:
        return []
    tenants = list(tenant_groups(next(iter(rows.values()))))
    worst = " (worst tenant)" if len(next(iter(rows.values()))["tenants"]) > MAX_TENANT_COLUMNS else ""
    lines = ["| policy | " + " | ".join(f"{t} SLO att. / TTFT p99 s{worst} / token share" for t in tenants) + " |",
             "|---|" + "---|" * len(tenants)]
    for pol in [p for p in POLICY_ORDER if p in rows]:
        cells = []
        groups = tenant_groups(rows[pol])
        for t in tenants:
            s = groups[t]
            cells.append(f"{_fmt(s['slo_attainment'], True)} / {_fmt(s['ttft_p99_s'])} / "
                         f"{_fmt(s['served_token_share'], True)}")
        lines.append(f"| {pol} | " + " | ".join(cells) + " |")
    return lines


def ttft_minus_slo_table(results: list[dict], scenario: str, load: float) -> list[str]:
    """Per band, when completed requests got their first token against their TTFT deadline."""
    rows = {r["policy"]: r for r in results if r["scenario"] == scenario and r["load"] == load
            and r.get("ttft_minus_slo")}
    if not rows:
        return []
    lines = ["| policy | band | completed | p10 | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for pol in [p for p in POLICY_ORDER if p in rows]:
        for band, d in sorted(rows[pol]["ttft_minus_slo"].items(), key=lambda kv: -int(kv[0])):
            lines.append(f"| {pol} | {band} | {d['completed']} | " +
                         " | ".join(f"{d[k]:+.2f}" for k in ("p10_s", "p50_s", "p90_s", "p99_s")) + " |")
    return lines


def router_label(r: dict) -> str:
    return r["routing"] + (" + KV events" if r.get("kv_events") else "")


def compares_routers(results: list[dict], scenario: str) -> bool:
    rows = [r for r in results if r["scenario"] == scenario]
    return len({(r["policy"], r["load"]) for r in rows}) < len(rows)


def routing_table(results: list[dict], scenario: str) -> list[str]:
    rows = sorted((r for r in results if r["scenario"] == scenario),
                  key=lambda r: (r["load"], r["policy"] != "none", router_label(r)))
    lines = ["| load | admission | router | prefix hit rate | infinite-cache bound | share of bound | TTFT p50 s "
             "| TTFT p99 s | KV imbalance (max/mean) | goodput req/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = r["prefix_hit_rate"] / r["prefix_hit_bound"] if r["prefix_hit_bound"] else None
        lines.append(f"| {r['load']:g} | {r['policy']} | {router_label(r)} | {_fmt(r['prefix_hit_rate'], True)} | "
                     f"{_fmt(r['prefix_hit_bound'], True)} | {_fmt(share, True)} | {_fmt(r['ttft_p50_s'])} | "
                     f"{_fmt(r['ttft_p99_s'])} | {_fmt(r['kv_imbalance'])} | {r['goodput_rps']:.2f} |")
    return lines


def plot_cliff(results: list[dict], out: pathlib.Path) -> None:
    scenarios = sorted({r["scenario"] for r in results})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.6), squeeze=False)
    for ax, sc in zip(axes[0], scenarios, strict=True):
        series = defaultdict(list)
        for r in results:
            if r["scenario"] == sc:
                series[r["policy"]].append((r["load"], r["goodput_rps"]))
        for pol in [p for p in POLICY_ORDER if p in series]:
            pts = sorted(series[pol])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol,
                    linewidth=2.5 if pol == "bouncer" else 1.2)
        ax.set_title(sc)
        ax.set_xlabel("offered load (x capacity)")
        ax.set_ylabel("goodput (req/s within SLO)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_tenants(results: list[dict], out: pathlib.Path) -> None:
    scenarios = sorted({r["scenario"] for r in results})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.6), squeeze=False)
    for ax, sc in zip(axes[0], scenarios, strict=True):
        rows = [r for r in results if r["scenario"] == sc]
        top = max(r["load"] for r in rows)
        groups = {r["policy"]: tenant_groups(r) for r in rows if r["load"] == top}
        tenants = list(next(iter(groups.values())))
        pols = [p for p in POLICY_ORDER if p in groups]
        width = 0.8 / len(tenants)
        for i, t in enumerate(tenants):
            ax.bar([j + i * width for j in range(len(pols))],
                   [groups[p][t]["slo_attainment"] or 0 for p in pols], width, label=t)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(pols))], pols, rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{sc}, load {top:g}")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_timeline(results: list[dict], scenario: str, out: pathlib.Path) -> bool:
    rows = [r for r in results if r["scenario"] == scenario]
    if not rows:
        return False
    top = max(r["load"] for r in rows)
    chosen = [r for r in rows if r["load"] == top and r["policy"] in ("none", "bouncer")]
    if not chosen:
        return False
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    for r in chosen:
        s = r["samples"]
        t = [x["t"] for x in s]
        axes[0].plot(t, [x["gateway_queued"] for x in s], label=r["policy"])
        axes[1].plot(t, [x["engine_waiting"] for x in s], label=r["policy"])
        axes[2].plot(t, [x["kv_usage_mean"] for x in s], label=r["policy"])
    for ax, title in zip(axes, ["queued at the gateway", "waiting in engines", "mean KV usage"], strict=True):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[-1].set_xlabel("simulated seconds")
    fig.suptitle(f"{scenario} at load {top:g}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def decode_pool_table(results: list[dict], scenario: str) -> list[str]:
    """Per policy and load on a disaggregated fleet: requests a decode worker refused after their
    prefill ran, the decode pool's KV usage (mean; standard deviation within 10-s windows, then of
    the windows' means; share of seconds at 98% or more), and preemptions."""
    rows = [r for r in results if r["scenario"] == scenario and r.get("decode_kv")]
    if not rows:
        return []
    lines = ["| policy | load | refused after prefill | decode KV mean | std within 10 s | std of 10-s means "
             "| seconds at >= 98% | preemptions |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["load"], POLICY_ORDER.index(r["policy"]))):
        k = r["decode_kv"]
        lines.append(f"| {r['policy']} | {r['load']:g} | {r['refused_after_prefill']} | {k['mean']:.2f} | "
                     f"{k['std_within_10s']:.3f} | {k['std_of_10s_means']:.3f} | {k['share_at_98pct']:.0%} | "
                     f"{r['preemptions']} |")
    return lines


def plot_decode_pool(results: list[dict], scenario: str, out: pathlib.Path) -> bool:
    rows = [r for r in results if r["scenario"] == scenario and r.get("decode_kv")]
    if not rows:
        return False
    top = max(r["load"] for r in rows)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for r in sorted((r for r in rows if r["load"] == top), key=lambda r: POLICY_ORDER.index(r["policy"])):
        s = [x for x in r["samples"] if "decode_kv_usage_mean" in x]
        ax.plot([x["t"] for x in s], [x["decode_kv_usage_mean"] for x in s], label=r["policy"],
                linewidth=2.0 if r["policy"] == "bouncer" else 1.0)
    ax.set_ylabel("decode pool KV usage")
    ax.set_xlabel("simulated seconds")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{scenario} at load {top:g}: the decode pool")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def _agent_runs(results: list[dict]) -> list[dict]:
    return sorted(results, key=lambda r: (r["duration_s"], r["sessions"], r["seed"],
                                          AGENT_POLICY_ORDER.index(r["policy"])))


def agents_table(results: list[dict]) -> list[str]:
    lines = ["| hours | agents | seed | policy | sessions/h | against the cap | steps per completed session | failed "
             "sessions (of them mid-session) | steps of sessions failed mid-way | under way at the end | steps/h | "
             "prefix hit rate | lowest 5-min hit rate after the first 20 min | recomputed tokens | engines busy | "
             "preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = _agent_runs(results)
    cap = {(r["duration_s"], r["sessions"], r["seed"]): r["sessions_completed_per_hour"] for r in runs
           if r["policy"] == "request-cap"}
    for r in runs:
        later = [x["prefix_hit_rate"] for x in r["prefix_hit_rate_over_time"]
                 if x["t"] > 1200 and x["prefix_hit_rate"] is not None]
        base = cap.get((r["duration_s"], r["sessions"], r["seed"]))
        ratio = f"{r['sessions_completed_per_hour'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['duration_s'] / 3600:g} | {r['sessions']} | {r['seed']} | {r['policy']} | "
                     f"{r['sessions_completed_per_hour']:.1f} | {ratio} | {_fmt(r['steps_per_completed_session'])} | "
                     f"{r['sessions_failed']} ({r['sessions_failed_midway']}) | {r['steps_of_failed_sessions']} | "
                     f"{r['sessions_under_way']} | {r['steps_completed_per_hour']:.0f} | "
                     f"{_fmt(r['prefix_hit_rate'], True)} | {_fmt(min(later) if later else None, True)} | "
                     f"{r['recomputed_tokens'] / 1e6:.1f} M | {_fmt(r['engine_busy'], True)} | {r['preemptions']} |")
    return lines


def plot_agent_hit_rate(results: list[dict], out: pathlib.Path) -> None:
    """Hit rate over time per policy, one panel per concurrency (the longest run of each, its lowest seed)."""
    panels = sorted({r["sessions"] for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], panels, strict=True):
        longest = max(r["duration_s"] for r in results if r["sessions"] == n)
        seed = min(r["seed"] for r in results if r["sessions"] == n and r["duration_s"] == longest)
        for r in _agent_runs([r for r in results
                              if r["sessions"] == n and r["duration_s"] == longest and r["seed"] == seed]):
            pts = [(x["t"] / 60, x["prefix_hit_rate"]) for x in r["prefix_hit_rate_over_time"]
                   if x["prefix_hit_rate"] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r["policy"],
                    color=AGENT_POLICY_COLORS[r["policy"]], linewidth=2.5 if r["policy"] == "bouncer" else 1.2)
        ax.set_title(f"{n} agents, {longest / 3600:g} h")
        ax.legend(fontsize=7)
        ax.set_xlabel("minutes")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("prefix-cache hit rate (5-min windows)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def retry_after_table(results: list[dict], scenario: str) -> list[str]:
    """Bouncer's Retry-After against what happened: per load and refusal reason, the median
    (p10-p90) of given / the time until a request of that tenant sent after it got in."""
    rows = sorted((r for r in results if r["scenario"] == scenario and r["policy"] == "bouncer"
                   and r.get("retry_after_accuracy")), key=lambda r: r["load"])
    if not rows:
        return []
    lines = ["| load | reason | refusals | Retry-After / actual: median (p10-p90) |", "|---|---|---|---|"]
    for r in rows:
        for reason, a in r["retry_after_accuracy"].items():
            spread = "-" if a["median_ratio"] is None else \
                f"{a['median_ratio']:.2f} ({a['p10_ratio']:.2f}-{a['p90_ratio']:.2f})"
            lines.append(f"| {r['load']:g} | {reason} | {a['refusals']} | {spread} |")
    return lines


def recordings_list(rows: list[dict], out: pathlib.Path) -> list[str]:
    """The runs recorded with `--record`, each with the command that opens it in the flight
    recorder's page (the path as the run wrote it, and as a link from the report)."""
    recorded = sorted((r for r in rows if r.get("recording")), key=lambda r: (r["policy"], r["load"]))
    if not recorded:
        return []
    lines = ["Flight recorder files of these runs (open one with `bouncer recorder FILE`, then /ui):", ""]
    for r in recorded:
        path = pathlib.Path(r["recording"])
        try:
            link = os.path.relpath(path.resolve(), out.resolve())
        except ValueError:  # another drive
            link = str(path)
        lines.append(f"- {r['policy']} at load {r['load']:g}: [{path.name}]({link}), "
                     f"`bouncer recorder {r['recording']}`")
    return lines + [""]


def write_report(paths: list[str], out_dir: str) -> pathlib.Path:
    results = load_results(paths)
    if not results:
        raise ValueError("no result files found")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    agents = [r for r in results if r["scenario"] == "agents"]
    results = [r for r in results if r["scenario"] != "agents"]
    routing = {sc for sc in {r["scenario"] for r in results} if compares_routers(results, sc)}
    policies = [r for r in results if r["scenario"] not in routing]
    lines = ["# Benchmark report", "", f"{len(results) + len(agents)} runs."]
    if results:
        lines[-1] += (" Goodput: requests per second completed within their tenant's TTFT and TPOT SLO, latency "
                      "measured from the user's first attempt.")
    lines.append("")
    if policies:
        plot_cliff(policies, out / "goodput-vs-load.png")
        plot_tenants(policies, out / "tenant-slo.png")
        lines += ["![goodput against load](goodput-vs-load.png)", "",
                  "![per-tenant SLO attainment](tenant-slo.png)", ""]
    for sc in sorted(routing):
        rows = [r for r in results if r["scenario"] == sc]
        lines += [f"## {sc}: routers", "", f"Capacity {rows[0]['capacity_rps']:.1f} req/s on {rows[0]['replicas']} "
                  f"replicas; {rows[0]['duration_s']:g} s of arrivals. Admission `none`: the router alone sends "
                  "every request at once; `bouncer`: the router ranks what Bouncer's admission lets through.", ""]
        lines += routing_table(results, sc) + ["", "Requests lost in accounting across these runs: "
                                                   f"{sum(r['lost'] for r in rows)}.", ""]
    for sc in sorted({r["scenario"] for r in policies}):
        rows = [r for r in results if r["scenario"] == sc]
        top = max(r["load"] for r in rows)
        lines += [f"## {sc}", "", f"Goodput (req/s), capacity {rows[0]['capacity_rps']:.1f} req/s "
                  f"on {rows[0]['replicas']} replicas:", ""]
        lines += goodput_table(results, sc) + [""]
        prompt_goodput = prompt_goodput_table(results, sc)
        if prompt_goodput:
            lines += ["The same in prompt tokens (thousands a second within SLO: the prefill spent on answers "
                      "that counted):", ""] + prompt_goodput + [""]
        lines += [f"Per tenant at load {top:g}:", ""]
        lines += tenant_table(results, sc, top) + [""]
        late = ttft_minus_slo_table(results, sc, top)
        if late:
            lines += [f"First token against the TTFT deadline at load {top:g}, per band (completed requests; "
                      "seconds, < 0: before it):", ""] + late + [""]
        accuracy = retry_after_table(results, sc)
        if accuracy:
            lines += ["Bouncer's Retry-After against the time until the tenant's next request got in:", ""]
            lines += accuracy + [""]
        lost = sum(r["lost"] for r in rows)
        lines.append(f"Requests lost in accounting across these runs: {lost}.")
        lines.append("")
        if plot_timeline(results, sc, out / f"timeline-{sc}.png"):
            lines += [f"![queue and KV over time](timeline-{sc}.png)", ""]
        pool = decode_pool_table(results, sc)
        if pool:
            lines += [f"The decode pool ({rows[0].get('decode_replicas', '?')} of the {rows[0]['replicas']} "
                      "engines decode):", ""] + pool + [""]
            if plot_decode_pool(results, sc, out / f"decode-pool-{sc}.png"):
                lines += [f"![decode pool KV over time](decode-pool-{sc}.png)", ""]
        lines += recordings_list(rows, out)
    for trace in sorted({r.get("trace", "traces") for r in agents}, key=lambda t: (t != "traces", t)):  # WEKA folders
        rows = [r for r in agents if r.get("trace", "traces") == trace]
        name = "" if trace == "traces" else f"-{trace}"
        plot_agent_hit_rate(rows, out / f"agents-hit-rate{name}.png")
        lines += [f"## agents{'' if trace == 'traces' else ': ' + trace}", "",
                  f"Closed loop on {rows[0]['replicas']} replicas; `sessions` agents run at all times; sessions of "
                  f"`{trace}/`.", ""] + agents_table(rows)
        lines += ["", f"![hit rate over time](agents-hit-rate{name}.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
