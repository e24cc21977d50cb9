"""How much room a band's TTFT predictions need: their observed error, per band.

The core plans a queued request's wait around its predicted TTFT. It may wait while its SLO
leaves room for the best predicted TTFT times a margin (`deadlines.queue_budget`); it is refused
at arrival when the wait ahead plus that already misses (`deadlines.late_by`); and it is
dispatched only to a replica where its predicted TTFT there, with what is queued there, times the
margin still meets its deadline (`placement`), else refused (or demoted) before any prefill.

A fixed margin is wrong both ways, and differently for each band:
- too small where predictions run short: on ServeGen's `m-mid` pool the bulk band's requests
  were dispatched at the edge of their deadline, on a prediction right on average, and half got
  their first token just past it (0.1% within SLO, TTFT p99 at the SLO);
- too large where they are accurate: live, with the step time learned, a factor of 2 over a fit
  that already carried the HTTP and event-loop time let the realtime band's requests expire in
  the queue, and refused others as infeasible, that would have been served in time.

So each band's margin is measured: the `QUANTILE` of observed / predicted TTFT over the band's
last `WINDOW` first tokens (the corrected prediction at dispatch, the one the core decided by),
kept within [1, `MAX_MARGIN`]. Until `MIN_OBSERVATIONS` are in, `margin` is None and the core
uses the configured `ttft_safety_factor` for waiting and no margin at dispatch.

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
