"""Markdown pieces the reference pages share: cells that cannot break a table, code spans that
may hold a pipe, and the line that says a page is generated."""

from __future__ import annotations

import html


def generated_note(what: str) -> str:
    return (f"<!-- Generated from {what} by `bouncer reference`: do not edit by hand; "
            "`bouncer reference --check` (run by the tests) fails when this page is stale. -->")


def code(text: object) -> str:
    """An inline code span. A pipe inside one would split a table's cell in some renderers and
    show its escape in others, so those spans are HTML with the pipe as an entity."""
    text = str(text)
    if "|" in text or "`" in text:
        return "<code>" + html.escape(text, quote=False).replace("|", "&#124;") + "</code>"
    return f"`{text}`"


def cell(text: object) -> str:
    """Text for a table cell: one line, pipes escaped (code spans made by `code` hold none)."""
    return " ".join(str(text).split()).replace("|", "\\|") if text not in (None, "") else "—"


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def paragraphs(doc: str | None) -> str:
    """A docstring as Markdown paragraphs: its wrapped lines joined, blank lines kept."""
    if not doc:
        return ""
    import inspect

    blocks = [" ".join(b.split()) for b in inspect.cleandoc(doc).split("\n\n")]
    return "\n\n".join(b for b in blocks if b)


def anchor(name: str) -> str:
    return f'<a id="{name}"></a>'
