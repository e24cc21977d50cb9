"""A backend that answers generation requests with whatever a test scripts, byte for byte.

A raw asyncio server (not an HTTP framework, so it can send what no framework would: status 999,
101, HTML labelled JSON, a stream cut mid-event). GET requests get a model list, so the gateway
(with `engine: openai`) finds it healthy; POST requests get `Misbehaving.mode`'s answer.
"""

from __future__ import annotations

import asyncio
import json

from servers import BackgroundLoop, free_port


def _sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def _chunk(text: str) -> dict:
    return {"id": "x", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}


def _head(status: str, ctype: str, body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


STREAM = "text/event-stream"
ANSWERS: dict[str, bytes] = {
    "ok-stream": _head("200 OK", STREAM, _sse(_chunk("a"), _chunk("b"), {"choices": [], "usage": {
        "prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}, b"[DONE]")),
    "error-event-string": _head("200 OK", STREAM, _sse({"error": "boom"}, b"[DONE]")),
    "error-event-list": _head("200 OK", STREAM, _sse({"error": [1, 2]}, b"[DONE]")),
    "usage-string": _head("200 OK", STREAM, _sse(_chunk("a"), {"choices": [], "usage": "lots"}, b"[DONE]")),
    "usage-list": _head("200 OK", STREAM, _sse(_chunk("a"), {"choices": [], "usage": [1]}, b"[DONE]")),
    "completion-abc": _head("200 OK", STREAM, _sse(_chunk("a"), {"choices": [], "usage": {
        "completion_tokens": "abc"}}, b"[DONE]")),
    "choices-null": _head("200 OK", STREAM, _sse({"choices": [None]}, _chunk("a"), b"[DONE]")),
    "not-sse": _head("200 OK", STREAM, b"<html>hello</html>"),
    "html-500": _head("500 Internal Server Error", "application/json", b"<html><body>oops</body></html>"),
    "text-400": _head("400 Bad Request", "text/plain", b"your prompt is bad"),
    "json-422": _head("422 Unprocessable Entity", "application/json",
                      json.dumps({"object": "error", "message": "temperature out of range"}).encode()),
    "status-999": b"HTTP/1.1 999 Weird\r\nContent-Length: 2\r\n\r\nhi",
    "status-101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    "status-302": _head("302 Found", "text/html", b"", "Location: http://elsewhere/\r\n"),
    "always-429": _head("429 Too Many Requests", "application/json", b'{"error": {"message": "slow down"}}',
                        "Retry-After: 2\r\n"),
    "json-not-object": _head("200 OK", "application/json", b"[1, 2, 3]"),
    "json-garbage": _head("200 OK", "application/json", b"{not json"),
    "garbage": b"NOT HTTP AT ALL\r\n\r\n",
    "empty-close": b"",
}
# 16 MB of stream: more than a client's connection holds when it stops reading (its answer's bytes
# wait in the gateway, or in the backend's socket while the gateway stops reading it)
HUGE_CHUNK_TEXT = "x" * 16_000
LARGE = {"huge-stream": _head("200 OK", STREAM, _sse(*[_chunk(HUGE_CHUNK_TEXT)] * 1000, {"choices": [], "usage": {
    "prompt_tokens": 1, "completion_tokens": 1000, "total_tokens": 1001}}, b"[DONE]"))}
# answers whose connection closes after the bytes (no Content-Length to honour)
CUT = {"cut-mid-stream": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
       + f"{len(_sse(_chunk('a'))):x}\r\n".encode() + _sse(_chunk("a")) + b"\r\n"}


class Misbehaving:
    def __init__(self, bg_loop: BackgroundLoop) -> None:
        self.bg_loop = bg_loop
        self.mode = "ok-stream"
        self.posts = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

        async def start():
            return await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.server = bg_loop.run(start())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = next((int(h.split(":", 1)[1]) for h in lines if h.lower().startswith("content-length:")), 0)
                if length:
                    await reader.readexactly(length)
                if lines[0].startswith("GET"):
                    body = b'{"object": "list", "data": []}'
                    writer.write(_head("200 OK", "application/json", body))
                    await writer.drain()
                    continue
                self.posts += 1
                if self.mode == "silent":  # reads the request, never answers: until the gateway gives up
                    await reader.read()
                    break
                if self.mode in CUT:
                    writer.write(CUT[self.mode])
                    await writer.drain()
                    break
                writer.write(ANSWERS[self.mode] if self.mode in ANSWERS else LARGE[self.mode])
                await writer.drain()
                if self.mode in ("garbage", "empty-close", "status-101", "status-999"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        async def stop():
            self.server.close()
            await self.server.wait_closed()
        self.bg_loop.run(stop())
