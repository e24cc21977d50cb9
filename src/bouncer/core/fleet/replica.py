"""The fleet as the core sees it: scraped telemetry blended with the gateway's own accounting.

Scraped engine metrics are hundreds of milliseconds old by the time they arrive, and the
gateway knows things the engine has not reported yet (what it just sent there). So each replica
keeps both, and every load figure the policies read takes the worse of the two.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from bouncer.core.fleet.decode_room import DecodeLedger
from bouncer.core.fleet.prefix_index import ReplicaPrefixIndex
from bouncer.core.learning.latency import LatencyPredictor, prefill_pairs
from bouncer.core.sharing.peers import NO_LOAD, ReplicaLoad

DEFAULT_INDEX_BLOCKS = 100_000  # prefix-index bound while a replica's KV size is not known yet
IN_TRANSIT_S = 1.0  # a request sent this shortly before a scrape may not have reached the engine yet
# `kv_growth` follows the scraped KV usage's rate of change smoothed over about this long: a few
# seconds, so that one long prompt let in (a step up, once) or one scrape's noise is not a trend,
# while a replica filling from cold with long answers (tens of seconds) is
KV_TREND_S = 4.0


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One scrape of a replica, stamped with the time it was *sampled* (not received)."""

    at: float
    kv_usage: float  # 0..1
    running: int
    waiting: int
    num_blocks: int | None = None  # KV pool size, where the engine reports it
    block_size: int | None = None
    prefix_queries: float | None = None  # cumulative tokens looked up
    prefix_hits: float | None = None  # cumulative tokens hit
    preemptions: float | None = None
    # the engine's inter-token latency, cumulative: its sum (seconds) and count (tokens; TGI's,
    # requests, each observed at its own mean), where it exports one. What a front that reads no
    # answer past its first token learns decode speed from (`feedback.engine_decodes`)
    itl_sum: float | None = None
    itl_count: float | None = None
    counts_requests: bool = True  # running and waiting are the engine's (not a bare liveness probe)
    # when it reached the gateway (None: at `at`). Freshness counts from here: a scrape that took
    # long to answer still shows the engine answering then. `at` stays the start of the scrape,
    # the safe side for what it may already include of what was sent.
    received: float | None = None

    @property
    def heard_at(self) -> float:
        return self.at if self.received is None else self.received


class ReplicaState:
    def __init__(self, name: str, model: str, url: str | None, capacity_blocks: int | None,
                 block_size: int, kv_events_staleness_s: float = 10.0) -> None:
        self.name = name
        self.model = model
        self.url = url
        self.role = "both"  # or, disaggregated, "prefill" or "decode"
        self.decode_ledger: DecodeLedger | None = None  # a decode worker's: what it is bound to hold
        self.configured_blocks = capacity_blocks
        self.offload_blocks = 0  # host-memory tier behind the GPU's (KV offloading)
        self.block_size = block_size
        self.telemetry: Telemetry | None = None
        self.healthy = True  # last scrape answered
        self.streamed_at: float | None = None  # last first token or completed answer from it: it was serving
        self.removed = False  # dropped by a config reload: finishes in-flight work, gets no new
        self.busy = False  # hysteresis state
        self.kv_growth = 0.0  # its KV usage's recent rate of change, per second (`observe`)
        self.cooldown_until: float | None = None  # rested after refusing a request
        self.idle_refusals = 0  # refusals in a row (none started here since) while it ran nothing of ours
        self.refusals_cut_limit = False  # concurrency_limit was cut by a refusal: completions grow it back
        self.concurrency_limit = float("inf")  # in-flight cap set by the TPOT guard (AIMD)
        self.last_cut = float("-inf")
        # queued prefill tokens it takes, set by the TPOT guard (AIMD; policy.prefill_busy_tokens
        # bounds it too)
        self.prefill_limit = float("inf")
        # own accounting of what was dispatched here and not finished
        self.inflight: dict[str, object] = {}
        self.inflight_blocks = 0
        self.blocks_since_sample = 0  # blocks dispatched after the last telemetry sample
        # the requests those are: request id -> (dispatched_at, blocks), in dispatch order, so a
        # new sample drops the ones it includes from the front instead of scanning every request
        self._since_sample: dict[str, tuple[float, int]] = {}
        self.unstarted = 0  # dispatched, no first token yet
        self.unstarted_by_band: dict[int, int] = {}  # the same, by priority band
        self.queued_prefill_tokens = 0  # uncached prompt tokens of those
        self.queued_prefill_pairs = 0  # the attention pairs of computing them
        self.pending_context = 0  # attention context those will read once decoding
        self.decoding = 0  # dispatched and past their first token
        self.decode_context = 0  # context tokens their steps read (prompt + half the expected output)
        self.batch_at_sample = (0, 0)  # (decoding, decode_context) when the last telemetry came
        self.tpot_slos: Counter = Counter()  # TPOT SLOs of the requests in flight here
        # what other gateways hold here, as last seen: counted in the figures above (except
        # `inflight`, which holds this gateway's own requests), so every reader sees the sum
        self.peers: ReplicaLoad = NO_LOAD
        self.peers_at = float("-inf")
        # requests we count in flight here that the engine does not (a permit the shell lost, or an
        # engine that restarted): how many at the last scrape, and since when, continuously
        self.unseen_by_engine = 0
        self.unseen_since: float | None = None
        self.drift_reported = False  # unseen for longer than the policy's inflight_drift_s
        self.predictor: LatencyPredictor | None = None  # None with step_time off
        self._floor_key: tuple | None = None  # what `ttft_floor` was computed from, and its value
        self._floor_model: object = None
        self._floor = 0.0
        # what it holds in its prefix cache, as far as we know
        self.prefix = ReplicaPrefixIndex(self.capacity_blocks or DEFAULT_INDEX_BLOCKS, block_size,
                                         kv_events_staleness_s)

    @property
    def requests_in_flight(self) -> int:
        """Requests running or queued here from every gateway (others' as last seen)."""
        return len(self.inflight) + self.peers.requests

    def set_peers(self, load: ReplicaLoad, now: float) -> None:
        """What the other gateways hold here now: the figures move from the last view to this one."""
        old, self.peers, self.peers_at = self.peers, load, now
        self.inflight_blocks += load.blocks - old.blocks
        self.unstarted += load.unstarted - old.unstarted
        by_band = self.unstarted_by_band
        for band, n in old.unstarted_by_band:
            by_band[band] -= n
        for band, n in load.unstarted_by_band:
            by_band[band] = by_band.get(band, 0) + n
        self.queued_prefill_tokens += load.queued_prefill_tokens - old.queued_prefill_tokens
        self.queued_prefill_pairs += load.queued_prefill_pairs - old.queued_prefill_pairs
        self.pending_context += load.pending_context - old.pending_context
        self.decoding += load.decoding - old.decoding
        self.decode_context += load.decode_context - old.decode_context

    def own_load(self) -> ReplicaLoad:
        """This gateway's own part of the figures, for the others."""
        p = self.peers
        by_band = dict(self.unstarted_by_band)
        for band, n in p.unstarted_by_band:
            by_band[band] -= n
        return ReplicaLoad(len(self.inflight), self.inflight_blocks - p.blocks, self.blocks_since_sample,
                           self.unstarted - p.unstarted, tuple(sorted((b, n) for b, n in by_band.items() if n)),
                           self.queued_prefill_tokens - p.queued_prefill_tokens,
                           self.queued_prefill_pairs - p.queued_prefill_pairs, self.pending_context - p.pending_context,
                           self.decoding - p.decoding, self.decode_context - p.decode_context)

    @property
    def latency(self) -> LatencyPredictor | None:
        """The predictor, where it can predict: a step time given, or learned and warm."""
        p = self.predictor
        return p if p is not None and p.model is not None else None

    @property
    def capacity_blocks(self) -> int | None:
        if self.configured_blocks:
            return self.configured_blocks
        t = self.telemetry
        return t.num_blocks if t is not None and t.num_blocks else None

    def sync_capacity(self) -> None:
        """The prefix index is bounded by what the engine can cache (its KV pool, plus any host
        tier), once that is known."""
        cap = self.capacity_blocks
        if cap and cap + self.offload_blocks != self.prefix.approx.capacity:
            self.prefix.resize(cap + self.offload_blocks)

    def telemetry_age(self, now: float) -> float:
        """Since its last scrape answered."""
        return now - self.telemetry.heard_at if self.telemetry is not None else float("inf")

    def projected_usage(self, now: float, fresh: bool, reserve: bool = False, project: bool = True) -> float:
        """KV usage the replica is heading for: the scraped figure plus what was sent after the
        sample. With `reserve` (or without fresh telemetry) our own reservations for every
        in-flight request count too, if larger: the no-evict guarantee. O(1)."""
        cap = self.capacity_blocks
        own = self.inflight_blocks / cap if cap else 0.0
        t = self.telemetry
        if t is None or not fresh:
            return own
        recent = self.blocks_since_sample
        if self.peers_at > t.at:  # the others' sent since their sample, unless this sample is newer
            recent += self.peers.recent_blocks
        scraped = t.kv_usage + (recent / cap if cap and project else 0.0)
        return max(own, scraped) if reserve else scraped

    def observe(self, telemetry: Telemetry) -> None:
        previous = self.telemetry
        self.telemetry = telemetry
        self.batch_at_sample = (self.decoding, self.decode_context)
        self.sync_capacity()
        if previous is not None and telemetry.at > previous.at:
            rate = (telemetry.kv_usage - previous.kv_usage) / (telemetry.at - previous.at)
            self.kv_growth += (1.0 - math.exp((previous.at - telemetry.at) / KV_TREND_S)) * (rate - self.kv_growth)
        # what we sent after this sample was taken is not in its figures yet
        since = self._since_sample
        if previous is not None and telemetry.at < previous.at:  # an older sample, late: count afresh
            since.clear()
            for rid, adm in self.inflight.items():
                if self._after_sample(adm):
                    since[rid] = (adm.dispatched_at, adm.blocks)  # type: ignore[attr-defined]
            self.blocks_since_sample = sum(blocks for _, blocks in since.values())
            return
        while since:
            rid, (dispatched_at, blocks) = next(iter(since.items()))
            if dispatched_at >= telemetry.at:  # a dispatch at the very instant of the sample counts as after it
                break
            del since[rid]
            self.blocks_since_sample -= blocks

    def check_drift(self, telemetry: Telemetry, now: float, lasting_s: float) -> None:
        """Compare the engine's own count of requests (running + waiting) with what we have in
        flight here and sent before the sample (with a second's grace for requests in transit).
        Fewer at the engine, continuously for `lasting_s`, sets `drift_reported`. The engine may
        count more (traffic from elsewhere): that is no drift."""
        if not telemetry.counts_requests:
            return
        sent_before = telemetry.at - IN_TRANSIT_S
        ours = sum(1 for adm in self.inflight.values() if adm.dispatched_at < sent_before)  # type: ignore[attr-defined]
        self.unseen_by_engine = max(0, ours - telemetry.running - telemetry.waiting)
        if not self.unseen_by_engine:
            self.unseen_since, self.drift_reported = None, False
            return
        if self.unseen_since is None:
            self.unseen_since = now
        self.drift_reported = now - self.unseen_since >= lasting_s

    def queue_depth(self, fresh: bool) -> int:
        """Requests waiting at the engine, as last scraped (0 when the scrape is stale: then
        only our own KV accounting speaks)."""
        t = self.telemetry
        return t.waiting if t is not None and fresh else 0

    def add(self, request_id: str, adm, blocks: int, prefill_tokens: int) -> None:
        self.inflight[request_id] = adm
        self.inflight_blocks += blocks
        if self._after_sample(adm):
            self._since_sample[request_id] = (adm.dispatched_at, blocks)
            self.blocks_since_sample += blocks
        self.unstarted += 1
        band = adm.priority
        self.unstarted_by_band[band] = self.unstarted_by_band.get(band, 0) + 1
        self.queued_prefill_tokens += prefill_tokens
        self.queued_prefill_pairs += prefill_pairs(adm.info.prompt_tokens, prefill_tokens)
        self.pending_context += decode_context(adm)
        if adm.tpot_slo is not None:
            self.tpot_slos[adm.tpot_slo] += 1

    def mark_started(self, adm) -> None:
        """Its first token came (or it ended before one): its prefill is done, it decodes."""
        self.unstarted -= 1
        self.unstarted_by_band[adm.priority] -= 1
        self.queued_prefill_tokens -= adm.prefill_tokens
        self.queued_prefill_pairs -= prefill_pairs(adm.info.prompt_tokens, adm.prefill_tokens)
        ctx = decode_context(adm)
        self.pending_context -= ctx
        self.decoding += 1
        self.decode_context += ctx

    def unstarted_at_or_above(self, band: int) -> int:
        return sum(n for b, n in self.unstarted_by_band.items() if b >= band)

    def remove(self, request_id: str, blocks: int) -> None:
        """Forget a request that was marked started."""
        adm = self.inflight.pop(request_id, None)
        self.inflight_blocks -= blocks
        if adm is None:
            return
        if self._since_sample.pop(request_id, None) is not None:
            self.blocks_since_sample -= blocks
        self.decoding -= 1
        self.decode_context -= decode_context(adm)
        if adm.tpot_slo is not None:
            self.tpot_slos[adm.tpot_slo] -= 1
            if not self.tpot_slos[adm.tpot_slo]:
                del self.tpot_slos[adm.tpot_slo]

    # -- predicted latency (None where the step-time model is unknown) --------------------------------
    def predict_ttft(self, adm, own_prefill: int, raw: bool = False) -> float | None:
        """TTFT if `adm` is sent here now with `own_prefill` of its prompt tokens uncached (`raw`:
        before the replica's online correction)."""
        lat = self.latency
        if lat is None:
            return None
        predict = lat.raw_ttft if raw else lat.ttft
        pairs = self.queued_prefill_pairs + prefill_pairs(adm.info.prompt_tokens, own_prefill)
        return predict(self.queued_prefill_tokens, own_prefill, self.decoding, self.decode_context, pairs)

    def ttft_floor(self) -> float | None:
        """The least TTFT any request sent here now could have, whatever its prompt: the prefill
        queued ahead of it and one token of its own (`predict_ttft` grows with the prompt)."""
        lat = self.latency
        if lat is None:
            return None
        # asked for every replica on every offer (the precheck), and what it depends on moves
        # far less often: kept until one of them does
        key = (self.queued_prefill_tokens, self.decoding, self.decode_context, self.queued_prefill_pairs,
               lat.ttft_factor)
        model = lat.model
        if key != self._floor_key or model is not self._floor_model:
            self._floor_key, self._floor_model = key, model
            self._floor = lat.ttft(self.queued_prefill_tokens, 0, self.decoding, self.decode_context,
                                   self.queued_prefill_pairs)
        return self._floor

    def predict_tpot(self, adm, now: float, raw: bool = False) -> float | None:
        """The TPOT of the batch `adm` would join: what decodes here now, what was sent and has
        not started yet, and itself (`raw`: before the online correction)."""
        lat = self.latency
        if lat is None:
            return None
        predict = lat.raw_tpot if raw else lat.tpot
        return predict(self.decoding + self.unstarted + 1,
                       self.decode_context + self.pending_context + decode_context(adm), now)

    def _after_sample(self, adm: object) -> bool:
        t = self.telemetry
        # a dispatch at the very instant of the sample counts as after it: the safe side
        return t is None or adm.dispatched_at >= t.at  # type: ignore[attr-defined]


def decode_context(adm) -> int:
    """Context tokens a request's decode steps read, on average over its life: its prompt and
    half the output expected of it."""
    return adm.info.prompt_tokens + adm.expected_output // 2
