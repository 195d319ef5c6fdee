"""Multi-head attention forward: attnlab against the NumPy reference and PyTorch."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .. import multi_head_attention, reference
from .common import Row, Timing, interleaved, output_errors, reference_fits, try_torch

__all__ = ["run", "mha_flops", "peak_extra_mib"]


def mha_flops(B: int, n_q: int, n_k: int, d: int, h: int, d_head: int, causal: bool) -> float:
    """Floating-point operations (2 per multiply-add) of one MHA forward."""
    proj = 2.0 * B * (n_q * d * h * d_head + 2 * n_k * d * h * d_head + n_q * h * d_head * d)
    pairs = n_q * n_k if not causal else n_q * (n_q + 1) / 2 + n_q * max(n_k - n_q, 0)
    attn = 2.0 * 2 * B * h * pairs * d_head
    return proj + attn


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_extra_mib(fn: Any) -> float | None:
    """Peak resident memory a call adds above the resident memory before it (Linux only)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        before = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - before) / 1024.0
    except OSError:
        return None


_MEMORY_PROBE = """
import numpy as np, attnlab
from attnlab._bench.mha import peak_extra_mib
n, causal = {n}, {causal}
rng = np.random.default_rng(0)
x = rng.standard_normal((1, n, 512)).astype(np.float32)
w = {{k: (rng.standard_normal((512, 512)) / 23).astype(np.float32)
     for k in ("w_q", "w_k", "w_v", "w_o")}}
print(peak_extra_mib(lambda: attnlab.multi_head_attention(x, num_heads=8, causal=causal, **w)))
"""


def fresh_peak_extra_mib(n: int, causal: bool) -> float | None:
    """Peak extra memory of one long-sequence call, measured in a fresh interpreter (in this
    process, memory freed by earlier calls stays resident and would hide the peak)."""
    import subprocess
    import sys

    try:
        r = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE.format(n=n, causal=causal)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        return float(r.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None  # no number: the probe failed, the row says n/a


def _weights(rng: np.random.Generator, d: int, dtype: Any) -> dict[str, Any]:
    s = 1.0 / np.sqrt(d)
    w = {n: (rng.uniform(-s, s, (d, d))).astype(dtype) for n in ("w_q", "w_k", "w_v", "w_o")}
    w.update({n: (rng.uniform(-s, s, d)).astype(dtype) for n in ("b_q", "b_k", "b_v", "b_o")})
    return w


def _torch_mha(torch: Any, w: dict[str, np.ndarray], d: int, h: int) -> Any:
    m = torch.nn.MultiheadAttention(d, h, batch_first=True).eval()
    with torch.no_grad():
        m.in_proj_weight.copy_(
            torch.from_numpy(np.concatenate([w["w_q"].T, w["w_k"].T, w["w_v"].T]))
        )
        m.in_proj_bias.copy_(torch.from_numpy(np.concatenate([w["b_q"], w["b_k"], w["b_v"]])))
        m.out_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(w["w_o"].T)))
        m.out_proj.bias.copy_(torch.from_numpy(w["b_o"]))
    return m


def _torch_params(
    torch: Any, w: dict[str, np.ndarray], requires_grad: bool = False
) -> dict[str, Any]:
    """The ``(in, out)`` weights as torch's ``(out, in)`` tensors (biases as they are), leaves
    of autograd when ``requires_grad``."""
    return {
        k: torch.from_numpy(np.ascontiguousarray(v.T if v.ndim == 2 else v)).requires_grad_(
            requires_grad
        )
        for k, v in w.items()
    }


def _torch_sdpa_mha(
    torch: Any, w: dict[str, np.ndarray], h: int, causal: bool, t: dict[str, Any] | None = None
) -> Any:
    """Projections + F.scaled_dot_product_attention + output projection, as a model would; with
    the parameters ``t`` (:func:`_torch_params` of ``w``) when given."""
    F = torch.nn.functional
    t = _torch_params(torch, w) if t is None else t

    def f(x: Any) -> Any:
        B, n, d = x.shape
        q = F.linear(x, t["w_q"], t["b_q"]).view(B, n, h, -1).transpose(1, 2)
        k = F.linear(x, t["w_k"], t["b_k"]).view(B, n, h, -1).transpose(1, 2)
        v = F.linear(x, t["w_v"], t["b_v"]).view(B, n, h, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.linear(o.transpose(1, 2).reshape(B, n, d), t["w_o"], t["b_o"])

    return f


def run(quick: bool, threads: int) -> list[Row]:
    torch = try_torch(threads)
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    # "tiny": 8 tokens, where the time is call overhead (validation, allocation, dispatch);
    # each timing is `calls` calls, reported per call
    cases = [("tiny", 1, 8, 32, 2, False, 200), ("ViT-S", 8, 197, 384, 6, False, 1)]
    if not quick:
        cases.append(("ViT-B", 8, 197, 768, 12, False, 1))
    for name, B, n, d, h, causal, calls in cases:
        x = rng.standard_normal((B, n, d)).astype(np.float32)
        w = _weights(rng, d, np.float32)
        fns: dict[str, Any] = {
            "attnlab": partial(multi_head_attention, x, num_heads=h, **w),
            "reference": partial(reference.multi_head_attention, x, num_heads=h, **w),
        }
        if torch is not None:
            m = _torch_mha(torch, w, d, h)
            xt = torch.from_numpy(x)

            def tf(m: Any = m, xt: Any = xt) -> Any:
                with torch.inference_mode():
                    return m(xt, xt, xt, need_weights=False)[0]

            fns["torch"] = tf
        ref = fns["reference"]()
        errors = output_errors({k: f for k, f in fns.items() if k != "reference"}, ref)
        if calls > 1:
            fns = {
                k: (lambda f=f, calls=calls: [f() for _ in range(calls)]) for k, f in fns.items()
            }
        times = interleaved(fns, repeat=5 if quick else 11)
        flops = mha_flops(B, n, n, d, h, d // h, causal)
        shape = f"B={B} n={n} d={d} h={h}"
        for impl, ms in times.items():
            rows.append(
                Row(
                    "mha",
                    f"{name} fwd fp32",
                    shape,
                    impl,
                    Timing(ms / calls, ms.spread),
                    flops,
                    baseline=None if impl == "attnlab" else "attnlab",
                    extra={"error": errors[impl]} if impl in errors else {},
                )
            )
    if not quick:  # (--quick fits on one screen without it; tests/test_bench.py runs it)
        rows.extend(_modern_case(torch, rng, quick))
    # long sequence: flash tiling keeps memory O(n d); the reference would need n^2 scores.
    # Timed at several n (time against n in --plot); peak memory at the largest.
    ns_long = (512, 1024) if quick else (1024, 2048, 4096, 8192)
    for causal in (False, True):
        for n_long in ns_long:
            rows.extend(_long_case(torch, rng, n_long, causal, quick, n_long == ns_long[-1]))
    return rows


def _long_case(
    torch: Any, rng: np.random.Generator, n_long: int, causal: bool, quick: bool, memory: bool
) -> list[Row]:
    B, d, h = 1, 512, 8
    x = rng.standard_normal((B, n_long, d)).astype(np.float32)
    w = _weights(rng, d, np.float32)
    fns: dict[str, Any] = {
        "attnlab": lambda: multi_head_attention(x, num_heads=h, causal=causal, **w)
    }
    if torch is not None:
        f = _torch_sdpa_mha(torch, w, h, causal)
        xt = torch.from_numpy(x)

        def tf2(f: Any = f, xt: Any = xt) -> Any:
            with torch.inference_mode():
                return f(xt)

        fns["torch-sdpa"] = tf2
    times = interleaved(fns, repeat=3 if quick else 5)
    errors: dict[str, float] = {}
    if reference_fits(n_long * n_long):  # the reference works one head at a time
        ref = reference.multi_head_attention(x, num_heads=h, causal=causal, **w)
        errors = output_errors(fns, ref)
    flops = mha_flops(B, n_long, n_long, d, h, d // h, causal)
    shape = f"B=1 n={n_long} d=512 h=8"
    label = "long causal fwd fp32" if causal else "long fwd fp32"
    rows = []
    for impl, ms in times.items():
        extra: dict[str, Any] = {"n": n_long}
        if impl in errors:
            extra["error"] = errors[impl]
        if impl == "attnlab" and memory and not quick:  # a fresh interpreter: full runs only
            extra["peak_extra_mib"] = fresh_peak_extra_mib(n_long, causal)
        rows.append(
            Row(
                "mha",
                label,
                shape,
                impl,
                ms,
                flops,
                baseline=None if impl == "attnlab" else "attnlab",
                extra=extra,
            )
        )
    return rows


# A layer of today's decoder models, Qwen3-0.6B's attention: d 1024, 16 query heads of 128 on 8
# kv heads, per-head q/k RMSNorm, rotary embeddings (theta 1e6), causal.
_MODERN = (1024, 16, 8, 128)  # d, h, h_kv, d_head
_MODERN_THETA = 1e6


def _modern_case(torch: Any, rng: np.random.Generator, quick: bool) -> list[Row]:
    """The Qwen3-shaped layer against torch written as such a model does (F.linear, RMSNorm,
    rotate_half, F.scaled_dot_product_attention with enable_gqa); errors against the float64
    reference."""
    d, h, h_kv, dh = _MODERN
    theta = _MODERN_THETA
    n = 512 if quick else 2048
    x = rng.standard_normal((1, n, d)).astype(np.float32)
    s = 1 / np.sqrt(d)
    w = {
        "w_q": rng.standard_normal((d, h * dh)) * s,
        "w_k": rng.standard_normal((d, h_kv * dh)) * s,
        "w_v": rng.standard_normal((d, h_kv * dh)) * s,
        "w_o": rng.standard_normal((h * dh, d)) / np.sqrt(h * dh),
        "q_norm": 1 + 0.1 * rng.standard_normal(dh),
        "k_norm": 1 + 0.1 * rng.standard_normal(dh),
    }
    w = {k: v.astype(np.float32) for k, v in w.items()}
    kw: dict[str, Any] = dict(num_heads=h, num_kv_heads=h_kv, causal=True, rope_theta=theta, **w)
    fns: dict[str, Any] = {"attnlab": partial(multi_head_attention, x, **kw)}
    if torch is not None:
        fns["torch-sdpa"] = _torch_modern(torch, x, w, n)
    times = interleaved(fns, repeat=3 if quick else 5)
    errors = output_errors(fns, reference.multi_head_attention(x, **kw))
    proj = 2.0 * n * d * (2 * h * dh + 2 * h_kv * dh)
    flops = proj + 4.0 * h * dh * n * (n + 1) / 2
    shape = f"B=1 n={n} d={d} h={h}/{h_kv}x{dh}"
    return [
        Row(
            "mha",
            "Qwen3-0.6B causal fwd fp32",
            shape,
            impl,
            ms,
            flops,
            baseline=None if impl == "attnlab" else "attnlab",
            extra={"error": errors[impl]},
        )
        for impl, ms in times.items()
    ]


def _torch_modern(torch: Any, x: np.ndarray, w: dict[str, np.ndarray], n: int) -> Any:
    """The Qwen3 layer in torch, as transformers writes it."""
    F = torch.nn.functional
    _, h, h_kv, dh = _MODERN
    theta = _MODERN_THETA
    t = {k: torch.from_numpy(np.ascontiguousarray(v.T if v.ndim == 2 else v)) for k, v in w.items()}
    inv = theta ** (-np.arange(0, dh, 2, dtype=np.float64) / dh)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv
    emb = np.concatenate([ang, ang], -1)
    cos, sin = (torch.from_numpy(f(emb).astype(np.float32)) for f in (np.cos, np.sin))
    xt = torch.from_numpy(x)

    def norm(a: Any, g: Any) -> Any:
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    def rope(a: Any) -> Any:
        a1, a2 = a[..., : dh // 2], a[..., dh // 2 :]
        return a * cos + torch.cat([-a2, a1], -1) * sin

    def f() -> Any:
        with torch.inference_mode():
            q = norm(F.linear(xt, t["w_q"]).view(1, n, h, dh), t["q_norm"]).transpose(1, 2)
            k = norm(F.linear(xt, t["w_k"]).view(1, n, h_kv, dh), t["k_norm"]).transpose(1, 2)
            v = F.linear(xt, t["w_v"]).view(1, n, h_kv, dh).transpose(1, 2)
            o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
            return F.linear(o.transpose(1, 2).reshape(1, n, h * dh), t["w_o"])

    return f
