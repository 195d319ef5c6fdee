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


# up to 4 rows (kBf16StreamRows) of a weight of 2**20 elements or more: the weight streamed
# and rounded as it is read
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1024, 1024), (1100, 1000), (2500, 420), (4096, 257)])
def test_linear_bf16_of_few_rows_is_the_float32_gemm_on_rounded_operands(rows, shape):
    """A decode step's few rows stream a large weight (no packing): bit for bit the float32 GEMM
    on the bf16-rounded copies (the emulated path's definition, chains of 256 products joined
    in order, then the bias), for any thread count; half-precision weights, x and y too."""
    K, N = shape
    rng = np.random.default_rng(rows * K + N)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    x[0, 0] = 1e-39  # a subnormal input: to zero, as the hardware rounding does
    w = rng.standard_normal((K, N)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    want = np.empty((rows, N), np.float32)
    xr, wr = _bf16(x).astype(np.float32), _bf16(w).astype(np.float32)
    core.linear_forward(xr, wr, b, want, False)
    threads = attnlab.get_num_threads()
    try:
        for n in (1, threads):
            attnlab.set_num_threads(n)
            np.testing.assert_array_equal(_bf16_linear(x, w, b), want)
    finally:
        attnlab.set_num_threads(threads)
    # half-precision weights (multi-head attention's projections read them as stored): the
    # same bits as their float32 copies, rounded
    xm = rng.standard_normal((1, rows, 1024)).astype(np.float32)
    wm = {
        n: (rng.standard_normal((1024, 1024)) / 32).astype(np.float16)
        for n in ("w_q", "w_k", "w_v", "w_o")
    }
    kw = dict(num_heads=8, precision="bf16")
    got = attnlab.multi_head_attention(xm, **wm, **kw)
    wide = attnlab.multi_head_attention(
        xm, **{n: a.astype(np.float32) for n, a in wm.items()}, **kw
    )
    np.testing.assert_array_equal(got, wide)


@pytest.mark.parametrize(
    "shape", [(1, 8, 8, 1, 3000, 64), (2, 8, 2, 2, 700, 128), (1, 4, 1, 3, 257, 40)]
)
def test_bf16_decode_rounds_the_cache_as_it_reads_it(shape):
    """precision="bf16" on decode shapes (few query rows per kv head): the decode path rounds q
    and each block of K and V as it reads them (no rounded copy of the cache; it was 16x the
    float32 call): within 2**-7 of the reference on the rounded operands (the kernels round the
    probabilities too), the same bits for any thread count, a masked key's NaN never read."""
    B, h, hk, n_q, n_k, d = shape
    rng = np.random.default_rng(n_k)
    q = rng.standard_normal((B, h, n_q, d)).astype(np.float32)
    k = rng.standard_normal((B, hk, n_k, d)).astype(np.float32)
    v = rng.standard_normal((B, hk, n_k, d)).astype(np.float32)
    kp = np.ones((B, n_k), bool)
    kp[:, 5] = False
    k[:, :, 5] = np.nan  # never read: padded
    v[:, :, 5] = np.nan
    kw = dict(mask=kp[:, None, None, :], causal="bottom_right", precision="bf16")
    got = attnlab.scaled_dot_product_attention(q, k, v, **kw)
    want = reference.scaled_dot_product_attention(q, k, v, **kw)
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 2.0**-7, err
    threads = attnlab.get_num_threads()
    try:
        attnlab.set_num_threads(1)
        np.testing.assert_array_equal(attnlab.scaled_dot_product_attention(q, k, v, **kw), got)
    finally:
        attnlab.set_num_threads(threads)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "token-major"])
@pytest.mark.parametrize("shape", [(1, 8, 8, 1, 1500, 64), (2, 8, 2, 3, 300, 40)])
def test_bf16_decode_is_the_call_on_rounded_arrays(shape, strided):
    """The decode kernels round K and V as they load them (AVX-512) or a block at a time
    (AVX2, the baseline): the same bits as the call on the arrays rounded first (rounding twice
    is rounding once), with ties, subnormals, NaN and infinities among the keys and values;
    also for a cache laid out token-major (rows of K a head's width times the heads apart)."""
    B, h, hk, n_q, n_k, d = shape
    rng = np.random.default_rng(n_k + d)
    q = rng.standard_normal((B, h, n_q, d)).astype(np.float32)
    if strided:  # (B, n_k, hk, d) storage viewed as (B, hk, n_k, d)
        k, v = (rng.standard_normal((B, n_k, hk, d)).astype(np.float32) for _ in range(2))
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    else:
        k, v = (rng.standard_normal((B, hk, n_k, d)).astype(np.float32) for _ in range(2))
    odd = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e-39, -3e-40, 3.4e38], np.float32)
    for a in (k, v):
        a[0, 0, :6, 0] = odd  # ties to even, subnormals, a finite value that rounds to inf
        a[0, 0, 7, 1] = np.nan
        a[0, -1, 9, 2] = -np.inf
    got = attnlab.scaled_dot_product_attention(q, k, v, precision="bf16")
    rounded = [np.ascontiguousarray(_bf16(a), np.float32) for a in (q, k, v)]  # (rows d apart)
    want = attnlab.scaled_dot_product_attention(*rounded, precision="bf16")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


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
    """The same products on the other kernel (ATTNLAB_AMX=0 and ATTNLAB_AVX512_BF16=0 force the
    emulation), in a subprocess: within K 2**-24 of |x| |w|, the float32 sums' order."""
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
    env = dict(os.environ, ATTNLAB_AMX="0", ATTNLAB_AVX512_BF16="0")
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


def _logit_error_bound(q, k, scale):
    """E >= max |s_bf16 - s| over the logits: each product of two operands rounded to bfloat16
    is off by at most (2 u + u**2) |q| |k|, u = 2**-8, summed over the features (float32's
    sums add less than 1e-5 of that here)."""
    u = 2.0**-8
    qa = np.abs(q.astype(np.float64))
    ka = np.abs(k.astype(np.float64))
    group = q.shape[-3] // k.shape[-3]
    ka = np.repeat(ka, group, axis=-3)
    return abs(scale) * (2 * u + u * u) * 1.0001 * float((qa @ np.swapaxes(ka, -1, -2)).max())


SDPA_BF16_CASES = [
    ((1, 2, 100, 64), (1, 2, 100, 64), {}),
    ((2, 3, 33, 40), (2, 3, 70, 40), {"causal": True}),
    ((1, 4, 129, 64), (1, 2, 300, 64), {"causal": "bottom_right"}),  # grouped-query heads
    ((1, 2, 200, 32), (1, 2, 200, 32), {"window": (40, 10)}),
    ((1, 2, 64, 128), (1, 2, 96, 128), {"softcap": 3.0, "alibi_slopes": [0.5, 0.25]}),
    ((1, 2, 50, 16), (1, 2, 77, 16), {"sinks": [0.5, -1.0], "scale": 0.3}),
    ((2, 1, 40, 8), (2, 1, 40, 8), {"mask": "bool"}),
    ((1, 2, 45, 24), (1, 2, 45, 24), {"mask": "float", "scale": -0.2}),
    ((1, 2, 3, 64), (1, 2, 2048, 64), {}),  # the decode path
    ((1, 2, 30, 64), (1, 2, 30, 64), {"return_weights": True, "d_v": 48}),  # the weights path
]


def _sdpa_case(q_shape, k_shape, options, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(q_shape).astype(np.float32)
    k = rng.standard_normal(k_shape).astype(np.float32)
    v = rng.standard_normal(k_shape[:-1] + (options.pop("d_v", k_shape[-1]),)).astype(np.float32)
    if options.get("mask") == "bool":
        options["mask"] = rng.random((q_shape[-2], k_shape[-2])) < 0.7
    elif options.get("mask") == "float":
        options["mask"] = rng.standard_normal((q_shape[-2], k_shape[-2])).astype(np.float32)
    for name in ("alibi_slopes", "sinks"):
        if name in options:
            options[name] = np.asarray(options[name], np.float32)
    return q, k, v, options


@pytest.mark.parametrize("q_shape,k_shape,options", SDPA_BF16_CASES)
def test_sdpa_bf16_within_its_bounds(q_shape, k_shape, options):
    """Against the reference with the operands rounded (the products exact): the kernels also
    round each probability to bfloat16, relative 2**-8 at most, so the output is within
    2**-8 max|v| (and float32's sums). Against the exact reference: logits off by at most E
    (from the operands' rounding) move the weights of a row by at most e**(2E) - 1 in sum,
    and v's rounding and P's add 2**-8 each: |out - exact| <= (e**(2E) - 1 + 2 2**-8) max|v|."""
    q, k, v, kw = _sdpa_case(q_shape, k_shape, dict(options), seed=sum(q_shape) + len(options))
    got = attnlab.scaled_dot_product_attention(q, k, v, precision="bf16", **kw)
    same = reference.scaled_dot_product_attention(q, k, v, precision="bf16", **kw)
    exact = reference.scaled_dot_product_attention(q, k, v, **kw)
    if kw.get("return_weights"):
        (got, w_got), (same, w_same), (exact, _) = got, same, exact
        np.testing.assert_allclose(w_got, w_same, rtol=1e-4, atol=1e-6)  # float32 weights
    assert got.dtype == np.float32
    vmax = float(np.abs(v).max())
    assert np.abs(got - same).max() <= 2.0**-8 * vmax * 1.01 + 1e-5
    scale = kw.get("scale", 1 / np.sqrt(q_shape[-1]))
    e = _logit_error_bound(q, k, scale)
    assert np.abs(got - exact).max() <= (np.expm1(2 * e) + 2 * 2.0**-8) * vmax * 1.01 + 1e-5
    assert np.abs(same - exact).max() > 1e-5 * vmax  # the rounding is really there


def test_sdpa_bf16_nonfinite_values_take_the_careful_path():
    """A value row holding Inf or NaN: only the queries that may see it get Inf/NaN, as in
    float32 (the AMX path hands such calls to the emulation)."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 1, 64, 32)).astype(np.float32) for _ in range(3))
    v[0, 0, 40, 3] = np.nan
    got = attnlab.scaled_dot_product_attention(q, k, v, causal=True, precision="bf16")
    ref = attnlab.scaled_dot_product_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[0, 0, 40:, 3]).all() and not np.isnan(got[0, 0, :40]).any()


def test_sdpa_bf16_amx_and_emulation_agree():
    """Both kernels round the same operands; the probabilities may round differently where the
    running maximum moves at another key (AMX blocks of 64 queries, the emulation's of 96):
    within 2**-8 max|v|."""
    info = attnlab.build_info()
    if info["bf16_kernel"] != "amx":
        pytest.skip(f"this CPU runs the {info['bf16_kernel']} bf16 kernel: no AMX to compare")
    code = (
        "import sys, numpy as np, attnlab; rng = np.random.default_rng(9); "
        "q, k, v = (rng.standard_normal((2, 3, 150, 64)).astype(np.float32) for _ in range(3)); "
        "o = attnlab.scaled_dot_product_attention(q, k, v, causal=True, precision='bf16'); "
        "np.save(sys.argv[1], o)"
    )
    pkg = str(Path(attnlab.__file__).resolve().parents[1])
    outs = []
    for amx in ("1", "0"):
        env = dict(os.environ, ATTNLAB_AMX=amx, ATTNLAB_AVX512_BF16="0")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"attnlab-bf16-{os.getpid()}-{amx}.npy"
        subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True)
        outs.append(np.load(path))
        path.unlink()
    rng = np.random.default_rng(9)
    v = [rng.standard_normal((2, 3, 150, 64)) for _ in range(3)][2].astype(np.float32)
    assert np.abs(outs[0] - outs[1]).max() <= 2.0**-8 * float(np.abs(v).max())


@pytest.mark.parametrize("options", [{}, {"causal": True, "num_kv_heads": 1}])
def test_sdpa_bf16_gradients_and_vjp(options):
    """Gradients in float32 at the rounded operands: within 4 2**-8 of the exact float64
    gradients' largest entry; vjp gives the same."""
    rng = np.random.default_rng(10)
    kv = options.pop("num_kv_heads", 2)
    q = rng.standard_normal((2, 2, 40, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, kv, 40, 16)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((2, 2, 40, 16)).astype(np.float32)
    grads = attnlab.scaled_dot_product_attention_backward(g, q, k, v, precision="bf16", **options)
    exact = attnlab.scaled_dot_product_attention_backward(
        *(a.astype(np.float64) for a in (g, q, k, v)), **options
    )
    for name, gr in grads.items():
        assert gr.dtype == np.float32
        assert np.abs(gr - exact[name]).max() <= 4 * 2.0**-8 * np.abs(exact[name]).max()
    out, pull = attnlab.vjp(
        attnlab.scaled_dot_product_attention, q, k, v, precision="bf16", **options
    )
    np.testing.assert_array_equal(
        out, attnlab.scaled_dot_product_attention(q, k, v, precision="bf16", **options)
    )
    for name, gr in pull(g).items():
        np.testing.assert_allclose(gr, grads[name], rtol=1e-5, atol=1e-6)


def test_sdpa_precision_errors():
    q = np.ones((1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"precision: 'bf16' .* float32 inputs, got float64"):
        attnlab.scaled_dot_product_attention(q, q, q, precision="bf16")
    with pytest.raises(ValueError, match="precision: expected None or 'bf16', got 'tf32'"):
        attnlab.scaled_dot_product_attention(q, q, q, precision="tf32")


@pytest.mark.parametrize("bias", [False, True])
def test_linear_without_features_writes_the_bias(bias):
    """An empty sum over no input feature is the bias (or 0) on either kernel."""
    x = np.zeros((5, 0), np.float32)
    w = np.zeros((0, 7), np.float32)
    b = np.arange(7, dtype=np.float32) if bias else None
    for bf16 in (False, True):
        y = np.full((5, 7), np.nan, np.float32)
        core.linear_forward(x, w, b, y, bf16)
        np.testing.assert_array_equal(y, np.broadcast_to(b if bias else 0.0, y.shape))
