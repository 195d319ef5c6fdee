"""Sliding-window attention: forward and backward time against n at a fixed window of 512
keys, which should grow linearly (key tiles outside the band are skipped)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import scaled_dot_product_attention, scaled_dot_product_attention_backward
from .common import Row, interleaved
from .mha import mha_flops

__all__ = ["WINDOW", "run"]

WINDOW = 512
BAND = (WINDOW - 1, 0)  # window=: the query's key and the WINDOW - 1 before it
HEADS, D_HEAD = 4, 64


def run(quick: bool, threads: int) -> list[Row]:  # noqa: ARG001 (threads set by the runner)
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    for n in (4096, 16384) if quick else (4096, 16384, 65536):
        q = rng.standard_normal((1, HEADS, n, D_HEAD)).astype(np.float32)
        g = rng.standard_normal((1, HEADS, n, D_HEAD)).astype(np.float32)

        def fwd(q: np.ndarray = q) -> Any:
            return scaled_dot_product_attention(q, q, q, window=BAND, causal=True)

        def bwd(q: np.ndarray = q, g: np.ndarray = g) -> Any:
            return scaled_dot_product_attention_backward(g, q, q, q, window=BAND, causal=True)

        t = interleaved({"fwd": fwd, "bwd": bwd}, repeat=3 if quick else 5)
        # the pairs inside the band: each query sees min(i + 1, WINDOW) keys
        pairs = WINDOW * n - WINDOW * (WINDOW - 1) / 2
        flops = mha_flops(1, n, n, 0, HEADS, D_HEAD, False) * pairs / (n * n)
        shape = f"(1, {HEADS}, {n}, {D_HEAD}) window {WINDOW}"
        for what, label, f in (("fwd", "window fwd fp32", 1), ("bwd", "window bwd fp32", 3)):
            ms = float(t[what])
            rows.append(
                Row(
                    "window",
                    label,
                    shape,
                    "attnlab",
                    t[what],
                    f * flops,
                    extra={"us_per_token": 1e3 * ms / n, "n": n},
                )
            )
    return rows
