"""The benchmark's table never misleads: the GEMM peak is measured until stable (or no share of
it is reported), no share above 100% is printed, and noisy timings are flagged."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnlab
from attnlab._bench import gemm, runner
from attnlab._bench.common import Row, Timing, interleaved
from attnlab._loader import core


def _result(rows: list[Row], peak: float | None, rounds: list[float] | None = None) -> dict:
    return {"date": "today", "cpu": "cpu", "threads": 2, "isa": "avx2",
            "gemm_peak_gflops": peak, "gemm_peak_rounds": rounds or [], "rows": rows,
            "targets": []}


def _shares(table: str) -> list[int]:
    return [int(s) for s in re.findall(r"\s(\d+)%\s", table)]


def test_timing_carries_its_spread():
    times = interleaved({"a": lambda: sum(range(1000))}, repeat=5)
    t = times["a"]
    assert isinstance(t, Timing) and isinstance(t, float) and t > 0
    assert t.spread >= 1.0


def test_share_is_never_above_100_percent():
    peak = 100.0
    fast = Row("gemm", "proj", "s", "attnlab", Timing(1.0), flops=2.7e8)   # 270 GFLOP/s
    ok = Row("mha", "case", "s", "attnlab", Timing(1.0), flops=0.85e8)     # 85 GFLOP/s
    assert runner.share(fast, peak) == "n/a"
    assert runner.share(ok, peak) == "85%"
    assert runner.share(ok, None) == "-"
    table = runner.format_table(_result([fast, ok], peak))
    assert _shares(table) == [85]
    assert "ABOVE PEAK" in table and "1 rows flagged" in table


def test_noisy_timings_are_flagged_on_the_row_and_the_ratio():
    calm = Row("mha", "tiny", "s", "attnlab", Timing(0.128, 1.1), flops=1e5)
    noisy = Row("mha", "tiny", "s", "torch", Timing(41.6, 3.0), flops=1e5, baseline="attnlab")
    table = runner.format_table(_result([calm, noisy], 100.0))
    line = next(x for x in table.splitlines() if " torch " in x)
    assert "325.00x!" in line and "NOISY (slowest run 3.0x the fastest)" in line
    calm_line = next(x for x in table.splitlines() if " attnlab " in x)
    assert "NOISY" not in calm_line


def test_unstable_peak_reports_no_share(monkeypatch):
    """Rates that keep moving between rounds (a busy machine) give no peak, and the table says
    so instead of printing shares of a wrong one."""
    ms = iter([10.0, 20.0, 10.0, 20.0, 10.0, 20.0])  # 215 / 107 GFLOP/s alternating (n = 1024)
    monkeypatch.setattr(gemm, "_gemm_sources", lambda n, threads: {"attnlab": None})
    monkeypatch.setattr(gemm, "interleaved", lambda fns, repeat: {"attnlab": Timing(next(ms))})
    peak, rows, rounds = gemm.gemm_peak(2, quick=True)
    assert peak is None and len(rounds) == 4
    table = runner.format_table(_result(rows, peak, rounds))
    assert "GEMM peak not stable (rounds: 214.7, 107.4, 214.7, 107.4 GFLOP/s)" in table
    assert _shares(table) == []


def test_stable_peak_stops_early(monkeypatch):
    ms = iter([20.0, 10.0, 10.2, 99.0])
    monkeypatch.setattr(gemm, "_gemm_sources", lambda n, threads: {"attnlab": None})
    monkeypatch.setattr(gemm, "interleaved", lambda fns, repeat: {"attnlab": Timing(next(ms))})
    peak, rows, rounds = gemm.gemm_peak(2, quick=True)
    assert len(rounds) == 3 and peak == pytest.approx(2 * 1024**3 / 10e-3 / 1e9)
    assert rows[0].ms == 10.0  # the best round's time


def test_quick_gemm_bench_end_to_end():
    """``python -m attnlab bench --quick --only gemm`` runs and prints no share above 100%."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(attnlab.__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "attnlab", "bench", "--quick", "--only", "gemm"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "GEMM peak" in res.stdout
    assert all(s <= 100 for s in _shares(res.stdout)), res.stdout


def test_fma_peak_kernel_structure():
    """The FMA peak kernel of the variant in use: a finite positive rate for the whole machine and
    one per pool thread (its size against sgemm is the bench's check, not a unit test's)."""
    total, per_thread = core.fma_peak(0.02)
    assert math.isfinite(total) and total > 0
    assert len(per_thread) == attnlab.get_num_threads()
    assert all(math.isfinite(r) and r > 0 for r in per_thread)
    for bad in (0, -1.0, float("nan"), float("inf"), 61):
        with pytest.raises(ValueError, match="seconds"):
            core.fma_peak(bad)
