"""Band protection: a band that sent requests recently has its TTFT and TPOT SLOs protected from
lower bands (`BandSLOs`), which placement reads as reserves; more so while it misses (`missed`).
"""

from __future__ import annotations

from bouncer.config import SLO

INF = float("inf")
BAND_ACTIVE_S = 10.0  # a band that sent a request this recently has its TTFT protected from lower bands
# The top band, for STRAINED_S after it missed its TTFT (a request refused or expired as late, a
# first token past its deadline), is protected as if its TTFT SLO were STRAINED_SLO_SHARE of it:
# lower bands keep the prefill queue shorter for it. On consolidation at load 3, where the
# realtime band's bursts pass the fleet's capacity, the fixed reserve left it 97.2% within SLO in
# the mix against 98.4% alone; a reserve as strict all the time (ttft_reserve_fraction 0.1) cost
# the standard band a fifth of its goodput at load 1, where the realtime band misses next to
# nothing; strained for 10 s after each miss, 2% of it there (docs/benchmarks/history/standing-queues.md, "The top band,
# protected more while it misses").
STRAINED_SLO_SHARE = 0.4
STRAINED_S = 3.0


class BandSLOs:
    """Per band, the strictest TTFT and TPOT SLO promised to its tenants that sent requests
    recently, and when it last missed its TTFT; with several gateways, the same as the others
    last said (`seen_elsewhere`), so that a gateway keeps room for a top band whose requests all
    arrive at another."""

    __slots__ = ("ttft", "tpot", "last_miss", "peer_ttft", "peer_tpot", "peer_miss")

    def __init__(self) -> None:
        self.ttft: dict[int, tuple[float, float]] = {}  # band -> (strictest recent SLO, last arrival)
        self.tpot: dict[int, tuple[float, float]] = {}
        self.last_miss: dict[int, float] = {}
        self.peer_ttft: dict[int, tuple[float, float]] = {}  # the same, at the other gateways
        self.peer_tpot: dict[int, tuple[float, float]] = {}
        self.peer_miss: dict[int, float] = {}

    def missed(self, band: int, now: float) -> None:
        """A request of `band` missed its TTFT SLO: refused or expired as late (the finaliser),
        or its first token came past its deadline (feedback)."""
        self.last_miss[band] = now

    def strained(self, band: int, now: float) -> bool:
        last = max(self.last_miss.get(band, -INF), self.peer_miss.get(band, -INF))
        return now - last <= STRAINED_S

    def note(self, band: int, slo: SLO, now: float) -> None:
        """A request of `band` came, from a tenant promised `slo`. The configured promise, never a
        client's tighter header: a header tightens its own request's deadline only, or one cheap
        request (refused, even) could make every lower band hold room for a 1 ms TTFT."""
        if slo.ttft_s:
            self._note(self.ttft, band, slo.ttft_s, now)
        if slo.tpot_s:
            self._note(self.tpot, band, slo.tpot_s, now)

    @staticmethod
    def _note(slos: dict[int, tuple[float, float]], band: int, slo: float, now: float) -> None:
        prev = slos.get(band)
        recent = prev is not None and now - prev[1] <= BAND_ACTIVE_S
        slos[band] = (min(prev[0], slo) if recent else slo, now)

    def protected(self, priority: int, now: float) -> tuple[float, float]:
        """The strictest TTFT and TPOT SLOs of bands above `priority` that sent requests
        recently (inf where none); the highest one's TTFT SLO counted as `STRAINED_SLO_SHARE` of
        it while that band is `strained` (the top band's only: it is the one whose promise the
        reserves are for; every band that misses holding the ones below it would stack up)."""
        # (plain loops over a band or two: this runs for every band on every dispatch loop)
        top, top_ttft, ttft = None, INF, INF  # the highest active band's strictest SLO, the others'
        for slos in (self.ttft, self.peer_ttft):
            for band, (slo, seen) in slos.items():
                if band <= priority or now - seen > BAND_ACTIVE_S:
                    continue
                if top is None or band > top:
                    if top is not None:
                        ttft = min(ttft, top_ttft)
                    top, top_ttft = band, slo
                elif band == top:
                    top_ttft = min(top_ttft, slo)
                else:
                    ttft = min(ttft, slo)
        if top is not None:
            ttft = min(ttft, top_ttft * STRAINED_SLO_SHARE if self.strained(top, now) else top_ttft)
        tpot = INF
        for slos in (self.tpot, self.peer_tpot):
            for band, (slo, seen) in slos.items():
                if band > priority and now - seen <= BAND_ACTIVE_S and slo < tpot:
                    tpot = slo
        return ttft, tpot

    # -- several gateways ------------------------------------------------------------------------
    def own(self, now: float) -> list[list]:
        """This gateway's recent bands, for the others: [band, TTFT SLO, its age, TPOT SLO, its
        age, age of its last miss] (None where there is none; ages in seconds, so that gateways'
        clocks need not agree)."""
        out = []
        for band in set(self.ttft) | set(self.tpot) | set(self.last_miss):
            ttft, tpot, miss = self.ttft.get(band), self.tpot.get(band), self.last_miss.get(band)
            out.append([band, ttft and ttft[0], ttft and now - ttft[1], tpot and tpot[0], tpot and now - tpot[1],
                        None if miss is None else now - miss])
        return out

    def seen_elsewhere(self, bands: list[list], now: float) -> None:
        """The other gateways' `own`, all of them together."""
        ttft: dict[int, tuple[float, float]] = {}
        tpot: dict[int, tuple[float, float]] = {}
        miss: dict[int, float] = {}
        for band, ttft_slo, ttft_age, tpot_slo, tpot_age, miss_age in bands:
            for slos, slo, age in ((ttft, ttft_slo, ttft_age), (tpot, tpot_slo, tpot_age)):
                if slo is not None:
                    prev = slos.get(band)
                    slos[band] = (min(prev[0], slo), max(prev[1], now - age)) if prev else (slo, now - age)
            if miss_age is not None:
                miss[band] = max(miss.get(band, -INF), now - miss_age)
        self.peer_ttft, self.peer_tpot, self.peer_miss = ttft, tpot, miss
