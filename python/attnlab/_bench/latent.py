"""Multi-head latent attention: one decode step against a 4096-token cache, absorbed against
expanded, measured and predicted.

The prediction is :func:`attnlab.cost.latent_cost`'s, as a time: multiply-adds at the rate of
attnlab's GEMM on the expansion's own product (``(n_k, r) x (r, h (d_nope + d_v))``), plus
memory traffic at the rate of a large copy, both measured in this run. Row.extra has both
ratios and whether the measured one is within 20% of the prediction (the target of DESIGN.md
section 7).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import latent_attention
from .._loader import core
from ..cost import latent_cost
from .common import Row, interleaved

__all__ = ["run"]

# DeepSeek-V2-Lite-like widths at 16 heads: d, h, r, d_nope, d_rope, d_v
SIZES = (1024, 16, 512, 128, 64, 128)
CACHE = 4096


def _rates(nk: int, r: int, cols: int, quick: bool) -> tuple[float, float]:
    """(multiply-adds per second of the GEMM ``(nk, r) x (r, cols)``, bytes per second of a
    copy of 64 MiB), float32."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((nk, r)).astype(np.float32)
    b = rng.standard_normal((r, cols)).astype(np.float32)
    y = np.empty((nk, cols), np.float32)
    src = np.ones(1 << 24, np.float32)
    dst = np.empty_like(src)
    t = interleaved(
        {
            "gemm": lambda: core.linear_forward(a, b, None, y),
            "copy": lambda: np.copyto(dst, src),
        },
        repeat=3 if quick else 7,
    )
    return nk * r * cols / (t["gemm"] * 1e-3), 2 * src.nbytes / (t["copy"] * 1e-3)


def run(quick: bool, threads: int) -> list[Row]:  # noqa: ARG001 (threads set by the runner)
    d, h, r, dn, dr, dv = SIZES
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    weights: dict[str, Any] = {
        "w_q": w(d, h * (dn + dr)),
        "w_kv_a": w(d, r + dr),
        "kv_a_norm": np.ones(r, np.float32),
        "w_kv_b": w(r, h * (dn + dv)),
        "w_o": w(h * dv, d),
    }
    cache = rng.standard_normal((1, CACHE - 1, r + dr)).astype(np.float32)
    x = rng.standard_normal((1, 1, d)).astype(np.float32)

    def step(form: str) -> Any:
        return latent_attention(
            x,
            **weights,
            num_heads=h,
            rope_theta=1e4,
            cache=cache,
            causal="bottom_right",
            form=form,
            return_cache=True,
        )

    times = interleaved(
        {"expanded": lambda: step("expanded"), "absorbed": lambda: step("absorbed")},
        repeat=3 if quick else 7,
        warmup=1,
    )
    macs_s, bytes_s = _rates(CACHE, r, h * (dn + dv), quick)
    sizes = dict(
        d_model=d,
        num_heads=h,
        kv_lora_rank=r,
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=dv,
    )
    cost = {f: latent_cost(f, n_q=1, n_k=CACHE, **sizes) for f in ("expanded", "absorbed")}
    pred = {f: c["flops"] / macs_s + c["bytes"] / bytes_s for f, c in cost.items()}
    pred_ratio = pred["expanded"] / pred["absorbed"]
    meas_ratio = times["expanded"] / times["absorbed"]
    extra = {
        "pred_ratio": pred_ratio,
        "meas_ratio": meas_ratio,
        "flops_ratio": cost["expanded"]["flops"] / cost["absorbed"]["flops"],
        "within_20pct": bool(abs(meas_ratio / pred_ratio - 1) <= 0.2),
        "gemm_gmacs": macs_s / 1e9,
        "copy_gbs": bytes_s / 1e9,
    }
    shape = f"B=1 n_k={CACHE} d={d} h={h} r={r} dn={dn} dr={dr} dv={dv}"
    return [
        Row(
            "latent",
            "MLA decode step fp32",
            shape,
            f,
            times[f],
            2.0 * cost[f]["flops"],
            baseline=None if f == "expanded" else "expanded",
            extra=extra if f == "absorbed" else {},
        )
        for f in ("expanded", "absorbed")
    ]
