"""The traces the repository carries, and the loaders' gzip handling."""

from __future__ import annotations

import gzip
import json
import os
import pathlib

import pytest

from bouncer.sim import scenarios
from bouncer.sim.traces import load_trace, load_weka, trace_file

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_every_default_trace_is_inside_the_checkout_with_its_licence():
    assert not os.environ.get("BOUNCER_TRACES_DIR"), "unset it to test the repository's own slices"
    traces = REPO / "data" / "traces"
    for path in (scenarios.AZURE_CONV, scenarios.AZURE_CODE, scenarios.MOONCAKE_CONV, scenarios.WEKA_SESSIONS,
                 scenarios.SERVEGEN_DEEPSEEK_R1):
        path = path.resolve()
        assert path.exists() and path.is_relative_to(traces), path
        folders = [p for p in path.parents if p.is_relative_to(traces) and p != traces]
        assert any(list(p.glob("LICENSE*")) for p in folders), f"no licence beside {path}"


def test_the_slices_hold_what_the_readme_says():
    assert len(load_trace(scenarios.AZURE_CONV)) == 19_366
    assert len(load_trace(scenarios.AZURE_CODE)) == 8_819
    mooncake = load_trace(scenarios.MOONCAKE_CONV)  # gzipped
    assert len(mooncake) == 12_031 and all(r.block_digests for r in mooncake[:100])
    assert len(load_weka(scenarios.WEKA_SESSIONS)) == 61


def test_a_name_finds_its_gzipped_file_and_both_load_alike(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
            {"timestamp": 3000, "input_length": 600, "output_length": 4, "hash_ids": [1, 3]}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    plain = tmp_path / "plain" / "t.jsonl"
    plain.parent.mkdir()
    plain.write_text(text)
    packed = tmp_path / "packed" / "t.jsonl"
    packed.parent.mkdir()
    with gzip.open(packed.with_name("t.jsonl.gz"), "wt") as f:
        f.write(text)
    assert trace_file(packed) == packed.with_name("t.jsonl.gz")
    assert trace_file(plain) == plain
    a, b = load_trace(plain), load_trace(packed)
    assert [(r.t, r.prompt_len, r.block_digests) for r in a] == [(r.t, r.prompt_len, r.block_digests) for r in b]


def test_a_folder_of_sessions_may_mix_plain_and_gzipped_files(tmp_path):
    session = {"id": "s", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": 100, "out": 5,
                                                           "hash_ids": [1, 2], "think_time": 0}]}
    (tmp_path / "a.json").write_text(json.dumps({**session, "id": "a"}))
    with gzip.open(tmp_path / "b.json.gz", "wt") as f:
        json.dump({**session, "id": "b"}, f)
    assert [s.name for s in load_weka(tmp_path)] == ["a", "b"]
    (tmp_path / "c.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a WEKA agent session trace"):
        load_weka(tmp_path)
