"""attnlab.scaled_dot_product_attention and attnlab.multi_head_attention (C++ kernels) against
the plain NumPy float64 reference (attnlab.reference), with the conventions of
docs/architecture.md, section 3.

Kernel tiles are 64 queries x 128 keys, so the sizes below straddle one and several tiles.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import attnlab
from attnlab import reference as ref
from attnlab._args import CoreMask
from attnlab._loader import core
from attnlab.reference._mha import allowed_and_bias
from conftest import assert_close, make_mha_weights

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
DTYPES = [F32, F64]
SIZES = [(1, 1), (1, 7), (7, 1), (7, 7), (64, 64), (65, 130), (130, 65), (300, 300)]
HEADS = [  # (num_heads, num_kv_heads, d_head)
    (1, None, 1),
    (1, None, 8),
    (4, None, 8),
    (4, 2, 8),  # grouped-query
    (4, 1, 4),  # multi-query
]
CAUSAL = [False, True, "top_left", "bottom_right"]
MODES = [False, True, "heads", "mean"]


def _ids(v):
    return str(v)


def check_weights(w: np.ndarray, n_k: int) -> None:
    """Rows of weights sum to 1, or are all 0 (fully masked); never NaN."""
    assert not np.isnan(w).any()
    assert (w >= 0).all()
    if n_k == 0:
        return
    s = w.sum(axis=-1)
    tol = 1e-5 if w.dtype == F32 else 1e-12
    ok = (np.abs(s - 1) <= tol) | (s == 0)
    assert ok.all(), f"weight rows sum to {s[~ok][:5]}"
    zero_rows = s == 0
    assert (w[zero_rows] == 0).all()


def compare_mha(dtype, query, key, value, w, *, mode=False, label="mha vs reference", **kw):
    """Runs both implementations; compares outputs (and weights). Returns (out, weights)."""
    cast = lambda a: None if a is None else np.asarray(a).astype(dtype)  # noqa: E731
    args = [cast(query), cast(key), cast(value)]
    wd = {n: cast(a) for n, a in w.items()}
    got = attnlab.multi_head_attention(*args, **wd, **kw, return_weights=mode)
    exp = ref.multi_head_attention(*args, **wd, **kw, return_weights=mode)
    if mode is False:
        assert_close(got, exp, dtype, label)
        return got, None
    assert isinstance(got, tuple) and len(got) == 2
    assert_close(got[0], exp[0], dtype, label)
    assert_close(got[1], exp[1], dtype, label + " (weights)")
    return got


def compare_sdpa(dtype, q, k, v, *, mode=False, label="sdpa vs reference", **kw):
    q, k, v = (np.asarray(a).astype(dtype) for a in (q, k, v))
    got = attnlab.scaled_dot_product_attention(q, k, v, **kw, return_weights=mode)
    exp = ref.scaled_dot_product_attention(q, k, v, **kw, return_weights=mode)
    if mode is False:
        assert_close(got, exp, dtype, label)
        return got, None
    assert_close(got[0], exp[0], dtype, label)
    assert_close(got[1], exp[1], dtype, label + " (weights)")
    return got


# --------------------------------------------------------------------------------------------
# multi_head_attention: sizes x heads x dtype x flash/dense path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("heads", HEADS, ids=_ids)
@pytest.mark.parametrize("n_q,n_k", SIZES, ids=_ids)
def test_mha_sizes_heads(rng, n_q, n_k, heads, dtype, mode):
    h, h_kv, d_head = heads
    B, d = 2, 12
    w = make_mha_weights(rng, d, h, d_head, d_k=10, num_kv_heads=h_kv)
    query = rng.standard_normal((B, n_q, d))
    key = rng.standard_normal((B, n_k, 10))
    out = compare_mha(
        dtype, query, key, None, w, num_heads=h, num_kv_heads=h_kv, mode="heads" if mode else False
    )
    if mode:
        assert out[1].shape == (B, h, n_q, n_k)
        check_weights(out[1], n_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("n", [1, 7, 65, 130])
def test_mha_self_attention_defaults(rng, n, dtype):
    """key and value default to query; one batch dimension."""
    w = make_mha_weights(rng, 16, 4, 4)
    x = rng.standard_normal((3, n, 16))
    compare_mha(dtype, x, None, None, w, num_heads=4)
    # value defaults to key (not to query)
    key = rng.standard_normal((3, n + 2, 16))
    compare_mha(dtype, x, key, None, w, num_heads=4)
    a = attnlab.multi_head_attention(x.astype(dtype), key.astype(dtype), **w, num_heads=4)
    b = attnlab.multi_head_attention(
        x.astype(dtype), key.astype(dtype), key.astype(dtype), **w, num_heads=4
    )
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------

MASKS = [
    "none",
    "bool_qk",  # (n_q, n_k)
    "bool_h1k",  # (h, 1, n_k)
    "bool_full",  # (B, h, n_q, n_k)
    "bool_1k",  # (1, n_k)
    "float_qk",  # (n_q, n_k) with -inf entries
    "float_b1qk",  # (B, 1, n_q, n_k) with -inf entries
    "kpm",  # key_padding_mask only
    "bool_qk+kpm",
    "float_qk+kpm",
]


def make_mask(kind: str, rng, B: int, h: int, n_q: int, n_k: int, dtype=np.float64):
    """(mask, key_padding_mask) of the kind named; includes fully masked rows."""
    mask = kpm = None
    base = kind.split("+")[0]
    if base == "bool_qk":
        mask = rng.random((n_q, n_k)) < 0.7
        mask[0] = False  # a fully masked query row
    elif base == "bool_h1k":
        mask = rng.random((h, 1, n_k)) < 0.7
        mask[0] = False  # head 0 sees nothing
    elif base == "bool_full":
        mask = rng.random((B, h, n_q, n_k)) < 0.6
        mask[-1, -1, -1] = False
    elif base == "bool_1k":
        mask = rng.random((1, n_k)) < 0.7
        mask[0, 0] = True
    elif base.startswith("float"):
        shape = (n_q, n_k) if base == "float_qk" else (B, 1, n_q, n_k)
        mask = rng.standard_normal(shape).astype(dtype)
        mask[rng.random(shape) < 0.25] = -np.inf
        mask[..., -1, :] = -np.inf  # the last query row fully masked
    if base == "kpm" or kind.endswith("+kpm"):
        kpm = rng.random((B, n_k)) < 0.8
        kpm[:, 0] = True
        if B > 1:
            kpm[1] = False  # one batch element is all padding: every row fully masked
    return mask, kpm


@pytest.mark.empty_rows
@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("n_q,n_k", [(7, 7), (5, 9), (65, 130), (130, 65)], ids=_ids)
@pytest.mark.parametrize("causal", CAUSAL, ids=_ids)
@pytest.mark.parametrize("kind", MASKS)
def test_mha_masks(rng, kind, causal, n_q, n_k, dtype, mode):
    B, h, d = 2, 4, 16
    w = make_mha_weights(rng, d, h, 4, num_kv_heads=2)
    mask, kpm = make_mask(kind, rng, B, h, n_q, n_k, dtype)
    query = rng.standard_normal((B, n_q, d))
    key = rng.standard_normal((B, n_k, d))
    out, weights = compare_mha(
        dtype,
        query,
        key,
        None,
        w,
        num_heads=h,
        num_kv_heads=2,
        mask=mask,
        key_padding_mask=kpm,
        causal=causal,
        mode=mode and "heads",
    )
    assert np.isfinite(out).all()
    if weights is not None:
        check_weights(weights, n_k)
        check_masked_exact_zero(weights, B, h, n_q, n_k, mask, kpm, causal)


def check_masked_exact_zero(weights, B, h, n_q, n_k, mask, kpm, causal):
    """Entries that may not attend (bool False, float -inf, padding, causal) weigh exactly 0."""
    allowed, bias = allowed_and_bias(n_q, n_k, mask, kpm, causal)
    allowed = np.broadcast_to(allowed & ~np.isneginf(bias), (B, h, n_q, n_k))
    bad = weights[~allowed]
    assert (bad == 0).all(), (
        f"{np.count_nonzero(bad)} masked weights are not 0, e.g. {bad[bad != 0][:3]}"
    )


def test_mha_mask_bool_vs_float_equivalent(rng):
    """A boolean mask equals the float mask with 0 / -inf."""
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((2, 9, 8))
    m = rng.random((9, 9)) < 0.5
    fm = np.where(m, 0.0, -np.inf)
    a = attnlab.multi_head_attention(x, **w, num_heads=2, mask=m)
    b = attnlab.multi_head_attention(x, **w, num_heads=2, mask=fm)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("n_q,n_k", [(3, 7), (7, 3), (70, 200), (200, 70)], ids=_ids)
def test_causal_alignment(rng, n_q, n_k, mode, dtype):
    """top_left: query i sees keys j <= i; bottom_right: j <= i + n_k - n_q."""
    q = rng.standard_normal((2, 2, n_q, 8)).astype(dtype)
    k = rng.standard_normal((2, 2, n_k, 8)).astype(dtype)
    v = rng.standard_normal((2, 2, n_k, 5)).astype(dtype)
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    for causal, allowed in (
        (True, j <= i),
        ("top_left", j <= i),
        ("bottom_right", j <= i + n_k - n_q),
    ):
        got = attnlab.scaled_dot_product_attention(q, k, v, causal=causal, return_weights=mode)
        exp = attnlab.scaled_dot_product_attention(q, k, v, mask=allowed, return_weights=mode)
        if mode:
            np.testing.assert_array_equal(got[1] > 0, np.broadcast_to(allowed, got[1].shape))
            got, exp = got[0], exp[0]
        np.testing.assert_allclose(
            got, exp, rtol=1e-6 if dtype == F32 else 1e-14, atol=1e-6 if dtype == F32 else 1e-14
        )
        empty_rows = ~allowed.any(axis=1)
        assert (got[..., empty_rows, :] == 0).all()


# --------------------------------------------------------------------------------------------
# widths, biases, cross-attention
# --------------------------------------------------------------------------------------------

WIDTHS = [  # (d_q, d_k, d_v, h, h_kv, d_head, d_vhead, d_out)
    (12, 12, 12, 3, None, 4, 4, 12),
    (12, 7, 5, 3, None, 4, 4, 12),  # cross-attention, all input widths differ
    (12, 7, 5, 3, None, 4, 6, 9),  # d_vhead != d_head, d_out != d_model
    (16, 9, 11, 4, 2, 3, 5, 2),  # GQA + everything different
    (16, 9, 11, 4, 1, 6, 2, 1),  # MQA, d_out = 1
    (5, 3, 2, 2, None, 8, 1, 20),  # d_head > d_model, d_vhead = 1
    (1, 1, 1, 1, None, 1, 1, 1),  # everything 1
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("bias", [False, "q", "k", "v", "o", True], ids=_ids)
@pytest.mark.parametrize("widths", WIDTHS, ids=_ids)
def test_mha_widths_biases(rng, widths, bias, dtype):
    d_q, d_k, d_v, h, h_kv, d_head, d_vhead, d_out = widths
    w = make_mha_weights(
        rng,
        d_q,
        h,
        d_head,
        d_k=d_k,
        d_v=d_v,
        num_kv_heads=h_kv,
        d_vhead=d_vhead,
        d_out=d_out,
        bias=bias,
    )
    query = rng.standard_normal((2, 6, d_q))
    key = rng.standard_normal((2, 9, d_k))
    value = rng.standard_normal((2, 9, d_v))
    out, weights = compare_mha(
        dtype,
        query,
        key,
        value,
        w,
        num_heads=h,
        num_kv_heads=h_kv,
        mode="heads",
        causal="bottom_right",
    )
    assert out.shape == (2, 6, d_out)
    assert weights.shape == (2, h, 6, 9)


def test_heads_use_their_own_column_block(rng):
    """Head i reads column block i of w_q/w_k/w_v and row block i of w_o (by construction)."""
    h, dh, d = 3, 2, 6
    w = make_mha_weights(rng, d, h, dh, bias=False)
    x = rng.standard_normal((5, d))
    got = attnlab.multi_head_attention(x, **w, num_heads=h)
    total = np.zeros((5, d))
    for i in range(h):
        sl = slice(i * dh, (i + 1) * dh)
        ctx = attnlab.scaled_dot_product_attention(
            (x @ w["w_q"][:, sl])[None], (x @ w["w_k"][:, sl])[None], (x @ w["w_v"][:, sl])[None]
        )[0]
        total += ctx @ w["w_o"][sl]
    np.testing.assert_allclose(got, total, rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------------------------
# batch dimensions
# --------------------------------------------------------------------------------------------

BATCHES = [  # (query batch, key batch, value batch, mask shape prefix or None)
    ((), (), (), None),
    ((3,), (3,), (3,), (3, 1)),
    ((2, 3), (2, 3), (2, 3), (2, 3, 1)),
    ((2, 1), (1, 3), (3,), (3, 1)),  # broadcasting batch dims
    ((1,), (4,), (4,), (4, 1)),
    ((), (2,), (2,), None),  # query without batch against batched keys
    ((2, 3), (), (), (1, 1)),
]


@pytest.mark.parametrize("mode", MODES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("batches", BATCHES, ids=_ids)
def test_mha_batch_dims(rng, batches, dtype, mode):
    bq, bk, bv, mb = batches
    h, n_q, n_k = 2, 5, 70
    w = make_mha_weights(rng, 8, h, 4, d_k=6)
    query = rng.standard_normal(bq + (n_q, 8))
    key = rng.standard_normal(bk + (n_k, 6))
    value = rng.standard_normal(bv + (n_k, 6))
    batch = np.broadcast_shapes(bq, bk, bv)
    mask = None if mb is None else rng.random(mb + (n_q, n_k)) < 0.7
    kpm = rng.random(batch + (n_k,)) < 0.9 if batch else None
    got = compare_mha(
        dtype, query, key, value, w, num_heads=h, mask=mask, key_padding_mask=kpm, mode=mode
    )
    out, weights = got
    assert out.shape == batch + (n_q, 8)
    if mode in (True, "heads"):
        assert weights.shape == batch + (h, n_q, n_k)
        check_weights(weights, n_k)
    elif mode == "mean":
        assert weights.shape == batch + (n_q, n_k)
        check_weights(weights, n_k)
    else:
        assert weights is None and isinstance(out, np.ndarray)


def test_return_weights_modes_agree(rng):
    w = make_mha_weights(rng, 8, 4, 2)
    x = rng.standard_normal((2, 6, 8))
    o0 = attnlab.multi_head_attention(x, **w, num_heads=4)
    o1, w1 = attnlab.multi_head_attention(x, **w, num_heads=4, return_weights=True)
    o2, w2 = attnlab.multi_head_attention(x, **w, num_heads=4, return_weights="heads")
    o3, w3 = attnlab.multi_head_attention(x, **w, num_heads=4, return_weights="mean")
    np.testing.assert_array_equal(w1, w2)
    np.testing.assert_allclose(w3, w1.mean(axis=-3), rtol=1e-15, atol=1e-15)
    for o in (o1, o2, o3):
        np.testing.assert_allclose(o, o0, rtol=1e-13, atol=1e-14)


# --------------------------------------------------------------------------------------------
# scale, fully masked rows, dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("scale", [0.0, 0.05, 0.3, 1.0, 2.5, -1.0, np.float32(0.7)], ids=_ids)
def test_explicit_scale(rng, scale, dtype):
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((2, 70, 8))
    compare_mha(dtype, x, None, None, w, num_heads=2, scale=scale, mode="heads", causal=True)
    q, k, v = (rng.standard_normal((2, 3, 9, 5)) for _ in range(3))
    compare_sdpa(dtype, q, k, v, scale=scale, mode=True)


def test_default_scale_is_inverse_sqrt_d_head(rng):
    w = make_mha_weights(rng, 12, 3, 4, d_vhead=7)
    x = rng.standard_normal((2, 6, 12))
    a = attnlab.multi_head_attention(x, **w, num_heads=3)
    b = attnlab.multi_head_attention(x, **w, num_heads=3, scale=0.5)
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("n_k", [5, 200])
@pytest.mark.parametrize("how", ["bool", "float", "kpm", "causal"])
def test_fully_masked_rows(rng, how, n_k, mode, dtype):
    """Weights 0, context 0, output row == b_o exactly; no NaN."""
    B, h, n_q, d = 2, 2, 6, 8
    w = {k: v.astype(dtype) for k, v in make_mha_weights(rng, d, h, 4).items()}
    x = rng.standard_normal((B, n_q, d)).astype(dtype)
    kv = rng.standard_normal((B, n_k, d)).astype(dtype)
    kw = {}
    dead = np.zeros((B, n_q), dtype=bool)  # rows fully masked in every head
    if how == "bool":
        m = np.ones((n_q, n_k), dtype=bool)
        m[[1, 4]] = False
        kw["mask"] = m
        dead[:, [1, 4]] = True
    elif how == "float":
        m = np.zeros((B, 1, n_q, n_k), dtype=dtype)
        m[0, :, 2] = -np.inf
        kw["mask"] = m
        dead[0, 2] = True
    elif how == "kpm":
        kpm = np.ones((B, n_k), dtype=bool)
        kpm[1] = False
        kw["key_padding_mask"] = kpm
        dead[1] = True
    else:  # bottom_right with more queries than keys: the first n_q - n_k rows see nothing
        kv = kv[:, :3]
        kw["causal"] = "bottom_right"
        dead[:, : n_q - 3] = True
    res = attnlab.multi_head_attention(x, kv, **w, num_heads=h, return_weights=mode, **kw)
    out = res[0] if mode else res
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[dead], np.broadcast_to(w["b_o"], out[dead].shape))
    if mode:
        wts = res[1]
        assert (wts.transpose(0, 2, 1, 3)[dead] == 0).all()
        check_weights(wts, kv.shape[-2])
    exp = ref.multi_head_attention(x, kv, **w, num_heads=h, return_weights=mode, **kw)
    assert_close(out, exp[0] if mode else exp, dtype, "mha vs reference")


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_first_key_blocks_unseen(rng, dtype, sinks):
    """Key blocks no query of a tile may see are skipped, so the first block a tile computes
    may be a later one (its value product then starts the accumulator): padding that hides the
    first 256-key block or two, a row that sees nothing, against the reference."""
    B, h, n, n_k, d = 3, 2, 40, 700, 16
    q = rng.standard_normal((B, h, n, d)).astype(dtype)
    k, v = (rng.standard_normal((B, h, n_k, d)).astype(dtype) for _ in range(2))
    keep = np.ones((B, 1, n, n_k), dtype=bool)
    keep[0, ..., :300] = False  # the first key block of batch 0 unseen
    keep[1, ..., :600] = False  # the first two of batch 1
    keep[2, :, 5] = False  # one row of batch 2 sees no key
    kw = {"sinks": rng.standard_normal(h).astype(dtype)} if sinks else {}
    got = attnlab.scaled_dot_product_attention(q, k, v, mask=keep, **kw)
    exp = ref.scaled_dot_product_attention(q, k, v, mask=keep, **kw)
    assert_close(got, exp, dtype, "sdpa, first key blocks unseen")


@pytest.mark.empty_rows
def test_sdpa_fully_masked_rows_zero(rng):
    q, k, v = (rng.standard_normal((2, 3, 10, 4)) for _ in range(3))
    m = np.ones((10, 10), dtype=bool)
    m[3] = False
    for mode in (False, True):
        res = attnlab.scaled_dot_product_attention(q, k, v, mask=m, return_weights=mode)
        out = res[0] if mode else res
        assert (out[..., 3, :] == 0).all() and not np.isnan(out).any()
        if mode:
            assert (res[1][..., 3, :] == 0).all()


MIXED = [  # dtypes of (query, weights) -> result
    (np.float32, np.float32, F32),
    (np.float64, np.float64, F64),
    (np.float32, np.float64, F64),
    (np.float64, np.float32, F64),
    (np.int64, np.float32, F64),
    (np.int32, np.float64, F64),
    (np.float16, np.float32, F32),  # half precision is computed in float32
    (np.float16, np.float16, np.float16),  # and stored in its own dtype when every input has it
    (np.uint8, np.int16, F64),
]


@pytest.mark.parametrize("dq,dw,expected", MIXED, ids=_ids)
def test_mha_mixed_dtypes(rng, dq, dw, expected):
    w = {
        k: (v * 4).round().astype(dw) if np.dtype(dw).kind in "iu" else v.astype(dw)
        for k, v in make_mha_weights(rng, 8, 2, 4).items()
    }
    x = rng.integers(0, 3, (2, 5, 8)).astype(dq)
    got = attnlab.multi_head_attention(x, **w, num_heads=2)
    assert got.dtype == expected
    exp = ref.multi_head_attention(x, **w, num_heads=2)
    assert_close(got, exp, expected, "mha vs reference")


@pytest.mark.parametrize("dq,dk,expected", MIXED, ids=_ids)
def test_sdpa_mixed_dtypes(rng, dq, dk, expected):
    q = rng.integers(-2, 3, (2, 5, 4)).astype(dq)
    k = rng.integers(-2, 3, (2, 6, 4)).astype(dk)
    v = rng.integers(-2, 3, (2, 6, 3)).astype(dk)
    got = attnlab.scaled_dot_product_attention(q, k, v)
    assert got.dtype == expected
    assert_close(got, ref.scaled_dot_product_attention(q, k, v), expected, "sdpa vs reference")


def test_float_mask_dtype_follows_data(rng):
    """A float64 mask on float32 data keeps the float32 result; float16 masks work."""
    q, k, v = (rng.standard_normal((2, 5, 4)).astype(np.float32) for _ in range(3))
    for mdt in (np.float16, np.float32, np.float64):
        m = rng.standard_normal((5, 5)).astype(mdt)
        got = attnlab.scaled_dot_product_attention(q, k, v, mask=m)
        assert got.dtype == F32
        assert_close(got, ref.scaled_dot_product_attention(q, k, v, mask=m), F32)


def test_array_likes(rng):
    w = make_mha_weights(rng, 4, 2, 2)
    x = rng.standard_normal((3, 4))
    got = attnlab.multi_head_attention(
        x.tolist(),
        **{k: v.tolist() for k, v in w.items()},
        num_heads=np.int64(2),
        mask=(np.eye(3) > 0).tolist(),
    )
    np.testing.assert_allclose(
        got,
        attnlab.multi_head_attention(x, **w, num_heads=2, mask=np.eye(3) > 0),
        rtol=1e-14,
        atol=1e-15,
    )


# --------------------------------------------------------------------------------------------
# memory layouts
# --------------------------------------------------------------------------------------------


def _layouts(a: np.ndarray):
    """Same values, different layouts: strided slice, Fortran order, read-only, negative step."""
    big = np.zeros(a.shape[:-1] + (a.shape[-1] * 2,), dtype=a.dtype)
    big[..., ::2] = a
    f = np.asfortranarray(a)
    ro = a.copy()
    ro.flags.writeable = False
    rev = a[..., ::-1].copy()[..., ::-1]
    # data at an odd address (np.ndarray over a byte buffer): flags.aligned is False
    un = np.ndarray(a.shape, dtype=a.dtype, buffer=bytearray(a.nbytes + 1), offset=1)
    un[...] = a
    return {
        "strided": big[..., ::2],
        "fortran": f,
        "readonly": ro,
        "reversed": rev,
        "unaligned": un,
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("layout", ["strided", "fortran", "readonly", "reversed", "unaligned"])
def test_mha_layouts(rng, layout, dtype):
    w = make_mha_weights(rng, 8, 2, 4, d_k=6, dtype=dtype)
    query = rng.standard_normal((2, 70, 8)).astype(dtype)
    key = rng.standard_normal((2, 130, 6)).astype(dtype)
    mask = rng.random((2, 1, 70, 130)) < 0.8
    kpm = rng.random((2, 130)) < 0.9
    expected = attnlab.multi_head_attention(
        query, key, **w, num_heads=2, mask=mask, key_padding_mask=kpm, return_weights=True
    )
    L = lambda a: _layouts(a)[layout]  # noqa: E731
    got = attnlab.multi_head_attention(
        L(query),
        L(key),
        **{k: L(v) for k, v in w.items()},
        num_heads=2,
        mask=L(mask),
        key_padding_mask=L(kpm),
        return_weights=True,
    )
    # (bitwise equality is the determinism tests' business: see test_repeatable)
    tol = 1e-6 if dtype == F32 else 1e-14
    assert_close(got[0], expected[0], dtype, "mha layouts vs contiguous", tol=tol)
    assert_close(got[1], expected[1], dtype, "mha layouts vs contiguous", tol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize(
    "layout", ["strided", "fortran", "readonly", "reversed", "unaligned", "heads_view"]
)
def test_sdpa_layouts(rng, layout, dtype):
    B, n, h, d = 2, 70, 3, 8
    x = {c: rng.standard_normal((B, n, h * d)).astype(dtype) for c in "qkv"}
    # the usual (B, n, h*d) -> (B, h, n, d) transposed view
    views = {c: a.reshape(B, n, h, d).transpose(0, 2, 1, 3) for c, a in x.items()}
    dense = {c: np.ascontiguousarray(a) for c, a in views.items()}
    mask = rng.standard_normal((B, 1, n, n)).astype(dtype)
    expected = attnlab.scaled_dot_product_attention(
        dense["q"], dense["k"], dense["v"], mask=mask, return_weights=True
    )
    if layout == "heads_view":
        args = [views[c] for c in "qkv"]
    else:
        args = [_layouts(dense[c])[layout] for c in "qkv"]
    got = attnlab.scaled_dot_product_attention(
        *args,
        mask=_layouts(mask)["strided"] if layout != "heads_view" else mask,
        return_weights=True,
    )
    assert_close(
        got[0],
        expected[0],
        dtype,
        "sdpa layouts vs contiguous",
        tol=1e-6 if dtype == F32 else 1e-14,
    )
    assert_close(
        got[1],
        expected[1],
        dtype,
        "sdpa layouts vs contiguous",
        tol=1e-6 if dtype == F32 else 1e-14,
    )
    exp_ref = ref.scaled_dot_product_attention(*args, mask=mask, return_weights=True)
    assert_close(got[0], exp_ref[0], dtype, "sdpa vs reference")


def test_inputs_not_modified(rng):
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((2, 5, 8))
    m = rng.standard_normal((5, 5))
    copies = [x.copy(), m.copy()] + [v.copy() for v in w.values()]
    attnlab.multi_head_attention(x, **w, num_heads=2, mask=m, return_weights="mean")
    for a, b in zip([x, m, *w.values()], copies, strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# empty inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [False, True, "mean"], ids=_ids)
@pytest.mark.parametrize(
    "batch,n_q,n_k",
    [((2,), 0, 5), ((2,), 4, 0), ((0,), 4, 5), ((2, 0), 4, 5), ((), 0, 0), ((3,), 0, 0)],
    ids=_ids,
)
def test_mha_empty(rng, batch, n_q, n_k, mode):
    w = make_mha_weights(rng, 8, 2, 4, d_out=5)
    query = rng.standard_normal(batch + (n_q, 8))
    key = rng.standard_normal(batch + (n_k, 8))
    res = attnlab.multi_head_attention(
        query, key, **w, num_heads=2, return_weights=mode, causal=True
    )
    out = res[0] if mode else res
    assert out.shape == batch + (n_q, 5)
    np.testing.assert_array_equal(out, np.broadcast_to(w["b_o"], out.shape))
    if mode:
        shape = batch + ((2,) if mode is True else ()) + (n_q, n_k)
        assert res[1].shape == shape


@pytest.mark.parametrize("mode", [False, True], ids=_ids)
@pytest.mark.parametrize(
    "shape_q,shape_k",
    [
        ((2, 3, 0, 4), (2, 3, 5, 4)),
        ((2, 3, 4, 4), (2, 3, 0, 4)),
        ((0, 3, 4, 4), (0, 3, 5, 4)),
        ((3, 0, 4), (3, 0, 4)),
    ],
    ids=_ids,
)
def test_sdpa_empty(rng, shape_q, shape_k, mode):
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal(shape_k)
    v = rng.standard_normal(shape_k[:-1] + (6,))
    res = attnlab.scaled_dot_product_attention(q, k, v, return_weights=mode)
    out = res[0] if mode else res
    assert out.shape == shape_q[:-1] + (6,)
    assert (out == 0).all()
    if mode:
        assert res[1].shape == shape_q[:-1] + (shape_k[-2],)


# --------------------------------------------------------------------------------------------
# NaN / Inf, large logits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("where", ["whole_row", "one_element"])
def test_sdpa_nan_query_row(rng, where, mode, dtype):
    """NaN in one query row makes that row's outputs NaN and leaves every other row alone."""
    q, k, v = (rng.standard_normal((2, 3, 70, 8)).astype(dtype) for _ in range(3))
    clean = attnlab.scaled_dot_product_attention(q, k, v, return_weights=mode)
    if where == "whole_row":
        q[1, 2, 66] = np.nan
    else:
        q[1, 2, 66, 3] = np.nan
    res = attnlab.scaled_dot_product_attention(q, k, v, return_weights=mode)
    out, c = (res[0], clean[0]) if mode else (res, clean)
    bad = np.zeros(out.shape[:-1], dtype=bool)
    bad[1, 2, 66] = True
    assert np.isnan(out[bad]).all(), f"NaN query row gave {out[bad]}"
    tol = 1e-6 if dtype == F32 else 1e-14  # (bitwise: the determinism tests' business)
    np.testing.assert_allclose(out[~bad], c[~bad], rtol=tol, atol=tol)
    if mode:
        assert np.isnan(res[1][bad]).all()
        np.testing.assert_allclose(res[1][~bad], clean[1][~bad], rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
def test_sdpa_nan_key_row(rng, mode):
    """NaN in one key poisons every query row that may attend to it, and only those."""
    q, k, v = (rng.standard_normal((1, 2, 200, 4)) for _ in range(3))
    k[0, 1, 150, 0] = np.nan
    res = attnlab.scaled_dot_product_attention(q, k, v, causal=True, return_weights=mode)
    out = res[0] if mode else res
    assert np.isnan(out[0, 1, 150:]).all()
    assert np.isfinite(out[0, 1, :150]).all() and np.isfinite(out[0, 0]).all()


def test_mha_nan_query_row(rng):
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((2, 5, 8))
    x[1, 3, 0] = np.nan
    out = attnlab.multi_head_attention(x, rng.standard_normal((2, 5, 8)), **w, num_heads=2)
    assert np.isnan(out[1, 3]).all()
    assert np.isfinite(np.delete(out.reshape(10, 8), 8, axis=0)).all()


@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("val", [np.inf, -np.inf])
def test_inf_does_not_crash(rng, val, mode):
    q, k, v = (rng.standard_normal((2, 2, 70, 4)) for _ in range(3))
    q[0, 0, 3, 1] = val
    k[1, 1, 5, 2] = val
    v[0, 1, 7, 0] = val
    res = attnlab.scaled_dot_product_attention(q, k, v, return_weights=mode)
    out = res[0] if mode else res
    assert out.shape == (2, 2, 70, 4)
    exp = ref.scaled_dot_product_attention(q, k, v)
    # rows untouched by the infinities agree with the reference
    fin = np.isfinite(exp).all(axis=-1) & np.isfinite(out).all(axis=-1)
    np.testing.assert_allclose(out[fin], exp[fin], rtol=1e-12, atol=1e-12)
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((2, 5, 8))
    x[0, 1, 0] = val
    attnlab.multi_head_attention(x, **w, num_heads=2, return_weights=mode)


@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_large_logits_float32(rng, magnitude, causal, mode):
    """Logits ~1e4 in float32: no Inf/NaN, and agreement with the float64 reference."""
    d = 16
    q = rng.standard_normal((2, 2, 150, d))
    k = rng.standard_normal((2, 2, 150, d))
    v = rng.standard_normal((2, 2, 150, 8))
    c = np.sqrt(magnitude)  # logits = q.k / sqrt(d) ~ magnitude
    q32, k32, v32 = (q * c).astype(np.float32), (k * c).astype(np.float32), v.astype(np.float32)
    res = attnlab.scaled_dot_product_attention(q32, k32, v32, causal=causal, return_weights=mode)
    out = res[0] if mode else res
    assert np.isfinite(out).all()
    # the reference sees the same rounded float32 inputs; near-ties between the two largest
    # logits amplify input rounding, so compare with the float32 inputs, widened
    exp = ref.scaled_dot_product_attention(q32, k32, v32, causal=causal)
    assert_close(out, exp, F32, "sdpa f32 large logits", tol=1e-3 if magnitude > 1e3 else None)
    if mode:
        assert np.isfinite(res[1]).all()
        check_weights(res[1], 150)
    # MHA with huge weights
    w = make_mha_weights(rng, 16, 2, 8)
    w["w_q"] *= c
    w["w_k"] *= c
    x = rng.standard_normal((2, 80, 16)).astype(np.float32)
    w32 = {kk: vv.astype(np.float32) for kk, vv in w.items()}
    got = attnlab.multi_head_attention(x, **w32, num_heads=2, causal=causal)
    assert np.isfinite(got).all()


# --------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------


@pytest.fixture
def restore_threads():
    before = attnlab.get_num_threads()
    yield
    attnlab.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.usefixtures("restore_threads")
def test_thread_count_bitwise(rng, dtype):
    w = make_mha_weights(rng, 32, 4, 8, num_kv_heads=2, dtype=dtype)
    x = rng.standard_normal((3, 300, 32)).astype(dtype)
    kpm = rng.random((3, 300)) < 0.9
    q, k, v = (rng.standard_normal((3, 4, 200, 8)).astype(dtype) for _ in range(3))
    results = []
    for t in (1, 2, 1, 2):
        attnlab.set_num_threads(t)
        assert attnlab.get_num_threads() == t
        results.append(
            (
                attnlab.multi_head_attention(
                    x, **w, num_heads=4, num_kv_heads=2, causal=True, key_padding_mask=kpm
                ),
                attnlab.multi_head_attention(
                    x, **w, num_heads=4, num_kv_heads=2, return_weights=True
                ),
                attnlab.scaled_dot_product_attention(q, k, v, causal="bottom_right"),
            )
        )
    for r in results[1:]:
        np.testing.assert_array_equal(r[0], results[0][0])
        np.testing.assert_array_equal(r[1][0], results[0][1][0])
        np.testing.assert_array_equal(r[1][1], results[0][1][1])
        np.testing.assert_array_equal(r[2], results[0][2])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.usefixtures("restore_threads")
def test_repeatable(rng, mode, dtype, threads):
    """The same call gives the same bits every time, wherever its buffers happen to land."""
    attnlab.set_num_threads(threads)
    w = make_mha_weights(rng, 16, 4, 4, dtype=dtype)
    x = rng.standard_normal((2, 130, 16)).astype(dtype)
    key = rng.standard_normal((2, 37, 16)).astype(dtype)
    first = attnlab.multi_head_attention(x, key, **w, num_heads=4, return_weights=mode)
    junk = []
    for i in range(40):
        junk.append(np.empty(int(rng.integers(1, 64)), dtype=np.int8))  # shift the heap
        again = attnlab.multi_head_attention(x, key, **w, num_heads=4, return_weights=mode)
        for a, b in zip(first if mode else [first], again if mode else [again], strict=True):
            np.testing.assert_array_equal(b, a, err_msg=f"call {i + 2} differs from call 1")


# --------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# --------------------------------------------------------------------------------------------

SDPA_HEADS = [(1, 1), (4, 4), (4, 2), (4, 1), (6, 3)]  # (h, h_kv)


@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("heads", SDPA_HEADS, ids=_ids)
@pytest.mark.parametrize("n_q,n_k", SIZES, ids=_ids)
def test_sdpa_sizes_heads(rng, n_q, n_k, heads, dtype, mode):
    h, h_kv = heads
    d, d_v = (1, 1) if h == 1 else (8, 5)
    q = rng.standard_normal((2, h, n_q, d))
    k = rng.standard_normal((2, h_kv, n_k, d))
    v = rng.standard_normal((2, h_kv, n_k, d_v))
    out = compare_sdpa(dtype, q, k, v, mode=mode)
    if mode:
        check_weights(out[1], n_k)


SDPA_MASKS = ["bool_qk", "bool_h1k", "bool_full", "bool_1k", "float_qk", "float_b1qk"]


@pytest.mark.empty_rows
@pytest.mark.parametrize("mode", [False, True], ids=["flash", "weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("causal", CAUSAL, ids=_ids)
@pytest.mark.parametrize("kind", SDPA_MASKS)
def test_sdpa_masks(rng, kind, causal, dtype, mode):
    B, h, h_kv, n_q, n_k = 2, 4, 2, 65, 130
    mask, _ = make_mask(kind, rng, B, h, n_q, n_k, dtype)
    q = rng.standard_normal((B, h, n_q, 8))
    k = rng.standard_normal((B, h_kv, n_k, 8))
    v = rng.standard_normal((B, h_kv, n_k, 8))
    out = compare_sdpa(dtype, q, k, v, mask=mask, causal=causal, mode=mode)
    if mode:
        check_weights(out[1], n_k)
        check_masked_exact_zero(out[1], B, h, n_q, n_k, mask, None, causal)


SDPA_BATCHES = [  # batch dims of q, k, v (and the mask prefix)
    ((), (), ()),
    ((3,), (3,), (3,)),
    ((2, 3), (2, 3), (2, 3)),
    ((2, 1), (1, 3), (3,)),
    ((1,), (4,), (1,)),
    ((5,), (), ()),
    ((), (2, 2), (1, 2)),
]


@pytest.mark.parametrize("mode", MODES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("batches", SDPA_BATCHES, ids=_ids)
def test_sdpa_batch_broadcast(rng, batches, dtype, mode):
    bq, bk, bv = batches
    h, h_kv, n_q, n_k = 4, 2, 9, 70
    q = rng.standard_normal(bq + (h, n_q, 8))
    k = rng.standard_normal(bk + (h_kv, n_k, 8))
    v = rng.standard_normal(bv + (h_kv, n_k, 3))
    batch = np.broadcast_shapes(bq, bk, bv)
    mask = rng.random((h, n_q, n_k)) < 0.7
    got = compare_sdpa(dtype, q, k, v, mask=mask, mode=mode)
    out = got[0]
    assert out.shape == batch + (h, n_q, 3)
    if mode:
        shape = batch + ((h,) if mode in (True, "heads") else ()) + (n_q, n_k)
        assert got[1].shape == shape
        check_weights(got[1], n_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_sdpa_gqa_equals_repeated_heads(rng, dtype):
    """Query head j uses kv head j // (h // h_kv)."""
    # 17 queries: both calls take the flash tile (up to 16 query rows per kv head take the
    # decode path, so 10 queries would take it for the repeated heads only, in another order)
    q = rng.standard_normal((2, 6, 17, 4)).astype(dtype)
    k = rng.standard_normal((2, 2, 12, 4)).astype(dtype)
    v = rng.standard_normal((2, 2, 12, 3)).astype(dtype)
    a = attnlab.scaled_dot_product_attention(q, k, v, causal=True)
    b = attnlab.scaled_dot_product_attention(
        q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), causal=True
    )
    np.testing.assert_array_equal(a, b)


def test_mha_gqa_equals_repeated_kv_weights(rng):
    """num_kv_heads=h_kv is MHA with each kv head's weight block repeated h // h_kv times."""
    h, h_kv, dh = 6, 2, 3
    w = make_mha_weights(rng, 12, h, dh, num_kv_heads=h_kv)
    x = rng.standard_normal((2, 7, 12))
    a = attnlab.multi_head_attention(x, **w, num_heads=h, num_kv_heads=h_kv)

    def rep(m):  # each kv head repeated for its group of query heads
        return np.concatenate(
            [m[..., j * dh : (j + 1) * dh] for j in range(h_kv) for _ in range(h // h_kv)], axis=-1
        )

    w2 = dict(w, w_k=rep(w["w_k"]), w_v=rep(w["w_v"]), b_k=rep(w["b_k"]), b_v=rep(w["b_v"]))
    b = attnlab.multi_head_attention(x, **w2, num_heads=h)
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


def test_core_mask_fields_are_what_the_bindings_read():
    """attnlab._args.CoreMask's fields, in order, are the tuple the bindings' mask_args reads
    (cpp/bindings/common.hpp, the scalar options through for_each_option): its error names
    them."""
    q = np.zeros((1, 1, 2, 4))
    out = np.zeros((1, 1, 2, 4))
    with pytest.raises(ValueError, match=r"mask: expected a tuple \(.*\), got 0 items") as e:
        core.sdpa_forward(q, q, q, out, (), 1.0, None, None)
    found = re.search(r"\((.*)\)", str(e.value))
    assert found and tuple(found.group(1).split(", ")) == CoreMask._fields
    core.sdpa_forward(q, q, q, out, CoreMask(None, None, 2), 1.0, None, None)
    with pytest.raises(ValueError, match="causal: expected an int from 0 to 2, got 3"):
        core.sdpa_forward(q, q, q, out, CoreMask(None, None, 3), 1.0, None, None)
    with pytest.raises(ValueError, match="causal: expected an int from 0 to 2, got 1"):
        core.sdpa_forward(q, q, q, out, CoreMask(None, None, 1 << 70), 1.0, None, None)
    with pytest.raises(TypeError, match="causal: expected an int, got str"):
        core.sdpa_forward(q, q, q, out, CoreMask(None, None, "top_left"), 1.0, None, None)  # type: ignore[arg-type]
