"""Config validation: clear messages naming the bad field; the example is valid."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from bouncer.config import EXAMPLE_CONFIG, ConfigError, key_digest, load_config, parse_config
from core_helpers import make_config, tenant


def test_example_config_is_valid_once_keys_are_filled_in(tmp_path):
    text = EXAMPLE_CONFIG.replace("<sha256 of the tenant's API key>", key_digest("k1")) \
        .replace("<sha256 of another key>", key_digest("k2"))
    path = tmp_path / "bouncer.yaml"
    path.write_text(text)
    config = load_config(path)
    assert [t.name for t in config.tenants] == ["interactive", "batch"]
    assert config.policy.band_ceilings == {10: 1.2}
    # kv_cache_gb is turned into blocks with the GQA geometry: 52e9 / (131072 x 16)
    from bouncer.core.admission import AdmissionCore
    core = AdmissionCore(config, 0.0)
    assert core.replicas["llama-3.1-8b/1"].configured_blocks == 24795


@pytest.mark.parametrize("mutate,needle", [
    (lambda c: c["tenants"][0].update(priority="high"), "tenants.0.priority"),
    (lambda c: c["tenants"][0].update(api_keys_sha256=["plaintext-key"]), "tenants.0.api_keys_sha256"),
    (lambda c: c["tenants"][0].update(max_tokens_default=9000, max_tokens_cap=100), "max_tokens_default"),
    (lambda c: c["models"][0]["backends"][0].update(url="127.0.0.1:9000"), "models.0.backends.0.url"),
    (lambda c: c["policy"].update(kv_busy_threshold=0.5, kv_resume_threshold=0.9), "kv_resume_threshold"),
    (lambda c: c["policy"].update(fairness="lottery"), "policy.fairness"),
    (lambda c: c.update(tenants=[tenant("a"), tenant("a")]), "tenant names must be unique"),
    (lambda c: c["tenants"][0].update(models=["nope"]), "unknown model 'nope'"),
    (lambda c: c["tenants"][0].update(surprise=1), "tenants.0.surprise"),
])
def test_errors_name_the_bad_field(mutate, needle):
    cfg = make_config()
    cfg["policy"] = {}
    mutate(cfg)
    with pytest.raises(ConfigError) as excinfo:
        parse_config(cfg, "test.yaml")
    assert needle in str(excinfo.value)


def test_cli_config_check_and_example(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tenants": [], "models": []}))
    proc = subprocess.run([sys.executable, "-m", "bouncer", "config", "check", str(bad)], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "tenants" in proc.stderr and "bad.yaml" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bouncer", "config", "example"], capture_output=True, text=True)
    assert proc.returncode == 0 and "tenants:" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "bouncer", "config", "hash-key", "abc"], capture_output=True,
                          text=True)
    assert proc.stdout.strip() == key_digest("abc")
