"""The `x-ratelimit-*` headers OpenAI's API sends, from a tenant's rate-limit buckets.

On every answer (served or refused) to a tenant with rate limits: for requests and for tokens,
`x-ratelimit-limit-*` (the bucket's size: what may go at once), `x-ratelimit-remaining-*` (what
it holds now) and `x-ratelimit-reset-*` (until it is full again, as OpenAI writes durations:
`20ms`, `1s`, `6m0s`). The limit is the bucket's burst, not the per-minute rate, so that the three
agree: remaining never passes the limit, and reaches it at the reset. Token buckets are settled
at what requests used (`bouncer.core.intake.rate_limit`), so what remains is what was not used.
"""

from __future__ import annotations

Headroom = tuple[float, float, float] | None  # a bucket's (level, burst, rate per second), None: no limit


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers (and Go) write it: `0s`, `20ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    whole = round(seconds, 3)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes else text


def ratelimit_headers(requests: Headroom, tokens: Headroom) -> dict[str, str]:
    out = {}
    for unit, bucket in (("requests", requests), ("tokens", tokens)):
        if bucket is None:
            continue
        level, burst, rate = bucket
        out[f"x-ratelimit-limit-{unit}"] = str(int(burst))
        out[f"x-ratelimit-remaining-{unit}"] = str(max(0, int(level)))
        out[f"x-ratelimit-reset-{unit}"] = duration(max(0.0, burst - level) / rate)
    return out
