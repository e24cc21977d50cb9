"""What a front hands the control plane: a parsed request going in (how an admitted request
ended comes back as `bouncer.core.journey.Outcome`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bouncer.config import ModelConfig
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
