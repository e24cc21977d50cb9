"""Write deploy/kubernetes/base/prometheusrule.yaml: the alert rules of
deploy/prometheus/bouncer-alerts.yaml as the Prometheus Operator's PrometheusRule.

    python scripts/prometheus_rule.py          # rewrite it
    python scripts/prometheus_rule.py --check  # exit 1 if it differs (tests/test_kubernetes.py)
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy/prometheus/bouncer-alerts.yaml"
OUT = ROOT / "deploy/kubernetes/base/prometheusrule.yaml"
HEADER = ("# Prometheus Operator: Bouncer's alert rules (deploy/prometheus/bouncer-alerts.yaml, which\n"
          "# docs/operations/dashboards-and-alerts.md explains). Written by scripts/prometheus_rule.py:\n"
          "# edit the rules there and rerun it.\n")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the rules' expressions) as literal blocks, as they are written."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                              style="|" if "\n" in s else None))


def render() -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "bouncer"},
           "spec": {"groups": groups}}
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what it would write")
    text = render()
    if parser.parse_args().check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/prometheus_rule.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
