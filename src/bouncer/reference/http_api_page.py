"""The HTTP API reference, read from docs/openapi.yaml: every path and method with its summary,
parameters, request body, responses and whether it needs a key."""

from __future__ import annotations

import pathlib

import yaml

import bouncer
from bouncer.reference._markdown import anchor, code, generated_note, paragraphs, table

TITLE = "HTTP API reference"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def openapi_path() -> pathlib.Path:
    return pathlib.Path(bouncer.__file__).resolve().parents[2] / "docs" / "openapi.yaml"


def load() -> dict:
    return yaml.safe_load(openapi_path().read_text())


def operations(spec: dict) -> list[tuple[str, str, dict]]:
    """(path, METHOD, operation) in the order the description lists them."""
    return [(path, m.upper(), item[m]) for path, item in spec.get("paths", {}).items() for m in METHODS if m in item]


def _resolve(spec: dict, node: dict) -> dict:
    while isinstance(node, dict) and "$ref" in node:
        target: object = spec
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]  # type: ignore[index]
        node = target  # type: ignore[assignment]
    return node


def _ref_name(node: dict) -> str | None:
    return node["$ref"].rsplit("/", 1)[1] if isinstance(node, dict) and "$ref" in node else None


def _schema_type(spec: dict, schema: dict | None) -> str:
    if not schema:
        return ""
    name = _ref_name(schema)
    if name:
        return f"[{name}](#schema-{name.lower()})"
    if "oneOf" in schema or "anyOf" in schema:
        return " or ".join(_schema_type(spec, s) for s in schema.get("oneOf", schema.get("anyOf", [])))
    if "allOf" in schema:
        return " and ".join(_schema_type(spec, s) for s in schema["allOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_schema_type(spec, schema.get('items', {})) or 'any'}"
    return kind + (" or null" if schema.get("nullable") else "")


def _properties(spec: dict, schema: dict) -> tuple[list[tuple[str, dict]], set[str]]:
    """A schema's properties and required names, through allOf."""
    schema = _resolve(spec, schema)
    props = list((schema.get("properties") or {}).items())
    required = set(schema.get("required") or [])
    for part in schema.get("allOf", []):
        p, r = _properties(spec, part)
        props += p
        required |= r
    return props, required


def _rows(spec: dict, props: list[tuple[str, dict]], required: set[str], prefix: str = "") -> list[list[str]]:
    """A row per property, an object's own properties after it as `outer.inner`."""
    rows = []
    for name, schema in props:
        rows.append([code(prefix + name), _schema_type(spec, schema), "yes" if name in required else "no",
                     schema.get("description", "")])
        if not _ref_name(schema) and schema.get("properties"):
            inner, inner_required = _properties(spec, schema)
            rows += _rows(spec, inner, inner_required, f"{prefix}{name}.")
    return rows


def _security(spec: dict, op: dict) -> str:
    schemes = op.get("security", spec.get("security", []))
    if not schemes:
        return "No key needed."
    names = sorted({n for s in schemes for n in s})
    kinds = {n: spec.get("components", {}).get("securitySchemes", {}).get(n, {}) for n in names}
    said = [f"{k.get('scheme', n)} token" if k.get("type") == "http" else n for n, k in kinds.items()]
    return "Needs a key: `Authorization: Bearer KEY` (" + ", ".join(said) + ")."


def render() -> str:
    spec = load()
    info = spec.get("info", {})
    parts = [generated_note("docs/openapi.yaml"), "", f"# {TITLE}", "",
             paragraphs(info.get("description", "")), "",
             f"OpenAPI {spec.get('openapi', '')} description, version {info.get('version', '')}: "
             "[openapi.yaml](../openapi.yaml). The request schemas there are the ones the fuzz suite "
             "generates from (their sizes and model names are the test's, not the gateway's limits, which come "
             "from the config's `limits` and `models`).", "", "## Endpoints", ""]
    parts.append(table(["method", "path", "summary"],
                       [[code(m), f"[{code(p)}](#{_op_id(m, p)})", op.get("summary", "")]
                        for p, m, op in operations(spec)]))
    for path, method, op in operations(spec):
        parts += ["", anchor(_op_id(method, path)), "", f"### {code(method + ' ' + path)}", ""]
        text = " ".join(x for x in (op.get("summary", ""), op.get("description", "")) if x)
        if text:
            parts += [paragraphs(text), ""]
        parts.append(_security(spec, op))
        params = [_resolve(spec, p) for p in op.get("parameters", [])]
        if params:
            parts += ["", "Parameters:", "",
                      table(["name", "in", "required", "schema", "description"],
                            [[code(p["name"]), p.get("in", ""), "yes" if p.get("required") else "no",
                              _schema_type(spec, p.get("schema")), p.get("description", "")] for p in params])]
        body = op.get("requestBody")
        if body:
            body = _resolve(spec, body)
            media = [f"{code(ct)}: {_schema_type(spec, c.get('schema')) or 'any'}"
                     for ct, c in (body.get("content") or {}).items()]
            parts += ["", f"Request body ({'required' if body.get('required') else 'optional'}): "
                      + "; ".join(media) + "."]
        rows = []
        for status, resp in (op.get("responses") or {}).items():
            resp = _resolve(spec, resp)
            content = ", ".join(code(ct) + (f" ({_schema_type(spec, c['schema'])})"
                                            if _ref_name(c.get("schema") or {}) else "")
                                for ct, c in (resp.get("content") or {}).items())
            rows.append([code(status), resp.get("description", ""), content])
        parts += ["", "Responses:", "", table(["status", "description", "content"], rows)]
    schemas = spec.get("components", {}).get("schemas", {})
    if schemas:
        parts += ["", "## Schemas"]
        for name, schema in schemas.items():
            parts += ["", anchor(f"schema-{name.lower()}"), "", f"### {name}", ""]
            if schema.get("description"):
                parts += [paragraphs(schema["description"]), ""]
            composed = [_ref_name(s) for s in schema.get("allOf", []) if _ref_name(s)]
            if composed:
                parts += ["Includes " + ", ".join(f"[{n}](#schema-{n.lower()})" for n in composed) + ".", ""]
            props, required = _properties(spec, {k: v for k, v in schema.items() if k != "allOf"}
                                          | {"allOf": [s for s in schema.get("allOf", []) if not _ref_name(s)]})
            parts.append(table(["property", "type", "required", "description"], _rows(spec, props, required)))
    return "\n".join(parts).rstrip() + "\n"


def _op_id(method: str, path: str) -> str:
    return (method + path).lower().replace("/", "-").replace("{", "").replace("}", "").replace("_", "-")
