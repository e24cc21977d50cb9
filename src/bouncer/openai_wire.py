"""The OpenAI wire format: error bodies, response objects and server-sent events.

Shared by the engine model's server and the gateway, so both speak exactly the same dialect.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

SSE_DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """An error to send as an OpenAI error body. `extra` fields (Bouncer's layer and reason)
    go inside the `error` object, where OpenAI clients ignore what they do not know."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | int | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def stream_chunk(kind: str, rid: str, model: str, created: int, text: str | None,
                 finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
    """One streamed event: `kind` is "chat" or "completion"."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, model: str, created: int, usage_obj: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_obj}


def full_response(kind: str, rid: str, model: str, created: int, text: str, finish_reason: str,
                  usage_obj: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_obj}


def models_list(names: list[str], owned_by: str = "bouncer") -> dict[str, Any]:
    created = int(time.time())
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": owned_by} for n in names]}
