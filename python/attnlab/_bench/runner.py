"""Runs every benchmark family (``python -m attnlab bench``): the full table of every row
(``--verbose``; the default output is :mod:`attnlab._bench.report`'s), the targets, the JSON and
the plot."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import platform
from dataclasses import asdict
from functools import partial
from typing import Any

from .. import build_info, get_num_threads
from .additive import growth_exponent
from .backward import CASES as BACKWARD_CASES
from .backward import training_targets
from .common import NOISY, Row, Timing, target
from .gemm import square_gemm
from .latent import targets as latent_targets
from .peak import fma_peak, sgemm_gflops
from .progress import Progress

__all__ = ["run_all", "format_table", "targets", "to_json", "from_json", "plot"]

FAMILIES = ("gemm", "mha", "bilinear", "additive", "backward", "latent", "window", "dask")


def _cpu_name() -> str:
    """The CPU's model name and, in brackets, its kind (``build_info()["cpu"]``): "AMD EPYC"
    names Zen 3, 4 and 5 alike."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} [{build_info()['cpu']}]"


def run_all(
    quick: bool, families: tuple[str, ...] = FAMILIES, show_progress: bool = False
) -> dict[str, Any]:
    threads = get_num_threads()
    progress = Progress(len(families) + 1, show_progress)
    progress.step("FMA peak")
    peak = fma_peak(quick)
    progress.finish(f"{peak['gflops']:.0f} GFLOP/s")
    sgemm = sgemm_gflops(threads, quick) if "gemm" in families else None
    rows: list[Row] = []
    for fam in families:
        progress.step(fam)
        new = square_gemm(threads, quick, sgemm) if fam == "gemm" else []
        with contextlib.suppress(ModuleNotFoundError):
            new += importlib.import_module(f"attnlab._bench.{fam}").run(quick, threads)
        progress.finish(f"{len(new)} rows")
        rows.extend(new)
    info = build_info()
    result = {
        "version": info.get("version"),
        "quick": quick,
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_name(),
        "threads": threads,
        "isa": info.get("isa"),
        "peak": peak,
        "peak_gflops": peak["gflops"],
        "sgemm": sgemm,
        "rows": rows,
    }
    result["targets"] = targets(result)
    return result


def _find(
    rows: list[Row], family: str, case: str, impl: str, shape: str | None = None
) -> Row | None:
    """The row of that family, case and implementation (the last of them when shape is None,
    i.e. the largest n of a sweep)."""
    hits = [
        r
        for r in rows
        if r.family == family
        and r.case == case
        and r.impl == impl
        and (shape is None or r.shape == shape)
    ]
    return hits[-1] if hits else None


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The performance targets, checked on this run: one entry per target whose rows were measured,
    with the measured value, the target and whether it is met."""
    rows: list[Row] = result["rows"]
    peak = result["peak_gflops"]
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, goal: str, met: bool) -> None:
        out.append(target(name, value, goal, met))

    def speedup(family: str, case: str, other: str) -> tuple[float, Row] | None:
        a, b = _find(rows, family, case, "attnlab"), _find(rows, family, case, other)
        if a is None or b is None:
            return None
        b = _find(rows, family, case, other, a.shape) or b
        return b.ms / a.ms, a

    for case in ("window fwd fp32", "window bwd fp32"):  # linear in n at a fixed window
        sweep = [r for r in rows if r.family == "window" and r.case == case]
        if len(sweep) >= 2:
            grow = sweep[-1].extra["us_per_token"] / sweep[0].extra["us_per_token"]
            add(
                f"{case}: time per token at n = {sweep[-1].extra['n']} / at n = "
                f"{sweep[0].extra['n']}",
                grow,
                "<= 1.5 (linear in n)",
                grow <= 1.5,
            )
    for case, label in (
        ("ViT-S fwd fp32", "MHA fwd ViT-S vs torch MHA"),
        ("ViT-B fwd fp32", "MHA fwd ViT-B vs torch MHA"),
    ):
        r = speedup("mha", case, "torch")
        if r:
            add(label, r[0], ">= 1.2x", r[0] >= 1.2)
    for case, label in (("long fwd fp32", "long"), ("long causal fwd fp32", "long causal")):
        r = speedup("mha", case, "torch-sdpa")
        if r:
            add(f"MHA {label} ({r[1].shape}) vs torch SDPA", r[0], ">= 1.2x", r[0] >= 1.2)
            mib = r[1].extra.get("peak_extra_mib")
            if isinstance(mib, float):
                add(f"MHA {label} ({r[1].shape}) extra memory (MiB)", mib, "< 128", mib < 128)
    for case, _B, _n, _d, _h, _c in BACKWARD_CASES:  # the training-step targets
        out += training_targets(case, partial(_find, rows, "backward", case))
    for case, label in (
        ("SwiftFormer fwd fp32", "additive (SwiftFormer)"),
        ("MobileViTv2 fwd fp32", "separable (MobileViT-v2)"),
    ):
        fam = "additive" if case.startswith("Swift") else "separable"
        r = speedup(fam, case, "torch")
        if r:
            add(f"{label} {r[1].shape} vs torch eager", r[0], ">= 1.5x", r[0] >= 1.5)
        r = speedup(fam, case, "torch.compile")
        if r:
            add(f"{label} {r[1].shape} vs torch.compile", r[0], "> 1.0x", r[0] > 1.0)
    out += latent_targets(rows)
    plans = [p for p in rows if p.family == "bilinear" and "plan_within_10pct" in p.extra]
    if plans:
        hit = sum(bool(p.extra["plan_within_10pct"]) for p in plans)
        add(
            f"bilinear auto plan within 10% ({hit}/{len(plans)} points)",
            hit / len(plans),
            "all",
            hit == len(plans),
        )
    for row in rows:
        if row.family == "gemm" and row.case.startswith("proj") and row.impl == "attnlab" and peak:
            share = row.gflops / peak
            if share <= 1.0:  # above the peak, the peak was timed on a busy machine
                add(
                    f"projection GEMM {row.shape} share of FMA peak",
                    share,
                    ">= 0.75",
                    share >= 0.75,
                )
    return out


def _ratio(row: Row, rows: list[Row]) -> str:
    """How many times faster attnlab is than this row's implementation (same case); "!" when
    either timing is noisy (see :func:`_noisy`)."""
    if row.baseline is None:
        return ""
    base = next(
        (
            r
            for r in rows
            if r.family == row.family
            and r.case == row.case
            and r.shape == row.shape
            and r.impl == row.baseline
        ),
        None,
    )
    if base is None or base.ms <= 0:
        return ""
    return f"{row.ms / base.ms:.2f}x" + ("!" if _noisy(row) or _noisy(base) else "")


def _noisy(row: Row) -> bool:
    """Whether the row's slowest timed run took NOISY times its fastest: the machine was busy
    during it, and its median may be an outlier."""
    return getattr(row.ms, "spread", 1.0) >= NOISY


def share(row: Row, peak: float | None) -> str:
    """The row's GFLOP/s as a share of the FMA peak, never above 100%: "-" without a peak or a
    FLOP count, "n/a" when the row ran faster than the measured peak (then the peak was timed
    while other processes took the cores, or it is wrong); "-" for a row of bf16 products
    (``extra["precision"]``: they run on AMX tiles or VDPBF16PS, not against that peak)."""
    if not peak or not row.gflops or row.extra.get("precision") == "bf16":
        return "-"
    s = row.gflops / peak
    return "n/a" if s > 1.0 else f"{100 * s:.0f}%"


def format_table(result: dict[str, Any]) -> str:
    from .peers import best_other, peak_lines

    rows: list[Row] = result["rows"]
    peak = result["peak_gflops"]
    lines = [
        (
            f"attnlab bench  {result['date']}  {result['cpu']}  threads={result['threads']}  "
            f"isa={result['isa']}"
        ),
        *peak_lines(result),
        "",
        (
            f"{'family':<9} {'case':<24} {'shape':<28} {'impl':<13} {'ms':>10} {'GFLOP/s':>8} "
            f"{'%peak':>6} {'attnlab':>8} {'vs best':>8}  notes"
        ),
    ]
    flagged = 0
    for r in rows:
        gf = r.gflops
        notes = " ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items()
        )
        pk = share(r, peak)
        if _noisy(r) or pk == "n/a":
            flagged += 1
            spread = getattr(r.ms, "spread", 1.0)  # a Timing (float subclass) carries it
            noisy = f"NOISY (slowest run {spread:.1f}x the fastest) " if _noisy(r) else ""
            notes = noisy + ("ABOVE PEAK " if pk == "n/a" else "") + notes
        b = best_other(r, rows)
        lines.append(
            f"{r.family:<9} {r.case:<24.24} {r.shape:<28.28} {r.impl:<13.13} {r.ms:>10.3f} "
            f"{gf:>8.1f} {pk:>6} {_ratio(r, rows):>8} {f'{b[0]:.2f}x' if b else '':>8}  {notes}"
        )
    lines.append("")
    lines.append(
        "attnlab column: time of that row / time of attnlab (above 1: attnlab is faster). "
        "vs best: the fastest other runtime's time / this row's (above 1: this row is "
        "the fastest)."
    )
    if flagged:
        lines.append(
            f"{flagged} rows flagged: NOISY = the slowest of its timed runs took "
            f"{NOISY}x the fastest or more (a busy machine; '!' on the ratios it "
            f"enters); ABOVE PEAK = faster than the measured FMA peak. Run again on "
            f"a quiet machine before quoting them."
        )
    return "\n".join(lines + target_lines(result.get("targets") or [], 62))


def table(head: list[str], body: list[list[str]], left: int) -> list[str]:
    """Rows under a header, indented by two: the first ``left`` columns left-aligned, the others
    right-aligned, each as wide as its widest cell."""
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        out = [
            f"{c:<{w}}" if i < left else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return ("  " + " ".join(out)).rstrip()

    return [line(head)] + [line(r) for r in body]


def target_lines(
    targets: list[dict[str, Any]], width: int, title: str = "Targets, this run:"
) -> list[str]:
    """The "Targets, this run" section (empty without targets): the names in a column at least
    ``width`` wide, as wide as the longest (a name cut short may lose the runtime it names);
    values to four significant digits (1.004 against a goal of 1.0 is not "1"); a target's
    ``note``, when it has one, after its goal."""
    if not targets:
        return []
    width = max(width, *(len(t["target"]) for t in targets))
    return ["", title] + [
        f"  {'met ' if t['met'] else 'MISS'}  {t['target']:<{width}} "
        f"{t['value']:>8.4g}  (goal {t['goal']})" + (f"  {t['note']}" if t.get("note") else "")
        for t in targets
    ]


def to_json(result: dict[str, Any]) -> str:
    out = dict(result)
    out["rows"] = [
        asdict(r) | {"gflops": r.gflops, "spread": getattr(r.ms, "spread", None)}
        for r in result["rows"]
    ]
    return json.dumps(out, indent=2)


def from_json(text: str) -> dict[str, Any]:
    """A result written by :func:`to_json`, its rows as :class:`Row` again (their times as
    :class:`Timing` with the spread), ready for the formatters and :func:`plot`."""
    result: dict[str, Any] = json.loads(text)
    rows = []
    for r in result["rows"]:
        spread = r.get("spread")
        fields = {k: v for k, v in r.items() if k not in ("gflops", "spread")}
        fields["ms"] = Timing(fields["ms"], 1.0 if spread is None else spread)
        rows.append(Row(**fields))
    result["rows"] = rows
    return result


# the plot's panels: families drawn together
_PANELS = {
    "mha": "multi-head attention, long sequences",
    "additive": "additive and separable (MHA for contrast)",
    "separable": "additive and separable (MHA for contrast)",
    "bilinear": "bilinear: separate against collapsed",
}


def plot(result: dict[str, Any], path: str) -> bool:
    """Time against n, log-log, one panel per family, for every case and implementation timed
    at two n or more; each line's label carries its slope (the growth exponent of time in n:
    the row's own fit where the family made one, else the fit over every point drawn).
    Returns whether it wrote ``path`` (False: no family was timed at two n)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    Key = tuple[str, str, str]  # (case, the shape without n, impl)
    panels: dict[str, dict[Key, list[Row]]] = {}
    for r in result["rows"]:
        if isinstance(r.extra.get("n"), int):
            rest = " ".join(t for t in r.shape.split() if not t.startswith("n="))
            title = _PANELS.get(r.family, r.family)
            panels.setdefault(title, {}).setdefault((r.case, rest, r.impl), []).append(r)
    panels = {
        t: {k: v for k, v in s.items() if len(v) >= 2}
        for t, s in panels.items()
        if any(len(v) >= 2 for v in s.values())
    }
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    colors: dict[str, str] = {}
    for ax, (title, series) in zip(axes[0], panels.items(), strict=True):
        cases = sorted({k[0] for k in series})
        shapes = {k[1] for k in series}
        for (case, rest, impl), unsorted in sorted(series.items()):
            pts = sorted(unsorted, key=lambda r: r.extra["n"])
            ns, ms = [r.extra["n"] for r in pts], [float(r.ms) for r in pts]
            slope = pts[-1].extra.get("slope")
            if not isinstance(slope, float):
                slope = growth_exponent(ns, ms, min(ns))
            color = colors.setdefault(impl, f"C{len(colors) % 10}")
            style = ("-", "--", ":", "-.")[cases.index(case) % 4]
            label = f"{impl}, {case.replace(' fwd fp32', '')}"
            label += f" {rest}" if len(shapes) > 1 else ""
            ax.loglog(ns, ms, style, marker="o", ms=3, color=color, label=f"{label}: {slope:.2f}")
            ax.annotate(
                f"{slope:.2f}",
                (ns[-1], ms[-1]),
                xytext=(4, -3),
                textcoords="offset points",
                fontsize=7,
                color=color,
            )
        ticks = sorted({r.extra["n"] for pts in series.values() for r in pts})
        ax.set_xticks(ticks, [str(n) for n in ticks], fontsize=7)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("tokens n")
        ax.set_ylabel("time (ms)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, title="implementation, case: slope", title_fontsize=6)
    fig.suptitle(
        f"attnlab {result.get('version') or ''} bench{' --quick' if result.get('quick') else ''}"
        f", {result['date']}: {result['cpu']}, {result['isa']}, {result['threads']} threads "
        "(float32; slope: time ~ n^slope)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
