"""Separate (multi-head) against collapsed (bilinear) query-key weights over a grid of (n, d, h).

For every grid point: the separate form (``multi_head_attention``), the collapsed form with the
order the cost model picks, and the collapsed form forced to each order. Row.extra reports what
:func:`attnlab.plan_qk` chose, the predicted cost ratio (collapsed / separate multiply-adds of
the whole layer) against the measured time ratio, whether the plan's choice ran within 10% of
the faster form measured, and the same for the kernel's evaluation order. A grid point that
misses either check is timed once more, twice as long (``retimed``): near a crossover the two
forms differ by less than the noise of a shared machine. Every row's ``extra["error"]`` is its
output's normwise difference from the float64 reference layer with separate weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import (
    attention_cost,
    bilinear_attention,
    collapse_qk,
    multi_head_attention,
    plan_qk,
    reference,
)
from ..cost import collapsed_order
from .common import Row, interleaved, output_errors

__all__ = ["run", "grid", "layer_macs"]

# (B, n_q, n_k, d, h, d_head): n_k None = self-attention, d_head None = d / h
# one point per regime: h = 1 (collapsed wins), h > 1, d_head > d, n_q >> n_k, n_k >> n_q
_QUICK = [
    (4, 64, None, 64, 1, None),
    (4, 256, None, 64, 4, None),
    (2, 128, None, 128, 8, None),
    (2, 64, None, 128, 2, 96),
    (1, 512, 32, 128, 2, None),
    (1, 32, 512, 128, 2, None),
]
_FULL = (
    [
        (B, n, None, d, h, None)
        for (B, n) in ((8, 64), (2, 256), (1, 1024))
        for d in (64, 256, 512)
        for h in (1, 2, 8)
    ]
    + [(2, n, None, 128, 2, 96) for n in (64, 128, 256, 512, 1024)]
    + [
        (1, 1024, 32, 256, 4, None),
        (1, 32, 1024, 256, 4, None),
        (2, 512, 16, 128, 1, None),
        (1, 1, 2048, 256, 4, None),
    ]
)


def grid(quick: bool) -> list[tuple[int, int, int | None, int, int, int | None]]:
    return list(_QUICK if quick else _FULL)


def layer_macs(form: str, B: int, n_q: int, n_k: int, d: int, h: int, dh: int) -> int:
    """Multiply-adds of the whole forward layer: the score part from attention_cost, plus what
    both forms share (value projection d x h*dh, P V, output projection)."""
    score = attention_cost(form, n_q=n_q, n_k=n_k, d_model=d, num_heads=h, d_head=dh, batch=B)[
        "flops"
    ]
    shared = B * (n_k * d * h * dh + n_q * h * dh * d + h * n_q * n_k * dh)
    return score + shared


def run(quick: bool, threads: int) -> list[Row]:  # noqa: ARG001 (threads set by the runner)
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    for B, n, n_k_, d, h, dh_ in grid(quick):
        dh = d // h if dh_ is None else dh_
        nk = n if n_k_ is None else n_k_
        s = 1.0 / np.sqrt(d)
        w: dict[str, Any] = {
            k: rng.uniform(-s, s, shape).astype(np.float32)
            for k, shape in (
                ("w_q", (d, h * dh)),
                ("w_k", (d, h * dh)),
                ("w_v", (d, h * dh)),
                ("w_o", (h * dh, d)),
                ("b_q", (h * dh,)),
                ("b_o", (d,)),
            )
        }
        x = rng.standard_normal((B, n, d)).astype(np.float32)
        y = x if n_k_ is None else rng.standard_normal((B, nk, d)).astype(np.float32)
        qk = collapse_qk(w["w_q"], w["w_k"], w["b_q"], num_heads=h)
        vo = {k: w[k] for k in ("w_v", "w_o", "b_o")}

        def col(
            order: str | None, qk: Any = qk, vo: Any = vo, x: Any = x, y: Any = y, h: int = h
        ) -> Any:
            return bilinear_attention(x, y, w_qk=qk, **vo, num_heads=h, _order=order)

        # the auto order calls the same kernel as the forced run of the order it picks
        # (collapsed_order is evaluated in Python first), so that run stands for it
        fns: dict[str, Any] = {
            "separate": lambda w=w, x=x, y=y, h=h: multi_head_attention(x, y, **w, num_heads=h),
            "coll-query": lambda: col("query"),
            "coll-key": lambda: col("key"),
        }
        big = B * h * (n * d * d + n * nk * d) > 2e8
        order = collapsed_order(n_q=n, n_k=nk, d_q=d, d_k=d, num_heads=h, batch=B, key_bias=True)
        plan = plan_qk(n_q=n, n_k=nk, d_model=d, num_heads=h, d_head=dh, batch=B)
        retimed = False
        for attempt in range(2):
            times = interleaved(
                fns,
                repeat=(5 if quick else (7 if big else 11)) * (1 + attempt),
                warmup=1,
                min_time=(0.1 if quick else 1.0) * (1 + attempt),
            )
            times["collapsed"] = times[f"coll-{order}"]
            best = min(times["separate"], times["collapsed"])
            best_order = min(times["coll-query"], times["coll-key"])
            if times[plan] <= 1.10 * best and times["collapsed"] <= 1.10 * best_order:
                break
            retimed = True  # a miss on a shared machine: measure once more, twice as long
        # every form against the float64 layer with separate weights: the collapse's rounding
        # is part of the collapsed forms' error
        errors = output_errors(fns, reference.multi_head_attention(x, y, **w, num_heads=h))
        errors["collapsed"] = errors[f"coll-{order}"]
        macs = {f: layer_macs(f, B, n, nk, d, h, dh) for f in ("separate", "collapsed")}
        faster = "collapsed" if times["collapsed"] < times["separate"] else "separate"
        extra = {
            "plan": plan,
            "faster": faster,
            "pred_ratio": macs["collapsed"] / macs["separate"],
            "meas_ratio": times["collapsed"] / times["separate"],
            "plan_within_10pct": bool(times[plan] <= 1.10 * best),
            "order": order,
            "order_within_10pct": bool(times["collapsed"] <= 1.10 * best_order),
            "retimed": retimed,
        }
        shape = (
            f"B={B} n={n}"
            + ("" if n_k_ is None else f" nk={nk}")
            + f" d={d} h={h}"
            + ("" if dh_ is None else f" dh={dh}")
        )
        for impl in ("separate", "collapsed", "coll-query", "coll-key"):
            ms = times[impl]
            f = macs["separate" if impl == "separate" else "collapsed"]
            rows.append(
                Row(
                    "bilinear",
                    "QK separate vs collapsed",
                    shape,
                    impl,
                    ms,
                    2.0 * f,
                    baseline=None if impl == "separate" else "separate",
                    extra=(extra if impl == "collapsed" else {}) | {"n": n, "error": errors[impl]},
                )
            )
    return rows


def summary(rows: list[Row]) -> dict[str, Any]:
    """Counts of grid points where the plan and the order were within 10%, and the predicted
    against the measured winner per grid point (for the crossover)."""
    pts = [r for r in rows if r.family == "bilinear" and r.impl == "collapsed"]
    return {
        "points": len(pts),
        "plan_within_10pct": sum(bool(r.extra["plan_within_10pct"]) for r in pts),
        "order_within_10pct": sum(bool(r.extra["order_within_10pct"]) for r in pts),
        "winners": [(r.shape, r.extra["plan"], r.extra["faster"]) for r in pts],
    }
