"""How much room a band's TTFT predictions need: their observed error, per band.

The core plans a queued request's wait around its predicted TTFT. It may wait while its SLO
leaves room for the best predicted TTFT times a margin (`deadlines.queue_budget`), and it is
refused at arrival when the wait ahead plus that already misses (`deadlines.late_by`). (At
dispatch it goes only where its predicted TTFT there, with what is queued there, meets its
deadline, with no margin: `placement`.)

A fixed margin is wrong both ways, and differently for each band: too small where a band's
predictions err more than it allows (its requests wait to the edge of their budget and start
just past their deadline), too large where they err less. Live, with the step time learned
(consolidation, 0.25x engines), a factor of 2 let the realtime band's requests expire in the
queue, or refused them as infeasible, that would have been served in time: 84-91% of them within
SLO against 92-96% with the measured margins (docs/benchmarks/ttft-margins.md, "TTFT margins"). Even with
the engine's true step time the error is wide (in the simulator the p90 of observed / predicted
is 1.5-2.0: the work that arrives after a request and goes ahead of it is not predictable).

So each band's margin is measured: the `QUANTILE` of observed / predicted TTFT over the band's
last `WINDOW` first tokens (the corrected prediction at dispatch, the one the core decided by),
kept within [1, `MAX_MARGIN`]. Until `MIN_OBSERVATIONS` are in, `margin` is None and the core
uses the configured `ttft_safety_factor`.

Pure and cheap: an observation is an append to a bounded ring; the quantile is recomputed (a sort
of at most `WINDOW` numbers) every `REFRESH_EVERY` observations.
"""

from __future__ import annotations

from collections import deque

QUANTILE = 0.9  # a request planned with this margin starts in time nine times in ten
WINDOW = 256  # first tokens per band the margin is measured over
MIN_OBSERVATIONS = 32
REFRESH_EVERY = 16
MAX_MARGIN = 4.0  # past this the predictions are not worth planning by; the wait is bounded anyway
MIN_PREDICTED_S = 1e-3  # a smaller prediction's ratio says nothing


class _BandErrors:
    __slots__ = ("ratios", "since_refresh", "margin")

    def __init__(self) -> None:
        self.ratios: deque[float] = deque(maxlen=WINDOW)
        self.since_refresh = 0
        self.margin: float | None = None


class TtftMargins:
    """One model's TTFT margins, by band."""

    def __init__(self) -> None:
        self._bands: dict[int, _BandErrors] = {}

    def observe(self, band: int, predicted: float, observed: float) -> None:
        """A first token of `band` came `observed` seconds after dispatch, `predicted` then."""
        if predicted < MIN_PREDICTED_S:
            return
        b = self._bands.get(band)
        if b is None:
            b = self._bands[band] = _BandErrors()
        b.ratios.append(observed / predicted)
        b.since_refresh += 1
        if len(b.ratios) >= MIN_OBSERVATIONS and (b.margin is None or b.since_refresh >= REFRESH_EVERY):
            ordered = sorted(b.ratios)
            q = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
            b.margin = min(MAX_MARGIN, max(1.0, q))
            b.since_refresh = 0

    def margin(self, band: int) -> float | None:
        """What `band`'s predicted TTFTs are multiplied by to plan with; None until measured."""
        b = self._bands.get(band)
        return b.margin if b is not None else None

    def snapshot(self) -> dict[int, dict]:
        return {band: {"margin": None if b.margin is None else round(b.margin, 3), "observed": len(b.ratios)}
                for band, b in sorted(self._bands.items())}
