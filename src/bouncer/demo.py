"""The embedded demo: a gateway in front of two simulated replicas, in one process.

`bouncer serve` with no config starts it. The replicas are deliberately small (Llama-3.1-8B step
times with a 1,024-block KV pool each: 16k tokens) so that a few hundred concurrent long requests
overload them: the demo exists to show the protection, not the throughput. Each replica publishes
its KV-cache events as vLLM does (over a local ipc:// socket), so the gateway's prefix index is
the precise one: `/admin/state` shows it per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import shutil
import tempfile

from bouncer.config import BouncerConfig, key_digest, parse_config
from bouncer.engine_server import EngineServer, KVEventPublisher, serve_engine
from bouncer.gateway.control_plane import ControlPlane
from bouncer.gateway.fronts.proxy import serve_proxy
from bouncer.sim.engine import EngineModel
from bouncer.sim.profiles import get_profile

DEMO_MODEL = "demo-llm"
DEMO_KEYS = {"demo-interactive": "interactive", "demo-research": "research", "demo-free": "free"}
DEMO_ADMIN_KEY = "demo-admin"
DEMO_KV_BLOCKS = 1024
DEMO_MAX_NUM_SEQS = 64
DEMO_PROFILE = "llama-3.1-8b-h100"
DEMO_ENGINE_PORTS = (8101, 8102)


def demo_config(host: str = "127.0.0.1", port: int = 8000, engine_ports: tuple[int, ...] = DEMO_ENGINE_PORTS,
                bundled_tokenizer: str | None = None, kv_events: tuple[str, ...] | None = None) -> BouncerConfig:
    from bouncer.tokenizer import default_tokenizer_path

    tok = bundled_tokenizer or str(default_tokenizer_path())
    return parse_config({
        "listen": {"host": host, "port": port},
        "admin_keys_sha256": [key_digest(DEMO_ADMIN_KEY)],
        "tenants": [
            {"name": "interactive", "api_keys_sha256": [key_digest("demo-interactive")], "priority": 10,
             "weight": 1.0, "slo": {"ttft_s": 1.0, "tpot_s": 0.1}, "queue_ttl_s": 5, "max_tokens_cap": 1024,
             "kv_share": 0.25},
            {"name": "research", "api_keys_sha256": [key_digest("demo-research")], "priority": 0,
             "slo": {"ttft_s": 10.0}, "queue_ttl_s": 60, "max_tokens_cap": 2048},
            {"name": "free", "api_keys_sha256": [key_digest("demo-free")], "priority": -1,
             "slo": {"ttft_s": 30.0}, "queue_ttl_s": 20, "max_tokens_cap": 512,
             "rate_limit": {"requests_per_s": 100}},
        ],
        "models": [{
            "name": DEMO_MODEL, "engine": "vllm", "tokenizer": tok, "max_model_len": 8192, "block_size": 16,
            "kv": {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2},
            # the demo engines' own step-time model: latency predictions start right
            "step_time": get_profile(DEMO_PROFILE).step_time_config,
            "backends": [{"url": f"http://127.0.0.1:{p}", "name": f"replica-{i}",
                          **({"kv_events": kv_events[i]} if kv_events else {})}
                         for i, p in enumerate(engine_ports)],
        }],
        "policy": {"band_ceilings": {10: 1.25}, "telemetry": {"scrape_interval_s": 0.2, "staleness_s": 2.0}},
    }, "embedded demo")


def demo_engine() -> EngineModel:
    profile = dataclasses.replace(get_profile(DEMO_PROFILE), max_model_len=8192)
    return EngineModel(profile, num_blocks=DEMO_KV_BLOCKS, max_num_seqs=DEMO_MAX_NUM_SEQS)


async def run_demo(host: str = "127.0.0.1", port: int = 8000,
                   engine_ports: tuple[int, ...] = DEMO_ENGINE_PORTS) -> None:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="bouncer-demo-"))
    tasks: list[asyncio.Task] = []
    try:
        kv_events = tuple(f"ipc://{sockets}/replica-{i}.kv" for i in range(len(engine_ports)))
        config = demo_config(host, port, engine_ports, kv_events=kv_events)
        servers = []
        for endpoint in kv_events:
            engine = demo_engine()
            servers.append(EngineServer(engine, model_name=DEMO_MODEL,
                                        kv_events=KVEventPublisher(endpoint, "", engine.block_size)))
        tasks += [asyncio.create_task(serve_engine(s, "127.0.0.1", p)) for s, p in zip(servers, engine_ports,
                                                                                       strict=True)]
        ready = asyncio.Event()
        tasks.append(asyncio.create_task(serve_proxy(ControlPlane(config), host, port, ready)))
        await ready.wait()
        print(DEMO_BANNER.format(host=host, port=port, engines=", ".join(f"127.0.0.1:{p}" for p in engine_ports)),
              flush=True)
        await asyncio.gather(*tasks)
    finally:
        # cancelled (Ctrl-C, or a test done with it): wait for the servers' own cleanup
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        shutil.rmtree(sockets, ignore_errors=True)


DEMO_BANNER = """\
Bouncer demo: gateway on http://{host}:{port}, two simulated Llama-3.1-8B replicas on {engines}
(1,024 KV blocks each, so a few hundred concurrent long requests overload them). They publish
KV-cache events; the gateway routes each prompt where its prefix is cached.

Tenants (API key -> band):  demo-interactive -> priority 10, TTFT SLO 1 s
                            demo-research    -> priority 0
                            demo-free        -> priority -1 (sheddable)

Try it:
  curl http://{host}:{port}/v1/chat/completions -H 'Authorization: Bearer demo-interactive' \\
       -H 'Content-Type: application/json' \\
       -d '{{"model": "demo-llm", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
  python -c "import openai; c = openai.OpenAI(base_url='http://{host}:{port}/v1', api_key='demo-free'); \\
print(c.chat.completions.create(model='demo-llm', messages=[{{'role': 'user', 'content': 'hi'}}]))"
  curl http://{host}:{port}/metrics          # decisions, queues, goodput per tenant
  curl -H 'Authorization: Bearer demo-admin' http://{host}:{port}/admin/state
  open http://{host}:{port}/ui#key=demo-admin    # the flight recorder: decisions, queues, engines
Ctrl-C stops everything."""
