"""Named benchmark scenarios: tenants, priorities and SLOs, stated here in code.

Each scenario draws on real public traces: the slices in the repository's data/traces (sources,
licences and schemas in its README), or the full traces where $BOUNCER_TRACES_DIR names a folder
of the same layout; `--trace PATH` swaps the default trace for another file of the same format.
Shares are of the offered load at load factor 1.

A ServeGen folder as `--trace` replaces the scenario's tenants too: every client active in the
replayed span (the day's busiest hour) becomes a tenant with its share of the requests, under the
scenario's first tenant's SLO and token cap. Bands follow one stated rule: a client sending at
least 10% of the span's requests is a bulk client in band 0; every other client is in band 1, so
a heavy client's burst cannot starve the many light ones.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from bouncer.sim.profiles import EngineProfile
from bouncer.sim.servegen import client_traces, is_servegen, load_servegen
from bouncer.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace, trace_file
from bouncer.sim.workloads import Burst, TenantSpec

REPO_TRACES = pathlib.Path(__file__).resolve().parents[3] / "data" / "traces"  # <checkout>/src/bouncer/sim


def _traces_dir() -> pathlib.Path:
    """$BOUNCER_TRACES_DIR (the full traces, say), else the slices in the checkout."""
    return pathlib.Path(os.environ["BOUNCER_TRACES_DIR"]) if os.environ.get("BOUNCER_TRACES_DIR") else REPO_TRACES


TRACES = _traces_dir()
# a name NAME finds NAME.gz too (bouncer.sim.traces.trace_file): the repository gzips its larger slices
AZURE_CONV = trace_file(TRACES / "azure-2023/AzureLLMInferenceTrace_conv.csv")
AZURE_CODE = trace_file(TRACES / "azure-2023/AzureLLMInferenceTrace_code.csv")
MOONCAKE_CONV = trace_file(TRACES / "mooncake-fast25/conversation_trace.jsonl")
WEKA_SESSIONS = TRACES / "weka-claude-code/traces"
SERVEGEN_DEEPSEEK_R1 = TRACES / "servegen/deepseek-r1"
SERVEGEN_M_MID = TRACES / "servegen/m-mid"  # a language-model service: thousands of short requests a second


@dataclass
class Scenario:
    name: str
    description: str
    tenants: list[TenantSpec]
    traces: dict[str, pathlib.Path]
    contention_window: tuple[float, float] = (0.0, 1.0)  # fraction of the run where fairness is judged
    max_model_len: int = 8192
    cpu_offload_gib: float = 0.0  # host-memory KV tier per replica (vLLM --kv-offloading-size)
    # separate prefill and decode workers: `--replicas` engines split between the pools so that
    # both run equally loaded on the scenario's mix (`pd_split`)
    disaggregated: bool = False
    loaded: dict[str, Sequence[TraceRequest]] = field(default_factory=dict)
    synthetic: bool = False  # its requests are made up (`loaded`), not read from a trace

    def load(self, override: str | None = None, start_h: float | None = None,
             tenancy: str = "banded") -> dict[str, Sequence[TraceRequest]]:
        """The scenario's traces; `override` replaces its first (main) trace, or, as a ServeGen
        folder, all of them and the tenants (module doc; `servegen_tenants` for `tenancy`), over
        the hour from `start_h` hours into the trace (default: its busiest hour)."""
        if (start_h is not None or tenancy != "banded") and not (override and is_servegen(override)):
            raise ValueError("a start time or a tenancy is for a ServeGen trace: give its folder as the trace")
        if override and self.synthetic:
            raise ValueError(f"scenario {self.name!r} replays no trace (its requests are synthetic): "
                             "a trace does not apply")
        if not self.loaded:
            if override and is_servegen(override):
                start_s = None if start_h is None else start_h * 3600
                self.loaded = client_traces(load_servegen(override), seed=0, start_s=start_s)
                if not self.loaded:
                    raise ValueError(f"{override}: no client sends a request in the hour from {start_h:g} h")
                self.tenants = servegen_tenants(self.loaded, self.tenants[0], tenancy)
                self.traces = {}
                return self.loaded
            for i, (key, path) in enumerate(self.traces.items()):
                path = override if override and i == 0 else path
                # a ServeGen folder as one tenant's trace: its clients' requests merged
                self.loaded[key] = merged_clients(path) if is_servegen(path) else load_trace(path)
        return self.loaded

    def pd_split(self, profile: EngineProfile, engines: int) -> tuple[int, int]:
        """(prefill workers, decode workers) out of `engines`, at least one of each: the share
        that prefills is the mix's prefill time over its prefill and decode time
        (`EngineProfile.prefill_seconds`, `decode_seconds`), over each tenant's requests at its
        share."""
        if engines < 2:
            raise ValueError("a disaggregated fleet needs at least 2 engines (--replicas)")
        traces = self.load()
        prefill_s = decode_s = 0.0
        for t in self.tenants:
            reqs = traces[t.trace]
            # per request, not of the mean length: a prompt's attention grows with its square
            prefill_s += t.share * sum(profile.prefill_seconds(max(r.prompt_len, t.min_prompt or 0))
                                       for r in reqs) / len(reqs)
            decode_s += t.share * sum(profile.decode_seconds(max(r.prompt_len, t.min_prompt or 0),
                                                             min(r.output_len, t.max_tokens)) for r in reqs) / len(reqs)
        prefill = min(engines - 1, max(1, round(engines * prefill_s / (prefill_s + decode_s))))
        return prefill, engines - prefill


def merged_clients(folder: str | pathlib.Path) -> list[TraceRequest]:
    """A ServeGen folder's clients as one trace, in arrival order."""
    return sorted((r for reqs in client_traces(load_servegen(folder), seed=0).values() for r in reqs),
                  key=lambda r: r.t)


BULK_CLIENT_SHARE = 0.10  # a ServeGen client with at least this share of the requests is bulk (band 0)


SERVEGEN_TENANCIES = ("banded", "volume-weighted")


def servegen_tenants(traces: dict[str, Sequence[TraceRequest]], template: TenantSpec,
                     tenancy: str = "banded") -> list[TenantSpec]:
    """A tenant per client. `banded`: clients with BULK_CLIENT_SHARE of the requests or more in
    band 0, the others in band 1 above them, all of weight 1. `volume-weighted`: all in one band,
    each weighted by its share of the requests (the mean weight 1), so that under overload fair
    queueing gives each about its share of what arrives, as serving in arrival order does."""
    if tenancy not in SERVEGEN_TENANCIES:
        raise ValueError(f"unknown tenancy {tenancy!r}: one of {', '.join(SERVEGEN_TENANCIES)}")
    total = sum(len(t) for t in traces.values())
    tenants = []
    for cid, reqs in sorted(traces.items(), key=lambda kv: -len(kv[1])):
        share = len(reqs) / total
        if tenancy == "banded":
            priority, weight = (0 if share >= BULK_CLIENT_SHARE else 1), 1.0
        else:
            priority, weight = 1, share * len(traces)
        tenants.append(replace(template, name=f"client-{cid}", priority=priority, share=share, trace=cid,
                               weight=weight, min_prompt=None, bursts=()))
    return tenants


def _bursting(tenants: list[TenantSpec], name: str, duration_s: float, multiplier: float) -> list[TenantSpec]:
    """The tenant `name` runs at `multiplier` x its rate through the middle third of the run."""
    burst = Burst(duration_s / 3, 2 * duration_s / 3, multiplier)
    return [replace(t, bursts=(burst,)) if t.name == name else t for t in tenants]


# guidellm's synthetic requests (`bouncer bench live --driver guidellm`), and the top tenant's
FLOOD_PROMPT, FLOOD_OUTPUT = 512, 64
TOP_PROMPT, TOP_OUTPUT = 64, 16
FLOOD_TOP_SHARE = 0.05  # of the requests, in the `flood` scenario


def flood(top_share: float = FLOOD_TOP_SHARE) -> Scenario:
    """A batch job flooding the pool as a sheddable tenant beside a top tenant: `flood` (band -1,
    guidellm's constant rate of 512-in / 64-out, no retries: guidellm makes none) and `top`
    (band 10, a 1 s TTFT SLO, short requests, the openai SDK's retries), `top_share` of the
    requests. The live flood is this, with the top tenant at one request a second."""
    def constant(prompt: int, output: int) -> list[TraceRequest]:
        return [TraceRequest(float(i), prompt, output) for i in range(1000)]
    tenants = [
        TenantSpec("top", priority=10, share=top_share, trace="top", ttft_slo=1.0, max_tokens=TOP_OUTPUT),
        TenantSpec("flood", priority=-1, share=1 - top_share, trace="flood", ttft_slo=5.0, tpot_slo=0.25,
                   max_tokens=FLOOD_OUTPUT, max_retries=0),
    ]
    return Scenario("flood", "a batch job (guidellm's synthetic requests) flooding the pool as a sheddable "
                             "tenant, a top tenant streaming through it", tenants, {},
                    loaded={"top": constant(TOP_PROMPT, TOP_OUTPUT), "flood": constant(FLOOD_PROMPT, FLOOD_OUTPUT)},
                    synthetic=True)


def get_scenario(name: str, duration_s: float) -> Scenario:
    scenario = _azure_scenario(name, duration_s) or _shared_prefix_scenario(name, duration_s)
    if scenario is not None:
        return scenario
    if name == "flood":
        # the only sheddable band beside rogue-tenant's bursty free tier: a change that cost
        # this flood 3-5% went unseen for two days (docs/benchmarks/history/sheddable-bands.md)
        return flood()
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


def _azure_scenario(name: str, duration_s: float) -> Scenario | None:
    """The scenarios on Azure's conversation and code traces; None: not one of them."""
    if name == "rogue-tenant":
        tenants = [
            TenantSpec("sla", priority=10, share=0.4, trace="conv", ttft_slo=1.0, tpot_slo=0.1, max_tokens=1024),
            TenantSpec("research", priority=0, share=0.3, trace="code", ttft_slo=10.0, tpot_slo=0.2,
                       max_tokens=1024),
            # max-length prompts: 6,000 of the 8,192-token context
            TenantSpec("free", priority=-1, share=0.3, trace="conv", ttft_slo=10.0, tpot_slo=0.2, max_tokens=512,
                       min_prompt=6000),
        ]
        return Scenario(name, "an SLA tenant, a research tenant of long prompts, and a free tier of max-length "
                              "prompts that goes 10x through the middle third",
                        _bursting(tenants, "free", duration_s, 10.0), {"conv": AZURE_CONV, "code": AZURE_CODE})
    if name == "consolidation":
        tenants = [
            TenantSpec("realtime", priority=10, share=0.3, trace="conv", ttft_slo=0.5, tpot_slo=0.05, max_tokens=1024),
            TenantSpec("standard", priority=0, share=0.7, trace="conv", ttft_slo=5.0, tpot_slo=0.15, max_tokens=1024),
        ]
        return Scenario(name, "real-time and standard bands sharing one pool", tenants, {"conv": AZURE_CONV})
    if name == "fairness":
        tenants = [
            TenantSpec("steady", priority=0, share=0.5, trace="conv", ttft_slo=5.0, tpot_slo=0.15, max_tokens=1024),
            TenantSpec("bursty", priority=0, share=0.5, trace="conv", ttft_slo=5.0, tpot_slo=0.15, max_tokens=1024),
        ]
        return Scenario(name, "two tenants of equal weight in one band; one bursts 10x through the middle third",
                        _bursting(tenants, "bursty", duration_s, 10.0), {"conv": AZURE_CONV},
                        contention_window=(1 / 3, 2 / 3))
    if name == "gateways":
        # What several gateways must keep as one would: with each tenant on its own
        # gateway (`--spread tenant`: top, steady, bursty on gateways 0, 1, 2), the burst arrives
        # at one gateway while the tenant it must not crowd out waits at another.
        tenants = [
            TenantSpec("top", priority=10, share=0.2, trace="conv", ttft_slo=1.0, tpot_slo=0.1, max_tokens=1024),
            TenantSpec("steady", priority=0, share=0.4, trace="conv", ttft_slo=5.0, tpot_slo=0.15, max_tokens=1024),
            TenantSpec("bursty", priority=0, share=0.4, trace="conv", ttft_slo=5.0, tpot_slo=0.15, max_tokens=1024),
        ]
        return Scenario(name, "a top-band tenant beside two tenants of equal weight in one band; one bursts 10x "
                              "through the middle third", _bursting(tenants, "bursty", duration_s, 10.0),
                        {"conv": AZURE_CONV}, contention_window=(1 / 3, 2 / 3))
    if name == "surge":
        tenants = [TenantSpec("standard", priority=0, share=1.0, trace="conv", ttft_slo=2.0, tpot_slo=0.1,
                              max_tokens=1024)]
        return Scenario(name, "the Azure conversation trace replayed at load factors 0.5 to 3", tenants,
                        {"conv": AZURE_CONV})
    return None


def _shared_prefix_scenario(name: str, duration_s: float) -> Scenario | None:
    """The scenarios of long, shared prompts (Mooncake, a RAG and reasoning mix); None: not one of them."""
    if name == "disaggregated":
        # Separate prefill and decode pools (vLLM / llm-d / Dynamo P/D) under a prefill-heavy
        # tenant and a decode-heavy one: Kimi's long-context conversations (Mooncake: 12k-token
        # prompts on average, 343-token answers) beside a reasoning model's chat (ServeGen's
        # DeepSeek-R1 clients: 697-token prompts, 830-token answers, p99 5.4k).
        tenants = [
            TenantSpec("rag", priority=0, share=0.5, trace="mooncake", ttft_slo=4.0, tpot_slo=0.1, max_tokens=2048),
            TenantSpec("reasoning", priority=0, share=0.5, trace="r1", ttft_slo=1.0, tpot_slo=0.05,
                       max_tokens=4096),
        ]
        return Scenario(name, "long-prompt RAG next to long-answer reasoning chat, on separate prefill and "
                              "decode pools", tenants, {"mooncake": MOONCAKE_CONV, "r1": SERVEGEN_DEEPSEEK_R1},
                        max_model_len=131_072, disaggregated=True)
    if name == "prefix":
        # Kimi's production conversations: 12k-token prompts on average (up to 126k), 37% of
        # their blocks repeat an earlier prompt's prefix. For comparing routers. Their working set
        # is several times what the GPUs hold (the fleet's pooled KV, used as one perfect LRU cache,
        # reaches only ~50% of the trace's infinite-cache hit rate), so engines offload KV to
        # 200 GiB of host memory each, as deployments serving such traffic do (vLLM
        # --kv-offloading-size; Mooncake's own store).
        tenants = [TenantSpec("chat", priority=0, share=1.0, trace="mooncake", ttft_slo=5.0, tpot_slo=0.1,
                              max_tokens=2048)]
        return Scenario(name, "the Mooncake conversation trace, whose prompts share long prefixes", tenants,
                        {"mooncake": MOONCAKE_CONV}, max_model_len=131_072, cpu_offload_gib=200.0)
    if name == "prefix-tenants":
        # the same conversations as `prefix`, each conversation one tenant's (by its second block:
        # every prompt opens with the same system prompt, then its conversation's own blocks), for
        # what keeping tenants' caches apart costs (`cache_isolation`): within a tenant, nothing
        # is lost to it; across tenants, only that shared system prompt, which each tenant's cache
        # then holds for itself
        conversations = load_trace(MOONCAKE_CONV)
        first_own = MOONCAKE_BLOCK_TOKENS // 16  # the digest of a conversation's first block of its own
        parts: list[list[TraceRequest]] = [[] for _ in range(PREFIX_TENANTS)]
        for r in conversations:
            key = r.block_digests[first_own] if len(r.block_digests) > first_own else 0
            parts[key % PREFIX_TENANTS].append(r)
        tenants = [TenantSpec(f"t{i}", priority=0, share=len(part) / len(conversations), trace=f"mooncake-{i}",
                              ttft_slo=5.0, tpot_slo=0.1, max_tokens=2048) for i, part in enumerate(parts)]
        return Scenario(name, "the Mooncake conversations, each conversation one of eight tenants'", tenants, {},
                        max_model_len=131_072, cpu_offload_gib=200.0,
                        loaded={f"mooncake-{i}": part for i, part in enumerate(parts)})
    return None


PREFIX_TENANTS = 8  # the tenants `prefix-tenants` spreads the conversations over
# `agents` is closed-loop and lives in bouncer.bench.agents
SCENARIOS = ("rogue-tenant", "consolidation", "fairness", "gateways", "surge", "prefix", "prefix-tenants",
             "disaggregated", "flood", "agents")
