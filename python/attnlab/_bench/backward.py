"""Training-step timings: attnlab's ``vjp`` + pullback (one forward, then the gradients of the
input and every weight from what the forward kept) against torch autograd over F.linear + SDPA
(forward + backward), with the pullback alone and the recomputing ``*_backward`` beside them."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import multi_head_attention, multi_head_attention_backward, vjp
from .common import Row, interleaved, try_torch
from .mha import _weights, mha_flops

__all__ = ["run"]

# (label, B, n, d, h, causal); the long case only in the full run
CASES = (
    ("ViT-S step fp32", 8, 197, 384, 6, False),
    ("long causal step fp32", 1, 4096, 512, 8, True),
)


def _torch_step(
    torch: Any, w: dict[str, np.ndarray], x: np.ndarray, g: np.ndarray, h: int, causal: bool
) -> Any:
    """One training step of F.linear + F.scaled_dot_product_attention: forward, then the
    gradients of the input and of every weight and bias."""
    F = torch.nn.functional
    t = {
        k: torch.from_numpy(np.ascontiguousarray(v.T if v.ndim == 2 else v)).requires_grad_(True)
        for k, v in w.items()
    }
    gt = torch.from_numpy(g)

    def step() -> None:
        for p in t.values():
            p.grad = None
        xt = torch.from_numpy(x).requires_grad_(True)
        B, n, d = xt.shape
        q = F.linear(xt, t["w_q"], t["b_q"]).view(B, n, h, -1).transpose(1, 2)
        k = F.linear(xt, t["w_k"], t["b_k"]).view(B, n, h, -1).transpose(1, 2)
        v = F.linear(xt, t["w_v"], t["b_v"]).view(B, n, h, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        F.linear(o.transpose(1, 2).reshape(B, n, d), t["w_o"], t["b_o"]).backward(gt)

    return step


def _attnlab_fns(x: np.ndarray, g: np.ndarray, kw: dict[str, Any]) -> dict[str, Any]:
    """The forward, a training step (vjp + pullback), the pullback alone and the recomputing
    backward of one case."""
    _, pullback = vjp(multi_head_attention, x, **kw)

    def step() -> None:
        _, pb = vjp(multi_head_attention, x, **kw)
        pb(g)

    return {
        "attnlab fwd": lambda: multi_head_attention(x, **kw),
        "attnlab step": step,
        "attnlab pullback": lambda: pullback(g),
        "attnlab bwd (recompute)": lambda: multi_head_attention_backward(g, x, **kw),
    }


def run(quick: bool, threads: int) -> list[Row]:
    torch = try_torch(threads)
    rows: list[Row] = []
    for label, B, n, d, h, causal in CASES[:1] if quick else CASES:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((B, n, d)).astype(np.float32)
        w = _weights(rng, d, np.float32)
        g = rng.standard_normal((B, n, d)).astype(np.float32)
        kw = dict(num_heads=h, causal=causal, **w)
        fns = _attnlab_fns(x, g, kw)
        if torch is not None:
            fns["torch step"] = _torch_step(torch, w, x, g, h, causal)
        long = n > 1000
        times = interleaved(fns, repeat=3 if long or quick else 11)
        fwd = mha_flops(B, n, n, d, h, d // h, causal)
        # a backward is two of the forward's products per forward product: 3x the forward
        flops = {
            "attnlab fwd": fwd,
            "attnlab step": 3 * fwd,
            "attnlab pullback": 2 * fwd,
            "attnlab bwd (recompute)": 3 * fwd,
            "torch step": 3 * fwd,
        }
        shape = f"B={B} n={n} d={d} h={h}" + (" causal" if causal else "")
        for impl, ms in times.items():
            extra: dict[str, Any] = {}
            if impl == "attnlab pullback":
                extra["pullback/fwd"] = ms / times["attnlab fwd"]
            if impl == "attnlab bwd (recompute)":
                extra["bwd/fwd"] = ms / times["attnlab fwd"]
            rows.append(
                Row(
                    "backward",
                    label,
                    shape,
                    impl,
                    ms,
                    flops[impl],
                    baseline="attnlab step" if impl == "torch step" else None,
                    extra=extra,
                )
            )
    return rows
