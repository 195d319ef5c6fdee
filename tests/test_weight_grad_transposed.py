"""Weight gradients dW = X^T dY of a tall X run on X^T, made once per call (or once for the
three projections of self-attention, the two of additive attention): the same products in the
same order as reading X across its rows, so bit for bit the same gradients.

Zero rows appended to X (and to dY) add exact zeros to every sum: a call of 128 rows (X read
across its rows) and the same rows padded to 300 (X^T first) give the same weight gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlab

WEIGHTS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def _layer(rng, d, dtype):
    w = {n: (rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype) for n in WEIGHTS[:4]}
    w.update({n: (rng.standard_normal(d) / 10).astype(dtype) for n in WEIGHTS[4:]})
    return w


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("extra", [172, 300])
def test_padded_query_rows_give_the_same_weight_gradients(dtype, extra):
    rng = np.random.default_rng(extra)
    d, n_q, n_k = 48, 128, 50
    w = _layer(rng, d, dtype)
    xq = rng.standard_normal((1, n_q, d)).astype(dtype)
    xkv = rng.standard_normal((1, n_k, d)).astype(dtype)
    g = rng.standard_normal((1, n_q, d)).astype(dtype)
    pad = np.zeros((1, extra, d), dtype)
    kw = dict(num_heads=4, **w)
    short = attnlab.multi_head_attention_backward(g, xq, xkv, xkv, **kw)
    tall = attnlab.multi_head_attention_backward(
        np.concatenate([g, pad], 1), np.concatenate([xq, pad], 1), xkv, xkv, **kw
    )
    for name in WEIGHTS:
        np.testing.assert_array_equal(tall[name], short[name], err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_self_attention_shares_one_transpose(dtype):
    """Self-attention transposes X once for the three weight gradients; given as three arrays,
    each gradient transposes its own: the same weight gradients."""
    rng = np.random.default_rng(5)
    d = 40
    w = _layer(rng, d, dtype)
    x = rng.standard_normal((2, 150, d)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    shared = attnlab.multi_head_attention_backward(g, x, num_heads=2, causal=True, **w)
    apart = attnlab.multi_head_attention_backward(
        g, x, x.copy(), x.copy(), num_heads=2, causal=True, **w
    )
    for name in WEIGHTS:
        np.testing.assert_array_equal(shared[name], apart[name], err_msg=name)
    if dtype == np.float64:  # and right: central differences of the float64 reference
        for name in WEIGHTS[:4]:
            direction = rng.standard_normal(w[name].shape)
            eps = 1e-5
            f = [
                attnlab.reference.multi_head_attention(
                    x, num_heads=2, causal=True, **{**w, name: w[name] + s * eps * direction}
                )
                for s in (1, -1)
            ]
            numeric = np.sum(g * (f[0] - f[1])) / (2 * eps)
            analytic = np.sum(shared[name] * direction)
            assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), name


def test_additive_weight_gradients_sharing_one_transpose():
    """Additive attention's two input projections share X^T (150 tokens a batch row, two rows:
    more than a row chunk): each weight gradient against central differences of the float64
    reference along a random direction."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 150, 24))
    ws = {n: rng.standard_normal((24, 32)) / 5 for n in ("w_q", "w_k")}
    ws.update(w_g=rng.standard_normal(32), w_proj=rng.standard_normal((32, 32)) / 6)
    ws["w_final"] = rng.standard_normal((32, 16)) / 6
    g = rng.standard_normal((2, 150, 16))
    grads = attnlab.additive_attention_backward(g, x, **ws)
    for name in ("w_q", "w_k"):
        direction = rng.standard_normal(ws[name].shape)
        eps = 1e-5
        up = attnlab.reference.additive_attention(x, **{**ws, name: ws[name] + eps * direction})
        down = attnlab.reference.additive_attention(x, **{**ws, name: ws[name] - eps * direction})
        numeric = np.sum(g * (up - down)) / (2 * eps)
        analytic = np.sum(grads[name] * direction)
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (name, numeric, analytic)
