"""The P/D hop: a request admitted on a disaggregated model goes to its prefill worker first.

vLLM's protocol for KV connectors (NixlConnector and others; its disaggregated-serving proxy
examples speak it, as llm-d's routing sidecar does): the prefill worker is sent the request with
`max_tokens` 1, not streamed, and `kv_transfer_params: {"do_remote_decode": true, ...}`; its answer
carries `kv_transfer_params` naming where the prompt's KV waits (engine id, block ids, host, port).
The decode worker is then sent the client's request as it came, with those `kv_transfer_params`:
it pulls the KV and generates the answer, which the gateway relays. The first token the client
sees is the decode worker's; the prefill worker's one token is discarded.

Both hops are the gateway's, so admission sees each: the prefill's end frees the prefill worker
(`AdmissionCore.handed_over`) and moves the request's permit to the decode worker.
"""

from __future__ import annotations

from typing import Any

import orjson

from bouncer.core.outcomes import Reason
from bouncer.gateway.relay import UpstreamFailure, failure_for_status
from bouncer.gateway.upstream import UpstreamResponse
from bouncer.gateway.upstream_body import token_limit_field

# what the prefill worker is told: compute the prompt, keep its KV for a remote decode
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(upstream_body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill worker gets it."""
    body = dict(upstream_body)
    body["stream"] = False
    body.pop("stream_options", None)
    body[token_limit_field(body)] = 1
    body.pop("min_tokens", None)  # a floor above one token would outlast the prefill
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return body


async def kv_transfer_params(up: UpstreamResponse, read_timeout: float) -> dict[str, Any]:
    """The prefill worker's answer: where the prompt's KV waits for the decode worker. A refusal
    raises as any backend's does (`failure_for_status`: held again for 429/503); an answer without
    the parameters is a misconfigured worker, said plainly."""
    raw = await up.read(read_timeout)
    if up.status != 200:
        raise failure_for_status(up.status, up.headers, raw)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    if not isinstance(params, dict):
        raise UpstreamFailure(502, Reason.UPSTREAM_ERROR,
                              "the prefill worker's answer has no kv_transfer_params: is it started with a KV "
                              "connector (vLLM --kv-transfer-config, bouncer engine --kv-connector)?")
    return params
