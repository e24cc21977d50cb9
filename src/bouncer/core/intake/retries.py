"""First attempts, remembered so that a client's retry keeps the deadline its user waits by.

A client refused with 429 or 503 (or timed out while queued) sends the same request again after
`Retry-After` or its backoff. Taken as a new request, the retry gets a fresh TTFT deadline, and
the engines then spend capacity on an answer that is already late for the user, ahead of
requests that could still be on time: clients retrying into the fire. With the first attempt's
arrival at hand, the retry keeps its first deadline, and once that has passed it is an
infeasible request: refused, or run best-effort, as its tenant's `slo.on_infeasible` says.

A request is known again by its tenant, model, prompt and max_tokens, and only when the client
says it is retrying (`x-stainless-retry-count`, sent by the OpenAI SDKs): two users sending the
same prompt are two requests.

Pure and bounded: a completed request is forgotten, and so is any first attempt older than
`remember_s` or beyond `max_entries` (the oldest first). `RetryLedger` is the in-process store;
the core sees it as a `RetryStore`, which a shared store implements for several gateways (a
retry may reach another gateway than its first attempt did).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from bouncer.core.requests import RequestInfo, RetryKey


def first_arrival(retries: RetryStore | None, tenant: str, info: RequestInfo,
                  now: float) -> tuple[RetryKey | None, float | None]:
    """(its key in the ledger, when its first attempt came) for a request whose client numbers
    its attempts (else None, None, as with the ledger off)."""
    key = retry_key(tenant, info)
    if retries is None or key is None:
        return None, None
    return key, retries.arrived(key, bool(info.retry_count), now)


def first_seen(retries: RetryStore | None, tenant: str, info: RequestInfo, now: float) -> float | None:
    """When a retry's first attempt came, as remembered here, recording nothing (None: not a
    retry, not remembered, or the ledger off). For the precheck, which may refuse a retry that
    is already late before its prompt is tokenized; `first_arrival` records it later."""
    key = retry_key(tenant, info) if info.retry_count else None
    return None if retries is None or key is None else retries.first_seen(key, now)


def retry_key(tenant: str, info: RequestInfo) -> RetryKey | None:
    """How the ledger knows a request again; None when its client does not number its attempts."""
    return None if info.prompt_digest is None else (tenant, info.model, info.prompt_digest, info.max_tokens)


class RetryStore(Protocol):
    """First attempts by key. Contract: `arrived(key, retry=False)` records `now` and returns it;
    `arrived(key, retry=True)` returns the recorded first arrival (recording `now` when none is
    remembered); `first_seen(key)` returns it (None when none is remembered) and records nothing;
    `completed(key)` forgets it; nothing older than `remember_s` is returned, and
    at most `max_entries` are kept."""

    remember_s: float
    max_entries: int

    def __len__(self) -> int: ...
    def arrived(self, key: RetryKey, retry: bool, now: float) -> float: ...
    def first_seen(self, key: RetryKey, now: float) -> float | None: ...
    def completed(self, key: RetryKey) -> None: ...


class RetryLedger:
    def __init__(self, remember_s: float, max_entries: int) -> None:
        self.remember_s = remember_s
        self.max_entries = max_entries
        self._first: OrderedDict[RetryKey, float] = OrderedDict()  # key -> first attempt's arrival, oldest first

    def __len__(self) -> int:
        return len(self._first)

    def arrived(self, key: RetryKey, retry: bool, now: float) -> float:
        """An attempt at `key` arrived at `now`; `retry`: the client says it tried before. Returns
        when the request's first attempt arrived (`now` for a first attempt, or for a retry whose
        first attempt is not remembered)."""
        self._forget_old(now)
        first = self._first.get(key) if retry else None
        if first is None:
            self._first[key] = first = now
            self._first.move_to_end(key)
            if len(self._first) > self.max_entries:
                self._first.popitem(last=False)
        return first

    def first_seen(self, key: RetryKey, now: float) -> float | None:
        first = self._first.get(key)
        return first if first is not None and first >= now - self.remember_s else None

    def completed(self, key: RetryKey) -> None:
        """Its answer was delivered: a later request with the same key is a new one."""
        self._first.pop(key, None)

    def _forget_old(self, now: float) -> None:
        horizon = now - self.remember_s
        while self._first:
            key, first = next(iter(self._first.items()))
            if first >= horizon:
                break
            del self._first[key]
