"""Check that a server counts prompt tokens exactly as Bouncer's tokenizer does.

    .venv/bin/python scripts/fidelity/check_tokens.py --base-url http://127.0.0.1:18200 --model tiny

For a few chat conversations it renders the prompt as Bouncer does
(<s>{role}\\n{content}</s>\\n ... <s>assistant\\n), counts it with
tokenizers.Tokenizer.from_file(src/bouncer/data/tokenizer.json).encode(text).ids, and compares with
usage.prompt_tokens of (a) /v1/chat/completions with the messages and (b) /v1/completions with the
rendered text, plus vLLM's /tokenize when the server has it. Exit status 1 on any mismatch
(for example a BOS token added by the server).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import urllib.error
import urllib.request

from tokenizers import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
CASES = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "def f(x):\n    return x + 1\n"}],
    [{"role": "user", "content": "h\u00e9llo \u00fcn\u00efcode \u2713 \u65e5\u672c"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "  spaces  and\ttabs "}],
]


def render(messages: list[dict]) -> str:
    return "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in messages) + "<s>assistant\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    a = ap.parse_args()
    base = a.base_url.rstrip("/")
    tok = Tokenizer.from_file(str(REPO / "src/bouncer/data/tokenizer.json"))

    def post(path: str, body: dict) -> dict | None:
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            if path == "/tokenize" and e.code == 404:
                return None
            raise

    bad = 0
    prompts = [render(m) for m in CASES] + ["plain text prompt, no special tokens"]
    for i, text in enumerate(prompts):
        ids = tok.encode(text).ids
        row = {"local": len(ids)}
        row["completion_usage"] = post("/v1/completions", {"model": a.model, "prompt": text,
                                                           "max_tokens": 1})["usage"]["prompt_tokens"]
        if i < len(CASES):
            row["chat_usage"] = post("/v1/chat/completions", {"model": a.model, "messages": CASES[i],
                                                              "max_tokens": 1})["usage"]["prompt_tokens"]
            t = post("/tokenize", {"model": a.model, "messages": CASES[i], "add_generation_prompt": True})
            if t is not None:
                row["tokenize_chat_ids_equal"] = t["tokens"] == ids
        t = post("/tokenize", {"model": a.model, "prompt": text})
        if t is not None:
            row["tokenize_prompt_ids_equal"] = t["tokens"] == ids
        ok = all(v == len(ids) for k, v in row.items() if k.endswith("usage")) and all(
            v for k, v in row.items() if k.endswith("equal"))
        bad += not ok
        print(("OK  " if ok else "BAD ") + json.dumps(row))
    print("all prompt-token counts agree" if not bad else f"{bad} mismatching case(s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
