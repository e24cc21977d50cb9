"""The recorder over HTTP: `/admin/timeline` (samples as JSON, JSON Lines, or a live stream) and
the page at `/ui`, for the gateway and for `bouncer recorder FILE` alike.

The page's HTML and scripts are static files with no data in them, so `/ui` needs no key; every
number it draws comes from `/admin/timeline`, which the caller guards (the admin or a viewer key
on a gateway). The page asks for the key and keeps it in the tab's sessionStorage; a link may
carry it in its fragment (`/ui#key=...`), which browsers do not send to the server.

The charting library (uPlot, MIT) is vendored into `static/vendor/` by
`scripts/vendor_uplot.sh`, so the page works where the gateway has no internet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pathlib

import orjson
from aiohttp import web

from bouncer.recorder.timeline import Timeline

log = logging.getLogger("bouncer.recorder")

STATIC = pathlib.Path(__file__).parent / "static"
CONTENT_TYPES = {".html": "text/html", ".js": "application/javascript", ".css": "text/css", ".txt": "text/plain"}
STREAM_BACKLOG = 256  # samples a slow stream reader may fall behind before it is cut off
HEARTBEAT_S = 15.0  # a comment line this often keeps proxies from closing an idle stream


class BadQuery(ValueError):
    pass


def add_page_routes(app: web.Application) -> None:
    app.router.add_get("/ui", _page)
    app.router.add_get("/ui/{name:[A-Za-z0-9_.-]+}", _static)
    app.router.add_get("/ui/vendor/{name:[A-Za-z0-9_.-]+}", _vendor)


async def _page(_request: web.Request) -> web.Response:
    return _file(STATIC / "ui.html")


async def _static(request: web.Request) -> web.Response:
    return _file(STATIC / request.match_info["name"])


async def _vendor(request: web.Request) -> web.Response:
    return _file(STATIC / "vendor" / request.match_info["name"])


def _file(path: pathlib.Path) -> web.Response:
    if not path.is_file() or path.suffix not in CONTENT_TYPES:
        raise web.HTTPNotFound()
    return web.Response(body=path.read_bytes(), content_type=CONTENT_TYPES[path.suffix],
                        headers={"Cache-Control": "no-cache"})


def _number(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadQuery(f"{name}={raw!r}: not a number") from None
    if not math.isfinite(value):
        raise BadQuery(f"{name}={raw!r}: not a finite number")
    return value


def query_range(request: web.Request, timeline: Timeline) -> tuple[float | None, float | None, float | None]:
    """since/until (the samples' own t) or last (seconds before the newest), and step (seconds,
    coarser than the recorder's: counts summed, gauges the last)."""
    since, until, last, step = (_number(request, k) for k in ("since", "until", "last", "step"))
    if last is not None:
        if since is not None:
            raise BadQuery("give since or last, not both")
        if last <= 0:
            raise BadQuery("last must be > 0 seconds")
        newest = timeline.newest()
        since = None if newest is None else newest - last
    if step is not None and step <= 0:
        raise BadQuery("step must be > 0 seconds")
    if since is not None and until is not None and until < since:
        raise BadQuery("until is before since")
    return since, until, step


async def timeline_response(request: web.Request, timeline: Timeline, extra: dict | None = None
                            ) -> web.StreamResponse:
    try:
        since, until, step = query_range(request, timeline)
        fmt = request.query.get("format", "json")
        if fmt not in ("json", "jsonl"):
            raise BadQuery(f"format={fmt!r}: json or jsonl")
        stream = request.query.get("stream", "0") not in ("0", "false", "")
    except BadQuery as exc:
        return web.json_response({"error": {"message": f"/admin/timeline: {exc}", "type": "invalid_request_error",
                                            "code": "invalid_parameter"}}, status=400)
    if stream:
        return await _stream(request, timeline, since)
    header = {**timeline.header(), "samples_held": len(timeline), "capacity": timeline.capacity,
              "bytes_held": timeline.bytes_held, **(extra or {})}
    if step is not None and step > timeline.step_s:
        encoded = [orjson.dumps(s) for s in timeline.samples(since, until, step)]
        header["step_s"] = step
    else:
        encoded = timeline.encoded(since, until)
    if fmt == "jsonl":
        body = b"\n".join([orjson.dumps(header), *encoded]) + b"\n"
        return web.Response(body=body, content_type="application/x-ndjson")
    body = b'{"header":' + orjson.dumps(header) + b',"samples":[' + b",".join(encoded) + b"]}"
    return web.Response(body=body, content_type="application/json")


async def _stream(request: web.Request, timeline: Timeline, since: float | None) -> web.StreamResponse:
    """Server-sent events: the header, the samples since `since` (none if unset), then each new
    sample as it is taken. A reader that falls STREAM_BACKLOG samples behind is cut off (it
    reconnects with since=), so a stalled tab cannot grow the gateway's memory."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(STREAM_BACKLOG)

    def deliver(encoded: bytes) -> None:
        try:
            queue.put_nowait(encoded)
        except asyncio.QueueFull:
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(None)  # the end: this reader is too slow

    unsubscribe = timeline.subscribe(deliver)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    try:
        await resp.prepare(request)
        await resp.write(b"event: header\ndata: " + orjson.dumps(timeline.header()) + b"\n\n")
        if since is not None:
            for encoded in timeline.encoded(since, None):
                await resp.write(b"data: " + encoded + b"\n\n")
        while True:
            try:
                encoded = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
            except TimeoutError:
                await resp.write(b": heartbeat\n\n")
                continue
            if encoded is None:
                log.info("timeline stream cut off: its reader fell behind", extra={"event": "timeline_stream_cut"})
                await resp.write(b"event: behind\ndata: {}\n\n")
                break
            await resp.write(b"data: " + encoded + b"\n\n")
    except ConnectionError:  # the reader left
        pass
    finally:
        unsubscribe()
    return resp


def recording_app(timeline: Timeline) -> web.Application:
    """The page and /admin/timeline for a recorded file (read-only, no key: it binds locally)."""
    async def handle(request: web.Request) -> web.StreamResponse:
        return await timeline_response(request, timeline, {"live": False})

    app = web.Application()
    app.router.add_get("/admin/timeline", handle)
    add_page_routes(app)
    return app


def serve_recording(path: str, host: str, port: int) -> None:
    """`bouncer recorder FILE`: the page over a recorded file, until Ctrl-C."""
    from bouncer.recorder.timeline import TimelineFormatError

    try:
        timeline = Timeline.read(path)
    except (OSError, TimelineFormatError) as exc:
        raise SystemExit(f"bouncer recorder: {exc}") from None
    span = f"{timeline.newest() - timeline.oldest():.1f} s" if len(timeline) else "no samples"
    print(f"bouncer recorder: {len(timeline)} samples ({span}, {timeline.source}) on http://{host}:{port}/ui",
          flush=True)
    try:
        web.run_app(recording_app(timeline), host=host, port=port, print=None, access_log=None)
    except OSError as exc:
        raise SystemExit(f"bouncer recorder: cannot listen on {host}:{port}: {exc}") from None
