"""What the gateway's own work costs per request, stage by stage, in-process and without HTTP:
the overhead benchmark's request (`bouncer bench overhead`) parsed, checked, prechecked,
tokenized with the bundled tokenizer, offered, started and finished, against a core with one
idle replica and 16 requests in flight. Prints microseconds per request for each stage.

    python scripts/request_path_cost.py [REQUESTS]
"""

from __future__ import annotations

import collections
import json
import sys
import time
from collections.abc import Callable

import orjson

from bouncer.bench.overhead import BENCH_KEY, BODY, _gateway_config
from bouncer.config import parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Dispatch, Reject, Terminal
from bouncer.gateway.prepared import prepare
from bouncer.gateway.request_parsing import request_head, with_prompt
from bouncer.openai_wire import dumps, parse_json_object
from bouncer.tokenizer import default_tokenizer_path

IN_FLIGHT = 16
WARM_UP = 100


def main(requests: int) -> None:
    cfg = json.loads(_gateway_config("http://127.0.0.1:9", 1, recorder=False))
    cfg["models"][0]["tokenizer"] = str(default_tokenizer_path())
    config = parse_config(cfg)
    tokenizer = prepare(config).tokenizers["fast"]
    clock = time.monotonic
    core = AdmissionCore(config, clock())
    replica = next(iter(core.replicas))
    raw = orjson.dumps(BODY)
    headers = {"Authorization": "Bearer " + BENCH_KEY, "Content-Type": "application/json"}
    cost: collections.Counter = collections.Counter()

    def timed(stage: str, call: Callable):
        t0 = time.perf_counter()
        out = call()
        cost[stage] += time.perf_counter() - t0
        return out

    in_flight: collections.deque[str] = collections.deque()
    for i in range(requests + WARM_UP):
        if i == WARM_UP:
            cost.clear()
        if i % 500 == 0:  # a scrape now and then, as the gateway's
            core.observe(replica, Telemetry(at=clock(), kv_usage=0.1, running=IN_FLIGHT, waiting=0), clock())
        rid = f"bq-{i}"
        body = timed("parse", lambda: parse_json_object(raw))
        head = timed("request_head", lambda: request_head(rid, "chat", body, headers, tokenizer))  # noqa: B023
        checked = timed("precheck", lambda: core.precheck(head, clock()))  # noqa: B023
        if isinstance(checked, Reject):
            raise SystemExit(f"refused: {checked.refusal}")
        info = timed("with_prompt", lambda: with_prompt(head, "chat", body, tokenizer, 16))  # noqa: B023
        events = timed("offer", lambda: core.offer(info, clock(), checked))  # noqa: B023
        dispatch = next(e for e in events if isinstance(e, Dispatch))
        timed("upstream_body", lambda: dumps({**body, "model": "fast", "max_tokens": dispatch.max_tokens}))  # noqa: B023
        in_flight.append(rid)
        if len(in_flight) > IN_FLIGHT:
            done = in_flight.popleft()
            timed("started", lambda: core.started(done, clock(), measured=False))  # noqa: B023
            timed("finished", lambda: core.finished(done, clock(), Terminal.COMPLETED, 16))  # noqa: B023
        if i % 4 == 0:
            timed("tick", lambda: core.tick(clock()))
            timed("next_wakeup", core.next_wakeup)
    for stage, seconds in cost.items():
        print(f"{stage:14s} {seconds / requests * 1e6:7.1f} us")
    print(f"{'total':14s} {sum(cost.values()) / requests * 1e6:7.1f} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
