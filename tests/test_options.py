"""The options of today's models (DESIGN §4b) on SDPA, multi-head and bilinear attention:
forward against the float64 reference, backward against finite differences of the reference
and against the same call written with the equivalent boolean mask, composed with masks,
causal (both alignments), grouped-query heads, n_q != n_k and batch broadcasting."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import attnlab
from attnlab import reference
from conftest import assert_close, make_mha_weights

WINDOWS = [(0, 0), (2, 0), (3, 1), (None, 2), (1, None), (0, None), (100, 100), (None, None)]
CAUSAL = [False, True, "bottom_right"]


def window_mask(n_q: int, n_k: int, window, causal) -> np.ndarray:
    """The boolean mask of ``window`` written out directly (not through the reference)."""
    p = np.arange(n_q)[:, None] + (n_k - n_q if causal == "bottom_right" else 0)
    j = np.arange(n_k)[None, :]
    left, right = window
    ok = np.ones((n_q, n_k), bool)
    if left is not None:
        ok &= j >= p - left
    if right is not None:
        ok &= j <= p + right
    return ok


def numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return g


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1.0))


# --- window ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 9), (1, 2, 1, 5, 13), (1, 2, 2, 13, 5)])
def test_sdpa_window_matches_reference(dtype, window, causal, shape):
    B, h, h_kv, n_q, n_k = shape
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, h, n_q, 8)).astype(dtype)
    k = rng.standard_normal((B, h_kv, n_k, 8)).astype(dtype)
    v = rng.standard_normal((B, h_kv, n_k, 6)).astype(dtype)
    kw = dict(window=window, causal=causal, warn_empty_rows=False)
    out, w = attnlab.scaled_dot_product_attention(q, k, v, return_weights=True, **kw)
    ref, rw = reference.scaled_dot_product_attention(q, k, v, return_weights=True, **kw)
    assert_close(out, ref, dtype, "window sdpa")
    assert_close(w, rw, dtype, "window sdpa weights")
    # the weights are zero exactly outside the band
    allowed = window_mask(n_q, n_k, window, False if causal is False else causal)
    if causal:
        p = np.arange(n_q)[:, None] + (n_k - n_q if causal == "bottom_right" else 0)
        allowed &= np.arange(n_k)[None, :] <= p
    assert not np.any(w[..., ~allowed])


@pytest.mark.parametrize("window", [(3, 0), (1, 2), (None, 0), (0, None)])
@pytest.mark.parametrize("causal", CAUSAL)
def test_window_equals_its_boolean_mask_on_long_sequences(window, causal):
    """Several tiles each way (tiles outside the band are skipped): the window gives what the
    same band as a boolean mask gives, forward and backward."""
    rng = np.random.default_rng(3)
    B, h, h_kv, n_q, n_k, d = 1, 2, 1, 300, 420, 16
    if causal is True:
        n_q = n_k
    q = rng.standard_normal((B, h, n_q, d))
    k = rng.standard_normal((B, h_kv, n_k, d))
    v = rng.standard_normal((B, h_kv, n_k, d))
    g = rng.standard_normal((B, h, n_q, d))
    mask = window_mask(n_q, n_k, window, causal)
    kw = dict(causal=causal, warn_empty_rows=False)
    out = attnlab.scaled_dot_product_attention(q, k, v, window=window, **kw)
    ref = attnlab.scaled_dot_product_attention(q, k, v, mask=mask, **kw)
    assert_close(out, ref, np.float64, "window vs mask")
    ga = attnlab.scaled_dot_product_attention_backward(g, q, k, v, window=window, **kw)
    gb = attnlab.scaled_dot_product_attention_backward(g, q, k, v, mask=mask, **kw)
    for name in ("q", "k", "v"):
        assert_close(ga[name], gb[name], np.float64, f"window grad {name}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(2, 0), (1, 3), (None, 1)])
def test_mha_and_bilinear_window_match_reference(dtype, causal, window):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 10, 12)).astype(dtype)
    mem = rng.standard_normal((1, 14, 12)).astype(dtype)
    w = make_mha_weights(rng, 12, 4, 3, num_kv_heads=2, dtype=dtype)
    pad = np.ones((2, 14), bool)
    pad[1, :3] = False
    kw = dict(
        num_heads=4,
        num_kv_heads=2,
        window=window,
        causal=causal,
        key_padding_mask=pad,
        warn_empty_rows=False,
    )
    out = attnlab.multi_head_attention(x, mem, **w, **kw)
    assert_close(out, reference.multi_head_attention(x, mem, **w, **kw), dtype, "window mha")
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], w["b_q"], w["b_k"], num_heads=4, num_kv_heads=2)
    bw = dict(w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], b_v=w["b_v"], b_o=w["b_o"])
    out_b = attnlab.bilinear_attention(x, mem, **bw, **kw)
    assert_close(out_b, reference.bilinear_attention(x, mem, **bw, **kw), dtype, "window bil")
    assert_close(out_b, out.astype(np.float64), dtype, "window bilinear vs mha")


@pytest.mark.parametrize("causal", CAUSAL)
def test_mha_window_backward_finite_differences(causal):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 7, 6))
    w = make_mha_weights(rng, 6, 2, 3, num_kv_heads=1)
    g = rng.standard_normal((1, 7, 6))
    kw = dict(num_heads=2, num_kv_heads=1, window=(2, 1), causal=causal, warn_empty_rows=False)
    grads = attnlab.multi_head_attention_backward(g, x, **w, **kw)
    args = {"query": x, **w}
    for name, arr in args.items():

        def f() -> float:
            rest = {n: a for n, a in args.items() if n != "query"}
            return float(np.sum(reference.multi_head_attention(args["query"], **rest, **kw) * g))

        num = numeric_grad(f, arr)
        assert rel_err(grads[name], num) < 1e-6, name


def test_window_rows_without_keys_are_zero_and_warned():
    """``window=(0, 0)`` with bottom-right alignment and n_q > n_k leaves the first queries'
    aligned key before the sequence: no key, a zero row, and the usual warning only when a
    mask array empties a row the window alone would not."""
    q = np.ones((1, 1, 6, 4))
    k = v = np.ones((1, 1, 3, 4))
    out = attnlab.scaled_dot_product_attention(q, k, v, window=(0, 0), causal="bottom_right")
    assert np.all(out[..., :3, :] == 0) and np.all(out[..., 3:, :] == 1)
    mask = np.ones((6, 3), bool)
    mask[4, 1] = False  # row 4 sees key 1 only through the window
    with pytest.warns(UserWarning, match="1 of 6"):
        attnlab.scaled_dot_product_attention(
            q, k, v, window=(0, 0), causal="bottom_right", mask=mask
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnlab.scaled_dot_product_attention(q, k, v, window=(0, 0), causal="bottom_right")


@pytest.mark.parametrize(
    "window, err, match",
    [
        (3, TypeError, "window: expected a pair"),
        ("ab", TypeError, "window: expected a pair"),
        ((1, 2, 3), ValueError, "window: expected a pair .* got 3 items"),
        ((-1, 0), ValueError, "window: the left side must be >= 0 or None, got -1"),
        ((0, 1.5), TypeError, "window: the right side must be an int"),
        ((True, 0), TypeError, "window: the left side must be an int"),
    ],
)
def test_window_errors(window, err, match):
    q = np.ones((1, 2, 3, 4))
    with pytest.raises(err, match=match):
        attnlab.scaled_dot_product_attention(q, q, q, window=window)
    w = make_mha_weights(np.random.default_rng(0), 4, 2, 2)
    with pytest.raises(err, match=match):
        attnlab.multi_head_attention(np.ones((3, 4)), **w, num_heads=2, window=window)


def test_window_huge_sides_are_unbounded():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 20, 4))
    big = attnlab.scaled_dot_product_attention(q, q, q, window=(2**63 - 1, 10**30))
    none = attnlab.scaled_dot_product_attention(q, q, q)
    np.testing.assert_array_equal(big, none)


def test_window_vjp_and_torch_adapter():
    torch = pytest.importorskip("torch")
    import attnlab.torch as at

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
    g = rng.standard_normal((1, 2, 9, 4))
    kw = dict(window=(2, 0), causal=True)
    out, pull = attnlab.vjp(attnlab.scaled_dot_product_attention, q, k, v, **kw)
    grads = pull(g)
    ref = attnlab.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    for name in "qkv":
        np.testing.assert_array_equal(grads[name], ref[name])
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    to = at.scaled_dot_product_attention(tq, tk, tv, **kw)
    to.backward(torch.tensor(g))
    np.testing.assert_allclose(to.detach().numpy(), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tq.grad.numpy(), grads["q"], rtol=1e-12, atol=1e-12)
    # torch's own SDPA with the band as a boolean mask
    band = torch.tensor(window_mask(9, 9, (2, 0), True))
    tref = torch.nn.functional.scaled_dot_product_attention(
        torch.tensor(q), torch.tensor(k), torch.tensor(v), attn_mask=band
    )
    np.testing.assert_allclose(out, tref.numpy(), rtol=1e-12, atol=1e-12)


def test_window_layers():
    layer = attnlab.layers.MultiHeadAttention(8, num_heads=2, seed=0)
    x = np.random.default_rng(0).standard_normal((2, 12, 8))
    out = layer(x, window=(3, 0), causal=True)
    ref = reference.multi_head_attention(x, **layer.params, num_heads=2, window=(3, 0), causal=True)
    assert_close(out, ref, np.float64, "window layer")


def test_window_combinations_bitwise_thread_independent():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 2, 200, 8)).astype(np.float32)
    outs = []
    for n in (1, 2):
        prev = attnlab.get_num_threads()
        attnlab.set_num_threads(n)
        try:
            outs.append(
                [
                    attnlab.scaled_dot_product_attention(q, q, q, window=w, causal=c)
                    for w, c in itertools.product([(5, 0), (17, 40)], [False, True])
                ]
            )
        finally:
            attnlab.set_num_threads(prev)
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)
