"""Layers: parameters, forward against the functional API, backward bookkeeping, state dicts.

Gradients against finite differences are in test_training.py. A family whose functional
backward is not in this build yet has its backward tests skipped (they start running as soon as
``attnlab.<family>_backward`` exists).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab import init as ainit
from attnlab.layers import (
    AdditiveAttention,
    BilinearAttention,
    MultiHeadAttention,
    SeparableAttention,
)

BACKWARD = {
    MultiHeadAttention: "multi_head_attention_backward",
    BilinearAttention: "bilinear_attention_backward",
    AdditiveAttention: "additive_attention_backward",
    SeparableAttention: "separable_attention_backward",
}


def backward_fn(cls: type):
    """``attnlab.<family>_backward`` of the layer's family."""
    return getattr(attnlab, BACKWARD[cls])


def same(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal up to rounding: the kernels are not yet bitwise reproducible from call to call
    (MHA forward/backward and separable forward differ by ~1 ulp between identical calls), so
    "the layer passes the same arguments as the functional call" is checked to 1e-12."""
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)


def rand(rng: np.random.Generator, *shape: int, dtype=np.float64) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


# --- multi-head attention ---------------------------------------------------------------------


@pytest.mark.empty_rows
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(d_model=12, num_heads=3),
        dict(d_model=12, num_heads=4, num_kv_heads=2, d_head=5, kdim=7, vdim=9, d_out=6),
        dict(d_model=8, num_heads=2, num_kv_heads=1),
    ],
)
def test_mha_params_and_forward(cfg: dict, bias: bool) -> None:
    layer = MultiHeadAttention(**cfg, bias=bias, seed=0)
    d = cfg["d_model"]
    h = cfg["num_heads"]
    h_kv = cfg.get("num_kv_heads", h)
    dh = cfg.get("d_head", d // h)
    kdim = cfg.get("kdim", d)
    vdim = cfg.get("vdim", kdim)
    d_out = cfg.get("d_out", d)
    shapes = {
        "w_q": (d, h * dh),
        "w_k": (kdim, h_kv * dh),
        "w_v": (vdim, h_kv * dh),
        "w_o": (h * dh, d_out),
    }
    if bias:
        shapes.update(b_q=(h * dh,), b_k=(h_kv * dh,), b_v=(h_kv * dh,), b_o=(d_out,))
    assert {k: v.shape for k, v in layer.params.items()} == shapes
    assert layer.num_parameters == sum(int(np.prod(s)) for s in shapes.values())
    assert layer.scale == 1 / np.sqrt(dh)

    rng = np.random.default_rng(1)
    q = rand(rng, 2, 5, d)
    k = rand(rng, 2, 4, kdim)
    v = rand(rng, 2, 4, vdim)
    mask = rng.random((5, 4)) > 0.3
    got = layer(q, k, v, mask=mask)
    ref = attnlab.multi_head_attention(
        q, k, v, **layer.params, num_heads=h, num_kv_heads=h_kv, mask=mask
    )
    same(got, ref)
    out, w = layer(q, k, v, causal=True, return_weights=True)
    assert out.shape == (2, 5, d_out) and w.shape == (2, h, 5, 4)


def test_mha_seed_and_init() -> None:
    a = MultiHeadAttention(16, 4, seed=3)
    b = MultiHeadAttention(16, 4, seed=3)
    c = MultiHeadAttention(16, 4, seed=4)
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    assert not np.array_equal(a.params["w_q"], c.params["w_q"])
    # the scheme's draws, in the documented order: w_q, b_q, w_k, ...
    rng = np.random.default_rng(3)
    np.testing.assert_array_equal(a.params["w_q"], ainit.torch_default(16, 16, rng, np.float64))
    np.testing.assert_array_equal(
        a.params["b_q"], ainit.torch_default_bias(16, 16, rng, np.float64)
    )
    r = MultiHeadAttention(64, 4, init="randn", seed=0)
    assert 0.9 < r.params["w_q"].std() < 1.1 and not r.params["b_q"].any()
    t = MultiHeadAttention(64, 4, init="trunc_normal", seed=0)
    assert np.abs(t.params["w_o"]).max() <= 0.04
    x = MultiHeadAttention(64, 4, init=ainit.xavier_uniform, seed=0)
    assert x.init.name == "xavier_uniform"
    assert np.abs(x.params["w_q"]).max() <= np.sqrt(6 / 128)
    f = MultiHeadAttention(8, 2, seed=0, dtype=np.float32)
    assert all(p.dtype == np.float32 for p in f.params.values())
    assert f(np.ones((3, 8), np.float32)).dtype == np.float32
    assert "MultiHeadAttention(" in repr(f) and "float32" in repr(f)


def test_mha_constructor_errors() -> None:
    with pytest.raises(ValueError, match="num_heads: 3 does not divide d_model = 8; pass d_head"):
        MultiHeadAttention(8, 3)
    with pytest.raises(ValueError, match="num_kv_heads: expected a divisor of num_heads = 4"):
        MultiHeadAttention(8, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match="d_model: expected an integer"):
        MultiHeadAttention(8.0, 2)
    with pytest.raises(ValueError, match="d_head: expected an integer >= 1, got 0"):
        MultiHeadAttention(8, 2, d_head=0)
    with pytest.raises(TypeError, match="dtype: expected float32 or float64, got int32"):
        MultiHeadAttention(8, 2, dtype=np.int32)
    with pytest.raises(ValueError, match="init: expected one of"):
        MultiHeadAttention(8, 2, init="he")
    with pytest.raises(TypeError, match="bias: expected True or False"):
        MultiHeadAttention(8, 2, bias=1)
    with pytest.raises(ValueError, match="init: the weight initialiser returned shape"):
        MultiHeadAttention(
            8,
            2,
            init=lambda fi, fo, _rng, _dt: (
                np.zeros((fo, fi)) if fi != fo else np.zeros((fi, fo + 1))
            ),
        )


def test_mha_backward_matches_functional_and_return_types() -> None:
    rng = np.random.default_rng(2)
    layer = MultiHeadAttention(8, 2, kdim=6, vdim=5, seed=0)
    q, k, v = rand(rng, 3, 4, 8), rand(rng, 3, 7, 6), rand(rng, 3, 7, 5)
    go = rand(rng, 3, 4, 8)
    layer(q, k, v, causal="bottom_right")
    dq, dk, dv = layer.backward(go)
    ref = attnlab.multi_head_attention_backward(
        go, q, k, v, **layer.params, num_heads=2, causal="bottom_right"
    )
    for name, g in (("query", dq), ("key", dk), ("value", dv)):
        same(g, ref[name])
    for name in layer.params:
        same(layer.grads[name], ref[name])
    assert set(layer.grads) == set(layer.params)

    self_layer = MultiHeadAttention(8, 2, seed=0)
    x = rand(rng, 3, 4, 8)
    self_layer(x)
    dx = self_layer.backward(go)
    assert isinstance(dx, np.ndarray) and dx.shape == x.shape
    # the same array passed as query and key still gets one gradient per argument, and their
    # sum is the self-attention gradient
    self_layer(x, x)
    d1, d2 = self_layer.backward(go)
    np.testing.assert_allclose(d1 + d2, dx, rtol=1e-12, atol=1e-12)
    self_layer(x, x, x)
    assert len(self_layer.backward(go)) == 3
    self_layer(x, value=x)  # key defaults to query: (d_query, d_value)
    dq2, dv2 = self_layer.backward(go)
    assert dq2.shape == dv2.shape == x.shape


def test_backward_uses_parameters_of_the_call() -> None:
    rng = np.random.default_rng(3)
    layer = MultiHeadAttention(8, 2, seed=0)
    x = rand(rng, 2, 5, 8)
    go = rand(rng, 2, 5, 8)
    layer(x)
    g_before = layer.backward(go)
    layer(x)
    layer.params["w_q"] += 1.0  # an optimiser stepping between forward and backward
    same(layer.backward(go), g_before)


def test_grads_accumulate_and_zero() -> None:
    rng = np.random.default_rng(4)
    layer = MultiHeadAttention(8, 2, seed=0)
    x, go = rand(rng, 2, 5, 8), rand(rng, 2, 5, 8)
    with pytest.raises(RuntimeError, match="call the layer first"):
        layer.backward(go)
    layer(x)
    layer.backward(go)
    once = {k: v.copy() for k, v in layer.grads.items()}
    layer.backward(go, accumulate=True)
    for k in once:
        same(layer.grads[k], 2 * once[k])
    layer.backward(go)
    for k in once:
        same(layer.grads[k], once[k])
    layer.zero_grad()
    assert set(layer.grads) == set(layer.params)
    assert not any(g.any() for g in layer.grads.values())
    with pytest.raises(ValueError, match="grad_out: expected the output's shape"):
        layer.backward(np.ones((2, 5, 7)))


def test_state_dict_round_trip_and_errors() -> None:
    a = MultiHeadAttention(8, 2, seed=0)
    b = MultiHeadAttention(8, 2, seed=1)
    sd = a.state_dict()
    sd["w_q"][0, 0] = 123.0  # a copy: the layer is unchanged
    assert a.params["w_q"][0, 0] != 123.0
    ids = {k: id(v) for k, v in b.params.items()}
    b.load_state_dict(a.state_dict())
    assert {k: id(v) for k, v in b.params.items()} == ids  # in place
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    same(a(x), b(x))
    b.load_state_dict({k: v.astype(np.float32) for k, v in a.params.items()})
    assert b.params["w_q"].dtype == np.float64

    before = b.state_dict()
    bad = a.state_dict()
    del bad["b_o"]
    bad["extra"] = np.zeros(3)
    with pytest.raises(KeyError, match=r"missing \['b_o'\], unexpected \['extra'\]"):
        b.load_state_dict(bad)
    bad = a.state_dict()
    bad["w_q"] = np.ones((8, 8))  # fine
    bad["w_o"] = np.ones((8, 4))
    with pytest.raises(ValueError, match=r"state\['w_o'\]: expected shape \(8, 8\), got \(8, 4\)"):
        b.load_state_dict(bad)
    for k in before:  # nothing was written by a failed load
        np.testing.assert_array_equal(b.params[k], before[k])
    with pytest.raises(TypeError, match="state: expected a mapping"):
        b.load_state_dict([1, 2])
    with pytest.raises(TypeError, match=r"state\['w_q'\]: expected real floating-point data"):
        b.load_state_dict({**a.state_dict(), "w_q": np.full((8, 8), "a")})
    nb = MultiHeadAttention(8, 2, bias=False, seed=0)
    with pytest.raises(KeyError, match="unexpected"):
        nb.load_state_dict(a.state_dict())


# --- bilinear ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(d_model=12, num_heads=3),
        dict(d_model=12, num_heads=4, num_kv_heads=2, d_head=5, kdim=7, vdim=9, d_out=6),
    ],
)
def test_bilinear_from_mha_is_exact(cfg: dict, bias: bool) -> None:
    mha = MultiHeadAttention(**cfg, bias=bias, seed=5)
    bil = BilinearAttention.from_mha(mha)
    h, d = cfg["num_heads"], cfg["d_model"]
    kdim = cfg.get("kdim", d)
    names = (
        ["w_qk"]
        + (["u_k"] if bias else [])
        + ["w_v"]
        + (["b_v"] if bias else [])
        + ["w_o"]
        + (["b_o"] if bias else [])
    )
    assert list(bil.params) == names
    assert bil.params["w_qk"].shape == (h, d, kdim)
    assert bil.scale == mha.scale
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, 2, 5, d), rand(rng, 2, 4, kdim), rand(rng, 2, 4, cfg.get("vdim", kdim))
    kp = np.array([[True, True, False, True], [True] * 4])
    np.testing.assert_allclose(
        bil(q, k, v, key_padding_mask=kp), mha(q, k, v, key_padding_mask=kp), rtol=0, atol=1e-12
    )
    # owns its parameters
    bil.params["w_v"] += 1
    assert not np.array_equal(bil.params["w_v"], mha.params["w_v"])
    # a fresh layer is the fold of the multi-head layer drawn with the same arguments
    fresh = BilinearAttention(**cfg, bias=bias, seed=5)
    np.testing.assert_allclose(fresh(q, k, v), mha(q, k, v), rtol=0, atol=1e-12)


def test_bilinear_from_mha_errors() -> None:
    with pytest.raises(TypeError, match="layer: expected a MultiHeadAttention, got"):
        BilinearAttention.from_mha(SeparableAttention(4))


def test_bilinear_backward() -> None:
    rng = np.random.default_rng(7)
    layer = BilinearAttention(8, 2, seed=0)
    x, go = rand(rng, 2, 5, 8), rand(rng, 2, 5, 8)
    layer(x, causal=True)
    dx = layer.backward(go)
    ref = backward_fn(BilinearAttention)(
        go, x, **layer.params, num_heads=2, scale=layer.scale, causal=True
    )
    same(dx, ref["query"])
    assert set(layer.grads) == set(layer.params)


# --- additive and separable -------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["official", "hf"])
@pytest.mark.parametrize("bias", [True, False])
def test_additive_params_and_forward(variant: str, bias: bool) -> None:
    layer = AdditiveAttention(6, d_hidden=10, d_out=4, variant=variant, bias=bias, seed=0)
    shapes = {
        "w_q": (6, 10),
        "b_q": (10,),
        "w_k": (6, 10),
        "b_k": (10,),
        "w_g": (10,),
        "w_proj": (10, 10),
        "b_proj": (10,),
        "w_final": (10, 4),
        "b_final": (4,),
    }
    if not bias:
        shapes = {k: s for k, s in shapes.items() if not k.startswith("b_")}
    assert {k: v.shape for k, v in layer.params.items()} == shapes
    assert layer.num_parameters == sum(int(np.prod(s)) for s in shapes.values())
    x = rand(np.random.default_rng(8), 3, 7, 6)
    kp = np.ones((3, 7), bool)
    kp[0, 5:] = False
    ref = attnlab.additive_attention(x, **layer.params, variant=variant, key_padding_mask=kp)
    same(layer(x, key_padding_mask=kp), ref)
    with pytest.raises(ValueError, match="variant: expected 'official' or 'hf'"):
        AdditiveAttention(6, variant="timm")


def test_separable_params_and_forward() -> None:
    layer = SeparableAttention(6, d_out=5, seed=0)
    assert {k: v.shape for k, v in layer.params.items()} == {
        "w_qkv": (6, 13),
        "b_qkv": (13,),
        "w_o": (6, 5),
        "b_o": (5,),
    }
    x = rand(np.random.default_rng(9), 2, 3, 7, 6)
    same(layer(x), attnlab.separable_attention(x, **layer.params))
    assert list(SeparableAttention(4, bias=False).params) == ["w_qkv", "w_o"]


@pytest.mark.parametrize("cls", [AdditiveAttention, SeparableAttention])
def test_token_layers_backward(cls: type) -> None:
    rng = np.random.default_rng(10)
    layer = cls(6, seed=0)
    x = rand(rng, 2, 7, 6)
    y = layer(x)
    go = rand(rng, *y.shape)
    dx = layer.backward(go)
    assert isinstance(dx, np.ndarray) and dx.shape == x.shape
    assert set(layer.grads) == set(layer.params)
    assert all(layer.grads[k].shape == p.shape for k, p in layer.params.items())
