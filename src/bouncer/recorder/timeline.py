"""A bounded ring of timeline samples, and the file format recorded runs are saved in.

Samples are kept encoded (compact JSON bytes, a few hundred bytes to a few kB each, by the
number of tenants and replicas), so the ring's memory is what `bytes_held` says and a range is
served by joining bytes, not re-encoding. The oldest sample goes when the ring holds
`horizon_s / step_s` of them.

A file is JSON Lines: a header line (`{"format": "bouncer-timeline", "version": 1, "step_s",
"clock", "source"}`), then one sample per line. `/admin/timeline?format=jsonl` writes the same,
so an incident saved from a gateway and a simulator run open alike in `bouncer recorder FILE`.
"""

from __future__ import annotations

import bisect
import gzip
import pathlib
from collections import deque
from collections.abc import Callable, Iterable

import orjson

FORMAT = "bouncer-timeline"
VERSION = 1


class TimelineFormatError(ValueError):
    pass


class Timeline:
    def __init__(self, step_s: float, horizon_s: float, clock: str = "wall", source: str = "gateway") -> None:
        self.step_s = step_s
        self.horizon_s = horizon_s
        self.clock = clock  # "wall": t is Unix time; "virtual": seconds of a simulated run
        self.source = source
        # a file read back holds all it has (horizon inf)
        capacity = None if horizon_s == float("inf") else max(1, round(horizon_s / step_s))
        self._times: deque[float] = deque(maxlen=capacity)
        self._encoded: deque[bytes] = deque(maxlen=self._times.maxlen)
        self.bytes_held = 0
        self._listeners: set[Callable[[bytes], None]] = set()

    def __len__(self) -> int:
        return len(self._times)

    def newest(self) -> float | None:
        return self._times[-1] if self._times else None

    def oldest(self) -> float | None:
        return self._times[0] if self._times else None

    @property
    def capacity(self) -> int | None:
        return self._times.maxlen

    def header(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "step_s": self.step_s, "clock": self.clock,
                "source": self.source, "horizon_s": self.horizon_s}

    def append(self, sample: dict) -> None:
        self._add(sample["t"], orjson.dumps(sample))

    def resized(self, step_s: float, horizon_s: float) -> Timeline:
        """A ring of another step or horizon holding what this one holds (the newest that fit),
        its open streams moved over."""
        new = Timeline(step_s, horizon_s, self.clock, self.source)
        for t, encoded in zip(self._times, self._encoded, strict=True):
            new._add(t, encoded)
        new._listeners, self._listeners = self._listeners, set()
        return new

    def _add(self, t: float, encoded: bytes) -> None:
        if len(self._times) == self._times.maxlen:
            self.bytes_held -= len(self._encoded[0])
        self._times.append(t)
        self._encoded.append(encoded)
        self.bytes_held += len(encoded)
        for listener in list(self._listeners):
            listener(encoded)

    def subscribe(self, listener: Callable[[bytes], None]) -> Callable[[], None]:
        """Call `listener` with each new sample's bytes; returns the unsubscribe."""
        self._listeners.add(listener)
        return lambda: self._listeners.discard(listener)

    def encoded(self, since: float | None = None, until: float | None = None) -> list[bytes]:
        """The samples with since <= t <= until, oldest first."""
        times = list(self._times) if since is not None or until is not None else None
        lo = 0 if since is None else bisect.bisect_left(times, since)
        hi = len(self._times) if until is None else bisect.bisect_right(times, until)
        return list(self._encoded)[lo:hi]

    def samples(self, since: float | None = None, until: float | None = None, step_s: float | None = None
                ) -> list[dict]:
        decoded = [orjson.loads(b) for b in self.encoded(since, until)]
        if step_s is None or step_s <= self.step_s:
            return decoded
        return coarsen(decoded, step_s)

    # -- files -------------------------------------------------------------------------------------
    def write(self, path: str | pathlib.Path) -> None:
        with _open(path, "wb") as f:
            f.write(orjson.dumps(self.header()) + b"\n")
            for encoded in self._encoded:
                f.write(encoded + b"\n")

    @classmethod
    def read(cls, path: str | pathlib.Path) -> Timeline:
        with _open(path, "rb") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        if not lines:
            raise TimelineFormatError(f"{path}: empty, not a {FORMAT} file")
        try:
            header = orjson.loads(lines[0])
        except orjson.JSONDecodeError as exc:
            raise TimelineFormatError(f"{path}: line 1 is not JSON ({exc})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise TimelineFormatError(f"{path}: line 1 is not a {FORMAT} header")
        if header.get("version") != VERSION:
            raise TimelineFormatError(f"{path}: version {header.get('version')!r}, this Bouncer reads {VERSION}")
        timeline = cls(float(header["step_s"]), float("inf"), header.get("clock", "wall"),
                       header.get("source", str(path)))
        for i, line in enumerate(lines[1:], start=2):
            try:
                sample = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TimelineFormatError(f"{path}: line {i} is not JSON ({exc})") from None
            if not isinstance(sample, dict) or not isinstance(sample.get("t"), int | float):
                raise TimelineFormatError(f"{path}: line {i} is not a sample (no numeric \"t\")")
            timeline.append(sample)
        timeline.horizon_s = len(timeline) * timeline.step_s
        return timeline


def coarsen(samples: Iterable[dict], step_s: float) -> list[dict]:
    """Merge consecutive samples into buckets `step_s` wide: counts add up, gauges are the
    bucket's last; each bucket is stamped with its last sample's t."""
    out: list[dict] = []
    bucket_of = None
    for s in samples:
        bucket = int(s["t"] // step_s)
        if out and bucket == bucket_of:
            last = out[-1]
            _add_counts(last["counts"], s["counts"])
            last["t"], last["gauges"] = s["t"], s["gauges"]
        else:
            out.append({"t": s["t"], "counts": s["counts"], "gauges": s["gauges"]})
            bucket_of = bucket
    return out


def _add_counts(into: dict, more: dict) -> None:
    for key, value in more.items():
        if isinstance(value, dict):
            _add_counts(into.setdefault(key, {}), value)
        else:
            into[key] = into.get(key, 0) + value


def _open(path: str | pathlib.Path, mode: str):
    return gzip.open(path, mode) if str(path).endswith(".gz") else open(path, mode)  # noqa: SIM115
