"""Envoy's ext_proc messages as the picker reads and writes them (the generated protos of
`xds-protos`): request headers in, header mutations and immediate answers out, the request body
whole, answer chunks passed back in full duplex, GIE's subset hint, and the usage of an answer
read to its end."""

from __future__ import annotations

from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from multidict import CIMultiDict

from bouncer.core.outcomes import Refusal
from bouncer.gateway.errors import refusal_answer
from bouncer.gateway.exchange import Outcome
from bouncer.gateway.relay import read_usage
from bouncer.openai_wire import ApiError, dumps

DROPPED_REASON = "x-llm-d-request-dropped-reason"  # llm-d's name for why a request was refused
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"


def set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def headers_of(msg: ext_proc.HttpHeaders) -> CIMultiDict[str]:
    return CIMultiDict((h.key, h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in msg.headers.headers)


def header_of(msg: ext_proc.HttpHeaders, name: str) -> str:
    """One header's value ("" if absent), without building them all."""
    for h in msg.headers.headers:
        if h.key == name:
            return h.raw_value.decode("latin-1") if h.raw_value else h.value
    return ""


def immediate(status: int, headers: dict[str, str], body: bytes, details: str) -> ext_proc.ProcessingResponse:
    """An answer Envoy sends the client itself, in place of the replica's (a JSON body)."""
    mutation = ext_proc.HeaderMutation(set_headers=[set_header(k, v) for k, v in headers.items()])
    mutation.set_headers.append(set_header("content-type", "application/json"))
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=body, details=details))


def refused(refusal: Refusal, extra: dict[str, str] | None = None) -> ext_proc.ProcessingResponse:
    """A refusal as the proxy answers it (`errors.refusal_answer`), with llm-d's reason header too
    and `extra` (the tenant's rate-limit headers)."""
    status, headers, body = refusal_answer(refusal)
    headers[DROPPED_REASON] = str(refusal.reason)
    if extra:
        headers.update(extra)
    return immediate(status, headers, body, str(refusal.reason))


def plain_error(status: int, message: str, error_type: str, code: str) -> ext_proc.ProcessingResponse:
    return immediate(status, {}, dumps(ApiError(status, message, error_type, code=code).body()), code)


def subset_hint(first: ext_proc.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows for this request (GIE's subset hint, in the
    `envoy.lb.subset_hint` filter metadata), or None where it sets none."""
    hint = first.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    items = value.list_value.values if value.HasField("list_value") else [value]
    return [e.strip() for v in items for e in v.string_value.split(",") if e.strip()]


class BodyTooLarge(Exception):
    """The request body went past the limit before it ended."""


async def request_body(context: grpc.aio.ServicerContext, limit: int) -> bytes | None:
    """The whole request body: one message (buffered) or its chunks (full duplex); None when
    Envoy gave up first. Past `limit` bytes it is not read on (`BodyTooLarge`): a client that
    streams chunks without end holds no more than that here."""
    parts: list[bytes] = []
    size = 0
    while (msg := await context.read()) is not grpc.aio.EOF:
        if msg.HasField("request_trailers"):
            return b"".join(parts)
        if msg.HasField("request_body"):
            chunk = msg.request_body.body
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            parts.append(chunk)
            if msg.request_body.end_of_stream:
                return b"".join(parts)
    return None


def passed_back(body: bytes, end: bool) -> ext_proc.ProcessingResponse:
    """A chunk of the answer passed on unchanged (full duplex)."""
    common = ext_proc.CommonResponse()
    common.body_mutation.streamed_response.body = body
    common.body_mutation.streamed_response.end_of_stream = end
    return ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse(response=common))


def read_usage_of(body: bytes | bytearray, streaming: bool, out: Outcome) -> bool:
    """The usage of an answer read whole (its JSON, or its stream's usage chunk) into `out`:
    prompt and completion tokens, as the engine counted them; whether it had one."""
    objects: list[Any] = []
    if streaming:
        for raw_line in bytes(body).splitlines():
            if raw_line.startswith(b"data:") and raw_line[5:].strip() != b"[DONE]":
                try:
                    objects.append(orjson.loads(raw_line[5:]))
                except orjson.JSONDecodeError:
                    continue
    else:
        try:
            objects.append(orjson.loads(bytes(body)))
        except orjson.JSONDecodeError:
            return False
    return any(read_usage(obj, out) for obj in reversed(objects))
