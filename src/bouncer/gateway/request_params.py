"""The parameters of an OpenAI request that the gateway forwards, checked before admission.

The body goes to the engine as the client sent it (but for `model`, the token limit and
`stream_options`), so a parameter of the wrong type would either reach the engine, which may
answer it with anything from a 400 to a 200 that ignored it, or trip the gateway's own reading
of it. Each known parameter is checked here for its type and range, with the OpenAI API's
bounds (and vLLM's for its own extensions); `null` means "not set" for all of them, as in the
OpenAI API. Unknown parameters pass through untouched: engines add their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bouncer.openai_wire import ApiError

Check = Callable[[Any], str | None]  # None if the value is acceptable, else what it must be


def _in_range(kind: str, v: float, lo: float | None, hi: float | None) -> str | None:
    """None if `v` lies in [lo, hi] (either bound may be open), else what it must be."""
    if (lo is None or v >= lo) and (hi is None or v <= hi):
        return None
    if lo is not None and hi is not None:
        return f"{kind} from {lo:g} to {hi:g}"
    return f"{kind} of at least {lo:g}" if lo is not None else f"{kind} of at most {hi:g}"


def _number(lo: float | None = None, hi: float | None = None) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return "a finite number"
        return _in_range("a number", v, lo, hi)
    return check


def _integer(lo: int | None = None, hi: int | None = None) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return "an integer"
        return _in_range("an integer", v, lo, hi)
    return check


def _boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _string(v: Any) -> str | None:
    return None if isinstance(v, str) else "a string"


def _object(v: Any) -> str | None:
    return None if isinstance(v, dict) else "an object"


def _array(v: Any) -> str | None:
    return None if isinstance(v, list) else "an array"


def _stop(v: Any) -> str | None:
    if isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        return None
    return "a string or an array of strings"


def _logit_bias(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "an object of token id to bias"
    for bias in v.values():
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            return "an object of token id to a bias from -100 to 100"
    return None


def _stream_options(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "an object"
    for key in ("include_usage", "continuous_usage_stats"):
        if v.get(key) is not None and not isinstance(v[key], bool):
            return f"an object whose {key} is true or false"
    return None


def _string_or_object(v: Any) -> str | None:
    return None if isinstance(v, str | dict) else "a string or an object"


COMMON: dict[str, Check] = {
    "stream": _boolean,
    "stream_options": _stream_options,
    "max_tokens": _integer(),  # its range is the core's (limits.max_tokens_min, the context)
    "max_completion_tokens": _integer(),  # the newer name; either is read
    "n": _integer(),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "stop": _stop,
    "seed": _integer(),
    "logit_bias": _logit_bias,
    "user": _string,
    # vLLM's sampling extensions
    "top_k": _integer(-1),
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0),
    "min_tokens": _integer(0),
    "ignore_eos": _boolean,
    "skip_special_tokens": _boolean,
}

CHAT: dict[str, Check] = {
    **COMMON,
    "logprobs": _boolean,
    "top_logprobs": _integer(0, 20),
    "response_format": _object,
    "tools": _array,
    "tool_choice": _string_or_object,
    "parallel_tool_calls": _boolean,
}

COMPLETION: dict[str, Check] = {
    **COMMON,
    "best_of": _integer(),
    "logprobs": _integer(0, 5),
    "echo": _boolean,
    "suffix": _string,
}


def check_params(kind: str, body: dict[str, Any]) -> None:
    """Raise a 400 naming the first known parameter of the wrong type or out of range."""
    checks = CHAT if kind == "chat" else COMPLETION
    for name, value in body.items():
        check = checks.get(name)
        if check is None or value is None:
            continue
        wanted = check(value)
        if wanted is not None:
            raise ApiError(400, f"{name} must be {wanted}", param=name, code="invalid_parameter")
