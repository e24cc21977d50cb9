"""The package's layout: no import circles anywhere in `bouncer`, and the core's folders small.

An import circle is counted whatever the import is for: at the top of a module, inside a function
(a lazy import) or under `TYPE_CHECKING` (an annotation still ties the two modules together for a
reader). A module imported by a name in its package (`from bouncer.core import deadlines`) counts
as an import of that module; any other name from a package counts as an import of its
`__init__.py`, which is why the packages' `__init__.py` files hold docstrings and nothing else.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "bouncer"
CORE = PACKAGE / "core"
MOST_MODULES_PER_FOLDER = 15


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports, at any depth of its code."""
    files = {_module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import bouncer.core.x` reaches x
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
    return found


def test_the_circle_finder_finds_a_circle_through_a_lazy_and_a_type_checking_import(tmp_path):
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""A package."""\n')
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n")
    (pkg / "c.py").write_text("def f():\n    from pkg.a import A\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    global SRC
    saved, SRC = SRC, tmp_path / "src"
    try:
        graph = import_graph(pkg)
    finally:
        SRC = saved
    assert graph["pkg.d"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_bouncer_has_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (each a set of modules that import one another):\n" + "\n".join(
        " <-> ".join(part) for part in found)


def test_the_packages_init_files_only_describe_the_package():
    """An `__init__.py` that imported its modules would tie every importer of the package to them."""
    for init in PACKAGE.rglob("__init__.py"):
        body = ast.parse(init.read_text()).body
        code = [node for node in body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert not code, f"{init.relative_to(SRC)} holds code; packages here only describe their parts"


def test_no_folder_of_the_core_holds_more_than_about_15_modules():
    for folder in [CORE, *[p for p in CORE.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= MOST_MODULES_PER_FOLDER, f"{folder.relative_to(SRC)}: {len(modules)} modules"


def test_no_two_modules_share_a_name():
    """A module's name says what it holds; two of one name make every mention of it ambiguous
    (in a traceback, a doc, a review)."""
    by_name: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


MOST_LINES_PER_FUNCTION = 80


def test_no_function_is_too_long_to_hold_in_ones_head():
    long = []
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith("_pb2.py"):
            continue  # generated
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MOST_LINES_PER_FUNCTION:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({lines} lines)")
    assert long == []
