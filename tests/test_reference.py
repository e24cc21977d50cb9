"""The reference pages generated from the code (docs/reference/, `bouncer reference`): each is
what the code generates now, every config field is described, the metrics page lists what a
running gateway's and engine's /metrics serve, the CLI page every command."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bouncer.bench.loopback import RedisServer
from bouncer.cli import build_parser
from bouncer.config import key_digest
from bouncer.reference import cli_page, config_page, metrics_page
from bouncer.reference.pages import PAGES, REGENERATE, default_out, render_all, run, stale
from bouncer.tokenizer import default_tokenizer_path
from conftest import start_engine, start_gateway
from servers import poll_until

UNITS = {"_s": "second", "_ms": "millisecond", "_tokens": "token", "_bytes": "byte", "_gb": "GB"}


@pytest.mark.parametrize("name", PAGES)
def test_each_generated_page_is_what_the_code_generates_now(name):
    page = default_out() / name
    assert page.exists(), f"docs/reference/{name} is missing: run `{REGENERATE}`"
    assert page.read_text() == render_all(build_parser())[name], \
        f"docs/reference/{name} is stale (the code it is generated from changed): run `{REGENERATE}` and commit it"


def test_check_names_a_stale_page_and_the_command(tmp_path, capsys):
    assert run(build_parser(), check=False, out=tmp_path) == 0 and stale(build_parser(), tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PAGES)
    (tmp_path / "metrics.md").write_text("old\n")
    (tmp_path / "cli.md").unlink()
    capsys.readouterr()
    assert run(build_parser(), check=True, out=tmp_path) == 1
    said = capsys.readouterr().out
    assert "metrics.md" in said and "cli.md" in said and "configuration.md" not in said and REGENERATE in said


def test_every_config_field_has_a_description_with_its_unit():
    fields = list(config_page.fields())
    assert len(fields) > 150  # every model of the file is walked, the nested ones too
    missing = [path for path, _, _, f in fields if not (f.description or "").strip()]
    assert not missing, f"config fields without a description (say what it means and its unit): {missing}"
    unitless = [path for path, _, name, f in fields for suffix, unit in UNITS.items()
                if name.endswith(suffix) and unit not in f.description]
    assert not unitless, f"config fields whose description does not name the unit their name promises: {unitless}"


def test_config_page_takes_defaults_bounds_and_choices_from_the_models():
    page = (default_out() / "configuration.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `policy.telemetry.staleness_s` |"))
    assert row.startswith("| `policy.telemetry.staleness_s` | float | `2.0` | > 0 | telemetry older than")
    row = next(line for line in page.splitlines() if line.startswith("| `tenants[].slo.on_infeasible` |"))
    assert "one of `refuse`, `best-effort`" in row and "| `refuse` |" in row
    assert "| `tenants[].name` | str | required | not empty |" in page
    for path, _ in config_page.sections():
        assert f'<a id="{config_page._slug(path)}"></a>' in page


def _page_metrics(section: str) -> set[str]:
    return set(re.findall(r"^\| `([A-Za-z_:][A-Za-z0-9_:]*)` \|", section, re.MULTILINE))


def _scrape(url: str) -> set[str]:
    """The metric families /metrics serves; a counter's or histogram's `X_created` (served as a
    family of its own in the text format) is part of X."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        names = {f.name for f in text_string_to_metric_families(resp.read().decode())}
    return {n for n in names if not (n.endswith("_created") and n.removesuffix("_created") in names)}


def test_metrics_page_lists_every_metric_the_gateway_and_the_engine_serve(bg_loop, tmp_path):
    page = (default_out() / "metrics.md").read_text()
    gateway_part, engine_part = page.split("## The simulated engine", 1)
    documented, documented_engine = _page_metrics(gateway_part), _page_metrics(engine_part)
    only_with_shared_state = {m.name for m in metrics_page.metrics("gateway") if m.group == "_SharedStateCollector"}
    assert only_with_shared_state and only_with_shared_state <= documented

    engine, _, stop_engine = start_engine(bg_loop, num_blocks=2048, max_num_seqs=32)
    redis_server = RedisServer()  # a quota, so that the quota families are served
    found = tmp_path / "found.yaml"
    found.write_text(f"[{engine}]\n")
    config = {
        "tenants": [{"name": "alice", "api_keys_sha256": [key_digest("alice")], "priority": 1,
                     "slo": {"ttft_s": 5.0, "tpot_s": 1.0},
                     "quota": {"limits": [{"window": "day", "limit": 1_000_000}]}}],
        "quotas": {"url": redis_server.url},
        "models": [{"name": "demo-llm", "tokenizer": str(default_tokenizer_path()),
                    "backends": [{"url": engine, "name": "e0"}]},
                   # a model whose replicas are found (a file), so that discovery's families are served
                   {"name": "found-llm", "discovery": {"file": {"path": str(found)}}}],
        "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}},
        # an outside signal with a value, so that its families are served too (a schedule: no IO)
        "pressure": [{"name": "carbon", "source": {"kind": "schedule", "schedule": [{"at": "00:00", "value": 1}]},
                      "shed_above": 100, "bands": [-1]}],
    }
    url, gateway, stop_gateway = start_gateway(bg_loop, config)
    try:
        poll_until(lambda: bg_loop.call(lambda: all(r.telemetry is not None
                                                    for r in gateway.core.replicas.values())), what="first scrape")
        body = json.dumps({"model": "demo-llm", "prompt": "hello", "max_tokens": 3}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer alice"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        served = _scrape(url)
        served_engine = _scrape(engine)
    finally:
        stop_gateway()
        stop_engine()
        redis_server.stop()

    assert "bouncer_pressure_value" in served and "bouncer_decisions" in served
    assert not served - documented, f"the gateway serves metrics the page does not list: {served - documented} " \
                                    f"(run `{REGENERATE}`; a metric defined outside gateway/metrics.py is not seen)"
    assert documented - served <= only_with_shared_state, \
        f"the page lists metrics the gateway does not serve: {documented - served - only_with_shared_state}"
    assert served_engine == documented_engine


def test_cli_page_names_every_command_with_its_options():
    from bouncer.cli import build_parser

    page = (default_out() / "cli.md").read_text()
    names = [path for path, _, _ in cli_page.commands(build_parser()) if path]
    assert {("serve",), ("reference",), ("config", "check"), ("bench", "run")} <= set(names)
    for path in names:
        assert f"# `bouncer {' '.join(path)}`" in page, f"`bouncer {' '.join(path)}` is not on the CLI page"
    top = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(top.choices) == {p[0] for p in names}
    assert "| `--config CONFIG` | str | — | YAML config; without it the embedded demo starts |" in page
    assert "| `--check` | flag | — |" in page


def test_http_api_page_lists_every_operation_of_the_openapi_description():
    from bouncer.reference import http_api_page

    page = (default_out() / "http-api.md").read_text()
    operations = http_api_page.operations(http_api_page.load())
    assert len(operations) >= 10
    for path, method, op in operations:
        assert f"### `{method} {path}`" in page
        for status in op.get("responses", {}):
            assert f"| `{status}` |" in page
