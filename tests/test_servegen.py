"""ServeGen per-client load models as a workload: every client a tenant, banded by a stated rule."""

from __future__ import annotations

import json
import statistics

import pytest

from bouncer.bench import goodput
from bouncer.sim import scenarios
from bouncer.sim.servegen import WINDOW_S, busiest_span, client_traces, load_servegen
from bouncer.sim.traces import load_trace

DAY = 86400


def write_client(folder, cid: str, rates: dict[float, float], pattern: str = "Gamma", shape: float = 0.5,
                 inputs: dict | None = None, outputs: dict | None = None) -> None:
    rows = []
    for start in range(0, DAY, int(WINDOW_S)):
        rate = rates.get(start, 0.0)
        rows.append(f"{start},{rate},1.0,{pattern if rate else ''},{shape if rate else 0},1.0")
    (folder / f"chunk-{cid}-trace.csv").write_text("\n".join(rows) + "\n")
    sizes = {"input_tokens": str(inputs or {100: 0.5, 300: 0.5}), "output_tokens": str(outputs or {50: 1.0}),
             "reason_ratio": "{0.0: 1.0}"}
    empty = {"input_tokens": "{}", "output_tokens": "{}", "reason_ratio": "{}"}
    (folder / f"chunk-{cid}-dataset.json").write_text(json.dumps({"0": sizes, "43200": empty}))


@pytest.fixture
def pool(tmp_path):
    # a heavy client busy from 10:00 to 11:00, a light one all day, one that never sends
    write_client(tmp_path, "0", {s: 20.0 for s in range(36000, 39600, 600)}, "Gamma", 0.25)
    write_client(tmp_path, "1", dict.fromkeys(range(0, DAY, 600), 1.0), "Weibull", 0.8,
                 inputs={1000: 1.0}, outputs={10: 0.25, 20: 0.75})
    write_client(tmp_path, "2", {})
    return tmp_path


def test_clients_become_request_traces_with_their_rates_and_sizes(pool):
    clients = load_servegen(pool)
    assert [c.id for c in clients] == ["0", "1"]  # the idle one is left out
    assert busiest_span(clients) == 36000
    traces = client_traces(clients, seed=1)
    heavy, light = traces["0"], traces["1"]
    assert 20 * 3600 * 0.8 < len(heavy) < 20 * 3600 * 1.2
    assert 3600 * 0.8 < len(light) < 3600 * 1.2
    assert all(0 <= r.t < 3600 for r in [*heavy, *light])
    # kept as arrays, read as requests: by index from either end, by slice, in order
    assert heavy[-1] == heavy[len(heavy) - 1] and heavy[-1].t == max(r.t for r in heavy)
    assert heavy[2:5] == [heavy[2], heavy[3], heavy[4]] and heavy[0].block_digests == []
    with pytest.raises(IndexError):
        heavy[len(heavy)]
    assert {r.prompt_len for r in heavy} == {100, 300} and {r.prompt_len for r in light} == {1000}
    assert 0.65 < sum(r.output_len == 20 for r in light) / len(light) < 0.85
    # Gamma with shape 0.25 is bursty: inter-arrival CV near 1 / sqrt(0.25) = 2, where Poisson gives 1
    gaps = [b.t - a.t for a, b in zip(heavy, heavy[1:], strict=False)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) > 1.6
    # the period after noon has empty distributions: sizes come from the morning's
    late = client_traces(clients, seed=1, start_s=50000)["1"]
    assert late and {r.prompt_len for r in late} == {1000}


def test_a_servegen_trace_makes_every_active_client_a_tenant_banded_by_volume(pool):
    sc = scenarios.get_scenario("surge", 60)
    traces = sc.load(str(pool))
    assert set(traces) == {"0", "1"}
    by_name = {t.name: t for t in sc.tenants}
    assert set(by_name) == {"client-0", "client-1"}
    assert by_name["client-0"].priority == 0 and by_name["client-1"].priority == 1  # bulk, light
    assert sum(t.share for t in sc.tenants) == pytest.approx(1.0)
    assert by_name["client-0"].share > 0.9
    assert all(t.ttft_slo == 2.0 and t.tpot_slo == 0.1 for t in sc.tenants)  # the surge tenant's SLO


def test_bad_servegen_folders_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a ServeGen client folder"):
        load_servegen(tmp_path)
    write_client(tmp_path, "0", {0: 1.0})
    (tmp_path / "chunk-0-dataset.json").unlink()
    with pytest.raises(ValueError, match="missing"):
        load_servegen(tmp_path)
    (tmp_path / "chunk-0-trace.csv").write_text("0,1.0,1.0\n")
    with pytest.raises(ValueError, match="expected 6 fields"):
        load_servegen(tmp_path)
    with pytest.raises(ValueError, match="ServeGen"):
        load_trace(tmp_path)


def test_the_deepseek_r1_pool_loads():
    folder = scenarios.SERVEGEN_DEEPSEEK_R1  # the repository's slice: the busiest hour
    clients = load_servegen(folder)
    assert busiest_span(clients) == 78_000  # 21:40, as in the full day's folder
    traces = client_traces(clients, seed=0)
    sizes = [len(t) for t in traces.values()]
    # what the full folder gives for that hour (scripts/slice_traces.py checks they are identical)
    assert len(traces) == 31 and sum(sizes) == 133_555
    assert max(sizes) / sum(sizes) > 0.2  # load is skewed across clients


def test_the_m_mid_pool_loads_thousands_of_short_requests_a_second():
    clients = load_servegen(scenarios.SERVEGEN_M_MID)
    start = busiest_span(clients)
    assert start == 1_058_400
    traces = client_traces(clients, seed=0, start_s=start, span_s=60.0)  # its first minute
    sizes = {cid: len(t) for cid, t in traces.items()}
    assert len(sizes) >= 15 and sum(sizes.values()) / 60.0 > 2_000  # 20 send in the hour
    bulk = max(sizes, key=sizes.get)
    assert sizes[bulk] / sum(sizes.values()) > 0.9  # one client sends nearly all of them...
    assert sum(r.prompt_len for r in traces[bulk]) / sizes[bulk] < 300  # ...short ones


def test_a_goodput_run_on_a_servegen_folder_accounts_for_every_client(pool, tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "CACHE_DIR", tmp_path / "capacity")
    r = goodput.run("surge", "bouncer", 2.0, duration_s=20, replicas=1, trace=str(pool))
    assert r["lost"] == 0 and sum(r["outcomes"].values()) == r["offered"] > 0
    assert {name: t["priority"] for name, t in r["tenants"].items()} == {"client-0": 0, "client-1": 1}


def test_a_goodput_run_replays_the_hour_it_is_given(pool, tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "CACHE_DIR", tmp_path / "capacity")
    # from 2:00 only the light client sends: one tenant, whose share makes it bulk
    r = goodput.run("surge", "bouncer", 1.0, duration_s=20, replicas=1, trace=str(pool), trace_start_h=2)
    assert set(r["tenants"]) == {"client-1"} and r["tenants"]["client-1"]["priority"] == 0
    assert r["trace_start_h"] == 2 and r["lost"] == 0 and r["offered"] > 0
    # the default is the busiest hour, 10:00, where both send
    assert set(goodput.run("surge", "bouncer", 1.0, duration_s=20, replicas=1, trace=str(pool))["tenants"]) == \
        {"client-0", "client-1"}
    with pytest.raises(ValueError, match="ServeGen"):
        goodput.run("surge", "bouncer", 1.0, duration_s=20, replicas=1, trace_start_h=2)
    silent = tmp_path / "silent"
    silent.mkdir()
    write_client(silent, "0", {600.0: 5.0})
    with pytest.raises(ValueError, match="no client sends a request in the hour from 5 h"):
        goodput.run("surge", "bouncer", 1.0, duration_s=20, replicas=1, trace=str(silent), trace_start_h=5)


def test_volume_weighted_tenancy_puts_every_client_in_one_band_weighted_by_its_requests(pool, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setattr(goodput, "CACHE_DIR", tmp_path / "capacity")
    r = goodput.run("surge", "bouncer", 1.0, duration_s=20, replicas=1, trace=str(pool), tenancy="volume-weighted")
    tenants = r["tenants"]
    assert {t["priority"] for t in tenants.values()} == {1} and r["tenancy"] == "volume-weighted"
    heavy, light = tenants["client-0"]["weight"], tenants["client-1"]["weight"]
    # client 0 sends about 20 requests a second in that hour, client 1 about one: weights in that
    # proportion, averaging 1
    assert 15 < heavy / light < 25 and heavy + light == pytest.approx(2.0)
    assert r["lost"] == 0 and r["offered"] > 0
    with pytest.raises(ValueError, match="unknown tenancy"):
        goodput.run("surge", "bouncer", 1.0, duration_s=20, replicas=1, trace=str(pool), tenancy="by-size")
    with pytest.raises(ValueError, match="ServeGen"):
        goodput.run("surge", "bouncer", 1.0, duration_s=20, replicas=1, tenancy="volume-weighted")
