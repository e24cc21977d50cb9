"""The body a request goes upstream with: the client's, with what the gateway decides written over it.

One place for both fronts and every hop (a replica, a P/D prefill worker, an overflow endpoint):
- `model`: the name the backend serves it under;
- the token limit: what the core clamped it to (the tenant's default and cap, the context), under
  whichever name the client used (`max_completion_tokens` or `max_tokens`);
- a stream asks for its usage (`include_usage`) where the gateway reads it, and, where the engine
  can say it in every chunk (vLLM, SGLang: `continuous_usage_stats`), in every chunk: a client
  that hangs up mid-stream is then charged what the engine had generated when it left, not what
  it read (`relay`);
- the fields that steer the engine are the gateway's (`STEERING`), never a client's: `priority`
  would jump vLLM's priority queue past every other tenant, `kv_transfer_params` and
  `ec_transfer_params` would have the engine fetch KV from a host the client names,
  `request_id` would collide with other requests' ids in the engine, `cache_salt` would share or
  probe another tenant's cached prefixes. A client's are dropped, and named in its access line;
  the gateway sets `cache_salt` itself, to its tenant's (`bouncer.core.fleet.cache_salt`).
"""

from __future__ import annotations

from typing import Any

STEERING = ("priority", "request_id", "kv_transfer_params", "ec_transfer_params", "cache_salt")
# engines that send usage with every chunk when asked (`stream_options.continuous_usage_stats`);
# others (TGI, llama.cpp, an OpenAI-compatible provider) may refuse the field
USAGE_EVERY_CHUNK = frozenset({"vllm", "sglang"})


def token_limit_field(body: dict[str, Any]) -> str:
    """The name the client gave its token limit (the newer one where it used it)."""
    return "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"


def upstream_body(body: dict[str, Any], model: str, max_tokens: int, *, usage: bool = False,
                  usage_every_chunk: bool = False, cache_salt: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """The body to send, and the steering fields the client sent that were dropped. `usage`: a
    stream asks for its usage (`usage_every_chunk`: in every chunk); `cache_salt`: its tenant's."""
    out = dict(body)
    dropped = [f for f in STEERING if f in out]
    for f in dropped:
        del out[f]
    out["model"] = model
    out[token_limit_field(body)] = max_tokens
    if usage and body.get("stream"):
        options = {**(body.get("stream_options") or {}), "include_usage": True}  # checked: an object
        if usage_every_chunk:
            options["continuous_usage_stats"] = True
        out["stream_options"] = options
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    return out, dropped
