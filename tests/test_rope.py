"""Rotary position embeddings in multi_head_attention: forward against the float64 reference
(shapes, dtypes, grouped-query heads, causal modes, masks, partial rotary, positions), the
properties RoPE must have (relative positions only, decoding with a cache), gradients by finite
differences and torch.autograd.gradcheck, layers, the torch adapter, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab import layers, reference
from conftest import assert_close, make_mha_weights
from test_backward_mha import numeric_grad, rel_err

DTYPES = [np.float64, np.float32]

CASES = [
    # batch, n_q, n_k, h, h_kv, d_head, causal, rope_dim, positions kind, cross
    ((), 1, 1, 1, 1, 2, False, None, None, False),
    ((2,), 7, 7, 4, 2, 8, True, None, None, False),
    ((), 5, 9, 4, 4, 6, "bottom_right", 4, None, True),
    ((3,), 6, 6, 2, 1, 4, False, None, "array", False),
    ((2, 2), 4, 6, 2, 2, 4, False, 2, "pair", True),
    ((2,), 70, 140, 4, 2, 16, "bottom_right", 8, "array", True),  # several tiles each way
    ((1,), 130, 130, 2, 2, 8, True, None, "batched", False),
]


def _positions(kind, rng, batch, n_q, n_k):
    if kind == "array":
        return rng.integers(0, 300, (n_k,))
    if kind == "batched":
        return rng.integers(0, 300, batch + (n_k,))
    if kind == "pair":
        return (rng.integers(0, 300, (n_q,)), rng.integers(0, 300, batch + (n_k,)))
    return None


def _case(rng, case, dtype, d_model=16):
    batch, n_q, n_k, h, h_kv, d_head, causal, rope_dim, pos, cross = case
    w = make_mha_weights(rng, d_model, h, d_head, num_kv_heads=h_kv, dtype=dtype)
    xq = rng.standard_normal(batch + (n_q, d_model)).astype(dtype)
    xk = rng.standard_normal(batch + (n_k, d_model)).astype(dtype) if cross else None
    kw = dict(
        num_heads=h,
        num_kv_heads=h_kv,
        causal=causal,
        rope_theta=500.0,
        rope_dim=rope_dim,
        positions=_positions(pos, rng, batch, n_q, n_k),
        **w,
    )
    return xq, xk, kw


@pytest.mark.parametrize("mode", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_rope_forward_matches_reference(rng, case, dtype, mode):
    xq, xk, kw = _case(rng, case, dtype)
    got = attnlab.multi_head_attention(xq, xk, return_weights=mode, **kw)
    ref = reference.multi_head_attention(xq, xk, return_weights=mode, **kw)
    if mode:
        assert_close(got[1], ref[1], dtype, "rope weights")
        got, ref = got[0], ref[0]
    assert_close(got, ref, dtype, "rope mha vs reference")
    plain = reference.multi_head_attention(
        xq, xk, **{**kw, "rope_theta": None, "rope_dim": None, "positions": None}
    )
    if case[1] > 1:  # one query over one key at the same position: RoPE changes nothing
        assert np.abs(plain - ref).max() > 1e-3


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float", "kpm"])
def test_rope_with_masks(rng, kind, dtype):
    B, n, h = 2, 9, 4
    w = make_mha_weights(rng, 16, h, 4, dtype=dtype)
    x = rng.standard_normal((B, n, 16)).astype(dtype)
    kw: dict = dict(num_heads=h, rope_theta=10000.0, **w)
    if kind == "bool":
        m = rng.random((B, 1, n, n)) > 0.3
        m[0, 0, 2] = False  # a fully masked row: output b_o
        kw["mask"] = m
    elif kind == "float":
        kw["mask"] = rng.standard_normal((h, n, n)).astype(dtype)
    else:
        kp = np.ones((B, n), bool)
        kp[1, 6:] = False
        kw["key_padding_mask"] = kp
    assert_close(
        attnlab.multi_head_attention(x, **kw),
        reference.multi_head_attention(x, **kw),
        dtype,
        "rope mha vs reference",
    )


def test_rope_depends_on_relative_positions_only(rng):
    """q_m R(m) . k_n R(n) = q_m R(n - m) k_n: shifting every position changes nothing."""
    xq, xk, kw = _case(rng, ((2,), 6, 8, 4, 2, 8, False, 6, None, True), np.float64)
    pq, pk = np.arange(6) + 2.0, np.arange(8) * 1.5
    base = attnlab.multi_head_attention(xq, xk, **{**kw, "positions": (pq, pk)})
    for shift in (1, 37, 1000):
        moved = attnlab.multi_head_attention(
            xq, xk, **{**kw, "positions": (pq + shift, pk + shift)}
        )
        assert_close(moved, base, np.float64, "rope shift invariance", tol=1e-11)
    other = attnlab.multi_head_attention(xq, xk, **{**kw, "positions": (pq + 1, pk)})
    assert np.abs(other - base).max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_default_positions_decode_like_a_cache(rng, dtype):
    """The last n_q rows of causal self-attention over n tokens equal a bottom-right call of
    those n_q queries over all n keys: the default query positions are n - n_q .. n - 1."""
    n, n_new = 11, 3
    w = make_mha_weights(rng, 16, 4, 4, num_kv_heads=2, dtype=dtype)
    x = rng.standard_normal((2, n, 16)).astype(dtype)
    kw = dict(num_heads=4, num_kv_heads=2, rope_theta=10000.0, **w)
    full = attnlab.multi_head_attention(x, causal=True, **kw)
    step = attnlab.multi_head_attention(x[:, -n_new:], x, causal="bottom_right", **kw)
    assert_close(step, full[:, -n_new:].astype(np.float64), dtype, "rope decode")
    # positions of the whole sequence, queries aligned to its end
    pos = np.arange(n) + 5
    step = attnlab.multi_head_attention(
        x[:, -n_new:], x, causal="bottom_right", positions=pos, **kw
    )
    full = attnlab.multi_head_attention(x, causal=True, positions=pos, **kw)
    assert_close(step, full[:, -n_new:].astype(np.float64), dtype, "rope decode")


def test_rope_full_rotation_of_a_pair():
    """One head of width 2, theta irrelevant (one frequency, 1): the key at position p is
    rotated by p radians; checked against an explicit 2x2 rotation."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 2)), rng.standard_normal((2, 2))
    eye = np.eye(2)
    _, wts = attnlab.multi_head_attention(
        q,
        k,
        k,
        w_q=eye,
        w_k=eye,
        w_v=eye,
        w_o=eye,
        num_heads=1,
        rope_theta=7.0,
        scale=1.0,
        positions=(np.array([0.3]), np.array([1.0, 2.5])),
        return_weights=True,
    )

    def rot(x, a):  # transformers: [x0, x1] -> [x0 cos - x1 sin, x1 cos + x0 sin]
        c, s = np.cos(a), np.sin(a)
        return np.array([x[0] * c - x[1] * s, x[1] * c + x[0] * s])

    logits = np.array([rot(q[0], 0.3) @ rot(k[j], p) for j, p in enumerate((1.0, 2.5))])
    p = np.exp(logits - logits.max())
    np.testing.assert_allclose(wts[0, 0], p / p.sum(), rtol=1e-13)


ROPE_GRAD_CASES = [
    ((2,), 5, 5, 4, 2, 4, True, None, None, False),
    ((), 3, 6, 2, 1, 4, "bottom_right", 2, None, True),
    ((2,), 4, 4, 2, 2, 6, False, 4, "array", False),
    ((1,), 2, 3, 2, 2, 4, False, None, "pair", True),
]


@pytest.mark.parametrize("case", ROPE_GRAD_CASES)
def test_rope_backward_finite_differences(case):
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    xq, xk, kw = _case(rng, case, np.float64, d_model=8)
    G = rng.standard_normal(xq.shape[:-1] + (8,))
    grads = attnlab.multi_head_attention_backward(G, xq, xk, **kw)
    arrays = {"query": xq, **{k: v for k, v in kw.items() if k.startswith(("w_", "b_"))}}
    if xk is not None:
        arrays["key"] = xk
    assert set(grads) == set(arrays)

    def loss():
        return float((attnlab.multi_head_attention(xq, xk, **kw) * G).sum())

    for name, x in arrays.items():
        assert grads[name].shape == x.shape
        assert rel_err(grads[name], numeric_grad(loss, x)) < 1e-6, name


@pytest.mark.empty_rows
def test_rope_backward_fully_masked_and_no_keys(rng):
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((4, 8))
    m = np.ones((4, 4), bool)
    m[1] = False
    g = attnlab.multi_head_attention_backward(
        np.ones((4, 8)), x, mask=m, num_heads=2, rope_theta=10.0, **w
    )
    assert all(np.isfinite(v).all() for v in g.values())
    g0 = attnlab.multi_head_attention_backward(
        np.ones((2, 8)), x[:2], x[:0], num_heads=2, rope_theta=10.0, **w
    )
    np.testing.assert_array_equal(g0["w_q"], 0)
    np.testing.assert_array_equal(g0["b_o"], 2.0)


try:
    import torch
except ImportError:
    torch = None


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_rope_torch_adapter_gradcheck():
    import attnlab.torch as at

    rng = np.random.default_rng(5)
    w = {
        k: torch.tensor(v, requires_grad=True)
        for k, v in make_mha_weights(rng, 6, 2, 4, num_kv_heads=1).items()
    }
    x = torch.tensor(rng.standard_normal((2, 4, 6)), requires_grad=True)
    pos = torch.tensor([[3, 4, 5, 6], [0, 2, 4, 6]])

    def f(x, *ws):
        kw = dict(zip(w, ws, strict=True))
        return at.multi_head_attention(
            x, num_heads=2, num_kv_heads=1, causal=True, rope_theta=100.0, positions=pos, **kw
        )

    assert torch.autograd.gradcheck(f, (x, *w.values()), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_layer(rng, dtype):
    layer = layers.MultiHeadAttention(
        16, 4, num_kv_heads=2, rope_theta=1000.0, rope_dim=2, seed=0, dtype=dtype
    )
    x = rng.standard_normal((2, 6, 16)).astype(dtype)
    pos = np.arange(6) * 2
    y = layer(x, causal=True, positions=pos)
    ref = reference.multi_head_attention(
        x,
        causal=True,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=1000.0,
        rope_dim=2,
        positions=pos,
        **layer.params,
    )
    assert_close(y, ref, dtype, "rope layer")
    G = rng.standard_normal(y.shape).astype(dtype)
    dx = layer.backward(G)
    g = attnlab.multi_head_attention_backward(
        G,
        x,
        causal=True,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=1000.0,
        rope_dim=2,
        positions=pos,
        **layer.params,
    )
    np.testing.assert_array_equal(dx, g["query"])
    np.testing.assert_array_equal(layer.grads["w_k"], g["w_k"])
    with pytest.raises(ValueError, match=r"rotary embeddings.*do not fold"):
        layers.BilinearAttention.from_mha(layer)
    with pytest.raises(ValueError, match="positions: MultiHeadAttention has no rotary"):
        layers.MultiHeadAttention(16, 4, seed=0)(x, positions=pos)


def test_bilinear_has_no_rotary_option(rng):
    w = make_mha_weights(rng, 8, 2, 4)
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], num_heads=2)
    with pytest.raises(TypeError, match="rope_theta"):
        attnlab.bilinear_attention(
            np.ones((3, 8)), w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], num_heads=2, rope_theta=10.0
        )


@pytest.mark.parametrize(
    "extra, exc, words",
    [
        (dict(rope_theta=10.0, rope_dim=3), ValueError, "rope_dim: expected an even number"),
        (dict(rope_theta=10.0, rope_dim=6), ValueError, "rope_dim.*<= d_head = 4, got 6"),
        (dict(rope_theta=10.0, rope_dim=0), ValueError, "rope_dim"),
        (dict(rope_theta=10.0, rope_dim=2.0), TypeError, "rope_dim"),
        (dict(rope_dim=2), ValueError, "rope_dim: given without rope_theta"),
        (dict(positions=np.arange(5)), ValueError, "positions: given without rope_theta"),
        (dict(rope_theta=-1.0), ValueError, "rope_theta: expected a finite number > 0"),
        (dict(rope_theta=np.inf), ValueError, "rope_theta"),
        (dict(rope_theta=True), TypeError, "rope_theta"),
        (dict(rope_theta="10000"), TypeError, "rope_theta"),
        (
            dict(rope_theta=10.0, positions=np.arange(4)),
            ValueError,
            r"positions: expected shape \(..., 5\).*got \(4,\)",
        ),
        (dict(rope_theta=10.0, positions=np.ones(5, bool)), TypeError, "positions.*bool"),
        (dict(rope_theta=10.0, positions=np.array([0, 1, np.nan, 3, 4])), ValueError, "finite"),
        (dict(rope_theta=10.0, positions=np.zeros((3, 5))), ValueError, "broadcast"),
        (dict(rope_theta=10.0, positions=(np.arange(5),)), ValueError, "pair"),
        (
            dict(rope_theta=10.0, positions=(np.arange(5), np.arange(4))),
            ValueError,
            r"positions\[1\] \(keys\)",
        ),
    ],
)
def test_rope_errors(rng, extra, exc, words):
    w = make_mha_weights(rng, 8, 2, 4)
    with pytest.raises(exc, match=words):
        attnlab.multi_head_attention(np.ones((2, 5, 8)), num_heads=2, **w, **extra)


def test_rope_errors_shapes(rng):
    w = make_mha_weights(rng, 8, 2, 3)  # d_head 3: odd
    with pytest.raises(ValueError, match="rope_dim: d_head = 3 is odd"):
        attnlab.multi_head_attention(np.ones((5, 8)), num_heads=2, rope_theta=10.0, **w)
    assert attnlab.multi_head_attention(
        np.ones((5, 8)), num_heads=2, rope_theta=10.0, rope_dim=2, **w
    ).shape == (5, 8)
    w = make_mha_weights(rng, 8, 2, 4)
    with pytest.raises(ValueError, match=r"6 queries cannot be aligned with 4 keys.*pair"):
        attnlab.multi_head_attention(
            np.ones((6, 8)),
            np.ones((4, 8)),
            num_heads=2,
            rope_theta=10.0,
            positions=np.arange(4),
            **w,
        )
    with pytest.raises(ValueError, match="rope_dim"):
        layers.MultiHeadAttention(8, 2, rope_theta=10.0, rope_dim=5)


@pytest.mark.parametrize(
    "n_q, n_k, causal",
    [(6, 6, True), (4, 9, "bottom_right"), (9, 4, False), (9, 4, "bottom_right")],
)
def test_default_positions_are_the_explicit_ones(n_q, n_k, causal):
    """Default positions (tables shared between calls, the queries' a slice of the keys') give
    the bits of the same positions passed explicitly; the shared tables are read-only."""
    from attnlab import _rope

    rng = np.random.default_rng(21)
    w = make_mha_weights(rng, 16, 4, 4, dtype=np.float32)
    xq = rng.standard_normal((2, n_q, 16)).astype(np.float32)
    xk = rng.standard_normal((2, n_k, 16)).astype(np.float32)
    kw = dict(num_heads=4, causal=causal, rope_theta=300.0, **w)
    offset = n_k - n_q if causal == "bottom_right" else 0
    explicit = (np.arange(offset, offset + n_q), np.arange(n_k))
    for _ in range(2):  # computed, then from the shared tables
        got = attnlab.multi_head_attention(xq, xk, **kw)
        np.testing.assert_array_equal(
            got, attnlab.multi_head_attention(xq, xk, **kw, positions=explicit)
        )
    for tables in _rope._DEFAULT_TABLES.values():
        assert not any(t.flags.writeable for t in tables)
