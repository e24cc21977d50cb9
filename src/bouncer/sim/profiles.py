"""Engine profiles: step-time coefficients and KV geometry for real model/GPU pairs.

One engine step (a forward pass over the continuous batch) is modelled as

    step_time = a + b * batched_tokens + c * context_tokens + d * attention_pairs

- `a`: fixed cost of a step. Decode is memory-bound, so at small batch the step is dominated by
  streaming the weights once from HBM, plus scheduler/sampler overhead.
- `b`: cost per token processed in the step (prefill chunk tokens + one per decoding request),
  compute-bound: 2 x parameters FLOPs per token at an achievable fraction of peak (MFU).
- `c`: cost per token of context the batch's attention reads (sum over scheduled requests of
  the tokens in their KV cache), memory-bound: KV bytes per token at achievable bandwidth.
- `d`: cost per attention pair of a prompt chunk (a token computed in the step, and a token at
  or before its position), compute-bound: QK^T and AV are 4 x query heads x head dim FLOPs per
  pair per layer, at the same MFU as `b`. A decode step's attention is memory-bound (`c`); a
  prompt's is quadratic, and at long contexts it outweighs the weights' 2 x parameters FLOPs
  per token (Llama-3.1-8B: 524k FLOPs per pair, so past ~30k tokens of context). Cross-check:
  NVIDIA's published TTFT of Llama 3.1 405B on a GH200 NVL32 grows 4.7x from 32,768 to 122,880
  input tokens; with `d` this model's ratio is 5.2x, without it 3.75x.

Roofline constants used below (datasheet figures, dense BF16):
  H100 SXM: 989 TFLOP/s, 3.35 TB/s HBM3, 80 GB.     H200: 989 TFLOP/s, 4.8 TB/s HBM3e, 141 GB.
Achievable fractions: 80% of HBM bandwidth, 60% MFU for one GPU, 50% under tensor parallelism
(all-reduce per layer). KV capacity follows vLLM's sizing: gpu_memory_utilization 0.9 of the
card, minus weights, minus ~4 GB for activations and CUDA graphs, divided by KV bytes per token.

Model geometry from the models' config.json (Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128;
Llama-3.1-70B: 80 layers, 8 KV heads, head dim 128; Qwen3-32B: 64 layers, 8 KV heads, head dim
128), BF16 weights and KV. Cross-check: vLLM's published Llama-3.1-8B H100 decode ITL at batch 1
is ~6-7 ms, and the 70B on 4xH100 ~15-20 ms, which `a` reproduces within ~15%.

`vllm-cpu-tiny` is measured, not derived: see docs/benchmarks/engine-model.md for the calibration run.

Disaggregated (P/D) fleets: `kv_transfer_s` is a prompt's KV over the link below; how many workers
should prefill is the traffic's as much as the model's (`prefill_seconds`, `decode_seconds`):
from the repository's traces, chat and long-context traffic (Azure conversations, Mooncake) want
0.62-0.77 of the workers prefilling on these pairs, a reasoning model's long answers (ServeGen
DeepSeek-R1) 0.24-0.35 (table and derivation in docs/benchmarks/engine-model.md, "Disaggregated fleets").
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        """K and V for every layer and KV head (GQA: KV heads, not attention heads)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    model: str
    hardware: str
    a: float  # s per step
    b: float  # s per batched token
    c: float  # s per context token read by attention
    kv: KVGeometry
    num_blocks: int
    block_size: int = 16
    # vLLM 0.32's OpenAI-server defaults on >= 70 GB GPUs other than A100 (EngineArgs
    # get_batch_defaults): 8,192 batched tokens, 1,024 sequences.
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: int = 131072
    # KV offloading to host memory (vLLM --kv-offloading-size): blocks come back over PCIe. Gen5
    # x16 is 64 GB/s per direction; 25 GB/s is assumed for copies of scattered 2 MB blocks. Each
    # GPU of a tensor-parallel group loads its own shard over its own link.
    pcie_bytes_per_s: float = 25e9
    gpus: int = 1
    d: float = 0.0  # s per attention pair of a prompt chunk
    # Disaggregated serving: a prefill worker sends a prompt's KV to a decode worker over RDMA,
    # one 400 Gb/s NIC per GPU (ConnectX-7, InfiniBand NDR) at 80% of line rate, 40 GB/s; each GPU
    # of a tensor-parallel group sends its own shard over its own NIC. Plus 2 ms per transfer for
    # the handshake (NIXL's notification round trip, and the second HTTP hop of the P/D proxy).
    link_bytes_per_s: float = 40e9
    transfer_setup_s: float = 0.002

    def step_time(self, batched_tokens: int, context_tokens: int, attention_pairs: int = 0) -> float:
        return self.a + self.b * batched_tokens + self.c * context_tokens + self.d * attention_pairs

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def offload_load_s_per_token(self) -> float:
        return self.kv.bytes_per_token / (self.pcie_bytes_per_s * self.gpus)

    @property
    def step_time_config(self) -> dict:
        """The `models[].step_time` config section that states this profile to the core's
        latency predictor."""
        return {"a": self.a, "b": self.b, "c": self.c, "d": self.d, "max_batched_tokens": self.max_num_batched_tokens}

    def kv_transfer_s(self, tokens: int) -> float:
        """Time for `tokens` of a prompt's KV to cross from a prefill to a decode worker."""
        return self.transfer_setup_s + tokens * self.kv.bytes_per_token / (self.link_bytes_per_s * self.gpus)

    def prefill_seconds(self, prompt_tokens: float) -> float:
        """A prefill worker's time for one prompt: its compute (`b` and `d` per token) in chunks
        of max_num_batched_tokens, each a step."""
        steps = max(1.0, prompt_tokens / self.max_num_batched_tokens)
        return steps * self.a + self.b * prompt_tokens + self.d * prompt_tokens ** 2 / 2

    def decode_seconds(self, prompt_tokens: float, output_tokens: float) -> float:
        """A decode worker's time per answer when it is full: as many decode at once as its KV
        holds (each holding its prompt and, on average, half its output; at most
        max_num_seqs), one token each per step, the batch reading all of their contexts."""
        context = prompt_tokens + output_tokens / 2
        batch = max(1, min(self.max_num_seqs, int(self.kv_tokens // context)))
        return output_tokens * (self.a + self.b * batch + self.c * batch * context) / batch

    def prefill_share(self, prompt_tokens: float, output_tokens: float) -> float:
        """The share of a disaggregated fleet's workers that should prefill so that both pools
        run equally loaded, for requests of these mean lengths. Typical splits in
        docs/benchmarks/engine-model.md ("Disaggregated fleets")."""
        prefill_s = self.prefill_seconds(prompt_tokens)
        return prefill_s / (prefill_s + self.decode_seconds(prompt_tokens, output_tokens))

    def offload_blocks(self, gib: float) -> int:
        """Host-memory blocks in `gib` GiB of offloading space (as vLLM sizes it: GiB, not GB)."""
        return int(gib * (1 << 30) / self.kv.bytes_per_token) // self.block_size


def _kv_blocks(card_gb: float, weights_gb_per_gpu: float, kv_bytes_per_token_per_gpu: float,
               block_size: int = 16) -> int:
    kv_bytes = (card_gb * 0.9 - weights_gb_per_gpu - 4.0) * GB
    return int(kv_bytes / kv_bytes_per_token_per_gpu) // block_size


_H100_BW, _H200_BW, _PEAK = 3.35e12 * 0.8, 4.8e12 * 0.8, 989e12


def _attention_flops_per_pair(layers: int, query_heads: int, head_dim: int) -> float:
    return 4 * layers * query_heads * head_dim  # QK^T and AV: 2 FLOPs per multiply-add each

_LLAMA8 = KVGeometry(layers=32, kv_heads=8, head_dim=128)
_LLAMA70 = KVGeometry(layers=80, kv_heads=8, head_dim=128)
_QWEN32 = KVGeometry(layers=64, kv_heads=8, head_dim=128)


def _llama_8b(card: str, hardware: str, bandwidth: float, card_gb: float) -> EngineProfile:
    return EngineProfile(
        name=f"llama-3.1-8b-{card}", model="meta-llama/Llama-3.1-8B-Instruct", hardware=hardware,
        # 16.06 GB of weights per step + ~1 ms of scheduling and sampling
        a=16.06 * GB / bandwidth + 0.001,
        b=2 * 8.03e9 / (_PEAK * 0.6),
        c=_LLAMA8.bytes_per_token / bandwidth,
        d=_attention_flops_per_pair(32, 32, 128) / (_PEAK * 0.6),
        kv=_LLAMA8, num_blocks=_kv_blocks(card_gb, 16.06, _LLAMA8.bytes_per_token))


PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        _llama_8b("h100", "1xH100-80GB", _H100_BW, 80),
        # the H100's compute, more bandwidth and memory; checked against step times measured on
        # one (docs/benchmarks/engine-model.md, "The derived profiles on a real H200")
        _llama_8b("h200", "1xH200-141GB", _H200_BW, 141),
        EngineProfile(
            name="llama-3.1-70b-4xh100", model="meta-llama/Llama-3.1-70B-Instruct",
            hardware="4xH100-80GB, tensor parallel 4",
            # 35.3 GB of weights per GPU per step + ~2.5 ms of all-reduces (2 per layer)
            a=141.2 / 4 * GB / _H100_BW + 0.0025,
            b=2 * 70.6e9 / (4 * _PEAK * 0.5),
            c=_LLAMA70.bytes_per_token / 4 / _H100_BW,
            d=_attention_flops_per_pair(80, 64, 128) / (4 * _PEAK * 0.5),
            kv=_LLAMA70, num_blocks=_kv_blocks(80, 141.2 / 4, _LLAMA70.bytes_per_token / 4), gpus=4),
        EngineProfile(
            name="qwen3-32b-h200", model="Qwen/Qwen3-32B", hardware="1xH200-141GB",
            a=65.5 * GB / _H200_BW + 0.001,
            b=2 * 32.8e9 / (_PEAK * 0.6),
            c=_QWEN32.bytes_per_token / _H200_BW,
            d=_attention_flops_per_pair(64, 64, 128) / (_PEAK * 0.6),
            kv=_QWEN32, num_blocks=_kv_blocks(141, 65.5, _QWEN32.bytes_per_token),
            max_model_len=40960),
        EngineProfile(
            # Measured: real vLLM 0.32 CPU build on this project's 2-core machine, serving the tiny
            # random Llama of scripts/make_tiny_model.py (2 layers, 4 KV heads x 32, float32).
            # Least-squares fit of step times (scripts/fidelity/calibrate.py, two runs): a and b
            # stable to ~5%; c poorly determined (0.7e-7 to 3.7e-7), the midpoint is used. d is
            # left 0: prompts of at most 512 tokens do not show attention's quadratic term.
            # The CPU backend uses 128-token blocks; 1 GiB of KV / 2,048 B per token = 4,096 blocks;
            # CPU defaults: 2,048 batched tokens, 128 sequences.
            name="vllm-cpu-tiny", model="tiny random Llama (local)", hardware="2-core x86 CPU, vLLM CPU build",
            a=0.0051, b=2.2e-5, c=2.2e-7,
            kv=KVGeometry(layers=2, kv_heads=4, head_dim=32, dtype_bytes=4), num_blocks=4096, block_size=128,
            max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=512),
    )
}

DEFAULT_PROFILE = "llama-3.1-8b-h100"


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
