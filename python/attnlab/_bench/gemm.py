"""GEMMs: the machine's float32 GEMM peak (the reference for every "%peak" column) and the
projection GEMMs of MHA against torch."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._loader import core
from .common import Row, interleaved, try_torch

__all__ = ["run", "gemm_peak"]


def _gemm_sources(n: int, threads: int) -> dict[str, Any]:
    """Square float32 GEMMs of size n by every implementation at hand: attnlab's projection
    kernel, NumPy's BLAS and torch.mm (same thread count)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n), dtype=np.float32)
    w = rng.standard_normal((n, n), dtype=np.float32)
    y = np.empty((n, n), dtype=np.float32)
    fns: dict[str, Any] = {"attnlab": lambda: core.linear_forward(x, w, None, y),
                           "numpy-blas": lambda: np.matmul(x, w, out=y)}
    torch = try_torch(threads)
    if torch is not None:
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        fns["torch"] = lambda: torch.mm(tx, tw)
    return fns


STABLE = 0.05  # two rounds whose best GFLOP/s agree within 5% make a peak


def gemm_peak(threads: int, quick: bool) -> tuple[float | None, list[Row], list[float]]:
    """The machine's float32 GEMM peak in GFLOP/s, all threads: the fastest of attnlab's
    projection kernel, NumPy's BLAS and torch.mm on a square GEMM.

    Timed in rounds until two consecutive rounds' best rates agree within 5% (a busy machine
    gives a peak that drifts from round to round); if they never do, within the rounds
    allowed, the peak is None and no share of it is reported. Returns the peak, one row per
    source (the round with the best rate), and every round's best rate.
    (NumPy's BLAS may use its own thread count; it still measures what the machine can do.)"""
    n = 1024 if quick else 2048
    flops = 2.0 * n**3
    fns = _gemm_sources(n, threads)
    best: dict[str, Any] = {}
    rounds: list[float] = []
    stable = False
    for _ in range(4 if quick else 6):
        times = interleaved(fns, repeat=3 if quick else 5)
        for impl, ms in times.items():
            if impl not in best or ms < best[impl]:
                best[impl] = ms
        rounds.append(max(flops / (ms * 1e-3) / 1e9 for ms in times.values()))
        if len(rounds) >= 2 and abs(rounds[-1] - rounds[-2]) <= STABLE * max(rounds[-2:]):
            stable = True
            break
    rows = [Row("gemm", "square GEMM fp32 (peak)", f"n={n}", impl, ms, flops,
                baseline=None if impl == "attnlab" else "attnlab") for impl, ms in best.items()]
    return (max(r.gflops for r in rows) if stable else None), rows, rounds


def run(quick: bool, threads: int) -> list[Row]:
    """The projection GEMMs of MHA at the ViT-B shape (B*n = 1576 rows, 768 -> 768, with bias)
    and the long-sequence shape (8192 rows, 512 -> 512): attnlab against torch's F.linear."""
    torch = try_torch(threads)
    rng = np.random.default_rng(2)
    rows: list[Row] = []
    for name, m, d in (("proj ViT-B fp32", 8 * 197, 768), ("proj long fp32", 8192, 512)):
        x = rng.standard_normal((m, d), dtype=np.float32)
        w = rng.standard_normal((d, d), dtype=np.float32)
        b = rng.standard_normal(d, dtype=np.float32)
        y = np.empty((m, d), dtype=np.float32)
        fns: dict[str, Any] = {"attnlab": lambda x=x, w=w, b=b, y=y: core.linear_forward(x, w, b, y)}
        if torch is not None:
            tx, twt, tb = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w.T)), \
                torch.from_numpy(b)
            fns["torch"] = lambda tx=tx, twt=twt, tb=tb: torch.nn.functional.linear(tx, twt, tb)
        times = interleaved(fns, repeat=3 if quick else 15)
        for impl, ms in times.items():
            rows.append(Row("gemm", name, f"{m}x{d} @ {d}x{d} + b", impl, ms, 2.0 * m * d * d,
                            baseline=None if impl == "attnlab" else "attnlab"))
    return rows
