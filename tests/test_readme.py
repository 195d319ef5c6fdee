"""Every ```python block of README.md runs, and shows what it says it shows.

Each block runs top to bottom in a fresh namespace, one top-level statement at a time. A
statement whose last line ends in a comment that states a result (a *claim*) is checked:

- ``expr  # (2, 197, 384) float32`` or ``name = expr  # ...``: the value, rendered as
  ``repr`` (an array as ``"<shape> <dtype>"``, a NumPy scalar as the Python number; ``print``
  as what it printed), must match the comment token by token: words and punctuation exactly,
  each number to the precision it is written with (``0.031`` means 0.0305 <= x < 0.0315,
  ``3e-07`` means 2.5e-07 .. 3.5e-07, integers exactly). The comment may stop early (``(2, 197,
  384)`` for an array says nothing about its dtype).
- ``expr  # < 1e-5``: the value is a number below the bound.

A comment is a claim when it starts with a digit, ``-``, ``(``, ``[`` or ``<`` and holds a
number; others (``# (in, out) weights``) are prose. A bare expression whose value is shown
(anything but None) must carry a claim: a README line that displays a number nobody checked is
how a wrong one got there. Blocks that import torch are skipped without it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import tokenize
from pathlib import Path
from typing import Any

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of every ```python block."""
    blocks, lines, start, inside = [], text.splitlines(), 0, False
    for i, line in enumerate(lines, 1):
        if not inside and line.strip() == "```python":
            inside, start, body = True, i + 1, []
        elif inside and line.strip() == "```":
            inside = False
            blocks.append((start, "\n".join(body) + "\n"))
        elif inside:
            body.append(line)
    return blocks


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment text on it (without ``#``)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:].strip()
    return out


def is_claim(comment: str) -> bool:
    return bool(comment) and comment[0] in "0123456789-([<" and bool(_NUMBER.search(comment))


def render(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.shape} {value.dtype}"
    if isinstance(value, np.generic):
        value = value.item()
    return repr(value)


def _tokens(text: str) -> list[str]:
    """Numbers and the text between them (whitespace-normalised), in order."""
    out, pos = [], 0
    for m in _NUMBER.finditer(text):
        gap = " ".join(text[pos : m.start()].split())
        if gap:
            out.append(gap)
        out.append(m.group())
        pos = m.end()
    tail = " ".join(text[pos:].split())
    return out + ([tail] if tail else [])


def _half_unit(written: str) -> float:
    """Half a unit in the last place of a number as written: 0.031 -> 5e-4, 3e-07 -> 5e-08."""
    mantissa, _, exp = written.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exp or 0) - decimals)


def matches(shown: str, claim: str) -> bool:
    """Whether ``shown`` (a rendered value) agrees with ``claim`` (a README comment)."""
    claim = claim.strip()
    if claim.startswith("<"):
        try:
            return float(shown) < float(claim[1:])
        except ValueError:
            return False
    want, got = _tokens(claim), _tokens(shown)
    if len(got) < len(want):
        return False
    for w, g in zip(want, got, strict=False):  # got may run on past the claim
        if _NUMBER.fullmatch(w):
            if not _NUMBER.fullmatch(g):
                return False
            exact = not any(c in w for c in ".eE")
            if (exact and float(g) != float(w)) or abs(float(g) - float(w)) > _half_unit(w) * (
                1 + 1e-9
            ):
                return False
        # a claim may stop inside the shown text's last word group ("(2, 197, 384)")
        elif w != g and not (w == want[-1] and g.startswith(w)):
            return False
    return True


def _imports_torch(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        )
        mod = node.module if isinstance(node, ast.ImportFrom) else None
        if any(n.split(".")[0] == "torch" for n in names) or (mod or "").split(".")[0] == "torch":
            return True
    return False


def run_block(source: str) -> list[tuple[int, str, str]]:
    """Run ``source``; return ``(line, shown, claim)`` for every claim checked. Raises
    AssertionError for a claim that does not hold or a shown value without a claim."""
    tree = ast.parse(source)
    comments = _comments(source)
    ns: dict[str, Any] = {"__name__": "__readme__"}
    checked = []
    for stmt in tree.body:
        line = stmt.end_lineno or stmt.lineno
        claim = comments.get(line, "")
        buf = io.StringIO()
        value: Any = None
        with contextlib.redirect_stdout(buf):
            if isinstance(stmt, ast.Expr):
                value = eval(compile(ast.Expression(stmt.value), "<README>", "eval"), ns)
            else:
                exec(compile(ast.Module([stmt], []), "<README>", "exec"), ns)
        printed = buf.getvalue().strip()
        is_print = (
            isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name)
            and stmt.value.func.id == "print"
        )
        if isinstance(stmt, ast.Expr):
            shown = printed if is_print else (None if value is None else render(value))
        elif (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            shown = render(ns[stmt.targets[0].id]) if is_claim(claim) else None
        else:
            shown = None
        if shown is None:
            continue
        assert is_claim(claim), (
            f"README line {line}: shows {shown!r} with no comment saying what it should be"
        )
        assert matches(shown, claim), (
            f"README line {line}: shows {shown!r}, the comment says {claim!r}"
        )
        checked.append((line, shown, claim))
    return checked


BLOCKS = python_blocks(README.read_text())


@pytest.mark.parametrize("start, source", BLOCKS, ids=[f"line{s}" for s, _ in BLOCKS])
def test_readme_block(start: int, source: str) -> None:
    if _imports_torch(ast.parse(source)) and importlib.util.find_spec("torch") is None:
        pytest.skip(f"README.md line {start}: the block imports torch, which is not installed")
    try:
        checked = run_block(source)
    except AssertionError as exc:
        raise AssertionError(
            f"README.md block at line {start}: {exc}".replace("README line ", "line +")
        ) from None
    assert checked or "print(" not in source, f"README.md line {start}: no claim was checked"


def test_readme_has_the_promised_blocks() -> None:
    """The Quick start and the training example are there, and make claims."""
    text = README.read_text()
    assert "## Quick start" in text and "## Train a layer" in text
    claims = sum(is_claim(c) for _, src in BLOCKS for c in _comments(src).values())
    assert claims >= 8, claims


@pytest.mark.parametrize(
    "shown, claim, ok",
    [
        ("(2, 197, 384) float32", "(2, 197, 384) float32", True),
        ("(2, 197, 384) float32", "(2, 197, 384)", True),
        ("(2, 197, 384) float64", "(2, 197, 384) float32", False),
        ("(2, 197, 385) float32", "(2, 197, 384)", False),
        ("1.2026", "< 1e-5", False),
        ("1.19e-07", "< 1e-5", True),
        ("test loss 0.0312", "test loss 0.031", True),
        ("test loss 0.0316", "test loss 0.031", False),
        ("2.9e-07", "3e-07", True),
        ("3.6e-07", "3e-07", False),
        ("0.5", "0.50", True),
        ("0.506", "0.50", False),
        ("(1, 6)", "(1, 6, 1)", False),
    ],
)
def test_claim_matcher(shown: str, claim: str, ok: bool) -> None:
    assert matches(shown, claim) is ok


def test_a_shown_value_needs_a_claim() -> None:
    with pytest.raises(AssertionError, match="no comment"):
        run_block("x = 1.5\nx * 2\n")
    with pytest.raises(AssertionError, match="the comment says"):
        run_block("x = 1.5\nx * 2          # 3.1\n")
    assert run_block("x = 1.5\nx * 2          # 3.0\nprint(x)  # 1.5\n") == [
        (2, "3.0", "3.0"),
        (3, "1.5", "1.5"),
    ]
