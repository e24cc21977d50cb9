"""The configuration reference, read from the pydantic models in bouncer/config.py: one section
per model in the order the YAML file nests them, a row per field with its type, default, bounds
and description (the description is the field's own, written once in the model)."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from bouncer import config as config_module
from bouncer.config import BouncerConfig
from bouncer.reference._markdown import anchor, code, generated_note, paragraphs, table

TITLE = "Configuration reference"


def sections(model: type[BaseModel] = BouncerConfig, path: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted path, model) of every model in the file, depth first in field order."""
    yield path, model
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None:
            sub = f"{path}.{name}" if path else name
            yield from sections(nested[0], sub + "[]" * nested[1])


def fields() -> Iterator[tuple[str, type[BaseModel], str, object]]:
    """(full dotted path, model, field name, FieldInfo) of every field of every model."""
    for path, model in sections():
        for name, field in model.model_fields.items():
            yield (f"{path}.{name}" if path else name), model, name, field


def _nested_model(annotation: object) -> tuple[type[BaseModel], int] | None:
    """The model a field holds (directly, optionally, or as list items) and how many lists deep."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, 0
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        found = [n for n in (_nested_model(a) for a in args) if n is not None]
        return found[0] if found else None
    if origin is list:
        inner = _nested_model(args[0])
        return (inner[0], inner[1] + 1) if inner else None
    return None


def _slug(path: str) -> str:
    return path.replace("[]", "").replace(".", "-").replace("_", "-") or "top-level"


def _section_of(model: type[BaseModel]) -> str:
    return next(p for p, m in sections() if m is model)


def render_type(annotation: object) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_slug(_section_of(annotation))})"
    if isinstance(annotation, type):
        return annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(code(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(render_type(a) for a in args)
    if origin is list:
        return f"list of {render_type(args[0])}"
    if origin is dict:
        return f"map of {render_type(args[0])} to {render_type(args[1])}"
    return code(annotation)


def _yaml_scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value and value.strip() == value and value[0] not in "{[\"'&*!|>%@`#" else json.dumps(value)
    return json.dumps(value)


def render_default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        changed = value.model_dump(mode="json", exclude_defaults=True)
        return code(json.dumps(changed, separators=(", ", ": ")) if changed else "{}")
    if isinstance(value, list | dict):
        return code(json.dumps(value, separators=(", ", ": ")))
    return code(_yaml_scalar(value))


def render_bounds(field) -> str:
    is_str = field.annotation is str or str in typing.get_args(field.annotation)
    out = []
    for m in field.metadata:
        if isinstance(m, annotated_types.Gt):
            out.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Ge):
            out.append(f"≥ {m.ge}")
        elif isinstance(m, annotated_types.Lt):
            out.append(f"< {m.lt}")
        elif isinstance(m, annotated_types.Le):
            out.append(f"≤ {m.le}")
        elif isinstance(m, annotated_types.MinLen):
            if is_str:
                out.append("not empty" if m.min_length == 1 else f"at least {m.min_length} characters")
            else:
                out.append(f"at least {m.min_length} item" + ("s" if m.min_length != 1 else ""))
        elif isinstance(m, annotated_types.MaxLen):
            out.append(f"at most {m.max_length}")
        elif getattr(m, "pattern", None):
            out.append("matches " + code(m.pattern))
    return ", ".join(out)


def render() -> str:
    module_doc = (config_module.__doc__ or "").split("\n", 1)
    parts = [generated_note("the pydantic models in src/bouncer/config.py"), "", f"# {TITLE}", "",
             paragraphs(module_doc[1] if len(module_doc) > 1 else ""), "",
             "Every setting of the YAML file `bouncer serve --config` reads, one table per part of the file, "
             "in the order the file nests them. A path such as `tenants[].slo.ttft_s` is the field `ttft_s` of "
             "the `slo` of each entry of the `tenants` list. Defaults and bounds are the model's own; `bouncer "
             "config example` prints a commented example and `bouncer config check FILE` validates one.", ""]
    parts.append("Sections: " + ", ".join(f"[{code(p or 'top level')}](#{_slug(p)})" for p, _ in sections()) + ".")
    for path, model in sections():
        parts += ["", anchor(_slug(path)), "", f"## {code(path) if path else 'Top level'}", ""]
        doc = model.__doc__ if model.__doc__ and model.__doc__ is not BaseModel.__doc__ else ""
        intro = paragraphs(doc)
        parts += [f"Model `{model.__name__}`." + (" " + intro if intro else ""), ""]
        rows = []
        for name, field in model.model_fields.items():
            full = f"{path}.{name}" if path else name
            rows.append([code(full), render_type(field.annotation), render_default(field), render_bounds(field),
                         field.description or ""])
        parts.append(table(["setting", "type", "default", "bounds", "description"], rows))
    return "\n".join(parts).rstrip() + "\n"
