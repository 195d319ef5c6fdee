"""attnlab.diagnostics against closed forms: entropy of uniform and one-hot rows, logit moments,
effective rank of matrices with known spectra, the softmax Jacobian's norms, and error cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnlab
from attnlab import diagnostics as D


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _jacobian(p: np.ndarray) -> np.ndarray:
    return np.diag(p) - np.outer(p, p)


# -- attention_entropy ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_entropy_uniform_is_log_n(n):
    w = np.full((3, 2, n), 1.0 / n)
    h = D.attention_entropy(w)
    assert h.shape == (3, 2)
    np.testing.assert_allclose(h, math.log(n), rtol=0, atol=1e-12)
    hn = D.attention_entropy(w, normalize=True)
    np.testing.assert_allclose(hn, 1.0 if n > 1 else 0.0, rtol=0, atol=1e-12)


def test_entropy_one_hot_is_zero():
    w = np.eye(5)[[0, 3, 4]]
    assert np.array_equal(D.attention_entropy(w), np.zeros(3))
    assert np.array_equal(D.attention_entropy(w, normalize=True), np.zeros(3))


def test_entropy_matches_definition(rng):
    p = _softmax(rng.standard_normal((4, 6, 9)) * 2)
    ref = -(p * np.log(p)).sum(axis=-1)
    np.testing.assert_allclose(D.attention_entropy(p), ref, rtol=1e-12)
    np.testing.assert_allclose(
        D.attention_entropy(p, normalize=True), ref / math.log(9), rtol=1e-12
    )


def test_entropy_two_point_closed_form():
    a = np.linspace(0.01, 0.99, 17)
    w = np.stack([a, 1 - a], axis=-1)
    ref = -(a * np.log(a) + (1 - a) * np.log(1 - a))
    np.testing.assert_allclose(D.attention_entropy(w), ref, rtol=1e-12)


def test_entropy_mask_ignores_masked_keys_and_counts_allowed():
    # uniform over the 3 allowed keys; masked keys hold garbage that must be ignored
    w = np.array([[1 / 3, 0.9, 1 / 3, 1 / 3, 0.5]])
    mask = np.array([True, False, True, True, False])
    np.testing.assert_allclose(D.attention_entropy(w, mask), math.log(3), atol=1e-12)
    np.testing.assert_allclose(D.attention_entropy(w, mask, normalize=True), 1.0, atol=1e-12)


def test_entropy_mask_broadcasts_and_fully_masked_rows_give_zero():
    w = np.full((2, 3, 4), 0.25)
    mask = np.array([[True, True, True, True], [False] * 4, [True, False, False, False]])
    h = D.attention_entropy(w, mask)  # mask (3, 4) broadcasts to (2, 3, 4)
    np.testing.assert_allclose(h, np.broadcast_to([math.log(4), 0.0, 0.0], (2, 3)), atol=1e-12)
    hn = D.attention_entropy(w, mask, normalize=True)
    assert np.all(np.isfinite(hn))
    np.testing.assert_allclose(hn, np.broadcast_to([1.0, 0.0, 0.0], (2, 3)), atol=1e-12)


def test_entropy_renormalises_rows_and_zero_rows_give_zero():
    np.testing.assert_allclose(D.attention_entropy([[2.0, 2.0]]), [math.log(2)], atol=1e-12)
    assert D.attention_entropy(np.zeros((2, 5))).tolist() == [0.0, 0.0]


def test_entropy_of_attnlab_weights(rng, mha_weights):
    """Causal weights: row i is spread over i + 1 keys, so normalised entropy stays in [0, 1]."""
    x = rng.standard_normal((2, 6, 8))
    _, w = attnlab.multi_head_attention(
        x, **mha_weights(rng, 8, 2, 4), num_heads=2, causal=True, return_weights=True
    )
    causal = np.tril(np.ones((6, 6), dtype=bool))
    h = D.attention_entropy(w, causal, normalize=True)
    assert h.shape == (2, 2, 6)
    assert np.all((h >= 0) & (h <= 1 + 1e-12))
    assert np.all(h[..., 0] == 0)  # the first query sees one key
    np.testing.assert_allclose(D.attention_entropy(w, causal), D.attention_entropy(w), atol=1e-12)


def test_entropy_dtypes_and_nan():
    w = np.full((2, 4), 0.25, dtype=np.float32)
    assert D.attention_entropy(w).dtype == np.float32
    assert D.attention_entropy(np.full((2, 4), 1, dtype=np.int64)).dtype == np.float64
    h = D.attention_entropy([[np.nan, 0.5], [0.5, 0.5]])
    assert np.isnan(h[0]) and h[1] == pytest.approx(math.log(2))
    assert D.attention_entropy(np.zeros((3, 0))).shape == (3,)


# -- logit_stats ----------------------------------------------------------------------------


def test_logit_stats_against_direct_computation(rng):
    q = rng.standard_normal((2, 3, 5, 8))
    k = rng.standard_normal((2, 3, 7, 8))
    s = D.logit_stats(q, k)
    z = q @ np.swapaxes(k, -1, -2) / math.sqrt(8)
    assert s["mean"] == pytest.approx(z.mean(), abs=1e-12)
    assert s["std"] == pytest.approx(z.std(), rel=1e-12)
    assert s["max_abs"] == pytest.approx(np.abs(z).max(), rel=1e-12)
    assert s["row_std"] == pytest.approx(math.sqrt(np.mean(z.var(axis=-1))), rel=1e-12)
    assert s["count"] == z.size
    s2 = D.logit_stats(q, k, scale=2.0)
    assert s2["std"] == pytest.approx(2 * math.sqrt(8) * s["std"], rel=1e-12)


def test_logit_stats_variance_closed_form():
    """Independent N(0, 1) q and k in d dims: logits scaled by 1/sqrt(d) have variance 1."""
    g = np.random.default_rng(7)
    s = D.logit_stats(g.standard_normal((64, 256, 32)), g.standard_normal((64, 256, 32)))
    assert s["std"] == pytest.approx(1.0, abs=0.02)
    assert abs(s["mean"]) < 0.02


def test_logit_stats_mask_and_broadcast():
    q = np.eye(3)
    s = D.logit_stats(q, q[None], scale=1.0, mask=np.eye(3, dtype=bool))
    assert (s["mean"], s["std"], s["max_abs"], s["count"]) == (1.0, 0.0, 1.0, 3.0)
    assert s["row_std"] == 0.0
    empty = D.logit_stats(q, q, mask=np.zeros((3, 3), dtype=bool))
    assert empty["count"] == 0 and math.isnan(empty["std"])


# -- effective_rank -------------------------------------------------------------------------


@pytest.mark.parametrize("r", [1, 2, 5, 8])
def test_effective_rank_equal_singular_values_is_rank(rng, r):
    u, _ = np.linalg.qr(rng.standard_normal((12, 12)))
    v, _ = np.linalg.qr(rng.standard_normal((9, 9)))
    a = (u[:, :r] * 3.0) @ v[:, :r].T
    assert D.effective_rank(a) == pytest.approx(r, rel=1e-10)


@pytest.mark.parametrize("r", [1, 3, 6])
def test_effective_rank_between_one_and_rank(rng, r):
    a = rng.standard_normal((10, r)) @ rng.standard_normal((r, 15))
    e = D.effective_rank(a)
    assert 1.0 - 1e-12 <= e <= r + 1e-9
    sv = np.linalg.svd(a, compute_uv=False)
    p = sv / sv.sum()
    p = p[p > 0]
    assert e == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-12)


def test_effective_rank_closed_form_two_values_and_stack():
    # singular values (2, 1): p = (2/3, 1/3), erank = exp(H(p))
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    stack = np.stack([np.diag([2.0, 1.0]), np.diag([1.0, 1.0]), np.zeros((2, 2))])
    e = D.effective_rank(stack)
    assert isinstance(e, np.ndarray) and e.shape == (3,)
    np.testing.assert_allclose(e, [math.exp(h), 2.0, 0.0], rtol=1e-12)
    assert isinstance(D.effective_rank(np.eye(3)), float)
    assert D.effective_rank(np.zeros((4, 0))) == 0.0


def test_effective_rank_of_folded_weights(rng):
    """A folded W_i = W_q,i W_k,i^T has rank <= d_head, so its effective rank is <= d_head."""
    qk = attnlab.collapse_qk(
        rng.standard_normal((16, 8)), rng.standard_normal((16, 8)), num_heads=2
    )
    e = D.effective_rank(qk.w)
    assert e.shape == (2,) and np.all(e <= 4 + 1e-9) and np.all(e >= 1)


# -- softmax_jacobian_norm ------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 32])
def test_jacobian_norm_uniform(n):
    z = np.zeros((3, n))
    np.testing.assert_allclose(D.softmax_jacobian_norm(z), math.sqrt(n - 1) / n, atol=1e-15)
    np.testing.assert_allclose(
        D.softmax_jacobian_norm(z, ord=2), 1.0 / n if n > 1 else 0.0, atol=1e-15
    )


def test_jacobian_norm_two_keys_closed_form():
    # p = (a, 1 - a): J = a (1 - a) [[1, -1], [-1, 1]], both norms 2 a (1 - a)
    t = np.linspace(-6, 6, 25)
    a = 1 / (1 + np.exp(-t))
    z = np.stack([t, np.zeros_like(t)], axis=-1)
    np.testing.assert_allclose(D.softmax_jacobian_norm(z), 2 * a * (1 - a), rtol=1e-12)
    np.testing.assert_allclose(D.softmax_jacobian_norm(z, ord=2), 2 * a * (1 - a), rtol=1e-12)


def test_jacobian_norm_matches_explicit_matrix(rng):
    z = rng.standard_normal((4, 7)) * 3
    fro = D.softmax_jacobian_norm(z)
    two = D.softmax_jacobian_norm(z, ord=2)
    for i, row in enumerate(_softmax(z)):
        j = _jacobian(row)
        assert fro[i] == pytest.approx(np.linalg.norm(j, "fro"), rel=1e-12)
        assert two[i] == pytest.approx(np.linalg.norm(j, 2), rel=1e-10)


def test_jacobian_norm_saturated_rows_are_accurate():
    """p = (1 - eps, eps): ||J||_F = 2 eps (1 - eps) even when eps is far below rounding."""
    for eps in (1e-3, 1e-9, 1e-40, 1e-200):
        z = np.array([0.0, math.log(eps) - math.log1p(-eps)])
        assert D.softmax_jacobian_norm(z) == pytest.approx(2 * eps * (1 - eps), rel=1e-9)
        assert D.softmax_jacobian_norm(z, ord=2) == pytest.approx(2 * eps * (1 - eps), rel=1e-9)
    big = D.softmax_jacobian_norm(np.array([[1e4, 0.0, -1e4], [1e4, 1e4, 0.0]]))
    assert np.all(np.isfinite(big))
    assert big[0] == 0.0 and big[1] == pytest.approx(0.5)


def test_jacobian_norm_masks():
    z = np.array([[0.0, 5.0, 0.0, 0.0]])
    keep = np.array([True, False, True, True])
    np.testing.assert_allclose(D.softmax_jacobian_norm(z, keep), math.sqrt(2) / 3, atol=1e-15)
    additive = np.where(keep, 0.0, -np.inf)
    np.testing.assert_allclose(D.softmax_jacobian_norm(z, additive), math.sqrt(2) / 3, atol=1e-15)
    assert D.softmax_jacobian_norm(z, np.zeros(4, dtype=bool)).tolist() == [0.0]
    assert D.softmax_jacobian_norm(np.full((2, 3), -np.inf)).tolist() == [0.0, 0.0]


def test_jacobian_norm_dtype_nan_empty():
    assert D.softmax_jacobian_norm(np.zeros((2, 3), np.float32)).dtype == np.float32
    assert np.isnan(D.softmax_jacobian_norm([np.nan, 1.0]))
    assert np.isnan(D.softmax_jacobian_norm([np.nan, 1.0], ord=2))
    assert D.softmax_jacobian_norm(np.zeros((2, 0))).tolist() == [0.0, 0.0]


def test_entropy_and_jacobian_fall_with_logit_scale(rng):
    """The notebook's claim in miniature: larger logits, lower entropy, smaller Jacobian."""
    z = rng.standard_normal((200, 64))
    hs = [float(D.attention_entropy(_softmax(c * z)).mean()) for c in (0.1, 1, 10, 100)]
    js = [float(D.softmax_jacobian_norm(c * z).mean()) for c in (1, 10, 100)]
    assert hs == sorted(hs, reverse=True) and hs[-1] < 0.1 * math.log(64)
    assert js == sorted(js, reverse=True)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: D.attention_entropy(None), TypeError, "^weights:"),
        (lambda: D.attention_entropy(np.ones(3, dtype=bool)), TypeError, "^weights:"),
        (lambda: D.attention_entropy(np.ones(3) * 1j), TypeError, "^weights:"),
        (lambda: D.attention_entropy(np.float64(0.5)), ValueError, "^weights:"),
        (lambda: D.attention_entropy([[0.5, -0.5]]), ValueError, "^weights: expected non-negative"),
        (
            lambda: D.attention_entropy(np.ones((2, 3)), mask=np.ones((2, 4), bool)),
            ValueError,
            "^mask:",
        ),
        (lambda: D.attention_entropy(np.ones((2, 3)), mask=np.ones((2, 3))), TypeError, "^mask:"),
        (lambda: D.attention_entropy(np.ones((2, 3)), normalize=1), TypeError, "^normalize:"),
        (lambda: D.logit_stats(np.ones(4), np.ones((3, 4))), ValueError, "^q:"),
        (lambda: D.logit_stats(np.ones((2, 4)), np.ones((3, 5))), ValueError, "^k:"),
        (
            lambda: D.logit_stats(np.ones((2, 2, 4)), np.ones((3, 3, 4))),
            ValueError,
            "^batch dimensions do not broadcast: q",
        ),
        (lambda: D.logit_stats(np.ones((2, 4)), np.ones((3, 4)), scale="x"), TypeError, "^scale:"),
        (
            lambda: D.logit_stats(np.ones((2, 4)), np.ones((3, 4)), scale=math.inf),
            ValueError,
            "^scale:",
        ),
        (
            lambda: D.logit_stats(np.ones((2, 4)), np.ones((3, 4)), mask=np.ones((2, 2), bool)),
            ValueError,
            "^mask:",
        ),
        (lambda: D.logit_stats(np.ones((2, 4)), "abc"), TypeError, "^k:"),
        (lambda: D.effective_rank(np.ones(3)), ValueError, "^matrix:"),
        (lambda: D.effective_rank(np.array([[1.0, np.nan]])), ValueError, "^matrix:"),
        (lambda: D.effective_rank([["a"]]), TypeError, "^matrix:"),
        (lambda: D.softmax_jacobian_norm(np.float64(1)), ValueError, "^logits:"),
        (lambda: D.softmax_jacobian_norm(np.ones(3), ord=1), ValueError, "^ord:"),
        (lambda: D.softmax_jacobian_norm(np.ones(3), ord=True), ValueError, "^ord:"),
        (
            lambda: D.softmax_jacobian_norm(np.ones(3), mask=np.ones(3, np.int64)),
            TypeError,
            "^mask:",
        ),
        (lambda: D.softmax_jacobian_norm(np.ones(3), mask=np.ones(4)), ValueError, "^mask:"),
        (lambda: D.softmax_jacobian_norm(np.ones(3), mask=np.ones(4, bool)), ValueError, "^mask:"),
        (lambda: D.softmax_jacobian_norm(np.ones(3, complex)), TypeError, "^logits:"),
    ],
)
def test_errors_name_the_argument(call, exc, words):
    """Each message starts with the argument it is about (``"k: ..."``, not just any "k")."""
    with pytest.raises(exc, match=words):
        call()


def test_masked_keys_are_ignored_even_when_negative():
    """The docstring's promise: masked keys do not count, whatever they hold."""
    got = D.attention_entropy([[0.5, -1.0, 0.5]], mask=[True, False, True])
    np.testing.assert_allclose(got, [math.log(2)])
    with pytest.raises(ValueError, match=r"^weights: expected non-negative"):
        D.attention_entropy([[0.5, -1.0, 0.5]], mask=[True, True, True])


@pytest.mark.parametrize("m", [2, 3, 10])
def test_saturated_jacobian_matches_the_documented_eps_factor(m):
    eps = 1e-9
    p = np.r_[1 - eps, np.full(m - 1, eps / (m - 1))]
    got = float(D.softmax_jacobian_norm(np.log(p)))
    np.testing.assert_allclose(got / eps, math.sqrt(1 + 3 / (m - 1)), rtol=1e-6)
    np.testing.assert_allclose(
        float(D.softmax_jacobian_norm([100.0, 0.0, 0.0])),
        math.sqrt(10) * math.exp(-100),
        rtol=1e-12,
    )


def test_torch_tensor_masks_are_accepted():
    torch = pytest.importorskip("torch")
    w = np.array([[0.5, 0.0, 0.5]])
    got = D.attention_entropy(w, mask=torch.tensor([True, False, True]), normalize=True)
    np.testing.assert_allclose(got, [1.0])
    z = np.zeros((1, 3))
    np.testing.assert_allclose(
        D.softmax_jacobian_norm(z, mask=torch.tensor([True, True, False])),
        D.softmax_jacobian_norm(z[:, :2]),
    )


def test_all_is_curated():
    assert sorted(D.__all__) == [
        "attention_entropy",
        "effective_rank",
        "logit_stats",
        "softmax_jacobian_norm",
    ]
    for name in D.__all__:
        assert callable(getattr(D, name)) and getattr(D, name).__doc__
