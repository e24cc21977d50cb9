"""Engine metric parsers, on metric text in each engine's own format."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bouncer.gateway.scrapers import parse_llamacpp, parse_sglang, parse_tgi, parse_vllm

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.9
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="24766"} 1.0
"""


def test_vllm_sums_data_parallel_engines_and_reads_pool_size():
    t = parse_vllm(VLLM, 12.5)
    assert (t.at, t.running, t.waiting) == (12.5, 5, 7)
    assert t.kv_usage == pytest.approx(0.7)
    assert (t.num_blocks, t.block_size) == (24766, 16)
    assert (t.prefix_queries, t.prefix_hits, t.preemptions) == (1000.0, 250.0, 4.0)


def test_a_whole_vllm_page_reads_as_its_few_lines_do():
    """What the parser skips (histograms, other families, names that merely start like one it
    reads, indented lines) changes nothing."""
    registry = CollectorRegistry()
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens"):
        h = Histogram(f"vllm:{name}", name, ["model_name"], buckets=[0.01 * 2**i for i in range(20)],
                      registry=registry)
        h.labels("m").observe(0.5)
    Counter("vllm:num_requests_running_by_lora", "a longer name", registry=registry).inc(40)
    page = generate_latest(registry).decode() + VLLM.replace("vllm:num_requests_waiting{engine=\"0\"",
                                                             "  vllm:num_requests_waiting{engine=\"0\"")
    assert len(page) > 5 * len(VLLM)
    assert parse_vllm(page, 12.5) == parse_vllm(VLLM, 12.5)


def test_vllm_pre_0_10_name():
    t = parse_vllm('# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.25\n', 0)
    assert t.kv_usage == 0.25


def test_missing_signal_is_an_error_not_a_zero():
    with pytest.raises(ValueError):
        parse_vllm("# TYPE up gauge\nup 1\n", 0)
    with pytest.raises(ValueError):
        parse_sglang("", 0)


SGLANG = ('# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m"} 0.28\n'
          '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 12\n'
          '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 4\n')


def test_sglang():
    t = parse_sglang(SGLANG, 1.0)
    assert (t.kv_usage, t.running, t.waiting) == (0.28, 12, 4)


def test_tgi_uses_batch_tokens_over_the_configured_pool():
    text = ("# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 6\n"
            "# TYPE tgi_queue_size gauge\ntgi_queue_size 9\n"
            "# TYPE tgi_batch_current_max_tokens gauge\ntgi_batch_current_max_tokens 8000\n")
    t = parse_tgi(text, 0.0, pool_blocks=1000)
    assert (t.running, t.waiting) == (6, 9) and t.kv_usage == pytest.approx(0.5)
    assert parse_tgi(text, 0.0).kv_usage == 0.0  # pool unknown: no KV signal, own accounting decides


LLAMACPP = ("# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.4\n"
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
            "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 5\n")


def test_llamacpp():
    t = parse_llamacpp(LLAMACPP, 0.0)
    assert (t.kv_usage, t.running, t.waiting) == (0.4, 2, 5)
    assert (t.itl_sum, t.itl_count) == (None, None)
    # each slot's decoding time and tokens, counted since start: their ratio is the step's time
    t = parse_llamacpp(LLAMACPP + "# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
                       "llamacpp:tokens_predicted_seconds_total 12.5\n"
                       "# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 500\n", 0.0)
    assert (t.itl_sum, t.itl_count) == (12.5, 500)


def test_tgi_reads_each_requests_mean_time_per_token():
    registry = CollectorRegistry()
    h = Histogram("tgi_request_mean_time_per_token_duration", "TPOT", buckets=[0.01, 0.1], registry=registry)
    for seconds in (0.02, 0.04):
        h.observe(seconds)
    t = parse_tgi(generate_latest(registry).decode() + "# TYPE tgi_batch_current_size gauge\n"
                  "tgi_batch_current_size 6\n", 0.0)
    assert (t.itl_sum, t.itl_count) == (pytest.approx(0.06), 2.0)


def test_the_inter_token_latency_histogram_is_read_as_its_sum_and_count():
    """vLLM from 0.11 and SGLang name it `inter_token_latency_seconds`; vLLM before, per token
    too, `time_per_output_token_seconds`. Summed over data-parallel ranks; absent, nothing."""
    for engine, parse, name in (("vllm", parse_vllm, "vllm:inter_token_latency_seconds"),
                                ("vllm", parse_vllm, "vllm:time_per_output_token_seconds"),
                                ("sglang", parse_sglang, "sglang:inter_token_latency_seconds")):
        registry = CollectorRegistry()
        h = Histogram(name, "ITL", ["rank"], buckets=[0.01, 0.1, 1.0], registry=registry)
        for rank, seconds in (("0", 0.02), ("0", 0.04), ("1", 0.03)):
            h.labels(rank).observe(seconds)
        base = VLLM if engine == "vllm" else SGLANG
        t = parse(generate_latest(registry).decode() + base, 1.0)
        assert (t.itl_sum, t.itl_count) == (pytest.approx(0.09), 3.0), name
    assert (parse_vllm(VLLM, 1.0).itl_sum, parse_vllm(VLLM, 1.0).itl_count) == (None, None)
