"""The package's structure: no import cycle among the modules of python/attnlab.

Edges are the intra-package imports a module runs when it is imported: those at module level
(including under ``if``/``try`` at module level), not those inside functions or classes' methods
and not those under ``if TYPE_CHECKING:``. Importing ``attnlab.a.b`` also imports the package
``attnlab.a``, but only as its parent: that implicit edge is left out (every module would
otherwise close a cycle through ``attnlab/__init__.py``, which imports them all).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "attnlab"


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package and every compiled module
    (named by its .pyi stub: attnlab._core, which imports nothing of the package)."""
    out = {}
    for path in sorted(package.rglob("*.pyi")) + sorted(package.rglob("*.py")):  # .py wins
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run at import time: module level, through if/try/with blocks, not under
    ``if TYPE_CHECKING:`` and not inside function or class bodies."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    walk(block)
                for handler in node.handlers:
                    walk(handler.body)
            elif isinstance(node, ast.With):
                walk(node.body)

    walk(tree.body)
    return found


def _targets(
    name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: set[str]
) -> set[str]:
    """The package's modules an import statement in module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    if isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
        return {b for b in bases if b in modules}
    if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]
        base_parts = here[: len(here) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            out.add(sub)  # a submodule
        elif base in modules:
            out.add(base)  # a name defined in the module (or package) itself
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at import time."""
    files = _modules(package)
    names = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        if path.suffix == ".pyi":
            graph[name] = edges
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _module_level_imports(tree):
            edges |= _targets(name, path, node, names)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "attnlab" in graph and "attnlab._core" in graph and "attnlab.interop" in graph
    assert "attnlab._validate" in graph["attnlab._mha"]  # from . import _validate as V
    assert "attnlab._memory" in graph["attnlab._validate"]  # from ._memory import copy, ...
    assert "attnlab._core" in graph["attnlab._loader"]  # the compiled module
    assert "attnlab.interop._transformers" in graph["attnlab.interop"]  # a package's submodule
    assert "attnlab._mha" not in graph["attnlab._rope"]  # under if TYPE_CHECKING:


def test_a_cycle_is_found_and_deferred_imports_are_not_edges(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "from . import b\n\ndef f():\n    from . import c\n",
        "b.py": "import pkg.sub\n",
        "c.py": "from .a import f\n",  # a -> c only inside a function: no cycle
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "sub/__init__.py": "try:\n    from ..a import f\nexcept ImportError:\n    pass\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub"},
        "pkg.c": {"pkg.a"},
        "pkg.d": set(),
        "pkg.sub": {"pkg.a"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_package_s_modules() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles among python/attnlab modules: {found}"
