"""First attempts several gateways share: a retry that reaches another gateway than its first
attempt did still keeps its first deadline.

The core never waits, so the shell asks the shared store before offering a retry (one call, and
only for requests whose client says they are retries) and hands the answer over with `prefetch`;
`arrived` then takes the earlier of it and what this gateway remembers. The first attempts this
gateway records, and the requests it completes, wait in `drain` for the shell to send (in the
background, one pipelined call per turn of its loop). Without an answer (the shared store is
away) the ledger is this gateway's own, as with one gateway.
"""

from __future__ import annotations

from bouncer.core.intake.retries import RetryLedger
from bouncer.core.requests import RetryKey

MAX_FETCHED = 1024  # answers kept for retries not offered yet (one refused before its ledger layer leaves one)


class SharedRetries(RetryLedger):
    """A `RetryStore`: the in-process ledger, plus what the shell fetched from and owes to the
    shared store."""

    def __init__(self, remember_s: float, max_entries: int) -> None:
        super().__init__(remember_s, max_entries)
        self._fetched: dict[RetryKey, float] = {}  # a retry's first arrival as the shared store has it
        self._recorded: list[tuple[RetryKey, float]] = []  # first attempts seen here: to publish
        self._completed: list[RetryKey] = []  # answered here: to forget there too

    def arrived(self, key: RetryKey, retry: bool, now: float) -> float:
        shared = self._fetched.pop(key, None) if retry else None
        first = super().arrived(key, retry, now)
        if shared is not None and shared < first:
            first = self._first[key] = shared
        elif first == now:
            self._recorded.append((key, now))
        return first

    def first_seen(self, key: RetryKey, now: float) -> float | None:
        local, shared = super().first_seen(key, now), self._fetched.get(key)
        return shared if local is None or (shared is not None and shared < local) else local

    def completed(self, key: RetryKey) -> None:
        super().completed(key)
        self._completed.append(key)

    # -- the shell's side ----------------------------------------------------------------------
    def prefetch(self, key: RetryKey, first: float | None) -> None:
        """The shared store's first arrival for the retry about to be offered (None: it has none)."""
        if first is not None:
            self._fetched[key] = first
            while len(self._fetched) > MAX_FETCHED:  # answers for retries an earlier layer refused
                del self._fetched[next(iter(self._fetched))]

    def drain(self) -> tuple[list[tuple[RetryKey, float]], list[RetryKey]]:
        """(first attempts recorded here, requests completed here) since the last drain."""
        out = self._recorded, self._completed
        self._recorded, self._completed = [], []
        return out
