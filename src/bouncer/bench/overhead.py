"""`bouncer bench overhead`: what the gateway costs, measured against going direct.

One run starts a fast upstream (bouncer.bench.fast_upstream) and two real gateways in front of
it, one with the flight recorder on (the default) and one with it off, each in its own process
(the upstream pinned to one core and the gateways to another, where `taskset` exists), then
drives each with wrk at concurrency 1, 16 and 64, streaming and not, and prints requests/s and
p50/p99 latency direct and through Bouncer, with the ratios, and the recorder's share of the
gateway's CPU per request (on against off). The peers (nginx, vllm-router, Envoy alone and with
Bouncer as its endpoint picker) run in the same rounds. Then the paced stream case
(`bouncer.bench.paced_streams`): CPU per 1,000 tokens streamed one write each, 20 ms apart.
Ratios are what to compare across machines: both sides are measured in the same run on the same (shared, noisy) machine.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import asdict, dataclass

from bouncer.bench.loopback import cpu_seconds, free_port, pinned, stop, wait_ok
from bouncer.bench.paced_streams import PACE_MS, PACED_TOKENS, PacedRun, measure
from bouncer.bench.paced_streams import report as paced_report
from bouncer.bench.peer_proxies import start_peers
from bouncer.config import key_digest

BENCH_KEY = "bench-key"
BENCH_ADMIN_KEY = "bench-admin"  # reads the recording gateway's own count of its sampling cost
BODY = {"model": "fast", "messages": [{"role": "user", "content": "Say hello to the benchmark, briefly."}],
        "max_tokens": 16}


@dataclass
class Run:
    target: str  # direct | bouncer | bouncer-recorder-off
    stream: bool
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    server_cpu_us_per_request: float  # CPU time of the server process measured (gateway or upstream)




_LUA = """wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
"""


def _latency_ms(text: str, pct: str) -> float:
    m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        return float("nan")
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def _wrk(url: str, stream: bool, concurrency: int, seconds: int,
         workdir: pathlib.Path) -> tuple[float, float, float, int, int]:
    body = dict(BODY, stream=stream)
    script = workdir / f"post-{int(stream)}.lua"
    script.write_text(_LUA.format(body=json.dumps(json.dumps(body)), key=BENCH_KEY))
    cmd = [*pinned(0), "wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency", "-s", str(script), url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
    m = re.search(r"Requests/sec:\s+([\d.]+)", proc.stdout)
    if m is None:
        raise RuntimeError(f"wrk failed: {proc.stdout}{proc.stderr}")
    out = proc.stdout
    rps = float(m.group(1))
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(x) for x in m.groups())
    total = int(re.search(r"(\d+) requests in", out).group(1))
    return rps, _latency_ms(out, "50"), _latency_ms(out, "99"), errors, total


TRACED_SHARE = 0.1  # the sampled gateway's tracing.sample_ratio


def _gateway_config(upstream: str, port: int, recorder: bool = True, tracing_to: int | None = None,
                    sample_ratio: float = 1.0) -> str:
    tracing = {"tracing": {"endpoint": f"http://127.0.0.1:{tracing_to}", "sample_ratio": sample_ratio}} \
        if tracing_to else {}
    return json.dumps({**tracing,
        "listen": {"host": "127.0.0.1", "port": port},
        "admin_keys_sha256": [key_digest(BENCH_ADMIN_KEY)],
        "recorder": {"enabled": recorder},
        "tenants": [{"name": "bench", "api_keys_sha256": [key_digest(BENCH_KEY)], "max_tokens_cap": 4096}],
        "models": [{"name": "fast", "engine": "vllm", "tokenizer": None, "max_model_len": 32768,
                    "backends": [{"url": upstream}]}],
        "policy": {"max_inflight_per_replica": 100000,
                   "queues": {"max_requests": 100000, "tenant_max_requests": 100000, "band_max_requests": 100000}},
    })


def _gateway_config_for(upstream_port: int, tokenizer: str | None, port: int = 0) -> str:
    cfg = json.loads(_gateway_config(f"http://127.0.0.1:{upstream_port}", port))
    if tokenizer:
        cfg["models"][0]["tokenizer"] = tokenizer
    return json.dumps(cfg)


def run_paced(seconds: float = 8.0, stream_counts: tuple[int, ...] = (64, 256),
              tokenizer: str | None = None, tokens: int = PACED_TOKENS) -> tuple[list[PacedRun], dict[str, str]]:
    """The paced stream case (`bouncer.bench.paced_streams`): a paced upstream and the client on
    core 0; Bouncer's proxy, Envoy alone, Envoy + Bouncer's picker (both setups), nginx and
    vllm-router on core 1, each run at each stream count."""
    up_port, gw_port = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        gateway = _gateway_config_for(up_port, tokenizer, gw_port)
        (work / "gateway.json").write_text(gateway)
        try:
            procs.append(subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer.bench.fast_upstream", "--port",
                                           str(up_port), "--pace-ms", str(PACE_MS), "--paced-tokens",
                                           str(tokens)]))
            procs.append(subprocess.Popen([*pinned(1), sys.executable, "-m", "bouncer", "serve", "--config",
                                           str(work / "gateway.json"), "--log-level", "warning"],
                                          stdout=subprocess.DEVNULL))
            wait_ok(f"http://127.0.0.1:{up_port}/metrics")
            wait_ok(f"http://127.0.0.1:{gw_port}/ready")
            peers, missing = start_peers(up_port, work, gateway, envoy_duplex=True)
            procs += [p for peer in peers for p in peer.procs]
            targets = [("direct", f"http://127.0.0.1:{up_port}", []),
                       ("bouncer", f"http://127.0.0.1:{gw_port}", [procs[1].pid])]
            targets += [(peer.name, peer.url, peer.pids) for peer in peers]
            for _name, url, _pids in targets:
                wait_ok(url + "/v1/models", timeout=60)
            runs = []
            for streams in stream_counts:
                for name, url, pids in targets:
                    measure(name, url + "/v1/completions", pids, BENCH_KEY, min(streams, 16), 1.0, 0, pinned,
                            cpu_seconds, tokens)  # warm-up
                    runs.append(measure(name, url + "/v1/completions", pids, BENCH_KEY, streams, seconds, 0, pinned,
                                        cpu_seconds, tokens))
            return runs, missing
        finally:
            stop(procs)


def run_overhead(seconds: int = 5, concurrencies: tuple[int, ...] = (1, 16, 64), tokenizer: str | None = None,
                 rounds: int = 3) -> tuple[list[Run], dict, dict[str, str]]:
    """The runs; what one flight-recorder sample cost the recording gateway (its own count, CPU
    time of the sampling thread); and the peers that are missing (`bouncer.bench.peer_proxies`). The
    two gateways are measured in `rounds` alternating rounds (the report takes each one's
    median), the upstream alone and each peer once."""
    if not shutil.which("wrk"):
        raise SystemExit("bouncer bench overhead needs wrk (Debian/Ubuntu: apt-get install wrk)")
    up_port, gw_port, off_port, traced_port, sampled_port, sink_port = (free_port() for _ in range(6))
    procs = []
    sink: subprocess.Popen | None = None
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        for name, port, recorder, sink, ratio in (
                ("gateway", gw_port, True, None, 1.0), ("gateway-off", off_port, False, None, 1.0),
                ("gateway-traced", traced_port, True, sink_port, 1.0),
                ("gateway-sampled", sampled_port, True, sink_port, TRACED_SHARE)):
            cfg = json.loads(_gateway_config(f"http://127.0.0.1:{up_port}", port, recorder, sink, ratio))
            if tokenizer:
                cfg["models"][0]["tokenizer"] = tokenizer
            (work / f"{name}.yaml").write_text(json.dumps(cfg))
        try:
            # taskset execs the server, so these pids are the servers' own (CPU time is read from them)
            procs.append(subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer.bench.fast_upstream",
                                           "--port", str(up_port)]))
            for name in ("gateway", "gateway-off", "gateway-traced", "gateway-sampled"):
                procs.append(subprocess.Popen([*pinned(1), sys.executable, "-m", "bouncer", "serve", "--config",
                                               str(work / f"{name}.yaml"), "--log-level", "warning"],
                                              stdout=subprocess.DEVNULL))
            # the traced gateways' collector, beside the upstream (its CPU is not the gateways'),
            # stopped after them (they send what they still hold as they stop)
            sink = subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer.bench.otlp_sink", "--port",
                                     str(sink_port)], stdout=subprocess.DEVNULL)
            wait_ok(f"http://127.0.0.1:{up_port}/metrics")
            for port in (gw_port, off_port, traced_port, sampled_port):
                wait_ok(f"http://127.0.0.1:{port}/ready")
            peers, missing = start_peers(up_port, work, _gateway_config_for(up_port, tokenizer))
            procs += [p for peer in peers for p in peer.procs]
            runs = []
            once = [("direct", (f"http://127.0.0.1:{up_port}/v1/chat/completions", [procs[0].pid]))] + [
                (peer.name, (peer.url + "/v1/chat/completions", peer.pids)) for peer in peers]
            gateways = {"bouncer": (f"http://127.0.0.1:{gw_port}/v1/chat/completions", [procs[1].pid]),
                        "bouncer-recorder-off": (f"http://127.0.0.1:{off_port}/v1/chat/completions", [procs[2].pid]),
                        "bouncer-tracing": (f"http://127.0.0.1:{traced_port}/v1/chat/completions", [procs[3].pid]),
                        "bouncer-tracing-sampled": (f"http://127.0.0.1:{sampled_port}/v1/chat/completions",
                                                    [procs[4].pid])}
            for stream in (False, True):
                for c in concurrencies:
                    # on, off, traced / traced, off, on / ...: no gateway always runs first (which
                    # was worth up to 18% here when two ran with the recorder off)
                    pairs = list(gateways.items())
                    order = once + [pair for i in range(rounds) for pair in pairs[::1 - 2 * (i % 2)]]
                    for target, (url, pids) in order:
                        _wrk(url, stream, c, 1, work)  # warm-up
                        cpu0 = sum(cpu_seconds(pid, children=True) for pid in pids)
                        rps, p50, p99, errors, total = _wrk(url, stream, c, seconds, work)
                        cpu_us = (sum(cpu_seconds(pid, children=True) for pid in pids) - cpu0) / max(1, total) * 1e6
                        runs.append(Run(target, stream, c, rps, p50, p99, errors, total, cpu_us))
            return runs, _recorder_stats(gw_port), missing
        finally:
            stop(procs)
            if sink is not None:
                stop([sink])


def _recorder_stats(port: int) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/timeline?last=0.001",
                                 headers={"Authorization": f"Bearer {BENCH_ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        header = json.loads(resp.read())["header"]
    return {k: header[k] for k in ("step_s", "samples_taken", "sample_cpu_us_mean", "bytes_held", "samples_held")}


def _median(runs: list[Run]) -> Run:
    """The run of median CPU per request."""
    return sorted(runs, key=lambda r: r.server_cpu_us_per_request)[len(runs) // 2]


def report(runs: list[Run], recorder: dict | None = None) -> str:
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault((r.target, r.stream, r.concurrency), []).append(r)
    by = {key: _median(rs) for key, rs in groups.items()}
    lines = ["| mode | conc. | direct req/s | Bouncer req/s | ratio | direct p50 / p99 ms | "
             "Bouncer p50 / p99 ms | added p50 ms | Bouncer CPU us/req | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (target, stream, c), r in by.items():
        if target != "direct":
            continue
        b = by[("bouncer", stream, c)]
        lines.append(f"| {'stream' if stream else 'plain'} | {c} | {r.rps:,.0f} | {b.rps:,.0f} | "
                     f"{b.rps / r.rps:.2f} | {r.p50_ms:.2f} / {r.p99_ms:.2f} | {b.p50_ms:.2f} / {b.p99_ms:.2f} | "
                     f"{b.p50_ms - r.p50_ms:.2f} | {b.server_cpu_us_per_request:.0f} | {r.errors + b.errors} |")
    rounds = len(groups.get(("bouncer", False, next(iter(by))[2]), []))
    lines += ["", f"The flight recorder on against off (medians of {rounds} alternating rounds each):", "",
              "| mode | conc. | CPU us/req on | CPU us/req off | on / off | sampling's share of CPU | "
              "req/s on | req/s off | errors |",
              "|---|---|---|---|---|---|---|---|---|"]
    per_sample = (recorder or {}).get("sample_cpu_us_mean")
    for (target, stream, c), on in by.items():
        off = by.get(("bouncer-recorder-off", stream, c))
        if target != "bouncer" or off is None:
            continue
        # the sampler's own CPU per second, over the gateway's CPU per second at this rate
        share = "–" if per_sample is None else \
            f"{per_sample / recorder['step_s'] / (on.server_cpu_us_per_request * on.rps):.3%}"
        lines.append(f"| {'stream' if stream else 'plain'} | {c} | {on.server_cpu_us_per_request:.0f} | "
                     f"{off.server_cpu_us_per_request:.0f} | "
                     f"{on.server_cpu_us_per_request / off.server_cpu_us_per_request - 1:+.1%} | {share} | "
                     f"{on.rps:,.0f} | {off.rps:,.0f} | {on.errors + off.errors} |")
    if per_sample is not None:
        lines += ["", f"One sample cost the recording gateway {per_sample:.0f} us of CPU on average "
                  f"({recorder['samples_taken']} samples, one every {recorder['step_s']} s; the ring held "
                  f"{recorder['samples_held']} samples in {recorder['bytes_held'] / 1024:.0f} KiB)."]
    lines += ["", f"Tracing on against off, both with the recorder on: every request traced (four spans, exported "
              f"over OTLP/gRPC to a collector on the upstream's core), and {TRACED_SHARE:.0%} of them "
              f"(sample_ratio {TRACED_SHARE}):", "",
              "| mode | conc. | CPU us/req off | all traced | added | sampled | added | req/s off / all / sampled | "
              "errors |", "|---|---|---|---|---|---|---|---|---|"]
    for (target, stream, c), off in by.items():
        on, sampled = by.get(("bouncer-tracing", stream, c)), by.get(("bouncer-tracing-sampled", stream, c))
        if target != "bouncer" or on is None or sampled is None:
            continue
        base = off.server_cpu_us_per_request
        lines.append(f"| {'stream' if stream else 'plain'} | {c} | {base:.0f} | "
                     f"{on.server_cpu_us_per_request:.0f} | {on.server_cpu_us_per_request / base - 1:+.0%} | "
                     f"{sampled.server_cpu_us_per_request:.0f} | {sampled.server_cpu_us_per_request / base - 1:+.0%} | "
                     f"{off.rps:,.0f} / {on.rps:,.0f} / {sampled.rps:,.0f} | "
                     f"{on.errors + off.errors + sampled.errors} |")
    return "\n".join(lines)


def peers_report(runs: list[Run], missing: dict[str, str]) -> str:
    """Bouncer beside each peer that ran: req/s, latency added over going direct, CPU per
    request, and Bouncer's CPU per request over the peer's."""
    by = {(r.target, r.stream, r.concurrency): r for r in runs if not r.target.startswith("bouncer")}
    bouncer = {}
    for r in runs:
        if r.target == "bouncer":
            bouncer.setdefault((r.stream, r.concurrency), []).append(r)
    names = sorted({t for t, _, _ in by} - {"direct"})
    lines = ["| mode | conc. | proxy | req/s | added p50 / p99 ms | CPU us/req | Bouncer's CPU / its |",
             "|---|---|---|---|---|---|---|"]
    for (stream, c), rs in bouncer.items():
        direct = by.get(("direct", stream, c))
        b = _median(rs)
        for name in ["bouncer", *names]:
            r = b if name == "bouncer" else by.get((name, stream, c))
            if r is None or direct is None:
                continue
            ratio = "" if name == "bouncer" else f"{b.server_cpu_us_per_request / r.server_cpu_us_per_request:.1f}x"
            lines.append(f"| {'stream' if stream else 'plain'} | {c} | {name} | {r.rps:,.0f} | "
                         f"{r.p50_ms - direct.p50_ms:.2f} / {r.p99_ms - direct.p99_ms:.2f} | "
                         f"{r.server_cpu_us_per_request:.0f} | {ratio} |")
    lines += [f"{name}: missing ({how})" for name, how in missing.items()]
    return "\n".join(lines)


def main(seconds: int, out: str | None, tokenizer: str | None, paced_seconds: float = 8.0,
         paced_only: bool = False, paced: bool = True, paced_tokens: int = PACED_TOKENS) -> None:
    runs: list[Run] = []
    recorder: dict = {}
    missing: dict[str, str] = {}
    if not paced_only:
        runs, recorder, missing = run_overhead(seconds, tokenizer=tokenizer)
        print(report(runs, recorder))
        print()
        print(peers_report(runs, missing))
        print()
    paced_runs, paced_missing = run_paced(paced_seconds, tokenizer=tokenizer, tokens=paced_tokens) \
        if paced else ([], {})
    if paced:
        print(f"Paced streams ({paced_tokens} tokens each, one write every {PACE_MS:g} ms):")
        print(paced_report(paced_runs))
    if out:
        pathlib.Path(out).write_text(json.dumps({"runs": [asdict(r) for r in runs], "recorder": recorder,
                                                 "missing_peers": {**missing, **paced_missing},
                                                 "paced_tokens": paced_tokens,
                                                 "paced": [asdict(r) for r in paced_runs]}, indent=2))
        print(f"saved {out}")
