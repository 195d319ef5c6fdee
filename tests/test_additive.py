"""Efficient additive attention (SwiftFormer) and separable self-attention (MobileViT-v2).

Against the NumPy reference over a grid, against PyTorch transcriptions of the official modules
(Amshaker/SwiftFormer ``EfficientAdditiveAttnetion`` after July 2023, apple/ml-cvnets
``LinearSelfAttention``) and against ``transformers``' ports when installed; edge cases (n = 1,
tiny and zero-norm rows hitting eps, padding) and error paths.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab import reference as R
from attnlab._loader import core
from torch_modules import official_swiftformer_module

DTYPES = [np.float64, np.float32]


# ----------------------------------------------------------------------------- weights


def additive_weights(
    rng: np.random.Generator,
    d_in: int,
    D: int,
    d_out: int,
    *,
    bias: bool = True,
    dtype: Any = np.float64,
) -> dict[str, np.ndarray]:
    """Keyword arguments w_q .. b_final, nn.Linear-like U(+-1/sqrt(fan_in)); w_g ~ N(0, 1)."""
    shapes = {"q": (d_in, D), "k": (d_in, D), "proj": (D, D), "final": (D, d_out)}
    out: dict[str, np.ndarray] = {}
    for name, (fi, fo) in shapes.items():
        bound = 1.0 / math.sqrt(max(fi, 1))
        out[f"w_{name}"] = rng.uniform(-bound, bound, (fi, fo)).astype(dtype)
        if bias:
            out[f"b_{name}"] = rng.uniform(-bound, bound, fo).astype(dtype)
    out["w_g"] = rng.standard_normal((D, 1)).astype(dtype)  # as torch.randn(D, 1)
    return out


def separable_weights(
    rng: np.random.Generator,
    d: int,
    d_out: int | None = None,
    *,
    bias: bool = True,
    dtype: Any = np.float64,
) -> dict[str, np.ndarray]:
    d_out = d if d_out is None else d_out
    bound = 1.0 / math.sqrt(max(d, 1))
    out = {
        "w_qkv": rng.uniform(-bound, bound, (d, 1 + 2 * d)).astype(dtype),
        "w_o": rng.uniform(-bound, bound, (d, d_out)).astype(dtype),
    }
    if bias:
        out["b_qkv"] = rng.uniform(-bound, bound, 1 + 2 * d).astype(dtype)
        out["b_o"] = rng.uniform(-bound, bound, d_out).astype(dtype)
    return out


@pytest.fixture
def aw():
    return additive_weights


@pytest.fixture
def sw():
    return separable_weights


# ----------------------------------------------------------------------------- grid vs reference


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("variant", ["official", "hf"])
@pytest.mark.parametrize("n", [1, 2, 7, 49, 300])
@pytest.mark.parametrize("heads", [1, 2, 3])  # D = heads * d_out, as num_heads in the original
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)], ids=["nobatch", "B3", "B2x2"])
def test_additive_grid(rng, close, dtype, variant, n, heads, batch):
    d_in, d_out = 12, 8
    w = additive_weights(rng, d_in, heads * d_out, d_out, dtype=dtype)
    x = rng.standard_normal(batch + (n, d_in)).astype(dtype)
    got = attnlab.additive_attention(x, variant=variant, **w)
    close(got, R.additive_attention(x, variant=variant, **w), dtype, "additive vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("n", [1, 2, 7, 49, 300])
@pytest.mark.parametrize("d,d_out", [(8, 8), (16, 5), (1, 3)])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)], ids=["nobatch", "B3", "B2x2"])
def test_separable_grid(rng, close, dtype, n, d, d_out, batch):
    w = separable_weights(rng, d, d_out, dtype=dtype)
    x = rng.standard_normal(batch + (n, d)).astype(dtype)
    got = attnlab.separable_attention(x, **w)
    close(got, R.separable_attention(x, **w), dtype, "separable vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("variant", ["official", "hf"])
def test_additive_no_biases_and_vector_w_g(rng, close, dtype, variant):
    w = additive_weights(rng, 10, 16, 16, bias=False, dtype=dtype)
    w["w_g"] = w["w_g"].reshape(-1)
    x = rng.standard_normal((2, 33, 10)).astype(dtype)
    got = attnlab.additive_attention(x, variant=variant, **w)
    close(got, R.additive_attention(x, variant=variant, **w), dtype, "additive vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_separable_no_biases(rng, close, dtype):
    w = separable_weights(rng, 9, bias=False, dtype=dtype)
    x = rng.standard_normal((2, 40, 9)).astype(dtype)
    close(
        attnlab.separable_attention(x, **w),
        R.separable_attention(x, **w),
        dtype,
        "separable vs reference",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_long_sequences(rng, close, dtype):
    """Several GEMM blocks and output tasks per batch element (n > 1024)."""
    x = rng.standard_normal((2, 2500, 16)).astype(dtype)
    w = additive_weights(rng, 16, 24, 12, dtype=dtype)
    for variant in ("official", "hf"):
        close(
            attnlab.additive_attention(x, variant=variant, **w),
            R.additive_attention(x, variant=variant, **w),
            dtype,
            "additive vs reference",
        )
    ws = separable_weights(rng, 16, dtype=dtype)
    close(
        attnlab.separable_attention(x, **ws),
        R.separable_attention(x, **ws),
        dtype,
        "separable vs reference",
    )


# ----------------------------------------------------------------------------- semantics


def test_hf_variant_ignores_w_g_and_scale(rng):
    w = additive_weights(rng, 8, 8, 8)
    x = rng.standard_normal((2, 10, 8))
    a = attnlab.additive_attention(x, variant="hf", **w)
    w2 = dict(w, w_g=-3.0 * rng.standard_normal((8, 1)))
    b = attnlab.additive_attention(x, variant="hf", scale=7.0, **w2)
    np.testing.assert_array_equal(a, b)


def test_official_scale_only_matters_through_sign_and_eps(rng):
    w = additive_weights(rng, 8, 8, 8)
    x = rng.standard_normal((2, 10, 8))
    a = attnlab.additive_attention(x, **w)
    np.testing.assert_allclose(
        attnlab.additive_attention(x, scale=5.0, **w), a, rtol=1e-13, atol=1e-13
    )
    flipped = attnlab.additive_attention(x, scale=-1.0, **w)
    # G -> -G: compare with the reference rather than with a
    np.testing.assert_allclose(
        flipped, R.additive_attention(x, scale=-1.0, **w), rtol=1e-12, atol=1e-12
    )
    assert not np.allclose(flipped, a)


def test_default_scale_is_d_out(rng):
    w = additive_weights(rng, 8, 16, 4)  # D = 16, d_out = 4: scale 1/2 by default
    x = rng.standard_normal((1, 3, 8)) * 1e-7  # small: the scores' norm is near eps
    w["w_g"] = w["w_g"] * 1e-9
    a = attnlab.additive_attention(x, **w)
    np.testing.assert_allclose(a, attnlab.additive_attention(x, scale=0.5, **w), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_official_n1_token_weight_is_sign(rng, close, dtype):
    """With one token, a = s / max(|s|, eps) = sign(s), so G = +-Q."""
    d = 6
    w = additive_weights(rng, d, d, d, dtype=dtype)
    x = rng.standard_normal((4, 1, d)).astype(dtype)
    got = attnlab.additive_attention(x, **w)
    x64 = x.astype(np.float64)
    W = {k: v.astype(np.float64) for k, v in w.items()}
    Q = x64 @ W["w_q"] + W["b_q"]
    Q /= np.linalg.norm(Q, axis=-1, keepdims=True)
    K = x64 @ W["w_k"] + W["b_k"]
    K /= np.linalg.norm(K, axis=-1, keepdims=True)
    s = (Q @ W["w_g"]) * d**-0.5
    G = np.sign(s) * Q
    expect = ((G * K) @ W["w_proj"] + W["b_proj"] + Q) @ W["w_final"] + W["b_final"]
    close(got, expect, dtype, "additive n=1 sign")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("variant", ["official", "hf"])
def test_eps_tiny_and_zero_rows(rng, close, dtype, variant):
    """Rows whose norm is below eps: zero rows stay zero, tiny rows are divided by eps."""
    d = 8
    w = additive_weights(rng, d, d, d, bias=False, dtype=dtype)
    x = rng.standard_normal((3, 6, d)).astype(dtype)
    x[0, 1] = 0.0  # Q, K rows exactly zero
    x[1, 2] *= 1e-14  # Q, K rows of norm ~1e-14 < eps
    x[2] *= 1e-15  # a whole batch element below eps
    got = attnlab.additive_attention(x, variant=variant, **w)
    close(got, R.additive_attention(x, variant=variant, **w), dtype, "additive eps")
    assert np.isfinite(got).all()
    # w_g = 0: every score is 0, their norm is 0 < eps, a = 0, G = 0
    w0 = dict(w, w_g=np.zeros((d, 1), dtype))
    got0 = attnlab.additive_attention(x, **w0)
    close(got0, R.additive_attention(x, **w0), dtype, "additive eps")


def test_scores_norm_below_eps_uses_eps(rng, close):
    w = additive_weights(rng, 8, 8, 8)
    x = rng.standard_normal((2, 5, 8))
    for scale in (1e-14, 1e-12, 3e-13):
        close(
            attnlab.additive_attention(x, scale=scale, **w),
            R.additive_attention(x, scale=scale, **w),
            np.float64,
            "additive eps",
        )
    for eps in (1e-3, 0.5, 1e-300):
        close(
            attnlab.additive_attention(x, eps=eps, **w),
            R.additive_attention(x, eps=eps, **w),
            np.float64,
            "additive eps",
        )


def test_tiny_float32_rows_are_exact(rng, close):
    """Squares of 1e-25 underflow in float32: the norm falls back to a scaled algorithm."""
    w = additive_weights(rng, 8, 8, 8, bias=False, dtype=np.float32)
    x = (rng.standard_normal((1, 4, 8)) * 1e-25).astype(np.float32)
    got = attnlab.additive_attention(x, eps=1e-30, **w)
    close(got, R.additive_attention(x, eps=1e-30, **w), np.float32, "additive eps")


# ----------------------------------------------------------------------------- padding


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("variant", ["official", "hf", "separable"])
def test_padding_matches_unpadded(rng, close, dtype, variant):
    """Real tokens of a padded batch get exactly the unpadded result; padding (even NaN) is
    left out of the pooling."""
    d, lengths, n = 8, [5, 9, 1], 12
    if variant == "separable":
        w = separable_weights(rng, d, dtype=dtype)
        f = attnlab.separable_attention
        ref = R.separable_attention
    else:
        w = additive_weights(rng, d, d, d, dtype=dtype)
        w["variant"] = variant

        def f(x, **kw):
            return attnlab.additive_attention(x, **kw)

        ref = R.additive_attention
    x = rng.standard_normal((3, n, d)).astype(dtype)
    kp = np.zeros((3, n), bool)
    for b, L in enumerate(lengths):
        kp[b, :L] = True
        x[b, L:] = np.nan if b == 0 else 1e30
    got = f(x, key_padding_mask=kp, **w)
    for b, L in enumerate(lengths):
        alone = f(x[b, :L], **w)
        close(got[b, :L], alone, dtype, "padded vs alone", tol=10 * np.finfo(dtype).eps)
        close(got[b, :L], ref(x[b, :L], **w), dtype, f"{variant} padded vs reference")
    xr = np.where(kp[..., None], x, 0.0)  # the reference gets finite padding
    gr = f(xr, key_padding_mask=kp, **w)
    close(gr, ref(xr, key_padding_mask=kp, **w), dtype, f"{variant} padded vs reference")


@pytest.mark.parametrize("variant", ["official", "hf", "separable"])
def test_padding_across_blocks(rng, close, variant):
    """Masks spanning several row blocks: fully padded blocks, partly padded ones, NaN padding."""
    n, d = 700, 8
    kp = rng.random((2, n)) > 0.5
    kp[0, 128:384] = False  # two whole blocks of padding
    kp[1, :] = True
    kp[1, 650:] = False
    x = rng.standard_normal((2, n, d))
    if variant == "separable":
        w = separable_weights(rng, d)
        f, ref = attnlab.separable_attention, R.separable_attention
    else:
        w = dict(additive_weights(rng, d, d, d), variant=variant)
        f, ref = attnlab.additive_attention, R.additive_attention
    expect = ref(x, key_padding_mask=kp, **w)
    close(f(x, key_padding_mask=kp, **w), expect, np.float64, f"{variant} padded vs reference")
    x[~kp] = np.nan
    got = f(x, key_padding_mask=kp, **w)
    close(got[kp], expect[kp], np.float64, f"{variant} padded vs reference")


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16], ids=["f64", "f32", "f16"])
@pytest.mark.parametrize(
    "variant,form",
    [(v, f) for v in ("official", "hf", "separable") for f in ("written", "folded")]
    + [("official", "wide"), ("hf", "wide")],  # the wide-row rule is the additive family's
)
def test_output_forms(rng, close, dtype, variant, form):
    """Both forms of the output pass against the reference: with few tokens per batch element
    (additive n < D, separable 16 n <= d) and wide rows (additive D >= 256) the module's own
    order, else the weights folded with the pooled vector; with padding, d_out != D, blocks of
    uneven rows, half-precision x."""
    D, d_out = (256, 200) if form == "wide" else (64, 40)
    few = form == "written"
    n = (D // 16 if variant == "separable" else D - 1) + (0 if few else 1)
    wdt = np.float32 if dtype == np.float16 else dtype  # float16: every array (below)
    if variant == "separable":
        w = separable_weights(rng, D, d_out, dtype=wdt)
        f, ref = attnlab.separable_attention, R.separable_attention
    else:
        w = dict(additive_weights(rng, 24, D, d_out, dtype=wdt), variant=variant)
        f, ref = attnlab.additive_attention, R.additive_attention
    x = rng.standard_normal((5, n, D if variant == "separable" else 24)).astype(dtype)
    kp = np.ones((5, n), bool)
    kp[1, n // 2 :] = False
    kp[3, 1:] = False
    w64 = {k: v.astype(np.float64) if isinstance(v, np.ndarray) else v for k, v in w.items()}
    label = f"{variant} {form}"
    for mask in (None, kp):
        if dtype == np.float16:  # read and written as stored: the float32 call, rounded
            w16 = {
                k: v.astype(np.float16) if isinstance(v, np.ndarray) else v for k, v in w.items()
            }
            w32 = {
                k: v.astype(np.float32) if isinstance(v, np.ndarray) else v for k, v in w16.items()
            }
            got = f(x, key_padding_mask=mask, **w16)
            wide = f(x.astype(np.float32), key_padding_mask=mask, **w32)
            assert got.dtype == np.float16
            np.testing.assert_array_equal(got, wide.astype(np.float16), err_msg=label)
            continue
        got = f(x, key_padding_mask=mask, **w)
        expect = ref(x.astype(np.float64), key_padding_mask=mask, **w64)
        close(got, expect, wdt, f"{label} vs reference")


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("variant", ["official", "hf"])
def test_additive_fully_padded(rng, close, dtype, variant):
    d = 8
    w = additive_weights(rng, d, d, 5, dtype=dtype)
    x = rng.standard_normal((2, 4, d)).astype(dtype)
    kp = np.array([[False] * 4, [True, False, True, False]])
    got = attnlab.additive_attention(x, key_padding_mask=kp, variant=variant, **w)
    assert np.isfinite(got).all()
    W = {k: v.astype(np.float64) for k, v in w.items()}
    Q = x[0].astype(np.float64) @ W["w_q"] + W["b_q"]
    Q /= np.linalg.norm(Q, axis=-1, keepdims=True)
    close(got[0], (Q + W["b_proj"]) @ W["w_final"] + W["b_final"], dtype, "fully padded")
    close(
        got,
        R.additive_attention(x, key_padding_mask=kp, variant=variant, **w),
        dtype,
        "fully padded",
    )


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_separable_fully_padded(rng, close, dtype):
    w = separable_weights(rng, 8, 3, dtype=dtype)
    x = rng.standard_normal((2, 4, 8)).astype(dtype)
    kp = np.array([[False] * 4, [True, True, False, False]])
    got = attnlab.separable_attention(x, key_padding_mask=kp, **w)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], np.broadcast_to(w["b_o"], (4, 3)))
    close(got, R.separable_attention(x, key_padding_mask=kp, **w), dtype, "fully padded")


def test_padding_mask_broadcasts(rng, close):
    w = additive_weights(rng, 8, 8, 8)
    x = rng.standard_normal((2, 3, 6, 8))
    kp = np.array([True, True, False, True, False, True])  # (n,) for every batch element
    got = attnlab.additive_attention(x, key_padding_mask=kp, **w)
    close(got, R.additive_attention(x, key_padding_mask=kp, **w), np.float64, "padding bcast")
    ws = separable_weights(rng, 8)
    kp2 = rng.random((3, 6)) > 0.3  # (3, n) broadcast over the leading 2
    close(
        attnlab.separable_attention(x, key_padding_mask=kp2, **ws),
        R.separable_attention(x, key_padding_mask=kp2, **ws),
        np.float64,
        "padding bcast",
    )


def test_all_true_mask_equals_no_mask(rng):
    w = additive_weights(rng, 8, 8, 8)
    x = rng.standard_normal((2, 9, 8))
    np.testing.assert_array_equal(
        attnlab.additive_attention(x, key_padding_mask=np.ones((2, 9), bool), **w),
        attnlab.additive_attention(x, **w),
    )
    ws = separable_weights(rng, 8)
    np.testing.assert_array_equal(
        attnlab.separable_attention(x, key_padding_mask=np.ones(9, bool), **ws),
        attnlab.separable_attention(x, **ws),
    )


# ----------------------------------------------------------------------------- NaN / Inf / large


def test_nan_in_real_token_poisons_its_batch_element_only(rng):
    w = additive_weights(rng, 8, 8, 8)
    x = rng.standard_normal((2, 5, 8))
    x[0, 2, 3] = np.nan
    for variant in ("official", "hf"):
        out = attnlab.additive_attention(x, variant=variant, **w)
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    out = attnlab.separable_attention(x, **separable_weights(rng, 8))
    assert np.isnan(out[0, 2]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_large_inputs_stay_finite(rng, close, dtype):
    """Logits of magnitude 1e4 in the separable softmax; 1e18-sized activations whose squares
    overflow float32 in the additive row norms."""
    ws = separable_weights(rng, 8, dtype=dtype)
    x = (rng.standard_normal((2, 30, 8)) * 1e4).astype(dtype)
    out = attnlab.separable_attention(x, **ws)
    assert np.isfinite(out).all()
    close(out, R.separable_attention(x, **ws), dtype, "separable large")
    w = additive_weights(rng, 8, 8, 8, bias=False, dtype=dtype)
    x = (rng.standard_normal((2, 30, 8)) * 1e18).astype(dtype)
    out = attnlab.additive_attention(x, **w)
    assert np.isfinite(out).all()
    close(out, R.additive_attention(x, **w), dtype, "additive large")


# ----------------------------------------------------------------------------- arrays


def _layouts(a: np.ndarray):
    yield "c", a
    yield "fortran", np.asfortranarray(a)
    big = np.zeros(a.shape[:-1] + (a.shape[-1] * 2,), a.dtype)
    big[..., ::2] = a
    yield "strided", big[..., ::2]
    ro = a.copy()
    ro.flags.writeable = False
    yield "readonly", ro


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_layouts(rng, dtype):
    w = additive_weights(rng, 8, 8, 8, dtype=dtype)
    ws = separable_weights(rng, 8, dtype=dtype)
    x = rng.standard_normal((2, 7, 8)).astype(dtype)
    a0 = attnlab.additive_attention(x, **w)
    s0 = attnlab.separable_attention(x, **ws)
    for _, xl in _layouts(x):
        np.testing.assert_array_equal(attnlab.additive_attention(xl, **w), a0)
        np.testing.assert_array_equal(attnlab.separable_attention(xl, **ws), s0)
    for _, wl in _layouts(w["w_proj"]):
        np.testing.assert_array_equal(attnlab.additive_attention(x, **dict(w, w_proj=wl)), a0)
    for _, wl in _layouts(ws["w_qkv"]):
        np.testing.assert_array_equal(attnlab.separable_attention(x, **dict(ws, w_qkv=wl)), s0)


def test_dtypes_follow_contract(rng):
    w = additive_weights(rng, 4, 4, 4, dtype=np.float32)
    x32 = rng.standard_normal((3, 4)).astype(np.float32)
    assert attnlab.additive_attention(x32, **w).dtype == np.float32
    assert attnlab.additive_attention(x32.astype(np.float64), **w).dtype == np.float64
    assert attnlab.additive_attention(np.ones((3, 4), np.int64), **w).dtype == np.float64
    # float16 with float32 weights: computed and returned in float32 (np.result_type)
    assert attnlab.additive_attention(x32.astype(np.float16), **w).dtype == np.float32
    ws = separable_weights(rng, 4, dtype=np.float32)
    assert attnlab.separable_attention(x32, **ws).dtype == np.float32
    assert attnlab.separable_attention(x32.tolist(), **ws).dtype == np.float64
    ws64 = dict(ws, b_o=ws["b_o"].astype(np.float64))
    assert attnlab.separable_attention(x32, **ws64).dtype == np.float64


def test_inputs_not_modified(rng):
    w = additive_weights(rng, 8, 8, 8)
    ws = separable_weights(rng, 8)
    x = rng.standard_normal((2, 5, 8))
    copies = [a.copy() for a in (x, *w.values(), *ws.values())]
    attnlab.additive_attention(x, **w)
    attnlab.separable_attention(x, **ws)
    for a, c in zip((x, *w.values(), *ws.values()), copies, strict=True):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (0, 3, 8), (3, 0)])
def test_empty(rng, shape):
    d = shape[-1]
    if d == 0:
        # no input features: Q = b_q, K = b_k for every token
        w = additive_weights(rng, 0, 4, 4)
        x = np.zeros(shape)
        close_ref = R.additive_attention(x, **w)
        np.testing.assert_allclose(attnlab.additive_attention(x, **w), close_ref, atol=1e-12)
        ws = separable_weights(rng, 0, 3)
        np.testing.assert_allclose(
            attnlab.separable_attention(x, **ws), R.separable_attention(x, **ws), atol=1e-12
        )
        return
    w = additive_weights(rng, d, 4, 5)
    x = np.zeros(shape)
    assert attnlab.additive_attention(x, **w).shape == shape[:-1] + (5,)
    ws = separable_weights(rng, d, 3)
    assert attnlab.separable_attention(x, **ws).shape == shape[:-1] + (3,)


def test_zero_output_width(rng):
    w = additive_weights(rng, 4, 4, 0)
    assert attnlab.additive_attention(np.ones((2, 3, 4)), scale=1.0, **w).shape == (2, 3, 0)


def test_thread_count_does_not_change_results(rng):
    w = additive_weights(rng, 16, 16, 16, dtype=np.float32)
    ws = separable_weights(rng, 16, dtype=np.float32)
    x = rng.standard_normal((3, 1500, 16)).astype(np.float32)
    before = attnlab.get_num_threads()
    try:
        attnlab.set_num_threads(1)
        a1, s1 = attnlab.additive_attention(x, **w), attnlab.separable_attention(x, **ws)
        attnlab.set_num_threads(3)
        a3, s3 = attnlab.additive_attention(x, **w), attnlab.separable_attention(x, **ws)
    finally:
        attnlab.set_num_threads(before)
    np.testing.assert_array_equal(a1, a3)
    np.testing.assert_array_equal(s1, s3)


def test_concurrent_python_threads_match_serial(rng):
    """The GIL is released around the kernels; concurrent calls give the serial results."""
    from concurrent.futures import ThreadPoolExecutor

    w = additive_weights(rng, 16, 16, 16)
    ws = separable_weights(rng, 16)
    xs = [rng.standard_normal((2, 300, 16)) for _ in range(8)]
    serial = [
        (attnlab.additive_attention(x, **w), attnlab.separable_attention(x, **ws)) for x in xs
    ]
    with ThreadPoolExecutor(8) as ex:
        par = list(
            ex.map(
                lambda x: (
                    attnlab.additive_attention(x, **w),
                    attnlab.separable_attention(x, **ws),
                ),
                xs,
            )
        )
    for (a, s), (pa, ps) in zip(serial, par, strict=True):
        np.testing.assert_array_equal(a, pa)
        np.testing.assert_array_equal(s, ps)


def test_feature_map_recipe(rng, close):
    """MobileViT-v2's (B, C, P, N) maps: P is a batch dimension, as the docstring shows."""
    B, C, P, N = 2, 6, 4, 9
    fmap = rng.standard_normal((B, C, P, N))
    ws = separable_weights(rng, C)
    out = attnlab.separable_attention(fmap.transpose(0, 2, 3, 1), **ws).transpose(0, 3, 1, 2)
    for p in range(P):
        close(
            out[:, :, p, :].transpose(0, 2, 1),
            R.separable_attention(fmap[:, :, p, :].transpose(0, 2, 1), **ws),
            np.float64,
            "feature map recipe",
        )


# ----------------------------------------------------------------------------- errors


def _err(exc, match, f, *args, **kw):
    with pytest.raises(exc, match=match):
        f(*args, **kw)


def test_additive_errors(rng):
    w = additive_weights(rng, 8, 16, 4)
    x = rng.standard_normal((2, 5, 8))
    f = attnlab.additive_attention
    _err(ValueError, "variant", f, x, variant="softmax", **w)
    _err(ValueError, "variant", f, x, variant=None, **w)
    _err(ValueError, "eps", f, x, eps=0.0, **w)
    _err(ValueError, "eps", f, x, eps=float("nan"), **w)
    _err(TypeError, "eps", f, x, eps="1e-12", **w)
    _err(ValueError, "scale", f, x, scale=float("inf"), **w)
    _err(TypeError, "scale", f, x, scale="big", **w)
    _err(ValueError, "x", f, np.ones(8), **w)
    _err(TypeError, "x", f, x.astype(complex), **w)
    _err(TypeError, "x", f, x > 0, **w)
    _err(TypeError, "x", f, None, **w)
    _err(ValueError, r"w_q.*\(8, D\)", f, x, **dict(w, w_q=np.ones((7, 16))))
    _err(ValueError, "w_q", f, x, **dict(w, w_q=np.ones(8)))
    _err(ValueError, "w_q", f, x, **dict(w, w_q=np.ones((8, 0))))
    _err(ValueError, r"w_k.*\(8, 16\)", f, x, **dict(w, w_k=np.ones((8, 15))))
    _err(ValueError, r"w_g.*\(16,\)", f, x, **dict(w, w_g=np.ones((16, 2))))
    _err(ValueError, "w_g", f, x, **dict(w, w_g=np.ones(15)))
    _err(ValueError, "w_proj", f, x, **dict(w, w_proj=np.ones((16, 8))))
    _err(ValueError, "w_final", f, x, **dict(w, w_final=np.ones((8, 4))))
    _err(ValueError, "b_q", f, x, **dict(w, b_q=np.ones(3)))
    _err(ValueError, "b_k", f, x, **dict(w, b_k=np.ones((16, 1))))
    _err(ValueError, "b_proj", f, x, **dict(w, b_proj=np.ones(4)))
    _err(ValueError, "b_final", f, x, **dict(w, b_final=np.ones(16)))
    _err(TypeError, "w_proj", f, x, **dict(w, w_proj=np.ones((16, 16), complex)))
    _err(TypeError, "key_padding_mask", f, x, key_padding_mask=np.ones((2, 5)), **w)
    _err(ValueError, "key_padding_mask", f, x, key_padding_mask=np.ones((2, 4), bool), **w)
    _err(TypeError, "w_q", f, x, **dict(w, w_q=None))
    with pytest.raises(TypeError):
        f(x, w["w_q"], **{k: v for k, v in w.items() if k != "w_q"})  # keyword-only


def test_separable_errors(rng):
    ws = separable_weights(rng, 8, 4)
    x = rng.standard_normal((2, 5, 8))
    f = attnlab.separable_attention
    _err(ValueError, r"w_qkv.*\(8, 17\)", f, x, **dict(ws, w_qkv=np.ones((8, 16))))
    _err(ValueError, "w_qkv", f, x, **dict(ws, w_qkv=np.ones((7, 17))))
    _err(ValueError, "w_o", f, x, **dict(ws, w_o=np.ones((4, 4))))
    _err(ValueError, "w_o", f, x, **dict(ws, w_o=np.ones(8)))
    _err(ValueError, "b_qkv", f, x, **dict(ws, b_qkv=np.ones(16)))
    _err(ValueError, "b_o", f, x, **dict(ws, b_o=np.ones(8)))
    _err(ValueError, "x", f, np.ones(8), **ws)
    _err(TypeError, "x", f, x.astype(object), **ws)
    _err(TypeError, "key_padding_mask", f, x, key_padding_mask=np.ones(5, int), **ws)
    _err(ValueError, "key_padding_mask", f, x, key_padding_mask=np.ones((3, 5), bool), **ws)


def test_core_rejects_inconsistent_buffers(rng):
    """The bindings check again: wrong sizes never reach the kernels."""
    w = additive_weights(rng, 8, 8, 8)
    x = np.ones((10, 8))
    out = np.empty((10, 8))
    w = dict(w, w_g=w["w_g"].reshape(-1))
    good = dict(
        x=x, **w, batch=2, n=5, scale=1.0, eps=1e-12, variant=0, key_padding_mask=None, half=0
    )

    def forward(out=out, **changed):
        core.additive_forward(core.AdditiveArgs(**dict(good, **changed)), out)

    forward()
    with pytest.raises(ValueError, match=r"^x: "):
        forward(batch=3)  # 3*5 != 10 rows
    with pytest.raises(ValueError, match=r"^variant: "):
        forward(variant=2)
    with pytest.raises(ValueError, match=r"^key_padding_mask: "):
        forward(key_padding_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"^out: shape"):
        forward(out=np.empty((10, 8))[:, :4])
    with pytest.raises(TypeError):
        forward(x=x.astype(np.float32))
    ro = np.empty((10, 8))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"^out: not writable"):
        forward(out=ro)
    # the argument object takes every field by keyword, typed, and no other
    with pytest.raises(TypeError, match=r"^AdditiveArgs\.x: expected an ndarray, got list"):
        forward(x=x.tolist())
    with pytest.raises(TypeError, match=r"^AdditiveArgs\.n: expected an int, got float"):
        forward(n=5.0)
    with pytest.raises(TypeError, match=r"^AdditiveArgs: missing keyword argument 'eps'"):
        core.AdditiveArgs(**{k: v for k, v in good.items() if k != "eps"})
    with pytest.raises(TypeError, match=r"^AdditiveArgs: unexpected keyword argument 'w_v'"):
        core.AdditiveArgs(**good, w_v=x)
    with pytest.raises(TypeError):
        core.AdditiveArgs(*good.values())
    a = core.AdditiveArgs(**good)
    assert a.x is x and a.n == 5 and a.key_padding_mask is None
    with pytest.raises(AttributeError):
        a.n = 4  # read-only
    ws = separable_weights(rng, 8)
    sep = dict(x=x, **ws, batch=2, n=5, key_padding_mask=None, half=0)
    bad = core.SeparableArgs(**dict(sep, w_qkv=ws["w_qkv"][:, :16].copy(), b_qkv=None))
    with pytest.raises(ValueError, match=r"^w_qkv: "):
        core.separable_forward(bad, out)
    with pytest.raises(ValueError, match="negative sizes"):
        core.separable_forward(core.SeparableArgs(**dict(sep, batch=-2, n=-5)), out)


# ----------------------------------------------------------------------------- PyTorch


def _torch():
    return pytest.importorskip("torch")


def _np(t):
    return t.detach().cpu().numpy()


def additive_kwargs(m, proj: str = "Proj") -> dict[str, np.ndarray]:
    p = getattr(m, proj)
    return {
        "w_q": _np(m.to_query.weight).T,
        "b_q": _np(m.to_query.bias),
        "w_k": _np(m.to_key.weight).T,
        "b_k": _np(m.to_key.bias),
        "w_g": _np(m.w_g),
        "w_proj": _np(p.weight).T,
        "b_proj": _np(p.bias),
        "w_final": _np(m.final.weight).T,
        "b_final": _np(m.final.bias),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize(
    "in_dims,token_dim,num_heads,n",
    [(32, 32, 1, 49), (24, 16, 2, 196), (8, 8, 1, 1), (16, 12, 3, 5)],
)
def test_vs_official_swiftformer_torch(rng, close, dtype, in_dims, token_dim, num_heads, n):
    torch = _torch()
    torch.manual_seed(0)
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    m = official_swiftformer_module(torch, in_dims, token_dim, num_heads).to(tdt).eval()
    x = rng.standard_normal((3, n, in_dims)).astype(dtype)
    with torch.inference_mode():
        ref = _np(m(torch.from_numpy(x)))
    got = attnlab.additive_attention(x, **additive_kwargs(m))
    close(got, ref, dtype, "additive vs torch official", tol=1e-5 if dtype == np.float32 else 1e-12)


def _linear_self_attention_torch(torch, x, conv_qkv_w, conv_qkv_b, conv_o_w, conv_o_b, d):
    """A transcription of apple/ml-cvnets LinearSelfAttention._forward_self_attn on (B, C, P, N)."""
    F = torch.nn.functional
    qkv = F.conv2d(x, conv_qkv_w, conv_qkv_b)
    query, key, value = torch.split(qkv, [1, d, d], dim=1)
    scores = F.softmax(query, dim=-1)
    ctx = torch.sum(key * scores, dim=-1, keepdim=True)
    return F.conv2d(F.relu(value) * ctx.expand_as(value), conv_o_w, conv_o_b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_vs_mobilevitv2_torch(rng, close, dtype):
    torch = _torch()
    B, C, P, N = 2, 16, 4, 64
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    g = torch.Generator().manual_seed(0)
    wq = torch.randn(1 + 2 * C, C, 1, 1, generator=g, dtype=tdt) * C**-0.5
    bq = torch.randn(1 + 2 * C, generator=g, dtype=tdt) * 0.1
    wo = torch.randn(C, C, 1, 1, generator=g, dtype=tdt) * C**-0.5
    bo = torch.randn(C, generator=g, dtype=tdt) * 0.1
    fmap = rng.standard_normal((B, C, P, N)).astype(dtype)
    with torch.inference_mode():
        ref = _np(_linear_self_attention_torch(torch, torch.from_numpy(fmap), wq, bq, wo, bo, C))
    kw = {
        "w_qkv": _np(wq[:, :, 0, 0]).T,
        "b_qkv": _np(bq),
        "w_o": _np(wo[:, :, 0, 0]).T,
        "b_o": _np(bo),
    }
    got = attnlab.separable_attention(fmap.transpose(0, 2, 3, 1), **kw).transpose(0, 3, 1, 2)
    close(got, ref, dtype, "separable vs torch cvnets", tol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_vs_transformers_swiftformer(rng, close, dtype):
    torch = _torch()
    tr = pytest.importorskip("transformers")
    from transformers.models.swiftformer.modeling_swiftformer import (
        SwiftFormerEfficientAdditiveAttention,
    )

    torch.manual_seed(0)
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    dim = 48
    m = SwiftFormerEfficientAdditiveAttention(tr.SwiftFormerConfig(), dim=dim).to(tdt).eval()
    with torch.no_grad():  # nn.Linear's default init, not the model's trunc_normal(0.02)
        for lin in (m.to_query, m.to_key, m.proj, m.final):
            lin.reset_parameters()
    x = rng.standard_normal((2, 49, dim)).astype(dtype)
    with torch.inference_mode():
        ref = _np(m(torch.from_numpy(x)))
    got = attnlab.additive_attention(x, variant="hf", **additive_kwargs(m, "proj"))
    close(got, ref, dtype, "additive vs transformers", tol=1e-5 if dtype == np.float32 else 1e-12)
    # and the official variant really is a different function of the same weights
    other = attnlab.additive_attention(x, variant="official", **additive_kwargs(m, "proj"))
    assert not np.allclose(other, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_vs_transformers_mobilevitv2(rng, close, dtype):
    torch = _torch()
    tr = pytest.importorskip("transformers")
    from transformers.models.mobilevitv2.modeling_mobilevitv2 import (
        MobileViTV2LinearSelfAttention,
    )

    torch.manual_seed(0)
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    C = 24
    m = MobileViTV2LinearSelfAttention(tr.MobileViTV2Config(attn_dropout=0.1), C).to(tdt).eval()
    fmap = rng.standard_normal((2, C, 4, 49)).astype(dtype)
    with torch.inference_mode():
        ref = _np(m(torch.from_numpy(fmap)))
    qkv, o = m.qkv_proj.convolution, m.out_proj.convolution
    kw = {
        "w_qkv": _np(qkv.weight[:, :, 0, 0]).T,
        "b_qkv": _np(qkv.bias),
        "w_o": _np(o.weight[:, :, 0, 0]).T,
        "b_o": _np(o.bias),
    }
    got = attnlab.separable_attention(fmap.transpose(0, 2, 3, 1), **kw).transpose(0, 3, 1, 2)
    close(got, ref, dtype, "separable vs transformers", tol=1e-5 if dtype == np.float32 else 1e-12)


# ----------------------------------------------------------------------------- bench helpers


def test_bench_growth_exponent_and_flops():
    from attnlab._bench.additive import additive_flops, growth_exponent, separable_flops

    ns = [49, 196, 784, 3136, 12544]
    assert growth_exponent(ns, [0.1 * n for n in ns]) == pytest.approx(1.0)
    assert growth_exponent(ns, [1e-4 * n * n for n in ns]) == pytest.approx(2.0)
    # fixed costs at small n are left out of the fit (n >= 784)
    assert growth_exponent(
        ns, [5.0 + 0.1 * n if n < 784 else 0.1 * n for n in ns]
    ) == pytest.approx(1.0)
    assert additive_flops(2, 10, 4, 4, 4) == 2 * additive_flops(1, 10, 4, 4, 4)
    assert separable_flops(1, 20, 8, 8) == 2 * separable_flops(1, 10, 8, 8)
