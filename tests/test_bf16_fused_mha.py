"""multi_head_attention(precision="bf16") runs as one C++ call. On AMX or AVX512-BF16,
self-attention with head widths that are multiples of 32 takes the fused forward (x packed once,
Q, K, V rounded to bf16 from the GEMM's sums into the attention's layouts, the context written as
the output GEMM's bf16 rows); every other call composes the same kernels. Either way the result
is bitwise that of the composition of the public kernels: three bf16 projections, the bf16
attention core, the bf16 output projection."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab._loader import core
from conftest import VDPBF16PS, require_vdpbf16ps, rerun_tests

# the fused forward runs on the bf16 hardware kernels (not on the emulation)
FUSES = attnlab.build_info()["bf16_kernel"] in ("amx", "avx512_bf16")


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = np.empty((x.shape[0], w.shape[1]), np.float32)
    core.linear_forward(x, w, b, y, True)
    return y


def _composed(
    x: np.ndarray, w: dict[str, Any], h: int, hk: int, kv: np.ndarray | None = None, **opts: Any
) -> np.ndarray:
    """The layer from its parts: the bf16 projections and the bf16 attention core."""
    kv = x if kv is None else kv
    B, n, d = x.shape
    m = kv.shape[1]

    def heads(y: np.ndarray, rows: int, count: int) -> np.ndarray:
        return y.reshape(B, rows, count, -1).transpose(0, 2, 1, 3)

    q = heads(_linear(x.reshape(-1, d), w["w_q"], w.get("b_q")), n, h)
    k = heads(_linear(kv.reshape(B * m, -1), w["w_k"], w.get("b_k")), m, hk)
    v = heads(_linear(kv.reshape(B * m, -1), w["w_v"], w.get("b_v")), m, hk)
    ctx = attnlab.scaled_dot_product_attention(q, k, v, precision="bf16", **opts)
    if isinstance(ctx, tuple):  # with the weights or the log-sum-exp
        ctx = ctx[0]
    rows = np.ascontiguousarray(ctx.transpose(0, 2, 1, 3)).reshape(B * n, -1)
    return _linear(rows, w["w_o"], w.get("b_o")).reshape(B, n, -1)


def _layer(
    rng: np.random.Generator,
    d: int,
    h: int,
    hk: int,
    dh: int,
    dv: int,
    biases: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    shapes = {
        "w_q": (d, h * dh),
        "w_k": (d, hk * dh),
        "w_v": (d, hk * dv),
        "w_o": (h * dv, d),
    }
    w = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
    for b in biases:
        w[b] = rng.standard_normal(shapes["w_" + b[2:]][1]).astype(np.float32)
    return w


def _check(x, w, h, hk, fused, kv=None, **opts):
    """The call against the composition, bitwise; whether the fused forward ran."""
    before = core.mha_bf16_fused_calls()
    keys = {} if kv is None else {"key": kv, "value": kv}
    got = attnlab.multi_head_attention(
        x, **keys, **w, num_heads=h, num_kv_heads=hk, precision="bf16", **opts
    )
    ran = core.mha_bf16_fused_calls() - before
    assert ran == (1 if fused and FUSES else 0)
    sdpa = {k: v for k, v in opts.items() if k != "key_padding_mask"}  # as a mask here
    if "key_padding_mask" in opts:
        sdpa["mask"] = opts["key_padding_mask"][:, None, None, :]
    ref = _composed(x, w, h, hk, kv, **sdpa)
    np.testing.assert_array_equal(got, ref)
    assert got.dtype == np.float32
    return got


# (batch, tokens, features, heads, kv heads, d_head, d_vhead, biases): tokens that are not a
# multiple of 16 put batch boundaries inside the 16-row groups V is transposed in
SHAPES = [
    (4, 197, 192, 3, 3, 64, 64, ("b_q", "b_k", "b_v", "b_o")),
    (2, 50, 96, 2, 1, 32, 64, ()),
    (3, 17, 40, 2, 2, 32, 32, ("b_v",)),
    (1, 130, 64, 1, 1, 64, 32, ("b_o",)),
    (2, 70, 100, 4, 2, 32, 32, ("b_k",)),
    (1, 1, 32, 1, 1, 32, 32, ()),
    (1, 64, 1000, 2, 2, 128, 96, ("b_q",)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:7])))
@pytest.mark.parametrize("causal", [False, True])
def test_fused_equals_the_composition(shape, causal):
    B, n, d, h, hk, dh, dv, biases = shape
    rng = np.random.default_rng(n * d + h)
    x = rng.standard_normal((B, n, d)).astype(np.float32)
    w = _layer(rng, d, h, hk, dh, dv, biases)
    # a single query is the decode path's, which the fused forward leaves to the composition
    _check(x, w, h, hk, fused=n > 1, causal=causal)


@pytest.mark.parametrize(
    "opts",
    [
        {"softcap": 5.0},
        {"window": (8, 3)},
        {"scale": 0.3},
        {"sinks": np.array([0.5, -1.0, 2.0], np.float32)},
        {"alibi_slopes": np.array([0.5, 0.25, 0.125], np.float32)},
        "key_padding_mask",
    ],
    ids=["softcap", "window", "scale", "sinks", "alibi", "key_padding_mask"],
)
def test_fused_with_masks_and_options(opts):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 45, 96)).astype(np.float32)
    w = _layer(rng, 96, 3, 3, 32, 32, ("b_q", "b_o"))
    if opts == "key_padding_mask":
        keep = rng.random((3, 45)) > 0.3
        keep[1] = False  # a batch item with every key masked: zero context, output b_o
        opts = {"key_padding_mask": keep, "warn_empty_rows": False}
    _check(x, w, 3, 3, fused=True, **opts)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_bitwise_for_any_thread_count(threads):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 77, 128)).astype(np.float32)
    w = _layer(rng, 128, 4, 2, 32, 64, ("b_v",))
    before = attnlab.get_num_threads()
    try:
        attnlab.set_num_threads(threads)
        _check(x, w, 4, 2, fused=True)
    finally:
        attnlab.set_num_threads(before)


def test_other_calls_compose_the_same_kernels():
    """Head widths not multiples of 32, cross-attention, weights or the log-sum-exp asked for:
    the composition in C++, the same bits."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 40, 96)).astype(np.float32)
    _check(x, _layer(rng, 96, 2, 2, 48, 48), 2, 2, fused=False)
    _check(x, _layer(rng, 96, 2, 2, 32, 40), 2, 2, fused=False)
    kv = rng.standard_normal((2, 30, 96)).astype(np.float32)
    _check(x, _layer(rng, 96, 2, 2, 32, 32), 2, 2, fused=False, kv=kv)
    w = _layer(rng, 96, 2, 2, 32, 32, ("b_o",))
    before = core.mha_bf16_fused_calls()
    out, weights = attnlab.multi_head_attention(
        x, **w, num_heads=2, precision="bf16", return_weights=True
    )
    out2, lse = attnlab.multi_head_attention(x, **w, num_heads=2, precision="bf16", return_lse=True)
    assert core.mha_bf16_fused_calls() == before
    # with the weights the core takes the emulation (the weights' own rounding), as SDPA does
    np.testing.assert_array_equal(out, _composed(x, w, 2, 2, return_weights=True))
    np.testing.assert_array_equal(out2, _composed(x, w, 2, 2))
    assert weights.shape == (2, 2, 40, 40) and lse.shape == (2, 2, 40)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_values_take_the_careful_path(bad):
    """A NaN or Inf in V (here from x): the fused forward gives up before writing anything and
    the composition runs the attention's careful path; the same bits either way."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 33, 64)).astype(np.float32)
    x[1, 7, :] = bad
    w = _layer(rng, 64, 2, 2, 32, 32)
    before = core.mha_bf16_fused_calls()
    got = attnlab.multi_head_attention(x, **w, num_heads=2, precision="bf16")
    assert core.mha_bf16_fused_calls() == before
    np.testing.assert_array_equal(got, _composed(x, w, 2, 2))
    assert np.isfinite(got[0]).all()


def test_core_refuses_bf16_with_float64():
    """The binding's own checks (the Python layer never sends these)."""
    x = np.ones((4, 8))
    w = {n: np.eye(8) for n in ("w_q", "w_k", "w_v", "w_o")}
    mask = (None, None, 0, -1, -1, 0.0, None, None)
    kw = dict(
        query=x, key=x, value=x, w_q=w["w_q"], b_q=None, w_k=w["w_k"], b_k=None,
        w_v=w["w_v"], b_v=None, w_o=w["w_o"], b_o=None,
        batch=1, n_q=4, n_k=4, heads=2, kv_heads=2, mask=mask, scale=0.5, weights_half=0,
        inputs_half=0, packed=None,
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"^bf16: bf16 products take float32 operands, got float64"):
        core.mha_forward(core.MhaArgs(**kw), np.empty((4, 8)), None, None, True)


def test_fused_on_vdpbf16ps_without_amx():
    """This file's tests again with AMX off and the VDPBF16PS kernel on (the switches are read
    once per process: a subprocess), where the CPU has AVX512-BF16."""
    require_vdpbf16ps()
    rerun_tests(__file__, "not without_amx and not on_the_emulation", **VDPBF16PS)


try:
    import ml_dtypes

    HALVES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
except ImportError:  # bfloat16 has no NumPy name without it
    HALVES = [np.dtype(np.float16)]

# (label, batch, tokens, features, heads, kv heads, d_head, d_vhead, cross, return_weights):
# the fused forward, then the composed bf16 kernels (cross-attention, a head width that is not
# a multiple of 32, one token: the decode path, the attention weights asked for)
HALF_CASES = [
    ("fused", 2, 37, 96, 3, 3, 32, 32, False, False),
    ("fused-100", 1, 33, 100, 2, 2, 32, 32, False, False),
    ("cross", 2, 19, 64, 2, 1, 32, 64, True, False),
    ("d_head-24", 1, 21, 48, 2, 2, 24, 24, False, False),
    ("one-token", 3, 1, 64, 2, 2, 32, 32, False, False),
    ("weights", 1, 9, 64, 2, 2, 32, 32, False, True),
]


@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_half_weights_read_as_stored(case, half):
    """precision="bf16" with the four weights stored in float16 or bfloat16: the C++ call reads
    their bits as stored and rounds them to bf16 as it packs them, bit for bit the call on the
    same weights widened to float32 first (which the Python layer used to do)."""
    from attnlab import _mha

    label, B, n, d, h, hk, dh, dv, cross, ret = case
    rng = np.random.default_rng(n * d)
    x = rng.standard_normal((B, n, d)).astype(np.float32)
    w = {k: v.astype(half) for k, v in _layer(rng, d, h, hk, dh, dv, ("b_q", "b_o")).items()}
    w["b_q"], w["b_o"] = w["b_q"].astype(np.float32), w["b_o"].astype(np.float32)
    wide = {k: v.astype(np.float32) for k, v in w.items()}
    kv = {"key": rng.standard_normal((B, n + 3, d)).astype(np.float32)} if cross else {}
    kw = dict(**kv, num_heads=h, num_kv_heads=hk, precision="bf16", return_weights=ret)
    before = core.mha_bf16_fused_calls()
    got = attnlab.multi_head_attention(x, **w, **kw)
    assert core.mha_bf16_fused_calls() - before == (1 if label.startswith("fused") and FUSES else 0)
    ref = attnlab.multi_head_attention(x, **wide, **kw)
    for g, r in zip(got, ref, strict=True) if ret else [(got, ref)]:
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, r)
    # the weights reached the kernel as their bits, not as float32 copies
    bound = inspect.signature(attnlab.multi_head_attention).bind(x, **w, **kw)
    bound.apply_defaults()
    prepared = _mha._prepare_mha(dict(bound.arguments), keep_half=True)
    assert prepared.weights_half == (1 if half == np.float16 else 2)


@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_half_inputs_read_as_stored(case, half):
    """precision="bf16" with the inputs stored as the weights are: the C++ call packs their bits
    and writes the result as bits of that dtype (no float32 copy of either), bit for bit the call
    on float32 inputs (which the Python layer used to make), rounded once: fused or composed,
    with a partial last block of 32 output columns (fused-100)."""
    from attnlab import _mha

    label, B, n, d, h, hk, dh, dv, cross, ret = case
    rng = np.random.default_rng(n * d + 1)
    x = rng.standard_normal((B, n, d)).astype(half)
    w = {k: v.astype(half) for k, v in _layer(rng, d, h, hk, dh, dv, ("b_q", "b_o")).items()}
    kv = rng.standard_normal((B, n + 3, d)).astype(half) if cross else None
    keys = {} if kv is None else {"key": kv, "value": kv}
    kw = dict(num_heads=h, num_kv_heads=hk, precision="bf16", return_weights=ret)
    bound = inspect.signature(attnlab.multi_head_attention).bind(x, **keys, **w, **kw)
    bound.apply_defaults()
    assert _mha._prepare_mha(dict(bound.arguments), keep_half=True).inputs_half
    before = core.mha_bf16_fused_calls()
    got = attnlab.multi_head_attention(x, **keys, **w, **kw)
    assert core.mha_bf16_fused_calls() - before == (1 if label.startswith("fused") and FUSES else 0)
    wide = {k: v.astype(np.float32) for k, v in keys.items()}
    ref = attnlab.multi_head_attention(x.astype(np.float32), **wide, **w, **kw)
    for g, r in zip(got, ref, strict=True) if ret else [(got, ref)]:
        assert g.dtype == half
        np.testing.assert_array_equal(g.view(np.uint16), r.astype(half).view(np.uint16))


@pytest.mark.parametrize("half", HALVES, ids=str)
def test_half_inputs_and_weights(half):
    """Every input and weight in the half dtype with precision="bf16": the result in that dtype,
    bit for bit the float32 call on the widened arrays, rounded once."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 40, 64)).astype(half)
    w = {k: v.astype(half) for k, v in _layer(rng, 64, 2, 2, 32, 32, ("b_k",)).items()}
    got = attnlab.multi_head_attention(x, **w, num_heads=2, precision="bf16")
    wide = {k: v.astype(np.float32) for k, v in w.items()}
    ref = attnlab.multi_head_attention(x.astype(np.float32), **wide, num_heads=2, precision="bf16")
    assert got.dtype == half
    np.testing.assert_array_equal(got.astype(np.float32), ref.astype(half).astype(np.float32))


def test_half_weights_on_the_emulation():
    """The half-weight tests again where no bf16 hardware kernel runs (the emulated rounding on
    the float32 GEMM): the AVX2 build, in a subprocess (the build is chosen once per process)."""
    if "avx2" not in attnlab.build_info()["available_isas"]:
        pytest.skip("no AVX2 build in this module (another CPU family)")
    rerun_tests(
        __file__,
        "half_weights_read_as_stored or half_inputs_read_as_stored or half_inputs_and_weights",
        ATTNLAB_ISA="avx2",
    )
