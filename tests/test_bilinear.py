"""Bilinear-collapsed attention: exactness against multi-head attention, the folded terms,
factorisation, options and error paths."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

import attnlab
from attnlab import _bilinear, reference
from attnlab._args import CoreMask
from attnlab._loader import core


def _split(w: dict) -> tuple[dict, dict]:
    """MHA weights -> (q/k part for collapse_qk, v/o part shared by both forms)."""
    qk = {k: w[k] for k in ("w_q", "w_k", "b_q", "b_k") if k in w}
    vo = {k: w[k] for k in ("w_v", "w_o", "b_v", "b_o") if k in w}
    return qk, vo


MASKS = ["none", "bool", "float", "padding", "causal", "bottom_right", "all"]


def _mask_kwargs(
    kind: str, rng: np.random.Generator, batch: tuple, h: int, n_q: int, n_k: int
) -> dict:
    if kind == "none":
        return {}
    if kind == "bool":
        m = rng.random(batch + (h, n_q, n_k)) > 0.3
        m[..., 0, :] = False  # a fully masked row
        return {"mask": m}
    if kind == "float":
        return {"mask": rng.standard_normal((n_q, n_k))}
    if kind == "padding":
        kp = np.ones(batch + (n_k,), dtype=bool)
        kp[..., -2:] = False
        return {"key_padding_mask": kp}
    if kind == "causal":
        return {"causal": True}
    if kind == "bottom_right":
        return {"causal": "bottom_right"}
    kp = np.ones(batch + (n_k,), dtype=bool)
    kp[..., 0] = False
    return {"mask": rng.random((h, n_q, n_k)) > 0.2, "key_padding_mask": kp, "causal": True}


GRID = [
    # batch, n_q, n_k (None = self), d, h, h_kv, d_head, bias
    ((), 7, None, 16, 1, 1, 16, True),
    ((2,), 33, None, 24, 4, 4, 6, True),
    ((2,), 33, None, 24, 4, 4, 6, False),
    ((2,), 70, None, 24, 4, 2, 6, "q"),
    ((3,), 5, 90, 12, 4, 1, 8, "k"),
    ((2, 2), 130, 9, 16, 2, 2, 20, True),
    ((1,), 1, 150, 32, 8, 2, 4, True),
]


@pytest.mark.empty_rows
@pytest.mark.parametrize("case", GRID, ids=[f"g{i}" for i in range(len(GRID))])
@pytest.mark.parametrize("order", [None, "query", "key"])
@pytest.mark.parametrize("kind", MASKS)
def test_exact_vs_mha(rng, mha_weights, close, case, order, kind):
    batch, n_q, n_k, d, h, h_kv, dh, bias = case
    w = mha_weights(rng, d, h, dh, num_kv_heads=h_kv, d_vhead=5, d_out=7, bias=bias)
    qk, vo = _split(w)
    x = rng.standard_normal(batch + (n_q, d))
    y = None if n_k is None else rng.standard_normal(batch + (n_k, d))
    nk = n_q if n_k is None else n_k
    mk = _mask_kwargs(kind, rng, batch, h, n_q, nk)
    folded = attnlab.collapse_qk(**qk, num_heads=h, num_kv_heads=h_kv)
    got, gw = attnlab.bilinear_attention(
        x,
        y,
        w_qk=folded,
        **vo,
        num_heads=h,
        num_kv_heads=h_kv,
        return_weights=True,
        _order=order,
        **mk,
    )
    ref, rw = attnlab.multi_head_attention(
        x, y, **w, num_heads=h, num_kv_heads=h_kv, return_weights=True, **mk
    )
    close(got, ref, np.float64, "bilinear vs mha")
    close(gw, rw, np.float64, "bilinear weights vs mha")
    oracle = reference.multi_head_attention(x, y, **w, num_heads=h, num_kv_heads=h_kv, **mk)
    close(got, oracle, np.float64, "bilinear vs reference")
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("order", ["query", "key"])
@pytest.mark.parametrize("bias", [True, False])
def test_float32(rng, mha_weights, close, order, bias):
    w = mha_weights(rng, 32, 4, 8, num_kv_heads=2, bias=bias, dtype=np.float32)
    qk, vo = _split(w)
    x = rng.standard_normal((2, 40, 32)).astype(np.float32)
    folded = attnlab.collapse_qk(**qk, num_heads=4, num_kv_heads=2)
    assert folded.w.dtype == np.float32
    got = attnlab.bilinear_attention(
        x, w_qk=folded, **vo, num_heads=4, num_kv_heads=2, causal=True, _order=order
    )
    ref = reference.multi_head_attention(x, **w, num_heads=4, num_kv_heads=2, causal=True)
    close(got, ref, np.float32, "bilinear fp32")


def test_reference_matches_mha_reference(rng, mha_weights, close):
    w = mha_weights(rng, 20, 4, 5, num_kv_heads=2)
    qk, vo = _split(w)
    x = rng.standard_normal((3, 11, 20))
    folded = reference.collapse_qk(**qk, num_heads=4, num_kv_heads=2)
    got = reference.bilinear_attention(
        x, w_qk=folded, **vo, num_heads=4, num_kv_heads=2, causal=True, return_weights="mean"
    )
    ref = reference.multi_head_attention(
        x, **w, num_heads=4, num_kv_heads=2, causal=True, return_weights="mean"
    )
    close(got[0], ref[0], np.float64, "reference bilinear")
    close(got[1], ref[1], np.float64, "reference bilinear")
    fast = attnlab.collapse_qk(**qk, num_heads=4, num_kv_heads=2)
    for name in ("w", "u", "v", "c"):
        close(getattr(fast, name), getattr(folded, name), np.float64, "collapse_qk")
    assert fast.d_head == folded.d_head == 5


@pytest.mark.parametrize("bias", [True, False, "q", "k"])
def test_homogeneous_and_scores_are_exact_logits(rng, mha_weights, close, bias):
    w = mha_weights(rng, 12, 3, 4, d_k=10, num_kv_heads=3, bias=bias)
    qk, _ = _split(w)
    folded = attnlab.collapse_qk(**qk, num_heads=3)
    assert (folded.u is None) == ("b_q" not in qk)
    assert (folded.v is None) == ("b_k" not in qk)
    assert (folded.c is None) == ("b_q" not in qk or "b_k" not in qk)
    xq = rng.standard_normal((2, 6, 12))
    xk = rng.standard_normal((2, 9, 10))
    exact = reference.separate_logits(xq, xk, **qk, num_heads=3)  # scaled by 1/sqrt(4)
    m = folded.homogeneous()
    assert m.shape == (3, 13, 11)
    one = np.ones((2, 1, 1))
    hq = np.concatenate([xq, np.broadcast_to(one, (2, 6, 1))], axis=-1)[:, None]
    hk = np.concatenate([xk, np.broadcast_to(one, (2, 9, 1))], axis=-1)[:, None]
    close((hq @ m @ np.swapaxes(hk, -1, -2)) / 2.0, exact, np.float64, "homogeneous")
    close(folded.scores(xq, xk), exact, np.float64, "scores")
    close(folded.scores(xq, xk, scale=1.0), exact * 2.0, np.float64, "scores")
    # the dropped v, c terms: softmax of the bilinear logits equals softmax of the exact ones
    bl = reference.bilinear_logits(xq, xk, w_qk=folded)
    close(
        np.exp(bl - bl.max(-1, keepdims=True))
        / np.exp(bl - bl.max(-1, keepdims=True)).sum(-1, keepdims=True),
        np.exp(exact - exact.max(-1, keepdims=True))
        / np.exp(exact - exact.max(-1, keepdims=True)).sum(-1, keepdims=True),
        np.float64,
        "softmax",
    )
    for order in ("query", "key"):
        close(
            reference.bilinear_logits(xq, xk, w_qk=folded, order=order),
            bl,
            np.float64,
            "bilinear_logits",
        )


def test_rank_is_d_head(rng, mha_weights):
    w = mha_weights(rng, 32, 4, 6, num_kv_heads=2)
    folded = attnlab.collapse_qk(w["w_q"], w["w_k"], num_heads=4, num_kv_heads=2)
    assert folded.rank().tolist() == [6] * 4
    assert folded.w.shape == (4, 32, 32)
    wide = mha_weights(rng, 8, 2, 16)  # d_head > d: W_i is full rank d
    assert attnlab.collapse_qk(wide["w_q"], wide["w_k"], num_heads=2).rank().tolist() == [8, 8]
    assert folded.rank(tol=1e9).tolist() == [0] * 4


def test_b_k_has_no_effect(rng, mha_weights, close):
    w = mha_weights(rng, 16, 4, 4)
    qk, vo = _split(w)
    x = rng.standard_normal((2, 13, 16))
    with_bk = attnlab.collapse_qk(**qk, num_heads=4)
    no_bk = attnlab.collapse_qk(qk["w_q"], qk["w_k"], qk["b_q"], num_heads=4)
    np.testing.assert_array_equal(with_bk.u, no_bk.u)
    a = attnlab.bilinear_attention(x, w_qk=with_bk, **vo, num_heads=4, return_weights=True)
    b = attnlab.bilinear_attention(x, w_qk=no_bk, **vo, num_heads=4, return_weights=True)
    np.testing.assert_array_equal(a[0], b[0])
    w2 = dict(w, b_k=rng.standard_normal(w["b_k"].shape) * 10)
    c = attnlab.multi_head_attention(x, **w2, num_heads=4, return_weights=True)
    close(c[0], a[0], np.float64, "b_k no effect")
    close(c[1], a[1], np.float64, "b_k no effect")
    # b_q does change it (through u)
    w3 = dict(w, b_q=w["b_q"] + 1.0)
    d = attnlab.multi_head_attention(x, **w3, num_heads=4)
    assert np.abs(d - a[0]).max() > 1e-6


def test_raw_w_qk_and_default_scale(rng, mha_weights, close):
    w = mha_weights(rng, 24, 2, 6)  # d_head 6, d_q / h = 12
    qk, vo = _split(w)
    folded = attnlab.collapse_qk(**qk, num_heads=2)
    x = rng.standard_normal((4, 24))
    ref = attnlab.multi_head_attention(x, **w, num_heads=2)
    got = attnlab.bilinear_attention(x, w_qk=folded, **vo, num_heads=2)
    close(got, ref, np.float64, "default scale")
    raw = attnlab.bilinear_attention(x, w_qk=folded.w, u_k=folded.u, **vo, num_heads=2)
    close(
        raw,
        reference.bilinear_attention(
            x, w_qk=folded.w, u_k=folded.u, **vo, num_heads=2, scale=1 / math.sqrt(12)
        ),
        np.float64,
        "raw scale",
    )
    explicit = attnlab.bilinear_attention(
        x, w_qk=folded.w, u_k=folded.u, **vo, num_heads=2, scale=1 / math.sqrt(6)
    )
    close(explicit, ref, np.float64, "explicit scale")


@pytest.mark.parametrize("rank", [1, 3, 6, 10])
def test_factorize(rng, mha_weights, close, rank):
    w = mha_weights(rng, 10, 3, 6)
    folded = attnlab.collapse_qk(w["w_q"], w["w_k"], num_heads=3)
    fq, fk, err = attnlab.factorize_qk(folded, rank)
    assert fq.shape == (10, 3 * rank) and fk.shape == (10, 3 * rank) and err.shape == (3,)
    _, _, rerr = reference.factorize_qk(folded, rank)
    approx = attnlab.collapse_qk(fq, fk, num_heads=3).w
    measured = np.linalg.norm(folded.w - approx, axis=(1, 2)) / np.linalg.norm(
        folded.w, axis=(1, 2)
    )
    sig = np.linalg.svd(folded.w, compute_uv=False)
    eckart_young = np.sqrt((sig[:, rank:] ** 2).sum(1)) / np.sqrt((sig**2).sum(1))
    np.testing.assert_allclose(err, eckart_young, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(err, measured, rtol=1e-6, atol=1e-13)
    np.testing.assert_allclose(err, rerr, rtol=1e-6, atol=1e-13)
    if rank >= 6:  # full rank (d_head): reproduces W, and an MHA with those weights
        assert err.max() < 1e-13
        close(approx, folded.w, np.float64, "factorize full rank")
        x = rng.standard_normal((2, 9, 10))
        ref = attnlab.bilinear_attention(x, w_qk=folded, w_v=w["w_v"], w_o=w["w_o"], num_heads=3)
        back = attnlab.multi_head_attention(
            x, w_q=fq, w_k=fk, w_v=w["w_v"], w_o=w["w_o"], num_heads=3, scale=1 / math.sqrt(6)
        )
        close(back, ref, np.float64, "factorize -> mha")
    zero_q, _, zero_err = attnlab.factorize_qk(np.zeros((2, 4, 3)), 2)
    assert zero_err.tolist() == [0.0, 0.0] and not zero_q.any()


@pytest.mark.empty_rows
def test_fully_masked_rows_and_empty(rng, mha_weights):
    w = mha_weights(rng, 8, 2, 4)
    qk, vo = _split(w)
    folded = attnlab.collapse_qk(**qk, num_heads=2)
    x = rng.standard_normal((2, 5, 8))
    kp = np.zeros((2, 5), dtype=bool)
    for order in ("query", "key"):
        out, wts = attnlab.bilinear_attention(
            x,
            w_qk=folded,
            **vo,
            num_heads=2,
            key_padding_mask=kp,
            return_weights=True,
            _order=order,
        )
        np.testing.assert_array_equal(out, np.broadcast_to(w["b_o"], out.shape))
        assert not wts.any()
        assert attnlab.bilinear_attention(
            np.zeros((0, 3, 8)), w_qk=folded, **vo, num_heads=2, _order=order
        ).shape == (0, 3, 8)
        assert attnlab.bilinear_attention(
            np.zeros((2, 0, 8)), w_qk=folded, **vo, num_heads=2, _order=order
        ).shape == (2, 0, 8)
        e = attnlab.bilinear_attention(
            x, np.zeros((2, 0, 8)), w_qk=folded, **vo, num_heads=2, _order=order
        )
        np.testing.assert_array_equal(e, np.broadcast_to(w["b_o"], e.shape))


def test_input_forms(rng, mha_weights, close):
    w = mha_weights(rng, 16, 4, 4, bias=True)
    qk, vo = _split(w)
    folded = attnlab.collapse_qk(**qk, num_heads=4)
    x = rng.standard_normal((3, 200, 16))
    ref = attnlab.bilinear_attention(x, w_qk=folded, **vo, num_heads=4)
    xf = np.asfortranarray(x)
    xf.flags.writeable = False
    vo_nc = {k: (np.asfortranarray(v) if v.ndim == 2 else v[::-1][::-1]) for k, v in vo.items()}
    got = attnlab.bilinear_attention(
        xf, w_qk=folded.w[:, :, ::-1][:, :, ::-1], u_k=folded.u, **vo_nc, num_heads=4, scale=0.5
    )
    close(got, ref, np.float64, "non-contiguous")
    xi = (x * 10).astype(np.int32)
    assert attnlab.bilinear_attention(xi, w_qk=folded, **vo, num_heads=4).dtype == np.float64
    mixed = attnlab.bilinear_attention(x.astype(np.float32), w_qk=folded, **vo, num_heads=4)
    assert mixed.dtype == np.float64


def test_thread_count_bitwise(rng, mha_weights):
    w = mha_weights(rng, 16, 4, 4, bias=True)
    qk, vo = _split(w)
    folded = attnlab.collapse_qk(**qk, num_heads=4)
    x = rng.standard_normal((3, 200, 16))
    old = attnlab.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            attnlab.set_num_threads(t)
            outs.append(
                [
                    attnlab.bilinear_attention(x, w_qk=folded, **vo, num_heads=4, _order=o)
                    for o in ("query", "key")
                ]
            )
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        np.testing.assert_array_equal(outs[0][1], outs[1][1])
    finally:
        attnlab.set_num_threads(old)


def test_nan_propagates(rng, mha_weights):
    w = mha_weights(rng, 8, 2, 4)
    qk, vo = _split(w)
    folded = attnlab.collapse_qk(**qk, num_heads=2)
    x = rng.standard_normal((6, 8))
    x[2, 3] = np.nan
    for order in ("query", "key"):
        out = attnlab.bilinear_attention(x, w_qk=folded, **vo, num_heads=2, _order=order)
        assert np.isnan(out).any()


def test_errors(rng, mha_weights):
    w = mha_weights(rng, 8, 2, 4)
    qk, vo = _split(w)
    folded = attnlab.collapse_qk(**qk, num_heads=2)
    x = rng.standard_normal((2, 5, 8))
    f = attnlab.bilinear_attention
    with pytest.raises(ValueError, match="w_qk"):
        f(x, w_qk=folded.w[:, :7], **vo, num_heads=2)
    with pytest.raises(ValueError, match="w_qk"):
        f(x, w_qk=folded, **vo, num_heads=4)
    with pytest.raises(ValueError, match="u_k"):
        f(x, w_qk=folded, u_k=folded.u, **vo, num_heads=2)
    with pytest.raises(ValueError, match="u_k"):
        f(x, w_qk=folded.w, u_k=folded.u[:, :3], **vo, num_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        f(x, w_qk=folded, **vo, num_heads=2, num_kv_heads=3)
    with pytest.raises(TypeError, match="num_heads"):
        f(x, w_qk=folded, **vo, num_heads=2.0)
    with pytest.raises(ValueError, match="w_v"):
        f(x, w_qk=folded, w_v=vo["w_v"][:5], w_o=vo["w_o"], num_heads=2)
    with pytest.raises(ValueError, match="w_o"):
        f(x, w_qk=folded, w_v=vo["w_v"], w_o=vo["w_o"][:3], num_heads=2)
    with pytest.raises(ValueError, match="b_o"):
        f(x, w_qk=folded, **dict(vo, b_o=np.zeros(3)), num_heads=2)
    with pytest.raises(ValueError, match="mask"):
        f(x, w_qk=folded, **vo, num_heads=2, mask=np.ones((3, 5, 5), dtype=bool))
    with pytest.raises(TypeError, match="query"):
        f(x.astype(complex), w_qk=folded, **vo, num_heads=2)
    with pytest.raises(ValueError, match="query"):
        f(np.ones(8), w_qk=folded, **vo, num_heads=2)
    with pytest.raises(ValueError, match="value"):
        f(x, x, x[:, :3], w_qk=folded, **vo, num_heads=2)
    with pytest.raises(ValueError, match="batch"):
        f(x, np.ones((3, 5, 8)), w_qk=folded, **vo, num_heads=2)
    with pytest.raises(ValueError, match="_order"):
        f(x, w_qk=folded, **vo, num_heads=2, _order="both")
    with pytest.raises(ValueError, match="causal"):
        f(x, w_qk=folded, **vo, num_heads=2, causal="left")
    with pytest.raises(ValueError, match="scale"):
        f(x, w_qk=folded, **vo, num_heads=2, scale=float("inf"))
    # collapse_qk
    with pytest.raises(ValueError, match="w_q"):
        attnlab.collapse_qk(qk["w_q"][:, :7], qk["w_k"], num_heads=2)
    with pytest.raises(ValueError, match="w_k"):
        attnlab.collapse_qk(qk["w_q"], qk["w_k"][:, :4], num_heads=2)
    with pytest.raises(ValueError, match="b_q"):
        attnlab.collapse_qk(qk["w_q"], qk["w_k"], np.ones(3), num_heads=2)
    with pytest.raises(ValueError, match="b_k"):
        attnlab.collapse_qk(qk["w_q"], qk["w_k"], None, np.ones(3), num_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        attnlab.collapse_qk(qk["w_q"], qk["w_k"], num_heads=2, num_kv_heads=4)
    with pytest.raises(TypeError, match="w_q"):
        attnlab.collapse_qk(None, qk["w_k"], num_heads=2)
    # factorize_qk
    with pytest.raises(ValueError, match="rank"):
        attnlab.factorize_qk(folded, 9)
    with pytest.raises(ValueError, match="rank"):
        attnlab.factorize_qk(folded, 0)
    with pytest.raises(TypeError, match="rank"):
        attnlab.factorize_qk(folded, 2.5)
    with pytest.raises(ValueError, match="w"):
        attnlab.factorize_qk(folded.w[0], 2)
    with pytest.raises(ValueError, match="NaN"):
        attnlab.factorize_qk(np.full((1, 2, 2), np.nan), 1)
    # BilinearQK
    with pytest.raises(ValueError, match="query"):
        folded.scores(np.ones((3, 7)))
    with pytest.raises(AttributeError):
        folded.w = folded.w  # frozen


def test_core_rejects_bad_buffers():
    x = np.zeros((10, 4))
    wqk = np.zeros((2, 4, 4))
    wv = np.zeros((4, 4))
    wo = np.zeros((4, 4))
    out = np.zeros((10, 4))
    args = dict(
        query=x,
        key=x,
        value=x,
        w_qk=wqk,
        u_k=None,
        w_v=wv,
        b_v=None,
        w_o=wo,
        b_o=None,
        batch=2,
        n_q=5,
        n_k=5,
        heads=2,
        kv_heads=2,
        mask=CoreMask(None, None, 0),
        scale=1.0,
        weights_half=0,
        inputs_half=0,
    )

    def forward(order=0, out=out, weights=None, **changed):
        core.bilinear_forward(core.BilinearArgs(**dict(args, **changed)), order, out, weights)

    forward()
    assert core.BilinearArgs(**args).mask == CoreMask(None, None, 0)  # read back as given
    for bad in (
        dict(n_q=6),
        dict(w_qk=np.zeros((3, 4, 4))),
        dict(u_k=np.zeros((2, 3))),
        dict(order=2),
        dict(kv_heads=3),
        dict(out=np.zeros((10, 4), np.float32)),
        dict(weights=np.zeros((2, 2, 5, 4))),
        dict(mask=CoreMask(None, None, 5)),
        dict(mask=CoreMask(None, None, "top_left")),
        dict(mask=CoreMask(np.ones((2, 2, 5, 4), bool), None, 0)),
        dict(mask=CoreMask(np.ones((2, 2, 5, 5), np.int32), None, 0)),
        dict(mask=CoreMask(None, np.ones((2, 4), bool), 0)),
        dict(mask=CoreMask(None, np.ones((2, 5)), 0)),
        dict(mask=None),
        dict(mask=(None, None)),
        dict(mask=[None, None, 0]),
        dict(batch=-1),
        dict(weights_half=3),
        dict(inputs_half=1),  # without half-precision weights
        dict(weights_half=1),  # float64 query, and weights that are not uint16 bits
    ):
        with pytest.raises((ValueError, TypeError)):
            forward(**bad)
    with pytest.raises(TypeError, match=r"^w_qk: half-precision weights go with float32"):
        core.bilinear_backward(out, core.BilinearArgs(**dict(args, weights_half=1)), {})
    with pytest.raises(ValueError, match=r"^inputs_half: expected 0, or 1 with the weights"):
        core.bilinear_backward(out, core.BilinearArgs(**dict(args, inputs_half=1)), {})


def test_core_half_inputs():
    """core.BilinearArgs' inputs_half: query, key, value and out as float16 bits beside float16
    weights, computed in float32 (the forward and the backward); refused, by name, for float32
    rows, and uint16 rows without it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 4)).astype(np.float16)
    w = {n: (rng.standard_normal(s) / 2).astype(np.float16) for n, s in
         (("w_qk", (2, 4, 4)), ("w_v", (4, 4)), ("w_o", (4, 4)))}  # fmt: skip
    bits = {n: a.view(np.uint16) for n, a in w.items()}
    args = dict(
        query=x.view(np.uint16), key=x.view(np.uint16), value=x.view(np.uint16), u_k=None,
        b_v=None, b_o=None, batch=2, n_q=5, n_k=5, heads=2, kv_heads=2,
        mask=CoreMask(None, None, 0), scale=0.5, weights_half=1, inputs_half=1, **bits,
    )  # fmt: skip
    out = np.empty((10, 4), np.float16)
    core.bilinear_forward(core.BilinearArgs(**args), 0, out.view(np.uint16), None)
    want = attnlab.bilinear_attention(
        x.reshape(2, 5, 4).astype(np.float32), num_heads=2, scale=0.5,
        **{n: a.astype(np.float32) for n, a in w.items()},
    )  # fmt: skip
    np.testing.assert_array_equal(out.reshape(2, 5, 4), want.astype(np.float16))
    grads = {"query": np.empty((10, 4), np.uint16), "w_qk": np.empty((2, 4, 4), np.float32)}
    core.bilinear_backward(np.ones((10, 4), np.float16).view(np.uint16),
                           core.BilinearArgs(**args), grads)  # fmt: skip
    assert np.isfinite(grads["query"].view(np.float16)).all()
    with pytest.raises(TypeError, match=r"^query: "):
        core.bilinear_forward(
            core.BilinearArgs(**dict(args, query=x.astype(np.float32))), 0, out, None
        )
    with pytest.raises(TypeError, match=r"^query: "):
        core.bilinear_forward(core.BilinearArgs(**dict(args, inputs_half=0)), 0, out, None)
    bad = {"query": np.empty((10, 4), np.float32)}  # float32 where bits are written
    with pytest.raises(TypeError, match=r"^grads\['query'\]|^query"):
        core.bilinear_backward(np.ones((10, 4), np.uint16), core.BilinearArgs(**args), bad)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("order", ["query", "key"])
@pytest.mark.parametrize("cross", [False, True])
def test_half_inputs_with_u_k(dtype, order, cross, monkeypatch):
    """Every array in one half dtype, u_k too (the key order pads the queries with a 1 as it
    widens them): the kernel reads the inputs as stored, and the output and every gradient are
    the float32 call's on the widened arrays, rounded, bit for bit."""
    from conftest import refuse_conversions

    dt = np.dtype(dtype) if dtype == "float16" else pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(11)
    B, n, m, d, h = 2, 21, 13, 12, 3
    x = rng.standard_normal((B, n, d)).astype(dt)
    y = rng.standard_normal((B, m, d)).astype(dt) if cross else None
    w = {
        "w_qk": (rng.standard_normal((h, d, d)) / 4).astype(dt),
        "u_k": rng.standard_normal((h, d)).astype(dt),
        "w_v": (rng.standard_normal((d, d)) / 4).astype(dt),
        "w_o": (rng.standard_normal((d, d)) / 4).astype(dt),
        "b_v": rng.standard_normal(d).astype(dt),
    }
    f32 = {k: v.astype(np.float32) for k, v in w.items()}
    y32 = None if y is None else y.astype(np.float32)
    want = attnlab.bilinear_attention(x.astype(np.float32), y32, num_heads=h, _order=order, **f32)
    go = rng.standard_normal(want.shape).astype(dt)
    want_g = attnlab.bilinear_attention_backward(
        go.astype(np.float32), x.astype(np.float32), y32, num_heads=h, **f32
    )
    shapes = {x.shape, (B * n, d)} | ({y.shape, (B * m, d)} if cross else set())
    refuse_conversions(monkeypatch, shapes)
    got = attnlab.bilinear_attention(x, y, num_heads=h, _order=order, **w)
    assert got.dtype == dt
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(dt).view(np.uint16))
    got_g = attnlab.bilinear_attention_backward(go, x, y, num_heads=h, **w)
    assert sorted(got_g) == sorted(want_g)
    for name, value in want_g.items():
        assert got_g[name].dtype == dt, name
        np.testing.assert_array_equal(
            got_g[name].view(np.uint16), value.astype(dt).view(np.uint16), err_msg=name
        )


def test_doctests():
    res = doctest.testmod(_bilinear, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0
