"""Baselines for a disaggregated fleet: what the peers do with separate prefill and decode pools.

Each picks a prefill worker and a decode worker per request (`Dispatched.decode_replica`), as
vLLM's P/D proxy and llm-d's P/D scheduling profiles do. Bouncer itself runs the same core as on a
colocated fleet (`CorePolicy`): its decode workers' room is predicted (`bouncer.core.fleet.decode_room`).

- `none`: round-robin over each pool, no admission (vLLM's disaggregated-serving proxy example).
- `vllm-queue-cap`: the same, engines started with queue caps on both pools; a decode worker
  that refuses a request refuses it after its prefill ran.
- `dynamo-busy`: Dynamo's per-role busy thresholds, no queue: a prefill worker is busy above its
  active prefill tokens threshold, a decode worker above its active decode blocks threshold, both
  from the router's own accounting of what it sent (blocks counted from routing until the end,
  as its active-sequence tracking does); refused with 529 when either pool is all busy.
- `pd-current-load`: Mooncake's first early-rejection policy (FAST'25 section 7.3): before its
  prefill, a request is admitted when the prefill worker with the least queued would start it
  within its TTFT SLO (the prompts queued there and its own, at the engine's prefill speed) and
  some decode worker's scraped KV usage is under the threshold *now*; it goes to the least loaded
  of each, and is refused with 503 otherwise. What its prefill adds to the decode worker arrives
  later, unseen: the anti-phase oscillation the paper describes.
"""

from __future__ import annotations

import itertools

from bouncer.sim.fleet import Dispatched, PolicyEvent, Refused, SimRequest
from bouncer.sim.policies import _Passthrough

DECODE_BLOCKS_THRESHOLD = 0.85  # Dynamo's threshold in the colocated baseline (policies.DynamoBusy)
CURRENT_LOAD_THRESHOLD = 0.85


class _PdBase(_Passthrough):
    """A passthrough baseline (no waiting room) on two pools."""

    name = "pd"

    def __init__(self, roles: dict[str, str]) -> None:
        super().__init__(list(roles))
        self.prefill = [n for n, role in roles.items() if role == "prefill"]
        self.decode = [n for n, role in roles.items() if role == "decode"]
        if not self.prefill or not self.decode:
            raise ValueError(f"{self.name} needs a disaggregated fleet (prefill and decode workers)")

    def engine_refused(self, attempt_id, now):
        self.finished(attempt_id, now, False, 0)  # what the baseline counts for it, released
        return super().engine_refused(attempt_id, now)


class PdRoundRobin(_PdBase):
    """`none` (and `vllm-queue-cap`, whose caps are the engines'): round-robin over each pool."""

    def __init__(self, roles: dict[str, str], name: str = "none") -> None:
        self.name = name
        super().__init__(roles)
        self._prefill_rr = itertools.cycle(self.prefill)
        self._decode_rr = itertools.cycle(self.decode)

    def offer(self, req: SimRequest, now: float) -> list[PolicyEvent]:
        return [Dispatched(req.attempt_id, next(self._prefill_rr), next(self._decode_rr))]


class PdDynamoBusy(_PdBase):
    """`dynamo-busy` on two pools (module doc). Prefill goes to the worker with the fewest active
    prefill tokens, decode to the one with the fewest active blocks."""

    name = "dynamo-busy"

    def __init__(self, roles: dict[str, str], capacity_blocks: int, block_size: int, prefill_threshold: int) -> None:
        super().__init__(roles)
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.prefill_threshold = prefill_threshold
        self._prefill_tokens = dict.fromkeys(self.prefill, 0)
        self._blocks = dict.fromkeys(self.decode, 0)
        self._req: dict[str, tuple[str, int, str, int]] = {}  # attempt -> (prefill worker, tokens, decode, blocks)

    def offer(self, req, now):
        prefill = [r for r in self.prefill if self._prefill_tokens[r] <= self.prefill_threshold]
        decode = [r for r in self.decode if self._blocks[r] / self.capacity <= DECODE_BLOCKS_THRESHOLD]
        if not prefill or not decode:
            return [Refused(req.attempt_id, 529, "dynamo/all_workers_busy", None)]
        p = min(prefill, key=self._prefill_tokens.__getitem__)
        d = min(decode, key=self._blocks.__getitem__)
        blocks = -(-(req.prompt_len + req.output_len) // self.block_size)
        self._prefill_tokens[p] += req.prompt_len
        self._blocks[d] += blocks
        self._req[req.attempt_id] = (p, req.prompt_len, d, blocks)
        return [Dispatched(req.attempt_id, p, d)]

    def handed_over(self, attempt_id, now):
        entry = self._req.get(attempt_id)
        if entry is not None and entry[1]:
            p, tokens, d, blocks = entry
            self._prefill_tokens[p] -= tokens
            self._req[attempt_id] = (p, 0, d, blocks)
        return []

    def finished(self, attempt_id, now, completed, completion_tokens):
        entry = self._req.pop(attempt_id, None)
        if entry is not None:
            p, tokens, d, blocks = entry
            self._prefill_tokens[p] -= tokens
            self._blocks[d] -= blocks
        return []


class PdCurrentLoad(_PdBase):
    """`pd-current-load` (module doc). `prefill_seconds(tokens)`: the engine's time to prefill
    that many prompt tokens (`EngineProfile.prefill_seconds`)."""

    name = "pd-current-load"

    def __init__(self, roles: dict[str, str], prefill_seconds) -> None:
        super().__init__(roles)
        self.prefill_seconds = prefill_seconds
        self._usage = dict.fromkeys(self.decode, 0.0)  # scraped KV usage
        self._queued = dict.fromkeys(self.prefill, 0)  # prompt tokens sent and not handed over
        self._where: dict[str, tuple[str, int]] = {}

    def observe(self, replica, telemetry, now):
        if replica in self._usage:
            self._usage[replica] = telemetry.kv_usage
        return []

    def offer(self, req, now):
        p = min(self.prefill, key=self._queued.__getitem__)
        if req.ttft_slo is not None and self.prefill_seconds(self._queued[p] + req.prompt_len) > req.ttft_slo:
            return [Refused(req.attempt_id, 503, "pd/prefill_late", None)]
        d = min(self.decode, key=self._usage.__getitem__)
        if self._usage[d] >= CURRENT_LOAD_THRESHOLD:
            return [Refused(req.attempt_id, 503, "pd/decode_busy", None)]
        self._queued[p] += req.prompt_len
        self._where[req.attempt_id] = (p, req.prompt_len)
        return [Dispatched(req.attempt_id, p, d)]

    def handed_over(self, attempt_id, now):
        entry = self._where.pop(attempt_id, None)
        if entry is not None:
            self._queued[entry[0]] -= entry[1]
        return []

    def finished(self, attempt_id, now, completed, completion_tokens):
        return self.handed_over(attempt_id, now)
