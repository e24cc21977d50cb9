"""The flight recorder page as a person sees it: the demo (`bouncer serve`, a real process) under
a scripted surge, then /ui in a real headless Chromium. The charts must hold the surge (traffic,
queues filling and draining, refusals by reason), the table under the cursor must show the
recorded numbers of the moment the cursor is on, and the console must stay free of errors.
A recorded simulator run must open in the same page (`bouncer recorder FILE`)."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys
import urllib.request

import openai
import pytest

from servers import free_port, poll_until, wait_http_ok

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("BOUNCER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
BOUNCER = str(pathlib.Path(sys.executable).with_name("bouncer"))
SCREENSHOTS = os.environ.get("BOUNCER_UI_SCREENSHOTS")  # a folder: keep the pages' screenshots there


def _chromium_or_fail() -> str:
    if not pathlib.Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: `apt-get install chromium` (make test does it as root), "
                    "or set BOUNCER_CHROMIUM")
    return CHROMIUM


def _timeline(base: str) -> dict:
    req = urllib.request.Request(base + "/admin/timeline", headers={"Authorization": "Bearer demo-admin"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _queued(base: str) -> int:
    req = urllib.request.Request(base + "/admin/state", headers={"Authorization": "Bearer demo-admin"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["queued"]


async def _surge(base: str) -> dict[str, int]:
    """300 sheddable requests at once (distinct ~1,500-token prompts), 40 of the research band,
    and the interactive tenant asking one at a time meanwhile; no client retries."""
    outcomes: dict[str, int] = {}

    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=90)

    async def one(c: openai.AsyncOpenAI, i: int, words: int, max_tokens: int) -> None:
        text = f"request {i}: " + " ".join(f"w{(i * 7919 + j) % 5003}" for j in range(words))
        try:
            await c.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens)
            key = "ok"
        except openai.APIStatusError as exc:
            key = str(exc.status_code)
        outcomes[key] = outcomes.get(key, 0) + 1

    async def interactive() -> None:
        c = client("demo-interactive")
        for i in range(12):
            await one(c, 10_000 + i, 30, 20)
            await asyncio.sleep(0.5)

    free, research = client("demo-free"), client("demo-research")
    await asyncio.gather(*(one(free, i, 700, 64) for i in range(300)),
                         *(one(research, 1000 + i, 400, 128) for i in range(40)), interactive())
    return outcomes


@pytest.fixture
def demo(tmp_path):
    """The demo gateway. Its log goes to a file, printed if the test fails: a pipe that nobody
    reads fills after 64 KB and then blocks the gateway's every write to it, event loop and all."""
    port, engines = free_port(), (free_port(), free_port())
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([BOUNCER, "serve", "--port", str(port), "--engine-ports",
                                 f"{engines[0]},{engines[1]}", "--log-level", "warning"],
                                stdout=subprocess.DEVNULL, stderr=out)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(base + "/ready", timeout=30)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"the demo's log ({log.stat().st_size} bytes), its end:\n" + log.read_text(errors="replace")[-4000:])


def _open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1600, "height": 1700})  # the whole page: no resize
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(url)
    page.wait_for_function("window.bouncerUI && window.bouncerUI.ready && window.bouncerUI.state.charts.length",
                           timeout=20_000)
    return page, problems


def _cell(page, table: str, row: str, key: str) -> str:
    return page.evaluate("""([table, row, key]) => {
        const t = document.querySelector(`#moment table[data-table="${table}"]`);
        for (const tr of t.querySelectorAll("tr")) {
            if (tr.cells[0] && tr.cells[0].textContent === row) {
                return tr.querySelector(`td[data-k="${key}"]`).textContent;
            }
        }
        return null;
    }""", [table, row, key])


def _move_cursor_to(page, chart: str, t: float) -> None:
    """The mouse, over chart `chart`, at the x of time t."""
    box = page.locator(f"#chart-{chart} .u-over").bounding_box()
    x = page.evaluate("([i, t]) => window.bouncerUI.state.charts[i].valToPos(t, 'x')",
                      [["traffic", "decisions", "queue", "wait", "pressure", "engine", "slo"].index(chart), t])
    page.mouse.move(box["x"] + x, box["y"] + box["height"] / 2)


def _check_moment(page, samples: list[dict], t: float, step: float) -> None:
    _move_cursor_to(page, "queue", t)
    page.wait_for_function(f"Math.abs(Number(document.querySelector('#moment').dataset.t) - {t}) <= {step * 1.01}",
                           timeout=5_000)
    at = float(page.evaluate("document.querySelector('#moment').dataset.t"))
    moment = next(s for s in samples if abs(s["t"] - at) < 1e-6)
    tenant = moment["gauges"]["tenants"]["free"]
    assert _cell(page, "tenants", "free", "queued") == str(tenant["queued"])
    assert float(_cell(page, "tenants", "free", "oldest_wait_s")) == pytest.approx(tenant["oldest_wait_s"], abs=0.006)
    band = moment["gauges"]["models"]["demo-llm"]["bands"].get("-1")
    if band is not None:
        assert _cell(page, "bands", "demo-llm -1", "queued") == str(band["queued"])
        assert _cell(page, "bands", "demo-llm -1", "tokens") == str(band["tokens"])
    replica = moment["gauges"]["models"]["demo-llm"]["replicas"]["replica-0"]
    assert _cell(page, "replicas", "replica-0", "running") == str(replica["running"])
    assert _cell(page, "replicas", "replica-0", "inflight") == str(replica["inflight"])
    counts = moment["counts"]["tenants"].get("free", {})
    assert float(_cell(page, "tenants", "free", "arrived")) == pytest.approx(counts.get("arrived", 0) / step,
                                                                            abs=0.006)
    for key, n in counts.items():  # each refusal or end of the moment, by reason
        if ":" in key:
            assert float(_cell(page, "refused and ended", f"free {key}", "per_s")) == pytest.approx(n / step,
                                                                                                abs=0.006)


def test_the_page_shows_a_surge_filling_and_draining_the_queues_and_reads_one_moment(demo):
    from playwright.sync_api import sync_playwright

    outcomes = asyncio.run(_surge(demo))
    assert outcomes.get("ok", 0) > 0 and sum(v for k, v in outcomes.items() if k != "ok") > 0, outcomes
    poll_until(lambda: _queued(demo) == 0, timeout=90, what="the gateway's queues drained")
    recorded = _timeline(demo)
    step = recorded["header"]["step_s"]
    samples = recorded["samples"]
    free_queue = [s["gauges"]["tenants"].get("free", {}).get("queued", 0) for s in samples]
    peak = max(range(len(samples)), key=free_queue.__getitem__)
    assert free_queue[peak] >= 20, "the surge did not queue: nothing for the page to show"

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium_or_fail(), args=["--no-sandbox"])
        try:
            page, problems = _open_page(browser, demo + "/ui#key=demo-admin")
            # the charts hold the surge: arrivals, the sheddable band's queue filling then empty,
            # refusals by reason, and the engines' KV in use
            traffic = page.evaluate("window.bouncerUI.chartData('traffic')")
            free = traffic["series"][traffic["labels"].index("free (band -1)")]
            assert max(v for v in free if v is not None) >= 100  # req/s in the step the surge arrived
            queue = page.evaluate("window.bouncerUI.chartData('queue')")
            band = queue["series"][queue["labels"].index("band -1")]
            assert max(band) >= 20 and band[-1] == 0
            decisions = page.evaluate("window.bouncerUI.chartData('decisions')")
            refusals = {label: max(s) for label, s in zip(decisions["labels"], decisions["series"], strict=True)
                        if ":" in label}
            assert refusals and max(refusals.values()) > 0, decisions["labels"]
            pressure = page.evaluate("window.bouncerUI.chartData('pressure')")
            kv = pressure["series"][pressure["labels"].index("replica-0 kv")]
            assert max(v for v in kv if v is not None) > 0.1

            # the stream goes on: new samples arrive while the page is open
            held = page.evaluate("window.bouncerUI.state.samples.length")
            page.wait_for_function(f"window.bouncerUI.state.samples.length >= {held + 4}", timeout=10_000)

            # the cursor at the sheddable queue's peak, then at its most refused moment: the
            # table shows each moment's recorded numbers
            refused = [sum(n for k, n in s["counts"]["tenants"].get("free", {}).items() if ":" in k) for s in samples]
            most_refused = max(range(len(samples)), key=refused.__getitem__)
            assert refused[most_refused] > 0
            for i in (peak, most_refused):
                _check_moment(page, samples, samples[i]["t"], step)

            # a band filter leaves that band's series only
            page.select_option("#band", "10")
            page.wait_for_function("window.bouncerUI.chartData('queue').labels.join() === 'band 10'", timeout=5_000)
            page.select_option("#band", "")
            if SCREENSHOTS:
                page.mouse.move(5, 5)  # off the charts, then back: the cursor follows a real move
                _move_cursor_to(page, "queue", samples[peak]["t"])
                page.screenshot(path=str(pathlib.Path(SCREENSHOTS) / "recorder-surge.png"), full_page=True)
            assert problems == []
        finally:
            browser.close()


def test_a_recorded_simulator_run_opens_in_the_same_page(tmp_path):
    from playwright.sync_api import sync_playwright

    record = tmp_path / "rogue.jsonl.gz"
    subprocess.run([BOUNCER, "bench", "run", "--scenario", "rogue-tenant", "--policy", "bouncer", "--load", "2",
                    "--duration", "40", "--replicas", "2", "--record", str(record)], check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    port = free_port()
    proc = subprocess.Popen([BOUNCER, "recorder", str(record), "--port", str(port)], stdout=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/admin/timeline", timeout=20)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium_or_fail(), args=["--no-sandbox"])
            try:
                page, problems = _open_page(browser, f"http://127.0.0.1:{port}/ui")
                assert "recorded (virtual time)" in page.text_content("#source")
                queue = page.evaluate("window.bouncerUI.chartData('queue')")
                assert queue["labels"] == ["band 10", "band 0", "band -1"]
                assert max(queue["series"][2]) > 50  # the sheddable flood queued
                assert queue["x"][0] == 0.0 and queue["x"][-1] > 40  # virtual seconds, to the drain
                _move_cursor_to(page, "queue", 20.0)
                page.wait_for_function("Math.abs(Number(document.querySelector('#moment').dataset.t) - 20) <= 0.26")
                assert _cell(page, "tenants", "sla", "band") == "10"
                if SCREENSHOTS:
                    page.screenshot(path=str(pathlib.Path(SCREENSHOTS) / "recorder-simulated.png"), full_page=True)
                assert problems == []
            finally:
                browser.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_names_are_shown_as_text_never_run_as_markup(tmp_path):
    """A tenant (or replica) name that is markup, as a config or a discovered replica could carry,
    is shown as its text: the page never builds elements, or runs scripts, from it."""
    import gzip

    from playwright.sync_api import sync_playwright

    record = tmp_path / "run.jsonl.gz"
    subprocess.run([BOUNCER, "bench", "run", "--scenario", "rogue-tenant", "--policy", "bouncer", "--load", "2",
                    "--duration", "10", "--replicas", "2", "--record", str(record)], check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    evil = '<img src=x onerror="window.pwned=1">'
    tampered = tmp_path / "tampered.jsonl.gz"
    with gzip.open(record, "rt") as src, gzip.open(tampered, "wt") as dst:
        dst.write(src.read().replace('"sla"', json.dumps(evil)))
    port = free_port()
    proc = subprocess.Popen([BOUNCER, "recorder", str(tampered), "--port", str(port)], stdout=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/admin/timeline", timeout=20)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium_or_fail(), args=["--no-sandbox"])
            try:
                page, problems = _open_page(browser, f"http://127.0.0.1:{port}/ui")
                _move_cursor_to(page, "queue", 5.0)
                page.wait_for_function("document.querySelector('#moment table')")
                assert _cell(page, "tenants", evil, "band") == "10"  # its row, named by its text
                assert page.evaluate("document.querySelectorAll('#moment img, #tenants img').length") == 0
                assert page.evaluate("window.pwned") is None and problems == []
            finally:
                browser.close()
    finally:
        proc.terminate()
        proc.wait(10)
