"""ServeGen per-client load models (alibaba/ServeGen; data/traces/servegen) as request traces.

ServeGen publishes no requests, only models of each client (each tenant of Alibaba Bailian's
service), one per 600 s window of a day: the request rate, the inter-arrival pattern (a Gamma
or Weibull fit, whose shape carries the burstiness), and per 6-hour period the empirical
distributions of input and output tokens. This module draws requests from those models:

- arrivals: per window, inter-arrival times from the fitted family with the window's shape and
  a scale that makes their mean 1 / rate (ServeGen's own generator instead rescales each
  window's draws to sum to the window; the burstiness is the same);
- sizes: input and output tokens drawn from the client's distributions for that time of day.

A folder is replayed over one span of the day: by default the busiest hour (most requests over
all clients). Every client with requests in that span becomes a tenant (`bouncer.sim.scenarios`
assigns them to bands). Prompts carry no prefix information.
"""

from __future__ import annotations

import ast
import bisect
import csv
import functools
import json
import math
import pathlib
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

from bouncer.sim.traces import TraceRequest, open_trace, trace_file

WINDOW_S = 600.0  # one row of a client's trace CSV
DEFAULT_SPAN_S = 3600.0


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float  # seconds since midnight
    rate: float  # requests per second
    pattern: str  # Gamma | Weibull ("" when the client is idle)
    shape: float


@dataclass(slots=True)
class Distribution:
    values: list[int]
    cumulative: list[float]  # normalised to end at 1

    def table(self) -> tuple[list[float], list[int]]:
        """(cumulative shares, sizes of at least 1 token): a draw is `sizes[bisect_left(shares,
        u)]` for a uniform `u`, the last size repeated for a draw past the rounded end. Inlined
        by `Client.requests`, as a busy pool's hour is ten million requests."""
        sizes = [max(1, v) for v in self.values]
        return self.cumulative, sizes + sizes[-1:]


@dataclass(slots=True)
class Client:
    id: str
    windows: list[Window]
    # from a period's start (seconds since midnight): field -> distribution
    datasets: dict[float, dict[str, Distribution]]

    def sizes_at(self, t: float) -> dict[str, Distribution]:
        """The distributions of the period `t` falls in; where that period has none, the
        closest earlier one (else the first)."""
        starts = sorted(self.datasets)
        return self.datasets[starts[max(0, bisect.bisect_right(starts, t) - 1)]]

    def requests(self, start_s: float, span_s: float, rng: random.Random) -> DrawnRequests:
        """Arrivals in [start_s, start_s + span_s), t relative to start_s."""
        out = DrawnRequests()
        at, prompt, output, uniform = out.t.append, out.prompt.append, out.output.append, rng.random
        for w in self.windows:
            lo, hi = max(w.start_s, start_s), min(w.start_s + WINDOW_S, start_s + span_s)
            if w.rate <= 0 or lo >= hi:
                continue
            sizes = self.sizes_at(w.start_s)
            (in_cum, in_values), (out_cum, out_values) = sizes["input_tokens"].table(), sizes["output_tokens"].table()
            gap = _inter_arrival(w, rng)
            t = lo + gap() * uniform()  # a renewal process entered at a random phase
            while t < hi:
                at(t - start_s)
                prompt(in_values[bisect.bisect_left(in_cum, uniform())])
                output(out_values[bisect.bisect_left(out_cum, uniform())])
                t += gap()
        return out


class DrawnRequests(Sequence[TraceRequest]):
    """A client's drawn requests as three arrays, each request made when it is read: a busy
    pool's hour is ten million requests, which as objects took 1.7 GB and a quarter of the
    drawing's time, where a run reads only the span it replays (`bouncer.sim.workloads`)."""

    __slots__ = ("t", "prompt", "output")

    def __init__(self) -> None:
        self.t = array("d")
        self.prompt = array("l")
        self.output = array("l")

    def __len__(self) -> int:
        return len(self.t)

    @overload
    def __getitem__(self, i: int) -> TraceRequest: ...
    @overload
    def __getitem__(self, i: slice) -> list[TraceRequest]: ...

    def __getitem__(self, i: int | slice) -> TraceRequest | list[TraceRequest]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return TraceRequest(self.t[i], self.prompt[i], self.output[i])


def _inter_arrival(w: Window, rng: random.Random) -> Callable[[], float]:
    """The window's inter-arrival draw."""
    mean = 1.0 / w.rate
    if w.pattern == "Gamma" and w.shape > 0:
        return functools.partial(rng.gammavariate, w.shape, mean / w.shape)
    if w.pattern == "Weibull" and w.shape > 0:
        return functools.partial(rng.weibullvariate, mean / math.gamma(1 + 1 / w.shape), w.shape)
    return functools.partial(rng.expovariate, w.rate)  # no fit recorded: Poisson


def is_servegen(path: str | pathlib.Path) -> bool:
    p = pathlib.Path(path)
    return p.is_dir() and any(p.glob("chunk-*-trace.csv"))


def _distribution(text: str) -> Distribution | None:
    """None for an empty one (the client sent nothing in that period)."""
    # stored as a Python dict literal, "{value: probability, ...}": literal_eval parses only literals
    pdf = ast.literal_eval(text)
    values = sorted(int(v) for v in pdf)
    total = sum(float(pdf[v]) for v in pdf)
    if total <= 0:
        return None
    acc, cum = 0.0, []
    for v in values:
        acc += float(pdf[v]) / total
        cum.append(acc)
    return Distribution(values, cum)


def load_servegen(folder: str | pathlib.Path) -> list[Client]:
    p = pathlib.Path(folder)
    if not is_servegen(p):
        raise ValueError(f"{folder}: not a ServeGen client folder (no chunk-<client>-trace.csv)")
    clients = []
    for trace in sorted(p.glob("chunk-*-trace.csv"), key=lambda f: int(f.stem.split("-")[1])):
        cid = trace.stem.split("-")[1]
        windows = []
        with open(trace, newline="") as f:
            for line_no, row in enumerate(csv.reader(f), 1):
                if len(row) != 6:
                    raise ValueError(f"{trace}:{line_no}: expected 6 fields (window start, rate, cv, pattern, "
                                     f"shape, scale), got {len(row)}")
                windows.append(Window(float(row[0]), float(row[1]), row[3], float(row[4] or 0)))
        dataset = trace_file(p / f"chunk-{cid}-dataset.json")
        if not dataset.is_file():
            raise ValueError(f"{dataset}: missing (each client needs its trace and its dataset)")
        datasets = {}
        try:
            with open_trace(dataset) as f:
                raw = json.load(f)
            for ts, fields in raw.items():
                sizes = {name: _distribution(fields[name]) for name in ("input_tokens", "output_tokens")}
                if all(sizes.values()):
                    datasets[float(ts)] = sizes
        except (KeyError, ValueError, SyntaxError, TypeError, OSError) as exc:
            raise ValueError(f"{dataset}: unreadable token distributions ({exc!r})") from None
        if any(w.rate > 0 for w in windows):
            if not datasets:
                raise ValueError(f"{dataset}: the client sends requests but has no token distributions")
            clients.append(Client(cid, windows, datasets))  # type: ignore[arg-type]
    if not clients:
        raise ValueError(f"{folder}: no client sends any request")
    return clients


def busiest_span(clients: list[Client], span_s: float = DEFAULT_SPAN_S) -> float:
    """Start (seconds since midnight, on a window boundary) of the span with the most requests."""
    per_window: dict[float, float] = {}
    for c in clients:
        for w in c.windows:
            per_window[w.start_s] = per_window.get(w.start_s, 0.0) + w.rate * WINDOW_S
    starts = sorted(per_window)
    n = max(1, int(span_s // WINDOW_S))
    best = max(range(max(1, len(starts) - n + 1)), key=lambda i: sum(per_window[s] for s in starts[i:i + n]))
    return starts[best]


def client_traces(clients: list[Client], seed: int, start_s: float | None = None,
                  span_s: float = DEFAULT_SPAN_S) -> dict[str, DrawnRequests]:
    """Each client's requests over the span (clients with none are left out)."""
    start = busiest_span(clients, span_s) if start_s is None else start_s
    rng = random.Random(seed)
    out = {}
    for c in clients:
        reqs = c.requests(start, span_s, rng)
        if reqs:
            out[c.id] = reqs
    return out
