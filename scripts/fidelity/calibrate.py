"""Measure an engine's step time and fit  step_time = a + b * batched_tokens + c * total_context_tokens.

    .venv/bin/python scripts/fidelity/calibrate.py --base-url http://127.0.0.1:18201 --model tiny \\
        --out scripts/fidelity/results/calibration.json

Run it against a server with plenty of KV cache (no --num-gpu-blocks-override) and nothing else
sending traffic, so no request waits for memory or is preempted. All step times come from the
client's view of a streamed sequence: one streamed token per engine step per running sequence.
Token counts per chunk come from the per-token logprobs the stream carries (logprobs=0), so
chunks that merge several tokens are counted right. Every prompt starts with a unique random word
sequence, so prefix caching never hits; all prompts are built before any timing starts.

(i)   Isolated prefill (raw data, not in the fit): one request at a time, prompts of
      --prefill-lens tokens, max_tokens 1, --reps times each. Records the client's time to first
      token and, where the server exports them, the server's vllm:request_prefill_time_seconds and
      vllm:time_to_first_token_seconds (sum/count deltas around the request). These contain fixed
      per-request latency (HTTP, tokenization, the engine-core -> API-server hop), reported as
      `request_latency_overhead_s` = client TTFT - fitted step time.
(ii)  Prefill bursts (in the fit): a background stream (prompt --bg-len tokens) decodes steadily;
      K prompts of P tokens (K in --burst-k, P in --prefill-lens, max_tokens 1) are sent at once.
      Window = from the background's last token before the burst to its token that arrives with
      the burst's last first token. Every engine step in the window emits exactly one background
      token, so steps = background tokens in the window and mean step time = span / steps; the
      steps together processed K*P prefill tokens plus one decode token each. Because the model is
      linear, the window's mean step obeys the same formula with mean batched tokens
      (K*P + steps) / steps and mean context (K*P + steps * background length) / steps.
(iii) Decode: N concurrent streams (N in --concurrency), prompts of L tokens (L in --decode-lens),
      max_tokens --decode-tokens. In the window where all N are past their first token and none
      has finished, each step decodes one token for each stream: step = span / tokens per stream,
      batched = N, context = sum of the N sequence lengths at mid-window.
Fits: `fit` = OLS on all (ii) and (iii) points; `fit_medians` = OLS on the per-configuration
medians (less sensitive to the occasional slow step on a busy 2-core machine);
`fit_with_new_requests` = `fit` plus a term d * (requests newly prefilled in the step), K/steps for
bursts and 0 for decode windows (steps that admit new requests were slower than a, b, c explain).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import statistics
import sys
import time

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from workload import TOKENIZER_JSON, grow, word_pool  # noqa: E402

COUNTERS = ["vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"]
HIST = ["vllm:request_prefill_time_seconds", "vllm:inter_token_latency_seconds",
        "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds"]


class Prompts:
    def __init__(self, seed: int) -> None:
        self.tok = Tokenizer.from_file(str(TOKENIZER_JSON))
        self.rng = random.Random(seed)
        self.words = word_pool(self.tok)

    def make(self, n_tokens: int) -> str:
        # 8 random words first: the first 128-token block differs from every other prompt's.
        start = "".join(self.rng.choice(self.words) for _ in range(min(8, n_tokens))).lstrip()
        return grow(self.tok, self.rng, self.words, start, n_tokens)


async def hist_snapshot(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if (fam.name in HIST and (s.name.endswith("_sum") or s.name.endswith("_count"))) or s.name in COUNTERS:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def hist_mean(before: dict, after: dict, name: str) -> float | None:
    c = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    if c <= 0:
        return None
    return (after[f"{name}_sum"] - before[f"{name}_sum"]) / c


async def stream(session: aiohttp.ClientSession, base: str, model: str, prompt: str,
                 max_tokens: int, rec: dict | None = None) -> dict:
    """Stream one completion. `rec` (filled in place, so it survives cancellation) gets t_send
    (perf_counter), chunks [(perf_counter time, tokens)], usage."""
    rec = {} if rec is None else rec
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "logprobs": 0}
    rec.update(t_send=time.perf_counter(), chunks=[], usage=None)
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        buf = b""
        async for data in r.content.iter_any():
            now = time.perf_counter()
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    payload = line[5:].strip() if line.startswith(b"data:") else b""
                    if not payload or payload == b"[DONE]":
                        continue
                    msg = json.loads(payload)
                    if "error" in msg:
                        raise RuntimeError(f"stream error: {msg['error']}")
                    for ch in msg.get("choices") or []:
                        lp = ch.get("logprobs") or {}
                        n = len(lp.get("tokens") or []) or (1 if ch.get("text") else 0)
                        rec["chunks"].append((now, n))
                    if msg.get("usage"):
                        rec["usage"] = msg["usage"]
    rec["end"] = time.perf_counter()
    return rec


async def isolated_prefill(session, base, model, prompts: Prompts, lens, reps) -> list[dict]:
    out = []
    texts = {p: [prompts.make(p) for _ in range(reps)] for p in lens}
    for text in [prompts.make(64) for _ in range(3)]:  # warm-up
        await stream(session, base, model, text, 4)
    for p in lens:
        for rep, text in enumerate(texts[p]):
            before = await hist_snapshot(session, base)
            res = await stream(session, base, model, text, 1)
            after = await hist_snapshot(session, base)
            out.append({"prompt_len": p, "rep": rep,
                        "prompt_tokens_usage": (res["usage"] or {}).get("prompt_tokens"),
                        "client_ttft_s": res["chunks"][0][0] - res["t_send"],
                        "server_prefill_s": hist_mean(before, after, "vllm:request_prefill_time_seconds"),
                        "server_ttft_s": hist_mean(before, after, "vllm:time_to_first_token_seconds"),
                        "server_queue_s": hist_mean(before, after, "vllm:request_queue_time_seconds")})
        xs = [r for r in out if r["prompt_len"] == p]
        print(f"  isolated prefill P={p:4d}: client TTFT median "
              f"{statistics.median(r['client_ttft_s'] for r in xs) * 1e3:6.2f} ms, server prefill median "
              f"{statistics.median((r['server_prefill_s'] or float('nan')) for r in xs) * 1e3:6.2f} ms",
              flush=True)
    return out


async def prefill_burst(session, base, model, prompts: Prompts, k: int, p: int, bg_len: int) -> dict:
    bg_text = prompts.make(bg_len)
    texts = [prompts.make(p) for _ in range(k)]
    bg: dict = {}
    bg_task = asyncio.create_task(stream(session, base, model, bg_text, 500 - bg_len, bg))
    await asyncio.sleep(0.2)  # background stream is in steady decode by now
    burst = await asyncio.gather(*(stream(session, base, model, t, 1) for t in texts))
    await asyncio.sleep(0.03)
    bg_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
        await bg_task
    times = [t for t, _ in bg["chunks"]]
    toks = [n for _, n in bg["chunks"]]
    sent = min(r["t_send"] for r in burst)
    last_first = max(r["chunks"][0][0] for r in burst)
    rec = {"burst_k": k, "prompt_len": p, "step_s": None,
           "prompt_tokens_usage": [(r["usage"] or {}).get("prompt_tokens") for r in burst]}
    before = [i for i, t in enumerate(times) if t <= sent]
    if not before or last_first > times[-1]:
        rec["note"] = "background stream did not span the burst"
        return rec
    i0 = before[-1]
    i1 = min(range(i0 + 1, len(times)), key=lambda j: abs(times[j] - last_first))
    steps = sum(toks[i0 + 1:i1 + 1])
    span = times[i1] - times[i0]
    ctx_bg = bg_len + sum(toks[:(i0 + i1) // 2 + 1])
    rec.update(step_s=span / steps, steps=steps, span_s=span,
               batched=(k * p + steps) / steps, context=(k * p + steps * ctx_bg) / steps,
               bg_context_mid=ctx_bg,
               last_first_token_s=last_first - sent,
               bg_chunk_minus_last_first_token_s=times[i1] - last_first)
    return rec


async def decode_run(session, base, model, prompts: Prompts, n: int, length: int, max_tokens: int) -> dict:
    texts = [prompts.make(length) for _ in range(n)]
    before = await hist_snapshot(session, base)
    streams = await asyncio.gather(*(stream(session, base, model, t, max_tokens) for t in texts))
    after = await hist_snapshot(session, base)
    w_lo = max(s["chunks"][0][0] for s in streams)   # every stream has its first token
    w_hi = min(s["chunks"][-1][0] for s in streams)  # no stream has its last token yet
    per_stream = []
    multi = 0
    for s in streams:
        inside = [(t, k) for t, k in s["chunks"] if w_lo <= t <= w_hi]
        multi += sum(1 for _, k in s["chunks"] if k > 1)
        if len(inside) >= 3:
            toks = sum(k for _, k in inside[1:])
            per_stream.append((inside[-1][0] - inside[0][0]) / toks)
    gaps = [b[0] - a[0] for s in streams for a, b in zip(s["chunks"], s["chunks"][1:], strict=False)
            if w_lo <= a[0] and b[0] <= w_hi]
    mid = (w_lo + w_hi) / 2
    gen_mid = statistics.mean(sum(k for t, k in s["chunks"] if t <= mid) for s in streams)
    return {"concurrency": n, "prompt_len": length, "max_tokens": max_tokens,
            "prompt_tokens_usage": [(s["usage"] or {}).get("prompt_tokens") for s in streams],
            "completion_tokens_usage": [(s["usage"] or {}).get("completion_tokens") for s in streams],
            "window_s": round(w_hi - w_lo, 4),
            "step_s": statistics.median(per_stream) if per_stream else None,
            "step_s_per_stream": per_stream,
            "gap_median_s": statistics.median(gaps) if gaps else None,
            "multi_token_chunks": multi,
            "batched": n, "generated_at_mid": gen_mid, "context": n * (length + gen_mid),
            "server_itl_mean_s": hist_mean(before, after, "vllm:inter_token_latency_seconds")}


def fit(rows: list[tuple], extra: str | None = None) -> dict:
    """rows: (batched_tokens, context_tokens, step_s) or, with `extra`, (batched, context, x, step_s).
    Ordinary least squares for a, b, c (and d, the coefficient of x)."""
    x = np.array([[1.0, *r[:-1]] for r in rows])
    y = np.array([r[-1] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    res = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    out = {"a_s": float(coef[0]), "b_s_per_batched_token": float(coef[1]),
           "c_s_per_context_token": float(coef[2])}
    if extra:
        out[f"d_s_per_{extra}"] = float(coef[3])
    out.update({"n_points": len(rows),
                "rms_residual_s": float(np.sqrt((res ** 2).mean())),
                "max_abs_residual_s": float(np.abs(res).max()),
                "rms_relative_residual": float(np.sqrt(((res / y) ** 2).mean())),
                "r2": 1.0 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else None,
                "points": [{"batched": round(r[0], 2), "context": round(r[1], 1), "measured_s": r[-1],
                            "fitted_s": float(p_)} for r, p_ in zip(rows, pred, strict=True)]})
    return out


def medians(points: list[dict], key) -> list[tuple[float, float, float]]:
    groups: dict = {}
    for p in points:
        if p["step_s"] is not None:
            groups.setdefault(key(p), []).append(p)
    return [(statistics.median(p["batched"] for p in g), statistics.median(p["context"] for p in g),
             statistics.median(p["step_s"] for p in g)) for g in groups.values()]


async def main_async(a) -> dict:
    base = a.base_url.rstrip("/")
    prompts = Prompts(a.seed)
    # Idle keep-alive connections are dropped after 3 s, before uvicorn's 5 s server-side timeout,
    # so no request is written to a connection the server is closing.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)) as session:
        start = await hist_snapshot(session, base)
        print("(i) isolated prefill, one request at a time", flush=True)
        iso = await isolated_prefill(session, base, a.model, prompts, a.prefill_lens, a.reps)
        print("(ii) prefill bursts next to one background decode stream", flush=True)
        bursts = []
        for k in a.burst_k:
            for p in a.prefill_lens:
                for rep in range(a.reps):
                    r = await prefill_burst(session, base, a.model, prompts, k, p, a.bg_len)
                    r["rep"] = rep
                    bursts.append(r)
                xs = [r for r in bursts if r["burst_k"] == k and r["prompt_len"] == p and r["step_s"]]
                if xs:
                    print(f"  burst K={k:2d} x P={p:4d}: mean step median "
                          f"{statistics.median(r['step_s'] for r in xs) * 1e3:6.2f} ms over "
                          f"{statistics.median(r['steps'] for r in xs)} steps; burst done after "
                          f"{statistics.median(r['last_first_token_s'] for r in xs) * 1e3:6.1f} ms", flush=True)
        print("(iii) decode at concurrency N", flush=True)
        dec = []
        for length in a.decode_lens:
            for n in a.concurrency:
                for rep in range(a.decode_reps):
                    r = await decode_run(session, base, a.model, prompts, n, length, a.decode_tokens)
                    r["rep"] = rep
                    dec.append(r)
                xs = [r for r in dec if r["concurrency"] == n and r["prompt_len"] == length and r["step_s"]]
                steps = ", ".join(f"{r['step_s'] * 1e3:.2f}" for r in xs)
                itl = ", ".join(f"{(r['server_itl_mean_s'] or float('nan')) * 1e3:.2f}" for r in xs)
                print(f"  decode N={n:2d} L={length:3d}: step median "
                      f"{statistics.median(r['step_s'] for r in xs) * 1e3:6.2f} ms (per rep {steps}; "
                      f"server ITL mean {itl}; multi-token chunks "
                      f"{sum(r['multi_token_chunks'] for r in xs)})", flush=True)
        end = await hist_snapshot(session, base)
    counter_deltas = {k: end.get(k, 0.0) - start.get(k, 0.0) for k in COUNTERS if k in end}
    pts = [r for r in bursts + dec if r["step_s"] is not None]
    main_fit = fit([(r["batched"], r["context"], r["step_s"]) for r in pts])
    med_fit = fit(medians(bursts, lambda r: ("b", r["burst_k"], r["prompt_len"]))
                  + medians(dec, lambda r: ("d", r["concurrency"], r["prompt_len"])))
    # Same, plus a term per request newly admitted (prefilled) in the step: K / steps for bursts.
    ext_fit = fit([(r["batched"], r["context"], r["burst_k"] / r["steps"] if "burst_k" in r else 0.0,
                    r["step_s"]) for r in pts], extra="new_request_in_step")
    for f in (main_fit, med_fit):
        over = [p["client_ttft_s"] - (f["a_s"] + (f["b_s_per_batched_token"] + f["c_s_per_context_token"])
                                      * p["prompt_len"]) for p in iso]
        f["request_latency_overhead_s"] = {"median": statistics.median(over), "min": min(over), "max": max(over)}
    mismatches = [p for p in iso if p["prompt_tokens_usage"] != p["prompt_len"]]
    mismatches += [r for r in bursts if any(u != r["prompt_len"] for u in r["prompt_tokens_usage"])]
    mismatches += [d for d in dec if any(u != d["prompt_len"] for u in d["prompt_tokens_usage"])]
    return {"base_url": base, "model": a.model, "args": vars(a),
            "prompt_token_mismatches": len(mismatches), "counter_deltas": counter_deltas,
            "prefill_isolated": iso, "prefill_bursts": bursts, "decode": dec,
            "fit": main_fit, "fit_medians": med_fit, "fit_with_new_requests": ext_fit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=None,
                    help="prompt RNG seed; default: a fresh one per run (recorded in the output), because "
                         "a seed already used against the same server would hit its prefix cache")
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[16, 128, 256, 480])
    ap.add_argument("--reps", type=int, default=5, help="repeats per isolated-prefill length and per burst")
    ap.add_argument("--burst-k", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--bg-len", type=int, default=50, help="background stream prompt length for (ii)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--decode-lens", type=int, nargs="+", default=[50, 400])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-reps", type=int, default=3)
    a = ap.parse_args()
    if a.seed is None:
        a.seed = time.time_ns() % 2**31
    result = asyncio.run(main_async(a))
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for name in ("fit", "fit_medians"):
        f = result[name]
        o = f["request_latency_overhead_s"]
        print(f"\n{name} over {f['n_points']} points: step_time = {f['a_s']:.6f} s + "
              f"{f['b_s_per_batched_token']:.3e} s * batched_tokens + "
              f"{f['c_s_per_context_token']:.3e} s * context_tokens")
        print(f"  RMS residual {f['rms_residual_s'] * 1e3:.3f} ms (relative {f['rms_relative_residual']:.1%}), "
              f"max |residual| {f['max_abs_residual_s'] * 1e3:.3f} ms, R^2 {f['r2']:.4f}; request latency overhead "
              f"(isolated client TTFT - fitted step) median {o['median'] * 1e3:.2f} ms "
              f"(min {o['min'] * 1e3:.2f}, max {o['max'] * 1e3:.2f})")
    e = result["fit_with_new_requests"]
    print(f"\nfit_with_new_requests: step_time = {e['a_s']:.6f} + {e['b_s_per_batched_token']:.3e} * batched + "
          f"{e['c_s_per_context_token']:.3e} * context + {e['d_s_per_new_request_in_step']:.3e} * new_requests; "
          f"RMS residual {e['rms_residual_s'] * 1e3:.3f} ms (relative {e['rms_relative_residual']:.1%}), "
          f"R^2 {e['r2']:.4f}")
    print(f"seed {a.seed}; prompt-token mismatches: {result['prompt_token_mismatches']}; counter deltas over the run "
          f"(both should be 0): {result['counter_deltas']}; wrote {out}")


if __name__ == "__main__":
    main()
