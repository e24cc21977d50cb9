"""`bouncer engine`: the engine model served over HTTP in real time, speaking OpenAI and vLLM.

A single asyncio task drives the model: it runs one step, sleeps for the step's modelled duration
(divided by `speed`), then hands each request its new tokens. Handlers only enqueue requests and
relay tokens, so one process carries hundreds of concurrent streams on one core.

Times reported in `/metrics` histograms are model time (equal to wall time at speed 1).

With a KV connector (`--kv-connector`, vLLM's `--kv-transfer-config`), it speaks vLLM's P/D
protocol: a request with `kv_transfer_params.do_remote_decode` is prefilled and answered with one
token and `kv_transfer_params` saying where its KV waits; one with `do_remote_prefill` waits the
modelled transfer of its prompt's KV (`EngineProfile.kv_transfer_s`) and then decodes with that
KV taken as computed. The KV itself is not moved between processes: the decode side trusts the
parameters (the number of blocks must match its prompt) and models the time the pull takes.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
import zlib
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import xxhash
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bouncer.config import ModelConfig
from bouncer.core.fleet.blocks import chain_block_hashes
from bouncer.core.fleet.cache_salt import salt_root, salted
from bouncer.core.fleet.kv_events import BlockRemoved, BlockStored, KVEvent
from bouncer.kv_events_wire import encode_batch, encode_seq
from bouncer.openai_wire import (
    SSE_DONE,
    ApiError,
    dumps,
    full_response,
    models_list,
    parse_json_object,
    sse,
    stream_chunk,
    usage,
    usage_chunk,
)
from bouncer.sim.engine import EngineModel, EngineRequest, QueueFull, RequestTooLong
from bouncer.tokenizer import PromptTokenizer, media_items

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM work as is.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Output length when the client does not ask for exactly max_tokens (ignore_eos): a log-normal
# around a typical chat answer, capped by max_tokens. Seeded by the request so runs repeat.
SAMPLED_OUTPUT_MEDIAN = 150
SAMPLED_OUTPUT_SIGMA = 0.8
DEFAULT_MAX_TOKENS = 256
RECEIVED_KEPT = 256  # request bodies kept as received (`EngineServer.received`)


@dataclass(slots=True)
class _Stream:
    """Tokens the step loop has produced for one request and not yet sent."""

    request: EngineRequest
    seed: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_token_at: float | None = None


class _EngineCollector:
    """Gauges and counters read from the model at scrape time, so /metrics always agrees with
    the model's state."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def collect(self):
        s = self.server
        e = s.engine
        c = e.counters
        labels = ["model_name", "engine"]
        lv = [s.model_name, "0"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lv, value)
            return m

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", e.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      c.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      c.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (prefix cache hits).",
                      c.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for reason, n in c.request_success.items():
            success.add_metric([*lv, reason], n)
        yield success
        rejections = CounterMetricFamily("vllm:admission_rejections", "Requests refused by the queue caps.",
                                         labels=[*labels, "reason"])
        for reason, n in c.admission_rejections.items():
            rejections.add_metric([*lv, reason], n)
        yield rejections
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([str(e.block_size), str(e.pool.num_blocks), str(e.pool.enable_prefix_caching)], 1.0)
        yield info


class KVEventPublisher:
    """Publishes the model's prefix-cache changes as vLLM's `--kv-events-config` ZMQ publisher
    does: one batch per step, `(topic, seq, msgpack)` on a PUB socket. Blocks are named by an
    engine-side hash unlike ours (vLLM's are seeded per process), so subscribers must map them
    back through the token ids, as they must with real vLLM. The model's pool reports our
    digests; this keeps each tracked prompt block's tokens and parent until its requests end."""

    ENGINE_HASH_SEED = 0x6B76  # any seed: engine keys just must not be our digests

    def __init__(self, endpoint: str, topic: str, block_size: int) -> None:
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        # vLLM's rule: bind a wildcard (tcp://*:5557) or ipc endpoint, connect to any other
        if endpoint.startswith(("tcp://*", "ipc://", "inproc://")):
            self._sock.bind(endpoint)
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sock.connect(endpoint)
            self.endpoint = endpoint
        self._topic = topic.encode()
        self.block_size = block_size
        self._seq = 0
        # our digest -> [parent digest | None, token ids, requests, cache salt of a prompt's first block]
        self._blocks: dict[int, list] = {}
        self._pending: list[KVEvent] = []

    def _key(self, digest: int) -> bytes:
        return xxhash.xxh3_64_digest(digest.to_bytes(8, "big"), seed=self.ENGINE_HASH_SEED)

    def track(self, digests: list[int], token_ids: list[int], salt: str | None = None) -> None:
        bs = self.block_size
        for i, d in enumerate(digests):
            entry = self._blocks.get(d)
            if entry is None:
                self._blocks[d] = [digests[i - 1] if i else None, token_ids[i * bs:(i + 1) * bs], 1,
                                   None if i else salt]
            else:
                entry[2] += 1

    def untrack(self, digests: list[int]) -> None:
        for d in digests:
            entry = self._blocks.get(d)
            if entry is not None:
                entry[2] -= 1
                if not entry[2]:
                    del self._blocks[d]

    def sink(self, kind: str, digests: list[int]) -> None:
        """The pool's event sink (`KVPool.event_sink`)."""
        if kind == "removed":
            self._pending.append(BlockRemoved([self._key(d) for d in digests]))
            return
        for d in digests:
            entry = self._blocks.get(d)
            if entry is None:
                continue  # not a block of a tracked prompt
            parent, tokens, _, salt = entry
            self._pending.append(BlockStored([self._key(d)], None if parent is None else self._key(parent), tokens,
                                             self.block_size, salt=salt))

    def flush(self, now: float) -> None:
        if not self._pending:
            return
        self._sock.send_multipart((self._topic, encode_seq(self._seq), encode_batch(now, self._pending)))
        self._seq += 1
        self._pending = []

    def close(self) -> None:
        self._sock.close(linger=0)


class EngineServer:
    def __init__(self, engine: EngineModel, *, model_name: str = "demo-llm", speed: float = 1.0,
                 tokenizer: PromptTokenizer | None = None, seed: int = 0,
                 kv_events: KVEventPublisher | None = None, kv_connector: str | None = None,
                 media_tokens: int = ModelConfig.model_fields["media_tokens"].default) -> None:
        """`kv_connector`: this engine's id in vLLM's P/D protocol (module doc); None: none.
        `media_tokens`: the prompt tokens each image (audio clip, video) of a chat is."""
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.engine = engine
        self.kv_connector = kv_connector
        self.media_tokens = media_tokens
        self.kv_events = kv_events
        if kv_events is not None:
            engine.pool.event_sink = kv_events.sink
        self.model_name = model_name
        self.speed = speed
        self.tokenizer = tokenizer or PromptTokenizer()
        self.seed = seed
        self._streams: dict[str, _Stream] = {}
        # the bodies of the last requests received, as they came (what a gateway in front sent)
        self.received: deque[dict[str, Any]] = deque(maxlen=RECEIVED_KEPT)
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._t0 = 0.0
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))
        hist_labels = ["model_name", "engine"]
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                hist_labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name, "0")
        self.h_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               hist_labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name, "0")
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               hist_labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name, "0")
        self.h_queue = Histogram("vllm:request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.",
                                 hist_labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name, "0")

    # -- clock ---------------------------------------------------------------------------------
    def now(self) -> float:
        """Model time: seconds since start, scaled by speed."""
        return (time.monotonic() - self._t0) * self.speed

    # -- lifecycle ------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/health", self.handle_health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._t0 = time.monotonic()
        self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _stop(self, _app: web.Application) -> None:
        if self._loop_task:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        if self.kv_events is not None:
            self.kv_events.close()

    # -- the step loop ----------------------------------------------------------------------------
    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            start = self.now()
            result = self.engine.step(start)
            if result is None:  # waiting requests that cannot run until something is aborted
                self._wake.clear()
                await self._wake.wait()
                continue
            # Sleep until the step's modelled end, measured from the wall clock so error does not
            # accumulate over thousands of steps.
            deadline = self._t0 + result.end / self.speed
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            end = result.end
            if self.kv_events is not None:
                self.kv_events.flush(end)
            wall = 1.0 / self.speed  # the histograms say what clients wait, in seconds, as a real engine's do
            for req, n in result.tokens:
                stream = self._streams.get(req.request_id)
                if stream is None:
                    continue
                if req.num_output == n:  # first tokens of this request
                    self.h_ttft.observe((end - req.arrival) * wall)
                    if req.scheduled_at is not None:
                        self.h_queue.observe((req.scheduled_at - req.arrival) * wall)
                elif stream.last_token_at is not None:
                    self.h_itl.observe((end - stream.last_token_at) / n * wall)
                stream.last_token_at = end
                stream.queue.put_nowait(n)
            for req in result.finished:
                self.h_e2e.observe((end - req.arrival) * wall)
                stream = self._streams.get(req.request_id)
                if stream is not None:
                    stream.queue.put_nowait(None)

    # -- request handling -------------------------------------------------------------------------
    def _output_len(self, body: dict[str, Any], rid_seed: int) -> tuple[int, int]:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, "max_tokens must be a positive integer", param="max_tokens")
        if body.get("ignore_eos"):
            return max_tokens, max_tokens
        eos_after = body.get("eos_after")  # this engine model's own: the answer's length, as a replayed trace says
        if eos_after is not None:
            if not isinstance(eos_after, int) or isinstance(eos_after, bool) or eos_after < 1:
                raise ApiError(400, "eos_after must be a positive integer", param="eos_after")
            return min(max_tokens, eos_after), max_tokens
        rng = random.Random(rid_seed)
        sampled = int(math.exp(rng.gauss(math.log(SAMPLED_OUTPUT_MEDIAN), SAMPLED_OUTPUT_SIGMA)))
        return max(1, min(max_tokens, sampled)), max_tokens

    def _prompt_ids(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            try:
                ids = self.tokenizer.encode_chat(messages, body.get("tools"))
                # a list: its blocks' token ids go out in KV events (msgpack has no arrays)
                return ids.tolist() if isinstance(ids, array) else ids
            except (TypeError, AttributeError) as exc:
                raise ApiError(400, f"invalid messages: {exc}", param="messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                       param="prompt")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = parse_json_object(await request.read())
            self.received.append(body)
            model = body.get("model")
            if model != self.model_name:
                raise ApiError(404, f"The model `{model}` does not exist.", type_="NotFoundError", code=404,
                               param="model")
            if body.get("n", 1) != 1:
                raise ApiError(400, "only n=1 is supported", param="n")
            prompt_ids = self._prompt_ids(kind, body)
            # an image (audio, video) is tokens of the engine's own, beside the text's
            media = media_items(body["messages"]) * self.media_tokens if kind == "chat" else 0
            n = next(self._ids)
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{n}"
            seed = zlib.crc32(rid.encode()) ^ self.seed
            target, max_tokens = self._output_len(body, seed)
            ends_at_eos = target < max_tokens
            remote_decode, remote_tokens = self._kv_transfer(body, len(prompt_ids))
            if remote_decode:
                target, ends_at_eos = 1, False  # the decode worker generates the answer
            elif remote_tokens:
                await asyncio.sleep(self.engine.profile.kv_transfer_s(remote_tokens) / self.speed)
            # its prefix cached under its cache salt, as vLLM keys it: another salt's prompt finds none of it
            salt = body.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 128):
                raise ApiError(400, "cache_salt must be a non-empty string of at most 128 characters",
                               param="cache_salt")
            digests = salted(chain_block_hashes(prompt_ids, self.engine.block_size), salt_root(salt) if salt else 0)
            priority = body.get("priority", 0)
            if not isinstance(priority, int):
                raise ApiError(400, "priority must be an integer", param="priority")
            req = EngineRequest(rid, len(prompt_ids) + media, target, digests, self.now(), priority,
                                remote_tokens=remote_tokens, ends_at_eos=ends_at_eos)
            try:
                self.engine.add_request(req)
            except QueueFull as exc:
                err = ApiError(503, f"engine queue is full ({exc.reason})", type_="ServiceUnavailableError",
                               code=503)
                if body.get("stream"):
                    # vLLM's quirk, kept on purpose: a refused *streaming* request gets HTTP 200
                    # whose only event is the error, then [DONE].
                    return await self._stream_error(request, err)
                raise err from None
            except RequestTooLong as exc:
                raise ApiError(400, str(exc), type_="BadRequestError", code=400) from None
        except ApiError as err:
            return web.json_response(err.body(), status=err.status, dumps=lambda o: dumps(o).decode())
        stream = _Stream(req, seed)
        self._streams[rid] = stream
        if self.kv_events is not None:
            self.kv_events.track(digests, prompt_ids, salt)
        self._wake.set()
        created = int(time.time())
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                include_usage = bool(options.get("include_usage"))
                every_chunk = include_usage and bool(options.get("continuous_usage_stats"))  # as vLLM
                return await self._stream_response(request, kind, stream, created, include_usage, every_chunk)
            return await self._full_response(kind, stream, created, remote_decode)
        finally:
            self._streams.pop(rid, None)
            if self.kv_events is not None:
                self.kv_events.untrack(digests)
            if req.finished_at is None:  # client went away: free its KV at once
                self.engine.abort(rid, self.now())
                self._wake.set()

    def _kv_transfer(self, body: dict[str, Any], prompt_len: int) -> tuple[bool, int]:
        """(prefill for a remote decode, prompt tokens whose KV a remote prefill computed), from
        the request's `kv_transfer_params`; ignored without a connector, as vLLM ignores them."""
        params = body.get("kv_transfer_params")
        if self.kv_connector is None or params is None:
            return False, 0
        if not isinstance(params, dict):
            raise ApiError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
        if params.get("do_remote_decode"):
            if body.get("stream"):
                raise ApiError(400, "a prefill for a remote decode is not streamed", param="stream")
            return True, 0
        if params.get("do_remote_prefill"):
            blocks = params.get("remote_block_ids")
            if not isinstance(blocks, list) or len(blocks) != -(-prompt_len // self.engine.block_size):
                raise ApiError(400, "kv_transfer_params.remote_block_ids does not match the prompt's blocks",
                               param="kv_transfer_params")
            return False, prompt_len
        return False, 0

    async def _stream_error(self, request: web.Request, err: ApiError) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(sse(err.body()) + SSE_DONE)
        await resp.write_eof()
        return resp

    def _texts(self, stream: _Stream, start: int, count: int) -> list[str]:
        ids = self.tokenizer.output_token_ids
        rng = random.Random(stream.seed * 1_000_003 + start)
        return [self.tokenizer.token_text(ids[rng.randrange(len(ids))]) for _ in range(count)]

    async def _stream_response(self, request: web.Request, kind: str, stream: _Stream, created: int,
                               include_usage: bool, every_chunk: bool = False) -> web.StreamResponse:
        """`every_chunk`: each chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        req = stream.request
        sent = 0
        while True:
            n = await stream.queue.get()
            if n is None:
                break
            parts = []
            for text in self._texts(stream, sent, n):
                chunk = stream_chunk(kind, req.request_id, self.model_name, created, text, first=sent == 0)
                sent += 1
                if every_chunk:
                    chunk["usage"] = usage(req.prompt_len, sent)
                parts.append(sse(chunk))
            await resp.write(b"".join(parts))
        finish = stream_chunk(kind, req.request_id, self.model_name, created, None if kind == "chat" else "",
                              finish_reason=req.finish_reason or "length")
        out = [sse(finish)]
        if include_usage:
            out.append(sse(usage_chunk(kind, req.request_id, self.model_name, created,
                                       usage(req.prompt_len, req.num_output, req.num_cached_tokens))))
        out.append(SSE_DONE)
        await resp.write(b"".join(out))
        await resp.write_eof()
        return resp

    async def _full_response(self, kind: str, stream: _Stream, created: int,
                             remote_decode: bool = False) -> web.Response:
        req = stream.request
        sent = 0
        texts: list[str] = []
        while True:
            n = await stream.queue.get()
            if n is None:
                break
            texts.extend(self._texts(stream, sent, n))
            sent += n
        body = full_response(kind, req.request_id, self.model_name, created, "".join(texts),
                             req.finish_reason or "length",
                             usage(req.prompt_len, req.num_output, req.num_cached_tokens))
        if remote_decode:  # where the decode worker finds its KV (vLLM's NixlConnector's fields)
            body["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.kv_connector,
                "remote_request_id": req.request_id,
                "remote_block_ids": list(range(-(-req.prompt_len // self.engine.block_size))),
                "remote_host": None, "remote_port": None}
        return web.Response(body=dumps(body), content_type="application/json")

    async def handle_models(self, _request: web.Request) -> web.Response:
        return web.Response(body=dumps(models_list([self.model_name], owned_by="vllm")),
                            content_type="application/json")

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def handle_health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")


async def serve_engine(server: EngineServer, host: str, port: int) -> None:
    """Run until cancelled. Handler cancellation is on so a client that disconnects aborts its
    request (and frees its KV) even while it waits for a non-streaming answer."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
