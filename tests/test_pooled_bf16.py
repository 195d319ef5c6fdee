"""additive_attention and separable_attention with precision="bf16": the weight products of the
form as written (additive: ``x w_q``, ``x w_k``, ``(G * K) w_proj``, ``H w_final``; separable:
``x w_qkv``, ``(relu(v) * ctx) w_o``) on operands rounded to bfloat16 with float32 sums, the norms,
scores, softmax and pooling in float32; gradients of the float32 function at the rounded inputs
and weights. The bounds against the exact result are tested in tests/test_half.py; here, that
the roundings are the documented ones (the reference rounds the same operands in float64), the
half-precision and thread-count paths, the kernels against the emulation, and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab import _half, reference
from attnlab._bench.accuracy import BACKWARD_C, error_bound, logit_scale
from attnlab._loader import core

try:
    import ml_dtypes
except ImportError:  # bfloat16 has no NumPy name without it: float16 only
    ml_dtypes = None

U = 2.0**-8  # bfloat16's unit roundoff
HALVES = [np.dtype(np.float16)] + ([np.dtype(ml_dtypes.bfloat16)] if ml_dtypes else [])


def _rel(got: Any, want: Any) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


def _f64(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v.astype(np.float64) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


def _uniform(rng: np.random.Generator, *shape: int) -> np.ndarray:
    b = 1.0 / np.sqrt(shape[0])
    return rng.uniform(-b, b, shape).astype(np.float32)


def _case(family: str, B: int, n: int, d: int, D: int, seed: int) -> tuple[Any, dict, dict]:
    """(function, arrays, options) of one family: nn.Linear-like weights (SwiftFormer's w_g
    ~ N(0, 1)); ``d_out`` is ``d`` for both."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, Any] = {"x": rng.standard_normal((B, n, d)).astype(np.float32)}
    if family == "separable":
        arrays.update(
            w_qkv=_uniform(rng, d, 1 + 2 * d),
            b_qkv=_uniform(rng, d, 1 + 2 * d)[0],
            w_o=_uniform(rng, d, d),
            b_o=_uniform(rng, d, d)[0],
        )
        return attnlab.separable_attention, arrays, {}
    for name, (fi, fo) in {"q": (d, D), "k": (d, D), "proj": (D, D), "final": (D, d)}.items():
        arrays[f"w_{name}"] = _uniform(rng, fi, fo)
        arrays[f"b_{name}"] = _uniform(rng, fi, fo)[0]
    arrays["w_g"] = rng.standard_normal(D).astype(np.float32)
    return attnlab.additive_attention, arrays, {"variant": family.split("-")[1]}


FAMILIES = ["additive-official", "additive-hf", "separable"]
# (B, n, d, D): several row blocks and an odd width, few tokens, D != d_out, one token
SHAPES = [(2, 300, 40, 40), (3, 33, 24, 48), (1, 64, 96, 64), (4, 1, 16, 16)]


def _backward(fn: Any) -> Any:
    return {
        attnlab.additive_attention: attnlab.additive_attention_backward,
        attnlab.separable_attention: attnlab.separable_attention_backward,
    }[fn]


def _reference(fn: Any) -> Any:
    return {
        attnlab.additive_attention: reference.additive_attention,
        attnlab.separable_attention: reference.separable_attention,
    }[fn]


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_rounds_the_documented_operands(family, shape, padded):
    """Against the reference with the same operands rounded (in float64), normwise within a
    twentieth of the rounding's own effect (the distance to the exact result): each rounded
    operand moves the result by a sizeable share of that effect, so none is missing or extra;
    the rest is the float32 sums (an intermediate whose float32 value sits at a rounding
    boundary may round to the neighbouring bfloat16). Padding leaves the first of several
    sequences with no real token."""
    fn, arrays, kw = _case(family, *shape, seed=sum(shape) + len(family))
    if padded:
        B, n = shape[:2]
        mask = np.random.default_rng(3).random((B, n)) < 0.7
        mask[0] = B == 1  # the first sequence has no real token (not the only one)
        kw["key_padding_mask"] = mask
        kw["warn_empty_rows"] = False
    got = fn(**arrays, **kw, precision="bf16")
    same = _reference(fn)(**arrays, **kw, precision="bf16")
    exact = _reference(fn)(**arrays, **kw)
    assert got.dtype == np.float32 and got.shape == exact.shape
    effect = _rel(same, exact)
    assert effect > 1e-4  # the rounding is there
    assert _rel(got, same) <= 0.05 * effect
    assert _rel(got, exact) <= 4 * U


@pytest.mark.parametrize("family", FAMILIES)
def test_half_x_is_the_widened_call(family, monkeypatch):
    """float16 or bfloat16 x (read as stored, rounded to bf16 as its products pack it): the
    float32 call on the widened x, bit for bit; with every array half, the result is that call's
    rounded to the inputs' dtype, x and the weight matrices read as stored (no float32 copy)."""
    from conftest import refuse_conversions

    fn, arrays, kw = _case(family, 2, 150, 24, 24, seed=5)
    matrices = {v.shape for k, v in arrays.items() if k.startswith("w_") and v.ndim == 2}
    for dtype in HALVES:
        x = arrays["x"].astype(dtype)
        got = fn(**{**arrays, "x": x}, **kw, precision="bf16")
        want = fn(**{**arrays, "x": x.astype(np.float32)}, **kw, precision="bf16")
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
        half = {k: v.astype(dtype) for k, v in arrays.items()}
        refuse_conversions(monkeypatch, {x.shape} | matrices)
        got = fn(**half, **kw, precision="bf16")
        monkeypatch.undo()
        widened = {k: v.astype(np.float32) for k, v in half.items()}
        want = fn(**widened, **kw, precision="bf16").astype(dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_are_float32_at_the_rounded_operands(family):
    """The backward with precision="bf16" is the float32 backward at x and the weight matrices
    rounded to bfloat16 (biases and w_g as given): bitwise; vjp's output is the bf16 forward's
    and its pullback that backward, bitwise. Against the exact float64 gradients of the
    unrounded arrays: normwise within the gradients' bound (tests/test_half.py's), each against
    1% of the norm of them all when it is smaller (a zero gradient)."""
    fn, arrays, kw = _case(family, 2, 70, 24, 32 if family != "separable" else 24, seed=9)
    kw["key_padding_mask"] = np.random.default_rng(1).random((2, 70)) < 0.8
    g = np.random.default_rng(2).standard_normal((2, 70, 24)).astype(np.float32)
    backward = _backward(fn)
    grads = backward(g, **arrays, **kw, precision="bf16")
    matrices = (
        ("x", "w_qkv", "w_o") if family == "separable" else ("x", "w_q", "w_k", "w_proj", "w_final")
    )
    rounded = {
        **arrays,
        **dict(zip(matrices, _half.rounded_bf16(*(arrays[m] for m in matrices)), strict=True)),
    }
    at_rounded = backward(g, **rounded, **kw)
    assert set(grads) == set(at_rounded)
    for name, gr in grads.items():
        assert gr.dtype == np.float32
        np.testing.assert_array_equal(gr, at_rounded[name], err_msg=name)
    exact = backward(g.astype(np.float64), **_f64(arrays), **kw)
    rho = logit_scale(arrays["x"], arrays["w_qkv"][:, 0], 1.0) if family == "separable" else 0.0
    bound = error_bound(U, rho, 70, BACKWARD_C)
    floor = 1e-2 * np.sqrt(sum(float(np.sum(e**2)) for e in exact.values()))
    for name, gr in grads.items():
        err = np.linalg.norm(gr - exact[name]) / max(float(np.linalg.norm(exact[name])), floor)
        assert err <= bound, name
    out, pull = attnlab.vjp(fn, **arrays, **kw, precision="bf16")
    np.testing.assert_array_equal(out, fn(**arrays, **kw, precision="bf16"))
    arrays["x"][...] = 0.0  # the pullback kept its own copies
    kept = pull(g)
    for name, gr in grads.items():
        np.testing.assert_array_equal(kept[name], gr, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_errors(family):
    fn, arrays, kw = _case(family, 1, 5, 8, 8, seed=4)
    with pytest.raises(ValueError, match="precision: expected None or 'bf16', got 'fp8'"):
        fn(**arrays, **kw, precision="fp8")
    with pytest.raises(ValueError, match=r"precision: 'bf16' .* float32 inputs, got float64"):
        fn(**_f64(arrays), **kw, precision="bf16")
    with pytest.raises(ValueError, match=r"precision: 'bf16' .* float32 inputs, got float64"):
        _backward(fn)(np.ones((1, 5, 8)), **_f64(arrays), **kw, precision="bf16")


def test_binding_refuses_bf16_where_it_has_no_meaning():
    """core.*_forward's bf16: float32 only, and no state (its pullback recomputes)."""
    x = np.ones((4, 3))
    args = core.SeparableArgs(
        x=x,
        w_qkv=np.ones((3, 7)),
        b_qkv=None,
        w_o=np.ones((3, 2)),
        b_o=None,
        batch=1,
        n=4,
        key_padding_mask=None,
        half=0,
    )
    with pytest.raises(TypeError, match="bf16: bf16 products take float32 operands"):
        core.separable_forward(args, np.empty((4, 2)), None, True)
    f32 = core.SeparableArgs(
        x=x.astype(np.float32),
        w_qkv=np.ones((3, 7), np.float32),
        b_qkv=None,
        w_o=np.ones((3, 2), np.float32),
        b_o=None,
        batch=1,
        n=4,
        key_padding_mask=None,
        half=0,
    )
    state = {
        "s": np.empty(4, np.float32),
        "k": np.empty((4, 3), np.float32),
        "v": np.empty((4, 3), np.float32),
        "context": np.empty((1, 3), np.float32),
    }
    with pytest.raises(ValueError, match="state: precision='bf16' keeps no state"):
        core.separable_forward(f32, np.empty((4, 2), np.float32), state, True)


def test_without_features_or_tokens():
    """No token, or separable attention without features (out = b_o): as the float32 call."""
    for family in FAMILIES:
        fn, arrays, kw = _case(family, 2, 0, 8, 8, seed=6)
        got = fn(**arrays, **kw, precision="bf16")
        assert got.shape == (2, 0, 8) and got.dtype == np.float32
    arrays = {
        "x": np.ones((2, 3, 0), np.float32),
        "w_qkv": np.ones((0, 1), np.float32),
        "w_o": np.ones((0, 5), np.float32),
        "b_o": np.arange(5, dtype=np.float32),
    }
    got = attnlab.separable_attention(**arrays, precision="bf16")
    np.testing.assert_array_equal(got, attnlab.separable_attention(**arrays))
    np.testing.assert_array_equal(got, np.broadcast_to(arrays["b_o"], (2, 3, 5)))


def test_kernels_agree_with_the_emulation(tmp_path: Path):
    """The VDPBF16PS products (in a process of their own) against the emulation's: the same
    roundings, so within a twentieth of the rounding's effect (the float32 sums' order, and an
    intermediate rounded to its neighbouring bfloat16 where that order moved it across a
    boundary). Skips where the CPU has no AVX512-BF16."""
    from test_bf16_avx512 import KERNELS, _run

    calls = []
    for i, family in enumerate(FAMILIES):
        fn, arrays, kw = _case(family, 2, 300, 72, 72, seed=20 + i)
        kw["key_padding_mask"] = np.random.default_rng(i).random((2, 300)) < 0.9
        calls.append((fn.__name__, (), {**arrays, **kw, "precision": "bf16"}))
    outs = {}
    for name, env in KERNELS.items():
        kernel, outs[name] = _run(env, calls, tmp_path / f"{name}.pkl")
        if kernel != name:
            pytest.skip(f"no AVX512-BF16 kernel here: with {env} the bf16 kernel is {kernel!r}")
    for (name, _, kw), got, emulated in zip(
        calls, outs["avx512_bf16"], outs["emulated"], strict=True
    ):
        fn = getattr(attnlab, name)
        same = _reference(fn)(**kw)
        exact = _reference(fn)(**{k: v for k, v in kw.items() if k != "precision"})
        effect = _rel(same, exact)
        assert _rel(got, emulated) <= 0.05 * effect, name
        assert _rel(got, same) <= 0.05 * effect, name


def test_torch_adapter_passes_precision():
    """attnlab.torch's pooled functions take precision="bf16": the NumPy call's output and
    gradients."""
    torch = pytest.importorskip("torch")
    import attnlab.torch as at

    for family in FAMILIES:
        fn, arrays, kw = _case(family, 2, 20, 8, 8, seed=12)
        tensors = {k: torch.tensor(v, requires_grad=True) for k, v in arrays.items()}
        out = getattr(at, fn.__name__)(**tensors, **kw, precision="bf16")
        np.testing.assert_array_equal(out.detach().numpy(), fn(**arrays, **kw, precision="bf16"))
        g = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
        out.backward(torch.tensor(g))
        want = _backward(fn)(g, **arrays, **kw, precision="bf16")
        for name, t in tensors.items():
            np.testing.assert_array_equal(t.grad.numpy(), want[name], err_msg=name)
