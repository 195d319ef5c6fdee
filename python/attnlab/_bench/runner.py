"""Runs every benchmark family and prints one table (``python -m attnlab bench``)."""

from __future__ import annotations

import datetime
import importlib
import json
import platform
from dataclasses import asdict
from typing import Any

from .. import build_info, get_num_threads
from .common import Row
from .mha import gemm_peak

__all__ = ["run_all", "format_table"]

FAMILIES = ("mha", "bilinear", "additive", "backward")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_all(quick: bool, families: tuple[str, ...] = FAMILIES) -> dict[str, Any]:
    threads = get_num_threads()
    peak = gemm_peak(threads, quick)
    rows: list[Row] = []
    for fam in families:
        try:
            mod = importlib.import_module(f"attnlab._bench.{fam}")
        except ModuleNotFoundError:
            continue
        rows.extend(mod.run(quick, threads))
    info = build_info()
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_name(),
        "threads": threads,
        "isa": info.get("isa"),
        "gemm_peak_gflops": peak,
        "rows": rows,
    }


def _ratio(row: Row, rows: list[Row]) -> str:
    """How many times faster attnlab is than this row's implementation (same case)."""
    if row.baseline is None:
        return ""
    base = next((r for r in rows if r.family == row.family and r.case == row.case
                 and r.shape == row.shape and r.impl == row.baseline), None)
    if base is None or base.ms <= 0:
        return ""
    return f"{row.ms / base.ms:.2f}x"


def format_table(result: dict[str, Any]) -> str:
    rows: list[Row] = result["rows"]
    peak = result["gemm_peak_gflops"]
    lines = [
        f"attnlab bench  {result['date']}  {result['cpu']}  threads={result['threads']}  "
        f"isa={result['isa']}  GEMM peak (fp32, measured) = {peak:.1f} GFLOP/s",
        "",
        f"{'family':<9} {'case':<24} {'shape':<28} {'impl':<12} {'ms':>10} {'GFLOP/s':>8} "
        f"{'%peak':>6} {'attnlab':>8}  notes",
    ]
    for r in rows:
        gf = r.gflops
        notes = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in r.extra.items())
        lines.append(
            f"{r.family:<9} {r.case:<24.24} {r.shape:<28.28} {r.impl:<12.12} {r.ms:>10.3f} "
            f"{gf:>8.1f} {100 * gf / peak if peak and gf else 0:>5.0f}% {_ratio(r, rows):>8}  "
            f"{notes}"
        )
    lines.append("")
    lines.append("attnlab column: time of that row / time of attnlab (above 1: attnlab is faster).")
    return "\n".join(lines)


def to_json(result: dict[str, Any]) -> str:
    out = dict(result)
    out["rows"] = [asdict(r) | {"gflops": r.gflops} for r in result["rows"]]
    return json.dumps(out, indent=2)


def plot(result: dict[str, Any], path: str) -> None:
    """Time against n for every family/implementation that was timed at several n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in result["rows"]:
        n = r.extra.get("n")
        if isinstance(n, int):
            series.setdefault((r.family, r.impl), []).append((n, r.ms))
    fig, ax = plt.subplots(figsize=(7, 5))
    for (fam, impl), pts in sorted(series.items()):
        if len(pts) < 2:
            continue
        pts.sort()
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{fam} / {impl}")
    ax.set_xlabel("tokens n")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"attnlab bench {result['date']} ({result['threads']} threads)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
