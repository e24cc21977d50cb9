"""Write the trace slices this repository carries (data/traces) from the full public traces.

    python scripts/slice_traces.py FULL_TRACES_DIR [OUT_DIR]   # OUT_DIR default: data/traces

FULL_TRACES_DIR has the upstream layout (azure-2023/, mooncake-fast25/, servegen/{deepseek-r1,m-mid,m-large}/,
weka-claude-code/{traces,subagents}/; data/traces/README.md says where each comes from). What is kept, and
why it is enough for the published benchmarks to regenerate unchanged:

- Azure 2023: both CSVs whole (1 MB). Every goodput scenario but `prefix` replays them.
- Mooncake FAST'25: the conversation trace whole, gzipped (the `prefix` scenario).
- WEKA Claude Code: every session of traces/ and of subagents/ (sessions with subagents), each
  gzipped (the `agents` scenario draws from all of a folder).
- ServeGen DeepSeek-R1, m-mid and m-large (a validation pool for what is tuned on m-mid): only
  what a replay reads. A replay takes the day's busiest hour over all
  clients (`bouncer.sim.servegen.busiest_span`); the slice keeps that hour's windows of the
  clients that send in it, and of each client's token distributions only the periods those
  windows draw from (gzipped). Clients that send nothing in that hour draw no random numbers in
  a replay, so the slice replays to exactly the same requests as the full folder; this script
  checks that before it writes anything.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from bouncer.sim.servegen import WINDOW_S, busiest_span, client_traces, load_servegen  # noqa: E402

SERVEGEN_SPAN_S = 3600.0


def _gzip(src: pathlib.Path, dst: pathlib.Path) -> None:
    # mtime=0: the same input gives the same bytes, so a re-run changes nothing in git
    with open(src, "rb") as f, open(dst, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        shutil.copyfileobj(f, out)


def _licence(src_dir: pathlib.Path, dst_dir: pathlib.Path) -> None:
    for name in ("LICENSE", "LICENSE-APACHE", "README.upstream.md"):
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)


def azure(full: pathlib.Path, out: pathlib.Path) -> None:
    src, dst = full / "azure-2023", out / "azure-2023"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv"):
        shutil.copyfile(src / name, dst / name)
    _licence(src, dst)


def mooncake(full: pathlib.Path, out: pathlib.Path) -> None:
    src, dst = full / "mooncake-fast25", out / "mooncake-fast25"
    dst.mkdir(parents=True, exist_ok=True)
    _gzip(src / "conversation_trace.jsonl", dst / "conversation_trace.jsonl.gz")
    _licence(src, dst)


def weka(full: pathlib.Path, out: pathlib.Path, folder: str = "traces") -> None:
    src, dst = full / "weka-claude-code", out / "weka-claude-code"
    (dst / folder).mkdir(parents=True, exist_ok=True)
    for f in sorted((src / folder).glob("*.json")):
        _gzip(f, dst / folder / (f.name + ".gz"))
    _licence(src, dst)


def servegen(full: pathlib.Path, out: pathlib.Path, pool: str) -> None:
    src, dst = full / "servegen" / pool, out / "servegen" / pool
    clients = load_servegen(src)
    start = busiest_span(clients, SERVEGEN_SPAN_S)
    end = start + SERVEGEN_SPAN_S
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("chunk-*"):
        old.unlink()
    for c in clients:
        windows = [w for w in c.windows if start <= w.start_s < end]
        if not any(w.rate > 0 for w in windows):
            continue
        rows = [line for line in (src / f"chunk-{c.id}-trace.csv").read_text().splitlines()
                if line and start <= float(line.split(",")[0]) < end]
        (dst / f"chunk-{c.id}-trace.csv").write_text("\n".join(rows) + "\n")
        periods = {_period(c, w.start_s) for w in windows if w.rate > 0}
        raw = json.loads((src / f"chunk-{c.id}-dataset.json").read_text())
        kept = {k: v for k, v in raw.items() if float(k) in periods}
        data = json.dumps(kept, separators=(",", ":")).encode()
        with open(dst / f"chunk-{c.id}-dataset.json.gz", "wb") as f, \
                gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:
            z.write(data)
    _licence(full / "servegen", out / "servegen")
    # the slice must replay to exactly the requests the full folder does
    full_traces = client_traces(clients, seed=0)
    sliced = client_traces(load_servegen(dst), seed=0)
    if {k: [(r.t, r.prompt_len, r.output_len) for r in v] for k, v in full_traces.items()} != \
            {k: [(r.t, r.prompt_len, r.output_len) for r in v] for k, v in sliced.items()}:
        raise SystemExit(f"servegen/{pool}: the slice does not replay as the full folder does")
    print(f"servegen/{pool}: busiest hour from {start:.0f} s, {len(sliced)} clients, "
          f"{sum(len(v) for v in sliced.values())} requests: identical to the full folder")


def _period(client, window_start: float) -> float:
    """The dataset period a window draws its sizes from (as Client.sizes_at picks it)."""
    sizes = client.sizes_at(window_start)
    return next(p for p, d in client.datasets.items() if d is sizes)


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    full = pathlib.Path(sys.argv[1])
    out = pathlib.Path(sys.argv[2]) if len(sys.argv) == 3 else REPO / "data" / "traces"
    azure(full, out)
    mooncake(full, out)
    weka(full, out)
    weka(full, out, "subagents")
    servegen(full, out, "deepseek-r1")
    servegen(full, out, "m-mid")
    servegen(full, out, "m-large")
    assert WINDOW_S == 600.0  # the slice keeps whole windows of the upstream's 600 s rows
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
