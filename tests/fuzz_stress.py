"""Random calls of every public function: valid ones, valid ones in odd memory layouts, and
broken ones. Shared by ``test_properties.py`` (through hypothesis) and run as a script by
``test_fuzz.py``.

A *case* is a valid call (``Case``): the function, its keyword arguments and an oracle. Builders
draw everything through a ``Chooser`` so that the same code serves hypothesis (which can shrink
the structural choices) and a seeded ``numpy`` generator (the stress run).

Mutations turn a case into

* a **layout** variant (Fortran order, strided or reversed views, read-only, zero-strided
  ``np.broadcast_to`` arrays, misaligned buffers, nested lists): the result must equal the
  call with plain contiguous copies and the inputs must be left untouched;
* an **invalid** call (too few dimensions, mismatched widths, heads that do not divide, bad
  options, complex/object/bool/str data, wrong mask dtypes or shapes, empty feature axes, huge
  sizes): it must raise ``ValueError`` or ``TypeError`` (``MemoryError`` for huge sizes) with a
  message naming the argument;
* (valid calls themselves are checked against their oracle: the float64 reference for
  forwards, central differences of the reference along a random direction for gradients, at
  the tolerances of ``oracle_error``; a mismatch counts as ``wrong``)
* a **NaN/Inf** variant: anything but a crash (a result, or a ``ValueError`` that names the
  argument where the contract refuses non-finite data, as ``factorize_qk`` does);
* a **half-precision** variant (the attention families and their backwards): every float array
  argument stored in float16 or bfloat16; the result must be the float32 call's on the widened
  arrays, rounded to each output's dtype, bit for bit (the main output, and each gradient of a
  half-precision argument, in that half dtype);
* a **vjp** variant (the attention families): ``attnlab.vjp`` of the forward, its arrays stored
  in float16 or bfloat16 three times in ten, gives the forward's output and, although the
  caller's arrays are overwritten before the pullback, the backward's gradients, bit for bit
  (to rounding with ``return_weights``);
* a **bf16** variant (the attention families' float32 forwards): ``precision="bf16"`` against
  the reference with the same operands rounded, within twice the rounding's own effect plus
  ``2**-6`` (``check_bf16``).

As a script: ``python fuzz_stress.py [--calls N] [--seed S]`` makes N random calls (default
10,000) and prints one JSON line of counts: calls, by kind, results, errors by type, wrong
answers and unexpected exceptions (the last two must be 0), the largest oracle error per
family. A crash kills the process, which the caller sees as a non-zero exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import attnlab
from attnlab import reference as R

try:
    import ml_dtypes

    HALF_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
except ImportError:  # bfloat16 is named by ml_dtypes (the test extra)
    HALF_DTYPES = (np.dtype(np.float16),)

# ----------------------------------------------------------------------------- choosers


class Chooser:
    """Where random choices come from: a numpy generator (subclass: hypothesis data)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        return int(self.rng.integers(lo, hi + 1))

    def choice(self, options: Sequence[Any]) -> Any:
        return options[int(self.rng.integers(len(options)))]

    def bool(self, p: float = 0.5) -> bool:
        return bool(self.rng.random() < p)

    def seed(self) -> int:
        return int(self.rng.integers(2**32))


class HypothesisChooser(Chooser):
    """Structural choices drawn through hypothesis (so failures shrink); values from a seed."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self._st = st
        self.data = data
        super().__init__(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed")))

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self._st.integers(lo, hi))

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.data.draw(self._st.integers(0, len(options) - 1))]

    def bool(self, p: float = 0.5) -> bool:
        del p  # hypothesis explores both values whatever the odds
        return self.data.draw(self._st.booleans())

    def seed(self) -> int:
        return int(self.rng.integers(2**32))


# ----------------------------------------------------------------------------- cases

DTYPES = (np.float32, np.float64)


@dataclass
class Case:
    name: str  # the public function
    kwargs: dict[str, Any]  # every argument, by keyword
    dtype: Any  # the result dtype
    ref: Callable[..., Any] | None = None  # float64 oracle with the same keyword arguments
    grad_of: str | None = None  # for a *_backward case: the forward function's name
    arrays: list[str] = field(default_factory=list)  # float array arguments (mutable data)

    @property
    def fn(self) -> Callable[..., Any]:
        return getattr(attnlab, self.name)

    def call(self, **override: Any) -> Any:
        kw = dict(self.kwargs)
        kw.update(override)
        return self.fn(**kw)


def _arr(c: Chooser, shape: tuple[int, ...], dtype: Any, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(c.seed())
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _weight(c: Chooser, fan_in: int, fan_out: int, dtype: Any) -> np.ndarray:
    rng = np.random.default_rng(c.seed())
    b = 1.0 / math.sqrt(max(fan_in, 1))
    return rng.uniform(-b, b, (fan_in, fan_out)).astype(dtype)


def _vec(c: Chooser, n: int, dtype: Any, scale: float = 0.5) -> np.ndarray:
    return _arr(c, (n,), dtype, scale)


def _batch(c: Chooser) -> tuple[int, ...]:
    return tuple(c.int(1, 3) for _ in range(c.int(0, 2)))


def _mask(
    c: Chooser, batch: tuple[int, ...], h: int, n_q: int, n_k: int, dtype: Any
) -> np.ndarray | None:
    """None, a bool mask or a float mask broadcasting to batch + (h, n_q, n_k)."""
    kind = c.choice(("none", "none", "bool", "float", "float_inf"))
    if kind == "none":
        return None
    shape = tuple(s if c.bool() else 1 for s in batch + (h,)) + (n_q, n_k)
    shape = shape[c.int(0, len(batch) + 1) :] if c.bool() else shape  # fewer leading axes
    rng = np.random.default_rng(c.seed())
    if kind == "bool":
        return rng.random(shape) < 0.7
    m = rng.standard_normal(shape).astype(dtype)
    if kind == "float_inf":
        m[rng.random(shape) < 0.3] = -np.inf
    return m


def _kpm(c: Chooser, batch: tuple[int, ...], n_k: int) -> np.ndarray | None:
    if not c.bool(0.3):
        return None
    rng = np.random.default_rng(c.seed())
    shape = tuple(s if c.bool() else 1 for s in batch) + (n_k,)
    return rng.random(shape) < 0.7


def _causal(c: Chooser) -> Any:
    return c.choice((False, False, True, "top_left", "bottom_right"))


def _window(c: Chooser) -> Any:
    if c.bool(0.7):
        return None
    return (c.choice((None, 0, 1, 3)), c.choice((None, 0, 2)))


def _scale(c: Chooser) -> float | None:
    return None if c.bool(0.7) else float(c.choice((0.1, 0.5, 2.0, -1.0)))


def build_sdpa(c: Chooser, dtype: Any) -> Case:
    batch = _batch(c)
    h_kv = c.int(1, 2)
    h = h_kv * c.int(1, 3)
    n_q, n_k, d, d_v = c.int(1, 9), c.int(1, 9), c.int(1, 8), c.int(1, 6)
    kw = dict(
        q=_arr(c, batch + (h, n_q, d), dtype),
        k=_arr(c, batch + (h_kv, n_k, d), dtype),
        v=_arr(c, batch + (h_kv, n_k, d_v), dtype),
        mask=_mask(c, batch, h, n_q, n_k, dtype),
        causal=_causal(c),
        window=_window(c),
        softcap=None if c.bool(0.8) else float(c.choice((0.5, 3.0))),
        alibi_slopes=None if c.bool(0.8) else np.linspace(0.1, 0.5, h),
        sinks=None if c.bool(0.8) else np.linspace(-1.0, 1.0, h),
        return_lse=c.bool(0.2),
        scale=_scale(c),
        return_weights=c.choice((False, False, True, "heads", "mean")),
    )
    if c.bool(0.2):  # batch broadcast between q and k/v
        kw["k"] = kw["k"][(0,) * len(batch)] if batch else kw["k"]
        kw["v"] = kw["v"][(0,) * len(batch)] if batch else kw["v"]
    return Case(
        "scaled_dot_product_attention",
        kw,
        dtype,
        R.scaled_dot_product_attention,
        arrays=["q", "k", "v"],
    )


def build_mha(c: Chooser, dtype: Any) -> Case:
    batch = _batch(c)
    h_kv = c.int(1, 2)
    h = h_kv * c.int(1, 3)
    d_head, d_vhead = c.int(1, 4), c.int(1, 4)
    n_q = c.int(1, 8)
    d_q = c.int(1, 8)
    form = c.choice(("self", "cross", "cross_kv"))
    n_k = n_q if form == "self" else c.int(1, 8)
    d_k = d_q if form == "self" else c.int(1, 8)
    d_v = d_k if form != "cross_kv" else c.int(1, 8)
    d_out = c.int(1, 8)
    kw: dict[str, Any] = dict(query=_arr(c, batch + (n_q, d_q), dtype))
    if form != "self":
        kw["key"] = _arr(c, batch + (n_k, d_k), dtype)
    if form == "cross_kv":
        kw["value"] = _arr(c, batch + (n_k, d_v), dtype)
    kw.update(
        w_q=_weight(c, d_q, h * d_head, dtype),
        w_k=_weight(c, d_k, h_kv * d_head, dtype),
        w_v=_weight(c, d_v, h_kv * d_vhead, dtype),
        w_o=_weight(c, h * d_vhead, d_out, dtype),
    )
    for name, n in (
        ("b_q", h * d_head),
        ("b_k", h_kv * d_head),
        ("b_v", h_kv * d_vhead),
        ("b_o", d_out),
    ):
        if c.bool():
            kw[name] = _vec(c, n, dtype)
    kw.update(
        num_heads=h,
        mask=_mask(c, batch, h, n_q, n_k, dtype),
        key_padding_mask=_kpm(c, batch, n_k),
        causal=_causal(c),
        window=_window(c),
        softcap=None if c.bool(0.85) else float(c.choice((0.5, 3.0))),
        sinks=None if c.bool(0.85) else np.linspace(-1.0, 1.0, h),
        scale=_scale(c),
        return_weights=c.choice((False, False, True, "heads", "mean")),
    )
    if h_kv != h or c.bool(0.2):
        kw["num_kv_heads"] = h_kv
    arrays = [k for k in kw if k in ("query", "key", "value") or k[:2] in ("w_", "b_")]
    return Case("multi_head_attention", kw, dtype, R.multi_head_attention, arrays=arrays)


def build_bilinear(c: Chooser, dtype: Any) -> Case:
    m = build_mha(c, dtype)
    kw = dict(m.kwargs)
    h = kw["num_heads"]
    w_q, w_k = kw.pop("w_q"), kw.pop("w_k")
    b_q, b_k = kw.pop("b_q", None), kw.pop("b_k", None)
    if c.bool():  # a BilinearQK (carries u and the scale) or raw arrays
        kw["w_qk"] = qk = attnlab.collapse_qk(
            w_q, w_k, b_q, b_k, num_heads=h, num_kv_heads=kw.get("num_kv_heads")
        )
        if qk.v is not None or qk.c is not None:  # b_k's terms: refused with a cap or a sink
            kw.pop("softcap", None)
            kw.pop("sinks", None)
    else:
        d_q, d_k = w_q.shape[0], w_k.shape[0]
        kw["w_qk"] = _arr(c, (h, d_q, d_k), dtype, 0.4)
        if c.bool():
            kw["u_k"] = _arr(c, (h, d_k), dtype, 0.4)
    arrays = [k for k in kw if k in ("query", "key", "value", "w_v", "w_o", "b_v", "b_o", "u_k")]
    if isinstance(kw["w_qk"], np.ndarray):
        arrays.append("w_qk")
    return Case("bilinear_attention", kw, dtype, R.bilinear_attention, arrays=arrays)


def build_additive(c: Chooser, dtype: Any) -> Case:
    batch = _batch(c)
    n, d_in, D, d_out = c.int(1, 9), c.int(1, 8), c.int(1, 8), c.int(1, 8)
    kw: dict[str, Any] = dict(
        x=_arr(c, batch + (n, d_in), dtype),
        w_q=_weight(c, d_in, D, dtype),
        w_k=_weight(c, d_in, D, dtype),
        w_g=_arr(c, (D,) if c.bool() else (D, 1), dtype),
        w_proj=_weight(c, D, D, dtype),
        w_final=_weight(c, D, d_out, dtype),
    )
    for name, k in (("b_q", D), ("b_k", D), ("b_proj", D), ("b_final", d_out)):
        if c.bool():
            kw[name] = _vec(c, k, dtype)
    kw["variant"] = c.choice(("official", "hf"))
    kw["scale"] = _scale(c)
    kp = _kpm(c, batch, n)
    if kp is not None:
        kw["key_padding_mask"] = kp
    arrays = [k for k in kw if k == "x" or k[:2] in ("w_", "b_")]
    return Case("additive_attention", kw, dtype, R.additive_attention, arrays=arrays)


def build_separable(c: Chooser, dtype: Any) -> Case:
    batch = _batch(c)
    n, d, d_out = c.int(1, 9), c.int(1, 8), c.int(1, 8)
    kw: dict[str, Any] = dict(
        x=_arr(c, batch + (n, d), dtype),
        w_qkv=_weight(c, d, 1 + 2 * d, dtype),
        w_o=_weight(c, d, d_out, dtype),
    )
    if c.bool():
        kw["b_qkv"] = _vec(c, 1 + 2 * d, dtype)
    if c.bool():
        kw["b_o"] = _vec(c, d_out, dtype)
    kp = _kpm(c, batch, n)
    if kp is not None:
        kw["key_padding_mask"] = kp
    arrays = [k for k in kw if k == "x" or k[:2] in ("w_", "b_")]
    return Case("separable_attention", kw, dtype, R.separable_attention, arrays=arrays)


def build_collapse(c: Chooser, dtype: Any) -> Case:
    h_kv = c.int(1, 2)
    h = h_kv * c.int(1, 3)
    d_head, d_q, d_k = c.int(1, 4), c.int(1, 8), c.int(1, 8)
    kw: dict[str, Any] = dict(
        w_q=_weight(c, d_q, h * d_head, dtype),
        w_k=_weight(c, d_k, h_kv * d_head, dtype),
        num_heads=h,
    )
    if c.bool():
        kw["b_q"] = _vec(c, h * d_head, dtype)
    if c.bool():
        kw["b_k"] = _vec(c, h_kv * d_head, dtype)
    if h_kv != h or c.bool(0.2):
        kw["num_kv_heads"] = h_kv
    return Case(
        "collapse_qk", kw, dtype, R.collapse_qk, arrays=[k for k in kw if k[:2] in ("w_", "b_")]
    )


def build_factorize(c: Chooser, dtype: Any) -> Case:
    h, d_q, d_k = c.int(1, 3), c.int(1, 6), c.int(1, 6)
    kw = dict(w=_arr(c, (h, d_q, d_k), dtype), rank=c.int(1, min(d_q, d_k)))
    return Case("factorize_qk", kw, dtype, R.factorize_qk, arrays=["w"])


def build_latent(c: Chooser, dtype: Any) -> Case:
    batch = _batch(c)
    h, d, d_out = c.int(1, 3), c.int(1, 8), c.int(1, 8)
    r, dr, dn, dv = c.int(2, 6), 2 * c.int(1, 2), c.int(1, 4), c.int(1, 4)
    n = c.int(1, 6)
    n_past = c.choice((0, c.int(1, 6)))
    kw: dict[str, Any] = dict(x=_arr(c, batch + (n, d), dtype))
    if c.bool():  # query compression (q_lora_rank)
        rq = c.int(1, 6)
        kw.update(
            w_q_a=_weight(c, d, rq, dtype),
            q_a_norm=1 + _vec(c, rq, dtype, 0.3),
            w_q_b=_weight(c, rq, h * (dn + dr), dtype),
        )
        if c.bool():
            kw["b_q_a"] = _vec(c, rq, dtype)
    else:
        kw["w_q"] = _weight(c, d, h * (dn + dr), dtype)
    kw.update(
        w_kv_a=_weight(c, d, r + dr, dtype),
        kv_a_norm=1 + _vec(c, r, dtype, 0.3),
        w_kv_b=_weight(c, r, h * (dn + dv), dtype),
        w_o=_weight(c, h * dv, d_out, dtype),
    )
    for name, k in (("b_kv_a", r + dr), ("b_o", d_out)):
        if c.bool():
            kw[name] = _vec(c, k, dtype)
    if n_past:  # the cache may broadcast over the batch
        kw["cache"] = _arr(c, tuple(s if c.bool() else 1 for s in batch) + (n_past, r + dr), dtype)
    n_k = n_past + n
    if c.bool(0.8):
        kw["rope_theta"] = float(c.choice((1e4, 50.0)))
    else:
        kw["rope_inv_freq"] = np.linspace(1.0, 0.05, dr // 2)
    kw.update(
        num_heads=h,
        mask=_mask(c, batch, h, n, n_k, dtype),
        key_padding_mask=_kpm(c, batch, n_k),
        causal=_causal(c),
        window=_window(c),
        softcap=None if c.bool(0.85) else float(c.choice((0.5, 3.0))),
        alibi_slopes=None if c.bool(0.85) else np.linspace(0.1, 0.5, h),
        sinks=None if c.bool(0.85) else np.linspace(-1.0, 1.0, h),
        scale=_scale(c),
        positions=None if c.bool(0.8) else np.arange(n) * c.int(1, 3) + c.int(0, 4),
        rope_scale=None if c.bool(0.8) else 1.3,
        rope_interleave=c.bool(),
        norm_eps=None if c.bool(0.8) else 1e-3,
        form=c.choice(("auto", "expanded", "absorbed")),
        return_weights=c.choice((False, False, True, "heads", "mean")),
        return_lse=c.bool(0.2),
        return_cache=c.bool(0.2),
    )
    arrays = [k for k in kw if k in ("x", "cache") or k[:2] in ("w_", "b_") or k.endswith("norm")]
    return Case("latent_attention", kw, dtype, R.latent_attention, arrays=arrays)


FORWARD_BUILDERS: dict[str, Callable[[Chooser, Any], Case]] = {
    "scaled_dot_product_attention": build_sdpa,
    "multi_head_attention": build_mha,
    "bilinear_attention": build_bilinear,
    "additive_attention": build_additive,
    "separable_attention": build_separable,
    "latent_attention": build_latent,
}
OTHER_BUILDERS: dict[str, Callable[[Chooser, Any], Case]] = {
    "collapse_qk": build_collapse,
    "factorize_qk": build_factorize,
}


def output_of(case: Case) -> np.ndarray:
    """The forward's output (the reference's, in float64), ignoring weights."""
    out = case.ref(**case.kwargs)  # type: ignore[misc]
    return out[0] if isinstance(out, tuple) else out


def backward_case(c: Chooser, fwd: Case) -> Case:
    """The *_backward call for a forward case, with a random grad_out of the output's shape."""
    with np.errstate(all="ignore"):
        shape = output_of(fwd).shape
    kw = dict(fwd.kwargs)
    kw["grad_out"] = _arr(c, shape, fwd.dtype)
    return Case(
        fwd.name + "_backward",
        kw,
        fwd.dtype,
        None,
        grad_of=fwd.name,
        arrays=fwd.arrays + ["grad_out"],
    )


def build(c: Chooser, family: str, dtype: Any) -> Case:
    """A valid case of ``family`` (a public function name, backward ones included)."""
    if family.endswith("_backward"):
        return backward_case(c, FORWARD_BUILDERS[family[: -len("_backward")]](c, dtype))
    builder = FORWARD_BUILDERS.get(family) or OTHER_BUILDERS[family]
    return builder(c, dtype)


FAMILIES = (
    list(FORWARD_BUILDERS) + [f + "_backward" for f in FORWARD_BUILDERS] + list(OTHER_BUILDERS)
)
# the forwards with precision="bf16" (the "bf16" kind): every attention family
BF16_FAMILIES = tuple(FORWARD_BUILDERS)


# ----------------------------------------------------------------------------- layouts

LAYOUTS = ("fortran", "strided", "reversed", "readonly", "broadcast", "unaligned", "list")


def relayout(a: np.ndarray, kind: str, c: Chooser) -> Any:
    """``a`` (or, for "broadcast", a zero-strided array of a's shape) in another layout."""
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "strided":  # every axis strided: a view into a larger buffer
        big = np.zeros(tuple(2 * s + 1 for s in a.shape), a.dtype)
        view = big[tuple(slice(1, None, 2) for _ in a.shape)]
        view[...] = a
        return view
    if kind == "reversed":  # negative strides
        flipped = np.flip(a).copy()
        return np.flip(flipped)
    if kind == "readonly":
        r = a.copy()
        r.setflags(write=False)
        return r
    if kind == "broadcast":  # one axis of length > 1 replaced by a zero stride
        axes = [i for i, s in enumerate(a.shape) if s > 1]
        if not axes:
            return np.broadcast_to(a, a.shape)
        ax = c.choice(axes)
        return np.broadcast_to(np.take(a, [0], axis=ax), a.shape)
    if kind == "unaligned":
        buf = np.zeros(a.nbytes + 1, np.uint8)
        r = buf[1:].view(a.dtype).reshape(a.shape)
        r[...] = a
        return r
    if kind == "list":
        return a.tolist()
    raise ValueError(kind)


def layout_variant(c: Chooser, case: Case) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs in odd layouts, the same values as contiguous float arrays)."""
    odd, plain = dict(case.kwargs), dict(case.kwargs)
    names = [
        n
        for n in case.arrays + ["mask", "key_padding_mask"]
        if isinstance(case.kwargs.get(n), np.ndarray)
    ]
    for name in names:
        if not c.bool(0.6):
            continue
        kind = c.choice(LAYOUTS)
        if kind == "list" and case.kwargs[name].dtype == np.float32:
            kind = "readonly"  # a list of float32 values would become float64
        new = relayout(case.kwargs[name], kind, c)
        odd[name] = new
        plain[name] = np.ascontiguousarray(np.asarray(new, dtype=case.kwargs[name].dtype))
    return odd, plain


# ----------------------------------------------------------------------------- invalid calls


@dataclass
class Invalid:
    kwargs: dict[str, Any]
    names: str  # regex: the argument(s) the message must name
    errors: tuple[type, ...] = (ValueError, TypeError)
    label: str = ""


def _bad_data(c: Chooser, a: np.ndarray) -> Any:
    kind = c.choice(("complex", "object", "bool", "str", "none", "ragged", "datetime"))
    if kind == "complex":
        return a.astype(np.complex128)
    if kind == "object":
        return a.astype(object)
    if kind == "bool":
        return a > 0
    if kind == "str":
        return a.astype(str)
    if kind == "none":
        return None
    if kind == "datetime":
        return np.zeros(a.shape, "datetime64[s]")
    return [[1.0, 2.0], [3.0]]  # ragged


_REQUIRED = {
    "q",
    "k",
    "v",
    "query",
    "x",
    "w_q",
    "w_k",
    "w_v",
    "w_o",
    "w_g",
    "w_proj",
    "w_final",
    "w_qkv",
    "w_qk",
    "w",
    "grad_out",
    "w_kv_a",
    "kv_a_norm",
    "w_kv_b",
}
_HUGE = 2**62


def invalid_variant(c: Chooser, case: Case) -> Invalid:
    """One thing broken in a valid case."""
    kw = dict(case.kwargs)
    fam = case.grad_of or case.name
    options: list[Callable[[], Invalid]] = []

    def data_of(name: str) -> Callable[[], Invalid]:
        def f() -> Invalid:
            bad = _bad_data(c, kw[name])
            if bad is None and name not in _REQUIRED:
                bad = kw[name].astype(np.complex64)  # None is valid for optional arguments
            return Invalid({**kw, name: bad}, name, label=f"data:{name}")

        return f

    def rank_of(name: str) -> Callable[[], Invalid]:
        def f() -> Invalid:
            a = kw[name]
            if name == "w_g":
                bad = np.zeros((a.shape[0], 2), a.dtype)
            elif a.ndim >= 2:
                bad = a.reshape(-1)[: a.shape[-1]]  # too few dimensions
                if fam == "scaled_dot_product_attention" or name in ("w_qk", "w"):
                    bad = a[(0,) * (a.ndim - 2)] if a.ndim >= 3 else bad
                if name == "grad_out":
                    bad = a.reshape(a.shape + (1,))
            else:  # vectors: a matrix
                bad = np.stack([a, a], axis=1)
            return Invalid({**kw, name: bad}, name, label=f"rank:{name}")

        return f

    def width_of(name: str, axis: int, names: str) -> Callable[[], Invalid]:
        def f() -> Invalid:
            a = kw[name]
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, 1)
            return Invalid({**kw, name: np.pad(a, pad)}, names, label=f"width:{name}:{axis}")

        return f

    def option(name: str, values: Sequence[Any], names: str | None = None) -> Callable[[], Invalid]:
        def f() -> Invalid:
            v = c.choice(values)
            errors: tuple[type, ...] = (ValueError, TypeError)
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2**40:
                errors = (ValueError, TypeError, MemoryError, OverflowError)
            return Invalid({**kw, name: v}, names or name, errors, label=f"option:{name}")

        return f

    for name in case.arrays:
        if isinstance(kw.get(name), np.ndarray):
            options.append(data_of(name))
            options.append(rank_of(name))
    if case.grad_of:
        options.append(width_of("grad_out", -1, "grad_out"))
        options.append(width_of("grad_out", -2, "grad_out"))

    bad_ints = (0, -1, 2.5, True, "2", None, _HUGE)
    if fam == "scaled_dot_product_attention":
        options += [width_of("k", -1, "k"), width_of("v", -2, "v"), width_of("k", -3, "k|v")]
        h, n_q, n_k = kw["q"].shape[-3], kw["q"].shape[-2], kw["k"].shape[-2]
        options += _mask_options(kw, c, h, n_q, n_k)
        options.append(
            lambda: Invalid(
                {**kw, "q": kw["q"][..., :0], "k": kw["k"][..., :0]}, "q", label="empty-features"
            )
        )
    if fam in ("multi_head_attention", "bilinear_attention"):
        h = kw["num_heads"]
        xq = kw["query"]
        xk = kw.get("key", xq)
        n_q, n_k = xq.shape[-2], xk.shape[-2]
        options += [
            # self-attention: key and value default to query, so w_k and w_v read it too
            width_of("query", -1, "query|w_q|w_qk" if "key" in kw else "query|w_q|w_qk|w_k|w_v"),
            width_of("w_v", 0, "w_v|value|key|query"),
            width_of("w_o", 0, "w_o"),
            option("num_heads", bad_ints, "num_heads|w_q|w_qk|w_o|w_v"),
            option("num_kv_heads", (0, -2, 1.5, "1", h + 1), "num_kv_heads|w_k|w_v|w_o"),
            option("causal", ("yes", 2, "bottom"), "causal"),
            option("scale", ("a", float("nan"), float("inf"), 1j), "scale"),
            option("return_weights", ("all", 2, None), "return_weights"),
        ]
        if "value" in kw:
            options.append(width_of("value", -2, "value"))
        if "key" in kw:
            options.append(width_of("key", -1, "key|w_k|w_qk|w_v"))
        if "key" in kw:  # batch axes that do not broadcast: (2, ...) against (3, ...)

            def batch_mismatch() -> Invalid:
                new = {k: v for k, v in kw.items() if k not in ("mask", "key_padding_mask")}
                for name, b in (("query", 2), ("key", 3), ("value", 3)):
                    if name in kw:
                        a = kw[name]
                        new[name] = np.broadcast_to(
                            a.reshape((-1,) + a.shape[-2:])[:1], (b,) + a.shape[-2:]
                        ).copy()
                return Invalid(new, "batch|query|key|value", label="batch")

            options.append(batch_mismatch)
        for b in ("b_q", "b_k", "b_v", "b_o"):
            if b in kw:
                options.append(width_of(b, 0, b))
        if fam == "multi_head_attention":
            options.append(width_of("w_q", 1, "w_q|w_k|w_o|num_heads"))
            options.append(width_of("w_k", 0, "w_k|key|query"))
        else:
            if isinstance(kw["w_qk"], np.ndarray):
                options.append(width_of("w_qk", 0, "w_qk"))
                options.append(width_of("w_qk", 2, "w_qk"))
            else:
                options.append(
                    lambda: Invalid(
                        {**kw, "u_k": np.zeros((h, xk.shape[-1]))}, "u_k", label="u_k+qk"
                    )
                )
        options += _mask_options(kw, c, h, n_q, n_k)
        options += _kpm_options(kw, n_k)
        options.append(
            lambda: Invalid(
                {**kw, "query": np.zeros(xq.shape[:-1] + (0,))},
                "query|w_q|w_qk",
                label="empty-features",
            )
        )
    if fam == "additive_attention":
        x = kw["x"]
        options += [
            width_of("x", -1, "x|w_q"),
            width_of("w_k", 1, "w_k"),
            width_of("w_g", 0, "w_g"),
            width_of("w_proj", 0, "w_proj"),
            width_of("w_final", 0, "w_final"),
            option("variant", ("torch", None, 1), "variant"),
            option("eps", (0.0, -1.0, float("nan"), "1e-6", None), "eps"),
            option("scale", ("a", float("inf"), 1j), "scale"),
        ]
        options += _kpm_options(kw, x.shape[-2])
        for b in ("b_q", "b_k", "b_proj", "b_final"):
            if b in kw:
                options.append(width_of(b, 0, b))
    if fam == "separable_attention":
        x = kw["x"]
        options += [
            width_of("x", -1, "x|w_qkv"),
            width_of("w_qkv", 1, "w_qkv"),
            width_of("w_o", 0, "w_o"),
        ]
        options += _kpm_options(kw, x.shape[-2])
        for b in ("b_qkv", "b_o"):
            if b in kw:
                options.append(width_of(b, 0, b))
    if fam == "collapse_qk":
        options += [
            option("num_heads", bad_ints, "num_heads|w_q"),
            option("num_kv_heads", (0, -2, 1.5, kw["num_heads"] + 1), "num_kv_heads|w_k"),
            width_of("w_q", 1, "w_q|num_heads|w_k"),
            width_of("w_k", 1, "w_k"),
        ]
        for b in ("b_q", "b_k"):
            if b in kw:
                options.append(width_of(b, 0, b))
    if fam == "factorize_qk":
        w = kw["w"]
        options += [
            option("rank", (0, -1, 1.5, "2", None, min(w.shape[1:]) + 1), "rank"),
            lambda: Invalid({**kw, "w": np.zeros((w.shape[0], 0, w.shape[2]))}, "w", label="empty"),
            lambda: Invalid(
                {**kw, "w": np.where(np.arange(w.size).reshape(w.shape) == 0, np.nan, w)},
                "w",
                label="nan",
            ),
        ]
    if fam == "latent_attention":
        h = kw["num_heads"]
        x = kw["x"]
        n_q = x.shape[-2]
        n_k = n_q + (kw["cache"].shape[-2] if "cache" in kw else 0)
        options += [
            width_of("x", -1, "x|w_q|w_q_a|w_kv_a"),
            width_of("w_kv_a", 1, "w_kv_a|w_q|w_q_b|kv_a_norm"),
            width_of("w_kv_b", 0, "w_kv_b|kv_a_norm"),
            width_of("w_kv_b", 1, "w_kv_b"),
            width_of("w_o", 0, "w_o"),
            width_of("kv_a_norm", 0, "kv_a_norm"),
            option("num_heads", bad_ints, "num_heads|w_q|w_kv_b|w_o"),
            option("form", ("fast", 1, None), "form"),
            option("rope_theta", ("a", -1.0, float("nan")), "rope_theta"),
            option("rope_interleave", ("yes", 1, None), "rope_interleave"),
            option("norm_eps", ("a", 0.0, float("inf")), "norm_eps"),
            option("return_cache", ("yes", 1), "return_cache"),
            option("positions", (np.arange(n_q + 1), "a"), "positions"),
        ]
        if "cache" in kw:
            options.append(width_of("cache", -1, "cache"))
        if "w_q" in kw:
            options.append(width_of("w_q", 1, "w_q"))
            options.append(lambda: Invalid({**kw, "w_q_a": np.ones((1, 1))}, "w_q", label="q+lora"))
        else:
            options.append(width_of("q_a_norm", 0, "q_a_norm"))
            options.append(width_of("w_q_b", 0, "w_q_b"))
        for b in ("b_q_a", "b_kv_a", "b_o"):
            if b in kw:
                options.append(width_of(b, 0, b))
        options += _mask_options(kw, c, h, n_q, n_k)
        options += _kpm_options(kw, n_k)
    if fam in (
        "scaled_dot_product_attention",
        "multi_head_attention",
        "bilinear_attention",
        "latent_attention",
    ):
        options.append(option("causal", ("yes", 3, "bottom"), "causal"))
        options.append(option("window", (3, (-1, 0), (0, 1.5), (1, 2, 3), "ab"), "window"))
        options.append(option("softcap", (0.0, -1.0, float("nan"), "a"), "softcap"))
        options.append(option("alibi_slopes", ([float("nan")], np.ones(7), "a"), "alibi_slopes"))
        options.append(option("sinks", ([float("inf")], np.ones(7)), "sinks"))
        options.append(option("return_weights", ("all", 2), "return_weights"))
        if fam == "scaled_dot_product_attention":
            options.append(option("scale", ("a", float("nan"), float("-inf"), 1j), "scale"))
    return c.choice(options)()


def _mask_options(
    kw: dict[str, Any], c: Chooser, h: int, n_q: int, n_k: int
) -> list[Callable[[], Invalid]]:
    def wrong_dtype() -> Invalid:
        m = c.choice(
            (
                np.ones((n_q, n_k), np.int64),
                np.ones((n_q, n_k), complex),
                np.full((n_q, n_k), "a"),
                np.ones((n_q, n_k), object),
            )
        )
        return Invalid({**kw, "mask": m}, "mask", label="mask-dtype")

    def wrong_shape() -> Invalid:
        m = np.ones((n_q + 1, n_k), bool) if c.bool() else np.ones((h + 1, n_q, n_k))
        if h + 1 == 1:
            m = np.ones((n_q, n_k + 1), bool)
        return Invalid({**kw, "mask": m}, "mask", label="mask-shape")

    return [wrong_dtype, wrong_shape]


def _kpm_options(kw: dict[str, Any], n_k: int) -> list[Callable[[], Invalid]]:
    return [
        lambda: Invalid(
            {**kw, "key_padding_mask": np.ones(n_k)}, "key_padding_mask", label="kpm-dtype"
        ),
        lambda: Invalid(
            {**kw, "key_padding_mask": np.ones(n_k + 1, bool)},
            "key_padding_mask",
            label="kpm-shape",
        ),
    ]


def huge_variant(c: Chooser, case: Case) -> Invalid:
    """A call whose result or work buffers could never be allocated (zero-strided inputs of
    astronomical shape): MemoryError or ValueError, never a crash."""
    fam = case.grad_of or case.name
    # Far beyond any machine (and beyond Linux's heuristic overcommit, which would otherwise
    # hand out the memory and let the process be killed when it is touched).
    kw = dict(case.kwargs)
    if fam == "scaled_dot_product_attention":
        q = kw["q"]
        kw["q"] = np.broadcast_to(q[..., :1, :], q.shape[:-2] + (2**42, q.shape[-1]))
        kw["return_weights"] = True
        kw.pop("mask", None)
    elif fam in ("multi_head_attention", "bilinear_attention"):
        xq = kw["query"]
        kw["query"] = np.broadcast_to(
            xq.reshape(-1, xq.shape[-1])[:1], (2**20, 2**21) + xq.shape[-1:]
        )
        for k in ("key", "value", "mask", "key_padding_mask"):
            kw.pop(k, None)
    elif fam in ("additive_attention", "separable_attention", "latent_attention"):
        x = kw["x"]
        kw["x"] = np.broadcast_to(x.reshape(-1, x.shape[-1])[:1], (2**20, 2**21) + x.shape[-1:])
        for k in ("key_padding_mask", "mask", "cache", "positions"):
            kw.pop(k, None)
    else:
        return invalid_variant(c, case)
    if case.grad_of:
        kw["grad_out"] = np.zeros(1)  # would be checked after the (huge) forward shapes
    # MemoryError says what it could not allocate; a ValueError may name any argument (the
    # sizes are checked against each other before anything is allocated)
    return Invalid(kw, ".", (MemoryError, ValueError), label="huge")


def nonfinite_variant(c: Chooser, case: Case) -> dict[str, Any]:
    kw = dict(case.kwargs)
    name = c.choice([n for n in case.arrays if isinstance(kw.get(n), np.ndarray) and kw[n].size])
    a = kw[name].copy()
    rng = np.random.default_rng(c.seed())
    idx = tuple(int(rng.integers(s)) for s in a.shape)
    a[idx] = c.choice((np.nan, np.inf, -np.inf))
    kw[name] = a
    return kw


# ----------------------------------------------------------------------------- checks


def message_names(exc: BaseException, names: str) -> bool:
    return re.search(names, str(exc)) is not None


def compare(got: Any, want: Any, dtype: Any, tol: float | None = None, floor: float = 0.0) -> float:
    """Largest normwise relative error |got - want| / (|want| + max(max|want|, floor)), NaN
    positions must agree; raises AssertionError on a mismatch beyond ``tol`` (default per
    dtype). ``floor``: the scale of the computation, for results that are (mathematically) 0
    and come out as rounding noise, as the query gradient when there is a single key."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        return max(compare(g, w, dtype, tol, floor) for g, w in zip(got, want, strict=True))
    got = np.asarray(got)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert got.dtype == np.dtype(dtype), f"dtype {got.dtype} != {np.dtype(dtype)}"
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), "NaN positions differ"
    ok = ~nan_w
    if not ok.any():
        return 0.0
    g, w = got[ok].astype(np.float64), want[ok]
    assert np.array_equal(np.isinf(g), np.isinf(w)), "Inf positions differ"
    fin = np.isfinite(w)
    g, w = g[fin], w[fin]
    if w.size == 0:
        return 0.0
    tol = (1e-5 if np.dtype(dtype) == np.float32 else 1e-12) if tol is None else tol
    scale = np.abs(w) + max(float(np.max(np.abs(w))), floor, 1e-300)
    err = float(np.max(np.abs(g - w) / scale))
    assert err <= tol, f"normwise relative error {err:.3e} > {tol:.1e}"
    return err


def grad_scale(grads: dict[str, np.ndarray]) -> float:
    """The largest finite gradient entry: the scale rounding noise is measured against."""
    m = [float(np.max(np.abs(g[np.isfinite(g)]))) for g in grads.values() if np.isfinite(g).any()]
    return max(m, default=0.0)


def directional_error(case: Case, grads: dict[str, np.ndarray], rng: np.random.Generator) -> float:
    """Largest |<grad, D> - (f(x + eD) - f(x - eD)) / 2e| / ((|grad| + noise) |D| + floor) over
    the array arguments of a ``*_backward`` case, f = <grad_out, reference forward>, in float64
    (noise and floor: the rounding allowances below)."""
    fwd = {k: v for k, v in case.kwargs.items() if k != "grad_out"}
    g_out = np.asarray(case.kwargs["grad_out"], np.float64)
    ref = getattr(R, case.grad_of)  # type: ignore[arg-type]

    def f(kw: dict) -> float:
        out = ref(**kw)
        out = out[0] if isinstance(out, tuple) else out
        return float(np.sum(g_out * out))

    out0 = ref(**fwd)
    out0 = out0[0] if isinstance(out0, tuple) else out0
    # Rounding in f is ~1e-16 * sum|g_out * out|, amplified 1/e by the difference quotient: a
    # floor for arguments whose gradient is (mathematically) zero, as b_k's in MHA.
    floor = 1e-3 * float(np.sum(np.abs(g_out * out0))) + 1e-12
    # A gradient that is mathematically 0 (b_k's; x's through a normalisation that makes the
    # output scale-invariant in it) is rounding noise of the size of the call's largest gradient
    # times the dtype's eps, or more where the cancelling terms are larger (1 / |q| of a short
    # q): each argument may err by 100 eps of the largest gradient beside GRAD_TOL of its own.
    big = max(
        (float(np.linalg.norm(g)) for g in grads.values() if np.isfinite(g).all()), default=0.0
    )
    noise = 100 * float(np.finfo(case.dtype).eps) * big / GRAD_TOL[np.dtype(case.dtype)]

    worst = 0.0
    for name in case.arrays:
        if name == "grad_out" or not isinstance(fwd.get(name), np.ndarray):
            continue
        x = fwd[name].astype(np.float64)
        if x.size == 0:
            continue
        d = rng.standard_normal(x.shape)
        an = float(np.sum(grads[name].astype(np.float64) * d))
        scale = float((np.linalg.norm(grads[name]) + noise) * np.linalg.norm(d)) + floor

        # Each step has its failure: one that crosses a kink (a ReLU input within e |D| of 0,
        # as MobileViT-v2's value branch can draw) mixes the two one-sided slopes; a short one
        # divides f's rounding by e, which the floor underrates when out is a small difference
        # of larger terms (a bias cancelling the rest: latent attention, seed 28). So a
        # gradient agrees if it matches the central differences at one of three steps.
        err = math.inf
        for e in (1e-6, 1e-8, 1e-4):
            plus, minus = dict(fwd), dict(fwd)
            plus[name], minus[name] = x + e * d, x - e * d
            err = min(err, abs((f(plus) - f(minus)) / (2 * e) - an) / scale)
            if err <= GRAD_TOL[np.dtype(case.dtype)]:
                break
        worst = max(worst, err)
    return worst


# Documented tolerances of a valid call against its oracle: forward results normwise 1e-5
# (float32) / 1e-12 (float64) against the float64 reference (compare's defaults); gradients
# along a random direction 5e-4 / 1e-6 of |grad| |D| against central differences of the
# reference (float32: up to 1.2e-4 seen over 10,000 calls, on b_k, whose gradient is
# mathematically 0); factorize_qk's products 1e-4 / 1e-10 (an SVD of float32 data in float32).
GRAD_TOL = {np.dtype(np.float32): 5e-4, np.dtype(np.float64): 1e-6}
FACTORIZE_TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-10}


def oracle_error(case: Case, got: Any, rng: np.random.Generator) -> float:
    """Error of ``got`` (the result of ``case.call()``) against the case's oracle; raises
    AssertionError beyond the documented tolerance."""
    dtype = np.dtype(case.dtype)
    with np.errstate(all="ignore"):
        if case.grad_of is not None:
            err = directional_error(case, got, rng)
            assert err <= GRAD_TOL[dtype], (
                f"gradient off the finite differences by {err:.3e} > {GRAD_TOL[dtype]:.0e}"
            )
            return err
        if case.name == "factorize_qk":
            w, r = case.kwargs["w"], case.kwargs["rank"]
            rq, rk, rrel = R.factorize_qk(w, r)
            w_q, w_k, rel = got
            assert w_q.dtype == w_k.dtype == rel.dtype == dtype
            heads = range(w.shape[0])
            cols = [slice(i * r, (i + 1) * r) for i in heads]
            prod = np.stack([w_q[:, c] @ w_k[:, c].T for c in cols])
            want = np.stack([rq[:, c] @ rk[:, c].T for c in cols])
            err = compare(prod.astype(dtype), want, dtype, FACTORIZE_TOL[dtype])
            np.testing.assert_allclose(rel, rrel, atol=50 * np.finfo(dtype).eps ** 0.5)
            return err
        want = case.ref(**case.kwargs)  # type: ignore[misc]
        if case.name == "collapse_qk":
            assert got.d_head == want.d_head
            err = 0.0
            for f in ("w", "u", "v", "c"):
                g, w = getattr(got, f), getattr(want, f)
                assert (g is None) == (w is None), f
                if g is not None:
                    err = max(err, compare(g, w, dtype))
            return err
        if isinstance(got, tuple) and case.kwargs.get("return_lse"):
            # the log-sum-exp m + log(l) rounds at the scale of the logits (about 1), not of
            # its own value, which can cancel to near 0: held to that scale
            lse = compare(got[-1], want[-1], dtype, floor=1.0)
            return max(compare(got[:-1], want[:-1], dtype), lse)
        return compare(got, want, dtype)


def results_equal(a: Any, b: Any, dtype: Any) -> None:
    """Same result up to the rounding of a different memory layout (tight)."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), (sorted(a), sorted(b))
        floor = grad_scale(b)
        for k in a:
            compare(a[k], b[k], dtype, 1e-6 if np.dtype(dtype) == np.float32 else 1e-13, floor)
        return
    if isinstance(a, attnlab.BilinearQK):
        for f in ("w", "u", "v", "c"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), f
            if x is not None:
                compare(x, y, dtype, 1e-6 if np.dtype(dtype) == np.float32 else 1e-13)
        return
    compare(a, b, dtype, 1e-6 if np.dtype(dtype) == np.float32 else 1e-13)


def half_variant(case: Case, half: np.dtype) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs with every float array argument stored in ``half``, the same values widened to
    float32: exactly)."""
    stored, widened = dict(case.kwargs), dict(case.kwargs)
    for name in case.arrays:
        a = case.kwargs.get(name)
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            stored[name] = a.astype(half)
            widened[name] = stored[name].astype(np.float32)
    qk = case.kwargs.get("w_qk")
    if isinstance(qk, attnlab.BilinearQK):  # its arrays too
        fields = {f: getattr(qk, f) for f in ("w", "u", "v", "c")}
        halves = {f: None if a is None else a.astype(half) for f, a in fields.items()}
        stored["w_qk"] = dataclasses.replace(qk, **halves)
        widened["w_qk"] = dataclasses.replace(
            qk, **{f: None if a is None else a.astype(np.float32) for f, a in halves.items()}
        )
    return stored, widened


def same_bits(got: Any, want: Any) -> None:
    """``got`` is ``want`` (float32) rounded to ``got``'s dtype, bit for bit (NaN where it is)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for k in want:
            same_bits(got[k], want[k])
        return
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            same_bits(g, w)
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert got.dtype in (*HALF_DTYPES, np.dtype(np.float32)), f"dtype {got.dtype}"
    rounded = want.astype(got.dtype)
    nan = np.isnan(rounded.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan), "NaN positions differ"
    bits = f"u{got.itemsize}"
    assert np.array_equal(got[~nan].view(bits), rounded[~nan].view(bits)), (
        "not the float32 call's result rounded"
    )


def check_half(case: Case, half: np.dtype, cache: bool = False) -> None:
    """The half-precision variant of a valid case against the float32 call on the widened
    arrays (``same_bits``), and the dtypes: the forward's output, and each gradient of a
    half-precision argument, stored in ``half``. ``cache`` (SDPA): ``q`` stays float32 against
    the half-precision ``k``, ``v``; the output and ``q``'s gradient are float32."""
    stored, widened = half_variant(case, half)
    if cache:
        stored["q"] = widened["q"]
    got, want = case.fn(**stored), case.fn(**widened)
    same_bits(got, want)
    if case.grad_of is None:
        out = got[0] if isinstance(got, tuple) else got
        expected = np.dtype(np.float32) if cache else half
        assert out.dtype == expected, f"output dtype {out.dtype}, not {expected}"
    else:
        for name, g in got.items():
            if name in case.arrays and name != "grad_out":
                expected = np.dtype(np.float32) if cache and name == "q" else half
                assert g.dtype == expected, f"gradient of {name}: dtype {g.dtype}, not {expected}"


def same_result(got: Any, want: Any, where: str = "output") -> None:
    """The same arrays, bit for bit (NaN where NaN, the same dtypes and shapes)."""
    if isinstance(want, (tuple, dict)):
        assert type(got) is type(want) and len(got) == len(want), where
        keys = sorted(want) if isinstance(want, dict) else range(len(want))
        if isinstance(want, dict):
            assert sorted(got) == keys, (sorted(got), keys)
        for k in keys:
            same_result(got[k], want[k], f"{where}[{k!r}]")
        return
    if want is None:
        assert got is None, where
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
    )
    bits = f"u{got.itemsize}"
    assert np.array_equal(got.view(bits), want.view(bits)), f"{where}: not the same bits"


def check_vjp(c: Chooser, case: Case) -> None:
    """``attnlab.vjp`` of a backward case's forward (its float arrays stored in float16 or
    bfloat16 three times in ten): the output is the forward's and the pullback gives the
    backward's gradients, bit for bit, although the caller's arrays were overwritten between
    the forward and the pullback (the forward keeps its own copies). With ``return_weights``
    the forward runs the dense path: its pullback then equals the backward to rounding."""
    kw = dict(case.kwargs)
    if c.bool(0.3):
        kw = half_variant(case, c.choice(HALF_DTYPES))[0]
    grad_out = kw.pop("grad_out")
    f = getattr(attnlab, case.grad_of or "")
    want_out = f(**kw)
    want = case.fn(grad_out=grad_out, **kw)
    out, pullback = attnlab.vjp(f, **kw)
    same_result(out, want_out)
    for name in case.arrays:  # the caller's arrays change in place after the forward
        a = kw.get(name)
        if isinstance(a, np.ndarray) and a.flags.writeable and a.size:
            a[...] = 0.375
    got = pullback(grad_out)
    if not kw.get("return_weights"):
        same_result(got, want, "gradient")
        return
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    floor = grad_scale({k: np.asarray(g, np.float64) for k, g in want.items()})
    for k in want:
        dt = np.dtype(want[k].dtype)
        tol = 1e-5 if dt == np.float32 else 1e-12 if dt == np.float64 else 2e-2
        compare(got[k], np.asarray(want[k], np.float64), dt, tol, floor)


def _parts(result: Any) -> list[np.ndarray]:
    return [np.asarray(r) for r in (result if isinstance(result, tuple) else (result,))]


def check_bf16(case: Case) -> float:
    """``precision="bf16"`` on a float32 forward: every output float32, NaN where the reference
    with the same operands rounded (in float64) has NaN, and normwise within twice that
    reference's distance to the exact one (the rounding's own effect) plus ``2**-6``: the
    float32 sums' order can round an intermediate at a boundary to its neighbour, and the
    kernels round the probabilities, which the reference leaves out. Returns the error."""
    kw = {**case.kwargs, "precision": "bf16"}
    got, same, exact = case.fn(**kw), case.ref(**kw), case.ref(**case.kwargs)  # type: ignore[misc]
    err = 0.0
    for g, sm, ex in zip(_parts(got), _parts(same), _parts(exact), strict=True):
        assert g.dtype == np.float32 and g.shape == sm.shape, (g.dtype, g.shape, sm.shape)
        assert np.array_equal(np.isnan(g), np.isnan(sm)), "NaN positions differ"
        fin = np.isfinite(sm) & np.isfinite(ex)
        norm = float(np.linalg.norm(sm[fin]))
        if norm == 0.0:
            continue
        effect = float(np.linalg.norm(sm[fin] - ex[fin])) / norm
        e = float(np.linalg.norm(g[fin].astype(np.float64) - sm[fin])) / norm
        assert e <= 2 * effect + 2.0**-6, f"bf16 error {e:.3e}, the rounding's effect {effect:.3e}"
        err = max(err, e)
    return err


def snapshot(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}


def unchanged(before: dict[str, Any], kw: dict[str, Any]) -> bool:
    for k, v in before.items():
        if isinstance(v, np.ndarray) and not np.array_equal(v, kw[k], equal_nan=True):
            return False
    return True


# ----------------------------------------------------------------------------- stress run

KINDS = ("valid", "layout", "invalid", "nonfinite", "huge", "half", "vjp", "bf16")
_KIND_P = (0.21, 0.17, 0.31, 0.1, 0.02, 0.06, 0.05, 0.08)


def _checked(
    check: Callable[[], None], counter: str, where: str, counts: Counter, problems: list[str]
) -> None:
    """A valid call's check: a result counted under ``counter``; a failed check (an
    ``AssertionError``) a wrong answer; any other exception from a valid call a defect."""
    try:
        check()
        counts["result"] += 1
        counts[counter] += 1
    except AssertionError as exc:
        counts["result"] += 1
        counts["wrong"] += 1
        problems.append(f"{where}: {exc}")
    except Exception as exc:  # noqa: BLE001 (any other exception from a valid call is a defect)
        counts["unexpected"] += 1
        problems.append(f"{where}: {type(exc).__name__}: {exc}")


def one_call(c: Chooser, counts: Counter, problems: list[str]) -> None:
    family = c.choice(FAMILIES)
    dtype = c.choice(DTYPES)
    case = build(c, family, dtype)
    kind = KINDS[int(np.searchsorted(np.cumsum(_KIND_P), c.rng.random()))]
    if kind in ("half", "vjp") and family in OTHER_BUILDERS:  # collapse_qk, factorize_qk
        kind = "valid"
    # precision="bf16": the forwards that have it, on float32
    if kind == "bf16" and (np.dtype(dtype) != np.float32 or family not in BF16_FAMILIES):
        kind = "valid"
    if kind == "vjp" and case.grad_of is None:  # a forward: vjp against its backward
        case = backward_case(c, case)
    counts[f"kind:{kind}"] += 1
    counts[f"family:{family}"] += 1
    where = f"{family} {np.dtype(dtype).name} {kind}"
    if kind == "valid":

        def oracle() -> None:
            err = oracle_error(case, case.call(), np.random.default_rng(c.seed()))
            key = f"max_err:{family} {np.dtype(dtype).name}"
            counts[key] = max(counts.get(key, 0.0), err)

        _checked(oracle, "checked", where, counts, problems)
        return
    if kind == "half":
        half = c.choice(HALF_DTYPES)
        # three SDPA calls in ten: float32 queries against a half-precision cache (the
        # backward widens it; the gradients' dtypes are those of the arguments all the same)
        cache = case.name.startswith("scaled_dot_product_attention") and c.bool(0.3)
        if cache:
            counts["half_cache_checked"] += 1
        _checked(
            lambda: check_half(case, half, cache),
            "half_checked",
            f"{where} {half.name}{' cache' if cache else ''}",
            counts,
            problems,
        )
        return
    if kind == "vjp":
        _checked(lambda: check_vjp(c, case), "vjp_checked", where, counts, problems)
        return
    if kind == "bf16":

        def bf16() -> None:
            key = f"max_err:{family} bf16"
            counts[key] = max(counts.get(key, 0.0), check_bf16(case))

        _checked(bf16, "bf16_checked", where, counts, problems)
        return
    if kind == "nonfinite":
        kw = nonfinite_variant(c, case)
        try:
            case.call(**kw)
            counts["result"] += 1
        except (ValueError, TypeError) as exc:
            # the contract refuses non-finite data only where the maths is undefined (the SVD)
            if kind == "nonfinite" and family == "factorize_qk" and message_names(exc, "w"):
                counts[f"error:{type(exc).__name__}"] += 1
            else:
                counts["unexpected"] += 1
                problems.append(f"{where}: {type(exc).__name__}: {exc}")
        return
    if kind == "layout":
        odd, plain = layout_variant(c, case)
        before = snapshot(odd)
        try:
            got = case.fn(**odd)
            want = case.fn(**plain)
            results_equal(got, want, dtype)
            assert unchanged(before, odd), "an input was modified"
            counts["result"] += 1
        except AssertionError as exc:
            counts["wrong"] += 1
            problems.append(f"{where}: {exc}")
        except Exception as exc:  # noqa: BLE001 (any exception but the failed check is a defect)
            counts["unexpected"] += 1
            problems.append(f"{where}: {type(exc).__name__}: {exc}")
        return
    bad = invalid_variant(c, case) if kind == "invalid" else huge_variant(c, case)
    try:
        case.fn(**bad.kwargs)
    except bad.errors as exc:
        counts[f"error:{type(exc).__name__}"] += 1
        if not message_names(exc, bad.names):
            counts["unnamed"] += 1
            problems.append(f"{where} {bad.label}: message does not name {bad.names!r}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 (the wrong exception type is a defect)
        counts["unexpected"] += 1
        problems.append(f"{where} {bad.label}: {type(exc).__name__}: {exc}")
        return
    counts["accepted_invalid"] += 1
    problems.append(f"{where} {bad.label}: no error raised")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=20240607)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    np.seterr(all="ignore")
    c = Chooser(np.random.default_rng(args.seed))
    counts: Counter = Counter()
    problems: list[str] = []
    start = time.perf_counter()
    abort_at = int(os.environ.get("ATTNLAB_FUZZ_ABORT_AT", "-1"))  # the harness's self-test
    for i in range(args.calls):
        if i == abort_at:
            os.abort()
        one_call(c, counts, problems)
        counts["calls"] += 1
    report = dict(counts)
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["problems"] = problems[:50]
    # No "crashes" field: a crash kills this process, and the caller sees the exit status.
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
