import pytest
from aiohttp import web

from bouncer.engine_server import EngineServer, KVEventPublisher
from bouncer.sim.engine import EngineModel
from bouncer.sim.profiles import get_profile
from servers import BackgroundLoop, free_port, wait_http_ok


@pytest.fixture
def bg_loop():
    loop = BackgroundLoop()
    yield loop
    loop.close()


def _serve_on_loopback(bg_loop: BackgroundLoop, make_server, port: int):
    """Start `make_server()`'s aiohttp app on 127.0.0.1:`port` in the background loop; returns
    (base_url, server, cleanup) once /health answers."""
    holder = {}

    async def start():
        server = make_server()
        runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        holder["server"] = server
        return runner

    runner = bg_loop.run(start())
    base = f"http://127.0.0.1:{port}"
    wait_http_ok(base + "/health")
    return base, holder["server"], lambda: bg_loop.run(runner.cleanup())


def start_engine(bg_loop: BackgroundLoop, *, speed: float = 1.0, kv_events: str | None = None, **engine_kwargs):
    """A real `bouncer engine` HTTP server on loopback; returns (base_url, EngineServer, cleanup).
    `kv_events`: a ZMQ endpoint to publish KV-cache events on, as vLLM's --kv-events-config."""

    def make():
        engine = EngineModel(get_profile("llama-3.1-8b-h100"), **engine_kwargs)
        publisher = KVEventPublisher(kv_events, "", engine.block_size) if kv_events else None
        return EngineServer(engine, model_name="demo-llm", speed=speed, kv_events=publisher)
    return _serve_on_loopback(bg_loop, make, free_port())


@pytest.fixture
def engine_server(bg_loop):
    base, server, cleanup = start_engine(bg_loop, num_blocks=2048, max_num_seqs=32)
    yield base, server
    cleanup()


def start_gateway(bg_loop: BackgroundLoop, config_dict: dict, **proxy_kw):
    """A real gateway on loopback, served as `bouncer serve` serves it (the proxy front,
    `proxy_kw` for its `Proxy`); returns (base_url, its ControlPlane, cleanup)."""
    import asyncio

    from bouncer.config import parse_config
    from bouncer.gateway.control_plane import ControlPlane
    from bouncer.gateway.fronts.proxy import Proxy, serve_proxy

    port = free_port()
    config = parse_config({**config_dict, "listen": {**config_dict.get("listen", {}), "host": "127.0.0.1",
                                                     "port": port}})
    gateway = bg_loop.call(lambda: ControlPlane(config))
    proxy = bg_loop.call(lambda: Proxy(gateway, **proxy_kw))
    ready = bg_loop.call(asyncio.Event)
    task = bg_loop.start_task(serve_proxy(gateway, "127.0.0.1", port, ready, proxy=proxy))
    bg_loop.run(asyncio.wait_for(ready.wait(), 30))
    base = f"http://127.0.0.1:{port}"
    wait_http_ok(base + "/health")

    def cleanup() -> None:
        task.cancel()
        try:
            task.result(10)
        except BaseException:  # noqa: BLE001 (cancelled, as asked)
            pass
    return base, gateway, cleanup
