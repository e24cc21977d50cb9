"""The gateway's error answers: a refusal as an OpenAI error with the headers clients act on, and
a plain OpenAI error for what is not a generation request (admin, metrics, unknown paths)."""

from __future__ import annotations

import math

from aiohttp import web

from bouncer.core.outcomes import Refusal
from bouncer.openai_wire import ApiError, dumps


def refusal_answer(refusal: Refusal) -> tuple[int, dict[str, str], bytes]:
    """The one place a refusal becomes an HTTP answer: status, headers, OpenAI error body (sent
    by the proxy, or by Envoy for the picker)."""
    err = ApiError(refusal.status, refusal.message, refusal.error_type, code=str(refusal.reason), param=refusal.param,
                   layer=refusal.layer.value, reason=str(refusal.reason))
    headers = {"x-bouncer-layer": refusal.layer.value, "x-bouncer-reason": str(refusal.reason)}
    if not refusal.should_retry:
        # this request cannot succeed if sent again (the OpenAI SDKs honour it); a Retry-After
        # may still say when new work would fit
        headers["x-should-retry"] = "false"
    if refusal.retry_after is not None:
        # whole seconds by the standard; milliseconds for clients that read them (OpenAI SDKs)
        headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_after)))
        headers["retry-after-ms"] = str(int(refusal.retry_after * 1000))
    return refusal.status, headers, dumps(err.body())


def error_response(refusal: Refusal) -> web.Response:
    status, headers, body = refusal_answer(refusal)
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def plain_error(status: int, message: str, error_type: str, code: str) -> web.Response:
    """An OpenAI error body for what is not a generation request."""
    return web.Response(status=status, body=dumps(ApiError(status, message, error_type, code=code).body()),
                        content_type="application/json")
