"""The CLI reference, read from the argparse parser in bouncer/cli.py (`build_parser()`): every
command and subcommand with its usage line and a row per option."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from bouncer.reference._markdown import code, generated_note, table

TITLE = "CLI reference"


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """(command path, help, parser) of every command, depth first in the order they are added;
    `parser` is `bouncer.cli.build_parser()` (handed in: the CLI imports this page's module)."""
    if not path:
        yield (), parser.description or "", parser
    sub = _subparsers(parser)
    if sub is None:
        return
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, child in sub.choices.items():
        yield (*path, name), helps.get(name, ""), child
        yield from commands(child, (*path, name))


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)  # the same lines whatever the terminal
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="usage: ")
    return formatter.format_help().strip()


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(action.metavar or action.dest)
    metavar = ""
    if action.nargs != 0:
        metavar = action.metavar or (action.dest.upper() if not action.choices else "")
        if isinstance(metavar, tuple):
            metavar = " ".join(metavar)
    return ", ".join(code(f"{o} {metavar}".strip()) for o in action.option_strings)


def _value(action: argparse.Action) -> str:
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "one of " + ", ".join(code(c) for c in action.choices)
    if action.nargs == 0:
        return "flag"
    # a builtin type by name; a parsing function's format is its metavar's (e.g. PORT,PORT)
    t = action.type.__name__ if isinstance(action.type, type) else "str"
    if action.nargs in ("+", "*"):
        t = f"one or more {t}" if action.nargs == "+" else f"any number of {t}"
    return t


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    d = action.default
    if d is None or d is argparse.SUPPRESS or (action.nargs == 0 and d is False):
        return ""
    if isinstance(d, list):
        return code(" ".join(map(str, d))) if d else ""
    if d is True:
        return "on"
    return code(d)


def _help(action: argparse.Action) -> str:
    if not action.help:
        return ""
    text = action.help
    if "%" in text:
        text = text % {**vars(action), "prog": "bouncer",
                       "default": action.default, "choices": ", ".join(map(str, action.choices or []))}
    return text


def render(parser: argparse.ArgumentParser) -> str:
    parts = [generated_note("the argparse parser in src/bouncer/cli.py"), "", f"# {TITLE}", "",
             "Every `bouncer` command (installed with the package; `python -m bouncer` is the same), its usage "
             "and its options, as `bouncer COMMAND --help` prints them. A command with subcommands runs one of "
             "them."]
    for path, help_text, command in commands(parser):
        name = " ".join(("bouncer", *path))
        level = "#" * min(2 + max(len(path) - 1, 0), 4)
        if path:
            parts += ["", f"{level} {code(name)}"]
        if help_text and path:
            parts += ["", help_text[0].upper() + help_text[1:] + ("" if help_text.endswith(".") else ".")]
        parts += ["", "```text", _usage(command), "```"]
        sub = _subparsers(command)
        if sub is not None:
            rows = [[code(" ".join((name, a.dest))), a.help or ""] for a in sub._choices_actions]
            parts += ["", table(["command", "what it does"], rows)]
        rows = [[_flags(a), _value(a), _default(a), _help(a)] for a in command._actions
                if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]
        if rows:
            parts += ["", table(["argument", "value", "default", "description"], rows)]
    return "\n".join(parts).rstrip() + "\n"
