"""In the gateway, what a cheap layer refuses is refused before its prompt is tokenized."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from gateway_setup import Fleet, tenant


def _post(url: str, key: str, content: str) -> int:
    body = json.dumps({"model": "demo-llm", "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    req = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def test_a_flood_over_its_rate_limit_is_refused_untokenized(bg_loop):
    f = Fleet(bg_loop, [tenant("rogue", -1, rate_limit={"requests_per_s": 1, "request_burst": 2})])
    try:
        segments = f.call(lambda: f.gateway.prepared.tokenizers["demo-llm"].segments)
        before = f.call(lambda: segments.misses + segments.hits)
        statuses = [_post(f.url, "rogue", f"request {i}: " + "long prompt words " * 400) for i in range(12)]
        assert statuses.count(200) >= 2 and statuses.count(429) >= 8, statuses
        looked_up = f.call(lambda: segments.misses + segments.hits) - before
        # each tokenized request looks up its message and the generation prompt: only those let through
        assert looked_up == 2 * statuses.count(200)
        refused = f.call(lambda: f.gateway.core.stats.decisions[("refused", "rate", "rate_limited_requests",
                                                                   "rogue", -1)])
        assert refused == statuses.count(429)
        assert f.call(lambda: f.gateway.core.stats.arrived["rogue"]) == 12  # each counted once
    finally:
        f.close()


def test_a_key_that_is_not_utf8_is_a_401_not_a_500(bg_loop):
    import socket
    import urllib.parse

    f = Fleet(bg_loop, [tenant("t")])
    try:
        url = urllib.parse.urlparse(f.url)
        body = b'{"model": "demo-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
        raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"api-key: \xff\xfe\xfd\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with socket.create_connection((url.hostname, url.port), timeout=10) as s:
            s.sendall(raw)
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert f.call(lambda: f.gateway.metrics.internal_errors._value.get()) == 0
    finally:
        f.close()
