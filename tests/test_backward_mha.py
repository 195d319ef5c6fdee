"""Gradients of scaled_dot_product_attention and multi_head_attention.

Central finite differences in float64 (relative error < 1e-6) and torch autograd (float32).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from conftest import numeric_grad, rel_err

SDPA_CASES = [
    # (B, h, h_kv, n_q, n_k, d, d_v, causal, mask kind)
    (1, 1, 1, 1, 1, 1, 1, False, None),
    (2, 2, 2, 5, 7, 3, 4, False, None),
    (1, 4, 2, 6, 6, 3, 2, True, None),
    (1, 4, 1, 4, 9, 2, 3, "bottom_right", None),
    (2, 2, 1, 5, 7, 3, 3, False, "bool"),
    (1, 2, 2, 5, 7, 3, 3, False, "float"),
    (1, 2, 2, 70, 140, 2, 2, True, "bool"),  # more than one tile each way
]


@pytest.mark.empty_rows
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_backward_finite_differences(case):
    B, h, h_kv, n_q, n_k, d, d_v, causal, mask_kind = case
    rng = np.random.default_rng(hash(case) % 2**32)
    q = rng.standard_normal((B, h, n_q, d))
    k = rng.standard_normal((B, h_kv, n_k, d))
    v = rng.standard_normal((B, h_kv, n_k, d_v))
    G = rng.standard_normal((B, h, n_q, d_v))
    mask = None
    if mask_kind == "bool":
        mask = rng.random((n_q, n_k)) > 0.3
        mask[0] = False  # a fully masked row: zero gradient, no NaN
    elif mask_kind == "float":
        mask = rng.standard_normal((h, n_q, n_k))
    kw = dict(mask=mask, causal=causal)
    grads = attnlab.scaled_dot_product_attention_backward(G, q, k, v, **kw)
    # a float mask is an additive bias with a gradient of its own
    assert set(grads) == {"q", "k", "v"} | ({"mask"} if mask_kind == "float" else set())

    def loss():
        return float((attnlab.scaled_dot_product_attention(q, k, v, **kw) * G).sum())

    checked = [("q", q), ("k", k), ("v", v)] + ([("mask", mask)] if mask_kind == "float" else [])
    for name, x in checked:
        assert grads[name].shape == x.shape
        assert np.all(np.isfinite(grads[name]))
        if x.size > 400:  # keep the finite-difference loop short: check a slice
            continue
        assert rel_err(grads[name], numeric_grad(loss, x)) < 1e-6, name
    if mask_kind == "bool":
        assert np.all(grads["q"][..., 0, :] == 0)


def test_sdpa_backward_long_slice():
    # sizes above one tile: compare on a few coordinates only
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 130, 4))
    k = rng.standard_normal((1, 1, 300, 4))
    v = rng.standard_normal((1, 1, 300, 3))
    G = rng.standard_normal((1, 2, 130, 3))
    g = attnlab.scaled_dot_product_attention_backward(G, q, k, v, causal="bottom_right")

    def loss():
        return float(
            (attnlab.scaled_dot_product_attention(q, k, v, causal="bottom_right") * G).sum()
        )

    for name, x, idx in (
        ("q", q, (0, 1, 129, 2)),
        ("k", k, (0, 0, 257, 1)),
        ("v", v, (0, 0, 3, 0)),
    ):
        eps = 1e-6
        old = x[idx]
        x[idx] = old + eps
        fp = loss()
        x[idx] = old - eps
        fm = loss()
        x[idx] = old
        num = (fp - fm) / (2 * eps)
        assert abs(num - g[name][idx]) <= 1e-6 * max(1.0, abs(num))


@pytest.mark.parametrize("n_q", [100, 128, 143, 144, 150, 197])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_forward_independent_of_the_query_tiles(n_q, dtype):
    """The flash forward's query tiles (96 rows; a last one under 48 rows joins the one before:
    100, 128 and 143 rows as one tile, 144 and 150 as 96 and the rest, 197 as 96 and 101) do not
    change a bit of the output or the log-sum-exp: each query's row is the same among 240
    queries (tiles of 96, 96 and 48). (With ``return_weights`` the dense path's Eigen products may
    round a tile's last rows otherwise.)"""
    rng = np.random.default_rng(n_q)
    q = rng.standard_normal((2, 2, 240, 64)).astype(dtype)
    k, v = rng.standard_normal((2, 1, 150, 64)).astype(dtype), rng.standard_normal((2, 1, 150, 40))
    v = v.astype(dtype)
    full = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True)
    part = attnlab.scaled_dot_product_attention(q[:, :, :n_q], k, v, return_lse=True)
    for got, want in zip(part, full, strict=True):
        np.testing.assert_array_equal(got, want[:, :, :n_q])


@pytest.mark.parametrize("n_q", [30, 70, 80, 197, 270])  # (few queries take the decode forward)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_backward_independent_of_the_query_tiles(n_q, causal, dtype):
    """The backward's query tiles (64 rows; a last one under 16 rows joins the one before: 30 or
    70 rows as one tile, 80 as two, 197 as 64, 64, 69, 270 as 64, 64, 64, 78) do not change a
    bit of the gradients: the same call with zero-gradient query rows appended (other tiles:
    256 or 512 rows, all full) gives the same dQ rows, dK and dV, since dK and dV sum one chain
    per 256 rows of a head, counted from its first (a tile across row 256 is cut there), to
    which the appended rows add exact zeros."""
    rng = np.random.default_rng(n_q)
    pad = (256 if n_q <= 256 else 512) - n_q
    q, extra = rng.standard_normal((2, 2, n_q, 16)), rng.standard_normal((2, 2, pad, 16))
    k, v = rng.standard_normal((2, 1, 150, 16)), rng.standard_normal((2, 1, 150, 8))
    G = rng.standard_normal((2, 2, n_q, 8))
    q, extra, k, v, G = (a.astype(dtype) for a in (q, extra, k, v, G))
    got = attnlab.scaled_dot_product_attention_backward(G, q, k, v, causal=causal)
    q2 = np.concatenate([q, extra], axis=2)
    G2 = np.concatenate([G, np.zeros((2, 2, pad, 8), dtype)], axis=2)
    padded = attnlab.scaled_dot_product_attention_backward(G2, q2, k, v, causal=causal)
    np.testing.assert_array_equal(got["q"], padded["q"][:, :, :n_q])
    np.testing.assert_array_equal(got["k"], padded["k"])
    np.testing.assert_array_equal(got["v"], padded["v"])
    if dtype == np.float32:  # and near the float64 gradients (finite differences above)
        wide = (a.astype(np.float64) for a in (G, q, k, v))
        ref = attnlab.scaled_dot_product_attention_backward(*wide, causal=causal)
        for name in ("q", "k", "v"):
            assert rel_err(got[name], ref[name]) < 1e-5, name


@pytest.mark.parametrize("n", [20, 45, 62, 110, 126, 170, 189])
def test_sdpa_every_panel_split_against_the_reference(n):
    """Query tiles and key tiles of these lengths give the products every split of their lanes
    into register panels (with AVX-512: 3 and 4 packets, 2 only for 2 and 5 packets; float32
    and float64 packets differ): forward and backward agree with the float64 reference, and
    float32 with float64."""
    from attnlab import reference

    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, 2, n, 16)) for _ in range(3))
    G = rng.standard_normal((1, 2, n, 16))
    for causal in (False, True):
        want = reference.scaled_dot_product_attention(q, k, v, causal=causal)
        g64 = attnlab.scaled_dot_product_attention_backward(G, q, k, v, causal=causal)
        assert rel_err(attnlab.scaled_dot_product_attention(q, k, v, causal=causal), want) < 1e-12
        f32 = (a.astype(np.float32) for a in (q, k, v))
        got = attnlab.scaled_dot_product_attention(*f32, causal=causal)
        assert rel_err(got, want) < 1e-5
        f32 = (a.astype(np.float32) for a in (G, q, k, v))
        g32 = attnlab.scaled_dot_product_attention_backward(*f32, causal=causal)
        for name in ("q", "k", "v"):
            assert rel_err(g32[name], g64[name]) < 1e-5, name


MHA_CASES = [
    # (self, h, h_kv, biases, causal, key padding, batch shape)
    (True, 2, 2, True, False, False, (2,)),
    (True, 4, 2, False, True, False, ()),
    (False, 4, 1, True, False, True, (2,)),
    (False, 2, 2, True, "bottom_right", False, (1, 2)),
]


@pytest.mark.parametrize("case", MHA_CASES)
def test_mha_backward_finite_differences(case):
    self_attn, h, h_kv, biases, causal, padding, batch = case
    rng = np.random.default_rng(len(str(case)))
    d_q, d_k, d_head, d_vhead, d_out, n_q, n_k = 6, 5, 2, 3, 4, 4, 6
    if self_attn:
        d_k, n_k = d_q, n_q
    x = rng.standard_normal(batch + (n_q, d_q))
    y = None if self_attn else rng.standard_normal(batch + (n_k, d_k))
    w = {
        "w_q": rng.standard_normal((d_q, h * d_head)) * 0.5,
        "w_k": rng.standard_normal((d_k, h_kv * d_head)) * 0.5,
        "w_v": rng.standard_normal((d_k, h_kv * d_vhead)) * 0.5,
        "w_o": rng.standard_normal((h * d_vhead, d_out)) * 0.5,
    }
    if biases:
        w.update(
            b_q=rng.standard_normal(h * d_head),
            b_k=rng.standard_normal(h_kv * d_head),
            b_v=rng.standard_normal(h_kv * d_vhead),
            b_o=rng.standard_normal(d_out),
        )
    kp = (rng.random(batch + (n_k,)) > 0.3) if padding else None
    kw = dict(num_heads=h, num_kv_heads=h_kv, causal=causal, key_padding_mask=kp, **w)
    G = rng.standard_normal(batch + (n_q, d_out))
    args = (x,) if self_attn else (x, y)
    grads = attnlab.multi_head_attention_backward(G, *args, **kw)
    expected = {"query"} | (set() if self_attn else {"key"}) | set(w)
    assert set(grads) == expected

    def loss():
        return float((attnlab.multi_head_attention(*args, **kw) * G).sum())

    arrays = {"query": x, **({} if self_attn else {"key": y}), **w}
    for name, arr in arrays.items():
        assert grads[name].shape == arr.shape, name
        assert rel_err(grads[name], numeric_grad(loss, arr)) < 1e-6, name


def test_mha_backward_value_defaults_to_key_and_broadcast_batch():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 6))
    y = rng.standard_normal((5, 6))  # key shared by every batch element: gradient summed
    w = {n: rng.standard_normal((6, 6)) * 0.4 for n in ("w_q", "w_k", "w_v", "w_o")}
    G = rng.standard_normal((3, 4, 6))
    grads = attnlab.multi_head_attention_backward(G, x, y, num_heads=3, **w)
    assert set(grads) == {"query", "key", "w_q", "w_k", "w_v", "w_o"}
    assert grads["key"].shape == y.shape

    def loss():
        return float((attnlab.multi_head_attention(x, y, num_heads=3, **w) * G).sum())

    assert rel_err(grads["key"], numeric_grad(loss, y)) < 1e-6


def test_backward_bitwise_identical_across_thread_counts():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 150, 32)).astype(np.float32)
    w = {
        n: (rng.standard_normal((32, 32)) * 0.2).astype(np.float32)
        for n in ("w_q", "w_k", "w_v", "w_o")
    }
    G = rng.standard_normal((4, 150, 32)).astype(np.float32)
    before = attnlab.get_num_threads()
    try:
        attnlab.set_num_threads(1)
        g1 = attnlab.multi_head_attention_backward(G, x, num_heads=4, causal=True, **w)
        attnlab.set_num_threads(2)
        g2 = attnlab.multi_head_attention_backward(G, x, num_heads=4, causal=True, **w)
    finally:
        attnlab.set_num_threads(before)
    for name in g1:
        assert np.array_equal(g1[name], g2[name]), name


def test_grad_out_shape_error():
    x = np.ones((4, 6))
    w = {n: np.eye(6) for n in ("w_q", "w_k", "w_v", "w_o")}
    with pytest.raises(ValueError, match="grad_out"):
        attnlab.multi_head_attention_backward(np.ones((4, 5)), x, num_heads=2, **w)
    with pytest.raises(ValueError, match="grad_out"):
        attnlab.scaled_dot_product_attention_backward(
            np.ones((2, 4, 5)), np.ones((2, 4, 6)), np.ones((2, 4, 6)), np.ones((2, 4, 6))
        )


torch = None


@pytest.fixture(scope="module")
def th():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_backward_matches_torch_autograd(th, causal, gqa):
    rng = np.random.default_rng(11)
    h, h_kv = (4, 2) if gqa else (4, 4)
    q = rng.standard_normal((2, h, 33, 8)).astype(np.float32)
    k = rng.standard_normal((2, h_kv, 33, 8)).astype(np.float32)
    v = rng.standard_normal((2, h_kv, 33, 5)).astype(np.float32)
    G = rng.standard_normal((2, h, 33, 5)).astype(np.float32)
    g = attnlab.scaled_dot_product_attention_backward(G, q, k, v, causal=causal)
    tq, tk, tv = (th.tensor(a, requires_grad=True) for a in (q, k, v))
    ek = tk.repeat_interleave(h // h_kv, dim=1)
    ev = tv.repeat_interleave(h // h_kv, dim=1)
    out = th.nn.functional.scaled_dot_product_attention(tq, ek, ev, is_causal=causal)
    out.backward(th.tensor(G))
    for name, t in (("q", tq), ("k", tk), ("v", tv)):
        ref = t.grad.numpy()
        assert np.abs(g[name] - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max()), name


def test_mha_backward_matches_torch_autograd(th):
    rng = np.random.default_rng(12)
    d, h, n, B = 16, 4, 10, 3
    x = rng.standard_normal((B, n, d)).astype(np.float32)
    m = th.nn.MultiheadAttention(d, h, batch_first=True)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    W, b = sd["in_proj_weight"], sd["in_proj_bias"]
    w = dict(
        w_q=W[:d].T.copy(),
        w_k=W[d : 2 * d].T.copy(),
        w_v=W[2 * d :].T.copy(),
        w_o=sd["out_proj.weight"].T.copy(),
        b_q=b[:d],
        b_k=b[d : 2 * d],
        b_v=b[2 * d :],
        b_o=sd["out_proj.bias"],
    )
    G = rng.standard_normal((B, n, d)).astype(np.float32)
    kp = rng.random((B, n)) > 0.2
    kp[:, 0] = True
    g = attnlab.multi_head_attention_backward(G, x, num_heads=h, key_padding_mask=kp, **w)
    tx = th.tensor(x, requires_grad=True)
    out, _ = m(tx, tx, tx, need_weights=False, key_padding_mask=th.tensor(~kp))
    out.backward(th.tensor(G))
    assert np.abs(g["query"] - tx.grad.numpy()).max() < 1e-4
    tw = m.in_proj_weight.grad.numpy()
    assert np.abs(g["w_q"] - tw[:d].T).max() < 1e-4
    assert np.abs(g["w_v"] - tw[2 * d :].T).max() < 1e-4
    assert np.abs(g["w_o"] - m.out_proj.weight.grad.numpy().T).max() < 1e-4
    assert np.abs(g["b_o"] - m.out_proj.bias.grad.numpy()).max() < 1e-4


@pytest.mark.parametrize("fn", ["multi_head_attention", "bilinear_attention"])
def test_gradient_keys_follow_the_arguments_given_not_object_identity(fn):
    """The same array passed as query and key (and value) still gets "key" (and "value")
    entries; omitted ones are summed into "query". It used to depend on `is`."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, 8))
    w = {n: rng.standard_normal((8, 8)) / 3 for n in ("w_v", "w_o")}
    if fn == "multi_head_attention":
        w.update(w_q=rng.standard_normal((8, 8)) / 3, w_k=rng.standard_normal((8, 8)) / 3)
    else:
        w["w_qk"] = rng.standard_normal((2, 8, 8)) / 3
    f = getattr(attnlab, fn + "_backward")
    go = rng.standard_normal((2, 5, 8))
    same = f(go, x, x, x, num_heads=2, **w)
    as_list = f(go, x, x.tolist(), x.tolist(), num_heads=2, **w)
    omitted = f(go, x, num_heads=2, **w)
    key_only = f(go, x, x, num_heads=2, **w)
    assert {"query", "key", "value"} <= set(same)
    assert set(same) == set(as_list)
    assert "key" not in omitted and "value" not in omitted
    assert "key" in key_only and "value" not in key_only
    for k in same:
        np.testing.assert_array_equal(same[k], as_list[k])
    total = same["query"] + same["key"] + same["value"]
    np.testing.assert_allclose(omitted["query"], total, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(key_only["key"], same["key"] + same["value"], rtol=1e-12, atol=1e-12)
