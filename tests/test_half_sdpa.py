"""Half-precision SDPA read and written as stored: ``q``, ``k``, ``v`` in float16 or bfloat16 are
widened inside the kernel (the flash tiles a kv head's key blocks at a time, the decode path as
its kernels load them) and the output rounded as it is written. Widening is exact and the
kernels sum in the same order, so each result must be bit for bit the float32 call on the
widened inputs, rounded: on the tiles' two ways of holding K and V (per thread for heads that
fit, per call for larger ones), the decode path, masks, grouped heads, nonfinite values,
strided and broadcast inputs, and any thread count. The backward likewise reads q, k, v (and a
half-precision grad_out) as stored and rounds dq, dk, dv as it writes them: bit for bit the
float32 backward on the widened arrays, rounded."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import attnlab

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

DTYPES = [
    pytest.param(np.dtype(np.float16), id="float16"),
    pytest.param(
        np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else None,
        id="bfloat16",
        marks=pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes (bfloat16) not installed"),
    ),
]

# (batch, heads, kv heads, n_q, n_k, d, d_v): tiles with per-thread K/V (small heads, several
# query tiles), the per-call copies (n_k (d + d_v) above 2**20 floats on Zen 4, elsewhere above
# half the L2: 2100 x 128 floats on Intel, 1000 x 128 too on the AVX2 EPYC), the decode path
SHAPES = [
    pytest.param((2, 4, 4, 200, 150, 32, 32), id="tiles"),
    pytest.param((1, 4, 2, 97, 300, 64, 48), id="tiles-gqa"),
    pytest.param((1, 2, 2, 100, 1000, 64, 64), id="tiles-head-in-l2"),
    pytest.param((1, 2, 2, 100, 2100, 64, 64), id="tiles-large-head"),
    pytest.param((1, 2, 1, 100, 8300, 64, 64), id="tiles-call-copy"),
    pytest.param((2, 8, 2, 1, 700, 64, 64), id="decode"),
    # rows in several row blocks (AVX-512 holds four), each reading the block's keys as stored
    pytest.param((1, 16, 1, 1, 1100, 64, 48), id="decode-many-rows"),
    pytest.param((2, 8, 2, 3, 700, 32, 37), id="decode-gqa-rows"),
    # heads not a whole number of packets: the decode path's scalar tails (fused alike)
    pytest.param((2, 2, 2, 2, 8, 8, 5), id="decode-narrow"),
    pytest.param((1, 3, 3, 0, 5, 8, 8), id="no-queries"),
    pytest.param((1, 3, 3, 4, 0, 8, 8), id="no-keys"),
]


def _inputs(shape: tuple[int, ...], dtype: np.dtype, seed: int = 0) -> list[np.ndarray]:
    B, h, hk, nq, nk, d, dv = shape
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(s).astype(np.float32).astype(dtype)
        for s in ((B, h, nq, d), (B, hk, nk, d), (B, hk, nk, dv))
    ]


def _check(q: Any, k: Any, v: Any, **kw: Any) -> None:
    dtype = q.dtype
    got = attnlab.scaled_dot_product_attention(q, k, v, **kw)
    want = attnlab.scaled_dot_product_attention(
        *(np.asarray(x, np.float32) for x in (q, k, v)), **kw
    )
    if isinstance(want, tuple):  # (out, lse): the log-sum-exp stays float32
        assert got[1].dtype == np.float32
        np.testing.assert_array_equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(dtype).view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bitwise_the_float32_call_rounded(shape: tuple[int, ...], dtype: np.dtype) -> None:
    _check(*_inputs(shape, dtype))
    _check(*_inputs(shape, dtype), causal=True, return_lse=True)  # the float32 lse, bit for bit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True},
        {"window": (40, 3)},
        {"softcap": 5.0, "return_lse": True},
        {"sinks": "sinks"},
        {"mask": "additive"},
        {"mask": "padding"},
    ],
    ids=["causal", "window", "softcap-lse", "sinks", "additive", "padding"],
)
def test_bitwise_with_masks(shape: tuple[int, ...], dtype: np.dtype, kw: dict[str, Any]) -> None:
    q, k, v = _inputs(shape, dtype, seed=1)
    _check(q, k, v, **_options(kw, shape, seed=2))


def _options(kw: dict[str, Any], shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """``kw`` with its named stand-ins made: ``"sinks"`` (h,), an ``"additive"`` mask (n_q,
    n_k), a ``"padding"`` mask (B, 1, 1, n_k) whose last sequence sees no key (zero rows and
    gradients, never NaN)."""
    B, h, _, nq, nk = shape[:5]
    rng = np.random.default_rng(seed)
    kw = dict(kw)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = rng.standard_normal(h).astype(np.float32)
    if kw.get("mask") == "additive":
        kw["mask"] = rng.standard_normal((nq, nk)).astype(np.float32)
    elif kw.get("mask") == "padding":
        pad = np.ones((B, 1, 1, nk), bool)
        pad[..., nk // 3 :] = False
        pad[-1] = False
        kw["mask"] = pad
        kw["warn_empty_rows"] = False
    return kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_nonfinite_values_as_in_float32(shape: tuple[int, ...], dtype: np.dtype) -> None:
    q, k, v = _inputs(shape, dtype, seed=3)
    v[..., 5, 0] = np.inf
    v[..., -2, -1] = np.nan
    with np.errstate(invalid="ignore"):
        _check(q, k, v, causal=True)
        _check(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_broadcast_inputs(dtype: np.dtype) -> None:
    rng = np.random.default_rng(4)
    # (B, n, h, d) views, as a layer's heads are: row strides of h * d
    q = rng.standard_normal((2, 130, 4, 32)).astype(np.float32).astype(dtype).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 90, 4, 32)).astype(np.float32).astype(dtype).transpose(0, 2, 1, 3)
    v = rng.standard_normal((90, 4, 16)).astype(np.float32).astype(dtype).transpose(1, 0, 2)
    _check(q, k, v)  # v broadcast over the batch
    _check(q[:, :, ::2], k, v, causal="bottom_right")


def _check_backward(q: Any, k: Any, v: Any, g: Any, **kw: Any) -> None:
    got = attnlab.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    f32 = [np.asarray(x, np.float32) for x in (g, q, k, v)]
    want = attnlab.scaled_dot_product_attention_backward(*f32, **kw)
    assert got.keys() == want.keys()
    for name, w in want.items():
        x = kw.get(name) if name in ("mask", "sinks") else {"q": q, "k": k, "v": v}[name]
        dtype = getattr(x, "dtype", np.dtype(np.float32))
        assert got[name].dtype == dtype, name
        assert got[name].shape == w.shape, name
        np.testing.assert_array_equal(
            got[name].view(np.uint8), w.astype(dtype).view(np.uint8), err_msg=name
        )


def _grad_out(q: np.ndarray, dv: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(q.shape[:-1] + (dv,)).astype(np.float32).astype(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_bitwise_the_float32_call_rounded(shape: tuple[int, ...], dtype: np.dtype) -> None:
    """grad_out in the inputs' half dtype (read as stored) and in float32 (read as given)."""
    q, k, v = _inputs(shape, dtype, seed=9)
    g = _grad_out(q, shape[-1], seed=10)
    _check_backward(q, k, v, g)
    _check_backward(q, k, v, g.astype(np.float32), causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:5])
@pytest.mark.parametrize(
    "kw",
    [
        {"causal": "bottom_right"},
        {"window": (40, 3)},
        {"softcap": 5.0},
        {"sinks": "sinks"},
        {"mask": "additive"},
        {"mask": "padding"},
    ],
    ids=["causal", "window", "softcap", "sinks", "additive", "padding"],
)
def test_backward_bitwise_with_masks(
    shape: tuple[int, ...], dtype: np.dtype, kw: dict[str, Any]
) -> None:
    """The gradients of the sinks and of an additive mask stay float32 (their dtype)."""
    q, k, v = _inputs(shape, dtype, seed=11)
    _check_backward(q, k, v, _grad_out(q, shape[-1], seed=13), **_options(kw, shape, seed=12))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_nonfinite_strided_and_broadcast(dtype: np.dtype) -> None:
    """NaN and Inf in the inputs propagate as in float32; strided head views are read in place;
    a key and value broadcast over the batch take the float32 path (their gradients are summed
    over the batch in float32, then rounded)."""
    rng = np.random.default_rng(14)
    q, k, v = _inputs((2, 4, 2, 130, 90, 32, 16), dtype, seed=15)
    v[0, 1, 5, 0] = np.inf
    k[1, 0, 7, 3] = np.nan
    with np.errstate(invalid="ignore"):
        _check_backward(q, k, v, _grad_out(q, 16, seed=16))
    qs = rng.standard_normal((2, 130, 4, 32)).astype(np.float32).astype(dtype).transpose(0, 2, 1, 3)
    ks = rng.standard_normal((2, 90, 2, 32)).astype(np.float32).astype(dtype).transpose(0, 2, 1, 3)
    vb = rng.standard_normal((90, 2, 16)).astype(np.float32).astype(dtype).transpose(1, 0, 2)
    g = _grad_out(qs, 16, seed=17)
    _check_backward(qs, ks, v[0], g, causal=True)  # strided q, k; v of one batch element
    _check_backward(qs[:, :, ::2], ks, vb, g[:, :, ::2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_reads_half_inputs_as_stored(dtype: np.dtype, monkeypatch) -> None:
    """No float32 copy of q, k, v or grad_out is made on the way to the kernel: widening them in
    Python fails this call (the path of test_backward_bitwise_the_float32_call_rounded)."""
    import attnlab._validate

    q, k, v = _inputs((1, 4, 2, 70, 90, 32, 32), dtype, seed=18)
    g = _grad_out(q, 32, seed=19)
    want = attnlab.scaled_dot_product_attention_backward(g, q, k, v)

    def refuse(_: np.ndarray) -> np.ndarray:
        raise AssertionError("widened in Python")

    monkeypatch.setattr(attnlab._validate, "widen", refuse)
    got = attnlab.scaled_dot_product_attention_backward(g, q, k, v)
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint16), want[name].view(np.uint16))
    with pytest.raises(AssertionError, match="widened"):  # the broadcast case does widen
        attnlab.scaled_dot_product_attention_backward(g, q, k[0], v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:])
def test_vjp_reads_half_inputs_as_stored(
    shape: tuple[int, ...], dtype: np.dtype, monkeypatch
) -> None:
    """attnlab.vjp: the forward reads q, k, v as stored and keeps its output in float32 (the
    caller gets it rounded), the pullback reads them as stored too: the output and gradients
    bit for bit the float32 vjp's on the widened arrays, rounded; nothing widened in Python
    (but grad_out when it is float32); and in-place changes of q after the forward do not reach
    the pullback."""
    import attnlab._validate

    q, k, v = _inputs(shape, dtype, seed=21)
    g = _grad_out(q, shape[-1], seed=22)
    kw = {"causal": "bottom_right", "return_lse": True, "warn_empty_rows": False}
    f = attnlab.scaled_dot_product_attention
    want_out, pull32 = attnlab.vjp(f, *(x.astype(np.float32) for x in (q, k, v)), **kw)
    want = pull32(g.astype(np.float32))

    def refuse(_: np.ndarray) -> np.ndarray:
        raise AssertionError("widened in Python")

    monkeypatch.setattr(attnlab._validate, "widen", refuse)
    out, pull = attnlab.vjp(f, q, k, v, **kw)
    assert out[0].dtype == dtype and out[1].dtype == np.float32
    np.testing.assert_array_equal(out[0].view(np.uint16), want_out[0].astype(dtype).view(np.uint16))
    np.testing.assert_array_equal(out[1], want_out[1])
    q[...] = 0  # the pullback differentiates at the values the forward saw
    for grads in (pull(g), pull(g.astype(np.float32))):
        assert grads.keys() == want.keys()
        for name, w in want.items():
            assert grads[name].dtype == dtype
            np.testing.assert_array_equal(
                grads[name].view(np.uint16), w.astype(dtype).view(np.uint16)
            )


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_weights_read_half_inputs_as_stored(dtype: np.dtype, monkeypatch) -> None:
    """return_weights="mean": q, k, v read as stored, each head's weights kept in float32 and
    averaged so, then rounded: bit for bit the float32 call's mean, rounded."""
    import attnlab._validate

    q, k, v = _inputs((2, 4, 2, 70, 90, 32, 32), dtype, seed=20)
    want = attnlab.scaled_dot_product_attention(
        *(x.astype(np.float32) for x in (q, k, v)), causal=True, return_weights="mean"
    )

    def refuse(_: np.ndarray) -> np.ndarray:
        raise AssertionError("widened in Python")

    monkeypatch.setattr(attnlab._validate, "widen", refuse)
    got = attnlab.scaled_dot_product_attention(q, k, v, causal=True, return_weights="mean")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.view(np.uint16), w.astype(dtype).view(np.uint16))


def _check_cache(q: Any, k: Any, v: Any, **kw: Any) -> None:
    """float32 ``q`` against a half-precision ``k``, ``v``: a float32 result, bit for bit the
    float32 call on the widened cache (outputs, weights, log-sum-exp)."""
    got = attnlab.scaled_dot_product_attention(q, k, v, **kw)
    want = attnlab.scaled_dot_product_attention(q, k.astype(np.float32), v.astype(np.float32), **kw)
    got, want = (r if isinstance(r, tuple) else (r,) for r in (got, want))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32 and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_queries_against_a_half_cache(shape: tuple[int, ...], dtype: np.dtype) -> None:
    """The kernel reads the cache as stored (the decode path and the tiles) and the queries
    in place; the output, weights and log-sum-exp stay float32."""
    q, k, v = _inputs(shape, dtype, seed=21)
    q = q.astype(np.float32)
    _check_cache(q, k, v)
    _check_cache(q, k, v, causal="bottom_right", return_lse=True)
    _check_cache(q, k, v, return_weights=True)
    _check_cache(q, k, v, return_weights="mean")
    for kw in ({"window": (40, 3)}, {"mask": "padding"}, {"sinks": "sinks"}):
        _check_cache(q, k, v, **_options(kw, shape, seed=22))
    _check_cache(q[..., ::2, :], k, v, causal="bottom_right")  # strided queries, read in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_cache_is_not_widened_in_python(dtype: np.dtype, monkeypatch) -> None:
    """No float32 copy of the cache is made in Python (decode and tiles); the other dtype
    mixes (a float16 key with a float32 value, float64 queries) widen as before."""
    from conftest import refuse_conversions

    shapes = [(2, 8, 2, 1, 700, 64, 64), (1, 4, 2, 97, 300, 64, 48)]
    calls = []
    for shape in shapes:
        q, k, v = _inputs(shape, dtype, seed=23)
        calls.append((q.astype(np.float32), k, v))
    want = [
        attnlab.scaled_dot_product_attention(q, k.astype(np.float32), v.astype(np.float32))
        for q, k, v in calls
    ]
    refuse_conversions(monkeypatch, {k.shape for _, k, _ in calls} | {v.shape for *_, v in calls})
    for (q, k, v), w in zip(calls, want, strict=True):
        np.testing.assert_array_equal(attnlab.scaled_dot_product_attention(q, k, v), w)
    monkeypatch.undo()
    q, k, v = calls[0]
    mixed = attnlab.scaled_dot_product_attention(q, k, v.astype(np.float32))
    np.testing.assert_array_equal(mixed, want[0])
    wide = attnlab.scaled_dot_product_attention(q.astype(np.float64), k, v)
    assert wide.dtype == np.float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_of_float32_queries_against_a_half_cache(
    shape: tuple[int, ...], dtype: np.dtype, monkeypatch
) -> None:
    """The backward reads the cache as stored too (no conversion of k, v or of their gradients
    in Python) and writes dk, dv in the cache's dtype, dq (and a float mask's and the sinks'
    gradients) in float32: bit for bit the float32 call on the widened cache, rounded."""
    from conftest import refuse_conversions

    q, k, v = _inputs(shape, dtype, seed=24)
    q = q.astype(np.float32)
    rng = np.random.default_rng(25)
    go = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(np.float32)
    kws = [{}, {"causal": "bottom_right"}, {"window": (40, 3)}]
    kws += [_options(kw, shape, seed=26) for kw in ({"mask": "additive"}, {"sinks": "sinks"})]
    wide = (k.astype(np.float32), v.astype(np.float32))
    wants = [attnlab.scaled_dot_product_attention_backward(go, q, *wide, **kw) for kw in kws]
    refuse_conversions(monkeypatch, {k.shape, v.shape})
    for kw, want in zip(kws, wants, strict=True):
        got = attnlab.scaled_dot_product_attention_backward(go, q, k, v, **kw)
        assert sorted(got) == sorted(want)
        for name, w in want.items():
            kind = dtype if name in ("k", "v") else np.dtype(np.float32)
            assert got[name].dtype == kind, name
            np.testing.assert_array_equal(
                got[name].view(np.uint8), w.astype(kind).view(np.uint8), err_msg=name
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": "bottom_right", "return_lse": True}, {"window": (40, 3)}, {"sinks": "sinks"}],
    ids=["plain", "causal-lse", "window", "sinks"],
)
def test_bf16_products_of_half_arrays_as_stored(
    shape: tuple[int, ...], dtype: np.dtype, kw: dict[str, Any], monkeypatch
) -> None:
    """``precision="bf16"`` on half-precision q, k, v (and on float32 q against a half-precision
    cache) makes no float32 copy of them in Python: the decode path rounds a half-precision
    cache's blocks as it reads them, the other paths widen in C++. Bit for bit the bf16 call on the
    widened arrays, rounded; so the weights (as stored, or their mean)."""
    from conftest import refuse_conversions

    q, k, v = _inputs(shape, dtype, seed=27)
    if k.size >= 4:  # subnormals, a NaN, and float16's largest (65504: 65536 in bf16)
        odd = (
            [0x0001, 0x8003, 0x7FC1, 0x0000] if dtype != np.float16 else [1, 0x8003, 0x7E01, 0x7BFF]
        )
        k.reshape(-1).view(np.uint16)[:4] = odd
    kw = dict(_options(kw, shape, seed=28), precision="bf16")
    calls = [((q, k, v), kw, dtype)]
    calls.append(((q.astype(np.float32), k, v), kw, np.dtype(np.float32)))
    if v.size:  # a value row holding Inf: the tiles give way to the emulation, as for floats
        v_inf = v.copy()
        v_inf.reshape(-1)[-1] = np.inf
        calls.append(((q, k, v_inf), kw, dtype))
    if shape[3] * shape[4]:
        calls.extend(((q, k, v), dict(kw, return_weights=m), dtype) for m in (True, "mean"))
    wants = [
        attnlab.scaled_dot_product_attention(*(x.astype(np.float32) for x in a), **o)
        for a, o, _ in calls
    ]
    refuse_conversions(monkeypatch, {q.shape, k.shape, v.shape})
    gots = [attnlab.scaled_dot_product_attention(*a, **o) for a, o, _ in calls]
    monkeypatch.undo()
    for (_, o, stored), got, want in zip(calls, gots, wants, strict=True):
        got_t = got if isinstance(got, tuple) else (got,)
        want_t = want if isinstance(want, tuple) else (want,)
        for i, (g, w) in enumerate(zip(got_t, want_t, strict=True)):
            kind = np.dtype(np.float32) if o.get("return_lse") and i == len(got_t) - 1 else stored
            assert g.dtype == kind and g.shape == w.shape
            np.testing.assert_array_equal(g.view(np.uint8), w.astype(kind).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:7])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "subnormal"])
def test_bf16_backward_of_half_arrays_as_stored(
    shape: tuple[int, ...], dtype: np.dtype, special: bool, monkeypatch
) -> None:
    """The ``precision="bf16"`` backward and ``vjp`` pullback of half-precision q, k, v (and the
    backward of float32 q against a half-precision cache) make no float32 copy of them in
    Python: bfloat16 arrays are read as stored, their own rounding (a kernel scan finds the
    subnormals and NaN the rounding would change: then, and for float16, the kernel widens
    them). Bit for bit the bf16 backward on the widened arrays, rounded."""
    from conftest import refuse_conversions

    q, k, v = _inputs(shape, dtype, seed=29)
    if special:  # q's first feature subnormal (rounded to bf16: zero, and so k's gradient there)
        q[..., 0] = np.float32(1e-39) if dtype != np.float16 else np.float16(1e-7)
    rng = np.random.default_rng(30)
    go = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(np.float32).astype(dtype)
    kws = [{}, {"causal": "bottom_right"}, _options({"sinks": "sinks"}, shape, seed=31)]
    calls = [(go, q, kw) for kw in kws] + [(go.astype(np.float32), q.astype(np.float32), {})]
    wants = [
        attnlab.scaled_dot_product_attention_backward(
            *(a.astype(np.float32) for a in (g, qq, k, v)), **kw, precision="bf16"
        )
        for g, qq, kw in calls
    ]
    # (q's shape may be the output's, which the vjp forward keeps in float32 and rounds)
    refuse_conversions(monkeypatch, {k.shape, v.shape}, read={q.shape})
    for (g, qq, kw), want in zip(calls, wants, strict=True):
        got = attnlab.scaled_dot_product_attention_backward(g, qq, k, v, **kw, precision="bf16")
        pulled = got  # (vjp of float32 q against a half cache widens it, as without bf16)
        if qq.dtype == dtype:
            _, pullback = attnlab.vjp(
                attnlab.scaled_dot_product_attention, qq, k, v, **kw, precision="bf16"
            )
            pulled = pullback(g)
        assert sorted(got) == sorted(want) == sorted(pulled)
        for name, w in want.items():
            kind = dtype if name in ("k", "v") or (name == "q" and qq.dtype == dtype) else w.dtype
            assert got[name].dtype == kind, name
            np.testing.assert_array_equal(
                got[name].view(np.uint8), w.astype(kind).view(np.uint8), err_msg=name
            )
            np.testing.assert_array_equal(pulled[name].view(np.uint8), got[name].view(np.uint8))


def test_same_bits_for_any_thread_count() -> None:
    code = (
        "import numpy as np, attnlab, hashlib\n"
        "rng = np.random.default_rng(5)\n"
        "outs = []\n"
        "for s in [(2, 4, 2, 300, 257, 64, 64), (1, 2, 1, 100, 2100, 64, 64),"
        " (3, 8, 2, 1, 900, 64, 64)]:\n"
        "    B, h, hk, nq, nk, d, dv = s\n"
        "    q, k, v = (rng.standard_normal(x).astype(np.float16) for x in"
        " ((B, h, nq, d), (B, hk, nk, d), (B, hk, nk, dv)))\n"
        "    outs.append(attnlab.scaled_dot_product_attention(q, k, v, causal=True))\n"
        "    g = rng.standard_normal(q.shape).astype(np.float16)\n"
        "    grads = attnlab.scaled_dot_product_attention_backward(g, q, k, v, causal=True)\n"
        "    outs += [grads[n] for n in 'qkv']\n"
        "print(hashlib.sha256(b''.join(o.tobytes() for o in outs)).hexdigest())\n"
    )
    digests = set()
    for threads in ("1", "2", "3"):
        env = dict(os.environ, ATTNLAB_NUM_THREADS=threads)
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        digests.add(run.stdout.strip())
    assert len(digests) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_calls_of_other_shapes_between(dtype: np.dtype) -> None:
    """A thread's widened head belongs to one call: the next call (same head index, other data
    or shape) widens its own."""
    a = _inputs((1, 2, 2, 120, 100, 16, 16), dtype, seed=6)
    b = _inputs((1, 2, 2, 120, 100, 16, 16), dtype, seed=7)
    c = _inputs((1, 2, 2, 120, 60, 16, 24), dtype, seed=8)
    for x in (a, b, c, a):
        _check(*x)


def test_backward_half_binding_refuses_what_it_does_not_read() -> None:
    """The kernel entry point checks every buffer: dtype, shape, and the half format's code."""
    from attnlab._loader import core

    u = np.zeros((1, 2, 3, 4), np.uint16)
    f = np.zeros((1, 2, 3, 4), np.float32)
    lse = np.zeros((1, 2, 3), np.float32)
    args = attnlab._mha._prepare_sdpa(
        {
            **{n: np.zeros((1, 2, 3, 4), np.float16) for n in ("q", "k", "v")},
            "mask": None,
            "causal": False,
            "window": None,
            "softcap": None,
            "alibi_slopes": None,
            "sinks": None,
            "scale": None,
            "precision": None,
            "warn_empty_rows": True,
        },
        half_qkv=True,
    )
    m = args.m.core_mask()

    def run(**over: Any) -> None:
        kw: dict[str, Any] = dict(
            grad_out=u,
            q=u,
            k=u,
            v=u,
            half=1,
            mask=m,
            scale=0.5,
            out=f.copy(),
            lse=lse.copy(),
            d_q=u.copy(),
            d_k=u.copy(),
            d_v=u.copy(),
            grad_out_half=True,
        )
        kw.update(over)
        core.sdpa_backward_half(**kw)

    run()  # the good call
    with pytest.raises(ValueError, match="half: expected 1"):
        run(half=3)
    with pytest.raises(TypeError, match="grad_out"):
        run(grad_out_half=False)  # uint16 given where float32 is read
    with pytest.raises(TypeError, match="d_q"):
        run(d_q=f.copy())
    with pytest.raises(ValueError, match="d_k"):
        run(d_k=np.zeros((1, 2, 4, 4), np.uint16))
    with pytest.raises(TypeError, match="out"):
        run(out=u.copy())
    # float32 queries: a float32 d_q and grad_out, half-precision d_k, d_v
    run(q=f, d_q=f.copy(), grad_out=f, grad_out_half=False)
    with pytest.raises(TypeError, match=r"^grad_out: float32 q's output"):
        run(q=f, d_q=f.copy())
    with pytest.raises(TypeError, match="d_q"):
        run(q=f, grad_out=f, grad_out_half=False)
    # the forward: float32 queries read a half-precision k, v and write a float32 out
    fwd = dict(q=f, k=u, v=u, half=1, mask=m, scale=0.5, lse=None)
    core.sdpa_forward_half(out=f.copy(), **fwd)
    with pytest.raises(TypeError, match="out: float32 q writes a float32 out"):
        core.sdpa_forward_half(out=u.copy(), **fwd)
    with pytest.raises(TypeError, match="k"):
        core.sdpa_forward_half(out=f.copy(), **{**fwd, "k": f})


def test_ragged_cache_beside_float32_queries_is_named() -> None:
    """The half-cache check looks at ndarrays only: a ragged ``k`` or ``v`` is still refused
    with an error that names it (the fuzzer found a backward that read its shape first)."""
    q = np.zeros((1, 2, 3, 4), np.float32)
    g = np.zeros((1, 2, 3, 4), np.float32)
    kv = np.zeros((1, 2, 5, 4), np.float16)
    ragged = [[0.0, 1.0], [2.0]]
    for name in ("k", "v"):
        args = {"k": kv, "v": kv, name: ragged}
        with pytest.raises(TypeError, match=f"^{name}: "):
            attnlab.scaled_dot_product_attention(q, **args)
        with pytest.raises(TypeError, match=f"^{name}: "):
            attnlab.scaled_dot_product_attention_backward(g, q, **args)
