"""precision="bf16": bf16 products with float32 sums, on AMX tiles where the CPU has them and
emulated elsewhere. Bounds from the unit roundoffs: bfloat16's u = 2**-8 (each operand rounded
once), float32's 2**-24 per term of a sum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnlab
from attnlab import reference
from attnlab._loader import core
from attnlab.reference._mha import _bf16
from conftest import make_mha_weights

SHAPES = [(1, 1, 1), (5, 3, 7), (33, 65, 17), (64, 1000, 31), (197, 384, 1152), (40, 32, 32)]


def _bf16_linear(x, w, b):
    y = np.empty((x.shape[0], w.shape[1]), np.float32)
    core.linear_forward(x, w, b, y, True)
    return y


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_bf16_is_the_rounded_product_to_float32_sums(shape):
    """Against float64 of the bf16-rounded operands: elementwise within (K + 2) 2**-24 of
    |x| |w| + |b| (the float32 sums; the rounding of the operands is exact and the same)."""
    M, K, N = shape
    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    y = _bf16_linear(x, w, b)
    exact = _bf16(x) @ _bf16(w) + b
    bound = ((np.abs(_bf16(x)) @ np.abs(_bf16(w))) + np.abs(b)) * (K + 2) * 2.0**-24
    assert np.all(np.abs(y - exact) <= bound)
    # and against the unrounded product: within 2 u = 2**-7 of |x| |w| (two operand roundings)
    loose = (np.abs(x) @ np.abs(w)) * (2.0**-7 + (K + 2) * 2.0**-24) + 1e-30
    assert np.all(np.abs(y - (x.astype(np.float64) @ w + b)) <= loose + np.abs(b) * 2.0**-23)


def test_linear_bf16_rounding_edges():
    """Ties to even, subnormals to zero, NaN and Inf through."""
    x = np.array([[1 + 2**-8, 1 + 3 * 2**-8, 1e-39, np.inf]], np.float32)
    y = _bf16_linear(x[:, :3].copy(), np.eye(3, dtype=np.float32), None)
    np.testing.assert_array_equal(y, [[1.0, 1 + 2**-6, 0.0]])
    y = _bf16_linear(np.array([[np.nan, 1.0]], np.float32), np.ones((2, 1), np.float32), None)
    assert np.isnan(y).all()
    y = _bf16_linear(np.array([[np.inf, 1.0]], np.float32), np.ones((2, 1), np.float32), None)
    assert np.isposinf(y).all()


def test_amx_and_emulation_agree_to_the_order_of_the_sums():
    """The same products on the other kernel (ATTNLAB_AMX=0 forces the emulation), in a
    subprocess: within K 2**-24 of |x| |w|, the float32 sums' order."""
    info = attnlab.build_info()
    if info["bf16_kernel"] != "amx":
        pytest.skip(f"this CPU runs the {info['bf16_kernel']} bf16 kernel: no AMX to compare")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((97, 300)).astype(np.float32)
    w = rng.standard_normal((300, 70)).astype(np.float32)
    y = _bf16_linear(x, w, None)
    code = (
        "import json, sys, numpy as np, attnlab; from attnlab._loader import core; "
        "rng = np.random.default_rng(3); x = rng.standard_normal((97, 300)).astype(np.float32); "
        "w = rng.standard_normal((300, 70)).astype(np.float32); "
        "y = np.empty((97, 70), np.float32); core.linear_forward(x, w, None, y, True); "
        "print(json.dumps([attnlab.build_info()['bf16_kernel'], y.tolist()]))"
    )
    pkg = str(Path(attnlab.__file__).resolve().parents[1])
    env = dict(os.environ, ATTNLAB_AMX="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    kernel, emulated = json.loads(out.stdout.strip().splitlines()[-1])
    assert kernel == "emulated"
    bound = (np.abs(_bf16(x)) @ np.abs(_bf16(w))) * 300 * 2.0**-24
    assert np.all(np.abs(y - np.array(emulated, np.float32)) <= bound)


@pytest.mark.parametrize("options", [{}, {"causal": True, "rope_theta": 1e4}, {"num_kv_heads": 2}])
def test_mha_bf16_within_its_bounds(options):
    """Against the reference computing the same rounding in float64: a context element may
    round to the neighbouring bfloat16 (its float32 value near a rounding boundary), one
    2**-8 step; against the exact reference: two operand roundings per projection, twice."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 40, 64)).astype(np.float32)
    w = make_mha_weights(rng, 64, 4, 16, num_kv_heads=options.get("num_kv_heads"), dtype=np.float32)
    kw = dict(options, num_heads=4)
    out = attnlab.multi_head_attention(x, **w, **kw, precision="bf16")
    assert out.dtype == np.float32
    same = reference.multi_head_attention(x, **w, **kw, precision="bf16")
    exact = reference.multi_head_attention(x, **w, **kw)
    scale = np.abs(exact).max()
    assert np.abs(out - same).max() <= 2.0**-8 * scale
    assert np.abs(out - exact).max() <= 4 * 2.0**-8 * scale
    assert np.abs(same - exact).max() > 1e-5 * scale  # the rounding is really there


def test_mha_bf16_gradients_and_vjp():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 12, 32)).astype(np.float32)
    w = make_mha_weights(rng, 32, 4, 8, dtype=np.float32)
    g = rng.standard_normal((2, 12, 32)).astype(np.float32)
    kw = dict(num_heads=4, precision="bf16")
    grads = attnlab.multi_head_attention_backward(g, x, **w, **kw)
    exact = attnlab.multi_head_attention_backward(
        g.astype(np.float64),
        x.astype(np.float64),
        **{k: v.astype(np.float64) for k, v in w.items()},
        num_heads=4,
    )
    for name, gr in grads.items():
        assert gr.dtype == np.float32
        assert np.abs(gr - exact[name]).max() <= 4 * 2.0**-8 * np.abs(exact[name]).max() + 1e-6
    out, pull = attnlab.vjp(attnlab.multi_head_attention, x, **w, **kw)
    np.testing.assert_array_equal(out, attnlab.multi_head_attention(x, **w, **kw))
    kept = pull(g)
    for name in grads:
        np.testing.assert_allclose(kept[name], grads[name], rtol=1e-5, atol=1e-6)


def test_precision_errors():
    x = np.ones((3, 8), np.float32)
    w = make_mha_weights(np.random.default_rng(0), 8, 2, 4, dtype=np.float32)
    with pytest.raises(ValueError, match="precision: expected None or 'bf16', got 'fp8'"):
        attnlab.multi_head_attention(x, **w, num_heads=2, precision="fp8")
    with pytest.raises(ValueError, match=r"precision: 'bf16' .* float32 inputs, got float64"):
        attnlab.multi_head_attention(x.astype(np.float64), **w, num_heads=2, precision="bf16")
    with pytest.raises(TypeError, match="x: bf16 products take float32 arrays"):
        core.linear_forward(np.ones((2, 2)), np.ones((2, 2)), None, np.ones((2, 2)), True)
