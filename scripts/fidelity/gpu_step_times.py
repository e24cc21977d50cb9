"""Time one engine step of a model's real shapes on a GPU, and fit the engine model's
`step_time = a + b * batched_tokens + c * context_tokens + d * attention_pairs` to it, to check
the coefficients `bouncer.sim.profiles` derives from datasheet rooflines.

No vLLM and no weights here (none can be fetched on the GPU machine): a decoder-only transformer
with the model's geometry (from its config.json) and random BF16 weights, written in plain
PyTorch: per layer RMSNorm, fused QKV and output projections, rotary-free grouped-query
attention (`scaled_dot_product_attention`, FlashAttention where PyTorch has it), SwiGLU MLP; the
LM head for one position per sequence, as an engine samples. Step time depends on shapes, not on
weights' values.

- Prefill steps: one prompt of N tokens, causal attention over it (batched = N, pairs = N(N+1)/2).
- Decode steps: n sequences of L tokens of context each, one new token each (batched = n,
  context = n * L), captured in a CUDA graph and replayed, as vLLM runs decode steps.
- Mixed steps (not in the fit: they test that the terms add up): a prompt chunk of N tokens and
  n decoding sequences in one pass, the linear layers over all N + n tokens together.
Every step is timed with CUDA events: median of `--reps` after warm-up. The KV read by decode
steps is one layer's buffer reused by every layer: each read is far larger than the L2 cache, so
the time is that of distinct buffers, in a fraction of the memory.

What it cannot show: vLLM's own kernels (paged attention, FlashAttention 3 on Hopper, fused
norms), its scheduler's CPU time per step, and chunked prefill mixed with decode in one step.
So `a` measured here is a floor for vLLM's, and `d` an upper bound where PyTorch's attention is
slower than FlashAttention 3.

    python scripts/fidelity/gpu_step_times.py --models llama-3.1-8b,qwen3-32b --out results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F

# config.json geometry (hidden, intermediate, layers, query heads, KV heads, head dim, vocab)
MODELS = {
    "llama-3.1-8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256),
    "qwen3-32b": dict(hidden=5120, inter=25600, layers=64, heads=64, kv_heads=8, head_dim=128, vocab=151936),
}


class Shapes:
    def __init__(self, hidden, inter, layers, heads, kv_heads, head_dim, vocab, dev):
        self.h, self.layers, self.heads, self.kvh, self.hd = hidden, layers, heads, kv_heads, head_dim
        dt = torch.bfloat16
        qkv = (heads + 2 * kv_heads) * head_dim
        scale = hidden ** -0.5

        def w(*shape):
            return (torch.randn(*shape, device=dev, dtype=dt) * scale)

        self.w_qkv = [w(hidden, qkv) for _ in range(layers)]
        self.w_o = [w(heads * head_dim, hidden) for _ in range(layers)]
        self.w_gu = [w(hidden, 2 * inter) for _ in range(layers)]
        self.w_down = [w(inter, hidden) for _ in range(layers)]
        self.norm = torch.ones(hidden, device=dev, dtype=dt)
        self.lm_head = w(hidden, vocab)
        self.params = sum(t.numel() for ts in (self.w_qkv, self.w_o, self.w_gu, self.w_down) for t in ts) \
            + self.lm_head.numel() * 2  # tied or not, the embedding table's size counts as weights

    def _mlp(self, x, i):
        gate, up = (x @ self.w_gu[i]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down[i]

    def prefill(self, x):
        """x: (N, hidden), one sequence, causal."""
        n = x.shape[0]
        for i in range(self.layers):
            y = F.rms_norm(x, (self.h,), self.norm)
            q, k, v = (y @ self.w_qkv[i]).split([self.heads * self.hd, self.kvh * self.hd, self.kvh * self.hd], -1)
            q = q.view(1, n, self.heads, self.hd).transpose(1, 2)
            k = k.view(1, n, self.kvh, self.hd).transpose(1, 2)
            v = v.view(1, n, self.kvh, self.hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(n, -1) @ self.w_o[i]
            x = x + self._mlp(F.rms_norm(x, (self.h,), self.norm), i)
        return F.rms_norm(x[-1:], (self.h,), self.norm) @ self.lm_head

    def mixed(self, x, p, k_cache, v_cache):
        """x: (p + n, hidden): a prompt chunk of p tokens (no earlier context) and one new token
        for each of n decoding sequences, through the linear layers together, as an engine
        batches them; attention apart (causal over the chunk, the cache for the others)."""
        n = x.shape[0] - p
        qd, kd = self.heads * self.hd, self.kvh * self.hd
        for i in range(self.layers):
            y = F.rms_norm(x, (self.h,), self.norm)
            q, k, v = (y @ self.w_qkv[i]).split([qd, kd, kd], -1)
            qp = q[:p].view(1, p, self.heads, self.hd).transpose(1, 2)
            kp = k[:p].view(1, p, self.kvh, self.hd).transpose(1, 2)
            vp = v[:p].view(1, p, self.kvh, self.hd).transpose(1, 2)
            ap = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            ap = ap.transpose(1, 2).reshape(p, -1)
            ad = F.scaled_dot_product_attention(q[p:].view(n, self.heads, 1, self.hd), k_cache, v_cache,
                                                enable_gqa=True).reshape(n, -1)
            x = x + torch.cat([ap, ad]) @ self.w_o[i]
            x = x + self._mlp(F.rms_norm(x, (self.h,), self.norm), i)
        return F.rms_norm(x[p - 1:], (self.h,), self.norm) @ self.lm_head

    def decode(self, x, k_cache, v_cache):
        """x: (n, hidden), one new token for each of n sequences whose KV is (n, kv_heads, L, hd)."""
        n = x.shape[0]
        for i in range(self.layers):
            y = F.rms_norm(x, (self.h,), self.norm)
            q, _, _ = (y @ self.w_qkv[i]).split([self.heads * self.hd, self.kvh * self.hd, self.kvh * self.hd], -1)
            q = q.view(n, self.heads, 1, self.hd)
            a = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
            x = x + a.reshape(n, -1) @ self.w_o[i]
            x = x + self._mlp(F.rms_norm(x, (self.h,), self.norm), i)
        return F.rms_norm(x, (self.h,), self.norm) @ self.lm_head


def timed(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def fit(points: list[dict]) -> dict:
    """Least squares of seconds on (1, batched, context, pairs) over the prefill and decode steps,
    relative errors weighted equally."""
    points = [p for p in points if p["kind"] != "mixed"]
    rows = torch.tensor([[1.0, p["batched"], p["context"], p["pairs"]] for p in points], dtype=torch.float64)
    y = torch.tensor([p["seconds"] for p in points], dtype=torch.float64)
    w = 1 / y  # relative error: short steps count as much as long ones
    coef = torch.linalg.lstsq(rows * w[:, None], y * w).solution
    pred = rows @ coef
    return {"a": coef[0].item(), "b": coef[1].item(), "c": coef[2].item(), "d": coef[3].item(),
            "max_rel_error": ((pred - y).abs() / y).max().item()}


def measure(name: str, reps: int, dev) -> dict:
    g = MODELS[name]
    t0 = time.time()
    m = Shapes(**g, dev=dev)
    torch.cuda.synchronize()
    points = []
    with torch.inference_mode():
        for n in (256, 512, 1024, 2048, 4096, 8192):
            x = torch.randn(n, g["hidden"], device=dev, dtype=torch.bfloat16)
            s = timed(functools.partial(m.prefill, x), reps)
            points.append({"kind": "prefill", "tokens": n, "batched": n, "context": 0,
                           "pairs": n * (n + 1) // 2, "seconds": s})
            print(f"{name} prefill {n:5d}: {s * 1000:8.2f} ms", flush=True)
        for n, length in ((1, 512), (8, 512), (32, 512), (128, 512), (256, 512), (512, 512),
                          (32, 4096), (128, 2048), (64, 8192), (16, 32768)):
            x = torch.randn(n, g["hidden"], device=dev, dtype=torch.bfloat16)
            k = torch.randn(n, g["kv_heads"], length, g["head_dim"], device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            graph = torch.cuda.CUDAGraph()
            m.decode(x, k, v)  # warm the kernels before capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                m.decode(x, k, v)
            s = timed(graph.replay, reps)
            points.append({"kind": "decode", "sequences": n, "context_each": length, "batched": n,
                           "context": n * length, "pairs": 0, "seconds": s})
            print(f"{name} decode {n:4d} x {length:6d}: {s * 1000:8.2f} ms", flush=True)
            del graph, k, v
        for p, n, length in ((1024, 128, 512), (2048, 256, 512), (4096, 64, 2048), (512, 512, 512)):
            x = torch.randn(p + n, g["hidden"], device=dev, dtype=torch.bfloat16)
            k = torch.randn(n, g["kv_heads"], length, g["head_dim"], device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            s = timed(functools.partial(m.mixed, x, p, k, v), reps)
            points.append({"kind": "mixed", "tokens": p, "sequences": n, "context_each": length,
                           "batched": p + n, "context": n * length, "pairs": p * (p + 1) // 2, "seconds": s})
            print(f"{name} mixed {p:5d} + {n:4d} x {length:6d}: {s * 1000:8.2f} ms", flush=True)
            del k, v
    out = {"model": name, "geometry": g, "params": m.params, "points": points, "fit": fit(points),
           "seconds": time.time() - t0}
    del m
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3.1-8b,qwen3-32b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "models": []}
    for name in args.models.split(","):
        r = measure(name, args.reps, dev)
        f = r["fit"]
        print(f"{name}: a {f['a'] * 1000:.3f} ms, b {f['b']:.3e} s/token, c {f['c']:.3e} s/context token, "
              f"d {f['d']:.3e} s/pair (max error {f['max_rel_error']:.1%}; {r['seconds']:.0f} s)", flush=True)
        result["models"].append(r)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
