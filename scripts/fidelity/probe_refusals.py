"""Probe how a server refuses requests beyond its queue limit (e.g. vLLM --max-num-queued-reqs).

    .venv/bin/python scripts/fidelity/probe_refusals.py --base-url http://127.0.0.1:18201 --model tiny --n 48

Sends --n requests at once (prompt --prompt-tokens tokens, max_tokens --max-tokens), half streaming
and half not, and prints, per kind, how many were accepted and how each refusal looked: HTTP
status, Retry-After header, and for a streaming HTTP 200 whether the first event was an error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import pathlib
import sys

import aiohttp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from calibrate import Prompts  # noqa: E402


async def one(session, base, model, prompt, max_tokens, streaming) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": streaming}
    async with session.post(f"{base}/v1/completions", json=body) as r:
        rec = {"stream": streaming, "status": r.status, "retry_after": r.headers.get("Retry-After")}
        text = await r.text()
    if r.status != 200:
        rec["kind"] = f"HTTP {r.status}"
        rec["body"] = text[:200]
    elif streaming:
        events = [line[5:].strip() for line in text.split("\n") if line.startswith("data:")]
        first = json.loads(events[0]) if events and events[0] != "[DONE]" else {}
        err = next((json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)), None)
        rec["kind"] = ("200 + error event first" if "error" in first else
                       "200 + error event later" if err else "200 ok")
        rec["body"] = json.dumps(err)[:200] if err else None
    else:
        rec["kind"] = "200 ok" if "choices" in json.loads(text) else "200 other"
    return rec


async def main_async(a) -> list[dict]:
    prompts = Prompts(None)
    texts = [prompts.make(a.prompt_tokens) for _ in range(a.n)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)) as s:
        return await asyncio.gather(*(one(s, a.base_url.rstrip("/"), a.model, t, a.max_tokens, i % 2 == 0)
                                      for i, t in enumerate(texts)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", help="optional JSON file for the per-request records")
    a = ap.parse_args()
    recs = asyncio.run(main_async(a))
    for streaming in (True, False):
        c = collections.Counter((r["kind"], r["retry_after"]) for r in recs if r["stream"] == streaming)
        print(f"{'streaming' if streaming else 'non-streaming'}: " +
              ", ".join(f"{k} (Retry-After {ra}) x{n}" for (k, ra), n in sorted(c.items())))
    for kind in sorted({r["kind"] for r in recs if r["kind"] != "200 ok"}):
        ex = next(r for r in recs if r["kind"] == kind)
        print(f"  example {kind}: {ex['body']}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
