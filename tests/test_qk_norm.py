"""Per-head q/k RMSNorm (``q_norm``, ``k_norm``, ``norm_eps``) and scaled rotary embeddings
(``rope_inv_freq``, ``rope_scale``) in multi_head_attention: forward against the float64
reference (alone, together, with grouped-query heads, causal modes, masks, partial rotary),
gradients (``"q_norm"``, ``"k_norm"`` included) by finite differences in float64, through
attnlab.vjp and attnlab.torch against torch autograd over an eager composition, and the
errors."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab import reference
from conftest import assert_close, make_mha_weights
from test_backward_mha import numeric_grad, rel_err

DTYPES = [np.float64, np.float32]

CASES = [
    # batch, n_q, n_k, h, h_kv, d_head, causal, options, cross
    ((), 1, 1, 1, 1, 2, False, "qk", False),
    ((2,), 7, 7, 4, 2, 8, True, "qk", False),
    ((), 5, 9, 4, 4, 6, "bottom_right", "q", True),
    ((3,), 6, 6, 2, 1, 4, False, "k+rope", False),
    ((2,), 4, 6, 2, 2, 8, False, "qk+inv", True),
    ((2,), 70, 140, 4, 2, 16, "bottom_right", "qk+inv_partial", True),  # several tiles
    ((1,), 130, 130, 2, 2, 8, True, "inv", False),
]


def _case(rng, case, dtype, d_model=16):
    batch, n_q, n_k, h, h_kv, d_head, causal, opts, cross = case
    w = make_mha_weights(rng, d_model, h, d_head, num_kv_heads=h_kv, dtype=dtype)
    xq = rng.standard_normal(batch + (n_q, d_model)).astype(dtype)
    xk = rng.standard_normal(batch + (n_k, d_model)).astype(dtype) if cross else None
    kw: dict = dict(num_heads=h, num_kv_heads=h_kv, causal=causal, **w)
    if "q" in opts.split("+")[0]:
        kw["q_norm"] = (1 + 0.5 * rng.standard_normal(d_head)).astype(dtype)
    if "k" in opts.split("+")[0]:
        kw["k_norm"] = (1 + 0.5 * rng.standard_normal(d_head)).astype(dtype)
        kw["norm_eps"] = 1e-5
    if "rope" in opts:
        kw["rope_theta"] = 300.0
    if "inv" in opts:
        r = d_head // 2 if "partial" in opts else d_head
        kw["rope_inv_freq"] = 0.7 ** np.arange(r // 2)  # any frequencies, not theta's
        kw["rope_scale"] = 1.2
        kw["positions"] = rng.integers(0, 200, (n_k,))
    return xq, xk, kw


@pytest.mark.parametrize("mode", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference(rng, case, dtype, mode):
    xq, xk, kw = _case(rng, case, dtype)
    got = attnlab.multi_head_attention(xq, xk, return_weights=mode, **kw)
    ref = reference.multi_head_attention(xq, xk, return_weights=mode, **kw)
    if mode:
        assert_close(got[1], ref[1], dtype, "q/k norm weights")
        got, ref = got[0], ref[0]
    assert_close(got, ref, dtype, "q/k norm, scaled rope vs reference")
    plain = {
        k: v
        for k, v in kw.items()
        if k not in ("q_norm", "k_norm", "norm_eps", "rope_inv_freq", "rope_scale", "positions")
    }
    if case[1] > 1:  # the options change the result
        assert np.abs(reference.multi_head_attention(xq, xk, **plain) - ref).max() > 1e-3


def test_norm_is_per_head_rms_and_inv_freq_is_theta_default(rng):
    """q_norm is x / rms(x) * w per head (scaling a head's projection changes nothing);
    rope_inv_freq = theta ** (-2j / r) and rope_scale = 1 is rope_theta exactly."""
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((5, 8))
    kw = dict(num_heads=2, q_norm=np.ones(4), k_norm=np.ones(4), norm_eps=1e-300, **w)
    a = attnlab.multi_head_attention(x, **kw)
    per_head = np.repeat([3.0, 0.5], 4)
    scaled = {
        **kw,
        **{n: w[n] * per_head for n in ("w_q", "b_q")},
        **{n: w[n] * 7.0 for n in ("w_k", "b_k")},
    }
    np.testing.assert_allclose(attnlab.multi_head_attention(x, **scaled), a, rtol=1e-13)
    base = dict(num_heads=2, causal=True, positions=np.arange(3, 8), **w)
    inv = 100.0 ** (-np.arange(0, 4, 2) / 4)
    np.testing.assert_array_equal(
        attnlab.multi_head_attention(x, rope_theta=100.0, **base),
        attnlab.multi_head_attention(x, rope_inv_freq=inv, rope_scale=1.0, **base),
    )
    # rope_scale multiplies cos and sin: both q and k, so the logits by its square
    s = attnlab.multi_head_attention(x, rope_theta=100.0, rope_scale=2.0, **base)
    t = attnlab.multi_head_attention(x, rope_theta=100.0, scale=4 * 0.5, **base)
    np.testing.assert_allclose(s, t, rtol=1e-13)


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_masks(rng, dtype):
    B, n, h = 2, 9, 4
    w = make_mha_weights(rng, 16, h, 4, dtype=dtype)
    x = rng.standard_normal((B, n, 16)).astype(dtype)
    m = rng.random((B, 1, n, n)) > 0.3
    m[0, 0, 2] = False  # a fully masked row: output b_o
    kw = dict(num_heads=h, q_norm=rng.random(4) + 0.5, k_norm=rng.random(4) + 0.5, **w)
    for masks in ({"mask": m}, {"mask": rng.standard_normal((h, n, n))}):
        assert_close(
            attnlab.multi_head_attention(x, **masks, **kw),
            reference.multi_head_attention(x, **masks, **kw),
            dtype,
            "q/k norm with masks",
        )


GRAD_CASES = [
    ((2,), 5, 5, 4, 2, 4, True, "qk", False),
    ((), 3, 6, 2, 1, 4, "bottom_right", "q+inv", True),
    ((2,), 4, 4, 2, 2, 6, False, "k+rope", False),
    ((1,), 2, 3, 2, 2, 4, False, "qk+inv_partial", True),
    ((2,), 4, 4, 2, 2, 4, True, "inv", False),
]


@pytest.mark.parametrize("case", GRAD_CASES)
def test_backward_finite_differences(case):
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    xq, xk, kw = _case(rng, case, np.float64, d_model=8)
    G = rng.standard_normal(xq.shape[:-1] + (8,))
    grads = attnlab.multi_head_attention_backward(G, xq, xk, **kw)
    arrays = {
        "query": xq,
        **{k: v for k, v in kw.items() if k.startswith(("w_", "b_")) or k.endswith("_norm")},
    }
    if xk is not None:
        arrays["key"] = xk
    assert set(grads) == set(arrays)

    def loss():
        return float((attnlab.multi_head_attention(xq, xk, **kw) * G).sum())

    for name, x in arrays.items():
        assert grads[name].shape == x.shape
        assert rel_err(grads[name], numeric_grad(loss, x)) < 1e-6, name
    _, pullback = attnlab.vjp(attnlab.multi_head_attention, xq, xk, **kw)
    again = pullback(G)
    assert set(again) == set(grads)
    for name, g in grads.items():
        np.testing.assert_array_equal(again[name], g, err_msg=name)


try:
    import torch
except ImportError:
    torch = None


def _torch_eager(x, w, h, h_kv, q_norm, k_norm, eps, inv_freq, rope_scale, causal):
    """The same call written with torch operations (autograd differentiates it)."""
    B, n, _ = x.shape
    d = w["w_q"].shape[1] // h
    q = (x @ w["w_q"] + w["b_q"]).view(B, n, h, d)
    k = (x @ w["w_k"] + w["b_k"]).view(B, n, h_kv, d)
    v = (x @ w["w_v"] + w["b_v"]).view(B, n, h_kv, d)
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * q_norm
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm
    ang = torch.arange(n, dtype=x.dtype)[:, None] * inv_freq
    emb = torch.cat([ang, ang], -1)[:, None, :]
    cos, sin = emb.cos() * rope_scale, emb.sin() * rope_scale

    def rot(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    q, k = rot(q).transpose(1, 2), rot(k).transpose(1, 2)
    k = k.repeat_interleave(h // h_kv, 1)
    v = v.transpose(1, 2).repeat_interleave(h // h_kv, 1)
    s = q @ k.transpose(-1, -2) / d**0.5
    if causal:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    ctx = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, n, h * d)
    return ctx @ w["w_o"] + w["b_o"]


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64] if torch else [], ids=str)
def test_torch_adapter_matches_autograd(dtype):
    import attnlab.torch as at

    rng = np.random.default_rng(6)
    h, h_kv, d = 4, 2, 8
    w = {
        k: torch.tensor(v, dtype=dtype, requires_grad=True)
        for k, v in make_mha_weights(rng, 16, h, d, num_kv_heads=h_kv).items()
    }
    x = torch.tensor(rng.standard_normal((2, 9, 16)), dtype=dtype, requires_grad=True)
    qn = torch.tensor(1 + 0.3 * rng.standard_normal(d), dtype=dtype, requires_grad=True)
    kn = torch.tensor(1 + 0.3 * rng.standard_normal(d), dtype=dtype, requires_grad=True)
    inv = 0.6 ** np.arange(d // 2)
    G = torch.tensor(rng.standard_normal((2, 9, 16)), dtype=dtype)
    leaves = [x, qn, kn, *w.values()]
    out = at.multi_head_attention(
        x,
        num_heads=h,
        num_kv_heads=h_kv,
        causal=True,
        q_norm=qn,
        k_norm=kn,
        norm_eps=1e-5,
        rope_inv_freq=torch.tensor(inv),
        rope_scale=1.1,
        **w,
    )
    ours = torch.autograd.grad((out * G).sum(), leaves)
    ref = _torch_eager(x, w, h, h_kv, qn, kn, 1e-5, torch.tensor(inv, dtype=dtype), 1.1, True)
    theirs = torch.autograd.grad((ref * G).sum(), leaves)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    assert_close(out.detach().numpy(), ref.detach().numpy(), np_dtype, "torch eager", tol)
    for name, a, b in zip(["x", "q_norm", "k_norm", *w], ours, theirs, strict=True):
        assert_close(a.numpy(), b.numpy(), np_dtype, f"torch grad {name}", tol)


@pytest.mark.parametrize(
    "extra, exc, words",
    [
        (dict(q_norm=np.ones(3)), ValueError, r"q_norm: expected shape \(4,\)"),
        (dict(k_norm=np.ones((2, 4))), ValueError, r"k_norm: expected shape \(4,\)"),
        (dict(q_norm="a"), TypeError, "q_norm"),
        (dict(norm_eps=1e-5), ValueError, "norm_eps: given without q_norm or k_norm"),
        (dict(q_norm=np.ones(4), norm_eps=0.0), ValueError, "norm_eps: expected a finite"),
        (dict(q_norm=np.ones(4), norm_eps=True), TypeError, "norm_eps"),
        (dict(rope_scale=2.0), ValueError, "rope_scale: given without rope_theta or rope_inv"),
        (dict(rope_inv_freq=[1.0], rope_theta=10.0), ValueError, "rope_theta: got 10.0 with"),
        (dict(rope_inv_freq=[1.0, 2.0, 3.0]), ValueError, r"rope_inv_freq: expected shape"),
        (dict(rope_inv_freq=np.ones((1, 2))), ValueError, r"rope_inv_freq: expected shape"),
        (dict(rope_inv_freq=[np.nan]), ValueError, "rope_inv_freq: expected finite"),
        (dict(rope_inv_freq=[1.0], rope_dim=4), ValueError, "rope_dim: got 4, but"),
        (dict(rope_theta=10.0, rope_scale=-1.0), ValueError, "rope_scale: expected a finite"),
        (dict(rope_theta=10.0, rope_scale="2"), TypeError, "rope_scale"),
    ],
)
def test_errors(rng, extra, exc, words):
    w = make_mha_weights(rng, 8, 2, 4)
    x = rng.standard_normal((3, 8))
    with pytest.raises(exc, match=words):
        attnlab.multi_head_attention(x, num_heads=2, **w, **extra)
    with pytest.raises(exc, match=words):
        attnlab.multi_head_attention_backward(np.ones((3, 8)), x, num_heads=2, **w, **extra)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_norms_and_rotation_run_in_the_kernel(monkeypatch, precision):
    """Forward, backward and vjp normalise and rotate in the one C++ call, with float32 or
    bf16 products: NumPy's norms and rotation are never called; vjp keeps the projections and
    its pullback runs no forward (with bf16 products it recomputes, as documented)."""
    import attnlab._rope as rope

    rng = np.random.default_rng(11)
    xq, _, kw = _case(rng, ((2,), 5, 5, 4, 2, 8, True, "qk+rope", False), np.float32)
    kw["precision"] = precision

    def refuse(*_a, **_k):
        raise AssertionError("normalised or rotated in NumPy")

    for name in ("rms_norm", "rms_norm_backward", "rotate", "rotate_pairs"):
        monkeypatch.setattr(rope, name, refuse)
    g = rng.standard_normal(xq.shape).astype(np.float32)
    attnlab.multi_head_attention(xq, **kw)
    grads = attnlab.multi_head_attention_backward(g, xq, **kw)
    states = []
    real = attnlab._loader.core.mha_backward
    monkeypatch.setattr(
        attnlab._loader.core, "mha_backward", lambda *a: states.append(a[3]) or real(*a)
    )
    _, pullback = attnlab.vjp(attnlab.multi_head_attention, xq, **kw)
    pulled = pullback(g)
    assert len(states) == 1 and (states[0] is None) == (precision == "bf16")
    for name, value in grads.items():
        np.testing.assert_array_equal(pulled[name], value, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_norms_bitwise_for_any_thread_count(dtype):
    """The q/k norm weights' gradients are summed over row blocks of a fixed size, then over
    the blocks in order: forward and every gradient the same bits at 1 and 2 threads (150 rows
    and 95 key rows: several blocks, a partial last one)."""
    rng = np.random.default_rng(12)
    xq, xk, kw = _case(rng, ((2,), 75, 95, 4, 2, 8, False, "qk+inv_partial", True), dtype)
    kw["positions"] = rng.integers(0, 200, (2, 95))  # a table per batch entry
    g = rng.standard_normal(xq.shape).astype(dtype)
    before = attnlab.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            attnlab.set_num_threads(threads)
            out = attnlab.multi_head_attention(xq, xk, **kw)
            results.append((out, attnlab.multi_head_attention_backward(g, xq, xk, **kw)))
    finally:
        attnlab.set_num_threads(before)
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert set(results[0][1]) >= {"q_norm", "k_norm", "query", "key"}
    for name, value in results[0][1].items():
        np.testing.assert_array_equal(results[1][1][name], value, err_msg=name)


def test_norm_gradients_when_no_query_rows():
    """A call of no query rows still returns the norms' gradients (zeros), as the others."""
    rng = np.random.default_rng(13)
    xq, xk, kw = _case(rng, ((2,), 0, 4, 2, 2, 4, False, "qk", True), np.float64)
    grads = attnlab.multi_head_attention_backward(np.zeros(xq.shape), xq, xk, **kw)
    for name in ("q_norm", "k_norm", "w_q"):
        assert grads[name].shape == kw[name].shape and not grads[name].any(), name


def test_core_qk_args_refuse_what_does_not_fit():
    """core.QkArgs checked against the call's sizes in C++ (the public API checks them first):
    a ValueError or TypeError naming the field, never a crash."""
    import inspect

    from attnlab import _mha
    from attnlab._loader import core

    rng = np.random.default_rng(14)
    xq, _, kw = _case(rng, ((2,), 5, 5, 4, 2, 8, False, "", False), np.float32)
    params = inspect.signature(attnlab.multi_head_attention).parameters.values()
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    a = _mha._prepare_mha({**defaults, "query": xq, **kw}).core_args()
    out = np.empty((10, 16), np.float32)
    ok = dict(q_norm=None, k_norm=None, norm_eps=1e-6, rope_dim=8)
    tab = np.ones((1, 5, 4), np.float32)
    tables = dict(cos_q=tab, sin_q=tab, cos_k=tab, sin_k=tab)
    for bad, words in (
        (dict(ok, rope_dim=3, **tables), "rope_dim: expected an even number"),
        (dict(ok, rope_dim=10, **tables), "rope_dim: expected an even number"),
        (dict(ok, **dict(tables, cos_q=np.ones((1, 4, 4), np.float32))), "cos_q: shape"),
        (dict(ok, **dict(tables, sin_k=np.ones((3, 5, 4), np.float32))), "sin_k: shape"),
        (dict(ok, **dict(tables, cos_k=np.ones((3, 5, 4), np.float32))), "cos_k: expected"),
        (dict(ok, q_norm=np.ones(7, np.float32), **tables), "q_norm: shape"),
        (dict(ok, norm_eps=float("nan"), **tables), "norm_eps: expected a number >= 0"),
    ):
        with pytest.raises(ValueError, match=words):
            core.mha_forward(a, out, None, None, False, core.QkArgs(**bad))
    wrong = core.QkArgs(**ok, **dict(tables, cos_q=tab.astype(np.float64)))
    with pytest.raises(TypeError, match="cos_q: unexpected dtype"):
        core.mha_forward(a, out, None, None, False, wrong)
    with pytest.raises(TypeError, match=r"qk: expected core.QkArgs or None"):
        core.mha_forward(a, out, None, None, False, ok)
    grads = {"q_norm": np.empty(8, np.float32)}
    with pytest.raises(ValueError, match=r"grads\['q_norm'\]: the call has no q_norm"):
        core.mha_backward(np.ones((10, 16), np.float32), a, grads, None, None)
