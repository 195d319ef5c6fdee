"""The float GEMM's per-CPU blocking (issue 30): B packed once per call for tall inputs, long
depth chunks with AVX-512. Whatever the blocking, every output element is the same chains of
FMAs (at most 256 products each, added in depth order), so the results must not depend on the
row count of the call, on the thread count, nor on which blocking this CPU chose. Also the
blocked sums' accuracy, and ``core.linear_backward`` (the gradients without transposed
copies)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import attnlab
from attnlab._loader import core
from conftest import cpuinfo, in_fresh_process

DTYPES = [np.float32, np.float64]


@pytest.fixture
def restore_threads():
    before = attnlab.get_num_threads()
    yield
    attnlab.set_num_threads(before)


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = np.empty((x.shape[0], w.shape[1]), x.dtype)
    core.linear_forward(x, w, b, y, False)
    return y


def _same_at_thread_counts(counts: tuple[int, ...], call: Callable[[], np.ndarray]) -> np.ndarray:
    """``call()`` at each thread count in turn: the same bits every time; that result."""
    results = []
    for t in counts:
        attnlab.set_num_threads(t)
        results.append(call())
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    return results[0]


def test_build_info_names_the_blocking():
    """The AVX-512 variant packs B once in long depth chunks (Intel and Zen 4 alike; on Intel
    its kernels also request the packed rows ahead), so does AVX2 on a CPU whose L2 holds 1 MiB
    or more per core, and in chunks of 256 with a smaller L2; the generic build keeps the
    default; a native build may be any of them."""
    info = attnlab.build_info()
    name = info["gemm_blocking"]
    assert isinstance(info["l2_cache_bytes"], int) and info["l2_cache_bytes"] >= 0
    avx2 = "avx2-large-l2:" if info["l2_cache_bytes"] >= 1 << 20 else "avx2:"
    vendor = cpuinfo()[0] or None
    avx512 = (
        ("avx512-intel:",)
        if vendor == "GenuineIntel"
        else ("avx512:", "avx512-intel:")
        if vendor is None
        else ("avx512:",)
    )
    expected = {"avx512": avx512, "avx2": (avx2,), "generic": ("default:",)}
    choices = expected.get(info["isa"], avx512 + (avx2, "default:"))
    assert name.startswith(choices), (info["isa"], name)


# Products whose blocking differs between the choices: a tall call (B packed once), depths of
# several chunks of 256, 512 and 2048, weight gradients (A^T), layers forward and backward, and
# half-precision operands; printed as the variant, the blocking and a hash of the results.
_BLOCKING_PROBE = """
import hashlib, numpy as np, attnlab
from attnlab._loader import core
h = hashlib.sha256()
rng = np.random.default_rng(33)
names = ("w_q", "w_k", "w_v", "w_o")
for dt in (np.float32, np.float64):
    for rows, depth, cols in ((1000, 300, 700), (300, 2100, 200), (129, 1100, 96), (5, 600, 50)):
        x = rng.standard_normal((rows, depth)).astype(dt)
        w = (rng.standard_normal((depth, cols)) / 30).astype(dt)
        y = np.empty((rows, cols), dt)
        core.linear_forward(x, w, None, y, False)
        dy = rng.standard_normal((rows, cols)).astype(dt)
        dx, dw = np.empty_like(x), np.empty_like(w)
        core.linear_backward(x, w, dy, dx, dw, None)
        for a in (y, dx, dw):
            h.update(a.tobytes())
    x = rng.standard_normal((3, 200, 640)).astype(dt)
    ws = {n: (rng.standard_normal((640, 640)) / 25).astype(dt) for n in names}
    h.update(attnlab.multi_head_attention(x, num_heads=10, **ws).tobytes())
    g = attnlab.multi_head_attention_backward(x, x, num_heads=10, **ws)
    for k in sorted(g):
        h.update(np.asarray(g[k]).tobytes())
x16 = rng.standard_normal((2, 300, 640)).astype(np.float16)
w16 = {n: (rng.standard_normal((640, 640)) / 25).astype(np.float16) for n in names}
h.update(attnlab.multi_head_attention(x16, num_heads=10, **w16).tobytes())
info = attnlab.build_info()
print(info["isa"], info["gemm_blocking"].split(":")[0], h.hexdigest())
"""


@pytest.mark.parametrize("isa", ["in use", "avx2"])
def test_blocking_choice_gives_the_same_bits(isa):
    """Whatever blocking the CPU chose, ``ATTNLAB_GEMM_BLOCKING=default`` (the default blocking
    forced) gives the same bits: each run in its own process."""
    from attnlab._loader import available

    info = attnlab.build_info()
    if isa == "avx2" and ("avx2" not in info["built_isas"] or "avx2" not in available()):
        pytest.skip("the avx2 variant is not built or this CPU cannot run it")
    isa_env = {"ATTNLAB_ISA": "avx2"} if isa == "avx2" else {}
    runs = [
        in_fresh_process(_BLOCKING_PROBE, ATTNLAB_GEMM_BLOCKING=blocking, **isa_env).split()
        for blocking in (None, "default")
    ]
    chosen, forced = runs
    assert forced[1] == "default", forced
    assert chosen[0] == forced[0], (chosen, forced)
    assert chosen[2] == forced[2], (chosen, forced)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
# 700 columns: whole 3-packet panels and a narrower last one for every packet size
@pytest.mark.parametrize("cols", [768, 700])
def test_tall_rows_equal_short_calls_bitwise(dtype, cols):
    """A call of many row chunks (B packed once, where chosen) gives the rows of short calls
    (B packed by the row chunk's own task, or read in place for a few rows), bit for bit."""
    rng = np.random.default_rng(30)
    x = rng.standard_normal((1000, 300)).astype(dtype)
    w = (rng.standard_normal((300, cols)) / 17).astype(dtype)
    b = rng.standard_normal(cols).astype(dtype)
    tall = _linear(x, w, b)
    # fewer rows than a row block (8 with AVX-512, 4 else) read B in place, unpacked
    for r0, r1 in ((0, 128), (128, 384), (900, 1000), (5, 13), (7, 8), (20, 23), (995, 1000)):
        np.testing.assert_array_equal(_linear(x[r0:r1], w, b), tall[r0:r1])
    exact = x.astype(np.float64) @ w.astype(np.float64) + b
    eps = np.finfo(dtype).eps
    bound = 300 * eps * (np.abs(x) @ np.abs(w) + np.abs(b)).astype(np.float64)
    assert np.all(np.abs(tall - exact) <= bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.usefixtures("restore_threads")
def test_tall_linear_bitwise_for_any_thread_count(dtype):
    rng = np.random.default_rng(31)
    x = rng.standard_normal((700, 2100)).astype(dtype)  # depth above one chunk of 2048
    w = (rng.standard_normal((2100, 200)) / 45).astype(dtype)
    _same_at_thread_counts((1, 2, 3, 1), lambda: _linear(x, w, None))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("rows", [128, 300])
@pytest.mark.usefixtures("restore_threads")
def test_short_linear_bitwise_for_any_thread_count(dtype, rows):
    """Calls of few row chunks split their columns into more tasks the more threads there are
    (at least 8 per thread: one panel each at 2 threads and more): the same bits at 1 to 4
    threads, with a bias and a narrower last panel (700 columns)."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 768)).astype(dtype)
    w = (rng.standard_normal((768, 700)) / 28).astype(dtype)
    b = rng.standard_normal(700).astype(dtype)
    y = _same_at_thread_counts((1, 2, 3, 4), lambda: _linear(x, w, b))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("restore_threads")
def test_tall_backward_bitwise_for_any_thread_count():
    """The input and weight gradients of a layer of 2 x 200 tokens (more than two row chunks)."""
    rng = np.random.default_rng(32)
    x = rng.standard_normal((2, 200, 96)).astype(np.float32)
    w = {
        n: (rng.standard_normal((96, 96)) / 10).astype(np.float32)
        for n in ("w_q", "w_k", "w_v", "w_o")
    }
    g = rng.standard_normal((2, 200, 96)).astype(np.float32)
    grads = []
    for t in (1, 2):
        attnlab.set_num_threads(t)
        grads.append(attnlab.multi_head_attention_backward(g, x, num_heads=4, **w))
    for name in grads[0]:
        np.testing.assert_array_equal(grads[1][name], grads[0][name], err_msg=name)


def test_blocked_sums_keep_deep_products_accurate():
    """Chains of at most 256 products: a 1024- and a 4096-deep float32 product stay within
    4.5e-7 of the float64 one, normwise (one chain over the depth does not: docs/performance.md,
    "GEMMs in blocked sums")."""
    rng = np.random.default_rng(4)
    for depth in (1024, 4096):
        x = rng.standard_normal((256, depth)).astype(np.float32)
        w = (rng.standard_normal((depth, 512)) / np.sqrt(depth)).astype(np.float32)
        exact = x.astype(np.float64) @ w.astype(np.float64)
        err = np.linalg.norm(_linear(x, w, None) - exact) / np.linalg.norm(exact)
        assert err < 4.5e-7, (depth, err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_linear_backward_matches_the_products(dtype, rows):
    """dx = dy w^T (or added to dx), dw = x^T dy, db = the column sums of dy, with x and dx read
    and written as rows of a stride of their own; outputs not asked for untouched."""
    rng = np.random.default_rng(rows)
    d_in, d_out = 40, 24
    xbig = rng.standard_normal((rows, d_in + 5)).astype(dtype)
    x = xbig[:, :d_in]  # rows d_in + 5 apart
    w = rng.standard_normal((d_in, d_out)).astype(dtype)
    dy = rng.standard_normal((rows, d_out)).astype(dtype)
    dxbig = np.full((rows, d_in + 3), 7.0, dtype)
    dx = dxbig[:, :d_in]
    dw, db = np.full((d_in, d_out), np.nan, dtype), np.full(d_out, np.nan, dtype)
    core.linear_backward(x, w, dy, dx, dw, db)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    np.testing.assert_allclose(dx, dy64 @ w64.T, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(dw, x64.T @ dy64, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(db, dy64.sum(axis=0), rtol=tol, atol=tol * 10)
    assert np.all(dxbig[:, d_in:] == 7.0)  # the stride's gap untouched
    before = dx.copy()
    core.linear_backward(x, w, dy, dx, None, None, True)
    np.testing.assert_allclose(dx, before + dy64 @ w64.T, rtol=tol, atol=tol * 10)


def test_linear_backward_refuses_bad_arrays():
    x, w, dy = np.ones((3, 4), np.float32), np.ones((4, 2), np.float32), np.ones((3, 2), np.float32)
    with pytest.raises(ValueError, match="x, w, dy: expected 2-d arrays"):
        core.linear_backward(x[0], w, dy, None, np.empty((4, 2), np.float32), None)
    with pytest.raises(ValueError, match="dw: shape"):
        core.linear_backward(x, w, dy, None, np.empty((2, 4), np.float32), None)
    with pytest.raises(TypeError, match="dx: unexpected dtype"):
        core.linear_backward(x, w, dy, np.empty((3, 4)), None, None)
    overlapping = np.lib.stride_tricks.as_strided(np.ones(8, np.float32), (3, 4), (8, 4))
    with pytest.raises(ValueError, match="dx: rows overlap"):
        core.linear_backward(x, w, dy, overlapping, None, None)
    with pytest.raises(TypeError, match="dy: expected float32 or float64"):
        core.linear_backward(x, w, dy.astype(np.int32), None, None, None)


def _composed_layer(
    x: np.ndarray, mem: np.ndarray, h: int, project: Callable[[np.ndarray, str], np.ndarray]
) -> np.ndarray:
    """The multi-head layer composed from its parts: ``project(rows, name)`` for each of the
    Q, K, V projections (``name`` "w_q", "w_k", "w_v"), the attention core over their heads,
    and the attention output's rows (B * n, h * d_head) returned for the output projection."""
    B, n, d = x.shape
    nk = mem.shape[1]

    def heads(rows: np.ndarray, m: int) -> np.ndarray:
        return rows.reshape(B, m, h, -1).transpose(0, 2, 1, 3)

    q = heads(project(x.reshape(B * n, d), "w_q"), n)
    k = heads(project(mem.reshape(B * nk, d), "w_k"), nk)
    v = heads(project(mem.reshape(B * nk, d), "w_v"), nk)
    ctx = attnlab.scaled_dot_product_attention(q, k, v).transpose(0, 2, 1, 3).reshape(B * n, -1)
    return np.ascontiguousarray(ctx)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize(
    "B, n, d, h, n_k",
    [(1, 128, 96, 4, None), (2, 37, 64, 2, 50), (3, 300, 48, 3, None), (1, 1, 40, 5, 7)],
)
@pytest.mark.usefixtures("restore_threads")
def test_layer_projections_run_together_give_linear_bits(dtype, B, n, d, h, n_k):
    """The multi-head forward runs its Q, K and V projections' tasks in one parallel region
    (``linear_group``): the layer equals, bit for bit, its composition from separate
    ``linear_forward`` calls and the attention core, at 1 and 2 threads, and with weights
    given as ``PackedWeight``."""
    rng = np.random.default_rng(31)
    x = rng.standard_normal((B, n, d)).astype(dtype)
    mem = x if n_k is None else rng.standard_normal((B, n_k, d)).astype(dtype)
    w = {k: (rng.standard_normal((d, d)) / 8).astype(dtype) for k in ("w_q", "w_k", "w_v", "w_o")}
    b = {k: rng.standard_normal(d).astype(dtype) for k in ("b_q", "b_k", "b_v", "b_o")}
    ctx = _composed_layer(x, mem, h, lambda rows, name: _linear(rows, w[name], b["b" + name[1:]]))
    want = _linear(ctx, w["w_o"], b["b_o"]).reshape(B, n, d)
    key = None if n_k is None else mem
    packed = {name: attnlab.PackedWeight(a) for name, a in w.items()}
    for weights in (w, packed):
        got = _same_at_thread_counts(
            (1, 2), lambda ws=weights: attnlab.multi_head_attention(x, key, num_heads=h, **ws, **b)
        )
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("B, n, d, h, n_k", [(1, 128, 96, 4, None), (2, 37, 64, 2, 50)])
@pytest.mark.usefixtures("restore_threads")
def test_half_layer_projections_run_together_give_linear_bits(half, B, n, d, h, n_k):
    """The same with inputs, weights and biases stored in float16 or bfloat16 (read as stored,
    float32 products): the projections, widened by their tasks in one parallel region, equal
    ``linear_forward`` on the bits, one call each, at 1 and 2 threads."""
    ml_dtypes = pytest.importorskip("ml_dtypes") if half == "bfloat16" else None
    hd = np.dtype(np.float16) if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)
    code = 1 if half == "float16" else 2
    rng = np.random.default_rng(33)
    x = rng.standard_normal((B, n, d)).astype(hd)
    mem = x if n_k is None else rng.standard_normal((B, n_k, d)).astype(hd)
    w = {k: (rng.standard_normal((d, d)) / 8).astype(hd) for k in ("w_q", "w_k", "w_v", "w_o")}
    b = {k: rng.standard_normal(d).astype(hd) for k in ("b_q", "b_k", "b_v", "b_o")}

    def project(rows: np.ndarray, name: str, out_half: bool = False) -> np.ndarray:
        y = np.empty((rows.shape[0], d), np.uint16 if out_half else np.float32)
        bias = b["b" + name[1:]].astype(np.float32)
        x_half = rows.dtype == hd
        xr = rows.view(np.uint16) if x_half else rows
        core.linear_forward(xr, w[name].view(np.uint16), bias, y, False, code, x_half, out_half)
        return y

    ctx = _composed_layer(x, mem, h, project)
    want = project(ctx, "w_o", out_half=True).view(hd).reshape(B, n, d)
    key = None if n_k is None else mem
    got = _same_at_thread_counts(
        (1, 2), lambda: attnlab.multi_head_attention(x, key, num_heads=h, **w, **b)
    )
    assert got.dtype == hd and got.tobytes() == want.tobytes()
