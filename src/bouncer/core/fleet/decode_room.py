"""Decode room: whether a decode worker will hold a request's KV when its prefill has ended.

In a disaggregated fleet (backends with `role: prefill` and `role: decode`) a request's KV moves
from the prefill worker that computed its prompt to a decode worker that generates its answer.
The two pools fill at different times, and a decode worker's load *now* says little about its
load when a request admitted now reaches it: Mooncake's first early-rejection policy read the
current decode load, and oscillated in anti-phase (FAST'25, section 7.3: prefill accepts a wave
while decode looks empty, decode fills, everything is refused, decode drains, again). A request
refused at decode has also spent its prefill.

So each decode worker keeps a ledger of what it is bound to hold. Every request dispatched to a
prefill worker with it named as the decode worker is in the ledger from when it is predicted to
arrive there (its predicted TTFT on the prefill worker) until it is predicted to end (its
tenant's mean output at the worker's time per output token), holding its prompt's KV at arrival
and one token more per output token, as the engine allocates it. A new request fits when, over the
span it would be there, the most the ledger holds at any instant plus its own prompt and mean
output stays under the busy threshold of the worker's KV. Means, not the margin a colocated
replica reserves for one request (`output_length.expected`): a decode worker holds hundreds of
requests, and their total is close to the sum of their means.

The predictions are corrected online from what the worker shows: arrivals and first tokens
re-anchor a request's span, the worker's time per output token is learned from completions, and
a request still running past its predicted end is expected to run as long again from now (output
lengths are heavy-tailed: one that ran long is likely a long one), its KV still growing.

Pure: every method takes `now`.
"""

from __future__ import annotations

from dataclasses import dataclass

TPOT_PRIOR_S = 0.03  # time per output token before a completion taught the worker's own
HANDOFF_PRIOR_S = 0.05  # from the prefill's end to the decode worker's first token: transfer and a step
EWMA = 0.1  # weight of each new observation


@dataclass(slots=True)
class _Bound:
    prompt: int  # tokens
    output: int  # the mean output it is counted for
    start: float  # predicted (then actual) arrival at the decode worker
    end: float  # predicted end
    first_token_at: float | None = None


class DecodeLedger:
    """What one decode worker is bound to hold, over time, in tokens of KV."""

    def __init__(self) -> None:
        self._bound: dict[str, _Bound] = {}
        self.tpot_s = TPOT_PRIOR_S
        self.handoff_s = HANDOFF_PRIOR_S
        self._handed_at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._bound)

    def duration(self, output: int) -> float:
        """How long a request of this mean output is predicted to stay, from its arrival."""
        return self.handoff_s + output * self.tpot_s

    def bind(self, request_id: str, prompt: int, output: int, arrive_at: float) -> None:
        """Dispatched to prefill with this worker as its decode worker, predicted here at `arrive_at`."""
        self._bound[request_id] = _Bound(prompt, output, arrive_at, arrive_at + self.duration(output))

    def arrived(self, request_id: str, now: float) -> None:
        """Its prefill ended and its KV is on its way here."""
        b = self._bound.get(request_id)
        if b is None:
            return
        b.start, b.end = now, now + self.duration(b.output)
        self._handed_at[request_id] = now

    def first_token(self, request_id: str, now: float) -> None:
        b = self._bound.get(request_id)
        if b is None:
            return
        handed = self._handed_at.pop(request_id, None)
        if handed is not None:
            self.handoff_s += EWMA * ((now - handed) - self.handoff_s)
        b.first_token_at = now
        b.start = min(b.start, now)
        b.end = now + max(0, b.output - 1) * self.tpot_s

    def observe_tpot(self, tpot_s: float) -> None:
        """A completed answer's time per output token here."""
        self.tpot_s += EWMA * (tpot_s - self.tpot_s)

    def release(self, request_id: str) -> None:
        self._bound.pop(request_id, None)
        self._handed_at.pop(request_id, None)

    def peak(self, start: float, end: float, now: float, limit: float = float("inf")) -> float:
        """The most KV tokens held at any instant of [start, end]. Each request holds its prompt
        from its start, growing by a token per `tpot_s`, until its end: a sweep over the starts
        and ends inside the span, the total growing linearly between them. With `limit`, the sweep
        is skipped where bounds decide (most calls): a value over `limit` then says the peak is
        over it too; one at or under it bounds the peak from above."""
        rate = 1.0 / self.tpot_s
        value = slope = 0.0
        upper = 0.0  # every request in the span at the most it would hold there
        events: list[tuple[float, float, float]] = []  # (time, tokens added, slope added)
        overdue_end = now + self.handoff_s
        for b in self._bound.values():
            b_start, b_end = b.start, b.end
            if b_end <= now:  # overdue: it runs as long again as it was expected to, from now
                b_end = overdue_end + b.output * self.tpot_s
            if b_end <= start or b_start >= end:
                continue
            top = b.prompt + ((b_end if b_end < end else end) - b_start) * rate
            upper += top
            if b_start <= start:
                value += b.prompt + (start - b_start) * rate
                slope += rate
            else:
                events.append((b_start, b.prompt, rate))
            if b_end < end:
                events.append((b_end, -top, -rate))
        if value > limit:
            return value
        if upper <= limit < float("inf"):
            return upper
        peak = value
        t = start
        # at equal times, ends before starts: a request leaving frees its KV for one arriving
        events.sort()
        for at, tokens, dslope in events:
            value += slope * (at - t)
            t = at
            if value > peak:
                peak = value  # the most is just before an end
            value += tokens
            slope += dslope
        return max(peak, value + slope * (end - t))


def choose_decode(workers: list, prompt: int, output: int, block_size: int, arrive_at: float, threshold: float,
                  now: float):
    """The decode worker (a `ReplicaState` with a ledger) with the most room over the span a
    request of `prompt` tokens and mean `output` would be there, among those where the ledger's
    peak plus the whole request stays under `threshold` of its KV; None when none has room (it
    waits). A worker whose KV size is not known yet is judged by how many it is bound to hold."""
    best, best_load = None, float("inf")
    need = prompt + output
    for r in workers:
        ledger: DecodeLedger = r.decode_ledger
        cap = r.capacity_blocks
        if cap:
            limit = cap * block_size * threshold - need
            peak = ledger.peak(arrive_at, arrive_at + ledger.duration(output), now, limit)
            load = (peak + need) / (cap * block_size)
            if load > threshold and peak > 0:
                continue
        else:
            load = float(len(ledger))
        if load < best_load:
            best, best_load = r, load
    return best
