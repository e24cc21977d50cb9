"""What a front and the control plane hold of one request: its exchange (opened and closed by the
plane, its access line written once) and, once its body is checked, the parsed request (how an
admitted request ended comes back as `bouncer.core.journey.Outcome`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bouncer.config import ModelConfig
from bouncer.core.requests import RequestInfo
from bouncer.tokenizer import PromptTokenizer


@dataclass(slots=True)
class Exchange:
    """One request, from its arrival at a front to its end: its id, when it came, its access line
    (what each step found, written once when the plane closes it) and, where tracing is on, its
    span."""

    rid: str
    began: float
    line: dict[str, Any]
    span: Any = None  # an OpenTelemetry span (`bouncer.gateway.tracing`), where one is recorded
    closed: bool = False


@dataclass(slots=True, frozen=True)
class Parsed:
    """A generation request checked whole, not yet tokenized."""

    kind: str  # "chat" or "completion"
    body: dict[str, Any]
    head: RequestInfo  # all but its prompt's tokens
    raw: bytes  # its body as it came
    model: ModelConfig | None
    tokenizer: PromptTokenizer | None
