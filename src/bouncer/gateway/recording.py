"""The gateway's flight recorder: a sample of the core every `recorder.step_s`, on its own task,
so the request path pays nothing for it but the sampler's share of the event loop
(`bouncer bench overhead --recorder off` measures that share)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from bouncer.config import Recorder
from bouncer.core.view import CoreView
from bouncer.recorder.sampler import Sampler
from bouncer.recorder.timeline import Timeline

log = logging.getLogger("bouncer.recorder")


class GatewayRecorder:
    def __init__(self, cfg: Recorder, view: Callable[[], CoreView], clock: Callable[[], float],
                 gateway_gauges: Callable[[], dict], wall: Callable[[], float] = time.time) -> None:
        self.view = view
        self.clock = clock
        self.wall = wall
        self.gateway_gauges = gateway_gauges
        self.sampler = Sampler()
        self.cfg = cfg
        self.timeline = Timeline(cfg.step_s, cfg.horizon_s)
        self.sample_cpu_s = 0.0  # CPU time spent sampling, all told, and the samples it took
        self.samples_taken = 0

    def reconfigure(self, cfg: Recorder) -> None:
        """A reload with another step or horizon keeps the samples the new ring can hold."""
        if (cfg.step_s, cfg.horizon_s) != (self.cfg.step_s, self.cfg.horizon_s):
            self.timeline = self.timeline.resized(cfg.step_s, cfg.horizon_s)
        self.cfg = cfg

    def sample(self) -> None:
        started = time.thread_time()
        self.timeline.append(self.sampler.sample(self.view(), self.clock(), self.wall(), self.gateway_gauges()))
        self.sample_cpu_s += time.thread_time() - started
        self.samples_taken += 1

    def stats(self) -> dict:
        """For /admin/timeline's header: what one sample costs this gateway."""
        mean = self.sample_cpu_s / self.samples_taken if self.samples_taken else None
        return {"samples_taken": self.samples_taken,
                "sample_cpu_us_mean": None if mean is None else round(mean * 1e6, 1)}

    async def run(self) -> None:
        """Sample on a fixed grid of `step_s` (a late wake-up does not shift the ones after it)."""
        next_at = self.clock()
        while True:
            if not self.cfg.enabled:
                await asyncio.sleep(1.0)
                next_at = self.clock()
                continue
            next_at += self.cfg.step_s
            await asyncio.sleep(max(0.0, next_at - self.clock()))
            try:
                self.sample()
            except Exception:  # a bug here must not stop the recorder for good, nor the gateway
                log.exception("timeline sample failed", extra={"event": "recorder_error"})
            if next_at < self.clock() - self.cfg.step_s:  # fell more than a step behind: skip ahead
                next_at = self.clock()
