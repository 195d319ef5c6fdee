"""attnlab.PackedWeight (issues 30, 31): weights packed once for the projections of many calls.

The packed panels (and, for precision="bf16" on AMX or AVX512-BF16, the bf16 tiles) are the
layout every call's GEMM makes from the weight anyway, so a call given them must give the array
call's bits; the tests below also prove that the kernels read them (altered panels or tiles
change exactly what they cover) and that every other use of a PackedWeight reads its array."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import attnlab
from attnlab._loader import core
from conftest import VDPBF16PS, require_vdpbf16ps, rerun_tests

NAMES = ("w_q", "w_k", "w_v", "w_o")


@pytest.fixture
def restore_threads():
    before = attnlab.get_num_threads()
    yield
    attnlab.set_num_threads(before)


def _weights(rng, d, h, d_head, dtype, kv_heads=None, d_out=None):
    kv = kv_heads or h
    shapes = {
        "w_q": (d, h * d_head),
        "w_k": (d, kv * d_head),
        "w_v": (d, kv * d_head),
        "w_o": (h * d_head, d_out or d),
    }
    return {n: (rng.standard_normal(s) / np.sqrt(s[0])).astype(dtype) for n, s in shapes.items()}


def _packed(w):
    return {n: attnlab.PackedWeight(a) for n, a in w.items()}


def _panel_width(dtype) -> int:
    """Columns of one packed panel in this build: the narrowest weight that packs whole."""
    for width in (2, 4, 6, 12, 24, 48, 96):  # the panel widths builds can have
        if core.pack_weight(np.zeros((1, width), dtype)).size == width:
            return width
    raise AssertionError("no panel width found")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "rows, d, h, d_head",
    [
        (128, 96, 4, 24),  # BERT-like: one row chunk
        (1, 64, 2, 32),  # a decode step: fewer rows than a register block
        (5, 40, 5, 8),  # columns narrower than one panel
        (400, 64, 4, 16),  # more than two row chunks (packed once per call otherwise)
        (70, 100, 5, 20),  # a narrower last panel
    ],
)
def test_same_bits_as_the_arrays(rng, dtype, rows, d, h, d_head):
    w = _weights(rng, d, h, d_head, dtype)
    b = {f"b_{n[2]}": rng.standard_normal(a.shape[1]).astype(dtype) for n, a in w.items()}
    x = rng.standard_normal((1, rows, d)).astype(dtype)
    want = attnlab.multi_head_attention(x, num_heads=h, causal=True, **w, **b)
    got = attnlab.multi_head_attention(x, num_heads=h, causal=True, **_packed(w), **b)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    ref = attnlab.reference.multi_head_attention(x, num_heads=h, causal=True, **w, **b)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.linalg.norm(got - ref) <= tol * np.linalg.norm(ref)


@pytest.mark.usefixtures("restore_threads")
def test_options_and_thread_counts(rng):
    """Grouped-query heads, cross-attention, rotary embeddings, q/k norms, weights returned:
    the same bits at 1 and 2 threads."""
    d, h, kv, d_head = 64, 8, 2, 16
    w = _weights(rng, d, h, d_head, np.float32, kv_heads=kv, d_out=48)
    x = rng.standard_normal((2, 33, d)).astype(np.float32)
    mem = rng.standard_normal((2, 50, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d_head)).astype(np.float32)
    opts = dict(num_heads=h, num_kv_heads=kv, rope_theta=1e4, q_norm=norm, k_norm=norm)
    for t in (1, 2):
        attnlab.set_num_threads(t)
        want, aw = attnlab.multi_head_attention(x, mem, return_weights=True, **opts, **w)
        got, gw = attnlab.multi_head_attention(x, mem, return_weights=True, **opts, **_packed(w))
        assert got.tobytes() == want.tobytes() and gw.tobytes() == aw.tobytes()


def test_the_kernel_reads_the_panels(rng):
    """Altered panels change exactly the output columns of the whole panels (the columns past
    the last whole panel are read from the array): the panels are read, and laid out as the
    GEMM expects."""
    d, h, d_head = 96, 2, 48
    wp = _panel_width(np.float32)
    w = _weights(rng, d, h, d_head, np.float32, d_out=2 * wp + wp // 2)
    x = rng.standard_normal((1, 20, d)).astype(np.float32)
    packed = _packed(w)
    other = rng.standard_normal(w["w_o"].shape).astype(np.float32)
    packed["w_o"]._panels = core.pack_weight(other)  # what a kernel ignoring them would miss
    got = attnlab.multi_head_attention(x, num_heads=h, **packed)
    mixed = w["w_o"].copy()
    mixed[:, : 2 * wp] = other[:, : 2 * wp]
    want = attnlab.multi_head_attention(x, num_heads=h, **{**w, "w_o": mixed})
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("rows", [0, 1, 7, 128, 300, 513])
@pytest.mark.parametrize("cols", [5, 48, 100, 768])
def test_linear_forward_with_panels(rng, dtype, rows, cols):
    d = 70
    x = rng.standard_normal((rows, d)).astype(dtype)
    w = rng.standard_normal((d, cols)).astype(dtype)
    b = rng.standard_normal(cols).astype(dtype)
    want, got = np.empty((rows, cols), dtype), np.empty((rows, cols), dtype)
    core.linear_forward(x, w, b, want)
    core.linear_forward(x, w, b, got, packed=core.pack_weight(w))
    assert got.tobytes() == want.tobytes()


def test_other_calls_read_the_array(rng):
    """Calls that do not compute in the weight's dtype with float32 products, the backward,
    vjp and another family: the array call's bits."""
    d, h, d_head = 32, 4, 8
    w = _weights(rng, d, h, d_head, np.float32)
    p = _packed(w)
    x = rng.standard_normal((2, 9, d)).astype(np.float32)
    same = lambda a, b: a.tobytes() == b.tobytes()  # noqa: E731
    x64 = x.astype(np.float64)  # promoted: the array, widened
    mha = attnlab.multi_head_attention
    assert same(mha(x64, num_heads=h, **p), mha(x64, num_heads=h, **w))
    assert mha(x64, num_heads=h, **p).dtype == np.float64
    bf = dict(num_heads=h, precision="bf16")
    assert same(mha(x, **bf, **p), mha(x, **bf, **w))
    g = rng.standard_normal((2, 9, d)).astype(np.float32)
    ga = attnlab.multi_head_attention_backward(g, x, num_heads=h, **w)
    gp = attnlab.multi_head_attention_backward(g, x, num_heads=h, **p)
    assert ga.keys() == gp.keys() and all(same(ga[k], gp[k]) for k in ga)
    out_a, pull_a = attnlab.vjp(mha, x, num_heads=h, **w)
    out_p, pull_p = attnlab.vjp(mha, x, num_heads=h, **p)
    assert same(out_a, out_p)
    ga, gp = pull_a(g), pull_p(g)
    assert ga.keys() == gp.keys() and all(same(ga[k], gp[k]) for k in ga)
    qk_p = attnlab.collapse_qk(p["w_q"], p["w_k"], num_heads=h)
    qk_w = attnlab.collapse_qk(w["w_q"], w["w_k"], num_heads=h)
    assert same(qk_p.w, qk_w.w)
    bil = lambda qk, ws: attnlab.bilinear_attention(  # noqa: E731
        x, w_qk=qk.w, w_v=ws["w_v"], w_o=ws["w_o"], num_heads=h
    )
    assert same(bil(qk_p, p), bil(qk_w, w))
    ref = attnlab.reference.multi_head_attention(x, num_heads=h, **p)
    assert same(ref, attnlab.reference.multi_head_attention(x, num_heads=h, **w))


def test_a_snapshot_read_only_and_picklable(rng):
    w = rng.standard_normal((16, 100)).astype(np.float32)
    p = attnlab.PackedWeight(w)
    x = rng.standard_normal((1, 4, 16)).astype(np.float32)
    layer = dict(num_heads=4, w_q=p, w_k=p, w_v=p, w_o=np.eye(100, 16, dtype=np.float32))
    before = attnlab.multi_head_attention(x, **layer)
    w[:] = 0  # the caller's array, changed after packing
    assert np.asarray(p) is p.array and p.array.any()
    with pytest.raises(ValueError, match="read-only"):
        p.array[0, 0] = 1
    assert attnlab.multi_head_attention(x, **layer).tobytes() == before.tobytes()
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p), attnlab.PackedWeight(p)):
        assert isinstance(q, attnlab.PackedWeight)
        assert q.array.tobytes() == p.array.tobytes() and q.dtype == p.dtype
        assert q._panels.tobytes() == p._panels.tobytes()
    assert p.shape == (16, 100) and p.ndim == 2 and p.nbytes >= 2 * 16 * 96 * 4
    assert repr(p) == "PackedWeight(shape=(16, 100), dtype=float32)"
    assert np.asarray(p, dtype=np.float64).dtype == np.float64


FLOATS = r"^w: expected a float32 or float64 array, got "


@pytest.mark.parametrize(
    "w, error, match",
    [
        (np.ones((4, 4), np.float16), TypeError, FLOATS + "float16"),
        (np.ones((4, 4), np.int32), TypeError, FLOATS + "int32"),
        (np.ones(4, np.float32), ValueError, r"^w: expected a 2-d \(in_features, out_features\)"),
        (None, TypeError, r"^w: expected an array, got None"),
    ],
)  # fmt: skip
def test_refused_with_a_named_error(w, error, match):
    with pytest.raises(error, match=match):
        attnlab.PackedWeight(w)


def _bf16_tiles_here() -> bool:
    return attnlab.build_info()["bf16_kernel"] != "emulated"


# (batch, tokens, features, heads, kv heads, d_head, d_vhead, d_out, options): the fused forward
# (self-attention, head widths multiples of 32), then the composed kernels
BF16_CASES = [
    (2, 197, 192, 3, 3, 64, 64, 192, {}),
    (2, 50, 96, 2, 1, 32, 64, 70, {"causal": True}),
    (1, 33, 40, 2, 2, 48, 40, 33, {}),
    (3, 17, 100, 4, 2, 32, 32, 100, {"cross": True}),
    (1, 9, 64, 2, 2, 32, 32, 64, {"return_weights": True}),
]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: "x".join(map(str, c[:8])))
def test_bf16_same_bits_as_the_arrays(rng, case):
    """precision="bf16" with PackedWeight (its bf16 tiles where the products run on AMX or
    AVX512-BF16; the array on the emulation): the array call's bits, forward and backward."""
    B, n, d, h, hk, dh, dv, d_out, opts = case
    shapes = {"w_q": (d, h * dh), "w_k": (d, hk * dh), "w_v": (d, hk * dv), "w_o": (h * dv, d_out)}
    w = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
    w["b_q"] = rng.standard_normal(h * dh).astype(np.float32)
    w["b_v"] = rng.standard_normal(hk * dv).astype(np.float32)
    p = {k: attnlab.PackedWeight(a) if k in NAMES else a for k, a in w.items()}
    x = rng.standard_normal((B, n, d)).astype(np.float32)
    kw = dict(num_heads=h, num_kv_heads=hk, precision="bf16")
    opts = dict(opts)
    if opts.pop("cross", False):
        kv = rng.standard_normal((B, n + 5, d)).astype(np.float32)
        kw.update(key=kv, value=kv)
    kw.update(opts)
    got = attnlab.multi_head_attention(x, **kw, **p)
    want = attnlab.multi_head_attention(x, **kw, **w)
    got, want = (r[0] if isinstance(r, tuple) else r for r in (got, want))
    assert got.tobytes() == want.tobytes()
    assert all((p[k]._tiles is not None) == _bf16_tiles_here() for k in NAMES)
    kw.pop("return_weights", None)
    g = rng.standard_normal(got.shape).astype(np.float32)
    gp = attnlab.multi_head_attention_backward(g, x, **kw, **p)
    ga = attnlab.multi_head_attention_backward(g, x, **kw, **w)
    assert gp.keys() == ga.keys() and all(gp[k].tobytes() == ga[k].tobytes() for k in ga)


@pytest.mark.parametrize("cross", [False, True], ids=["fused", "composed"])
@pytest.mark.parametrize("name", ["w_q", "w_v", "w_o"])
def test_the_bf16_products_read_the_tiles(rng, cross, name):
    """Altered tiles give the result of the weight they were packed from: the tiles are read
    (the fused forward's three projections from their own tiles, and the composed kernels')."""
    if not _bf16_tiles_here():
        pytest.skip("the bf16 products are emulated here: they read the array (no tiles)")
    d, h = 64, 2  # heads of 32: self-attention takes the fused forward
    w = {n: (rng.standard_normal((d, d)) / 8).astype(np.float32) for n in NAMES}
    p = _packed(w)
    other = (rng.standard_normal((d, d)) / 8).astype(np.float32)
    p[name]._tiles = core.pack_bf16_tiles(other)
    x = rng.standard_normal((2, 40, d)).astype(np.float32)
    kw = dict(num_heads=h, precision="bf16")
    if cross:
        kv = rng.standard_normal((2, 23, d)).astype(np.float32)
        kw.update(key=kv, value=kv)
    fused = core.mha_bf16_fused_calls()
    got = attnlab.multi_head_attention(x, **kw, **p)
    assert core.mha_bf16_fused_calls() - fused == (0 if cross else 1)
    want = attnlab.multi_head_attention(x, **kw, **{**w, name: other})
    assert got.tobytes() == want.tobytes()


def test_bf16_tiles_packed_once_and_counted(rng):
    w = rng.standard_normal((96, 64)).astype(np.float32)
    p = attnlab.PackedWeight(w)
    before = p.nbytes
    x = rng.standard_normal((1, 40, 96)).astype(np.float32)
    ws = dict(w_q=p, w_k=p, w_v=p, w_o=rng.standard_normal((64, 96)).astype(np.float32))
    attnlab.multi_head_attention(x, num_heads=2, precision="bf16", **ws)
    tiles = p._tiles
    attnlab.multi_head_attention(x, num_heads=2, precision="bf16", **ws)
    assert p._tiles is tiles  # the same array: packed at the first call only
    if _bf16_tiles_here():
        assert p.nbytes == before + tiles.nbytes and not tiles.flags.writeable
    else:
        assert tiles is None and p.nbytes == before
    # the packed layouts start on a cache line (NumPy aligns to 16 bytes only)
    assert p._panels.ctypes.data % 64 == 0
    assert tiles is None or tiles.ctypes.data % 64 == 0


def test_bf16_tiles_on_vdpbf16ps_without_amx():
    """The bf16 tests above again with AMX off and the VDPBF16PS kernel on (the switches are read
    once per process: a subprocess), where the CPU has AVX512-BF16."""
    require_vdpbf16ps()
    rerun_tests(__file__, "bf16 and not without_amx", **VDPBF16PS)


def test_core_checks_the_panels():
    """The binding's own checks (the Python layer sends only panels it made)."""
    w = np.ones((8, 96), np.float32)
    # zeros, not np.empty: y is cast below (uninitialised bits warned as NaN at random)
    x, y = np.ones((3, 8), np.float32), np.zeros((3, 96), np.float32)
    with pytest.raises(ValueError, match=r"^packed"):
        core.linear_forward(x, w, None, y, packed=np.zeros(5, np.float32))
    with pytest.raises(TypeError, match=r"^packed: unexpected dtype float32"):
        core.linear_forward(x.astype(np.float64), w.astype(np.float64), None,
                            y.astype(np.float64), packed=core.pack_weight(w))  # fmt: skip
    with pytest.raises(ValueError, match=r"^packed: only with float weights"):
        core.linear_forward(x, w, None, y, bf16=True, packed=core.pack_weight(w))
    with pytest.raises(ValueError, match=r"^w: expected a 2-d array"):
        core.pack_weight(np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"^w: expected float32 or float64"):
        core.pack_weight(np.ones((3, 3), np.int64))
    with pytest.raises(ValueError, match=r"^w: expected a 2-d array"):
        core.pack_bf16_tiles(np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"^w: unexpected dtype float64"):
        core.pack_bf16_tiles(np.ones((3, 3)))


def test_core_checks_the_layer_panels():
    x = np.ones((4, 8), np.float32)
    w = np.eye(8, dtype=np.float32)
    kw = dict(
        query=x, key=x, value=x, w_q=w, b_q=None, w_k=w, b_k=None, weights_half=0,
        inputs_half=0, packed=None, w_v=w, b_v=None, w_o=w, b_o=None, batch=1, n_q=4, n_k=4,
        heads=2, kv_heads=2, mask=(None, None, 0, -1, -1, 0.0, None, None), scale=0.5,
    )  # fmt: skip
    out = np.empty((4, 8), np.float32)
    pw = core.pack_weight(w)
    with pytest.raises(TypeError, match=r"^packed: expected None or a tuple of 4"):
        core.mha_forward(core.MhaArgs(**{**kw, "packed": (pw,)}), out, None)
    with pytest.raises(TypeError, match=r"^packed\[2\] \(w_v\): expected an array"):
        core.mha_forward(core.MhaArgs(**{**kw, "packed": (pw, pw, 3, None)}), out, None)
    bad = np.zeros(pw.size + 1, np.float32)
    with pytest.raises(ValueError, match=r"^packed\[3\] \(w_o\)"):
        core.mha_forward(core.MhaArgs(**{**kw, "packed": (None, None, None, bad)}), out, None)
    if _bf16_tiles_here():  # precision="bf16": the tiles, checked against the layer's size
        tiles = core.pack_bf16_tiles(w)
        bf16 = (None, None, True)  # (weights, state, bf16) after the output
        with pytest.raises(ValueError, match=r"^packed\[1\] \(w_k\)"):
            core.mha_forward(core.MhaArgs(**{**kw, "packed": (tiles, tiles[1:], None, None)}),
                             out, *bf16)  # fmt: skip
        with pytest.raises(TypeError, match=r"^packed\[0\] \(w_q\): unexpected dtype float32"):
            core.mha_forward(core.MhaArgs(**{**kw, "packed": (pw, None, None, None)}), out, *bf16)
        core.mha_forward(core.MhaArgs(**{**kw, "packed": (tiles,) * 4}), out, *bf16)
    halves = {n: w.astype(np.float16).view(np.uint16) for n in NAMES}
    with pytest.raises(ValueError, match=r"^packed: not with half-precision weights"):
        core.mha_forward(
            core.MhaArgs(**{**kw, **halves, "weights_half": 1, "packed": (pw, None, None, None)}),
            out, None,
        )  # fmt: skip
