"""The metrics reference, read from the code that defines the collectors: every metric family
constructed in src/bouncer/gateway/metrics.py (the gateway's /metrics) and in
src/bouncer/engine_server.py (`bouncer engine`'s, vLLM's names), with its type, labels and help.

Most of the gateway's families are built inside a collector's `collect()` at scrape time, some
only when a feature is configured (shared state, outside pressure), so a registry emptied of
traffic would not list them all, nor their labels; the constructors in the source do, each
with literal name, help and label names. tests/test_reference.py checks the page against what
a running gateway's /metrics serves."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import bouncer
from bouncer.reference._markdown import code, generated_note, paragraphs, table

TITLE = "Metrics reference"
SOURCES = {"gateway": "gateway/metrics.py", "engine": "engine_server.py"}

_KINDS = {"CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge", "HistogramMetricFamily": "histogram",
          "SummaryMetricFamily": "summary", "InfoMetricFamily": "info", "Counter": "counter", "Gauge": "gauge",
          "Histogram": "histogram", "Summary": "summary", "Info": "info"}
# prometheus_client's own metrics take label names third, its MetricFamily classes as `labels=`
_LABEL_ARG = {"Counter": 2, "Gauge": 2, "Histogram": 2, "Summary": 2, "Info": 2}


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    group: str  # the class that defines it

    @property
    def series(self) -> tuple[str, ...]:
        """The names its samples carry in Prometheus' text format."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind in ("histogram", "summary"):
            return tuple(f"{self.name}_{s}" for s in (("bucket", "sum", "count") if self.kind == "histogram"
                                                      else ("sum", "count")))
        return (self.name,)


def _source(which: str) -> str:
    return (pathlib.Path(bouncer.__file__).parent / SOURCES[which]).read_text()


def _strings(node: ast.AST, names: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Label names from a literal list, a name bound to one, or `[*name, "more"]`."""
    if isinstance(node, ast.Name):
        return names.get(node.id, ())
    if isinstance(node, ast.List | ast.Tuple):
        out: list[str] = []
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                out += _strings(elt.value, names)
            elif isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                out.append(elt.value)
        return tuple(out)
    return ()


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.metrics: list[Metric] = []
        self.groups: dict[str, str] = {}  # class -> its docstring
        self._class = ""
        self._names: dict[str, tuple[str, ...]] = {}
        self._wrappers: dict[str, tuple[str, tuple[str, ...]]] = {}  # helper(name, doc, ...) -> kind, labels

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer, self._class = self._class, node.name
        self.groups.setdefault(node.name, ast.get_docstring(node) or "")
        self.generic_visit(node)
        self._class = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        # a local helper whose first two parameters go to a constructor as its name and help
        params = [a.arg for a in node.args.args]
        for call in ast.walk(node):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in _KINDS
                    and len(params) >= 2 and len(call.args) >= 2
                    and all(isinstance(a, ast.Name) for a in call.args[:2])
                    and [a.id for a in call.args[:2]] == params[:2]):
                self._wrappers[node.name] = (_KINDS[call.func.id], self._labels(call, call.func.id))
                return
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            labels = _strings(node.value, self._names)
            if labels and isinstance(node.value, ast.List | ast.Tuple):
                self._names[node.targets[0].id] = labels
        self.generic_visit(node)

    def _labels(self, call: ast.Call, ctor: str) -> tuple[str, ...]:
        for kw in call.keywords:
            if kw.arg in ("labels", "labelnames"):
                return _strings(kw.value, self._names)
        i = _LABEL_ARG.get(ctor)
        return _strings(call.args[i], self._names) if i is not None and len(call.args) > i else ()

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        args = node.args
        if name and len(args) >= 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                           for a in args[:2]):
            if name in _KINDS:
                self.metrics.append(Metric(args[0].value, _KINDS[name], self._labels(node, name), args[1].value,
                                           self._class))
            elif name in self._wrappers:
                kind, labels = self._wrappers[name]
                self.metrics.append(Metric(args[0].value, kind, labels, args[1].value, self._class))
        self.generic_visit(node)


def metrics(which: str = "gateway") -> list[Metric]:
    """The metric families `which` ("gateway" or "engine") defines, in source order."""
    return _find(which).metrics


def _find(which: str) -> _Finder:
    finder = _Finder()
    finder.visit(ast.parse(_source(which)))
    return finder


def _table(ms: list[Metric]) -> str:
    def kind(m: Metric) -> str:
        suffixes = [s[len(m.name):] for s in m.series if s != m.name]
        return m.kind + (f" ({', '.join(code(x) for x in suffixes)})" if suffixes else "")

    return table(["metric", "type", "labels", "help"],
                 [[code(m.name), kind(m), ", ".join(code(lb) for lb in m.labels), m.help] for m in ms])


def _section(finder: _Finder, level: str) -> list[str]:
    parts: list[str] = []
    groups: dict[str, list[Metric]] = {}
    for m in finder.metrics:
        groups.setdefault(m.group, []).append(m)
    for group, ms in groups.items():
        doc = paragraphs(finder.groups.get(group, ""))
        parts += ["", f"{level} {doc.split('. ')[0].rstrip('.') if doc else group}", ""]
        rest = doc.split(". ", 1)[1] if ". " in doc else ""
        if rest:
            parts += [rest, ""]
        parts.append(_table(ms))
    return parts


def render() -> str:
    gateway_doc = ast.get_docstring(ast.parse(_source("gateway"))) or ""
    parts = [generated_note("the collectors in src/bouncer/gateway/metrics.py and src/bouncer/engine_server.py"),
             "", f"# {TITLE}", "", paragraphs(gateway_doc.split("\n", 1)[1] if "\n" in gateway_doc else ""), "",
             "Every metric family the gateway's `GET /metrics` serves (Prometheus text format; `access."
             "metrics_keys_sha256` may require a key). A counter's samples end in `_total`, a histogram's in "
             "`_bucket`, `_sum` and `_count`; both also carry a `_created` series (prometheus_client's start "
             "time of each). A family with labels has samples once a value with them exists (a tenant's first "
             "request, a replica's first scrape); the pressure families appear only with `pressure` "
             "configured, the shared-state ones only with `shared_state`.",
             "", "## The gateway (`bouncer serve`)"]
    parts += _section(_find("gateway"), "###")
    engine_doc = paragraphs(_find("engine").groups.get("_EngineCollector", ""))
    parts += ["", "## The simulated engine (`bouncer engine`)", "",
              "`bouncer engine` serves a subset of vLLM's metrics under vLLM's names, the ones the gateway "
              "scrapes (model_name and engine labels as vLLM sets them). " + engine_doc]
    finder = _find("engine")
    parts += ["", _table(finder.metrics)]
    return "\n".join(parts).rstrip() + "\n"
