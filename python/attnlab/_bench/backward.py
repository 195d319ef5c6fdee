"""Backward timings next to forward: attnlab's *_backward (which recomputes the forward) against
torch autograd (forward + backward), on the ViT-S shape."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import multi_head_attention, multi_head_attention_backward
from .common import Row, interleaved, try_torch
from .mha import _torch_mha, _weights, mha_flops

__all__ = ["run"]


def run(quick: bool, threads: int) -> list[Row]:
    torch = try_torch(threads)
    rng = np.random.default_rng(1)
    B, n, d, h = 8, 197, 384, 6
    x = rng.standard_normal((B, n, d)).astype(np.float32)
    w = _weights(rng, d, h, np.float32)
    g = rng.standard_normal((B, n, d)).astype(np.float32)
    fns: dict[str, Any] = {
        "attnlab fwd": lambda: multi_head_attention(x, num_heads=h, **w),
        "attnlab bwd": lambda: multi_head_attention_backward(g, x, num_heads=h, **w),
    }
    if torch is not None:
        m = _torch_mha(torch, w, d, h).train(False)
        gt = torch.from_numpy(g)

        def tf() -> None:
            xt = torch.from_numpy(x).requires_grad_(True)
            out = m(xt, xt, xt, need_weights=False)[0]
            out.backward(gt)

        fns["torch fwd+bwd"] = tf
    times = interleaved(fns, repeat=3 if quick else 11)
    fwd = mha_flops(B, n, n, d, h, d // h, False)
    flops = {"attnlab fwd": fwd, "attnlab bwd": 3 * fwd, "torch fwd+bwd": 3 * fwd}
    shape = f"B={B} n={n} d={d} h={h}"
    rows = []
    for impl, ms in times.items():
        extra: dict[str, Any] = {}
        if impl == "attnlab bwd":
            extra["bwd/fwd"] = ms / times["attnlab fwd"]
        rows.append(Row("backward", "ViT-S fwd+bwd fp32", shape, impl, ms, flops[impl],
                        baseline="attnlab bwd" if impl == "torch fwd+bwd" else None,
                        extra=extra))
    return rows
