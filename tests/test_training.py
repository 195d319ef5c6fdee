"""Training with NumPy alone: layer gradients against finite differences, Adam against its
closed form and against torch.optim.Adam, and a tiny copy task that must learn.

Finite differences: loss ``L = sum(out * R)`` for a fixed random ``R`` (so ``grad_out = R``),
central differences with step 1e-6 in float64 (truncation ~1e-12, rounding ~1e-10 relative);
the relative error ``||analytic - numeric|| / ||numeric||`` of every parameter and input must be
below 1e-6. The largest one measured is printed (``-s``).
"""

from __future__ import annotations

import importlib
import math
import time
from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab.layers import (
    AdditiveAttention,
    BilinearAttention,
    MultiHeadAttention,
    SeparableAttention,
)
from attnlab.optim import Adam

FD_STEP = 1e-6
FD_TOL = 1e-6
_WORST: dict[str, float] = {}

BACKWARD = {
    MultiHeadAttention: "multi_head_attention_backward",
    BilinearAttention: "bilinear_attention_backward",
    AdditiveAttention: "additive_attention_backward",
    SeparableAttention: "separable_attention_backward",
}


def backward_fn(cls: type):
    """``attnlab.<family>_backward``, or the same name in the forward's private module."""
    name = BACKWARD[cls]
    mod = importlib.import_module(cls._forward.__module__)
    return getattr(attnlab, name, None) or getattr(mod, name, None)


def need_backward(cls: type) -> None:
    if backward_fn(cls) is None:
        pytest.skip(
            f"attnlab.{BACKWARD[cls]} is not implemented yet: {cls.__name__}.backward needs it"
        )


def _numeric(f, a: np.ndarray) -> np.ndarray:
    """Central differences of the scalar ``f()`` with respect to ``a``, perturbed in place."""
    g = np.zeros_like(a)
    flat, gf = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + FD_STEP
        fp = f()
        flat[i] = old - FD_STEP
        fm = f()
        flat[i] = old
        gf[i] = (fp - fm) / (2 * FD_STEP)
    return g


def _rel(got: np.ndarray, ref: np.ndarray, floor: float) -> float:
    """``||got - ref|| / max(||ref||, floor)``: relative, except for a gradient that is zero in
    exact arithmetic (``b_k`` of multi-head attention cancels in the softmax), whose numeric
    estimate is pure rounding noise; that one is measured against ``floor``."""
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), floor))


def check_layer_gradients(
    label: str, layer: Any, inputs: list[np.ndarray], call: dict[str, Any]
) -> None:
    rng = np.random.default_rng(99)
    out = layer(*inputs, **call)
    R = rng.standard_normal(out.shape)
    dins = layer.backward(R)
    dins = dins if isinstance(dins, tuple) else (dins,)
    assert len(dins) == len(inputs)
    analytic = dict(layer.grads)

    def loss() -> float:
        return float(np.sum(layer(*inputs, **call) * R))

    numeric = {name: _numeric(loss, p) for name, p in layer.params.items()}
    numeric_in = [_numeric(loss, x) for x in inputs]
    # 1e-3 of the norm of the whole gradient: far above the noise of a zero gradient's estimate
    floor = 1e-3 * math.sqrt(sum(float(np.sum(g * g)) for g in [*numeric.values(), *numeric_in]))
    worst = 0.0
    for name in layer.params:
        e = _rel(analytic[name], numeric[name], floor)
        assert e < FD_TOL, (label, name, e)
        worst = max(worst, e)
    for i, (dx, num) in enumerate(zip(dins, numeric_in, strict=True)):
        e = _rel(dx, num, floor)
        assert e < FD_TOL, (label, f"input {i}", e)
        worst = max(worst, e)
    _WORST[label] = worst
    print(f"{label}: largest relative gradient error {worst:.2e}")


def _x(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def test_mha_layer_gradients_self_attention() -> None:
    rng = np.random.default_rng(0)
    layer = MultiHeadAttention(6, 2, seed=0)
    check_layer_gradients("mha self causal", layer, [_x(rng, 2, 5, 6)], {"causal": True})


def test_mha_layer_gradients_cross_gqa_masks_no_bias() -> None:
    rng = np.random.default_rng(1)
    layer = MultiHeadAttention(
        6, 4, num_kv_heads=2, d_head=3, kdim=5, vdim=4, d_out=3, bias=False, seed=1
    )
    mask = rng.random((4, 1, 6)) > 0.3  # per-head pattern broadcast over queries
    kp = np.ones((2, 6), bool)
    kp[1, :2] = False
    check_layer_gradients(
        "mha cross gqa masked",
        layer,
        [_x(rng, 2, 4, 6), _x(rng, 2, 6, 5), _x(rng, 2, 6, 4)],
        {"mask": mask, "key_padding_mask": kp},
    )


def test_bilinear_layer_gradients() -> None:
    need_backward(BilinearAttention)
    rng = np.random.default_rng(2)
    layer = BilinearAttention(6, 2, kdim=5, seed=2)
    check_layer_gradients(
        "bilinear cross", layer, [_x(rng, 2, 4, 6), _x(rng, 2, 5, 5)], {"causal": "bottom_right"}
    )


def test_bilinear_layer_gradients_gqa_masked_no_bias() -> None:
    need_backward(BilinearAttention)
    rng = np.random.default_rng(12)
    layer = BilinearAttention(6, 4, num_kv_heads=2, d_head=2, vdim=5, d_out=4, bias=False, seed=12)
    kp = np.array([[True, False, True, True, True], [True] * 5])
    check_layer_gradients(
        "bilinear gqa masked",
        layer,
        [_x(rng, 2, 3, 6), _x(rng, 2, 5, 6), _x(rng, 2, 5, 5)],
        {"key_padding_mask": kp, "causal": True},
    )


@pytest.mark.parametrize("variant", ["official", "hf"])
def test_additive_layer_gradients(variant: str) -> None:
    need_backward(AdditiveAttention)
    rng = np.random.default_rng(3)
    layer = AdditiveAttention(5, d_hidden=6, d_out=4, variant=variant, seed=3)
    check_layer_gradients(f"additive {variant}", layer, [_x(rng, 2, 7, 5)], {})


def test_separable_layer_gradients() -> None:
    need_backward(SeparableAttention)
    rng = np.random.default_rng(4)
    layer = SeparableAttention(5, d_out=3, seed=4)
    check_layer_gradients("separable", layer, [_x(rng, 2, 7, 5)], {})


# --- Adam -------------------------------------------------------------------------------------


def test_adam_first_step_closed_form() -> None:
    """At t = 1, m_hat = g and v_hat = g^2: p -= lr * g / (|g| + eps)."""
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal((4, 3))
    g = rng.standard_normal((4, 3))
    g[0, 0] = 0.0
    for wd in (0.0, 0.1):
        p = p0.copy()
        Adam({"p": p}, lr=0.01, eps=1e-3, weight_decay=wd).step({"p": g})
        ge = g + wd * p0
        np.testing.assert_allclose(p, p0 - 0.01 * ge / (np.abs(ge) + 1e-3), rtol=1e-14, atol=1e-16)


def test_adam_two_steps_closed_form_and_float32() -> None:
    b1, b2, lr, eps = 0.8, 0.9, 0.05, 1e-8
    g1, g2 = np.array([1.0, -2.0, 0.5]), np.array([-3.0, -1.0, 0.5])
    for dtype in (np.float64, np.float32):
        p = np.zeros(3, dtype)
        ref_obj = p
        opt = Adam({"p": p}, lr=lr, betas=(b1, b2), eps=eps)
        opt.step({"p": g1})
        opt.step({"p": g2})
        m = (1 - b1) * (b1 * g1 + g2)
        v = (1 - b2) * (b2 * g1**2 + g2**2)
        step2 = lr * (m / (1 - b1**2)) / (np.sqrt(v / (1 - b2**2)) + eps)
        expected = -lr * g1 / (np.abs(g1) + eps) - step2
        assert p is ref_obj and p.dtype == dtype and opt.t == 2
        np.testing.assert_allclose(p, expected, rtol=1e-14 if dtype == np.float64 else 1e-6)


def test_adam_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    shapes = {"w": (5, 4), "b": (4,)}
    ours = {k: rng.standard_normal(s) for k, s in shapes.items()}
    theirs = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in ours.items()}
    kw = dict(lr=0.03, betas=(0.85, 0.97), eps=1e-6, weight_decay=0.05)
    opt = Adam(ours, **kw)
    topt = torch.optim.Adam(list(theirs.values()), **kw)
    worst = 0.0
    for _ in range(6):
        grads = {k: rng.standard_normal(s) for k, s in shapes.items()}
        opt.step(grads)
        for k, t in theirs.items():
            t.grad = torch.tensor(grads[k])
        topt.step()
        for k in shapes:
            ref = theirs[k].detach().numpy()
            np.testing.assert_allclose(ours[k], ref, rtol=1e-13, atol=1e-15)
            worst = max(worst, float(np.abs(ours[k] - ref).max()))
    print(f"Adam vs torch.optim.Adam, 6 steps: max |diff| {worst:.1e}")


def test_adam_layers_and_errors() -> None:
    rng = np.random.default_rng(7)
    a, b = MultiHeadAttention(4, 2, seed=0), MultiHeadAttention(4, 1, seed=1)
    opt = Adam([a, b], lr=1e-2)
    with pytest.raises(RuntimeError, match=r"params\[0\] \(MultiHeadAttention\) has no gradients"):
        opt.step()
    ids = {k: id(v) for k, v in a.params.items()}
    before = a.state_dict()
    x = rng.standard_normal((3, 4))
    for layer in (a, b):
        layer.backward(np.ones_like(layer(x)))
    opt.step()
    assert {k: id(v) for k, v in a.params.items()} == ids
    assert all(not np.array_equal(a.params[k], before[k]) for k in before)
    opt.zero_grad()
    assert not any(g.any() for g in a.grads.values())

    p = {"w": np.zeros((2, 2))}
    dopt = Adam(p)
    with pytest.raises(TypeError, match=r"params\[0\] is a dict, so step\(\) needs"):
        dopt.step()
    with pytest.raises(KeyError, match=r"no gradient for params\[0\] \['w'\]"):
        dopt.step({"v": np.zeros(2)})
    with pytest.raises(ValueError, match=r"grads\['w'\]: expected shape \(2, 2\)"):
        dopt.step({"w": np.zeros(3)})
    with pytest.raises(ValueError, match="grads: expected a dict of gradients per parameter"):
        dopt.step([{"w": np.zeros((2, 2))}] * 2)
    assert dopt.t == 0 and not p["w"].any()
    with pytest.raises(ValueError, match=r"lr: expected a finite number in \(0.0"):
        Adam(p, lr=0)
    with pytest.raises(ValueError, match=r"betas\[1\]: expected a finite number in \[0.0, 1.0\)"):
        Adam(p, betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="betas: expected a pair"):
        Adam(p, betas=0.9)
    with pytest.raises(TypeError, match=r"params\[0\]\['w'\]: expected a float ndarray"):
        Adam({"w": [1.0, 2.0]})
    ro = np.zeros(2)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        Adam({"w": ro})
    with pytest.raises(ValueError, match="params: expected at least one"):
        Adam([])


# --- a tiny training run ----------------------------------------------------------------------

N_TOK, D_CONTENT, BATCH = 8, 8, 32


def _copy_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[content (8) | one-hot position (8)]``; target: the previous token's content
    (output ``i`` = content ``(i - 1) mod n``)."""
    c = rng.standard_normal((BATCH, N_TOK, D_CONTENT))
    pos = np.broadcast_to(np.eye(N_TOK), (BATCH, N_TOK, N_TOK))
    return np.concatenate([c, pos], axis=-1), np.roll(c, 1, axis=1)


def test_mha_learns_to_copy_the_previous_token() -> None:
    """One MultiHeadAttention layer (d_model 16, 2 heads, float64) trained with Adam on MSE."""
    layer = MultiHeadAttention(D_CONTENT + N_TOK, 2, d_out=D_CONTENT, seed=0)
    opt = Adam(layer, lr=1e-2)
    x_test, y_test = _copy_batch(np.random.default_rng(123))  # held out

    def test_loss() -> float:
        return float(np.mean((layer(x_test) - y_test) ** 2))

    initial = test_loss()
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    for _ in range(300):
        x, y = _copy_batch(rng)
        out = layer(x)
        layer.backward(2.0 * (out - y) / out.size)
        opt.step()
    elapsed = time.perf_counter() - t0
    final = test_loss()
    _, w = layer(x_test, return_weights="mean")
    on_previous = float(np.mean(w[:, np.arange(N_TOK), (np.arange(N_TOK) - 1) % N_TOK]))
    print(
        f"copy task: test MSE {initial:.3f} -> {final:.2e} ({initial / final:.0f}x) in "
        f"{elapsed:.2f} s; mean attention on the previous token {on_previous:.3f}"
    )
    assert math.isfinite(final)
    assert final <= initial / 10
    assert on_previous > 0.8
