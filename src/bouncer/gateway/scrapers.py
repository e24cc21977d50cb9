"""Reading each engine's Prometheus metrics into the core's `Telemetry`.

One parser per engine kind, chosen by the model's `engine` setting. Each reads the few signals
that run out (KV usage, running and waiting requests) and whatever extra the engine offers
(KV pool size, prefix-cache counters, preemptions). Parsers are pure functions of the text.

Names, as the engines export them:
- vLLM v1: `vllm:kv_cache_usage_perc` (0..1; `vllm:gpu_cache_usage_perc` before 0.10),
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:cache_config_info{num_gpu_blocks,
  block_size}`, `vllm:prefix_cache_queries_total` / `_hits_total`, `vllm:num_preemptions_total`,
  `vllm:inter_token_latency_seconds_sum` / `_count` (`vllm:time_per_output_token_seconds` before
  0.11; a token's time since its request's previous one).
- SGLang (`--enable-metrics`): `sglang:token_usage` (0..1), `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:cache_hit_rate`, `sglang:inter_token_latency_seconds_sum` /
  `_count`.
- TGI: `tgi_batch_current_size` (running), `tgi_queue_size` (waiting); TGI exports no KV usage,
  so `tgi_batch_current_max_tokens` over the configured pool is used when the pool is known.
  `tgi_request_mean_time_per_token_duration_sum` / `_count`: each completed request's own mean
  time per token (its count is of requests, not tokens).
- llama.cpp server (`--metrics`): `llamacpp:kv_cache_usage_ratio`, `llamacpp:requests_processing`,
  `llamacpp:requests_deferred`, `llamacpp:tokens_predicted_seconds_total` over
  `llamacpp:tokens_predicted_total` (each slot's decoding time and tokens: their ratio is the
  step's time).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from bouncer.core.fleet.replica import Telemetry


def _samples(text: str, names: tuple[str, ...]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of the metrics `names` (a sample's full name, `_total` included). Only their
    lines go to the parser: a vLLM page is about 40 KB of histograms, which took 8 ms to parse
    whole here, at every scrape of every replica (4 a second by default), for a dozen lines read.
    Comment lines are left out as well: without its `# TYPE` a sample keeps its own name."""
    lines = "\n".join(line for line in text.splitlines() if line.lstrip().startswith(names))
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(lines):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _sum(samples, *names: str) -> float | None:
    """Sum over label sets (several engines / data-parallel ranks behind one endpoint)."""
    for name in names:
        if name in samples:
            return sum(v for _, v in samples[name])
    return None


def _mean(samples, *names: str) -> float | None:
    for name in names:
        if name in samples and samples[name]:
            return sum(v for _, v in samples[name]) / len(samples[name])
    return None


VLLM_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cache_config_info",
              "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prefix_cache_queries_total",
              "vllm:gpu_prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
              "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds_sum",
              "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_sum",
              "vllm:time_per_output_token_seconds_count")


def parse_vllm(text: str, at: float, pool_blocks: int | None = None) -> Telemetry:
    s = _samples(text, VLLM_NAMES)
    usage = _mean(s, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    if usage is None:
        raise ValueError("no vllm:kv_cache_usage_perc in the scrape")
    num_blocks = block_size = None
    for labels, _ in s.get("vllm:cache_config_info", []):
        if labels.get("num_gpu_blocks", "").isdigit():
            num_blocks = int(labels["num_gpu_blocks"])
        if labels.get("block_size", "").isdigit():
            block_size = int(labels["block_size"])
    return Telemetry(at=at, kv_usage=usage,
                     running=int(_sum(s, "vllm:num_requests_running") or 0),
                     waiting=int(_sum(s, "vllm:num_requests_waiting") or 0),
                     num_blocks=num_blocks, block_size=block_size,
                     prefix_queries=_sum(s, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
                     prefix_hits=_sum(s, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
                     preemptions=_sum(s, "vllm:num_preemptions_total"),
                     **_itl(s, "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"))


def _itl(samples, *histograms: str) -> dict[str, float]:
    """The first of `histograms` exported: its sum and count (`Telemetry.itl_sum`, `itl_count`)."""
    for h in histograms:
        total, count = _sum(samples, h + "_sum"), _sum(samples, h + "_count")
        if total is not None and count is not None:
            return {"itl_sum": total, "itl_count": count}
    return {}


def parse_sglang(text: str, at: float, pool_blocks: int | None = None) -> Telemetry:
    s = _samples(text, ("sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                        "sglang:inter_token_latency_seconds_sum", "sglang:inter_token_latency_seconds_count"))
    usage = _mean(s, "sglang:token_usage")
    if usage is None:
        raise ValueError("no sglang:token_usage in the scrape (is --enable-metrics set?)")
    return Telemetry(at=at, kv_usage=usage, running=int(_sum(s, "sglang:num_running_reqs") or 0),
                     waiting=int(_sum(s, "sglang:num_queue_reqs") or 0),
                     **_itl(s, "sglang:inter_token_latency_seconds"))


def parse_tgi(text: str, at: float, pool_blocks: int | None = None) -> Telemetry:
    s = _samples(text, ("tgi_batch_current_size", "tgi_batch_current_max_tokens", "tgi_queue_size",
                        "tgi_request_mean_time_per_token_duration_sum",
                        "tgi_request_mean_time_per_token_duration_count"))
    running = _sum(s, "tgi_batch_current_size")
    if running is None:
        raise ValueError("no tgi_batch_current_size in the scrape")
    tokens = _sum(s, "tgi_batch_current_max_tokens")
    usage = min(1.0, tokens / (pool_blocks * 16)) if tokens is not None and pool_blocks else 0.0
    return Telemetry(at=at, kv_usage=usage, running=int(running), waiting=int(_sum(s, "tgi_queue_size") or 0),
                     **_itl(s, "tgi_request_mean_time_per_token_duration"))


def parse_llamacpp(text: str, at: float, pool_blocks: int | None = None) -> Telemetry:
    s = _samples(text, ("llamacpp:kv_cache_usage_ratio", "llamacpp:requests_processing",
                        "llamacpp:requests_deferred", "llamacpp:tokens_predicted_seconds_total",
                        "llamacpp:tokens_predicted_total"))
    usage = _mean(s, "llamacpp:kv_cache_usage_ratio")
    running = _sum(s, "llamacpp:requests_processing")
    if usage is None and running is None:
        raise ValueError("no llamacpp: metrics in the scrape (is --metrics set?)")
    seconds, tokens = _sum(s, "llamacpp:tokens_predicted_seconds_total"), _sum(s, "llamacpp:tokens_predicted_total")
    return Telemetry(at=at, kv_usage=usage or 0.0, running=int(running or 0),
                     waiting=int(_sum(s, "llamacpp:requests_deferred") or 0), itl_sum=seconds,
                     itl_count=tokens if seconds is not None else None)


Parser = Callable[[str, float, "int | None"], Telemetry]

PARSERS: dict[str, Parser] = {"vllm": parse_vllm, "sglang": parse_sglang, "tgi": parse_tgi,
                              "llamacpp": parse_llamacpp}
