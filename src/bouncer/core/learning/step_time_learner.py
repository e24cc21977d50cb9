"""The engine's step time, learned: a, b, c, d (and e) fitted online from what the gateway sees.

Operators rarely know their engines' step-time coefficients (`bouncer.core.learning.latency`), and an
engine run slower or faster than its profile (another GPU, `bouncer engine --speed`, a
neighbour on the same card) has others. Without them the core cannot predict TTFT or TPOT, and
SLO feasibility, the TPOT hold and band protection do nothing. So each model fits them from its
own requests. Every observation is linear in theta = (a, b, c, d, e), e being the part of a first
token spent outside the prefill steps (the step under way when the request arrives, HTTP, the
event loops: without it, a per-request cost would be learned as a per-step one, and predicted
TTFTs would grow too fast with the queue):

- a first token, `observed` seconds after dispatch: the terms the predictor used at dispatch,
  (steps, steps x batched tokens, steps x context tokens, attention pairs, 1), `ttft_terms`;
- a completed stream decoding at `s` seconds per token, with a batch of `n` requests reading
  `ctx` context tokens (the mean of the batch it started and ended in) while uncached prompt
  tokens arrived at `p` per second (each step carrying p x s of them): s = a + b (n + p s) + c ctx;
- an answer that came whole (not streamed; when its first token came is not known): the sum of
  the two, its TTFT terms plus (tokens - 1) decode steps.

The fit is least squares on relative error (each observation divided by what was observed, so a
5 ms step counts as much as a 3 s prefill), with exponential forgetting (an observation's weight
halves every `HALF_LIFE` observations: engines change, and so does what is measured), a ridge
towards the prior worth `PRIOR_WEIGHT` observations (in units of the prior's own coefficients,
so a coefficient the traffic never exercises, such as `d` when no prompt is long, stays at the
prior), and coefficients kept >= 0. After warm-up, an observation more than `OUTLIER` off the
current fit counts less (Huber): a request that waited for KV blocks says nothing about steps.

Until `WARM_TTFT` first tokens and `WARM_TPOT` decode observations are in, `model` is None: the
core behaves as with no step time at all, rather than act on the prior's guess.

Pure and cheap: an observation is a rank-one update of a symmetric 5 x 5 matrix; the solve (Gaussian
elimination, at most five times for the sign constraints) runs every `REFIT_EVERY` observations.
"""

from __future__ import annotations

from bouncer.core.learning.step_time import StepTimeModel

HALF_LIFE = 400  # observations
PRIOR_WEIGHT = 0.25  # observations' worth: pins what the traffic never exercises, biases little else
WARM_TTFT, WARM_TPOT = 8, 4
REFIT_EVERY_WARMING, REFIT_EVERY = 2, 16
OUTLIER = 1.0  # relative error past which an observation's weight falls (Huber)
MIN_A_FRACTION = 0.01  # a step costs something: a is kept above 1% of the prior's
MIN_OBSERVED_S = 1e-4  # below this an observation says nothing about step times
_DECAY = 0.5 ** (1.0 / HALF_LIFE)
RESCALE_BELOW = 1e-100  # 46,000 observations of forgetting; 1 / it is far from overflowing

# A generic prior: a mid-size dense model on one current GPU (between the 8B-on-H100 and
# 32B-on-H200 profiles of bouncer.sim.profiles), and 5 ms outside the engine's steps. Its only
# job is to be the right order of magnitude for each coefficient; the traffic moves it.
GENERIC_PRIOR = (0.01, 5e-5, 1e-7, 2e-9, 0.005)
N = len(GENERIC_PRIOR)

Terms = tuple[float, float, float, float, float]


class StepTimeLearner:
    """One model's step-time fit, shared by its replicas (each keeps its own correction factors
    on top, `bouncer.core.learning.latency.LatencyPredictor`)."""

    def __init__(self, prior: Terms, max_batched_tokens: int) -> None:
        if len(prior) != N or min(prior) <= 0:
            raise ValueError(f"a learned step time's prior needs {N} coefficients, each > 0")
        self.prior = prior
        self.max_batched_tokens = max_batched_tokens
        self.model: StepTimeModel | None = None  # None until warm
        self.ttft_seen = 0
        self.tpot_seen = 0
        # sum of w x x^T (upper triangle: it is symmetric), x in units of the prior, and sum of w x
        # (target 1: relative error), both over `_scale`: forgetting multiplies the scale, not
        # every entry, so an observation updates 20 numbers rather than 30
        self._gram = [[0.0] * N for _ in range(N)]
        self._rhs = [0.0] * N
        self._scale = 1.0
        self._since_fit = 0
        self._phi = [1.0] * N  # coefficients as multiples of the prior's

    # -- observations --------------------------------------------------------------------------------
    def observe_ttft(self, terms: Terms, observed: float) -> None:
        if self._add(terms, observed):
            self.ttft_seen += 1
            self._maybe_refit()

    def observe_tpot(self, batch: int, context: float, prefill_rate: float, observed: float) -> None:
        if self._add(decode_terms(batch, context, prefill_rate, observed), observed):
            self.tpot_seen += 1
            self._maybe_refit()

    def observe_whole(self, terms: Terms, tokens: int, batch: int, context: float, observed: float) -> None:
        """A non-streamed answer, `observed` seconds from dispatch to its end: its prefill and
        `tokens - 1` decode steps (their prefill-arrival term left out: the step time it needs
        is not measured)."""
        steps = max(0, tokens - 1)
        a, b, c, d, e = terms
        if self._add((a + steps, b + steps * batch, c + steps * context, d, e), observed):
            self.ttft_seen += 1
            self.tpot_seen += 1 if steps else 0
            self._maybe_refit()

    def _add(self, terms: Terms, observed: float) -> bool:
        if observed < MIN_OBSERVED_S:
            return False
        x = [t * p / observed for t, p in zip(terms, self.prior, strict=True)]
        w = 1.0
        if self.model is not None:
            error = abs(sum(xi * fi for xi, fi in zip(x, self._phi, strict=True)) - 1.0)
            if error > OUTLIER:
                w = OUTLIER / error
        gram, rhs = self._gram, self._rhs
        self._scale *= _DECAY
        if self._scale < RESCALE_BELOW:  # fold the scale back into the sums before it underflows
            for i in range(N):
                rhs[i] *= self._scale
                row = gram[i]
                for j in range(i, N):
                    row[j] *= self._scale
            self._scale = 1.0
        w /= self._scale
        for i in range(N):
            wx = w * x[i]
            rhs[i] += wx
            row = gram[i]
            for j in range(i, N):
                row[j] += wx * x[j]
        return True

    def _sums(self) -> tuple[list[list[float]], list[float]]:
        """The decayed sums themselves: the full symmetric matrix and the right-hand side."""
        s, g = self._scale, self._gram
        return ([[g[min(i, j)][max(i, j)] * s for j in range(N)] for i in range(N)],
                [r * s for r in self._rhs])

    def _maybe_refit(self) -> None:
        self._since_fit += 1
        warm = self.ttft_seen >= WARM_TTFT and self.tpot_seen >= WARM_TPOT
        if self._since_fit < (REFIT_EVERY if self.model is not None else REFIT_EVERY_WARMING):
            return
        self._since_fit = 0
        if not warm:
            # nothing reads the fit before it is published (`_add` weighs outliers only against a
            # model): a model whose answers never show a decode (all read whole in a blink, or
            # none read) would otherwise solve every other request for nothing
            return
        self._phi = self._solve()
        a, b, c, d, e = (f * p for f, p in zip(self._phi, self.prior, strict=True))
        self.model = StepTimeModel(a, b, c, self.max_batched_tokens, d, e)

    def _solve(self) -> list[float]:
        """Ridge least squares towards the prior (phi = 1), with phi >= 0 (a above its floor):
        a coefficient the unconstrained solution puts below its floor is fixed there and the
        rest solved again."""
        floor = [MIN_A_FRACTION] + [0.0] * (N - 1)
        fixed: dict[int, float] = {}
        full, b = self._sums()
        while True:
            free = [i for i in range(N) if i not in fixed]
            gram = [[full[i][j] + (PRIOR_WEIGHT if i == j else 0.0) for j in free] for i in free]
            rhs = [b[i] + PRIOR_WEIGHT - sum(full[i][k] * v for k, v in fixed.items()) for i in free]
            sol = dict(zip(free, _gauss(gram, rhs), strict=True))
            low = [i for i, v in sol.items() if v < floor[i]]
            if not low:
                return [fixed.get(i, sol.get(i, 0.0)) for i in range(N)]
            for i in low:
                fixed[i] = floor[i]

    def snapshot(self) -> dict:
        m = self.model
        return {"mode": "learned", "warm": m is not None, "first_tokens_seen": self.ttft_seen,
                "decodes_seen": self.tpot_seen, "max_batched_tokens": self.max_batched_tokens,
                "coefficients": None if m is None else {"a": m.a, "b": m.b, "c": m.c, "d": m.d, "e": m.e},
                "prior": dict(zip("abcde", self.prior, strict=True))}


def decode_terms(batch: int, context: float, prefill_rate: float, step_s: float) -> Terms:
    """s = a + b (batch + prefill_rate x s) + c context, as terms of theta."""
    return (1.0, batch + prefill_rate * step_s, context, 0.0, 0.0)


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b (a small, positive definite: the ridge sees to it) by elimination with
    partial pivoting."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
