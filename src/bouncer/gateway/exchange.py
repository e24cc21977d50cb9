"""What a front and the control plane hand each other: a parsed request going in, and how an
admitted request ended coming back (`bouncer.gateway.control_plane`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bouncer.config import ModelConfig
from bouncer.core.outcomes import Reason, Terminal
from bouncer.core.requests import RequestInfo
from bouncer.tokenizer import PromptTokenizer


@dataclass(slots=True, frozen=True)
class Parsed:
    """A generation request checked whole, not yet tokenized."""

    kind: str  # "chat" or "completion"
    body: dict[str, Any]
    head: RequestInfo  # all but its prompt's tokens
    raw: bytes  # its body as it came
    model: ModelConfig | None
    tokenizer: PromptTokenizer | None


@dataclass(slots=True)
class Outcome:
    """How an admitted request ended, for the core's `finished` and its quota. `completion_tokens`
    None: the front did not see the answer's length (an endpoint picker that let it pass, a
    client that left before a whole answer came). `prompt_tokens`: the engine's own count, where
    its usage said (the gateway's count stands in otherwise)."""

    terminal: Terminal = Terminal.FAILED
    reason: Reason | None = Reason.UPSTREAM_ERROR
    completion_tokens: int | None = 0
    first_token_at: float | None = None
    prompt_tokens: int | None = None
