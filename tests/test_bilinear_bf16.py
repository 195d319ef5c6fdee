"""bilinear_attention with precision="bf16": the query order ``(X_q W_i + u_i) X_k^T`` with every
product's operands rounded to bfloat16 (the inputs, ``w_qk``, ``w_v``, ``w_o``, the projected
queries, the values and the context) into float32 sums, the probabilities rounded as in
scaled_dot_product_attention's bf16 core; gradients of the float32 maths at the rounded inputs and
weights. The bounds against the exact result are tested in tests/test_half.py; here, that the
roundings are the ones documented, the errors, and the AMX kernels against the emulation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab import _bilinear, _half, reference
from attnlab._loader import core
from attnlab.reference._mha import _bf16
from conftest import make_mha_weights

U = 2.0**-8  # bfloat16's unit roundoff


def _case(
    seed: int,
    B: int = 2,
    n_q: int = 33,
    n_k: int | None = None,
    d: int = 32,
    h: int = 4,
    h_kv: int | None = None,
) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
    """Query rows (and key rows when ``n_k`` is given), and folded weights as float32 arrays."""
    rng = np.random.default_rng(seed)
    w = make_mha_weights(rng, d, h, d // h, num_kv_heads=h_kv, dtype=np.float32)
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], w["b_q"], None, num_heads=h, num_kv_heads=h_kv)
    x = rng.standard_normal((B, n_q, d)).astype(np.float32)
    key = None if n_k is None else rng.standard_normal((B, n_k, d)).astype(np.float32)
    kw = {
        "w_qk": qk.w.astype(np.float32),
        "u_k": qk.u.astype(np.float32),
        **{k: w[k] for k in ("w_v", "w_o", "b_v", "b_o")},
        "num_heads": h,
        "num_kv_heads": h_kv,
        "scale": 1.0 / np.sqrt(d // h),
    }
    return x, key, kw


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


def _f64(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v.astype(np.float64) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


OPTIONS = [
    {},
    {"causal": True, "h_kv": 2},
    {"n_k": 50, "softcap": 4.0, "alibi_slopes": [0.5, 0.25, 0.1, 0.05]},
    {"sinks": [0.5, -1.0, 0.0, 2.0], "window": (6, 2)},
    {"mask": "bool", "n_k": 20},
    {"mask": "float"},
    {"n_q": 1, "n_k": 700},  # one query row over many keys
]


def _options(opts: dict[str, Any], rng: np.random.Generator, n_q: int, n_k: int) -> dict:
    kw = {k: v for k, v in opts.items() if k not in ("h_kv", "n_k", "n_q")}
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((n_q, n_k)) < 0.7
    elif kw.get("mask") == "float":
        kw["mask"] = rng.standard_normal((n_q, n_k)).astype(np.float32)
    for name in ("alibi_slopes", "sinks"):
        if name in kw:
            kw[name] = np.asarray(kw[name], np.float32)
    return kw


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_bf16_weights_are_those_of_the_rounded_logits(opts):
    """The attention weights of the bf16 forward against those of the reference's logits from
    the rounded operands (x_q, W_i, x_k and the projected queries x_q W_i + u_i): normwise
    within a fifth of the rounding's own effect (the exact logits' weights), so the logits are
    the ones documented (leaving the projected queries unrounded gives half of it; a projected
    query whose float32 sum sits at a rounding boundary may round to the neighbouring bfloat16
    of the reference's, which moves its row as much as the rounding does: rows, not the
    norm). Against the reference with the same operands rounded
    (the probabilities not: a product with v moves by at most 2**-8 max|v| per context element,
    the context's rounding and w_o's sum add as much again), the output is within
    2 2**-8 max|v| sum_j |w_o[j, :]|."""
    n_q = opts.get("n_q", 33)
    x, key, kw = _case(len(str(opts)), n_q=n_q, n_k=opts.get("n_k"), h_kv=opts.get("h_kv"))
    n_k = n_q if key is None else key.shape[1]
    kw.update(_options(opts, np.random.default_rng(1), n_q, n_k))
    got, w_got = attnlab.bilinear_attention(
        x, key, **kw, precision="bf16", return_weights=True, warn_empty_rows=False
    )
    same, w_same = reference.bilinear_attention(
        x, key, **kw, precision="bf16", return_weights=True, warn_empty_rows=False
    )
    exact, w_exact = reference.bilinear_attention(
        x, key, **kw, return_weights=True, warn_empty_rows=False
    )
    assert got.dtype == w_got.dtype == np.float32
    assert _rel(w_got, w_same) <= 0.2 * _rel(w_same, w_exact)
    value = x if key is None else key
    vmax = float(np.abs(value.astype(np.float64) @ kw["w_v"] + kw["b_v"]).max())
    reach = float(np.abs(kw["w_o"]).sum(axis=0).max())
    assert np.abs(got - same).max() <= 2 * U * vmax * reach * 1.01 + 1e-5
    assert np.abs(same - exact).max() > 1e-5 * np.abs(exact).max()  # the rounding is there
    # the flash path (no weights) gives the same output as the weights path, to the sums
    flash = attnlab.bilinear_attention(x, key, **kw, precision="bf16", warn_empty_rows=False)
    assert np.abs(flash - got).max() <= 2 * U * vmax * reach * 1.01 + 1e-5


def test_bf16_forward_is_the_query_order_whatever_the_cost_model():
    """Many more queries than keys make the cost model pick the key order for float32; bf16
    evaluates the query order (its rounded operands are the projected queries): the same
    output as with ``_order="query"``, bitwise; ``_order="key"`` is refused."""
    x, key, kw = _case(3, B=1, n_q=400, n_k=3, d=16, h=2)
    assert (
        attnlab.cost.collapsed_order(
            n_q=400, n_k=3, d_q=16, d_k=16, num_heads=2, batch=1, key_bias=True
        )
        == "key"
    )
    got = attnlab.bilinear_attention(x, key, **kw, precision="bf16")
    np.testing.assert_array_equal(
        got, attnlab.bilinear_attention(x, key, **kw, precision="bf16", _order="query")
    )
    with pytest.raises(ValueError, match="_order: precision='bf16' evaluates the query order"):
        attnlab.bilinear_attention(x, key, **kw, precision="bf16", _order="key")


def test_bf16_lse_and_empty_keys():
    """The log-sum-exp is the bf16 logits' (the reference's with the same rounding, within a
    fifth of the rounding's effect, as the weights); with no key at all the output is b_o,
    the log-sum-exp -inf, and the gradients those of float32 (zero but b_o's)."""
    x, key, kw = _case(4, n_k=9)
    _, lse = attnlab.bilinear_attention(x, key, **kw, precision="bf16", return_lse=True)
    _, lse_same = reference.bilinear_attention(x, key, **kw, precision="bf16", return_lse=True)
    _, lse_exact = reference.bilinear_attention(x, key, **kw, return_lse=True)
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 33)
    assert np.linalg.norm(lse - lse_same) <= 0.2 * np.linalg.norm(lse_same - lse_exact)
    none = np.zeros((2, 0, 32), np.float32)
    empty, lse0 = attnlab.bilinear_attention(
        x, none, **kw, precision="bf16", return_lse=True, warn_empty_rows=False
    )
    np.testing.assert_array_equal(empty, np.broadcast_to(kw["b_o"], empty.shape))
    assert np.isneginf(lse0).all()
    g = np.ones_like(x)
    grads = attnlab.bilinear_attention_backward(g, x, none, **kw, precision="bf16")
    plain = attnlab.bilinear_attention_backward(g, x, none, **kw)
    assert set(grads) == set(plain)
    for name in plain:
        np.testing.assert_array_equal(grads[name], plain[name])


@pytest.mark.parametrize("opts", [{}, {"causal": True, "h_kv": 2, "n_k": None}, {"n_k": 21}])
def test_bf16_gradients_are_float32_at_the_rounded_operands(opts):
    """The backward with precision="bf16" is the float32 backward at query, key, value, w_qk,
    w_v and w_o rounded to bfloat16 (u_k, b_v, b_o as given): bitwise. vjp's forward is the
    bf16 forward and its pullback that backward, bitwise. Against the exact float64 gradients
    of the unrounded arrays: within 4 2**-8 of each gradient's largest entry."""
    x, key, kw = _case(5, n_k=opts.get("n_k"), h_kv=opts.get("h_kv"))
    kw.update(_options(opts, np.random.default_rng(2), 33, 33))
    g = np.random.default_rng(6).standard_normal(x.shape[:-1] + (32,)).astype(np.float32)
    grads = attnlab.bilinear_attention_backward(g, x, key, **kw, precision="bf16")

    def rnd(a: np.ndarray) -> np.ndarray:
        return _bf16(a).astype(np.float32)

    rounded = {**kw, **{n: rnd(kw[n]) for n in ("w_qk", "w_v", "w_o")}}
    at_rounded = attnlab.bilinear_attention_backward(
        g, rnd(x), None if key is None else rnd(key), **rounded
    )
    assert set(grads) == set(at_rounded)
    for name, gr in grads.items():
        assert gr.dtype == np.float32
        np.testing.assert_array_equal(gr, at_rounded[name], err_msg=name)
    exact = attnlab.bilinear_attention_backward(
        g.astype(np.float64),
        x.astype(np.float64),
        None if key is None else key.astype(np.float64),
        **_f64(kw),
    )
    for name, gr in grads.items():
        assert np.abs(gr - exact[name]).max() <= 4 * U * np.abs(exact[name]).max(), name
    out, pull = attnlab.vjp(attnlab.bilinear_attention, x, key, **kw, precision="bf16")
    np.testing.assert_array_equal(out, attnlab.bilinear_attention(x, key, **kw, precision="bf16"))
    kept = pull(g)
    for name, gr in grads.items():
        np.testing.assert_array_equal(kept[name], gr, err_msg=name)


def test_bf16_with_a_bilinear_qk_and_broadcast_batches():
    """A BilinearQK (its u and d_head), key rows broadcast over the query's batch: as the
    reference with the same rounding."""
    rng = np.random.default_rng(7)
    w = make_mha_weights(rng, 24, 3, 8, dtype=np.float32)
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], w["b_q"], None, num_heads=3)
    qk = _bilinear.BilinearQK(qk.w.astype(np.float32), qk.u.astype(np.float32), None, None, 8)
    x = rng.standard_normal((3, 2, 6, 24)).astype(np.float32)
    key = rng.standard_normal((2, 11, 24)).astype(np.float32)
    kw = dict(w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], num_heads=3)
    got, p = attnlab.bilinear_attention(x, key, **kw, precision="bf16", return_weights="mean")
    same, p_same = reference.bilinear_attention(
        x, key, **kw, precision="bf16", return_weights="mean"
    )
    assert got.shape == (3, 2, 6, 24) and p.shape == (3, 2, 6, 11)
    np.testing.assert_allclose(p, p_same, rtol=1e-4, atol=1e-6)
    vmax = float(np.abs(key.astype(np.float64) @ w["w_v"]).max())
    reach = float(np.abs(w["w_o"]).sum(axis=0).max())
    assert np.abs(got - same).max() <= 2 * U * vmax * reach * 1.01 + 1e-5


@pytest.mark.parametrize("widths", [(0, 3, 4), (3, 0, 4), (3, 3, 0)], ids=str)
def test_bf16_empty_sums(widths):
    """A product over no feature (``d_q``, ``d_k`` or ``d_v`` zero) is its bias, or 0: as the
    reference with the same rounding (the bf16 GEMM leaves an empty sum unwritten)."""
    d_q, d_k, d_v = widths
    rng = np.random.default_rng(11)
    x, k, v = (
        rng.standard_normal((2, n, w)).astype(np.float32)
        for n, w in zip((5, 6, 6), widths, strict=True)
    )
    kw = {
        "w_qk": rng.standard_normal((2, d_q, d_k)).astype(np.float32),
        "w_v": rng.standard_normal((d_v, 4)).astype(np.float32),
        "b_v": np.ones(4, np.float32),
        "w_o": rng.standard_normal((4, 3)).astype(np.float32),
        "num_heads": 2,
        "scale": 0.5,
    }
    got = attnlab.bilinear_attention(x, k, v, **kw, precision="bf16")
    same = reference.bilinear_attention(x, k, v, **kw, precision="bf16")
    assert np.abs(got - same).max() <= 4 * U * np.abs(same).max()


def test_rounding_is_the_kernels():
    """The backward's rounding of the operands (``_half.rounded_bf16``) is the kernels': the bf16
    product with a 1 x 1 one returns the rounded operand, ties
    to even, subnormals to zero, Inf and NaN through; arrays passed twice are rounded once."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((7, 40)).astype(np.float32) * np.float32(3.0)
    x[0, :6] = [1 + 2**-8, 1 + 3 * 2**-8, 1e-39, -1e-39, np.inf, -np.inf]
    x[1, :2] = [np.finfo(np.float32).max, -(1 + 2**-8)]  # rounds up to Inf; a negative tie
    y = np.empty((x.size, 1), np.float32)
    core.linear_forward(x.reshape(-1, 1), np.ones((1, 1), np.float32), None, y, True)
    y = y.reshape(x.shape)
    r, r2 = _half.rounded_bf16(x, x)
    assert r is r2
    np.testing.assert_array_equal(r, y)
    np.testing.assert_array_equal(r, _bf16(x).astype(np.float32))
    assert np.signbit(r[0, 3]) and r[0, 3] == 0 and np.isposinf(r[1, 0])
    nan = _half.rounded_bf16(np.array([np.nan, -np.nan], np.float32))[0]
    assert np.isnan(nan).all()


def test_bf16_errors():
    x, _, kw = _case(9, B=1, n_q=3, d=8, h=2)
    with pytest.raises(ValueError, match="precision: expected None or 'bf16', got 'fp8'"):
        attnlab.bilinear_attention(x, **kw, precision="fp8")
    with pytest.raises(ValueError, match=r"precision: 'bf16' .* float32 inputs, got float64"):
        attnlab.bilinear_attention(x.astype(np.float64), **kw, precision="bf16")
    with pytest.raises(ValueError, match=r"precision: 'bf16' .* float32 inputs, got float64"):
        attnlab.bilinear_attention_backward(x, x, **_f64(kw), precision="bf16")
    with pytest.raises(ValueError, match=r"precision: 'bf16' .* float32 inputs, got float64"):
        attnlab.vjp(attnlab.bilinear_attention, x, **_f64(kw), precision="bf16")
    with pytest.raises(ValueError, match="precision: expected None, or 'bf16' with order='query'"):
        reference.bilinear_logits(x, w_qk=kw["w_qk"], order="key", precision="bf16")


def test_bf16_amx_and_emulation_agree():
    """ATTNLAB_AMX=0 forces the emulation (in a subprocess): both round the same operands; a
    probability may round to the neighbouring bfloat16 where the running maximum moves at
    another key, and the context then to its neighbour: within 2 2**-8 max|v| sum_j |w_o|."""
    info = attnlab.build_info()
    if info["bf16_kernel"] != "amx":
        pytest.skip(f"this CPU runs the {info['bf16_kernel']} bf16 kernel: no AMX to compare")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import numpy as np, attnlab; "
        "from test_bilinear_bf16 import _case; "
        "x, key, kw = _case(10, B=2, n_q=150, d=64, h=4, h_kv=2); "
        "o = attnlab.bilinear_attention(x, **kw, causal=True, precision='bf16'); "
        "print(json.dumps([attnlab.build_info()['bf16_kernel'], o.tolist()]))"
    )
    pkg = str(Path(attnlab.__file__).resolve().parents[1])
    outs, kernels = [], []
    for amx in ("1", "0"):
        env = dict(os.environ, ATTNLAB_AMX=amx)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
        run = subprocess.run(
            [sys.executable, "-c", code, str(Path(__file__).parent)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        kernel, out = json.loads(run.stdout.strip().splitlines()[-1])
        kernels.append(kernel)
        outs.append(np.array(out, np.float32))
    assert kernels == ["amx", "emulated"]
    x, _, kw = _case(10, B=2, n_q=150, d=64, h=4, h_kv=2)
    vmax = float(np.abs(x.astype(np.float64) @ kw["w_v"] + kw["b_v"]).max())
    reach = float(np.abs(kw["w_o"]).sum(axis=0).max())
    assert np.abs(outs[0] - outs[1]).max() <= 2 * U * vmax * reach
