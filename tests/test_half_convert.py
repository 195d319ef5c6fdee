"""Half precision at the boundary: the conversions (core.widen_half / narrow_half, used for every
float16 / bfloat16 argument and result) against NumPy's and ml_dtypes' ``astype`` (bit for bit,
NaN kept as NaN, over every bit pattern, the edges of each format and odd shapes), and the
multi-head attention weights its fused forward reads as stored (bit for bit the widened call)."""

import numpy as np
import pytest

from attnlab import _half
from attnlab._loader import core
from conftest import refuse_conversions

ml_dtypes = pytest.importorskip("ml_dtypes")

FORMATS = [(1, np.dtype(np.float16)), (2, np.dtype(ml_dtypes.bfloat16))]


def _same(got_bits, want_bits, dtype):
    """Equal bits where the value is a number, NaN where it is NaN."""
    got, want = got_bits.view(dtype), want_bits.view(dtype)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])


@pytest.mark.parametrize("code,dtype", FORMATS)
def test_widen_is_astype_on_every_bit_pattern(code, dtype):
    bits = np.arange(2**16, dtype=np.uint16)
    got = np.empty(bits.shape, np.float32)
    core.widen_half(bits, got, code)
    want = bits.view(dtype).astype(np.float32)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.parametrize("code,dtype", FORMATS)
def test_narrow_rounds_as_astype(code, dtype):
    rng = np.random.default_rng(code)
    edges = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.996, 65520, 1e-8, 6e-8, 3e-38, 1e-40,
         3.4e38, -3.4e38, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11],
        np.float32,
    )  # fmt: skip
    random_bits = rng.integers(0, 2**32, size=100_003, dtype=np.uint32).view(np.float32)
    x = np.concatenate([edges, random_bits, rng.standard_normal(50_001).astype(np.float32)])
    got = np.empty(x.shape, np.uint16)
    core.narrow_half(x, got, code)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(dtype).view(np.uint16)
    _same(got, want, dtype)


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (15,), (17, 3), (2, 3, 4, 5, 6)])
def test_widen_and_store_keep_shapes_and_strides(dtype, shape):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal((2,) + shape).astype(np.float32)[1]  # a view, maybe not contiguous
    h = np.asarray(x.astype(dtype))
    if h.ndim >= 2:
        h = h.swapaxes(0, 1)  # not C-contiguous
    w = _half.widen(h)
    assert w.dtype == np.float32 and w.shape == h.shape
    np.testing.assert_array_equal(w, h.astype(np.float32))
    s = _half.store(w, dtype)
    assert s.dtype == dtype and s.shape == h.shape
    np.testing.assert_array_equal(s.view(np.uint16), h.astype(dtype).view(np.uint16))


def test_conversions_refuse_wrong_arrays():
    f, u = np.zeros(4, np.float32), np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="half: expected 1"):
        core.widen_half(u, f, 3)
    with pytest.raises(TypeError, match="src: expected a C-contiguous uint16"):
        core.widen_half(f, f, 1)
    with pytest.raises(ValueError, match="dst: expected 4 elements, got 3"):
        core.narrow_half(f, np.zeros(3, np.uint16), 2)
    with pytest.raises(TypeError, match="src: expected a C-contiguous float32"):
        core.narrow_half(np.zeros(8, np.float32)[::2], u, 1)


def _mha_case(rng, dtype, cross, h_kv):
    d, h = 32, 4
    x = rng.standard_normal((2, 7, d)).astype(dtype)
    kv = rng.standard_normal((2, 11, 24)).astype(dtype) if cross else None
    d_kv = 24 if cross else d
    w = {
        "w_q": rng.standard_normal((d, d)) / 6,
        "w_k": rng.standard_normal((d_kv, (h_kv or h) * 8)) / 6,
        "w_v": rng.standard_normal((d_kv, (h_kv or h) * 8)) / 6,
        "w_o": rng.standard_normal((d, 16)) / 6,
    }
    w = {n: a.astype(dtype) for n, a in w.items()}
    return x, kv, w, {"num_heads": h, "num_kv_heads": h_kv}


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("h_kv", [None, 2])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"return_weights": True, "return_lse": True},
        {"return_weights": "mean", "causal": True},
        {"padding": True},
    ],
    ids=["plain", "causal", "weights_lse", "mean_weights", "key_padding"],
)
def test_half_weights_read_as_stored_are_the_widened_call(dtype, cross, h_kv, options):
    """Weights stored in one half dtype go to the fused forward as their bits (its GEMMs widen
    them while packing), the attention weights are rounded by the kernel as it writes them
    (their mean over the heads taken in float32 first): every output is bit for bit the call
    on float32 copies, rounded."""
    import attnlab

    rng = np.random.default_rng(7)
    x, kv, w, kw = _mha_case(rng, dtype, cross, h_kv)
    options = dict(options)
    if options.pop("padding", False):
        kw["key_padding_mask"] = np.arange(11 if cross else 7) >= 5
    b_o = rng.standard_normal(16).astype(dtype)
    got = attnlab.multi_head_attention(x, kv, kv, **w, b_o=b_o, **kw, **options)
    f32 = {n: a.astype(np.float32) for n, a in w.items()}
    kv32 = None if kv is None else kv.astype(np.float32)
    want = attnlab.multi_head_attention(
        x.astype(np.float32), kv32, kv32, **f32, b_o=b_o.astype(np.float32), **kw, **options
    )
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert got[0].dtype == dtype  # the output (and the weights) stored in the half dtype
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.view(np.uint8), r.astype(g.dtype).view(np.uint8))


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize(
    "options",
    [
        {"rope_theta": 1e4, "causal": True},
        {"rope_theta": 1e4, "rope_dim": 4, "return_weights": True, "return_lse": True},
        {"q_norm": "q_norm", "k_norm": "k_norm", "rope_theta": 500.0},
        {"q_norm": "q_norm", "rope_theta": 1e4, "precision": "bf16", "causal": True},
    ],
    ids=["rope_causal", "partial_rope_weights_lse", "qk_norm_rope", "bf16_norm_rope"],
)
def test_rotary_and_norms_read_half_weights_and_inputs_as_stored(
    dtype, cross, options, monkeypatch
):
    """Rotary embeddings and q/k norms (with float32 or bf16 products): weights stored in one
    half dtype, and the inputs when stored so too, read as stored by the projections, the
    output rounded by the last one: bit for bit the call on float32 copies, rounded (float32
    inputs: a float32 result); no weight or input widened in Python."""
    import attnlab
    import attnlab._validate

    rng = np.random.default_rng(8)
    x, kv, w, kw = _mha_case(rng, dtype, cross, 2)
    options = dict(options)
    for n in ("q_norm", "k_norm"):
        if n in options:
            options[n] = (1 + rng.standard_normal(8) / 4).astype(dtype)  # stored so too
    f32 = {n: a.astype(np.float32) for n, a in w.items()}
    kv32 = None if kv is None else kv.astype(np.float32)
    x32 = x.astype(np.float32)
    want = attnlab.multi_head_attention(x32, kv32, kv32, **f32, **kw, **options)
    widen = attnlab._validate.widen

    def refuse(a):
        if any(a is b for b in (x, kv, *w.values())):
            raise AssertionError("widened in Python")
        return widen(a)

    monkeypatch.setattr(attnlab._validate, "widen", refuse)
    for inputs, stored in (((x, kv, kv), dtype), ((x32, kv32, kv32), np.float32)):
        got = attnlab.multi_head_attention(*inputs, **w, **kw, **options)
        got_t, want_t = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert got_t[0].dtype == stored
        for i, (g, r) in enumerate(zip(got_t, want_t, strict=True)):
            kind = np.float32 if options.get("return_lse") and i == len(got_t) - 1 else stored
            assert g.dtype == kind
            np.testing.assert_array_equal(g.view(np.uint8), r.astype(kind).view(np.uint8))


def test_half_weights_mixed_with_other_dtypes():
    """float32 inputs with float16 weights compute and return float32, weights read as stored;
    float64 inputs widen the weights with them; weights of two half dtypes widen too; the
    backward, vjp and the composed path (rotary embeddings) take widened weights."""
    import attnlab

    rng = np.random.default_rng(3)
    x, _, w, kw = _mha_case(rng, np.float16, False, None)
    f32 = {n: a.astype(np.float32) for n, a in w.items()}
    x32 = x.astype(np.float32)
    got = attnlab.multi_head_attention(x32, **w, **kw)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, attnlab.multi_head_attention(x32, **f32, **kw))
    got = attnlab.multi_head_attention(x32.astype(np.float64), **w, **kw)
    assert got.dtype == np.float64
    mixed = dict(w, w_o=w["w_o"].astype(ml_dtypes.bfloat16))
    want = attnlab.multi_head_attention(x32, **dict(f32, w_o=mixed["w_o"].astype(np.float32)), **kw)
    np.testing.assert_array_equal(attnlab.multi_head_attention(x32, **mixed, **kw), want)
    transposed = dict(w, w_q=np.ascontiguousarray(w["w_q"].T).T)  # not C-contiguous
    np.testing.assert_array_equal(
        attnlab.multi_head_attention(x32, **transposed, **kw),
        attnlab.multi_head_attention(x32, **f32, **kw),
    )
    rope = attnlab.multi_head_attention(x32, **w, **kw, rope_theta=1e4)
    np.testing.assert_array_equal(
        rope, attnlab.multi_head_attention(x32, **f32, **kw, rope_theta=1e4)
    )
    out, pullback = attnlab.vjp(attnlab.multi_head_attention, x32, **w, **kw)
    np.testing.assert_array_equal(out, attnlab.multi_head_attention(x32, **f32, **kw))
    g = pullback(np.ones_like(out))
    assert g["w_q"].dtype == np.float16


def test_mha_args_refuse_a_bad_weights_half():
    import inspect

    import attnlab
    from attnlab import _mha

    rng = np.random.default_rng(0)
    x, _, w, kw = _mha_case(rng, np.float32, False, None)
    params = inspect.signature(attnlab.multi_head_attention).parameters.values()
    args = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    a = _mha._prepare_mha({**args, "query": x, **w, **kw})
    out = np.empty((14, 16), np.float32)
    with pytest.raises(ValueError, match=r"weights_half: expected 0, 1 .* got 3"):
        core.mha_forward(a._replace(weights_half=3).core_args(), out, None)
    grads = {"w_q": np.empty_like(w["w_q"])}
    half = a._replace(weights_half=1).core_args()  # float32 weights, not their bits
    with pytest.raises(TypeError, match=r"^w_q: "):
        core.mha_backward(np.ones((14, 16), np.float32), half, grads)


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
@pytest.mark.parametrize(("rows", "d"), [(128, 96), (128, 384), (200, 96), (300, 96), (1000, 96)])
def test_half_weights_of_tall_calls_are_the_widened_call(dtype, rows, d):
    """Calls of more than two 128-row chunks may pack the weights once for the call (the
    AVX-512 blocking, `build_info()["gemm_blocking"]`), widening half-precision ones as they
    pack them; shorter ones widen each panel as its first row block packs it, and a thread
    reuses its widened rows of X for its next task on them: still bit for bit the call on
    float32 copies, rounded (a partial last panel too)."""
    import attnlab

    rng = np.random.default_rng(8)
    w = {n: (rng.standard_normal((d, d)) / 10).astype(dtype) for n in ("w_q", "w_k", "w_v")}
    w["w_o"] = (rng.standard_normal((d, 100)) / 10).astype(dtype)
    w32 = {n: a.astype(np.float32) for n, a in w.items()}
    for _ in range(2):  # a second x of the same shape: no widened rows kept from the first
        x = rng.standard_normal((2, rows // 2, d)).astype(dtype)
        got = attnlab.multi_head_attention(x, num_heads=2, **w)
        want = attnlab.multi_head_attention(x.astype(np.float32), num_heads=2, **w32)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.view(np.uint16), want.astype(dtype).view(np.uint16))


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("h_kv", [None, 1])
def test_half_weights_of_few_rows_are_the_widened_call(dtype, n, h_kv):
    """Fewer rows than the GEMM's row block (decode-sized calls) read half-precision weights in
    place, widening them as they load them, instead of widening a copy of each panel: still bit
    for bit the call on float32 copies, rounded (a partial last panel too: w_o has 100 columns)."""
    import attnlab

    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, n, 96)).astype(dtype)
    w = {n_: (rng.standard_normal((96, 96)) / 10).astype(dtype) for n_ in ("w_q", "w_k", "w_v")}
    w["w_o"] = (rng.standard_normal((96, 100)) / 10).astype(dtype)
    if h_kv:
        w["w_k"], w["w_v"] = w["w_k"][:, :48], w["w_v"][:, :48]
    kw = {"num_heads": 2, "num_kv_heads": h_kv}
    got = attnlab.multi_head_attention(x, **w, **kw)
    want = attnlab.multi_head_attention(
        x.astype(np.float32), **{n_: a.astype(np.float32) for n_, a in w.items()}, **kw
    )
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(dtype).view(np.uint16))


def _prepared(x, kv=None, **kw):
    """The prepared multi-head call (_mha._Mha) of these arguments, as the forward sees it."""
    import inspect

    import attnlab
    from attnlab import _mha

    bound = inspect.signature(attnlab.multi_head_attention).bind(x, kv, kv, **kw)
    bound.apply_defaults()
    return _mha._prepare_mha(dict(bound.arguments), keep_half=True)


@pytest.mark.parametrize("code, dtype", FORMATS)
def test_half_inputs_reach_the_kernel_as_bits(code, dtype):
    """Inputs stored as the weights are (float32 or bf16 products) go to the kernel as their
    bits, the output comes back as bits: no float32 copy of either. Not so with an input of
    another dtype, or with float64 biases (the call then computes in float64)."""
    rng = np.random.default_rng(11)
    x, kv, w, kw = _mha_case(rng, dtype, True, 2)
    a = _prepared(x, kv, **w, **kw)
    assert (a.weights_half, a.inputs_half) == (code, True)
    assert a.rq.dtype == a.rk.dtype == np.uint16 and a.dtype == np.float32
    assert _prepared(x, kv, **w, **kw, precision="bf16").inputs_half
    assert not _prepared(x, kv.astype(np.float32), **w, **kw).inputs_half
    assert not _prepared(x.tolist(), kv, **w, **kw).inputs_half  # not an array: widened
    wide = _prepared(x, kv, **w, **kw, b_o=np.zeros(16))
    assert (wide.weights_half, wide.inputs_half, wide.dtype) == (0, False, np.float64)
    # a float32 bias: computed as before, the output float32 (inputs widened, weights as bits)
    f32_bias = _prepared(x, kv, **w, **kw, b_o=np.zeros(16, np.float32))
    assert (f32_bias.weights_half, f32_bias.inputs_half) == (code, False)
    assert f32_bias.rq.dtype == np.float32


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
def test_half_inputs_with_a_float32_bias_or_a_float_mask(dtype):
    """A float32 bias makes the result float32 (as before): the inputs are then widened and the
    output not rounded. A float mask does not set the result's dtype: the inputs stay as
    stored. Both bit for bit the call on float32 copies (rounded when stored in half)."""
    import attnlab

    rng = np.random.default_rng(13)
    x, kv, w, kw = _mha_case(rng, dtype, True, None)
    f32 = {n: a.astype(np.float32) for n, a in w.items()}
    kv32 = kv.astype(np.float32)
    b_o = rng.standard_normal(16).astype(np.float32)
    mask = rng.standard_normal((7, 11)).astype(np.float32)
    for extra, stored in (({"b_o": b_o}, np.float32), ({"mask": mask}, dtype)):
        assert _prepared(x, kv, **w, **kw, **extra).inputs_half == (stored == dtype)
        got = attnlab.multi_head_attention(x, kv, kv, **w, **kw, **extra)
        want = attnlab.multi_head_attention(x.astype(np.float32), kv32, kv32, **f32, **kw, **extra)
        assert got.dtype == stored
        np.testing.assert_array_equal(got.view(np.uint8), want.astype(stored).view(np.uint8))


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
def test_half_inputs_strided_and_broadcast_are_the_widened_call(dtype):
    """Half-precision inputs that are not C-contiguous, or broadcast over the batch, are
    copied in their dtype and read as bits: bit for bit the call on float32 copies, rounded;
    300 query rows (three row chunks of the GEMM, a partial one) and a 100-column output."""
    import attnlab

    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 48, 300)).astype(dtype).transpose(0, 2, 1)  # (2, 300, 48)
    kv = rng.standard_normal((1, 9, 40)).astype(dtype)  # broadcast over the batch
    w = {
        "w_q": rng.standard_normal((48, 64)) / 7,
        "w_k": rng.standard_normal((40, 64)) / 7,
        "w_v": rng.standard_normal((40, 64)) / 7,
        "w_o": rng.standard_normal((64, 100)) / 7,
    }
    w = {n: a.astype(dtype) for n, a in w.items()}
    assert _prepared(x, kv, **w, num_heads=4).inputs_half
    got = attnlab.multi_head_attention(x, kv, kv, **w, num_heads=4)
    want = attnlab.multi_head_attention(
        x.astype(np.float32),
        kv.astype(np.float32),
        kv.astype(np.float32),
        **{n: a.astype(np.float32) for n, a in w.items()},
        num_heads=4,
    )
    assert got.dtype == dtype and got.shape == (2, 300, 100)
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(dtype).view(np.uint16))


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
@pytest.mark.parametrize("h_kv", [4, 1])
def test_half_input_shared_by_q_k_v_is_the_widened_call(dtype, h_kv):
    """Self-attention on a half-precision input: the Q, K and V projections read the same rows,
    widened once per row chunk for all three (their tasks taken row chunk by row chunk, K and V
    narrower than Q with one kv head). Bit for bit the call on float32 copies, rounded, at 1, 2
    and 3 threads; 450 rows: three whole row chunks of the GEMM and a partial one."""
    import attnlab

    rng = np.random.default_rng(14)
    d, h = 96, 4
    x = rng.standard_normal((3, 150, d)).astype(dtype)
    shapes = {"w_q": (d, d), "w_k": (d, h_kv * 24), "w_v": (d, h_kv * 24), "w_o": (d, 80)}
    w = {n: (rng.standard_normal(s) / 9).astype(dtype) for n, s in shapes.items()}
    kw = dict(num_heads=h, num_kv_heads=h_kv, causal=True)
    want = attnlab.multi_head_attention(
        x.astype(np.float32), **{n: a.astype(np.float32) for n, a in w.items()}, **kw
    ).astype(dtype)
    before = attnlab.get_num_threads()
    try:
        for threads in (1, 2, 3):
            attnlab.set_num_threads(threads)
            got = attnlab.multi_head_attention(x, **w, **kw)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    finally:
        attnlab.set_num_threads(before)


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
@pytest.mark.parametrize(
    "case",
    [
        dict(B=2, n=200, n_k=None, d=64, h=4, h_kv=4, go="half"),  # self-attention, 400 rows
        dict(B=1, n=5, n_k=None, d=16, h=2, h_kv=1, go="half", bias=True),  # one row chunk
        dict(B=2, n=130, n_k=133, d=48, h=3, h_kv=3, go="float32", bias=True),  # cross
        dict(B=3, n=129, n_k=None, d=40, h=2, h_kv=2, go="half", causal=True),
        dict(B=1, n=7, n_k=9, d=32, h=4, h_kv=2, go="float32", inputs="float32"),  # weights only
        # keys and values broadcast over the batch: their gradients summed in float32 first
        dict(B=2, n=30, n_k=20, d=32, h=4, h_kv=4, go="half", kv_batch=1),
        # q/k norms (stored in the half dtype too) and rotary embeddings, in the kernel
        dict(B=2, n=40, n_k=None, d=32, h=4, h_kv=2, go="half", qk_norm=True, rope=(1e4, None)),
        dict(B=1, n=9, n_k=12, d=48, h=3, h_kv=3, go="float32", causal=True, rope=(500.0, 8)),
    ],
    ids=[
        "self",
        "short-gqa",
        "cross",
        "causal",
        "weights-only",
        "broadcast",
        "norms-rope",
        "partial-rope-cross",
    ],
)
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_mha_backward_reads_half_as_stored(case, dtype, precision, monkeypatch):
    """The MHA backward reads half-precision weights (W^T widened as it is transposed), inputs
    (widened as the forward's projections read them and as X^T is made) and ``grad_out``
    (widened by the products that read it) as stored, and rounds the inputs' gradients as
    their last product writes them (summed in float32 first when self-attention shares them),
    and the weights' gradients as their product writes them:
    every gradient is the float32 call's on the widened arrays, rounded, bit for bit, and so
    is ``attnlab.vjp``'s pullback; nothing of an input's size widened or rounded in Python.
    With ``precision="bf16"`` too (its forward's products round what they read)."""
    import attnlab

    B, n, d, h, h_kv = case["B"], case["n"], case["d"], case["h"], case["h_kv"]
    rng = np.random.default_rng(B + n + d)
    in_dtype = np.dtype(case.get("inputs", dtype))
    x = rng.standard_normal((B, n, d)).astype(in_dtype)
    kv_shape = (case.get("kv_batch", B), case["n_k"], d)
    kv = None if case["n_k"] is None else rng.standard_normal(kv_shape).astype(in_dtype)
    dh = d // h
    shapes = {"w_q": (d, d), "w_k": (d, h_kv * dh), "w_v": (d, h_kv * dh), "w_o": (d, d)}
    if case.get("bias"):
        shapes.update(b_q=(d,), b_o=(d,))
    w = {k: (rng.standard_normal(s) / 5).astype(dtype) for k, s in shapes.items()}
    g = rng.standard_normal((B, n, d)).astype(dtype if case["go"] == "half" else np.float32)
    kw = dict(num_heads=h, num_kv_heads=h_kv, causal=case.get("causal", False))
    if precision is not None:
        kw["precision"] = precision
    if "rope" in case:
        kw.update(rope_theta=case["rope"][0], rope_dim=case["rope"][1])
    if case.get("qk_norm"):
        w.update({n: (1 + rng.standard_normal(dh) / 4).astype(dtype) for n in ("q_norm", "k_norm")})
    inputs = (x,) if kv is None else (x, kv, kv)
    f32 = {k: a.astype(np.float32) for k, a in w.items()}
    want = attnlab.multi_head_attention_backward(
        g.astype(np.float32), *(a.astype(np.float32) for a in inputs), **f32, **kw
    )
    tokens = {(B, n, d), (B * n, d)} | (
        {(B, kv.shape[1], d), (B * kv.shape[1], d)} if kv is not None else set()
    )
    if "kv_batch" in case:  # broadcast inputs: the call is prepared widened, as documented
        tokens = set()
    else:  # the weights' gradients are written in their dtype by the kernel, not rounded here
        tokens |= {shapes[k] for k in ("w_q", "w_k", "w_v", "w_o")}
    refuse_conversions(monkeypatch, tokens)
    got = attnlab.multi_head_attention_backward(g, *inputs, **w, **kw)
    out, pullback = attnlab.vjp(attnlab.multi_head_attention, *inputs, **w, **kw)
    pulled = pullback(g)  # the forward keeps its projections: no recompute, the same bits
    monkeypatch.undo()
    forward = attnlab.multi_head_attention(*inputs, **w, **kw)
    np.testing.assert_array_equal(out.view(np.uint8), forward.view(np.uint8))
    for name, value in got.items():
        np.testing.assert_array_equal(pulled[name].view(np.uint8), value.view(np.uint8))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        stored = in_dtype if name in ("query", "key", "value") else dtype
        assert got[name].dtype == stored, name
        np.testing.assert_array_equal(
            got[name].view(np.uint8), value.astype(stored).view(np.uint8), err_msg=name
        )


def test_mha_args_refuse_a_bad_inputs_half():
    """The binding's own checks of inputs_half (the Python layer never sends these)."""
    rng = np.random.default_rng(0)
    x, _, w, kw = _mha_case(rng, np.float16, False, None)
    a = _prepared(x, **w, **kw)
    # zeros, not np.empty: it is also the backward's grad_out below (garbage bits can be NaN)
    out = np.zeros((14, 16), np.float16).view(np.uint16)
    with pytest.raises(ValueError, match=r"inputs_half: expected 0, or 1 .* got 2 with"):
        core.mha_forward(a._replace(inputs_half=2).core_args(), out, None)
    with pytest.raises(ValueError, match=r"inputs_half: .* got 1 with weights_half 0"):
        core.mha_forward(a._replace(weights_half=0).core_args(), out, None)
    with pytest.raises(TypeError, match="out: unexpected dtype float32"):
        core.mha_forward(a.core_args(), np.empty((14, 16), np.float32), None)
    with pytest.raises(ValueError, match=r"inputs_half: .* got 1 with weights_half 0"):
        core.mha_backward(out, a._replace(weights_half=0).core_args(), {})
    weights_only = a._replace(inputs_half=False, rq=x.reshape(14, 32).astype(np.float32))
    weights_only = weights_only._replace(rk=weights_only.rq, rv=weights_only.rq).core_args()
    with pytest.raises(TypeError, match=r"^grad_out: half-precision bits go with inputs_half"):
        core.mha_backward(out, weights_only, {})
    with pytest.raises(TypeError, match=r"^query: "):  # the inputs' gradients as their bits
        core.mha_backward(out, a.core_args(), {"query": np.empty((14, 32), np.float32)})
    grads = {"query": np.empty((14, 32), np.uint16), "w_o": np.empty((32, 16), np.float32)}
    core.mha_backward(out, a.core_args(), grads)  # the backward itself runs
    assert np.isfinite(grads["query"].view(np.float16)).all()
    bits = {"w_o": np.empty((32, 16), np.uint16)}  # a half weight's gradient as its bits too
    core.mha_backward(out, a.core_args(), bits)
    np.testing.assert_array_equal(bits["w_o"].view(np.float16), grads["w_o"].astype(np.float16))
    core.mha_forward(a.core_args(), out, None)  # the call itself runs, with bf16 products too
    core.mha_forward(a.core_args(), out, None, None, True)


@pytest.mark.parametrize("dtype", [d for _, d in FORMATS])
def test_half_inputs_bitwise_for_any_thread_count(dtype):
    """The tasks that widen rows of X and round blocks of Y are a fixed grid: the same bits at
    1, 2 and 3 threads (300 rows: three row chunks, a partial one)."""
    import attnlab

    rng = np.random.default_rng(14)
    x = rng.standard_normal((3, 100, 96)).astype(dtype)
    w = {n: (rng.standard_normal((96, 96)) / 10).astype(dtype) for n in ("w_q", "w_k", "w_v")}
    w["w_o"] = (rng.standard_normal((96, 100)) / 10).astype(dtype)
    before = attnlab.get_num_threads()
    try:
        got = []
        for t in (1, 2, 3):
            attnlab.set_num_threads(t)
            got.append(attnlab.multi_head_attention(x, **w, num_heads=3).view(np.uint16))
    finally:
        attnlab.set_num_threads(before)
    for g in got[1:]:
        np.testing.assert_array_equal(g, got[0])
