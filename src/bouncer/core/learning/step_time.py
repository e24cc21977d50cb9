"""An engine's step time as vLLM v1 runs it: the coefficients every prediction reads.

    step_time = a + b * batched_tokens + c * context_tokens + d * attention_pairs

given in the config (`models[].step_time`) or fitted online (`step_time_learner`); `latency`
predicts TTFT and TPOT from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    a: float  # s per step
    b: float  # s per batched token
    c: float  # s per context token attention reads
    max_batched_tokens: int  # the engine's per-step token budget (vLLM --max-num-batched-tokens)
    d: float = 0.0  # s per (prompt token computed, token before it) pair: prefill attention's compute
    # s of a first token spent outside the prefill steps: the step under way when the request
    # reaches the engine, HTTP, event loops (0 where the model is given: the engine model's own)
    e: float = 0.0

    def step(self, batched_tokens: float, context_tokens: float) -> float:
        return self.a + self.b * batched_tokens + self.c * context_tokens

    def batch_within(self, step_s: float, context_tokens: float) -> float:
        """Tokens a step may batch and still take at most `step_s`, reading `context_tokens`."""
        return (step_s - self.a - self.c * context_tokens) / self.b if self.b > 0 else float("inf")
