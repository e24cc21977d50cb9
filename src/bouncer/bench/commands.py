"""The lab's commands: `bouncer engine` (the simulated engine served over HTTP) and `bouncer bench
...` (the benchmarks), apart from the product's (`bouncer.cli`)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bouncer.event_loop import run_async as _run


def _engine_model_from_args(args):
    from bouncer.sim.engine import EngineModel
    from bouncer.sim.profiles import get_profile

    profile = get_profile(args.profile)
    return EngineModel(profile, num_blocks=args.kv_blocks, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, policy=args.scheduling_policy,
                       max_num_queued_reqs=args.max_num_queued_reqs,
                       max_num_queued_tokens=args.max_num_queued_tokens)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from bouncer.sim.profiles import DEFAULT_PROFILE, PROFILES

    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                   help="model/GPU pair whose step times and KV size are modelled")
    p.add_argument("--kv-blocks", type=int, help="KV blocks in the pool (default: the profile's)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the profile's, 16)")
    p.add_argument("--max-num-seqs", type=int, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, help="context length")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--max-num-queued-reqs", type=int, help="refuse with 503 beyond this many requests")
    p.add_argument("--max-num-queued-tokens", type=int, help="refuse with 503 beyond this many queued prompt tokens")


def cmd_engine(args) -> None:
    from bouncer.engine_server import EngineServer, serve_engine
    from bouncer.tokenizer import PromptTokenizer

    engine = _engine_model_from_args(args)
    publisher = _kv_event_publisher(args.kv_events_config, engine.block_size)
    server = EngineServer(engine, model_name=args.model, speed=args.speed,
                          tokenizer=PromptTokenizer(args.tokenizer), seed=args.seed, kv_events=publisher,
                          kv_connector=f"{args.host}:{args.port}" if args.kv_connector else None)
    if publisher is not None:
        print(f"bouncer engine: KV events on {publisher.endpoint}", flush=True)
    print(f"bouncer engine: model {args.model!r} ({args.profile}, {engine.pool.num_blocks} KV blocks of "
          f"{engine.block_size}, max_num_seqs {engine.max_num_seqs}, speed x{args.speed}) on "
          f"http://{args.host}:{args.port}", flush=True)
    _run(serve_engine(server, args.host, args.port))


def _kv_event_publisher(config: str | None, block_size: int):
    """vLLM's --kv-events-config JSON: {"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://*:5557", "topic": ""}."""
    if not config:
        return None
    from bouncer.engine_server import KVEventPublisher

    try:
        cfg = json.loads(config)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"bouncer engine: --kv-events-config is not JSON: {exc}") from None
    if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events"):
        return None
    if cfg.get("publisher", "zmq") != "zmq":
        raise SystemExit("bouncer engine: only the zmq KV-event publisher is supported")
    return KVEventPublisher(cfg.get("endpoint", "tcp://*:5557"), cfg.get("topic", ""), block_size)


def cmd_bench_engine(args) -> None:
    from bouncer.sim.engine_replay import replay
    from bouncer.sim.traces import load_azure

    if args.trace is None:
        from bouncer.sim.scenarios import AZURE_CONV

        args.trace = str(AZURE_CONV)
    trace = load_azure(args.trace)
    engine = _engine_model_from_args(args)
    s = replay(engine, trace, args.duration)
    print(f"trace {args.trace}: {s.requests} requests over {s.sim_seconds:.0f} simulated seconds, "
          f"profile {args.profile}")
    print(f"  completed {s.completed}, refused {s.refused}, preemptions {s.preemptions}, "
          f"max waiting {s.max_waiting}, max KV usage {s.max_kv_usage:.2f}")
    print(f"  TTFT p50 {s.ttft_p50 * 1e3:.1f} ms, p99 {s.ttft_p99 * 1e3:.1f} ms; TPOT p50 "
          f"{s.tpot_p50 * 1e3:.2f} ms; e2e p99 {s.e2e_p99:.2f} s")
    print(f"  {s.steps} engine steps in {s.wall_seconds:.2f} s wall: "
          f"{s.speedup:.0f} simulated seconds per wall second")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**{k: getattr(s, k) for k in s.__slots__}, "speedup": s.speedup,
                       "profile": args.profile, "trace": args.trace}, f, indent=2)


def cmd_bench_overhead(args) -> None:
    from bouncer.bench.overhead import main as overhead
    from bouncer.tokenizer import default_tokenizer_path

    overhead(args.seconds, args.out, None if args.no_tokenizer else str(default_tokenizer_path()),
             paced_seconds=args.paced_seconds, paced_only=args.paced_only, paced=not args.no_paced,
             paced_tokens=args.paced_tokens)


def cmd_bench_flood(args) -> None:
    from bouncer.bench.flood import main as flood

    flood(args.clients, args.seconds, args.out, args.gateway_pythonpath)


def cmd_bench_gateways(args) -> None:
    from bouncer.bench.gateway_processes import main as gateways

    gateways(args.gateways, args.engines, args.seconds, args.out, args.contention_seconds, args.faults,
             args.faults_only)


def cmd_bench_long_prompts(args) -> None:
    from bouncer.bench.long_prompts import main as long_prompts

    long_prompts(args.sessions, args.steps, args.out)


def _gateway_setup(args):
    from bouncer.sim.several_gateways import GatewaySetup

    if args.gateways == 1 and (args.state_delay_ms is not None or args.spread != "request"):
        raise SystemExit("bouncer bench run: --state-delay-ms and --spread need --gateways 2 or more")
    delay = None if args.state_delay_ms is None else args.state_delay_ms / 1000
    try:
        return GatewaySetup(args.gateways, delay, args.spread)
    except ValueError as exc:
        raise SystemExit(f"bouncer bench run: {exc}") from None


def cmd_bench_run(args) -> None:
    from bouncer.bench.goodput import run, save
    from bouncer.recorder.timeline import Timeline

    if args.scenario == "agents":
        if args.trace_start is not None or args.servegen_tenancy != "banded":
            raise SystemExit("bouncer bench run: --trace-start and --servegen-tenancy are for a ServeGen trace; "
                             "the agents scenario replays agent sessions")
        return _bench_agents(args)
    timeline = None
    if args.record:
        timeline = Timeline(args.record_step, float("inf"), clock="virtual",
                            source=f"bench run {args.scenario} {args.policy} load {args.load:g}")
    try:
        result = run(args.scenario, args.policy, args.load, seed=args.seed, replicas=args.replicas,
                     duration_s=args.duration, trace=args.trace, profile=args.profile, routing=args.routing,
                     kv_events=args.kv_events,
                     only_tenants=args.only_tenants.split(",") if args.only_tenants else None,
                     policy_set=_policy_settings(args.set), step_time=args.step_time, record=timeline,
                     gateways=_gateway_setup(args), trace_start_h=args.trace_start,
                     tenancy=args.servegen_tenancy, cache_isolation=args.cache_isolation)
    except ValueError as exc:
        raise SystemExit(f"bouncer bench run: {exc}") from None
    if timeline is not None:
        timeline.write(args.record)
        result["recording"] = args.record
        print(f"recorded {len(timeline)} samples to {args.record}: `bouncer recorder {args.record}` shows them")
    if args.out:  # first: the summary below may go to a pipe that closes early
        save(result, args.out)
    o = result["outcomes"]
    print(f"{result['scenario']} / {result['policy']} at load {result['load']} "
          f"(capacity {result['capacity_rps']:.1f} req/s, {result['replicas']} replicas): "
          f"goodput {result['goodput_rps']:.2f} req/s; offered {result['offered']}, completed {o['completed']}, "
          f"refused {o['refused']}, expired {o['expired']}, abandoned {o['abandoned']}, lost {result['lost']}")
    for name, t in result["tenants"].items():
        att = "-" if t["slo_attainment"] is None else f"{t['slo_attainment']:.1%}"
        print(f"  {name:>10} (priority {t['priority']}): SLO attainment {att}, token share "
              f"{t['served_token_share']:.1%}")
    for reason, a in (result.get("retry_after_accuracy") or {}).items():
        if a["median_ratio"] is not None:
            print(f"  Retry-After on {reason}: {a['median_ratio']:.2f}x (p10 {a['p10_ratio']:.2f}, p90 "
                  f"{a['p90_ratio']:.2f}) the time until the tenant's next request got in, {a['refusals']} refusals")
    print(f"  simulated {result['sim_seconds']:.0f} s in {result['wall_seconds']:.1f} s "
          f"({result['sim_seconds_per_wall_second']:.0f} sim s per wall s)")


def _policy_settings(items: list[str]) -> dict:
    """`--set retries.deadline=first-attempt` (repeatable) as a nested dict; values are read as
    YAML, so numbers and booleans keep their types."""
    import yaml

    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set wants KEY=VALUE (a policy setting, dotted for nested ones), not {item!r}")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def _bench_agents(args) -> None:
    from bouncer.bench import agents
    from bouncer.bench.goodput import save

    if args.policy not in agents.AGENT_POLICIES:
        raise SystemExit(f"bouncer: the agents scenario compares {', '.join(agents.AGENT_POLICIES)}")
    result = agents.run(args.policy, args.sessions, duration_s=args.duration, replicas=args.replicas,
                        seed=args.seed, trace=args.trace, profile=args.profile, gateways=_gateway_setup(args),
                        policy_set=_policy_settings(args.set))
    if args.out:
        save(result, args.out)
    print(f"agents / {result['policy']} with {result['sessions']} concurrent sessions on {result['replicas']} "
          f"replicas: {result['sessions_completed_per_hour']:.1f} sessions/h completed "
          f"({result['sessions_failed']} failed), prefix hit rate {result['prefix_hit_rate']:.1%}, "
          f"{result['recomputed_tokens']:,} tokens recomputed; simulated {result['sim_seconds']:.0f} s "
          f"in {result['wall_seconds']:.1f} s")


def cmd_bench_hashing(args) -> None:
    from bouncer.bench.hashing import main as hashing

    hashing(args.tokens, args.repeats, args.out)


def cmd_bench_feasibility(args) -> None:
    from bouncer.bench.feasibility import main as feasibility

    feasibility(args.scenario, args.load, args.steady_load, args.replicas, args.duration, args.seed, args.samples,
                args.out)


def cmd_bench_demand(args) -> None:
    from bouncer.bench.demand_signal import main as demand

    demand(args.scenario, args.load, args.arrivals, args.duration, args.seed, args.trace, args.out)


def cmd_bench_autoscaling(args) -> None:
    from bouncer.bench.autoscaling import main as autoscaling

    autoscaling(args.scenario, args.admission, args.signal, args.startup, args.seed, args.out)


def cmd_bench_overflow(args) -> None:
    from bouncer.bench import quotas_overflow

    quotas_overflow.main(args.scenario, args.load, args.spare, args.seed, args.out)


def cmd_bench_provisioner(args) -> None:
    from bouncer.bench.live_provisioner import run

    engine_args = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    run(args.metrics, args.model, args.file, engine_args, args.scope, args.target, args.min, args.max, args.startup,
        args.interval, args.window, args.scale_down_window, args.drain, args.duration)


def cmd_bench_live(args) -> None:
    try:
        import openai  # noqa: F401 (the clients it drives the gateway with)
    except ImportError:
        sys.exit("bouncer bench live needs the openai SDK: pip install 'bouncer[bench]'")
    from bouncer.bench import live

    if not 0 <= args.warm_up < args.duration:
        sys.exit(f"--warm-up ({args.warm_up:g} s) must be at least 0 and shorter than --duration ({args.duration:g} s)")
    if args.warm_up and args.driver == "guidellm":
        sys.exit("--warm-up counts a replayed trace's requests; the guidellm driver counts its whole run")
    fleet = live.LiveFleet(engines=args.engines, profile=args.profile, speed=args.speed, kv_blocks=args.kv_blocks,
                           max_num_seqs=args.max_num_seqs)
    for load in args.load:
        if args.driver == "guidellm":
            result = live.run_flood(load, args.duration, fleet, seed=args.seed, step_time=args.step_time,
                                    guidellm_bin=args.guidellm, skip_direct=args.skip_direct, epp=args.epp)
        else:
            result = live.run(args.scenario, load, args.duration, fleet, seed=args.seed, step_time=args.step_time,
                              trace=args.trace, skip_direct=args.skip_direct, warm_up_s=args.warm_up)
        print(live.report(result), flush=True)
        if args.out:
            out = pathlib.Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            warm = f"-after{args.warm_up:g}s" if args.warm_up else ""
            path = out / f"{result['scenario']}-{load:g}-{args.step_time}{warm}.json"
            path.write_text(json.dumps(result, indent=1))
            print(f"  wrote {path}")


def cmd_bench_core(args) -> None:
    from bouncer.bench.core_cost import main as core_cost

    core_cost(args.scenario, args.load, args.duration, args.replicas, args.out, trace=args.trace)


def cmd_bench_report(args) -> None:
    from bouncer.bench.report import write_report

    print(f"wrote {write_report(args.files, args.out)}")


def add_lab_commands(sub) -> None:
    """`bouncer engine` (the engine stand-in) and `bouncer bench ...` on the main parser's subcommands."""
    p = sub.add_parser("engine", help="serve the simulated vLLM-like engine over HTTP (OpenAI API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model", default="demo-llm", help="served model name")
    p.add_argument("--speed", type=float, default=1.0, help="run the model clock this many times faster")
    p.add_argument("--tokenizer", help="tokenizer.json (default: Bouncer's bundled one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-events-config", help="publish KV-cache events as vLLM does, e.g. "
                                              "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                                              "\"endpoint\": \"tcp://127.0.0.1:5557\"}'")
    p.add_argument("--kv-connector", action="store_true",
                   help="speak vLLM's P/D protocol (kv_transfer_params), as vLLM with --kv-transfer-config does: "
                        "serve as a prefill or a decode worker of a disaggregated fleet")
    _add_engine_args(p)
    p.set_defaults(func=cmd_engine)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("engine", help="replay a trace against one engine model in virtual time")
    p.add_argument("--trace", help="an Azure LLM trace CSV (default: the Azure 2023 conversation trace in data/traces)")
    p.add_argument("--duration", type=float, help="only arrivals in the first N seconds")
    p.add_argument("--out", help="write the summary as JSON")
    _add_engine_args(p)
    p.set_defaults(func=cmd_bench_engine)
    _add_bench_run(bench)
    _add_simulated_benches(bench)
    _add_real_time_benches(bench)
    _add_process_benches(bench)


def _add_bench_run(bench) -> None:
    from bouncer.bench.goodput import POLICIES, STEP_TIMES
    from bouncer.core.registry import ROUTERS
    from bouncer.sim.scenarios import SCENARIOS, SERVEGEN_TENANCIES

    p = bench.add_parser("run", help="one goodput run in the fleet simulator")
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--policy", required=True, choices=POLICIES + ("request-cap",),
                   help="request-cap: the agents scenario's request-level concurrency cap")
    p.add_argument("--sessions", type=int, default=32, help="agents scenario: concurrent agent sessions")
    p.add_argument("--load", type=float, default=1.0, help="offered load as a multiple of the fleet's capacity")
    p.add_argument("--trace", help="replace the scenario's main trace (same format); a ServeGen client folder "
                                    "replaces its tenants: one per client")
    p.add_argument("--trace-start", type=float, metavar="HOURS",
                   help="a ServeGen trace: replay the hour from this many hours into it (default: its busiest)")
    p.add_argument("--servegen-tenancy", choices=SERVEGEN_TENANCIES, default="banded",
                   help="a ServeGen trace: banded (its heaviest clients in a band below the others, equal "
                        "weights) or volume-weighted (one band, each client weighted by its share of requests)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=300.0, help="simulated seconds of arrivals")
    p.add_argument("--profile", default="llama-3.1-8b-h100")
    p.add_argument("--routing", choices=sorted(ROUTERS), help="override the policy's router")
    p.add_argument("--kv-events", action="store_true",
                   help="engines publish KV-cache events; Bouncer's prefix index follows them")
    p.add_argument("--cache-isolation", action="store_true",
                   help="bouncer: each tenant's prompt prefixes in a cache of its own on the engines (the "
                        "production default; benchmarks run without unless asked)")
    p.add_argument("--only-tenants", metavar="NAME,...",
                   help="send only these tenants' requests (the same arrivals; capacity and load still "
                        "count the whole mix): what a band gets with the others perfectly isolated")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change one of the policy's settings for this run (bouncer and llmd-flow-control), "
                        "e.g. retries.deadline=first-attempt; repeatable")
    p.add_argument("--step-time", choices=STEP_TIMES, default="given",
                   help="what Bouncer knows of the engines' step time: given (the profile's coefficients in its "
                        "config), learned (fitted online from its requests) or off (no latency prediction)")
    p.add_argument("--gateways", type=int, default=1, metavar="N",
                   help="N gateways, each with its own core, clients spread over them (bouncer and "
                        "llmd-flow-control); they share nothing unless --state-delay-ms is given")
    p.add_argument("--state-delay-ms", type=float, metavar="D",
                   help="the gateways share state (rate limits, retries, each replica's load and tenants' "
                        "service) as on Redis, each seeing the others' part D ms late")
    p.add_argument("--spread", choices=("request", "tenant"), default="request",
                   help="how clients reach the gateways: request (each attempt anywhere, an agent's session "
                        "on one), tenant (each tenant on one gateway)")
    p.add_argument("--out", help="write the result JSON")
    p.add_argument("--record", metavar="FILE", help="write the flight recorder's samples of the run (JSON Lines, "
                   ".gz to compress) for `bouncer recorder FILE`")
    p.add_argument("--record-step", type=float, default=0.25, metavar="S", help="seconds between samples")
    p.set_defaults(func=cmd_bench_run)


def _add_simulated_benches(bench) -> None:
    """Benchmarks in the fleet simulator, apart from `bench run`."""
    from bouncer.sim.scenarios import SCENARIOS

    p = bench.add_parser("hashing", help="chained block hashes against tokenizing, on one long prompt")
    p.add_argument("--tokens", type=int, default=131_072, help="prompt length")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", help="write the numbers as JSON")
    p.set_defaults(func=cmd_bench_hashing)

    p = bench.add_parser("feasibility", help="latency predictor error, and paired runs that let refused "
                                             "deadline_infeasible requests through")
    p.add_argument("--scenario", default="surge", choices=["rogue-tenant", "consolidation", "fairness", "surge"])
    p.add_argument("--load", type=float, default=2.0, help="load factor of the paired runs")
    p.add_argument("--steady-load", type=float, default=0.7, help="load factor the predictor error is measured at")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=30, help="refused requests let through, one paired run each")
    p.add_argument("--out", help="write the result JSON")
    p.set_defaults(func=cmd_bench_feasibility)

    p = bench.add_parser("demand", help="the demand signal for autoscalers: one replica offered N x its capacity, "
                                        "does bouncer_demand_replicas read N?")
    p.add_argument("--scenario", nargs="+", default=["surge"], choices=[s for s in SCENARIOS if s != "agents"])
    p.add_argument("--load", type=float, nargs="+", default=[1.0, 2.0, 3.0], help="offered load(s), multiples of "
                   "one replica's capacity")
    p.add_argument("--arrivals", nargs="+", choices=("steady", "trace"), default=["steady", "trace"],
                   help="steady: Poisson arrivals of the traces' requests; trace: each trace's own arrival pattern")
    p.add_argument("--trace", help="replace the scenario's main trace (a ServeGen folder: its clients as tenants)")
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the result JSON")
    p.set_defaults(func=cmd_bench_demand)

    from bouncer.bench.autoscaling import ADMISSIONS, SIGNALS
    from bouncer.bench.autoscaling import SCENARIOS as AUTOSCALING
    p = bench.add_parser("autoscaling", help="an HPA-like autoscaler with a start-up delay on three signals, with "
                                             "and without admission: goodput, the protected band, replica-minutes")
    p.add_argument("--scenario", nargs="+", choices=AUTOSCALING, default=list(AUTOSCALING))
    p.add_argument("--admission", nargs="+", choices=ADMISSIONS, default=list(ADMISSIONS))
    p.add_argument("--signal", nargs="+", choices=SIGNALS, default=list(SIGNALS))
    p.add_argument("--startup", type=float, default=300.0, help="seconds from asking for a replica to its serving")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the result JSON (with each run's autoscaler history)")
    p.set_defaults(func=cmd_bench_autoscaling)

    p = bench.add_parser("overflow", help="quotas and overflow in the simulator: a provisioned-throughput tenant "
                         "refused or demoted past its quota; a saturated pool refusing or diverting to a spare pool")
    p.add_argument("--scenario", nargs="+", choices=["demote", "divert"], default=["demote", "divert"])
    p.add_argument("--load", type=float, nargs="+", default=[2.0], help="divert: offered load over the primary's "
                   "capacity")
    p.add_argument("--spare", type=int, nargs="+", default=[2], help="divert: the spare pool's replicas (the "
                   "primary has 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the rows as JSON here")
    p.set_defaults(func=cmd_bench_overflow)


def _add_real_time_benches(bench) -> None:
    """Benchmarks in real time, against `bouncer engine` processes."""
    from bouncer.sim.scenarios import SCENARIOS

    p = bench.add_parser("provisioner", help="a stand-in for KEDA: starts and stops `bouncer engine` replicas on "
                                             "the gateways' demand gauge, listing them in a discovery file")
    p.add_argument("--metrics", nargs="+", required=True, metavar="URL", help="each gateway's /metrics URL")
    p.add_argument("--model", required=True)
    p.add_argument("--file", required=True, help="the discovery file the gateways watch (models[].discovery.file)")
    p.add_argument("--scope", choices=("all", "protected"), default="all")
    p.add_argument("--target", type=float, default=0.8, help="demand per replica (KEDA's threshold)")
    p.add_argument("--min", type=int, default=0, help="fewest replicas (0: scale to zero)")
    p.add_argument("--max", type=int, default=4)
    p.add_argument("--startup", type=float, default=10.0, help="seconds from asking for a replica to starting it")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between decisions")
    p.add_argument("--window", type=float, default=10.0, help="seconds the gauge is averaged over")
    p.add_argument("--scale-down-window", type=float, default=30.0, help="the HPA's scale-down stabilisation")
    p.add_argument("--drain", type=float, default=30.0, help="longest a replica taken out finishes its requests")
    p.add_argument("--duration", type=float, default=300.0, help="seconds before it stops (and its engines)")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then the `bouncer engine` arguments")
    p.set_defaults(func=cmd_bench_provisioner)

    p = bench.add_parser("live", help="Bouncer in real time in front of `bouncer engine` processes, beside the same "
                                      "traffic straight to the engines and the simulator's prediction of both")
    p.add_argument("--driver", choices=("trace", "guidellm"), default="trace",
                   help="trace: the scenario's requests replayed open loop through the openai SDK; guidellm: "
                        "guidellm flooding as a sheddable tenant, a top tenant streaming beside it")
    p.add_argument("--scenario", default="consolidation", choices=[s for s in SCENARIOS if s != "agents"],
                   help="with --driver trace")
    p.add_argument("--guidellm", help="the guidellm executable (default: $BOUNCER_GUIDELLM, .venv-guidellm)")
    p.add_argument("--load", type=float, nargs="+", default=[2.0], help="offered load(s), multiples of capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (real time)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--profile", default="llama-3.1-8b-h100")
    p.add_argument("--speed", type=float, default=0.25, help="the engines' --speed (0.25: 4x slower than the profile)")
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--step-time", choices=("learned", "given"), default="learned",
                   help="what the gateway is told of the engines' step time (and the simulated Bouncer too)")
    p.add_argument("--trace", help="replace the scenario's main trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-direct", action="store_true", help="do not run the traffic straight to the engines")
    p.add_argument("--epp", action="store_true", help="guidellm driver: also run it through Envoy with Bouncer as "
                                                      "its endpoint picker (bouncer serve --mode epp)")
    p.add_argument("--warm-up", type=float, default=0.0,
                   help="with --driver trace: count only the requests that arrive after this many seconds")
    p.add_argument("--out", help="a folder for the result JSON files")
    p.set_defaults(func=cmd_bench_live)

    p = bench.add_parser("core", help="the admission core's microseconds per call on a simulated workload")
    p.add_argument("--scenario", default="surge", choices=[s for s in SCENARIOS if s != "agents"])
    p.add_argument("--load", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--trace", help="replace the scenario's main trace (a ServeGen folder: its clients as tenants)")
    p.add_argument("--out", help="write the numbers as JSON")
    p.set_defaults(func=cmd_bench_core)

    p = bench.add_parser("report", help="Markdown and plots from `bench run` result files")
    p.add_argument("files", nargs="+", help="result JSON files or folders of them")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_bench_report)


def _add_process_benches(bench) -> None:
    """The gateway's own cost, as processes under load."""
    p = bench.add_parser("flood", help="the rogue drill: 300 sheddable clients looping on long prompts against "
                         "the demo's fleet, one interactive client; its TTFT and the gateway's CPU per refusal")
    p.add_argument("--clients", type=int, default=300)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--gateway-pythonpath", metavar="DIR", help="run the gateway from another checkout's src/ "
                   "(to compare commits)")
    p.add_argument("--out", help="write the result as JSON")
    p.set_defaults(func=cmd_bench_flood)

    p = bench.add_parser("gateways", help="several gateway processes behind one spreading client, each alone and "
                         "then sharing a redis-server of its own: tenants' admitted rates against their limits")
    p.add_argument("--gateways", type=int, default=3)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0, help="per run (two runs)")
    p.add_argument("--contention-seconds", type=float, default=60.0,
                   help="then the gateways scenario through 1, 3 independent and 3 sharing gateways, each tenant "
                        "on its own, for this long each (0: skip)")
    p.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                   help="then three gateways sharing Redis through a Redis killed for 10 s and a gateway killed "
                        "mid-stream, fail-open and fail-closed (about 2 minutes)")
    p.add_argument("--faults-only", action="store_true", help="only that last part (--out gets its runs)")
    p.add_argument("--out", help="write the result as JSON")
    p.set_defaults(func=cmd_bench_gateways)

    p = bench.add_parser("long-prompts", help="gateway CPU and added latency for agent steps of 10k-130k tokens, "
                         "each extending the previous one, with the chat-segment token cache on and off")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--steps", type=int, default=13, help="steps a session (about 10k tokens each)")
    p.add_argument("--out", help="write the steps as JSON")
    p.set_defaults(func=cmd_bench_long_prompts)

    p = bench.add_parser("overhead", help="gateway overhead against a fast upstream, direct vs through Bouncer")
    p.add_argument("--seconds", type=int, default=5, help="per measurement")
    p.add_argument("--out", help="write the runs as JSON")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="estimate prompt tokens instead of running the bundled tokenizer")
    p.add_argument("--paced-seconds", type=float, default=8.0, help="per paced-stream measurement")
    p.add_argument("--paced-only", action="store_true", help="only the paced stream case (no wrk runs)")
    p.add_argument("--paced-tokens", type=int, default=64, help="each paced answer's length in tokens (the picker "
                                                                "pays per request, so longer answers dilute it)")
    p.add_argument("--no-paced", action="store_true", help="only the wrk runs (no paced stream case)")
    p.set_defaults(func=cmd_bench_overhead)
