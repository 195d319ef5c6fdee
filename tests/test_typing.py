"""Typing and documentation of the installed package.

- mypy passes on the installed package (with its ``_core.pyi`` stub and ``py.typed``), every
  function fully annotated;
- the stub declares exactly the compiled module's functions, with the bindings' argument names;
- every public function of attnlab, attnlab.interop, .diagnostics, .init, .reference, .layers,
  .optim and .torch, and every public method of their public classes, has a NumPy-style
  docstring with "Parameters" (when it takes arguments), "Returns" (when it returns something)
  and "Examples" sections, and the examples run.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import attnlab
from attnlab._loader import core

PKG = Path(attnlab.__file__).parent

# torch's own annotations are large (about 35 s more to analyse); attnlab.torch is checked
# against them in development, and here against torch as Any.
MYPY_INI = """\
[mypy]
ignore_missing_imports = True
disallow_untyped_defs = True
disallow_incomplete_defs = True
check_untyped_defs = True
warn_redundant_casts = True

[mypy-torch.*]
follow_imports = skip
"""


def test_package_ships_stub_and_marker():
    assert (PKG / "py.typed").is_file()
    assert (PKG / "_core.pyi").is_file()


def test_mypy_passes_on_installed_package(tmp_path):
    pytest.importorskip("mypy")
    # A copy outside site-packages: mypy refuses to check a package inside its own search path.
    shutil.copytree(
        PKG, tmp_path / "attnlab", ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__")
    )
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(tmp_path / "mypy.ini"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "attnlab",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _stub_functions() -> dict[str, list[str]]:
    tree = ast.parse((PKG / "_core.pyi").read_text())
    return {
        node.name: [a.arg for a in node.args.args]
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }


def _runtime_functions() -> dict[str, list[str]]:
    out = {}
    for name in dir(core):
        obj = getattr(core, name)
        if name.startswith("_") or not callable(obj):
            continue
        first = (obj.__doc__ or "").splitlines()[0]  # pybind11: "name(a: T, b: U) -> R"
        m = re.fullmatch(rf"{name}\((.*)\) -> .*", first)
        assert m, f"{name}: unexpected signature line {first!r}"
        out[name] = re.findall(r"(?:^|, )(\w+):", m.group(1))
    return out


def test_stub_matches_compiled_module():
    stub, runtime = _stub_functions(), _runtime_functions()
    assert sorted(stub) == sorted(runtime)
    for name, args in runtime.items():
        assert stub[name] == args, f"{name}: stub {stub[name]}, module {args}"
    text = (PKG / "_core.pyi").read_text()
    assert "__version__: str" in text and "ISA: str" in text
    # and the compiled module really has them, as the stub says
    assert isinstance(getattr(core, "__version__", None), str)
    assert isinstance(getattr(core, "ISA", None), str)


DOC_MODULES = [
    "attnlab",
    "attnlab.interop",
    "attnlab.diagnostics",
    "attnlab.init",
    "attnlab.reference",
    "attnlab.layers",
    "attnlab.optim",
    "attnlab.torch",
]


def _public_functions():
    """Public functions (``__all__``) and the public methods of public classes."""
    done: set = set()
    for modname in DOC_MODULES:
        if modname == "attnlab.torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                continue
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                yield f"{modname}.{name}", obj
            elif inspect.isclass(obj):
                # own and inherited methods, from attnlab's classes only (not tuple, object)
                seen = set()
                for klass in obj.__mro__:
                    if not klass.__module__.startswith("attnlab"):
                        continue
                    for attr, member in vars(klass).items():
                        if attr.startswith("_") or attr in seen:
                            continue
                        seen.add(attr)
                        fn = (
                            member.__func__
                            if isinstance(member, (staticmethod, classmethod))
                            else member
                        )
                        if inspect.isfunction(fn) and fn not in done:
                            done.add(fn)  # a base-class method is checked once
                            yield f"{modname}.{name}.{attr}", fn


def _sections(doc: str) -> set[str]:
    heading = r"^[ \t]*([A-Z]\w*(?: \w+)*)[ \t]*\n[ \t]*-{3,}[ \t]*$"  # a NumPy-style section
    return set(re.findall(heading, doc, re.MULTILINE))


PUBLIC = list(_public_functions())


@pytest.mark.parametrize("name, fn", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_numpy_docstring(name, fn):
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{name}: no docstring"
    found = _sections(doc)
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters if p not in ("self", "cls")]
    missing = []
    if params:
        missing += [] if "Parameters" in found else ["Parameters"]
    if sig.return_annotation not in (None, "None", inspect.Signature.empty):
        missing += [] if "Returns" in found or "Yields" in found else ["Returns"]
    missing += [] if "Examples" in found else ["Examples"]
    assert not missing, f"{name}: no {', '.join(repr(m) for m in missing)} section"


@pytest.mark.parametrize("name, fn", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_docstring_examples_run(name, fn):
    """The "Examples" of every checked function run and print what they show."""
    if (
        "from transformers" in (fn.__doc__ or "")
        and importlib.util.find_spec("transformers") is None
    ):
        pytest.skip("the example builds a transformers module; transformers is not installed")
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(fn, name, globs={}):
        runner.run(test)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} examples failed"
