"""Where the floor is under the endpoint picker's cost per request: Envoy with the picker's
ext_proc filter (as `bouncer envoy-config` sets it up) in front of the overhead benchmark's fast
upstream, and behind it

- `trivial: the request only`: a grpc.aio servicer that only answers each message and names the
  upstream as the destination (none of Bouncer's work), on uvloop as Bouncer runs; the filter
  sends nothing of the answer and there is no access log (the least any picker pays);
- `trivial: as Bouncer's setup`: the same servicer in `bouncer envoy-config`'s setup: it answers
  a streamed answer's first chunk and closes its stream (a whole answer's once it is routed, as
  Bouncer's picker does), and reads Envoy's access log (each request's end) without acting on it;
- `bouncer's process: trivial answers`: Bouncer's picker process (its control plane, scrapers,
  recorder and HTTP port all running) answering as the trivial servicer does, deciding nothing;
- `bouncer's process: the decision, trivial answers`: the same, with each request decided as
  Bouncer decides it (parse, tokenize, the core's offer, its first token and end) but answered
  as the trivial servicer answers: between the two, what the decision costs in place;
- `bouncer`: Bouncer's picker (`bouncer serve --mode epp`) in that setup.

Measured alike (`bouncer bench overhead`'s setup: the upstream and wrk on one core, Envoy and the
picker on the other): requests/s and p50 at concurrency 16 and 1, the CPU per request of the
picker and of Envoy at concurrency 16, and the picker's at concurrency 1; and, in this process, the
decision alone (what the `decision` case adds) made 5,000 times in a row, with no gRPC or Envoy
between: its CPU per request with everything it touches warm.

    python scripts/ext_proc_floor.py [--seconds 6] [--out floor.json]

`--paced` measures the same cases in the paced stream case instead (`bouncer bench overhead`'s:
each token its own write, 20 ms apart; 256 streams by default), beside vllm-router (where
`$BOUNCER_VLLM_ROUTER` names it) and Envoy alone: CPU per 1,000 tokens the client read, Envoy's
and the picker's apart, so Envoy's own share with a picker that costs nothing shows.

    BOUNCER_VLLM_ROUTER=.venv-peers/bin/vllm-router python scripts/ext_proc_floor.py --paced [--streams 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import subprocess
import sys
import tempfile

import yaml

from bouncer.bench.envoy_peers import envoy_binary, start_envoy
from bouncer.bench.loopback import cpu_seconds, free_port, pinned, stop, wait_ok
from bouncer.bench.overhead import BENCH_KEY, _gateway_config_for, _wrk
from bouncer.bench.paced_streams import PACE_MS, PACED_TOKENS, measure
from bouncer.bench.peer_proxies import start_vllm_router
from bouncer.config import parse_config
from bouncer.gateway.fronts.envoy_bootstrap import BUFFERED, bootstrap
from bouncer.tokenizer import default_tokenizer_path

TRIVIAL = '''
import asyncio, itertools, json, sys
import grpc, uvloop
from bouncer.gateway.fronts import envoy_wire_pb2 as pb
from bouncer.gateway.fronts.access_log_wire import access_log_service
from bouncer.gateway.fronts.ext_proc_wire import ext_proc_service

DEST = pb.HeaderValueOption(
    header=pb.HeaderValue(key="x-gateway-destination-endpoint", raw_value=sys.argv[2].encode()),
    append_action=pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
LOGGED = sys.argv[3] == "logged"
IDS = itertools.count()


class Trivial:
    async def Process(self, _requests, context):
        while (msg := await context.read()) is not grpc.aio.EOF:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                r = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                if msg.request_headers.end_of_stream:  # a GET: routed here, no body to wait for
                    r.request_headers.response.header_mutation.set_headers.append(DEST)
                    r.request_headers.response.clear_route_cache = True
                await context.write(r)
            elif kind == "request_body":
                r = pb.ProcessingResponse(request_body=pb.BodyResponse())
                r.request_body.response.header_mutation.set_headers.append(DEST)
                if LOGGED:  # as Bouncer's picker: the request id its access log entry is filtered on
                    r.request_body.response.header_mutation.set_headers.append(pb.HeaderValueOption(
                        header=pb.HeaderValue(key="x-bouncer-request-id", raw_value=b"bq-%d" % next(IDS)),
                        append_action=pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD))
                r.request_body.response.clear_route_cache = True
                await context.write(r)
                if LOGGED and not json.loads(msg.request_body.body).get("stream"):
                    return  # a whole answer: its end comes through the access log
            elif kind == "response_body":  # the first chunk, then done
                await context.write(pb.ProcessingResponse(response_body=pb.BodyResponse()))
                return


class Log:
    async def StreamAccessLogs(self, request_iterator, context):
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                entry.request.request_headers.get("x-bouncer-request-id")
        return pb.StreamAccessLogsResponse()


async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((ext_proc_service(Trivial().Process), access_log_service(Log().StreamAccessLogs)))
    server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
    await server.start()
    await server.wait_for_termination()

uvloop.install()
asyncio.run(main())
'''

# Bouncer's picker with its `_pick` replaced: the trivial servicer's answers (`bare`), and with
# `decide` the control plane's decision and end for each request as well
SPLIT = '''
import json, sys
from bouncer.gateway.fronts import envoy_wire_pb2 as pb
from bouncer.cli import main
from bouncer.core.outcomes import Refusal, Terminal
from bouncer.core.journey import Outcome
from bouncer.gateway.fronts import picker
from bouncer.gateway.fronts.ext_proc_wire import header_of, headers_of, refused, request_body, set_header

DECIDE = sys.argv[1] == "decide"
WHOLE = picker.Picker._pick


async def pick(self, first, context):
    if header_of(first.request_headers, ":method") != "POST":
        return await WHOLE(self, first, context)  # /v1/models, as Bouncer answers it
    await context.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
    raw = await request_body(context, self.plane.config.limits.max_body_bytes)
    if raw is None:
        return
    ex = self.plane.open_exchange("/v1/chat/completions", front="picker")
    rid = ex.rid
    if DECIDE:
        kind = picker.GENERATION.get(header_of(first.request_headers, ":path").partition("?")[0], "chat")
        decision = await self._admit(ex, kind, raw, headers_of(first.request_headers), None)
        if isinstance(decision, Refusal):
            await context.write(refused(decision))
            return
        parsed, d = decision
        url = self.plane.replica_url(d.replica)
        streamed = parsed.body.get("stream")
    else:
        url = self.plane.config.models[0].backends[0].url
        streamed = json.loads(raw).get("stream")
    out = Outcome(Terminal.CANCELLED, None, None)
    try:
        r = pb.ProcessingResponse(request_body=pb.BodyResponse())
        r.request_body.response.header_mutation.set_headers.extend(
            [set_header(picker.DESTINATION, await self._endpoint(url)), set_header(picker.REQUEST_ID, rid)])
        r.request_body.response.clear_route_cache = True
        await context.write(r)
        if streamed:  # a whole answer's stream is closed once routed, as Bouncer's picker does
            await context.read()  # the answer's first chunk
            await context.write(pb.ProcessingResponse(response_body=pb.BodyResponse()))
        out = Outcome(Terminal.COMPLETED, None, 16, self.clock())
        if DECIDE:
            self.plane.started(rid, out.first_token_at)
    finally:  # its permit goes back however the stream ends
        if DECIDE:
            self.plane.finish(ex, d, out, True)


picker.Picker._pick = pick
sys.argv = ["bouncer", *sys.argv[2:]]
main()
'''

CASES = ("trivial: the request only", "trivial: as Bouncer's setup", "bouncer's process: trivial answers",
         "bouncer's process: the decision, trivial answers", "bouncer")


def _measure(url: str, picker: int, envoy: int, seconds: int, work: pathlib.Path) -> dict:
    _wrk(url, False, 16, 1, work)  # warm-up
    before = cpu_seconds(picker), cpu_seconds(envoy)
    rps, p50, _p99, errors, total = _wrk(url, False, 16, seconds, work)
    picker_us = (cpu_seconds(picker) - before[0]) / max(1, total) * 1e6
    envoy_us = (cpu_seconds(envoy) - before[1]) / max(1, total) * 1e6
    before_c1 = cpu_seconds(picker)
    _rps1, p50_c1, _p99_1, errors_c1, total_c1 = _wrk(url, False, 1, seconds, work)
    picker_us_c1 = (cpu_seconds(picker) - before_c1) / max(1, total_c1) * 1e6
    return {"rps": round(rps), "p50_ms": p50, "errors": errors + errors_c1, "p50_ms_c1": p50_c1,
            "picker_cpu_us_per_request": round(picker_us), "envoy_cpu_us_per_request": round(envoy_us),
            "picker_cpu_us_per_request_c1": round(picker_us_c1)}


def _measure_paced(url: str, picker: int | None, envoy: int, streams: int, seconds: int, tokens: int) -> dict:
    """The paced stream case's client against `url`: Envoy's CPU and the picker's, apart, per
    1,000 tokens the client read."""
    url += "/v1/completions"
    measure("warm-up", url, [envoy], BENCH_KEY, min(streams, 16), 1.0, 0, pinned, cpu_seconds, tokens)
    before = cpu_seconds(picker) if picker else 0.0
    run = measure("run", url, [envoy], BENCH_KEY, streams, seconds, 0, pinned, cpu_seconds, tokens)
    picker_ms = (cpu_seconds(picker) - before) * 1e6 / max(1, run.tokens) if picker else 0.0
    return {"streams": streams, "tokens": run.tokens, "errors": run.errors, "ttfb_p50_ms": run.ttfb_p50_ms,
            "envoy_cpu_ms_per_1k_tokens": run.cpu_ms_per_1k_tokens,
            "picker_cpu_ms_per_1k_tokens": round(picker_ms, 2)}


def _start_case(name: str, up_port: int, work: pathlib.Path) -> tuple[str, list[subprocess.Popen]]:
    """Envoy (and, but for Envoy alone, its picker: procs[0]) for one case; the URL clients use."""
    if name == "envoy alone":
        started = start_envoy(up_port, work)
        assert started is not None
        return started
    cfg = json.loads(_gateway_config_for(up_port, str(default_tokenizer_path()), free_port()))
    cfg["picker"] = {"host": "127.0.0.1", "port": free_port()}
    (work / "bouncer.json").write_text(json.dumps(cfg))
    port = free_port()
    envoy_cfg = bootstrap(parse_config(cfg), listen_port=port, admin_port=None)
    if name.startswith("trivial"):
        hcm = envoy_cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        assert hcm["http_filters"][1]["typed_config"]["processing_mode"] == BUFFERED
        if name == CASES[0]:
            hcm["http_filters"][1]["typed_config"]["processing_mode"] = {**BUFFERED, "response_body_mode": "NONE"}
            hcm["access_log"] = []
        (work / "trivial.py").write_text(TRIVIAL)
        cmd = [sys.executable, str(work / "trivial.py"), str(cfg["picker"]["port"]), f"127.0.0.1:{up_port}",
               "plain" if name == CASES[0] else "logged"]
    else:
        serve = ["serve", "--mode", "epp", "--config", str(work / "bouncer.json"), "--log-level", "warning"]
        cmd = [sys.executable, "-m", "bouncer", *serve]
        if name.startswith("bouncer's process"):
            (work / "split.py").write_text(SPLIT)
            cmd = [sys.executable, str(work / "split.py"), "decide" if "decision" in name else "bare", *serve]
    (work / "envoy.yaml").write_text(yaml.safe_dump(envoy_cfg))
    procs = [subprocess.Popen([*pinned(1), *cmd], stdout=subprocess.DEVNULL)]
    procs.append(subprocess.Popen([*pinned(1), binary_or_exit(), "-c", str(work / "envoy.yaml"), "--concurrency",
                                   "1", "--use-dynamic-base-id", "--log-level", "error"], stdout=subprocess.DEVNULL))
    return f"http://127.0.0.1:{port}", procs


def hot_loop(up_port: int, n: int) -> float:
    """The decision the `decision` case makes in place, made `n` times in a row in this process
    (parse, tokenize, offer, first token, finish; no gRPC, no Envoy): its CPU us per request with
    everything it touches warm in the caches."""
    import time

    import uvloop
    from aiohttp import web
    from multidict import CIMultiDict

    from bouncer.bench.overhead import BODY
    from bouncer.core.journey import Outcome
    from bouncer.core.outcomes import Terminal
    from bouncer.gateway.control_plane import ControlPlane

    async def run() -> float:
        cfg = json.loads(_gateway_config_for(up_port, str(default_tokenizer_path()), free_port()))
        plane = ControlPlane(parse_config(cfg))
        runner = web.AppRunner(plane.http_app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", cfg["listen"]["port"]).start()
        try:
            while not all(plane.readiness().values()):  # its replica scraped
                await asyncio.sleep(0.05)
            raw = json.dumps(BODY).encode()
            headers = CIMultiDict({":method": "POST", ":path": "/v1/chat/completions",
                                   "authorization": f"Bearer {BENCH_KEY}", "content-type": "application/json"})

            async def one() -> None:
                ex = plane.open_exchange("/v1/chat/completions", front="picker")
                d = await plane.admit(ex, plane.parse(ex, "chat", raw, headers))
                now = plane.clock()
                plane.started(ex.rid, now)
                plane.finish(ex, d, Outcome(Terminal.COMPLETED, None, 16, now), True)

            for _ in range(500):
                await one()
            t0 = time.process_time()
            for _ in range(n):
                await one()
            return (time.process_time() - t0) / n * 1e6
        finally:
            await runner.cleanup()

    uvloop.install()
    return asyncio.run(run())


def binary_or_exit() -> str:
    binary = envoy_binary()
    if binary is None:
        sys.exit("no Envoy: make .venv-envoy/.installed")
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--paced", action="store_true",
                    help="the paced stream case instead of wrk: CPU per 1,000 streamed tokens, Envoy's and the "
                         "picker's apart, beside vllm-router ($BOUNCER_VLLM_ROUTER) and Envoy alone")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--paced-tokens", type=int, default=PACED_TOKENS)
    ap.add_argument("--out")
    args = ap.parse_args()
    binary_or_exit()
    up_port = free_port()
    results = {}
    upstream_cmd = [*pinned(0), sys.executable, "-m", "bouncer.bench.fast_upstream", "--port", str(up_port)]
    if args.paced:
        upstream_cmd += ["--pace-ms", str(PACE_MS), "--paced-tokens", str(args.paced_tokens)]
    names = ["vllm-router", "envoy alone", *CASES] if args.paced else list(CASES)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        upstream = subprocess.Popen(upstream_cmd)
        try:
            wait_ok(f"http://127.0.0.1:{up_port}/metrics")
            if not args.paced:
                results["decision in a hot loop"] = {"picker_cpu_us_per_request": round(hot_loop(up_port, 5000))}
            for name in names:
                if name == "vllm-router":
                    router = start_vllm_router(up_port)
                    started = (router.url, router.procs) if router else None
                else:
                    started = _start_case(name, up_port, work)
                if started is None:
                    print(f"{name}: not installed (make .venv-peers/.installed, then "
                          "BOUNCER_VLLM_ROUTER=.venv-peers/bin/vllm-router)")
                    continue
                url, procs = started
                try:
                    wait_ok(url + "/v1/models", timeout=60)
                    if args.paced:
                        picker = procs[0].pid if len(procs) == 2 else None
                        results[name] = _measure_paced(url, picker, procs[-1].pid, args.streams, args.seconds,
                                                       args.paced_tokens)
                    else:
                        results[name] = _measure(url + "/v1/chat/completions", procs[0].pid, procs[1].pid,
                                                 args.seconds, work)
                finally:
                    stop(procs)
        finally:
            stop([upstream])
    if args.paced:
        base = results.get("vllm-router", {}).get("envoy_cpu_ms_per_1k_tokens")
        print(f"{args.streams} streams, {args.paced_tokens}-token answers, one token every {PACE_MS:g} ms")
        print("| proxy | Envoy (or the proxy) CPU ms per 1,000 tokens | picker CPU ms | both | both over vllm-router | "
              "TTFB p50 ms |")
        print("|---|---|---|---|---|---|")
        for name, r in results.items():
            both = r["envoy_cpu_ms_per_1k_tokens"] + r["picker_cpu_ms_per_1k_tokens"]
            ratio = f"{both / base:.2f}x" if base else "-"
            print(f"| {name} | {r['envoy_cpu_ms_per_1k_tokens']:.1f} | {r['picker_cpu_ms_per_1k_tokens']:.1f} | "
                  f"{both:.1f} | {ratio} | {r['ttfb_p50_ms']:.1f} |")
    else:
        print("| picker | req/s at concurrency 16 | p50 ms | p50 ms at concurrency 1 | picker CPU us/req | "
              "Envoy CPU us/req | picker CPU us/req at concurrency 1 |")
        print("|---|---|---|---|---|---|---|")
        hot = results.pop("decision in a hot loop")
        for name, r in results.items():
            print(f"| {name} | {r['rps']:,} | {r['p50_ms']:.2f} | {r['p50_ms_c1']:.2f} | "
                  f"{r['picker_cpu_us_per_request']:,} | {r['envoy_cpu_us_per_request']:,} | "
                  f"{r['picker_cpu_us_per_request_c1']:,} |")
        print(f"the decision alone, in a hot loop in one process: {hot['picker_cpu_us_per_request']} us of CPU "
              "a request")
        results["decision in a hot loop"] = hot
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
