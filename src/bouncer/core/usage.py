"""What a dispatched request used of its engine when the engine never said.

An engine tells a request's usage in its answer: whole, in the last chunk of a stream, or in every
chunk (vLLM and SGLang, asked to). A client that leaves before any of it came (a whole answer it
did not wait for, a stream it left before its first chunk) leaves the gateway only the time the
request ran; closing the upstream makes the engine abort it, but by then the engine may have
computed its prompt and some of its answer. Charging nothing would make a hang-up a way to pay
less than was used; so it is charged what the core's own predictions for it say was done by then:
its prompt once its predicted prefill time has passed (as vLLM counts prompt tokens, once the
prefill is over), and the tokens its predicted time per token allows since.
"""

from __future__ import annotations

from bouncer.core.outcomes import Dispatch


def estimated_usage(d: Dispatch, prompt_tokens: int, now: float) -> tuple[int, int | None]:
    """(prompt, completion) tokens the engine most likely spent on `d` by `now`. Completion None:
    the core had no prediction for it (no step-time model yet): it is then charged what was
    reserved for it, its prompt and its expected output."""
    ttft = d.predicted_ttft_s
    if ttft is None:
        return prompt_tokens, None
    elapsed = now - d.dispatched_at
    if elapsed < ttft:
        return 0, 0
    tpot = d.predicted_tpot_s
    decoded = 1 + int((elapsed - ttft) / tpot) if tpot else 1
    return prompt_tokens, min(d.max_tokens, decoded)
