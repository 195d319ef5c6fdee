"""The decode path of the attention forward (few query rows per kv head against >= 1024 keys,
split along the keys and merged by log-sum-exp): against the float64 reference with every mask
and option, NaN/Inf rules, thread-count independence, and the backward built on its lse."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab import reference
from conftest import assert_close

CASES = [
    # (B, h, h_kv, n_q, n_k, d, d_v, options)
    (1, 4, 4, 1, 3000, 64, 48, {}),
    (2, 8, 2, 1, 2000, 128, 128, {"causal": "bottom_right"}),
    (1, 8, 2, 4, 1500, 64, 32, {"causal": "bottom_right", "window": (700, 0)}),
    (
        2,
        4,
        1,
        2,
        1200,
        33,
        17,
        {"softcap": 2.0, "sinks": [0.3, -1, 2, 0], "alibi_slopes": [1e-3, 2e-3, 4e-3, 8e-3]},
    ),
    (1, 2, 2, 3, 1100, 16, 16, {"mask": "bool"}),
    (1, 2, 1, 5, 1024, 8, 8, {"mask": "float", "causal": True}),
    (3, 16, 1, 1, 4100, 64, 64, {"window": (100, None), "causal": "bottom_right"}),
]


def _args(case, dtype, rng):
    B, h, h_kv, n_q, n_k, d, d_v, opts = case
    q = rng.standard_normal((B, h, n_q, d)).astype(dtype)
    k = rng.standard_normal((B, h_kv, n_k, d)).astype(dtype)
    v = rng.standard_normal((B, h_kv, n_k, d_v)).astype(dtype)
    kw = dict(opts)
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((n_q, n_k)) < 0.5
    elif kw.get("mask") == "float":
        kw["mask"] = rng.standard_normal((h, n_q, n_k)).astype(dtype)
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_decode_matches_reference(case, dtype):
    rng = np.random.default_rng(1)
    q, k, v, kw = _args(case, dtype, rng)
    out, lse = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, dtype, "decode")
    assert_close(lse, rlse, dtype, "decode lse")
    # the weights path (never the decode path) agrees
    out_w, _ = attnlab.scaled_dot_product_attention(q, k, v, return_weights=True, **kw)
    assert_close(out_w, ref, dtype, "decode vs weights path")


def test_decode_bitwise_independent_of_thread_count():
    rng = np.random.default_rng(2)
    q, k, v, kw = _args(CASES[1], np.float32, rng)
    outs = []
    prev = attnlab.get_num_threads()
    try:
        for n in (1, 2, 3):
            attnlab.set_num_threads(n)
            outs.append(attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw))
    finally:
        attnlab.set_num_threads(prev)
    for o in outs[1:]:
        np.testing.assert_array_equal(o[0], outs[0][0])
        np.testing.assert_array_equal(o[1], outs[0][1])


def test_decode_nonfinite_rules():
    """NaN in a value row a query may not see never reaches it; NaN in q makes its row NaN;
    Inf in a visible value row reaches that row; rows with no key are 0 with lse -inf."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 2, 16))
    k = rng.standard_normal((1, 1, 2048, 16))
    v = rng.standard_normal((1, 1, 2048, 16))
    v[0, 0, 2047, 3] = np.nan  # seen by the last query only (bottom_right)
    out = attnlab.scaled_dot_product_attention(q, k, v, causal="bottom_right")
    assert np.all(np.isfinite(out[..., 0, :]))
    assert np.isnan(out[..., 1, 3]).all() and np.isfinite(np.delete(out[..., 1, :], 3, -1)).all()
    q2 = q.copy()
    q2[0, 1, 0, 0] = np.nan
    v2 = v.copy()
    v2[0, 0, 2047, 3] = 0.0
    out = attnlab.scaled_dot_product_attention(q2, k, v2)
    assert np.isnan(out[0, 1, 0]).all() and np.isfinite(out[0, 0]).all()
    mask = np.zeros((2, 2048), bool)
    mask[1, 5] = True
    out, lse = attnlab.scaled_dot_product_attention(
        q, k, v, mask=mask, return_lse=True, warn_empty_rows=False
    )
    assert np.all(out[..., 0, :] == 0) and np.all(np.isneginf(lse[..., 0]))
    np.testing.assert_allclose(out[..., 1, :], v[0, 0, 5].reshape(1, 1, -1).repeat(2, 1))


def test_decode_gradients_and_vjp():
    rng = np.random.default_rng(4)
    q, k, v, kw = _args(CASES[3], np.float64, rng)
    g = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    grads = attnlab.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    _, pull = attnlab.vjp(attnlab.scaled_dot_product_attention, q, k, v, **kw)
    kept = pull(g)
    for name in grads:
        np.testing.assert_allclose(kept[name], grads[name], rtol=1e-12, atol=1e-13)
    # q's gradient against central differences of the reference along one direction
    direction = rng.standard_normal(q.shape)
    eps = 1e-6

    def loss(x):
        return float(np.sum(reference.scaled_dot_product_attention(x, k, v, **kw) * g))

    num = (loss(q + eps * direction) - loss(q - eps * direction)) / (2 * eps)
    assert abs(num - float(np.sum(grads["q"] * direction))) < 1e-6 * max(1.0, abs(num))
