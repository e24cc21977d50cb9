"""The `bouncer` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys

from bouncer.event_loop import run_async


def _engine_ports(text: str) -> tuple[int, ...]:
    try:
        ports = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ports separated by commas, got {text!r}") from None
    if not ports or any(not 0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be from 1 to 65535, got {text!r}")
    return ports


def cmd_serve(args) -> None:
    from bouncer.gateway import logs

    if args.config is None:
        if args.mode == "epp":
            raise SystemExit("bouncer: --mode epp needs --config (the backends Envoy sends to)")
        from bouncer.demo import DEMO_ENGINE_PORTS, run_demo

        logs.configure(args.log_level or "info", args.log_format or "logfmt")
        run_async(run_demo(args.host or "127.0.0.1", args.port or 8000, args.engine_ports or DEMO_ENGINE_PORTS))
        return
    if args.engine_ports:
        raise SystemExit("bouncer: --engine-ports is for the embedded demo; a config names its backends")
    from bouncer.config import load_config
    from bouncer.gateway.control_plane import ControlPlane, until_terminated

    config = load_config(args.config)
    logs.configure(args.log_level or config.logging.level, args.log_format or config.logging.format)
    # loads tokenizers and checks what the front can serve: a bad file stops here
    plane = ControlPlane(config, config_path=args.config, front="picker" if args.mode == "epp" else "proxy")
    host = args.host or config.listen.host
    port = args.port or config.listen.port
    models = ", ".join(m.name for m in config.models)
    if args.mode == "epp":
        from bouncer.gateway.fronts.picker import serve_picker

        where = f"{config.picker.host}:{config.picker.port}"
        serving = serve_picker(plane, host, port, on_listening=lambda: print(
            f"bouncer: endpoint picker (ext_proc) on {where}, metrics and admin on http://{host}:{port}, for models "
            f"{models}", flush=True))
    else:
        from bouncer.gateway.fronts.proxy import serve_proxy

        serving = serve_proxy(plane, host, port, on_listening=lambda: print(
            f"bouncer: gateway on http://{host}:{port} for models {models}", flush=True))
    try:
        run_async(until_terminated(plane, serving))
    except OSError as exc:  # the address is taken, say
        raise SystemExit(f"bouncer: cannot listen: {exc}") from None


def cmd_envoy_config(args) -> None:
    import shlex

    import yaml

    from bouncer.config import load_config
    from bouncer.gateway.fronts.envoy_bootstrap import PickerClientTLS, bootstrap

    config = load_config(args.config)
    for where in [args.listen, *(args.picker or [])]:
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"bouncer envoy-config: --listen and --picker take HOST:PORT, not {where!r}")
    host, _, port = args.listen.rpartition(":")
    if (args.picker_client_cert is None) != (args.picker_client_key is None) or (
            args.picker_ca is None and (args.picker_client_cert or args.picker_name)):
        raise SystemExit("bouncer envoy-config: --picker-client-cert and --picker-client-key go together, and both "
                         "and --picker-name with --picker-ca")
    tls = PickerClientTLS(args.picker_ca, args.picker_name, args.picker_client_cert, args.picker_client_key) \
        if args.picker_ca else None
    try:
        doc = bootstrap(config, listen_host=host, listen_port=int(port), pickers=args.picker,
                        fail_open=args.failure_mode == "open", admin_port=args.admin_port,
                        duplex=args.body_mode == "duplex", picker_tls=tls)
    except ValueError as exc:
        raise SystemExit(f"bouncer envoy-config: {exc}") from None
    made_by = " ".join(shlex.quote(a) for a in ["bouncer", *sys.argv[1:]])
    print(f"# Envoy bootstrap for Bouncer's endpoint picker, written by: {made_by}\n"
          f"# run: envoy -c THIS_FILE, and bouncer serve --mode epp --config {args.config}")
    print(yaml.safe_dump(doc, sort_keys=False), end="")


def cmd_recorder(args) -> None:
    from bouncer.recorder.page import serve_recording

    serve_recording(args.file, args.host, args.port)


def cmd_config_example(args) -> None:
    from bouncer.config import EXAMPLE_CONFIG

    print(EXAMPLE_CONFIG, end="")


def cmd_config_check(args) -> None:
    from bouncer.config import load_config
    from bouncer.gateway.prepared import prepare

    config = load_config(args.file)
    prepare(config, args.file)  # what serve and reload check too: tokenizers load
    found = [m.discovery.source for m in config.models if m.discovery is not None]
    print(f"{args.file}: OK ({len(config.tenants)} tenants, {len(config.models)} models, "
          f"{sum(len(m.backends) for m in config.models)} backends listed"
          + (f", found by {'; '.join(found)}" if found else "") + ")")


def cmd_quota(args) -> None:
    """`bouncer quota show|reset`: a tenant's spend and what is left, read from (or reset in)
    the quota store the config names."""
    import datetime as dt

    from bouncer.config import load_config
    from bouncer.gateway.quota_keeper import QuotaKeeper

    config = load_config(args.config)
    if config.quotas is None:
        raise SystemExit(f"bouncer quota: {args.config} has no `quotas` section")
    if args.tenant not in {t.name for t in config.tenants}:
        raise SystemExit(f"bouncer quota: no tenant {args.tenant!r} in {args.config}")

    async def run() -> list[dict]:
        keeper = QuotaKeeper(config)
        try:
            if args.quota_cmd == "reset":
                lines = [c for c in keeper.current(args.tenant)
                         if (c.line.owner == (args.group or args.tenant))
                         and (args.group is not None or c.line.scope == "tenant")
                         and (args.window is None or c.line.limit.window == args.window)]
                if not lines:
                    raise SystemExit(f"bouncer quota: no such limit on {args.group or args.tenant!r}")
                await keeper.reset(lines)
            await keeper.refresh()
            return keeper.report(args.tenant)
        finally:
            await keeper.close()

    from redis.exceptions import RedisError

    try:
        rows = asyncio.run(run())
    except (OSError, RedisError) as exc:
        raise SystemExit(f"bouncer quota: the quota store is unreachable: {exc}") from None
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print(f"{args.tenant}: no quota applies")
    for r in rows:
        resets = dt.datetime.fromtimestamp(r["resets_at"], dt.UTC).isoformat(timespec="seconds")
        print(f"{r['scope']} {r['owner']}: {r['unit']} per {r['window']} ({r['period']}, {r['time_zone']}): "
              f"spent {r['spent']:g}, reserved {r['reserved']:g}, remaining {r['remaining']:g} of {r['limit']:g}; "
              f"resets {resets}")


def cmd_config_hash_key(args) -> None:
    from bouncer.config import key_digest

    print(key_digest(args.key))


def cmd_reference(args) -> None:
    from bouncer.reference.pages import run

    sys.exit(run(build_parser(), args.check, pathlib.Path(args.out) if args.out else None))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bouncer", description="Admission control for LLM inference fleets.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("recorder", help="serve the flight recorder page for a recorded file (bench run --record, "
                       "or /admin/timeline?format=jsonl saved from a gateway)")
    p.add_argument("file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.set_defaults(func=cmd_recorder)

    _add_gateway_commands(sub)

    config = sub.add_parser("config", help="configuration helpers").add_subparsers(dest="config_cmd", required=True)
    p = config.add_parser("example", help="print a commented example config")
    p.set_defaults(func=cmd_config_example)
    p = config.add_parser("check", help="validate a config file")
    p.add_argument("file")
    p.set_defaults(func=cmd_config_check)
    p = config.add_parser("hash-key", help="SHA-256 digest of an API key, for api_keys_sha256")
    p.add_argument("key")
    p.set_defaults(func=cmd_config_hash_key)

    quota = sub.add_parser("quota", help="tenants' spend over hours, days, weeks and months, in the quota store"
                           ).add_subparsers(dest="quota_cmd", required=True)
    p = quota.add_parser("show", help="a tenant's spend and what is left, on each limit that applies to it")
    p.add_argument("tenant")
    p.add_argument("--config", required=True, help="the gateway's config (it names the store)")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p.set_defaults(func=cmd_quota)
    p = quota.add_parser("reset", help="forget a tenant's (or its group's) spend in the current window (admin)")
    p.add_argument("tenant")
    p.add_argument("--config", required=True, help="the gateway's config (it names the store)")
    p.add_argument("--group", metavar="NAME", help="reset this group of the tenant instead of the tenant's own")
    p.add_argument("--window", choices=["hour", "day", "week", "month"], help="only this window's limit")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p.set_defaults(func=cmd_quota)

    p = sub.add_parser("reference", help="write the reference pages generated from the code (docs/reference: "
                       "configuration, metrics, CLI, HTTP API)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the pages that differ from "
                   "what the code generates now")
    p.add_argument("--out", metavar="DIR", help="the pages' folder (default: docs/reference of this checkout)")
    p.set_defaults(func=cmd_reference)

    from bouncer.bench.commands import add_lab_commands

    add_lab_commands(sub)
    return parser


def _add_gateway_commands(sub) -> None:
    """`bouncer serve` and `bouncer envoy-config`: the gateway, and Envoy in front of its picker."""
    p = sub.add_parser("serve", help="run the gateway (no --config: the embedded demo)")
    p.add_argument("--config", help="YAML config; without it the embedded demo starts")
    p.add_argument("--host", help="listen address (default: the config's, or 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: the config's, or 8000)")
    p.add_argument("--engine-ports", type=_engine_ports, metavar="PORT,PORT",
                   help="the embedded demo's simulated replicas (default: 8101,8102)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="default: the config's logging.level (info)")
    p.add_argument("--log-format", choices=["logfmt", "json", "text"],
                   help="default: the config's logging.format (logfmt)")
    p.add_argument("--mode", choices=["proxy", "epp"], default="proxy",
                   help="proxy: clients talk to Bouncer, which relays the answers (default); epp: Envoy's "
                        "external processor, the Gateway API Inference Extension's endpoint picker, on the "
                        "config's picker.port (see bouncer envoy-config)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("envoy-config", help="print an Envoy bootstrap that runs `bouncer serve --mode epp` as its "
                                            "endpoint picker")
    p.add_argument("--config", required=True, help="the Bouncer config the picker runs")
    p.add_argument("--listen", default="127.0.0.1:10000", help="where Envoy listens for clients (HOST:PORT)")
    p.add_argument("--picker", action="append", metavar="HOST:PORT",
                   help="where Envoy reaches a picker; repeat it for several, which share state in Redis "
                        "(default: the config's picker.host and picker.port)")
    p.add_argument("--failure-mode", choices=["open", "close"], default="close",
                   help="the picker down or failing: close answers 503 (default); open sends requests round robin "
                        "to the config's backends, unadmitted")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin port on 127.0.0.1")
    p.add_argument("--body-mode", choices=["buffered", "duplex"], default="buffered",
                   help="buffered: the request body read whole, the answer watched without waiting (default, "
                        "cheaper); duplex: every body chunk both ways through the picker, as GIE's gateways and "
                        "llm-d set ext_proc up")
    p.add_argument("--picker-ca", metavar="FILE", help="the picker serves TLS (picker.tls): the CA that signed its "
                                                       "certificate, for Envoy to check it by")
    p.add_argument("--picker-name", metavar="NAME", help="the DNS name the picker's certificate carries (SNI and the "
                                                          "name checked)")
    p.add_argument("--picker-client-cert", metavar="FILE", help="Envoy's certificate for the picker (mutual TLS: "
                                                                "picker.tls.client_ca_file signed it), PEM")
    p.add_argument("--picker-client-key", metavar="FILE", help="its private key, PEM")
    p.set_defaults(func=cmd_envoy_config)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as exc:
        print(f"bouncer: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
