"""Efficient additive attention (SwiftFormer) and separable self-attention (MobileViT-v2):
attnlab (float32, and ``precision="bf16"`` against it) against the NumPy reference and a PyTorch
eager module (and, at the largest n, that module under ``torch.compile``), over n = 49 .. 12544
tokens.

The rows of the largest n carry ``extra["slope"]``: the least-squares slope of log(time) against
log(n) over the n >= 784 points (where fixed per-call costs no longer dominate; all points with
--quick, which times n = 196, 784, 1568), i.e. the growth
exponent of time in n: about 1 for these two, about 2 for multi-head attention (timed alongside,
at B = 1, for contrast). The rows of attnlab and torch carry ``extra["error"]``: the output's
normwise difference from the float64 reference's, at every n where the reference's activations
fit in ``REFERENCE_MIB`` (n <= 4096).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import additive_attention, multi_head_attention, reference, separable_attention
from .common import Row, interleaved, output_errors, reference_fits, try_torch

__all__ = ["run", "additive_flops", "separable_flops", "growth_exponent"]

N_ALL = (49, 196, 784, 3136, 12544)
N_QUICK = (196, 784, 1568)
B, D = 8, 256  # the main case is B=8, n=3136, d=256
MHA_B, MHA_H = 1, 4  # the quadratic contrast
SLOPE_MIN_N = 784


def additive_flops(B: int, n: int, d_in: int, D: int, d_out: int) -> float:
    """Operations (2 per multiply-add) of one additive-attention forward.

    GEMMs: Q and K (2 n d_in D each), the projection (2 n D^2) and final (2 n D d_out); plus
    per token the biases, both L2 normalisations (3 per element), the score (2D), the pooling
    (2D), G * K (D), the residual and its bias (2D).
    """
    rows = B * n
    gemm = 2.0 * rows * (2 * d_in * D + D * D + D * d_out)
    elementwise = rows * (2 * D + 6 * D + 2 * D + 2 * D + D + 2 * D + d_out)
    return gemm + elementwise


def separable_flops(B: int, n: int, d: int, d_out: int) -> float:
    """Operations of one separable-attention forward: the (d, 1+2d) and (d, d_out) GEMMs, their
    biases, the softmax (about 4 per token), the context (2d per token), ReLU * ctx (2d)."""
    rows = B * n
    gemm = 2.0 * rows * (d * (1 + 2 * d) + d * d_out)
    return gemm + rows * ((1 + 2 * d) + d_out + 4 + 2 * d + 2 * d)


def _mha_flops(B: int, n: int, d: int) -> float:
    return 2.0 * B * 4 * n * d * d + 2.0 * 2 * B * n * n * d


def growth_exponent(ns: list[int], ms: list[float], min_n: int = SLOPE_MIN_N) -> float:
    """Least-squares slope of log(ms) against log(n) over the points with n >= min_n."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(ns, ms, strict=True) if n >= min_n and t > 0]
    if len(pts) < 2:
        pts = [(math.log(n), math.log(t)) for n, t in zip(ns, ms, strict=True) if t > 0]
    if len(pts) < 2:
        return float("nan")
    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def _additive_weights(rng: np.random.Generator, d: int, dtype: Any) -> dict[str, Any]:
    s = 1.0 / math.sqrt(d)
    w = {k: rng.uniform(-s, s, (d, d)).astype(dtype) for k in ("w_q", "w_k", "w_proj", "w_final")}
    w.update({k: rng.uniform(-s, s, d).astype(dtype) for k in ("b_q", "b_k", "b_proj", "b_final")})
    w["w_g"] = rng.standard_normal((d, 1)).astype(dtype)
    return w


def _separable_weights(rng: np.random.Generator, d: int, dtype: Any) -> dict[str, Any]:
    s = 1.0 / math.sqrt(d)
    return {
        "w_qkv": rng.uniform(-s, s, (d, 1 + 2 * d)).astype(dtype),
        "b_qkv": rng.uniform(-s, s, 1 + 2 * d).astype(dtype),
        "w_o": rng.uniform(-s, s, (d, d)).astype(dtype),
        "b_o": rng.uniform(-s, s, d).astype(dtype),
    }


def _torch_additive(torch: Any, w: dict[str, np.ndarray]) -> Callable[[Any], Any]:
    """The official SwiftFormer module (EfficientAdditiveAttnetion) in eager mode."""
    nn, F = torch.nn, torch.nn.functional
    d_out = w["w_final"].shape[1]

    def linear(wn: str, bn: str) -> Any:
        lin = nn.Linear(w[wn].shape[0], w[wn].shape[1])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(w[wn].T)))
            lin.bias.copy_(torch.from_numpy(w[bn]))
        return lin

    class EfficientAdditiveAttention(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.to_query = linear("w_q", "b_q")
            self.to_key = linear("w_k", "b_k")
            self.w_g = nn.Parameter(torch.from_numpy(w["w_g"].copy()))
            self.scale_factor = d_out**-0.5
            self.Proj = linear("w_proj", "b_proj")
            self.final = linear("w_final", "b_final")

        def forward(self, x: Any) -> Any:
            query = F.normalize(self.to_query(x), dim=-1)
            key = F.normalize(self.to_key(x), dim=-1)
            A = F.normalize(query @ self.w_g * self.scale_factor, dim=1)
            G = torch.sum(A * query, dim=1)
            G = G.unsqueeze(1).expand(-1, key.shape[1], -1)
            return self.final(self.Proj(G * key) + query)

    return EfficientAdditiveAttention().eval()


def _torch_separable(torch: Any, w: dict[str, np.ndarray]) -> Callable[[Any], Any]:
    """MobileViT-v2's LinearSelfAttention on tokens (its 1x1 convolutions as Linear layers)."""
    nn, F = torch.nn, torch.nn.functional
    d = w["w_qkv"].shape[0]

    class LinearSelfAttention(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = nn.Linear(d, 1 + 2 * d)
            self.out_proj = nn.Linear(d, w["w_o"].shape[1])
            with torch.no_grad():
                self.qkv_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(w["w_qkv"].T)))
                self.qkv_proj.bias.copy_(torch.from_numpy(w["b_qkv"]))
                self.out_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(w["w_o"].T)))
                self.out_proj.bias.copy_(torch.from_numpy(w["b_o"]))

        def forward(self, x: Any) -> Any:
            query, key, value = torch.split(self.qkv_proj(x), [1, d, d], dim=-1)
            scores = F.softmax(query, dim=-2)  # over the tokens
            ctx = torch.sum(key * scores, dim=-2, keepdim=True)
            return self.out_proj(F.relu(value) * ctx)

    return LinearSelfAttention().eval()


def _torch_compiled(torch: Any, module: Any, x: np.ndarray) -> Callable[[], Any] | None:
    """``torch.compile`` of the module (inductor's C++ code for this CPU), compiled for ``x``'s
    shape by a first call (seconds), or None where it cannot compile here (no C++ compiler)."""
    try:
        compiled = torch.compile(module, dynamic=False)
        _torch_call(torch, compiled, x)()
    except Exception:  # noqa: BLE001 (any failure to compile: the row is left out)
        return None
    return _torch_call(torch, compiled, x)


def _torch_call(torch: Any, module: Any, x: np.ndarray) -> Callable[[], Any]:
    xt = torch.from_numpy(x)

    def f() -> Any:
        with torch.inference_mode():
            return module(xt)

    return f


def _sweep(
    family: str,
    case: str,
    ns: tuple[int, ...],
    fns_at: Callable[[int], dict[str, Any]],
    flops_at: Callable[[int], float],
    shape_at: Callable[[int], str],
    repeat: int,
    min_n: int,
    ref_at: Callable[[int], Any] | None = None,
) -> list[Row]:
    """The rows of one case timed at every n in ``ns`` (``fns_at(n)``: the implementations),
    the largest n's rows with the slope of time in n; with ``ref_at`` (the float64 reference's
    output at n), the error of every implementation but the reference."""
    rows: list[Row] = []
    series: dict[str, tuple[list[int], list[float]]] = {}
    for n in ns:
        fns = fns_at(n)
        times = interleaved(fns, repeat=repeat, warmup=1, max_time=20.0)
        errors = (
            output_errors({k: f for k, f in fns.items() if k != "reference"}, ref_at(n))
            if ref_at is not None and reference_fits(B * n * D)
            else {}
        )
        for impl, ms in times.items():
            series.setdefault(impl, ([], []))
            series[impl][0].append(n)
            series[impl][1].append(ms)
            rows.append(
                Row(
                    family=family,
                    case=case,
                    shape=shape_at(n),
                    impl=impl,
                    ms=ms,
                    flops=flops_at(n),
                    baseline=None if impl == "attnlab" else "attnlab",
                    extra={"n": n}
                    | ({"error": errors[impl]} if impl in errors else {})
                    | ({"precision": "bf16"} if impl.endswith("bf16") else {}),
                )
            )
    for impl, (ns_i, ms_i) in series.items():
        top = max(ns_i)
        for r in rows:
            if r.impl == impl and r.extra["n"] == top:
                slope = growth_exponent(ns_i, ms_i, min_n)
                if math.isfinite(slope):
                    r.extra["slope"] = slope
    return rows


def run(quick: bool, threads: int) -> list[Row]:
    torch = try_torch(threads)
    rng = np.random.default_rng(0)
    ns = N_QUICK if quick else N_ALL
    ref_max_n = 196 if quick else 3136  # the float64 reference is slow; enough to compare
    repeat = 3 if quick else 5
    min_n = min(ns) if quick else SLOPE_MIN_N  # fit the slope over n >= min_n
    dtype = np.float32
    rows: list[Row] = []

    wa = _additive_weights(rng, D, dtype)
    ws = _separable_weights(rng, D, dtype)
    xs = {n: rng.standard_normal((B, n, D)).astype(dtype) for n in ns}
    t_add = _torch_additive(torch, wa) if torch is not None else None
    t_sep = _torch_separable(torch, ws) if torch is not None else None

    def family_fns(
        ours: Callable[..., Any], ref: Callable[..., Any], w: dict[str, Any], module: Any
    ) -> Callable[[int], dict[str, Any]]:
        """The implementations timed at each n: attnlab (float32, and precision="bf16"), the
        reference (small n), torch eager, and torch.compile at the largest n (not with
        --quick: each compile takes seconds)."""

        def fns_at(n: int) -> dict[str, Any]:
            x = xs[n]
            fns: dict[str, Any] = {
                "attnlab": lambda: ours(x, **w),
                "attnlab bf16": lambda: ours(x, **w, precision="bf16"),
            }
            if n <= ref_max_n:
                fns["reference"] = lambda: ref(x, **w)
            if module is not None:
                fns["torch"] = _torch_call(torch, module, x)
                compiled = None if quick or n != max(ns) else _torch_compiled(torch, module, x)
                if compiled is not None:
                    fns["torch.compile"] = compiled
            return fns

        return fns_at

    additive_fns = family_fns(additive_attention, reference.additive_attention, wa, t_add)
    separable_fns = family_fns(separable_attention, reference.separable_attention, ws, t_sep)

    rows += _sweep(
        "additive",
        "SwiftFormer fwd fp32",
        ns,
        additive_fns,
        lambda n: additive_flops(B, n, D, D, D),
        lambda n: f"B={B} n={n} d={D}",
        repeat,
        min_n,
        lambda n: reference.additive_attention(xs[n], **wa),
    )
    rows += _sweep(
        "separable",
        "MobileViTv2 fwd fp32",
        ns,
        separable_fns,
        lambda n: separable_flops(B, n, D, D),
        lambda n: f"B={B} n={n} d={D}",
        repeat,
        min_n,
        lambda n: reference.separable_attention(xs[n], **ws),
    )

    # The quadratic contrast: attnlab's own multi-head attention over the same n.
    s = 1.0 / math.sqrt(D)
    wm: dict[str, Any] = {
        k: rng.uniform(-s, s, (D, D)).astype(dtype) for k in ("w_q", "w_k", "w_v", "w_o")
    }
    xm = {n: xs[n][:MHA_B] for n in ns}

    def mha_fns(n: int) -> dict[str, Any]:
        x = xm[n]
        return {"attnlab-mha": lambda: multi_head_attention(x, num_heads=MHA_H, **wm)}

    mha_rows = _sweep(
        "additive",
        "MHA fwd fp32 (contrast)",
        ns,
        mha_fns,
        lambda n: _mha_flops(MHA_B, n, D),
        lambda n: f"B={MHA_B} n={n} d={D} h={MHA_H}",
        min(repeat, 3),
        min_n,
    )
    for r in mha_rows:
        r.baseline = None
    rows += mha_rows
    return rows
