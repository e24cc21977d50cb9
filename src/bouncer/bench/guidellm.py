"""Driving guidellm (the vLLM project's load generator, PyPI `guidellm`) against a gateway.

guidellm runs as its own process from its own virtualenv (it brings torch and transformers), so
it is a client Bouncer did not write. It needs a Hugging Face tokenizer to size its synthetic
prompts; with no hub to download one from, `tokenizer_dir` writes Bouncer's bundled tokenizer as
a local `PreTrainedTokenizerFast` folder, so guidellm and the gateway count tokens alike.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
from dataclasses import dataclass

from bouncer.tokenizer import default_tokenizer_path

TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                    "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 8192}


def tokenizer_dir(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(default_tokenizer_path(), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return folder


@dataclass(frozen=True)
class GuidellmRun:
    successful: int
    errored: int
    incomplete: int
    seconds: float
    report: pathlib.Path

    @property
    def total(self) -> int:
        return self.successful + self.errored + self.incomplete


def run(guidellm: str | pathlib.Path, target: str, model: str, api_key: str, rate: float, seconds: float,
        prompt_tokens: int, output_tokens: int, workdir: pathlib.Path, timeout_s: float | None = None) -> GuidellmRun:
    """One constant-rate guidellm run of synthetic prompts against `target`, bounded in time."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "guidellm.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": target, "model": model, "request_format": "/v1/completions",
                    "api_key": api_key, "validate_backend": False, "http2": False, "timeout": 60.0},
        "profile": {"kind": "constant", "rate": rate},
        "tokenizer": {"kind": "hf_auto", "model": str(tokenizer_dir(workdir / "tokenizer"))},
        "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
        "constraints": [{"kind": "max_duration", "seconds": seconds}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}
    (workdir / "scenario.json").write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    # it runs in `workdir`: a relative path to it (`make test`'s default) is the caller's
    proc = subprocess.run([os.path.abspath(guidellm), "run", "--scenario", str(workdir / "scenario.json"),
                           "--disable-console"], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout_s or seconds + 180)
    if proc.returncode != 0 or not report.is_file():
        raise RuntimeError(f"guidellm failed ({proc.returncode}): {proc.stderr[-2000:]}")
    bench = json.loads(report.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    return GuidellmRun(totals["successful"], totals["errored"], totals["incomplete"], float(bench["duration"]), report)


@dataclass(frozen=True)
class GuidellmRequest:
    """One request as guidellm saw it, in its clock (seconds since the epoch)."""

    targeted_start: float  # when its rate said to send it
    first_token: float | None
    end: float | None
    output_tokens: int
    status: str  # successful | errored | incomplete


def requests(report: pathlib.Path) -> list[GuidellmRequest]:
    """Every request of a run's report, whatever became of it."""
    bench = json.loads(report.read_text())["benchmarks"][0]
    out = []
    for status, reqs in bench["requests"].items():
        if status == "total":
            continue
        for r in reqs:
            t = r["info"]["timings"]
            out.append(GuidellmRequest(t["targeted_start"], t.get("first_token_iteration"),
                                       t.get("last_token_iteration") or t.get("request_end"),
                                       r.get("output_tokens") or 0, status))
    return out
