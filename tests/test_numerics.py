"""Numerics on adversarial inputs : float32 kernels against the float64
reference evaluated on the same float32 values; no Inf or NaN where the maths is finite.

Errors are normwise relative, ``max |got - ref| / (|ref| + max|ref|)``; each test's docstring
gives its tolerance and why. ``u = 2**-24`` is float32's unit roundoff.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab import reference as R
from conftest import _MAX_ERR

U32 = 2.0**-24


def _err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    return float(np.max(np.abs(got - ref) / (np.abs(ref) + np.max(np.abs(ref)))))


def _check(label: str, got: np.ndarray, ref: np.ndarray, tol: float) -> None:
    assert np.isfinite(got).all(), f"{label}: Inf or NaN where the maths is finite"
    e = _err(got, ref)
    key = ("numerics " + label, "")  # printed in the session summary (conftest)
    _MAX_ERR[key] = max(_MAX_ERR[key], e)
    assert e <= tol, f"{label}: {e:.3e} > {tol:.1e}"


def _qkv(
    rng: np.random.Generator, b: int, h: int, n_q: int, n_k: int, d: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f(b, h, n_q, d), f(b, h, n_k, d), f(b, h, n_k, d)


@pytest.mark.parametrize("logit", [1e2, 1e3, 1e4])
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(logit: float, causal: bool) -> None:
    """Logits scaled so that the largest is ``logit`` (up to 1e4: the softmax is one-hot in
    most rows). Rounding the logits in float32 moves them by about ``u * logit`` each, and the
    softmax turns an absolute logit error into the same relative weight error, so the
    tolerance is ``1e-5 + u * logit`` (6e-4 at 1e4; measured 1.8e-5 at 1e4, 6e-6 at 1e3).
    float64: ``1e-12 * max(1, logit / 100)`` (measured 3e-14). Gradients stay finite."""
    rng = np.random.default_rng(int(logit))
    q, k, v = _qkv(rng, 2, 4, 64, 80, 16)
    s = float(logit / np.max(np.abs(np.einsum("bhid,bhjd->bhij", q, k))))
    ref = R.scaled_dot_product_attention(q, k, v, scale=s, causal=causal)
    got = attnlab.scaled_dot_product_attention(q, k, v, scale=s, causal=causal)
    _check(f"sdpa logits {logit:g} float32", got, ref, 1e-5 + U32 * logit)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    got64 = attnlab.scaled_dot_product_attention(q64, k64, v64, scale=s, causal=causal)
    _check(f"sdpa logits {logit:g} float64", got64, ref, 1e-12 * max(1.0, logit / 100))
    grads = attnlab.scaled_dot_product_attention_backward(
        np.ones_like(got), q, k, v, scale=s, causal=causal
    )
    assert all(np.isfinite(g).all() for g in grads.values())


def test_large_logits_mha_weights() -> None:
    """MHA with std-1 weights at d_model 512 (the "randn" initialisation of notebook 3): logits
    in the thousands. Tolerance as above, ``1e-5 + u * L`` with L the largest |logit|
    (measured 4e-5 for L about 2500)."""
    rng = np.random.default_rng(5)
    d, h, n = 512, 8, 64
    x = rng.standard_normal((2, n, d)).astype(np.float32)
    w = {k: rng.standard_normal((d, d)).astype(np.float32) for k in ("w_q", "w_k", "w_v")}
    w["w_o"] = (rng.standard_normal((d, d)) / d).astype(np.float32)
    logits = R.separate_logits(x, w_q=w["w_q"], w_k=w["w_k"], num_heads=h)
    big = float(np.max(np.abs(logits)))
    assert big > 100
    ref = R.multi_head_attention(x, num_heads=h, **w)
    got = attnlab.multi_head_attention(x, num_heads=h, **w)
    _check("mha randn weights float32", got, ref, 1e-5 + U32 * big)
    grads = attnlab.multi_head_attention_backward(np.ones_like(got), x, num_heads=h, **w)
    assert all(np.isfinite(g).all() for g in grads.values())


def test_near_ties() -> None:
    """Keys equal up to relative perturbations of 1e-7 (scores tied to float32's last bits):
    with scale 1 the weights are nearly uniform and the output is a plain average (1e-5, as
    for ordinary inputs; measured 5e-7); with scale 1e3 the ties are broken by the
    perturbations alone, which float32 resolves only to ``u * L`` (tolerance ``1e-5 + u * L``,
    L the largest |logit|; measured 1.9e-4 for L about 7e3)."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 2, 2, 32, 200, 8)
    k = np.broadcast_to(k[:, :, :1], k.shape) * (1 + 1e-7 * rng.standard_normal(k.shape))
    k = k.astype(np.float32)
    for s in (1.0, 1e3):  # with scale 1e3 the ties are broken by the perturbations alone
        ref = R.scaled_dot_product_attention(q, k, v, scale=s)
        got = attnlab.scaled_dot_product_attention(q, k, v, scale=s)
        big = float(np.max(np.abs(s * np.einsum("bhid,bhjd->bhij", q, k))))
        _check(f"near ties scale {s:g} float32", got, ref, 1e-5 + U32 * big)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_with_one_allowed_key_are_exact(dtype: type) -> None:
    """A row that may attend a single key gets weight exactly 1 there: its output is that
    key's value row, bit for bit (any of exp(0) = 1, 1/1 = 1, 1 * v = v is exact)."""
    rng = np.random.default_rng(3)
    b, h, n_q, n_k, d = 2, 3, 40, 50, 8
    q, k, v = (a.astype(dtype) for a in _qkv(rng, b, h, n_q, n_k, d))
    q *= 30  # large logits elsewhere must not matter
    only = rng.integers(0, n_k, (b, h, n_q))
    mask = np.zeros((b, h, n_q, n_k), bool)
    np.put_along_axis(mask, only[..., None], True, axis=-1)
    out, wts = attnlab.scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    want = np.take_along_axis(v, only[..., None].repeat(d, -1), axis=-2)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(wts, mask.astype(dtype))
    # the same through causal: query 0 sees only key 0
    out = attnlab.scaled_dot_product_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(out[..., 0, :], v[..., 0, :])


@pytest.mark.parametrize("n", [16384])
def test_very_long_rows(n: int) -> None:
    """One row of n = 16384 keys with d = 4 (softmax sums over 16384 terms, accumulated
    blockwise): still within the ordinary 1e-5 (measured 2e-6). The linear families pool
    16384 tokens: 1e-5 too (measured 2e-7)."""
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 2, 64, n, 4)
    ref = R.scaled_dot_product_attention(q, k, v)
    _check(f"sdpa n_k={n} float32", attnlab.scaled_dot_product_attention(q, k, v), ref, 1e-5)
    ref = R.scaled_dot_product_attention(q, k, v, causal="bottom_right")
    got = attnlab.scaled_dot_product_attention(q, k, v, causal="bottom_right")
    _check(f"sdpa n_k={n} bottom_right float32", got, ref, 1e-5)
    x = rng.standard_normal((2, n, 8)).astype(np.float32)
    w = {
        k_: (rng.standard_normal((8, 8)) / 3).astype(np.float32)
        for k_ in ("w_q", "w_k", "w_proj", "w_final")
    }
    for variant in ("official", "hf"):
        kw = dict(w_g=np.ones(8, np.float32), variant=variant, **w)
        _check(
            f"additive {variant} n={n} float32",
            attnlab.additive_attention(x, **kw),
            R.additive_attention(x, **kw),
            1e-5,
        )
    sep = dict(
        w_qkv=(rng.standard_normal((8, 17)) / 3).astype(np.float32),
        w_o=(rng.standard_normal((8, 8)) / 3).astype(np.float32),
    )
    _check(
        f"separable n={n} float32",
        attnlab.separable_attention(x, **sep),
        R.separable_attention(x, **sep),
        1e-5,
    )


def test_blocked_sums_over_many_keys() -> None:
    """P V and dQ sum one chain per key tile of 256, dK and dV one per 256 query rows, then add
    the chains: at 4096 keys and queries (d = 32) the float32 output stays within 10 u of the
    float64 one normwise, each gradient within 11 u (measured 6.4 u for the output, 8.6 u for
    dQ on AVX-512, AVX2 and generic; one chain over all the keys or queries gave 19 u and 13 u:
    docs/performance.md, "Blocked sums in the attention")."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 4096, 32)).astype(np.float32) for _ in range(3))
    wide = [a.astype(np.float64) for a in (q, k, v)]
    out = attnlab.scaled_dot_product_attention(q, k, v)
    exact = attnlab.scaled_dot_product_attention(*wide)
    err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert err < 10 * U32, err / U32
    g = rng.standard_normal(out.shape).astype(np.float32)
    grads = attnlab.scaled_dot_product_attention_backward(g, q, k, v)
    exact_grads = attnlab.scaled_dot_product_attention_backward(g.astype(np.float64), *wide)
    for name in ("q", "k", "v"):
        err = np.linalg.norm(grads[name] - exact_grads[name]) / np.linalg.norm(exact_grads[name])
        assert err < 11 * U32, (name, err / U32)


def test_separable_large_scores() -> None:
    """Separable attention with token scores up to 1e4 (a softmax over tokens that is one-hot):
    finite, and within ``1e-5 + u * max|score|`` as for MHA's logits (measured 7e-8)."""
    rng = np.random.default_rng(6)
    d, n = 8, 300
    x = rng.standard_normal((3, n, d)).astype(np.float32)
    w_qkv = (rng.standard_normal((d, 1 + 2 * d)) / 3).astype(np.float32)
    w_qkv[:, 0] *= 1e4 / np.max(np.abs(x @ w_qkv[:, 0]))
    w_o = (rng.standard_normal((d, d)) / 3).astype(np.float32)
    got = attnlab.separable_attention(x, w_qkv=w_qkv, w_o=w_o)
    ref = R.separable_attention(x, w_qkv=w_qkv, w_o=w_o)
    _check("separable scores 1e4 float32", got, ref, 1e-5 + U32 * 1e4)
    grads = attnlab.separable_attention_backward(np.ones_like(got), x, w_qkv=w_qkv, w_o=w_o)
    assert all(np.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("magnitude", [1e-20, 1e4])
@pytest.mark.parametrize("variant", ["official", "hf"])
def test_additive_extreme_magnitudes(magnitude: float, variant: str) -> None:
    """Additive attention normalises Q and K per token and the scores over tokens, so inputs
    scaled by 1e4 change nothing and inputs scaled by 1e-20 fall below ``eps`` (the norms are
    clamped, as torch's F.normalize): finite either way and within 1e-5 of the reference
    (measured 2.5e-7)."""
    rng = np.random.default_rng(7)
    d = 8
    x = (rng.standard_normal((2, 50, d)) * magnitude).astype(np.float32)
    w = {
        k: (rng.standard_normal((d, d)) / 3).astype(np.float32)
        for k in ("w_q", "w_k", "w_proj", "w_final")
    }
    kw = dict(w_g=rng.standard_normal(d).astype(np.float32), variant=variant, **w)
    got = attnlab.additive_attention(x, **kw)
    _check(f"additive {variant} x*{magnitude:g} float32", got, R.additive_attention(x, **kw), 1e-5)
    grads = attnlab.additive_attention_backward(np.ones_like(got), x, **kw)
    assert all(np.isfinite(g).all() for g in grads.values())


# ----------------------------------------------------------------------------- fully masked


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_separable_all_real_scores_minus_inf_give_zero_context(dtype: type) -> None:
    """Every real token's score -inf (here through b_qkv[0] = -inf) masks every token, as a
    -inf float mask does in SDPA: by the convention "fully masked rows give zeros, never NaN" the
    context is 0, every output row is b_o, and the gradients are finite (0 through the scores).
    The kernel used to return NaN here (torch's softmax does) while the reference gave b_o."""
    rng = np.random.default_rng(8)
    d, n = 6, 200  # two row blocks
    x = rng.standard_normal((3, n, d)).astype(dtype)
    w_qkv = (rng.standard_normal((d, 1 + 2 * d)) / 3).astype(dtype)
    b_qkv = rng.standard_normal(1 + 2 * d).astype(dtype)
    b_qkv[0] = -np.inf
    w_o = (rng.standard_normal((d, 4)) / 3).astype(dtype)
    b_o = rng.standard_normal(4).astype(dtype)
    kw = dict(w_qkv=w_qkv, b_qkv=b_qkv, w_o=w_o, b_o=b_o)
    got = attnlab.separable_attention(x, **kw)
    np.testing.assert_array_equal(got, np.broadcast_to(b_o, got.shape))
    np.testing.assert_array_equal(got, R.separable_attention(x, **kw).astype(dtype))
    g = attnlab.separable_attention_backward(np.ones_like(got), x, **kw)
    assert all(np.isfinite(a).all() for a in g.values())
    np.testing.assert_array_equal(g["b_o"], np.full(4, 3 * n, dtype))
    np.testing.assert_array_equal(g["w_o"], 0)  # relu(v) * ctx = 0
    # some tokens -inf, the others finite: those others share the softmax as usual
    x2 = x.copy()
    x2[:, ::2] = 0.0
    b2 = b_qkv.copy()
    b2[0] = 0.0
    w2 = w_qkv.copy()
    w2[:, 0] = 1.0
    x2[:, 1::2, :] = -np.inf  # scores -inf, and keys/values inf: those tokens are NaN rows
    kw2 = dict(w_qkv=w2, b_qkv=b2, w_o=w_o, b_o=b_o)
    with np.errstate(all="ignore"):
        got2 = attnlab.separable_attention(x2[:, ::2], **kw2)
        ref2 = R.separable_attention(x2[:, ::2], **kw2)
    np.testing.assert_allclose(got2, ref2, rtol=1e-5, atol=1e-6)


@pytest.mark.empty_rows
@pytest.mark.parametrize("family", ["additive_official", "additive_hf", "separable"])
def test_no_real_token_gives_finite_output(family: str) -> None:
    """All tokens padded (key_padding_mask all False): nothing is pooled, G = 0 (ctx = 0); the
    output equals the reference and is finite, as are the gradients."""
    rng = np.random.default_rng(9)
    d, n = 6, 140
    x = rng.standard_normal((2, n, d))
    kpm = np.zeros((2, n), bool)
    kpm[1, :5] = True  # the second batch element has a few real tokens
    if family == "separable":
        kw = dict(
            w_qkv=rng.standard_normal((d, 1 + 2 * d)) / 3,
            b_qkv=rng.standard_normal(13),
            w_o=rng.standard_normal((d, 4)),
            b_o=rng.standard_normal(4),
        )
        f, fb, ref = (
            attnlab.separable_attention,
            attnlab.separable_attention_backward,
            R.separable_attention,
        )
    else:
        kw = {k: rng.standard_normal((d, d)) / 3 for k in ("w_q", "w_k", "w_proj", "w_final")}
        kw.update(
            w_g=rng.standard_normal(d), b_q=rng.standard_normal(d), variant=family.split("_")[1]
        )
        f, fb, ref = (
            attnlab.additive_attention,
            attnlab.additive_attention_backward,
            R.additive_attention,
        )
    got = f(x, key_padding_mask=kpm, **kw)
    want = ref(x, key_padding_mask=kpm, **kw)
    _check(f"{family} no real token float64", got, want, 1e-12)
    g = fb(np.ones_like(got), x, key_padding_mask=kpm, **kw)
    assert all(np.isfinite(a).all() for a in g.values())


@pytest.mark.empty_rows
@pytest.mark.parametrize("how", ["bool", "float_inf", "key_padding", "causal_bottom_right"])
def test_mha_fully_masked_rows_give_b_o_and_zero_gradients(how: str) -> None:
    """A query row that may attend no key: weights 0, output b_o, no NaN, and it contributes
    nothing to any gradient but b_o's."""
    rng = np.random.default_rng(10)
    d, h, n_q, n_k = 8, 2, 6, 5
    x, y = rng.standard_normal((2, n_q, d)), rng.standard_normal((2, n_k, d))
    w = {k: rng.standard_normal((d, d)) / 3 for k in ("w_q", "w_k", "w_v", "w_o")}
    w.update(b_q=rng.standard_normal(d), b_o=rng.standard_normal(d))
    kw: dict = dict(num_heads=h, **w)
    dead = np.zeros((2, n_q), bool)
    if how == "bool":
        m = rng.random((2, 1, n_q, n_k)) < 0.6
        m[:, :, 2] = False
        kw["mask"] = m
        dead[:, 2] = True
    elif how == "float_inf":
        m = rng.standard_normal((n_q, n_k))
        m[4] = -np.inf
        kw["mask"] = m
        dead[:, 4] = True
    elif how == "key_padding":
        kp = np.ones((2, n_k), bool)
        kp[1] = False
        kw["key_padding_mask"] = kp
        dead[1] = True
    else:
        kw["causal"] = "bottom_right"  # n_q > n_k: the first n_q - n_k queries see nothing
        dead[:, : n_q - n_k] = True
    out, wts = attnlab.multi_head_attention(x, y, return_weights=True, **kw)
    ref = R.multi_head_attention(x, y, **kw)
    _check(f"mha fully masked ({how})", out, ref, 1e-12)
    np.testing.assert_array_equal(out[dead], np.broadcast_to(w["b_o"], out[dead].shape))
    assert np.all(wts.transpose(0, 2, 1, 3)[dead] == 0)
    g_out = np.zeros_like(out)
    g_out[dead] = 1.0  # only the dead rows receive a gradient
    g = attnlab.multi_head_attention_backward(g_out, x, y, **kw)
    for name, a in g.items():
        assert np.isfinite(a).all(), name
        if name != "b_o":
            np.testing.assert_array_equal(a, 0, err_msg=name)
    np.testing.assert_array_equal(g["b_o"], np.full(d, dead.sum()))


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_masked_out_nonfinite_keys_and_values_reach_no_output(return_weights, dtype):
    """The rule for masked-out positions (README, Conventions): a key whose masked logit is -inf
    (causal, boolean mask, key padding, float mask -inf) is never read. With 300 tokens the
    causal rows span several query and key tiles: a NaN in value row 150 must reach rows
    150..299 and no earlier row, on the flash and the weights path alike, and equal the
    reference; the same for a NaN key behind a boolean mask and an Inf value behind a -inf float
    mask."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, 300, 16)).astype(dtype) for _ in range(3))
    v[0, 1, 150, 3] = np.nan
    k[0, 0, 40] = np.nan
    v[0, 0, 41] = np.inf
    boolean = np.ones((300, 300), bool)
    boolean[:, 40] = False  # key 40 hidden from every query of head 0 and 1
    boolean[200:, 40] = True  # ... except queries 200.. (they see the NaN key)
    flt = np.where(np.arange(300) == 41, -np.inf, 0.0).astype(dtype)[None, :].repeat(300, 0)
    flt[250:, 41] = 0.0  # the Inf value reaches queries 250.. only
    mask = np.where(boolean, flt, -np.inf).astype(dtype)
    with np.errstate(all="ignore"):
        got = attnlab.scaled_dot_product_attention(
            q, k, v, causal=True, mask=mask, return_weights=return_weights
        )
        ref = attnlab.reference.scaled_dot_product_attention(q, k, v, causal=True, mask=mask)
    got = got[0] if return_weights else got
    bad = ~np.isfinite(got)
    rows = np.arange(300)
    # head 1: the NaN value of key 150 reaches column 3 of rows >= 150 only
    assert bad[0, 1, rows >= 150, 3].all() and not bad[0, 1, rows < 150].any()
    # head 0: the NaN key 40 reaches rows >= 200 (all columns), the Inf value rows >= 250
    assert bad[0, 0, rows >= 200].all() and not bad[0, 0, rows < 200].any()
    assert np.array_equal(bad, ~np.isfinite(ref))
    ok = ~bad
    np.testing.assert_allclose(
        got[ok],
        ref[ok],
        rtol=2e-5 if dtype == np.float32 else 1e-12,
        atol=2e-5 if dtype == np.float32 else 1e-12,
    )


@pytest.mark.parametrize("d", [64, 384])
def test_projection_bias_rounds_once(d: int) -> None:
    """A bias much larger than the products of a projection: the product sum is accumulated
    first and the bias added once, so each output is within one ulp of the exact value (with
    the bias as the accumulator's start, each of the d FMAs rounds at the bias's scale: measured
    5.5 ulps at d = 64 and 21 at d = 384). One key, so the softmax weight is
    exactly 1 and the output is (x W_v) W_o + b_o."""
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((3, 1, d)) * 1e-2).astype(np.float32)
    w = {k: (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for k in "qkvo"}
    b_o = rng.uniform(1.0, 2.0, d).astype(np.float32)
    got = attnlab.multi_head_attention(
        x, w_q=w["q"], w_k=w["k"], w_v=w["v"], w_o=w["o"], b_o=b_o, num_heads=4
    )
    ref = (x.astype(np.float64) @ w["v"] @ w["o"]) + b_o
    ulps = np.abs(got - ref) / np.spacing(np.abs(ref).astype(np.float32))
    assert ulps.max() <= 1.0, f"{ulps.max():.2f} ulps"
