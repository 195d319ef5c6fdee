"""CPU time per call of the kernel cases docs/performance.md's A/Bs quote: bf16 products on AMX
(the attention core on ViT-B's head views, the ViT-B layer, the fused-width GEMM) and float16
against float32 inputs (BERT and ViT-B layers, SDPA with and without a causal mask, decode).
One thread by default (ATTNLAB_NUM_THREADS overrides it): on a shared machine the CPU time of
one thread is the steadiest measure.

    python scripts/kernel_ab.py [CASE ...]
        the attnlab on PYTHONPATH: per case the minimum CPU time of 25 calls, in ms
    python scripts/kernel_ab.py --compare A/python B/python [--rounds 5] [CASE ...]
        two trees, each case in its own process, A and B alternately; minima per tree

Cases: sdpa-bf16, vitb-bf16, gemm-bf16 and gemm-float32 (1576 x 768 x 2304), gemmbert-float32
(128 x 768 x 2304), vitbgrad-float32 (the ViT-B layer's pullback: its linear_input_grad and
linear_weight_grad) and {bert,vitb,sdpa,causal,decode}-{float32,float16}.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import ab_compare  # scripts/ab_compare.py (this folder is on sys.path when run)

CASES = (
    "sdpa-bf16",
    "vitb-bf16",
    "gemm-bf16",
    "gemm-float32",
    "gemmbert-float32",
    "vitbgrad-float32",
    *(
        f"{c}-{t}"
        for c in ("bert", "vitb", "sdpa", "causal", "decode")
        for t in ("float32", "float16")
    ),
)


def _call(name: str) -> Callable[[], Any]:
    import numpy as np

    import attnlab
    from attnlab._loader import core

    rng = np.random.default_rng(0)
    case, kind = name.split("-")
    dt = np.float32 if kind == "bf16" else np.dtype(kind)
    precision = "bf16" if kind == "bf16" else None

    def layer(b: int, n: int) -> Callable[[], Any]:
        x = rng.standard_normal((b, n, 768)).astype(dt)
        w = {
            k: (rng.standard_normal((768, 768)) / 28).astype(dt)
            for k in ("w_q", "w_k", "w_v", "w_o")
        }
        return lambda: attnlab.multi_head_attention(x, num_heads=12, precision=precision, **w)

    if case == "bert":
        return layer(1, 128)
    if case == "vitb":
        return layer(8, 197)
    if case in ("gemm", "gemmbert"):  # the fused q, k, v projection of ViT-B or of BERT
        rows = 1576 if case == "gemm" else 128
        x = rng.standard_normal((rows, 768)).astype(np.float32)
        w = (rng.standard_normal((768, 2304)) / 28).astype(np.float32)
        b, y = np.ones(2304, np.float32), np.empty((rows, 2304), np.float32)
        return lambda: core.linear_forward(x, w, b, y, kind == "bf16")
    if case == "vitbgrad":
        x = rng.standard_normal((8, 197, 768)).astype(dt)
        w = {
            k: (rng.standard_normal((768, 768)) / 28).astype(dt)
            for k in ("w_q", "w_k", "w_v", "w_o")
        }
        out, pullback = attnlab.vjp(attnlab.multi_head_attention, x, num_heads=12, **w)
        g = rng.standard_normal(out.shape).astype(dt)
        return lambda: pullback(g)
    if case == "sdpa" and kind == "bf16":  # ViT-B's heads: strided views of (B, n, h, d)
        q, k, v = (rng.standard_normal((8, 197, 12, 64)).astype(np.float32) for _ in range(3))
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        return lambda: attnlab.scaled_dot_product_attention(q, k, v, precision="bf16")
    if case == "decode":
        q = rng.standard_normal((1, 32, 1, 128)).astype(dt)
        k, v = (rng.standard_normal((1, 32, 8192, 128)).astype(dt) for _ in range(2))
        return lambda: attnlab.scaled_dot_product_attention(q, k, v)
    q, k, v = (rng.standard_normal((1, 8, 1024, 64)).astype(dt) for _ in range(3))
    causal = case == "causal"
    return lambda: attnlab.scaled_dot_product_attention(q, k, v, causal=causal)


def time_case(name: str) -> float:
    """Milliseconds of CPU time per call: the minimum over 25 calls."""
    f = _call(name)
    f()
    best = float("inf")
    for _ in range(25):
        t = time.process_time()
        f()
        best = min(best, time.process_time() - t)
    return best * 1e3


if __name__ == "__main__":
    os.environ.setdefault("ATTNLAB_NUM_THREADS", "1")  # before attnlab is imported
    sys.exit(ab_compare.main(__doc__, __file__, CASES, time_case, "ms", rounds=5))
