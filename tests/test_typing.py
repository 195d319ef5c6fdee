"""Typing and documentation of the installed package.

- mypy passes on the installed package (with its ``_core.pyi`` stub and ``py.typed``), every
  function fully annotated;
- mypy sees the generated functions' parameters (every ``*_backward`` and the reference's
  twins of the public functions): it rejects a misspelt keyword and accepts the right call;
- ``help()`` shows no private parameter (``_keep``, vjp's);
- the stub declares exactly the compiled module's functions, with the bindings' argument names,
  and its argument classes (``MhaArgs``, ...), with their fields;
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


@pytest.fixture(scope="module")
def mypy_tree(tmp_path_factory):
    """A copy of the package outside site-packages (mypy refuses to check a package inside its
    own search path), its config, and one cache the module's mypy runs share."""
    pytest.importorskip("mypy")
    tree = tmp_path_factory.mktemp("mypy")
    shutil.copytree(
        PKG, tree / "attnlab", ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__")
    )
    (tree / "mypy.ini").write_text(MYPY_INI)
    return tree


def _mypy(tree: Path, *targets: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(tree / "mypy.ini")]
        + ["--cache-dir", str(tree / "cache"), *targets],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def test_mypy_passes_on_installed_package(mypy_tree):
    proc = _mypy(mypy_tree, "attnlab")
    assert proc.returncode == 0, proc.stdout + proc.stderr


# The generated functions: each backward (``grad_out`` first, then its forward's parameters) and
# the reference's functions that take a public function's parameters.
GENERATED = [
    f"attnlab.{f}_backward"
    for f in (
        "scaled_dot_product_attention",
        "multi_head_attention",
        "bilinear_attention",
        "latent_attention",
        "additive_attention",
        "separable_attention",
    )
] + [
    f"attnlab.reference.{f}"
    for f in (
        "scaled_dot_product_attention",
        "multi_head_attention",
        "bilinear_attention",
        "collapse_qk",
        "factorize_qk",
        "latent_attention",
        "additive_attention",
        "separable_attention",
        "separate_logits",
    )
]


def _resolve(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _calls(dotted: str) -> tuple[str, str, str]:
    """A call with the required arguments, the same call with a parameter's name misspelt (two
    letters swapped) as a keyword, and that misspelling."""
    params = list(inspect.signature(_resolve(dotted)).parameters.values())
    args = []
    for p in params:
        if p.default is not p.empty:
            continue
        value = "1" if p.annotation == "int" else "a"
        args.append(value if p.kind is p.POSITIONAL_OR_KEYWORD else f"{p.name}={value}")
    names = {p.name for p in params}
    # an optional keyword's name if there is one (factorize_qk has none), of 4 letters or more
    by_default = sorted(params, key=lambda p: p.default is p.empty)
    word = next(p.name for p in by_default if len(p.name) > 3)
    typo = word[0] + word[2] + word[1] + word[3:]
    assert typo not in names
    right = f"{dotted}({', '.join(args)})"
    return right, f"{dotted}({', '.join([*args, f'{typo}=a'])})", typo


def test_mypy_sees_generated_parameters(mypy_tree):
    """mypy checks the keywords of every generated function against the forward's ``def``: a
    misspelt one is an error, the right call is not (as for a written-out ``def``)."""
    lines = ["import numpy as np", "import attnlab", "import attnlab.reference", ""]
    lines.append("a = np.ones((2, 3, 4))")
    expected: dict[int, str] = {}  # line number -> the misspelt keyword mypy must name
    for dotted in GENERATED:
        right, wrong, typo = _calls(dotted)
        lines.append(right)
        lines.append(wrong)
        expected[len(lines)] = typo
    (mypy_tree / "snippet.py").write_text("\n".join(lines) + "\n")
    proc = _mypy(mypy_tree, "snippet.py")
    errors: dict[int, list[str]] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"snippet\.py:(\d+): error: (.*)", line)
        if m:
            errors.setdefault(int(m.group(1)), []).append(m.group(2))
    assert set(errors) == set(expected), proc.stdout + proc.stderr
    for number, typo in expected.items():
        assert any(f'Unexpected keyword argument "{typo}"' in e for e in errors[number]), errors


def test_separate_logits_parameters_are_multi_head_attentions():
    """``reference.separate_logits`` writes out the query-key side of
    ``multi_head_attention``'s parameters: the same names, kinds, defaults and annotations."""
    mha = inspect.signature(attnlab.multi_head_attention).parameters
    for name, p in inspect.signature(attnlab.reference.separate_logits).parameters.items():
        assert name in mha, name
        q = mha[name]
        assert (p.kind, p.default, p.annotation) == (q.kind, q.default, q.annotation), name


FORWARDS_WITH_KEEP = [
    "multi_head_attention",
    "scaled_dot_product_attention",
    "bilinear_attention",
    "latent_attention",
    "additive_attention",
    "separable_attention",
]


@pytest.mark.parametrize("name", FORWARDS_WITH_KEEP)
def test_help_hides_private_parameters(name):
    import pydoc

    f = getattr(attnlab, name)
    text = pydoc.render_doc(f, renderer=pydoc.plaintext)
    assert "_keep" not in text and "_keep" not in str(inspect.signature(f))
    assert "_keep" in f.__code__.co_varnames  # still the forward's, for attnlab.vjp


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
        if name.startswith("_") or not callable(obj) or isinstance(obj, type):
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


def _stub_classes() -> dict[str, set[str]]:
    """The stub's public classes and their fields (with those of their bases in the stub)."""
    tree = ast.parse((PKG / "_core.pyi").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(node: ast.ClassDef) -> set[str]:
        own = {
            s.target.id
            for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        bases = [classes[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
        return own.union(*(fields(b) for b in bases))

    return {name: fields(node) for name, node in classes.items() if not name.startswith("_")}


def test_stub_classes_match_compiled_module():
    """The argument objects: the same classes, fields and keyword-only constructors."""
    stub = _stub_classes()
    runtime = {
        name: {f for f, v in vars(obj).items() if isinstance(v, property)}
        for name, obj in vars(core).items()
        if isinstance(obj, type) and not name.startswith("_")
    }
    assert stub and sorted(stub) == sorted(runtime)
    for name, fields in runtime.items():
        assert stub[name] == fields, f"{name}: stub {sorted(stub[name])}, module {sorted(fields)}"
        with pytest.raises(TypeError, match=f"^{name}: missing keyword argument"):
            getattr(core, name)()


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
    if "from transformers" in (fn.__doc__ or "") and any(
        importlib.util.find_spec(m) is None for m in ("transformers", "torch")
    ):
        # (transformers' modules are torch modules)
        pytest.skip("the example builds a transformers module; transformers or torch is missing")
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(fn, name, globs={}):
        runner.run(test)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} examples failed"
