"""Standing queues: under sustained overload a shorter queue serves as many, sooner.

When a tenant's requests arrive faster than the fleet leaves room for them, its queue fills to
whatever budget its requests are planned on (`deadlines.queue_budget`, `deadlines.late_by`):
the band is served at the rate the fleet leaves it whatever the queue holds, so a longer queue
adds only waiting. Planned on the whole TTFT SLO, every request served waits out most of it and
gets its first token at the SLO's edge, where any error in the prediction makes it late. On
ServeGen's m-mid pool at load 3 the bulk client's first tokens came 0.19 s before its 2 s SLO at
the median; with standing queues planned on 70% of it, 0.67 s before, at the same goodput
(docs/benchmarks/history/standing-queues.md, "Standing queues, and the top band protected more while it misses").

A burst is not a standing queue: its queue drains after it, and cutting its budget would refuse
requests that would have been served in time. The two are told apart, after CoDel's idea
(Nichols and Jacobson, "Controlling Queue Delay", 2012), by the waits over a whole interval. A
tenant's queue in a band (one `_Queue` per band and tenant, since fair queueing serves a light
tenant at once while a heavy one's queue stands) is standing once the mean wait of the requests
that left it over an interval (at least `MIN_INTERVAL_S`, at least the SLO) was more than
`ENTER_SHARE` of their TTFT SLO; it stops standing once an interval's mean is under
`EXIT_SHARE` (it drained). (CoDel's own rule, the least wait, flapped: on m-mid the bulk queue's
waits run in a sawtooth from near 0, so every interval held one short wait.) While standing, its
newcomers are planned on `policy.standing_queue_share` of what their SLO leaves.

Waits are measured as the requests leave the waiting room by any way (dispatched, expired,
refused as late, evicted, cancelled): a band that gets no dispatch at all has its requests
expire after waiting out their budget, and that is a standing queue too. Pure and O(1) per
departure; a queue's state is touched only by its own requests.

Sheddable bands (below 0) never stand. They are served from spare capacity only: they dispatch
while the pool's saturation is under their ceiling, in bursts as it dips, and their door shuts
while it is over. Their queue is what fills those bursts, and the ceiling already bounds it. A
plan cut to 70% left less to send: the live guidellm flood's simulated twin (band -1, TTFT SLO
5 s, beside a top tenant) served 603 of its 1,134 requests within SLO at load 2, against 619
with its queue never judged standing (docs/benchmarks/history/sheddable-bands.md, "Sheddable bands do not stand").
"""

from __future__ import annotations

ENTER_SHARE = 0.5  # an interval whose mean wait was over this share of the TTFT SLO: standing
EXIT_SHARE = 0.15  # one whose mean wait was under this share: drained
MIN_INTERVAL_S = 2.0  # a burst shorter than this is not a standing queue, whatever the SLO


class _Queue:
    __slots__ = ("interval_end", "interval_s", "waited", "departures", "standing")

    def __init__(self) -> None:
        self.interval_end = -1.0  # the first departure opens the first interval
        self.interval_s = MIN_INTERVAL_S
        self.waited = 0.0  # sum of the waits in the current interval, as shares of their SLO
        self.departures = 0
        self.standing = False


class StandingQueues:
    """One model's queues, by band and tenant: which stand."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, str], _Queue] = {}

    def departed(self, band: int, tenant: str, waited: float, ttft_slo: float, now: float) -> None:
        """A request of `tenant` in `band` left the waiting room after `waited` seconds."""
        if band < 0:  # sheddable: never standing (module doc)
            return
        key = (band, tenant)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = _Queue()
        if now >= q.interval_end:
            if q.departures:  # the interval that ended had departures: judge it
                q.standing = q.waited / q.departures > (EXIT_SHARE if q.standing else ENTER_SHARE)
            q.interval_s = max(MIN_INTERVAL_S, ttft_slo)
            q.interval_end = now + q.interval_s
            q.waited, q.departures = 0.0, 0
        q.waited += waited / ttft_slo
        q.departures += 1

    def standing(self, band: int, tenant: str, now: float) -> bool:
        """Whether its queue stands: judged so at the last interval's end, and not idle since
        (a whole interval without a departure: nothing waited, for a queued request waits at
        most its SLO's budget)."""
        q = self._queues.get((band, tenant))
        return q is not None and q.standing and now < q.interval_end + q.interval_s

    def snapshot(self, now: float) -> list[dict]:
        return [{"band": band, "tenant": tenant} for band, tenant in sorted(self._queues)
                if self.standing(band, tenant, now)]
