"""What ``python -m attnlab bench`` prints by default: a header (CPU, instruction set, threads,
FMA peak), one compact table per family (attnlab's time, GFLOP/s, share of peak and error against
the float64 reference, beside torch and the NumPy reference), one plain sentence when the machine
was busy, and what to try next. Noise flags, the GEMM rows and the project's targets are
``--verbose`` (every row, as :func:`attnlab._bench.runner.format_table` prints them) and
``--targets``."""

from __future__ import annotations

import textwrap
from typing import Any

from .common import NOISY, Row
from .latent import summary_tables
from .runner import format_table, share, table, target_lines

__all__ = ["format_report", "NEXT", "TITLES"]

WIDTH = 100  # prose lines are wrapped to this many characters

NEXT = (
    "Next: --peers (other runtimes), --plot PATH (time against n), --json PATH, --verbose "
    "(every row)"
)

TITLES = {
    "mha": "Multi-head attention, forward (torch: nn.MultiheadAttention; long: F.linear + SDPA)",
    "bilinear": "Bilinear attention: query-key weights collapsed per head, against separate heads",
    "additive": "Additive (SwiftFormer) and separable (MobileViT-v2) attention, forward",
    "backward": "Gradients: a training step is the forward and every gradient (torch: autograd)",
    "latent": "Latent attention (DeepSeek's MLA): absorbed against expanded, and latent_cost",
}

_LEGEND = (
    "ms: median time; %peak: share of the FMA peak; error: normwise difference from the float64 "
    "NumPy reference (gradients: torch in float64); speedup: its ms / attnlab's (above 1: "
    "attnlab is faster)."
)


def _ms(v: float) -> str:
    """A time in milliseconds to about four significant digits."""
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if v >= 10 else (f"{v:.2f}" if v >= 1 else f"{v:.3f}")


def _err(row: Row | None) -> str:
    e = None if row is None else row.extra.get("error")
    return f"{e:.1e}" if isinstance(e, float) else "-"


def _speedup(other: Row | None, ours: Row) -> str:
    if other is None or ours.ms <= 0:
        return "-"
    v = other.ms / ours.ms
    return f"{v:.0f}x" if v >= 100 else f"{v:.2f}x"


def _gflops(row: Row) -> str:
    return f"{row.gflops:.1f}" if row.gflops else "-"


def _label(case: str) -> str:
    """A case's label without what the table's title says (forward, float32)."""
    for tail in (" fwd fp32", " step fp32", " fp32"):
        if case.endswith(tail):
            return case[: -len(tail)]
    return case


def _versus(
    rows: list[Row],
    peak: float | None,
    families: tuple[str, ...],
    parts: tuple[tuple[str, str, tuple[str, ...]], ...],
) -> list[str]:
    """attnlab against torch and the NumPy reference: one line per case, shape and part
    (``parts``: attnlab's impl, the suffix of its label, and torch's impls of the same thing)."""
    ours = [r for r in rows if r.family in families]

    def find(like: Row, impls: tuple[str, ...]) -> Row | None:
        return next(
            (r for r in ours if r.case == like.case and r.shape == like.shape and r.impl in impls),
            None,
        )

    body = []
    for r in ours:
        for impl, suffix, torch_impls in parts:
            if r.impl != impl:
                continue
            t, ref = find(r, torch_impls), find(r, ("reference",))
            body.append(
                [
                    _label(r.case) + suffix,
                    r.shape,
                    _ms(r.ms),
                    _gflops(r),
                    share(r, peak),
                    _err(r),
                    "-" if t is None else _ms(t.ms),
                    _speedup(t, r),
                    _err(t),
                    "-" if ref is None else _ms(ref.ms),
                    _speedup(ref, r),
                ]
            )
    if not body:
        return []
    head = ["case", "shape", "attnlab ms", "GFLOP/s", "%peak", "error"]
    head += [" torch ms", "speedup", "error", " NumPy ms", "speedup"]
    # a comparison no line has (torch not installed, no reference timed) is left out
    groups = {6: (6, 7, 8), 9: (9, 10)}  # the torch ms / NumPy ms column: its group's columns
    drop = {c for k, cols in groups.items() if all(ln[k] == "-" for ln in body) for c in cols}
    keep = [i for i in range(len(head)) if i not in drop]
    return table([head[i] for i in keep], [[line[i] for i in keep] for line in body], 2)


def _bilinear(rows: list[Row], peak: float | None) -> list[str]:
    """One line per grid point: both forms' times, the form attnlab's plan picks, and that
    form's GFLOP/s, share of peak and error."""
    fam = [r for r in rows if r.family == "bilinear"]
    body = []
    for r in fam:
        if r.impl != "collapsed":
            continue
        sep = next((s for s in fam if s.shape == r.shape and s.impl == "separate"), None)
        plan = str(r.extra.get("plan", "collapsed"))
        picked = sep if plan == "separate" and sep is not None else r
        body.append(
            [
                r.shape,
                "-" if sep is None else _ms(sep.ms),
                _ms(r.ms),
                plan,
                _gflops(picked),
                share(picked, peak),
                _err(picked),
            ]
        )
    if not body:
        return []
    head = ["shape", "separate ms", "collapsed ms", "plan picks", "GFLOP/s", "%peak", "error"]
    return table(head, body, 1)


def _latent(rows: list[Row]) -> list[str]:
    """The latent family's tables (left out of ``--quick``, which keeps to one screen)."""
    return [ln for t, h, b in summary_tables(rows) for ln in ["  " + t, *table(h, b, 0)]]


def _slopes(rows: list[Row]) -> list[str]:
    """The growth exponents of the additive family's sweep, as one sentence."""
    names = {
        "SwiftFormer fwd fp32": "SwiftFormer",
        "MobileViTv2 fwd fp32": "MobileViT-v2",
        "MHA fwd fp32 (contrast)": "multi-head, for contrast",
    }
    parts = [
        f"n^{r.extra['slope']:.2f} ({names.get(r.case, r.case)})"
        for r in rows
        if r.family in ("additive", "separable")
        and r.impl in ("attnlab", "attnlab-mha")
        and isinstance(r.extra.get("slope"), float)
    ]
    if not parts:
        return []
    text = "Time grows as " + ", ".join(parts) + "."
    return textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="  ")


def _busy(result: dict[str, Any]) -> list[str]:
    """One plain sentence when timings varied or beat the measured peak; nothing otherwise."""
    rows: list[Row] = result["rows"]
    peak = result.get("peak_gflops")
    noisy = any(getattr(r.ms, "spread", 1.0) >= NOISY for r in rows)
    sg = result.get("sgemm")
    low = any(share(r, peak) == "n/a" for r in rows) or bool(
        sg and peak and sg.get("gflops", 0) > peak
    )
    if low:
        text = (
            "Timings varied and the FMA peak was measured low (n/a: above 100%): the CPU was busy."
        )
    elif noisy:
        text = (
            "Timings varied between runs (the CPU was busy): run again on a quiet machine "
            "before quoting them."
        )
    else:
        return []
    return textwrap.wrap(text, WIDTH)


def format_report(result: dict[str, Any], *, verbose: bool = False, targets: bool = False) -> str:
    """The default output of ``python -m attnlab bench``.

    Parameters
    ----------
    result : dict
        What :func:`attnlab._bench.runner.run_all` returns.
    verbose : bool
        Also print every row as :func:`attnlab._bench.runner.format_table` does: noise flags, the
        GEMM rows and the FMA peak's check, every implementation, and the project's targets.
    targets : bool
        Also print the project's performance targets, checked on this run.

    Returns
    -------
    str
        The lines to print; the last says what to try next.
    """
    rows: list[Row] = result["rows"]
    peak = result.get("peak_gflops")
    version = result.get("version")
    quick = " --quick" if result.get("quick") else ""
    lines = [
        f"attnlab{' ' + version if version else ''} bench{quick}, {result['date']}, float32",
        (
            f"CPU: {result['cpu']}; instruction set in use: {result['isa']}; "
            f"{result['threads']} threads; FMA peak {peak or 0:.1f} GFLOP/s"
        ),
    ]
    torch = ("torch", "torch-sdpa")
    grads = (("attnlab step", " step", ("torch step",)), ("attnlab pullback", " pullback", ()))
    sections = [
        ("mha", _versus(rows, peak, ("mha",), (("attnlab", "", torch),))),
        ("bilinear", _bilinear(rows, peak)),
        (
            "additive",
            _versus(rows, peak, ("additive", "separable"), (("attnlab", "", torch),))
            + _slopes(rows),
        ),
        ("backward", _versus(rows, peak, ("backward",), grads)),
        ("latent", [] if result.get("quick") else _latent(rows)),
    ]
    shown = [(fam, body) for fam, body in sections if body]
    for fam, body in shown:
        lines += ["", TITLES[fam], *body]
    lines.append("")
    if shown:
        lines += textwrap.wrap(_LEGEND, WIDTH)
    elif rows:
        lines.append("The GEMM rows are diagnostics of the kernels: --verbose prints them.")
    lines += _busy(result)
    if targets and not verbose:
        lines += [*target_lines(result.get("targets") or [], 62), ""]
    if verbose:
        lines += ["", "Every row (--verbose):", "", format_table(result), ""]
    lines.append(NEXT)
    return "\n".join(lines)
