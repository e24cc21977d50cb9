"""The embedded demo (`make run` / `bouncer serve` without a config) answers an OpenAI client,
and its replicas' KV events make the gateway's prefix index precise."""

from __future__ import annotations

import json
import urllib.request

import openai

from bouncer.demo import DEMO_ADMIN_KEY, run_demo
from servers import free_port, poll_until, wait_http_ok


def test_demo_serves_and_follows_its_replicas_kv_events(bg_loop):
    port, engines = free_port(), (free_port(), free_port())
    task = bg_loop.start_task(run_demo("127.0.0.1", port, engines))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", timeout=30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-interactive", max_retries=0)
        system = {"role": "system", "content": "You are the doorman of a very busy GPU cluster. " * 12}

        def state() -> dict:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/state",
                                         headers={"Authorization": f"Bearer {DEMO_ADMIN_KEY}"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())["models"]["demo-llm"]["replicas"]

        def precise_blocks() -> int:
            return sum(r["prefix_index"].get("precise_blocks", 0) for r in state().values())

        for i in range(30):  # until the event subscriptions have joined and reported a prompt
            resp = client.chat.completions.create(
                model="demo-llm", messages=[system, {"role": "user", "content": f"Question {i}?"}], max_tokens=4)
            assert resp.choices[0].message.content is not None
            if precise_blocks() >= 10:
                break
        poll_until(lambda: precise_blocks() >= 10, timeout=5, what="KV events in the gateway's prefix index")
        assert any(r["prefix_index"]["mode"] == "precise" for r in state().values())
    finally:
        bg_loop.call(task.cancel)
