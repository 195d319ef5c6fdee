"""float16 against float32 (``python -m attnlab bench --half``): each family's call on the same
values stored in float16 and in float32, timed in pairs in one process (the two calls of a round
back to back), and issue 31's target that float16 input is never slower than float32 input: the
median of the rounds' ratios, with a 95% interval that says whether a verdict is within the
machine's noise.

The float16 call reads and writes its arrays in float16 where the call does so (every forward,
backward and vjp but those the README lists as widening first) and computes in float32
everywhere, so the two calls do the same arithmetic; what differs is the memory they
move and the conversions.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import build_info, get_num_threads
from .common import NOISY, median_interval, paired, target
from .progress import Progress
from .runner import table, target_lines

__all__ = ["CASES", "format_half", "run_half"]

Call = Callable[[], Any]
# a case's call from (dtype, quick, precision): the same values in that dtype
Builder = Callable[[Any, bool, "str | None"], Call]
# cases whose call takes no precision (no products): left out with precision="bf16"
_NO_PRECISION = ("merge",)


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)  # the same values for both dtypes


def _weights(rng: np.random.Generator, dt: Any, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    return [(rng.standard_normal(s) / np.sqrt(s[0])).astype(dt) for s in shapes]


def _sdpa(dt: Any, quick: bool, precision: str | None, **kw: Any) -> Call:
    import attnlab

    shape = (1, 8, 1024 if quick else 4096, 64)
    q, k, v = (_rng().standard_normal(shape).astype(dt) for _ in range(3))
    return lambda: attnlab.scaled_dot_product_attention(q, k, v, **kw, precision=precision)


def _sdpa_weights(dt: Any, quick: bool, precision: str | None) -> Call:
    import attnlab

    shape = (2 if quick else 8, 6, 197, 64)
    q, k, v = (_rng().standard_normal(shape).astype(dt) for _ in range(3))
    return lambda: attnlab.scaled_dot_product_attention(
        q, k, v, return_weights=True, precision=precision
    )


def _sdpa_backward(dt: Any, quick: bool, precision: str | None) -> Call:
    import attnlab

    shape = (2 if quick else 8, 6, 197, 64)
    g, q, k, v = (_rng().standard_normal(shape).astype(dt) for _ in range(4))
    return lambda: attnlab.scaled_dot_product_attention_backward(g, q, k, v, precision=precision)


def _sdpa_vjp(dt: Any, quick: bool, precision: str | None) -> Call:
    import attnlab

    shape = (2 if quick else 8, 6, 197, 64)
    g, q, k, v = (_rng().standard_normal(shape).astype(dt) for _ in range(4))
    f = attnlab.scaled_dot_product_attention
    return lambda: attnlab.vjp(f, q, k, v, precision=precision)[1](g)


def _decode(dt: Any, quick: bool, precision: str | None, float_q: bool = False) -> Call:
    """One query of 32 heads against a cache of 8 kv heads stored in ``dt``; ``float_q``: the
    query in float32 (the kernel reads a float16 cache as stored, the output is float32)."""
    import attnlab

    rng, n = _rng(), 2048 if quick else 8192
    q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32 if float_q else dt)
    k, v = (rng.standard_normal((1, 8, n, 128)).astype(dt) for _ in range(2))
    return lambda: attnlab.scaled_dot_product_attention(q, k, v, precision=precision)


def _mha(B: int, n: int, d: int, h: int, step: str = "", **kw: Any) -> Builder:
    """A layer's forward with the options ``kw`` (``qk_norm=True``: q/k norms of ones);
    ``step="backward"``: its backward, ``step="vjp"``: ``attnlab.vjp`` and the pullback (a
    training step)."""

    def build(dt: Any, quick: bool, precision: str | None) -> Call:
        import attnlab

        rng = _rng()
        x = rng.standard_normal((2 if quick and B > 2 else B, n, d)).astype(dt)
        wq, wk, wv, wo = _weights(rng, dt, *[(d, d)] * 4)
        opts = dict(kw)
        if opts.pop("qk_norm", False):  # Qwen3's per-head norms, stored as the weights are
            opts.update(q_norm=np.ones(d // h, dt), k_norm=np.ones(d // h, dt))
        args: dict[str, Any] = dict(num_heads=h, w_q=wq, w_k=wk, w_v=wv, w_o=wo, **opts)
        args["precision"] = precision
        f = attnlab.multi_head_attention
        if step == "backward":
            return lambda: attnlab.multi_head_attention_backward(x, x, **args)
        if step == "vjp":
            return lambda: attnlab.vjp(f, x, **args)[1](x)
        return lambda: f(x, **args)

    return build


def _pooled(family: str, backward: bool = False, D: int = 256, n: int = 3136) -> Builder:
    """A pooled family's forward (or backward) of width ``D`` over ``n`` tokens (``n // 4``
    quick)."""

    def build(dt: Any, quick: bool, precision: str | None) -> Call:
        import attnlab

        rng = _rng()
        x = rng.standard_normal((2 if quick else 8, n // 4 if quick else n, D)).astype(dt)
        w: dict[str, Any] = dict(precision=precision)
        if family == "additive":
            wq, wk, wp, wf, wg = _weights(rng, dt, (D, D), (D, D), (D, D), (D, D), (D,))
            w.update(w_q=wq, w_k=wk, w_g=wg, w_proj=wp, w_final=wf)
            if backward:
                return lambda: attnlab.additive_attention_backward(x, x, **w)
            return lambda: attnlab.additive_attention(x, **w)
        wqkv, wo = _weights(rng, dt, (D, 1 + 2 * D), (D, D))
        w.update(w_qkv=wqkv, w_o=wo)
        if backward:
            return lambda: attnlab.separable_attention_backward(x, x, **w)
        return lambda: attnlab.separable_attention(x, **w)

    return build


def _bilinear(dt: Any, quick: bool, precision: str | None, backward: bool = False) -> Call:
    import attnlab

    rng, d, h = _rng(), 384, 6
    x = rng.standard_normal((2 if quick else 8, 197, d)).astype(dt)
    w_qk, w_v, w_o = _weights(rng, dt, (h, d, d), (d, d), (d, d))
    w: dict[str, Any] = dict(num_heads=h, w_qk=w_qk, w_v=w_v, w_o=w_o, precision=precision)
    if backward:
        return lambda: attnlab.bilinear_attention_backward(x, x, **w)
    return lambda: attnlab.bilinear_attention(x, **w)


def _latent(dt: Any, quick: bool, precision: str | None, backward: bool = False) -> Call:
    import attnlab

    from .latent import SIZES

    d, h, r, dn, dr, dv = SIZES
    rng = _rng()
    w_q, w_kv_a, w_kv_b, w_o = _weights(
        rng, dt, (d, h * (dn + dr)), (d, r + dr), (r, h * (dn + dv)), (h * dv, d)
    )
    if backward:  # a prefill's gradients (the weights' dominate at few tokens)
        n = 16 if quick else 64
        xs = rng.standard_normal((1, n, d)).astype(dt)
        w: dict[str, Any] = dict(
            w_q=w_q, w_kv_a=w_kv_a, kv_a_norm=np.ones(r, dt), w_kv_b=w_kv_b, w_o=w_o
        )
        return lambda: attnlab.latent_attention_backward(
            xs, xs, **w, num_heads=h, rope_theta=1e4, causal=True, precision=precision
        )
    cache = rng.standard_normal((1, (1024 if quick else 4096) - 1, r + dr)).astype(dt)
    x = rng.standard_normal((1, 1, d)).astype(dt)
    norm = np.ones(r, dt)
    return lambda: attnlab.latent_attention(
        x,
        w_q=w_q,
        w_kv_a=w_kv_a,
        kv_a_norm=norm,
        w_kv_b=w_kv_b,
        w_o=w_o,
        num_heads=h,
        rope_theta=1e4,
        cache=cache,
        causal="bottom_right",
        return_cache=True,
        precision=precision,
    )


def _merge(dt: Any, quick: bool, precision: str | None) -> Call:
    import attnlab

    del precision  # (none: the merge has no products; not run with --bf16)

    rng, shape = _rng(), (2, 8, 256, 64) if quick else (4, 8, 512, 64)
    outs = [rng.standard_normal(shape).astype(dt) for _ in range(4)]
    lses = [rng.standard_normal(shape[:-1]).astype(np.float32) for _ in range(4)]
    return lambda: attnlab.merge_attention(outs, lses)


# name: (label, shape of the full run, shape of --quick, builder(dtype, quick, precision))
CASES: dict[str, tuple[str, str, str, Builder]] = {
    "sdpa": ("SDPA core", "(1, 8, 4096, 64)", "(1, 8, 1024, 64)", _sdpa),
    "sdpa-causal": (
        "SDPA causal",
        "(1, 8, 4096, 64)",
        "(1, 8, 1024, 64)",
        lambda dt, quick, precision: _sdpa(dt, quick, precision, causal=True),
    ),
    "sdpa-weights": ("SDPA + weights", "(8, 6, 197, 64)", "(2, 6, 197, 64)", _sdpa_weights),
    "sdpa-backward": ("SDPA backward", "(8, 6, 197, 64)", "(2, 6, 197, 64)", _sdpa_backward),
    "sdpa-vjp": ("SDPA vjp + pullback", "(8, 6, 197, 64)", "(2, 6, 197, 64)", _sdpa_vjp),
    "merge": ("merge, 4 parts", "(4, 8, 512, 64)", "(2, 8, 256, 64)", _merge),
    "decode-gqa": ("decode GQA", "32/8 heads x 128, 8192 keys", "2048 keys", _decode),
    "decode-cache": (
        "decode GQA, float32 q",
        "32/8 heads x 128, 8192 keys",
        "2048 keys",
        lambda dt, quick, precision: _decode(dt, quick, precision, float_q=True),
    ),
    "bert": (
        "BERT-base layer",
        "B=1 n=128 d=768 h=12",
        "B=1 n=128 d=768 h=12",
        _mha(1, 128, 768, 12),
    ),
    "bert-backward": (  # few rows: the weights' gradients are a large share of the work
        "BERT-base backward",
        "B=1 n=128 d=768 h=12",
        "B=1 n=128 d=768 h=12",
        _mha(1, 128, 768, 12, "backward"),
    ),
    "vit-s": ("ViT-S layer", "B=8 n=197 d=384 h=6", "B=2 n=197 d=384 h=6", _mha(8, 197, 384, 6)),
    "vit-s-weights": (
        "ViT-S + weights",
        "B=8 n=197 d=384 h=6",
        "B=2 n=197 d=384 h=6",
        _mha(8, 197, 384, 6, return_weights=True),
    ),
    "vit-s-rope": (
        "ViT-S causal rotary",
        "B=8 n=197 d=384 h=6",
        "B=2 n=197 d=384 h=6",
        _mha(8, 197, 384, 6, causal=True, rope_theta=1e4),
    ),
    "vit-s-rope-backward": (
        "ViT-S rotary + q/k norms backward",
        "B=8 n=197 d=384 h=6",
        "B=2 n=197 d=384 h=6",
        _mha(8, 197, 384, 6, "backward", causal=True, rope_theta=1e4, qk_norm=True),
    ),
    "vit-s-backward": (
        "ViT-S backward",
        "B=8 n=197 d=384 h=6",
        "B=2 n=197 d=384 h=6",
        _mha(8, 197, 384, 6, "backward"),
    ),
    "vit-s-vjp": (
        "ViT-S vjp + pullback",
        "B=8 n=197 d=384 h=6",
        "B=2 n=197 d=384 h=6",
        _mha(8, 197, 384, 6, "vjp"),
    ),
    "additive": (
        "SwiftFormer additive",
        "B=8 n=3136 d=256",
        "B=2 n=784 d=256",
        _pooled("additive"),
    ),
    "additive-narrow": (  # SwiftFormer-XS's first stage
        "SwiftFormer additive, narrow",
        "B=8 n=3136 d=48",
        "B=2 n=784 d=48",
        _pooled("additive", D=48),
    ),
    "additive-last": (  # SwiftFormer-L3's last stage: few tokens, wide (the form as written)
        "SwiftFormer additive, last stage",
        "B=8 n=49 d=512",
        "B=2 n=12 d=512",
        _pooled("additive", D=512, n=49),
    ),
    "separable": (
        "MobileViT-v2 separable",
        "B=8 n=3136 d=256",
        "B=2 n=784 d=256",
        _pooled("separable"),
    ),
    "additive-backward": (
        "additive backward",
        "B=8 n=3136 d=256",
        "B=2 n=784 d=256",
        _pooled("additive", backward=True),
    ),
    "separable-backward": (
        "separable backward",
        "B=8 n=3136 d=256",
        "B=2 n=784 d=256",
        _pooled("separable", backward=True),
    ),
    "bilinear": ("bilinear", "B=8 n=197 d=384 h=6", "B=2 n=197 d=384 h=6", _bilinear),
    "bilinear-backward": (
        "bilinear backward",
        "B=8 n=197 d=384 h=6",
        "B=2 n=197 d=384 h=6",
        lambda dt, quick, precision: _bilinear(dt, quick, precision, backward=True),
    ),
    "latent-decode": ("MLA decode step", "1 token after 4095", "1 token after 1023", _latent),
    "latent-backward": (
        "MLA backward",
        "64 tokens",
        "16 tokens",
        lambda dt, quick, precision: _latent(dt, quick, precision, backward=True),
    ),
}


def run_half(
    quick: bool,
    cases: tuple[str, ...] | None = None,
    show_progress: bool = False,
    precision: str | None = None,
) -> dict[str, Any]:
    """Each case's float32 and float16 calls timed round-robin (medians), and the target per
    case. ``cases``: names of :data:`CASES` (default: all; with ``precision``, those whose call
    takes it). ``precision``: passed to both calls (``"bf16"``: bf16 products on both)."""
    names = cases or tuple(c for c in CASES if not (precision and c in _NO_PRECISION))
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise ValueError(
            f"--case: unknown {', '.join(unknown)}; expected one of {', '.join(CASES)}"
        )
    if precision:
        refused = [c for c in names if c in _NO_PRECISION]
        if refused:
            raise ValueError(f"--case: {', '.join(refused)} takes no precision (--bf16)")
    progress = Progress(len(names), show_progress)
    rows: list[dict[str, Any]] = []
    goals: list[dict[str, Any]] = []
    for name in names:
        label, full, small, build = CASES[name]
        progress.step(label)
        t32, t16 = paired(
            build(np.float32, quick, precision),
            build(np.float16, quick, precision),
            repeat=3 if quick else 9,
            min_time=0.2 if quick else 1.0,
        )
        # each round's two calls back to back: the median of their ratios, with its interval
        ratio, lo, hi = median_interval([b / a for a, b in zip(t32, t16, strict=True)])
        shape = small if quick else full
        what = f"{label} {shape}: float16 / float32 time" + (f", {precision}" if precision else "")
        goal = target(what, ratio, "<= 1.0", ratio <= 1.0)
        noise = ", holds 1.0: within the noise" if lo <= 1.0 <= hi else ""
        goal["note"] = f"95% interval {lo:.3f}-{hi:.3f}{noise}"
        goals.append(goal)
        rows.append(
            {
                "case": name,
                "label": label,
                "shape": shape,
                "float32_ms": float(np.median(t32)) * 1e3,
                "float16_ms": float(np.median(t16)) * 1e3,
                "ratio": ratio,
                "interval": [lo, hi],
                "rounds": len(t32),
                "noisy": max(max(t) / min(t) for t in (t32, t16)) >= NOISY,
            }
        )
        progress.finish(f"{ratio:.3f}")
    info = build_info()
    return {
        "date": datetime.date.today().isoformat(),
        "quick": quick,
        "threads": get_num_threads(),
        "isa": info.get("isa"),
        "precision": precision,
        "rows": rows,
        "targets": goals,
    }


def format_half(result: dict[str, Any]) -> str:
    """The table: each case's two medians, the median of the rounds' ratios and its 95%
    interval, then the targets."""
    head = (
        f"attnlab bench --half  {result['date']}  threads={result['threads']}  "
        f"isa={result['isa']}  (float16 inputs against the same values in float32, one "
        "process, in pairs: medians of the times and of the pairs' ratios"
        + (f"; precision={result['precision']!r} on both" if result.get("precision") else "")
        + ")"
    )
    body = [
        [
            r["label"],
            r["shape"],
            f"{r['float32_ms']:.3f}",
            f"{r['float16_ms']:.3f}",
            f"{r['ratio']:.3f}",
            "{:.3f}-{:.3f}".format(*r["interval"]) if "interval" in r else "",
            "NOISY" if r["noisy"] else "",
        ]
        for r in result["rows"]
    ]
    header = ["case", "shape", "float32 ms", "float16 ms", "16 / 32", "95% interval", ""]
    rows = table(header, body, 2)
    title = "Targets, this run (issue 31: float16 input never slower than float32):"
    return "\n".join([head, "", *rows, *target_lines(result["targets"], 70, title)])
