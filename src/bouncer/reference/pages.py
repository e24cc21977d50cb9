"""The reference pages: which there are, where they go, and whether they are stale."""


from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Callable

import bouncer
from bouncer.reference import cli_page, config_page, http_api_page, metrics_page

REGENERATE = "bouncer reference"


def _pages(parser: argparse.ArgumentParser) -> dict[str, Callable[[], str]]:
    return {"configuration.md": config_page.render, "metrics.md": metrics_page.render,
            "cli.md": lambda: cli_page.render(parser), "http-api.md": http_api_page.render}


PAGES = ("configuration.md", "metrics.md", "cli.md", "http-api.md")


def default_out() -> pathlib.Path:
    """docs/reference of the checkout this package runs from (src/bouncer -> the repository)."""
    return pathlib.Path(bouncer.__file__).resolve().parents[2] / "docs" / "reference"


def render_all(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {name: render() for name, render in _pages(parser).items()}


def write(parser: argparse.ArgumentParser, out: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Write every page; returns those whose text changed."""
    out = out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in render_all(parser).items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


def stale(parser: argparse.ArgumentParser, out: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The pages that are missing or differ from what the code generates now."""
    out = out or default_out()
    return [out / name for name, text in render_all(parser).items()
            if not (out / name).exists() or (out / name).read_text() != text]


def _shown(path: pathlib.Path) -> str:
    """A path as the user would type it: relative to the working directory where it is below it."""
    rel = os.path.relpath(path)
    return path.as_posix() if rel.startswith("..") else rel


def run(parser: argparse.ArgumentParser, check: bool, out: pathlib.Path | None = None) -> int:
    """`bouncer reference [--check]` (`parser`: the CLI's own, for its page): 0, or 1 with the
    stale pages named."""
    out = out or default_out()
    if check:
        bad = stale(parser, out)
        for path in bad:
            print(f"stale: {_shown(path)}")
        if bad:
            print(f"the reference differs from the code; regenerate it with `{REGENERATE}`")
            return 1
        print(f"up to date: {len(PAGES)} pages in {_shown(out)}")
        return 0
    changed = write(parser, out)
    for path in changed:
        print(f"wrote {_shown(path)}")
    print(f"{len(changed)} of {len(PAGES)} pages changed in {_shown(out)}")
    return 0
