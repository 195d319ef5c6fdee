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
from conftest import assert_close, make_mha_weights, numeric_grad, rel_err

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


@pytest.mark.parametrize(
    ("dtype", "precision"), [(np.float32, None), (np.float64, None), (np.float32, "bf16")]
)
@pytest.mark.parametrize("window", [(3, 0), (1, 2), (None, 0), (300, 0), (270, 10)])
def test_window_forward_is_its_mask_bit_for_bit(dtype, precision, window):
    """The forward's key tiles (and the bf16 tiles' softmax blocks) sit at whole multiples of
    their size whatever the band (the first one cut where the band starts), so a row sums its
    keys in the same chains as with the band given as a boolean mask (tiles outside it skipped,
    inside it masked: exact zeros): the same bits. And a row's bits do not depend on its query
    tile: the rows from s on, as their own call aligned bottom-right, are the whole call's."""
    rng = np.random.default_rng(11)
    n_q, n_k, d = 700, 1000, 16
    q = rng.standard_normal((1, 2, n_k, d)).astype(dtype)
    k = rng.standard_normal((1, 1, n_k, d)).astype(dtype)
    v = rng.standard_normal((1, 1, n_k, 8)).astype(dtype)
    kw = dict(warn_empty_rows=False, precision=precision)
    for causal in CAUSAL:
        rows = n_k if causal is True else n_q
        got = attnlab.scaled_dot_product_attention(
            q[:, :, :rows], k, v, window=window, causal=causal, **kw
        )
        mask = window_mask(rows, n_k, window, causal)
        want = attnlab.scaled_dot_product_attention(
            q[:, :, :rows], k, v, mask=mask, causal=causal, **kw
        )
        np.testing.assert_array_equal(got, want, err_msg=f"causal={causal}")
    whole = attnlab.scaled_dot_product_attention(q, k, v, window=window, causal=True, **kw)
    for s in (1, 37, 401):  # query tiles start 1, 37 and 401 keys on
        part = attnlab.scaled_dot_product_attention(
            q[:, :, s:], k, v, window=window, causal="bottom_right", **kw
        )
        np.testing.assert_array_equal(part, whole[:, :, s:], err_msg=f"rows from {s}")


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("window", [(3, 0), (300, 0), (270, 10)])
def test_window_weights_are_its_mask_bit_for_bit(precision, window):
    """With the weights returned (whole rows of scores, masked, then normalised) a window
    gives its band-as-mask's output and weights, bit for bit."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 2, 400, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 500, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 500, 8)).astype(np.float32)
    kw = dict(warn_empty_rows=False, precision=precision, return_weights=True)
    for causal in CAUSAL:
        mask = window_mask(400, 500, window, causal)
        got = attnlab.scaled_dot_product_attention(q, k, v, window=window, causal=causal, **kw)
        want = attnlab.scaled_dot_product_attention(q, k, v, mask=mask, causal=causal, **kw)
        for name, a, b in zip(("output", "weights"), got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, causal={causal}")


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


# --- softcap, sinks, ALiBi, log-sum-exp ---------------------------------------------------------


def logit_options(rng: np.random.Generator, which: str, batch: int, h: int) -> dict:
    kw: dict = {}
    if "c" in which:
        kw["softcap"] = 1.5
    if "s" in which:
        kw["sinks"] = rng.standard_normal((batch, h) if "b" in which else h)
    if "a" in which:
        kw["alibi_slopes"] = rng.uniform(0.05, 0.8, (batch, h) if "b" in which else h)
    return kw


OPTION_SETS = ["c", "s", "a", "csa", "csab"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", OPTION_SETS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("masking", [None, "bool", "float", "window"])
def test_sdpa_logit_options_match_reference(dtype, which, causal, masking):
    rng = np.random.default_rng(17)
    B, h, h_kv, n_q, n_k = 2, 4, 2, 9, 12
    q = (3 * rng.standard_normal((B, h, n_q, 8))).astype(dtype)  # far from uniform: caps bite
    k = rng.standard_normal((B, h_kv, n_k, 8)).astype(dtype)
    v = rng.standard_normal((B, h_kv, n_k, 5)).astype(dtype)
    kw = dict(logit_options(rng, which, B, h), causal=causal, warn_empty_rows=False)
    if masking == "bool":
        kw["mask"] = rng.random((h, n_q, n_k)) < 0.7
    elif masking == "float":
        kw["mask"] = rng.standard_normal((n_q, n_k)).astype(dtype)
    elif masking == "window":
        kw["window"] = (2, 1)
    got = attnlab.scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True, **kw)
    ref = reference.scaled_dot_product_attention(
        q, k, v, return_weights=True, return_lse=True, **kw
    )
    for g, r, what in zip(got, ref, ("out", "weights", "lse"), strict=True):
        assert_close(g, r, dtype, f"logit options sdpa {what}")
    # the flash path (no weights) agrees with the weights path
    out, lse = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref[0], dtype, "logit options sdpa out")
    assert_close(lse, ref[2], dtype, "logit options sdpa lse")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["c", "s", "csa"])
def test_mha_and_bilinear_logit_options_match_reference(dtype, which):
    rng = np.random.default_rng(19)
    x = (2 * rng.standard_normal((2, 10, 16))).astype(dtype)
    w = make_mha_weights(rng, 16, 4, 4, num_kv_heads=2, dtype=dtype)
    kw = dict(
        logit_options(rng, which, 2, 4),
        num_heads=4,
        num_kv_heads=2,
        causal=True,
        window=(4, 0),
        return_lse=True,
    )
    out, lse = attnlab.multi_head_attention(x, **w, **kw)
    ref, rlse = reference.multi_head_attention(x, **w, **kw)
    assert_close(out, ref, dtype, "logit options mha")
    assert_close(lse, rlse, dtype, "logit options mha lse")
    out_r, lse_r = attnlab.multi_head_attention(x, **w, **kw, rope_theta=100.0)
    ref_r, rlse_r = reference.multi_head_attention(x, **w, **kw, rope_theta=100.0)
    assert_close(out_r, ref_r, dtype, "logit options mha rope")
    assert_close(lse_r, rlse_r, dtype, "logit options mha rope lse")
    # b_k folds into per-row terms that cancel in a softmax, not through a cap or with a sink
    spoilt = "softcap" in kw or "sinks" in kw
    b_k = None if spoilt else w["b_k"]
    if spoilt:
        qk = attnlab.collapse_qk(
            w["w_q"], w["w_k"], w["b_q"], w["b_k"], num_heads=4, num_kv_heads=2
        )
        with pytest.raises(
            ValueError, match=r"(softcap|sinks): this BilinearQK has query-side terms"
        ):
            attnlab.bilinear_attention(x, w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], **kw)
        w = {**w, "b_k": None}
        out, lse = attnlab.multi_head_attention(x, **w, **kw)
        ref, _ = reference.multi_head_attention(x, **w, **kw)
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], w["b_q"], b_k, num_heads=4, num_kv_heads=2)
    bw = dict(w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], b_v=w["b_v"], b_o=w["b_o"])
    out_b, lse_b = attnlab.bilinear_attention(x, **bw, **kw)
    ref_b, rlse_b = reference.bilinear_attention(x, **bw, **kw)
    assert_close(out_b, ref_b, dtype, "logit options bilinear")
    assert_close(lse_b, rlse_b, dtype, "logit options bilinear lse")
    assert_close(out_b, ref, dtype, "logit options bilinear vs mha")


def test_sinks_rows_without_keys_and_lse_edges():
    q = np.ones((1, 2, 3, 4))
    k = v = np.ones((1, 2, 2, 4))
    mask = np.zeros((3, 2), bool)
    out, w, lse = attnlab.scaled_dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        sinks=[0.5, -1.0],
        return_weights=True,
        return_lse=True,
        warn_empty_rows=False,
    )
    assert np.all(out == 0) and np.all(w == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to([[0.5], [-1.0]], (1, 2, 3)))
    _, lse = attnlab.scaled_dot_product_attention(
        q, k, v, mask=mask, return_lse=True, warn_empty_rows=False
    )
    assert np.all(np.isneginf(lse))
    # no key at all
    out, lse = attnlab.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert out.shape == (1, 2, 3, 4) and np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("which", ["c", "s", "a", "csa"])
@pytest.mark.parametrize("masking", [None, "float", "float_bcast"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_sdpa_gradients_finite_differences(which, masking, causal):
    """Every gradient, sinks and the float mask included, against central differences of
    the float64 reference."""
    rng = np.random.default_rng(23)
    B, h, h_kv, n_q, n_k, d = 2, 2, 1, 4, 6, 3
    args = {
        "q": 2 * rng.standard_normal((B, h, n_q, d)),
        "k": rng.standard_normal((B, h_kv, n_k, d)),
        "v": rng.standard_normal((B, h_kv, n_k, 2)),
    }
    kw = dict(logit_options(rng, which, B, h), causal=causal, window=(3, None))
    if "sinks" in kw:
        args["sinks"] = kw.pop("sinks")
    if masking == "float":
        args["mask"] = rng.standard_normal((B, h, n_q, n_k))
    elif masking == "float_bcast":
        args["mask"] = rng.standard_normal((h, 1, n_k))
    g = rng.standard_normal((B, h, n_q, 2))
    grads = attnlab.scaled_dot_product_attention_backward(g, **args, **kw)
    assert set(grads) == set(args)
    for name, arr in args.items():

        def f() -> float:
            return float(np.sum(reference.scaled_dot_product_attention(**args, **kw) * g))

        num = numeric_grad(f, arr)
        assert grads[name].shape == arr.shape
        assert rel_err(grads[name], num) < 1e-6, name


@pytest.mark.parametrize("which", ["cs", "csa"])
def test_mha_and_bilinear_gradients_finite_differences(which):
    rng = np.random.default_rng(29)
    x = 2 * rng.standard_normal((1, 5, 8))
    w = make_mha_weights(rng, 8, 2, 4, num_kv_heads=1)
    opts = logit_options(rng, which, 1, 2)
    args = {"query": x, **w, "sinks": opts.pop("sinks"), "mask": rng.standard_normal((5, 5))}
    kw = dict(opts, num_heads=2, num_kv_heads=1, causal=True)
    g = rng.standard_normal((1, 5, 8))
    for rope in (None, 50.0):
        grads = attnlab.multi_head_attention_backward(g, **args, **kw, rope_theta=rope)
        for name in ("query", "w_q", "w_k", "sinks", "mask"):

            def f(rope: float | None = rope) -> float:
                out = reference.multi_head_attention(**args, **kw, rope_theta=rope)
                return float(np.sum(out * g))

            assert rel_err(grads[name], numeric_grad(f, args[name])) < 1e-6, (name, rope)
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], w["b_q"], w["b_k"], num_heads=2, num_kv_heads=1)
    bargs = {k: args[k] for k in ("query", "w_v", "w_o", "b_v", "b_o", "sinks", "mask")}
    bargs["w_qk"] = qk.w
    bargs["u_k"] = qk.u
    gb = attnlab.bilinear_attention_backward(g, **bargs, **kw, scale=0.5)
    for name in ("sinks", "mask", "w_qk"):

        def fb() -> float:
            out = reference.bilinear_attention(**bargs, **kw, scale=0.5)
            return float(np.sum(out * g))

        assert rel_err(gb[name], numeric_grad(fb, bargs[name])) < 1e-6, name


def test_logit_option_gradients_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    B, h, n, d = 2, 4, 150, 16  # more than one tile each way
    q, k, v = (rng.standard_normal((B, h, n, d)).astype(np.float32) for _ in range(3))
    q *= 2
    sinks = rng.standard_normal(h).astype(np.float32)
    bias = rng.standard_normal((h, n, n)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.2, h).astype(np.float32)
    g = rng.standard_normal((B, h, n, d)).astype(np.float32)
    kw = dict(softcap=3.0, alibi_slopes=slopes, causal=True, window=(60, 0))
    grads = attnlab.scaled_dot_product_attention_backward(g, q, k, v, sinks=sinks, mask=bias, **kw)
    out = attnlab.scaled_dot_product_attention(q, k, v, sinks=sinks, mask=bias, **kw)

    tq, tk, tv, ts, tb = (torch.tensor(a, requires_grad=True) for a in (q, k, v, sinks, bias))
    s = (tq @ tk.transpose(-1, -2)) / d**0.5
    s = 3.0 * torch.tanh(s / 3.0) + tb
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    s = s - torch.tensor(slopes)[:, None, None] * (i - j).abs()
    s = s.masked_fill(~((j <= i) & (j >= i - 60)), float("-inf"))
    full = torch.cat([s, ts[None, :, None, None].expand(B, h, n, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    to = p @ tv
    to.backward(torch.tensor(g))
    np.testing.assert_allclose(out, to.detach().numpy(), rtol=2e-5, atol=2e-5)
    for name, t in (("q", tq), ("k", tk), ("v", tv), ("sinks", ts), ("mask", tb)):
        assert_close(grads[name], t.grad.numpy().astype(np.float64), np.float32, f"torch {name}")


def test_vjp_returns_sinks_and_mask_gradients():
    rng = np.random.default_rng(37)
    q, k, v = (rng.standard_normal((1, 2, 7, 4)) for _ in range(3))
    sinks, bias = rng.standard_normal(2), rng.standard_normal((7, 7))
    g = rng.standard_normal((1, 2, 7, 4))
    kw = dict(sinks=sinks, mask=bias, softcap=2.0)
    _, pull = attnlab.vjp(attnlab.scaled_dot_product_attention, q, k, v, **kw)
    got = pull(g)
    ref = attnlab.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    assert set(got) == {"q", "k", "v", "sinks", "mask"}
    for name in got:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(softcap=0.0), ValueError, "softcap: expected a finite number > 0"),
        (dict(softcap=-1), ValueError, "softcap: expected a finite number > 0"),
        (dict(softcap="2"), TypeError, "softcap: expected a positive real number"),
        (dict(sinks=np.ones(3)), ValueError, r"sinks: expected shape \(h,\) = \(2,\)"),
        (dict(sinks=[np.nan, 0.0]), ValueError, "sinks: expected finite values"),
        (
            dict(alibi_slopes=np.ones((3, 2))),
            ValueError,
            "alibi_slopes: shape .* does not broadcast",
        ),
        (dict(alibi_slopes=[np.nan, 1.0]), ValueError, "alibi_slopes: expected finite values"),
        (dict(return_lse="yes"), (TypeError, ValueError), "return_lse"),
    ],
)
def test_logit_option_errors(kw, err, match):
    q = np.ones((1, 2, 3, 4))
    with pytest.raises(err, match=match):
        attnlab.scaled_dot_product_attention(q, q, q, **kw)


# --- merge_attention -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_attention_over_key_splits_equals_attention_over_all_keys(dtype):
    rng = np.random.default_rng(41)
    q = rng.standard_normal((2, 4, 5, 8)).astype(dtype)
    k = rng.standard_normal((2, 2, 13, 8)).astype(dtype)
    v = rng.standard_normal((2, 2, 13, 6)).astype(dtype)
    full, lse_full = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True)
    cuts = [0, 3, 4, 9, 13]
    parts = [
        attnlab.scaled_dot_product_attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
        for a, b in itertools.pairwise(cuts)
    ]
    out, lse = attnlab.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == dtype and lse.dtype == dtype
    assert_close(out, full, dtype, "merge")
    assert_close(lse, lse_full, dtype, "merge lse")
    # a part whose rows are all masked, and rows no part sees
    mask = np.ones((5, 13), bool)
    mask[:, 3:4] = False
    mask[0] = False
    kw = dict(mask=mask, return_lse=True, warn_empty_rows=False)
    full, lse_full = attnlab.scaled_dot_product_attention(q, k, v, **kw)
    parts = [
        attnlab.scaled_dot_product_attention(
            q, k[:, :, a:b], v[:, :, a:b], **{**kw, "mask": mask[:, a:b]}
        )
        for a, b in itertools.pairwise(cuts)
    ]
    out, lse = attnlab.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert np.all(out[..., 0, :] == 0) and np.all(np.isneginf(lse[..., 0]))
    assert_close(out, full, dtype, "merge masked")


def test_merge_attention_errors():
    o = np.zeros((2, 3, 4))
    s = np.zeros((2, 3))
    with pytest.raises(ValueError, match="same number"):
        attnlab.merge_attention([o, o], [s])
    with pytest.raises(ValueError, match=r"lses\[1\]: expected shape \(2, 3\)"):
        attnlab.merge_attention([o, o], [s, np.zeros((2, 4))])
    with pytest.raises(ValueError, match=r"outs\[1\]: expected shape"):
        attnlab.merge_attention([o, np.zeros((2, 3, 5))], [s, s])
    with pytest.raises(TypeError, match="sequences"):
        attnlab.merge_attention(o, s)


def test_torch_adapter_differentiates_sinks():
    torch = pytest.importorskip("torch")
    import attnlab.torch as at

    rng = np.random.default_rng(43)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    sinks = rng.standard_normal(2)
    g = rng.standard_normal((1, 2, 6, 4))
    tq, ts = torch.tensor(q, requires_grad=True), torch.tensor(sinks, requires_grad=True)
    out = at.scaled_dot_product_attention(
        tq, torch.tensor(k), torch.tensor(v), sinks=ts, softcap=2.0
    )
    out.backward(torch.tensor(g))
    ref = attnlab.scaled_dot_product_attention_backward(g, q, k, v, sinks=sinks, softcap=2.0)
    np.testing.assert_allclose(ts.grad.numpy(), ref["sinks"], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(tq.grad.numpy(), ref["q"], rtol=1e-12, atol=1e-13)


def test_window_and_softcap_match_torch_flex_attention():
    """FlexAttention's score_mod (soft cap) and block_mask (causal band) on the CPU."""
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    rng = np.random.default_rng(47)
    B, H, n, d, left, cap = 1, 2, 300, 16, 40, 2.0
    q, k, v = (rng.standard_normal((B, H, n, d)) for _ in range(3))

    def score_mod(s, b, h, qi, kj):  # noqa: ARG001 (FlexAttention's signature)
        return cap * torch.tanh(s / cap)

    def mask_mod(b, h, qi, kj):  # noqa: ARG001 (FlexAttention's signature)
        return (kj <= qi) & (kj >= qi - left)

    block_mask = flex.create_block_mask(mask_mod, B, H, n, n, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention warns that it is not compiled
        want = flex.flex_attention(
            *(torch.tensor(a) for a in (q, k, v)), score_mod=score_mod, block_mask=block_mask
        )
    got = attnlab.scaled_dot_product_attention(q, k, v, softcap=cap, window=(left, 0), causal=True)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_layers_take_the_logit_options_per_call():
    layer = attnlab.layers.MultiHeadAttention(8, num_heads=2, seed=0)
    x = np.random.default_rng(0).standard_normal((2, 12, 8))
    kw = dict(window=(3, 0), causal=True, softcap=2.0, sinks=[0.5, -0.5], alibi_slopes=[0.1, 0.2])
    out = layer(x, **kw)
    ref = reference.multi_head_attention(x, **layer.params, num_heads=2, **kw)
    assert_close(out, ref, np.float64, "logit options layer")
    dx = layer.backward(np.ones_like(out))
    assert dx.shape == x.shape and set(layer.grads) == set(layer.params)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_padded_batch_prefill_reads_no_padding(dtype):
    """A batch of sequences of different lengths padded to one n with NaN and Inf in the keys
    and values past each length, masked by a boolean or additive (-inf) key mask: every query
    row equals the float64 reference on its element's own keys (key tiles that only padding
    fills are skipped whole; a length may end inside a tile)."""
    rng = np.random.default_rng(13)
    lengths, h, n, d = (1000, 300, 257, 1), 2, 1000, 32
    B = len(lengths)
    q, k, v = (rng.standard_normal((B, h, n, d)).astype(dtype) for _ in range(3))
    pad = np.arange(n)[None, :] < np.array(lengths)[:, None]
    for b, m in enumerate(lengths):
        k[b, :, m:] = np.inf
        v[b, :, m:] = np.nan
    additive = np.where(pad, 0.0, -np.inf).astype(dtype)
    for mask in (pad, additive):
        out = attnlab.scaled_dot_product_attention(q, k, v, mask=mask[:, None, None, :])
        assert out.dtype == dtype and np.isfinite(out).all()
        for b, m in enumerate(lengths):
            ref = reference.scaled_dot_product_attention(
                *(x[b : b + 1].astype(np.float64) for x in (q, k[:, :, :m], v[:, :, :m]))
            )
            assert_close(out[b : b + 1], ref, dtype, f"padded element {b}")
