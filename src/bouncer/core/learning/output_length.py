"""Learned expected output length, per tenant and model.

KV is reserved for prompt + *expected* output, not max_tokens taken blindly: most clients ask
for far more than they use. The estimate is an exponentially weighted mean plus a margin of
weighted mean absolute deviation, so it covers most requests without reserving for the tail.
"""

from __future__ import annotations

import math

EWMA_ALPHA = 0.1  # ~ the last 20 finished requests dominate
DEVIATION_MARGIN = 1.5  # mean + 1.5 x MAD covers ~85-90% of a long-tailed length distribution
MIN_SAMPLES = 5  # before this, the configured default is used


class OutputLengthModel:
    __slots__ = ("default", "_mean", "_dev", "_n")

    def __init__(self, default: int) -> None:
        self.default = default
        self._mean = float(default)
        self._dev = 0.0
        self._n = 0

    def observe(self, completion_tokens: int) -> None:
        if self._n == 0:
            self._mean = float(completion_tokens)
        else:
            err = completion_tokens - self._mean
            self._mean += EWMA_ALPHA * err
            self._dev += EWMA_ALPHA * (abs(err) - self._dev)
        self._n += 1

    def mean(self, max_tokens: int) -> int:
        """The mean alone: what each of many requests holds on average (a pool's total)."""
        if self._n < MIN_SAMPLES:
            return min(max_tokens, self.default)
        return max(1, min(max_tokens, round(self._mean)))

    def expected(self, max_tokens: int) -> int:
        if self._n < MIN_SAMPLES:
            return min(max_tokens, self.default)
        return max(1, min(max_tokens, math.ceil(self._mean + DEVIATION_MARGIN * self._dev)))
