"""Gradients of bilinear_attention.

Central finite differences in float64 (relative error < 1e-6), consistency with
multi_head_attention_backward for folded weights (chain rule, float64 to 1e-10), torch autograd
of an einsum transcription (float32, 1e-4), thread-count determinism and argument errors.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import attnlab
from attnlab._bilinear import bilinear_attention_backward
from conftest import numeric_grad, rel_err


def uniform(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape)


def make_args(
    rng,
    *,
    batch,
    h,
    h_kv,
    n_q,
    n_k,
    d_q,
    d_k,
    d_v,
    d_vhead,
    d_out,
    cross,
    bias,
    u_k,
    dtype=np.float64,
):
    """Inputs and keyword arguments of bilinear_attention (key/value only when cross)."""
    query = rng.standard_normal(batch + (n_q, d_q))
    inputs = {"query": query}
    if cross:
        inputs["key"] = rng.standard_normal(batch + (n_k, d_k))
        inputs["value"] = rng.standard_normal(batch + (n_k, d_v))
    else:
        assert n_q == n_k and d_q == d_k == d_v
    kw = {
        # W_i = W_q,i W_k,i^T has entries of size ~ 1/sqrt(d): keep logits O(1)
        "w_qk": rng.standard_normal((h, d_q, d_k)) / np.sqrt(d_q * d_k) * 2.0,
        "w_v": uniform(rng, (d_v, h_kv * d_vhead), d_v),
        "w_o": uniform(rng, (h * d_vhead, d_out), h * d_vhead),
        "num_heads": h,
    }
    if h_kv != h:
        kw["num_kv_heads"] = h_kv
    if u_k:
        kw["u_k"] = rng.standard_normal((h, d_k)) * 0.5
    if bias:
        kw["b_v"] = uniform(rng, (h_kv * d_vhead,), d_v)
        kw["b_o"] = uniform(rng, (d_out,), h * d_vhead)
    inputs = {k: v.astype(dtype) for k, v in inputs.items()}
    kw = {k: (v.astype(dtype) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    return inputs, kw


ARRAY_ARGS = ("w_qk", "u_k", "w_v", "b_v", "w_o", "b_o")

# (name, batch, h, h_kv, n_q, n_k, d_q, d_k, d_v, d_vhead, d_out, cross, bias, u_k, extra)
FD_CASES = [
    ("minimal", (), 1, 1, 1, 1, 1, 1, 1, 1, 1, False, False, False, {}),
    ("self_nobias", (), 2, 2, 4, 4, 4, 4, 4, 2, 3, False, False, False, {}),
    ("self_bias_u", (2,), 2, 2, 4, 4, 4, 4, 4, 3, 4, False, True, True, {}),
    ("gqa_cross", (2,), 4, 2, 3, 5, 4, 3, 2, 2, 3, True, True, True, {}),
    (
        "mqa_cross_causal",
        (),
        4,
        1,
        4,
        6,
        3,
        4,
        3,
        2,
        2,
        True,
        False,
        True,
        {"causal": "bottom_right"},
    ),
    ("self_causal", (1, 2), 2, 1, 5, 5, 4, 4, 4, 2, 3, False, True, False, {"causal": True}),
    ("cross_padding", (2,), 2, 2, 3, 5, 3, 4, 3, 2, 2, True, True, True, {"padding": True}),
    ("cross_masked_row", (2,), 2, 1, 4, 5, 3, 3, 2, 2, 3, True, True, True, {"masked_row": True}),
    ("float_mask", (), 2, 2, 3, 4, 3, 2, 3, 2, 2, True, False, True, {"float_mask": True}),
    ("key_order_forward", (), 2, 2, 8, 2, 3, 3, 3, 2, 2, True, True, True, {"order": "key"}),
    ("bilinearqk", (2,), 2, 1, 4, 4, 4, 4, 4, 2, 3, False, True, False, {"qk": True}),
]


@pytest.mark.empty_rows
@pytest.mark.parametrize("case", FD_CASES, ids=[c[0] for c in FD_CASES])
def test_finite_differences(case):
    (name, batch, h, h_kv, n_q, n_k, d_q, d_k, d_v, d_vhead, d_out, cross, bias, u_k, extra) = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    inputs, kw = make_args(
        rng,
        batch=batch,
        h=h,
        h_kv=h_kv,
        n_q=n_q,
        n_k=n_k,
        d_q=d_q,
        d_k=d_k,
        d_v=d_v,
        d_vhead=d_vhead,
        d_out=d_out,
        cross=cross,
        bias=bias,
        u_k=u_k,
    )
    if extra.get("qk"):
        # a folded BilinearQK (with u from b_q): differentiate its w and u arrays in place
        dh = 2
        wq, wk = rng.standard_normal((d_q, h * dh)) / 2, rng.standard_normal((d_k, h_kv * dh)) / 2
        qk = attnlab.collapse_qk(
            wq, wk, rng.standard_normal(h * dh), None, num_heads=h, num_kv_heads=h_kv
        )
        kw["w_qk"] = qk
    if "causal" in extra:
        kw["causal"] = extra["causal"]
    if extra.get("padding"):
        kp = np.ones(batch + (n_k,), bool)
        kp[0, -2:] = False
        kw["key_padding_mask"] = kp
    if extra.get("masked_row"):
        m = rng.random((n_q, n_k)) > 0.3
        m[1] = False  # query row 1 sees nothing: zero gradient, no NaN
        m[0, 0] = True
        kw["mask"] = m
    if extra.get("float_mask"):
        kw["mask"] = rng.standard_normal((h, n_q, n_k))
    order = extra.get("order")
    G = rng.standard_normal(batch + (n_q, d_out))

    grads = bilinear_attention_backward(G, **inputs, **kw)

    def loss():
        out = attnlab.bilinear_attention(**inputs, **kw, _order=order)
        return float((out * G).sum())

    params = dict(inputs)
    if isinstance(kw["w_qk"], attnlab.BilinearQK):
        params["w_qk"] = kw["w_qk"].w
        params["u_k"] = kw["w_qk"].u
    for n in ARRAY_ARGS:
        if n in kw and isinstance(kw[n], np.ndarray):
            params[n] = kw[n]
    if extra.get("float_mask"):  # an additive bias has a gradient
        params["mask"] = kw["mask"]
    assert set(grads) == set(params)
    for n, x in params.items():
        assert grads[n].shape == x.shape, n
        assert grads[n].dtype == np.float64, n
        assert np.all(np.isfinite(grads[n])), n
        err = rel_err(grads[n], numeric_grad(loss, x))
        assert err < 1e-6, (n, err)
    if extra.get("masked_row"):
        assert np.all(grads["query"][..., 1, :] == 0)


@pytest.mark.empty_rows
def test_fully_masked_batch_element_gives_zero_input_gradients(rng):
    inputs, kw = make_args(
        rng,
        batch=(2,),
        h=2,
        h_kv=2,
        n_q=3,
        n_k=4,
        d_q=3,
        d_k=3,
        d_v=3,
        d_vhead=2,
        d_out=2,
        cross=True,
        bias=True,
        u_k=True,
    )
    kp = np.ones((2, 4), bool)
    kp[1] = False
    G = rng.standard_normal((2, 3, 2))
    g = bilinear_attention_backward(G, **inputs, **kw, key_padding_mask=kp)
    for n in ("query", "key", "value"):
        assert np.all(g[n][1] == 0), n
        assert np.any(g[n][0] != 0), n
    np.testing.assert_allclose(g["b_o"], G.sum(axis=(0, 1)), rtol=1e-13)


def test_broadcast_batch_and_defaults(rng):
    # key without a batch axis, value defaulting to key: gradients summed over the broadcast
    query = rng.standard_normal((2, 3, 4))
    key = rng.standard_normal((5, 3))
    kw = {
        "w_qk": rng.standard_normal((2, 4, 3)) / 3,
        "w_v": uniform(rng, (3, 4), 3),
        "w_o": uniform(rng, (4, 2), 4),
        "num_heads": 2,
    }
    G = rng.standard_normal((2, 3, 2))
    g = bilinear_attention_backward(G, query, key, **kw)
    assert set(g) == {"query", "key", "w_qk", "w_v", "w_o"}
    assert g["key"].shape == key.shape

    def loss():
        return float((attnlab.bilinear_attention(query, key, **kw) * G).sum())

    assert rel_err(g["key"], numeric_grad(loss, key)) < 1e-6
    assert rel_err(g["query"], numeric_grad(loss, query)) < 1e-6


def test_empty_keys(rng):
    inputs, kw = make_args(
        rng,
        batch=(),
        h=2,
        h_kv=2,
        n_q=3,
        n_k=0,
        d_q=3,
        d_k=3,
        d_v=3,
        d_vhead=2,
        d_out=2,
        cross=True,
        bias=True,
        u_k=True,
    )
    G = rng.standard_normal((3, 2))
    g = bilinear_attention_backward(G, **inputs, **kw)
    for n, arr in g.items():
        assert np.all(np.isfinite(arr)), n
    assert np.all(g["query"] == 0) and np.all(g["w_qk"] == 0)
    np.testing.assert_allclose(g["b_o"], G.sum(axis=0), rtol=1e-13)


# (batch, h, h_kv, n_q, n_k, d_model, d_head, cross, causal, bias)
MHA_CASES = [
    ((), 2, 2, 5, 5, 8, 4, False, False, True),
    ((2,), 4, 2, 4, 7, 8, 3, True, False, True),
    ((2,), 2, 1, 6, 6, 6, 5, False, True, "qv"),
    ((), 3, 3, 70, 140, 6, 2, True, "bottom_right", True),  # several tiles each way
]


@pytest.mark.parametrize("case", MHA_CASES)
def test_consistent_with_mha_backward(case):
    batch, h, h_kv, n_q, n_k, d, dh, cross, causal, bias = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    which = "qkvo" if bias is True else bias
    w = {
        "w_q": uniform(rng, (d, h * dh), d),
        "w_k": uniform(rng, (d, h_kv * dh), d),
        "w_v": uniform(rng, (d, h_kv * dh), d),
        "w_o": uniform(rng, (h * dh, d), h * dh),
    }
    for c in which:
        w["b_" + c] = uniform(rng, (w["w_" + c].shape[1],), d) * 3
    query = rng.standard_normal(batch + (n_q, d))
    inputs = {"query": query}
    if cross:
        inputs["key"] = rng.standard_normal(batch + (n_k, d))
        inputs["value"] = rng.standard_normal(batch + (n_k, d))
    common = {"num_heads": h, "num_kv_heads": h_kv, "causal": causal}
    G = rng.standard_normal(batch + (n_q, d))
    gm = attnlab.multi_head_attention_backward(G, **inputs, **w, **common)
    qk = attnlab.collapse_qk(
        w["w_q"], w["w_k"], w.get("b_q"), w.get("b_k"), num_heads=h, num_kv_heads=h_kv
    )
    rest = {n: w[n] for n in ("w_v", "w_o", "b_v", "b_o") if n in w}
    gb = bilinear_attention_backward(G, **inputs, w_qk=qk, **rest, **common)

    for n in list(inputs) + list(rest):
        assert rel_err(gb[n], gm[n]) < 1e-10, n
    # chain rule through W_i = W_q,i W_k,i^T and u_i = W_k,i b_q,i (the dropped v_i, c_i
    # terms cancel in the softmax: their gradient is zero)
    g = h // h_kv
    wq = w["w_q"].reshape(d, h, dh).transpose(1, 0, 2)  # (h, d, dh)
    wk = np.repeat(w["w_k"].reshape(d, h_kv, dh).transpose(1, 0, 2), g, axis=0)
    dW = gb["w_qk"]
    dwq = dW @ wk  # (h, d, dh)
    dwk = np.swapaxes(dW, -1, -2) @ wq  # per query head
    if "b_q" in w:
        bq = w["b_q"].reshape(h, dh)
        du = gb["u_k"]  # (h, d)
        dwk = dwk + du[:, :, None] * bq[:, None, :]
        dbq = np.einsum("hde,hd->he", wk, du).reshape(-1)
        assert rel_err(dbq, gm["b_q"]) < 1e-10
    else:
        assert "u_k" not in gb
    dwk = dwk.reshape(h_kv, g, d, dh).sum(axis=1)  # sum over the group
    assert rel_err(dwq.transpose(1, 0, 2).reshape(d, h * dh), gm["w_q"]) < 1e-10
    assert rel_err(dwk.transpose(1, 0, 2).reshape(d, h_kv * dh), gm["w_k"]) < 1e-10


def _torch_bilinear(torch, xq, xk, xv, wqk, uk, wv, bv, wo, bo, h, h_kv, scale, mask):
    """bilinear_attention transcribed with einsum (boolean mask: True may attend)."""
    qp = torch.einsum("bnd,hde->bhne", xq, wqk)
    if uk is not None:
        qp = qp + uk[None, :, None, :]
    s = torch.einsum("bhne,bme->bhnm", qp, xk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    v = xv @ wv
    if bv is not None:
        v = v + bv
    B, n_k = xv.shape[:2]
    v = v.reshape(B, n_k, h_kv, -1).transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    ctx = (p @ v).transpose(1, 2).reshape(B, xq.shape[1], -1)
    out = ctx @ wo
    return out if bo is None else out + bo


@pytest.mark.parametrize(
    "h_kv,u_k,bias,causal",
    [(4, True, True, False), (2, False, True, True), (1, True, False, False)],
)
def test_torch_autograd_float32(h_kv, u_k, bias, causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11 + h_kv)
    h, B, n_q, n_k = 4, 2, 9, 70
    inputs, kw = make_args(
        rng,
        batch=(B,),
        h=h,
        h_kv=h_kv,
        n_q=n_q,
        n_k=n_k,
        d_q=8,
        d_k=6,
        d_v=5,
        d_vhead=3,
        d_out=7,
        cross=True,
        bias=bias,
        u_k=u_k,
        dtype=np.float32,
    )
    kp = np.ones((B, n_k), bool)
    kp[1, 50:] = False
    mask = np.broadcast_to(kp[:, None, None, :], (B, h, n_q, n_k))
    if causal:
        mask = mask & np.tril(np.ones((n_q, n_k), bool), k=n_k - n_q)
    G = rng.standard_normal((B, n_q, 7)).astype(np.float32)
    scale = 0.4
    g = bilinear_attention_backward(
        G,
        **inputs,
        **kw,
        key_padding_mask=kp,
        scale=scale,
        causal="bottom_right" if causal else False,
    )
    t = {
        n: torch.tensor(v, requires_grad=True)
        for n, v in {**inputs, **{k: v for k, v in kw.items() if isinstance(v, np.ndarray)}}.items()
    }
    out = _torch_bilinear(
        torch,
        t["query"],
        t["key"],
        t["value"],
        t["w_qk"],
        t.get("u_k"),
        t["w_v"],
        t.get("b_v"),
        t["w_o"],
        t.get("b_o"),
        h,
        h_kv,
        scale,
        torch.tensor(np.ascontiguousarray(mask)),
    )
    out.backward(torch.tensor(G))
    assert set(g) == set(t)
    for n, tv in t.items():
        assert g[n].dtype == np.float32, n
        assert rel_err(g[n].astype(np.float64), tv.grad.double().numpy()) < 1e-4, n


def test_thread_count_bitwise_identical():
    rng = np.random.default_rng(5)
    inputs, kw = make_args(
        rng,
        batch=(2,),
        h=4,
        h_kv=2,
        n_q=150,
        n_k=300,
        d_q=16,
        d_k=12,
        d_v=10,
        d_vhead=8,
        d_out=16,
        cross=True,
        bias=True,
        u_k=True,
    )
    G = rng.standard_normal((2, 150, 16))
    kw["causal"] = "bottom_right"
    before = attnlab.get_num_threads()
    try:
        attnlab.set_num_threads(1)
        g1 = bilinear_attention_backward(G, **inputs, **kw)
        attnlab.set_num_threads(2)
        g2 = bilinear_attention_backward(G, **inputs, **kw)
    finally:
        attnlab.set_num_threads(before)
    assert set(g1) == set(g2)
    for n in g1:
        assert np.array_equal(g1[n], g2[n]), n


def test_grad_out_wrong_shape(rng):
    inputs, kw = make_args(
        rng,
        batch=(2,),
        h=2,
        h_kv=2,
        n_q=3,
        n_k=3,
        d_q=4,
        d_k=4,
        d_v=4,
        d_vhead=2,
        d_out=5,
        cross=False,
        bias=False,
        u_k=False,
    )
    with pytest.raises(ValueError, match="grad_out"):
        bilinear_attention_backward(np.ones((2, 3, 4)), **inputs, **kw)
    with pytest.raises(ValueError, match="grad_out"):
        bilinear_attention_backward(np.ones((3, 5)), **inputs, **kw)
    with pytest.raises(TypeError, match="grad_out"):
        bilinear_attention_backward(np.ones((2, 3, 5), complex), **inputs, **kw)


def test_u_k_with_bilinearqk_rejected(rng):
    qk = attnlab.collapse_qk(
        rng.standard_normal((4, 4)),
        rng.standard_normal((4, 4)),
        rng.standard_normal(4),
        num_heads=2,
    )
    with pytest.raises(ValueError, match="u_k"):
        bilinear_attention_backward(
            np.ones((3, 4)),
            np.ones((3, 4)),
            w_qk=qk,
            u_k=np.ones((2, 4)),
            w_v=np.ones((4, 4)),
            w_o=np.ones((4, 4)),
            num_heads=2,
        )
