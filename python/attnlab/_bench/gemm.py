"""GEMMs: square GEMMs to set against the FMA peak (attnlab, torch, OpenBLAS) and the projection
GEMMs of MHA against torch."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .._loader import core
from .common import Row, Timing, interleaved, try_torch

__all__ = ["run", "square_gemm"]


def _gemm_sources(n: int, threads: int) -> dict[str, Any]:
    """Square float32 GEMMs of size n: attnlab's projection kernel and torch.mm (same thread
    count)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n), dtype=np.float32)
    w = rng.standard_normal((n, n), dtype=np.float32)
    y = np.empty((n, n), dtype=np.float32)
    fns: dict[str, Any] = {"attnlab": lambda: core.linear_forward(x, w, None, y)}
    torch = try_torch(threads)
    if torch is not None:
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        fns["torch"] = lambda: torch.mm(tx, tw)
    return fns


def square_gemm(threads: int, quick: bool, sgemm: dict[str, Any] | None) -> list[Row]:
    """Square float32 GEMMs (n = 1024, or 2048 for a full run): attnlab's projection kernel and
    torch.mm timed together, and OpenBLAS's sgemm as timed in its own process (``sgemm``, from
    :func:`attnlab._bench.peak.sgemm_gflops`; NumPy's BLAS threads would slow the others here).
    Rows to set against the FMA peak, which none of them may exceed."""
    n = 1024 if quick else 2048
    flops = 2.0 * n**3
    times = interleaved(_gemm_sources(n, threads), repeat=3 if quick else 7)
    rows = [
        Row(
            "gemm",
            "square GEMM fp32",
            f"n={n}",
            impl,
            ms,
            flops,
            baseline=None if impl == "attnlab" else "attnlab",
        )
        for impl, ms in times.items()
    ]
    if sgemm and sgemm.get("n") == n:
        rows.append(
            Row(
                "gemm",
                "square GEMM fp32",
                f"n={n}",
                "openblas-own-process",
                Timing(min(sgemm["ms"])),
                flops,
                baseline="attnlab",
                extra={"best_of": len(sgemm["ms"])},
            )
        )
    return rows


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
        fns: dict[str, Any] = {"attnlab": partial(core.linear_forward, x, w, b, y)}
        if torch is not None:
            tx, twt, tb = (
                torch.from_numpy(x),
                torch.from_numpy(np.ascontiguousarray(w.T)),
                torch.from_numpy(b),
            )
            fns["torch"] = lambda tx=tx, twt=twt, tb=tb: torch.nn.functional.linear(tx, twt, tb)
        times = interleaved(fns, repeat=3 if quick else 15)
        for impl, ms in times.items():
            rows.append(
                Row(
                    "gemm",
                    name,
                    f"{m}x{d} @ {d}x{d} + b",
                    impl,
                    ms,
                    2.0 * m * d * d,
                    baseline=None if impl == "attnlab" else "attnlab",
                )
            )
    return rows
