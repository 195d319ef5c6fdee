"""The shortcuts that keep small calls cheap (issue 30): each gives what the general rule gives,
and no check is skipped that could fail."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab import _half, _memory
from attnlab import _validate as V


def _layer(d: int = 8, dtype: type = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal((d, d)).astype(dtype) for n in ("w_q", "w_k", "w_v", "w_o")}


@pytest.mark.parametrize(
    "dtype", ["float16", "float32", "float64", "int16", "uint16", "int8", "complex64", "bool"]
)
def test_is_half_as_by_name(dtype: str) -> None:
    dt = np.dtype(dtype)
    assert _half.is_half(dt) is (dt.name in _half.HALF_NAMES)


def test_is_half_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert _half.is_half(np.dtype(ml_dtypes.bfloat16))


@pytest.mark.parametrize(
    "dtypes",
    [
        ("float32",),
        ("float32", "float32", "float32"),
        ("float64", "float64"),
        ("float32", "float64"),
        ("float64", "float32", "float32"),
    ],
)
def test_result_dtype_as_numpy(dtypes: tuple[str, ...]) -> None:
    arrays = [np.zeros(2, dt) for dt in dtypes]
    assert V.result_dtype(*arrays, None) == np.result_type(*arrays)


@pytest.mark.parametrize(
    "shapes", [[(2, 3), (2, 3)], [(), ()], [(1,), (4,)], [(2, 1), (3,)], [(0,), (0,)]]
)
def test_batch_shape_as_numpy(shapes: list[tuple[int, ...]]) -> None:
    named = [(f"x{i}", s) for i, s in enumerate(shapes)]
    assert V.batch_shape(named) == np.broadcast_shapes(*shapes)


def test_batch_shape_error_names_the_inputs() -> None:
    with pytest.raises(ValueError, match=r"query \(2,\), key \(3,\)"):
        V.batch_shape([("query", (2,)), ("key", (3,))])


@pytest.mark.parametrize("shape", [(3, 5), (7,), 5, np.int64(4), [2, np.int32(3)], (0, 4)])
def test_empty_aligned(shape: object) -> None:
    a = _memory.empty(shape, np.float32)  # type: ignore[arg-type]
    assert a.ctypes.data % 64 == 0 or a.size == 0
    assert a.flags.c_contiguous and a.dtype == np.float32
    want = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)  # type: ignore[arg-type, union-attr]
    assert a.shape == want


def test_layout_error_raised_on_every_call() -> None:
    """A layout is remembered only once accepted: a wrong one is refused each time, with the
    same message, also after a good call of the same sizes."""
    x = np.ones((1, 4, 8), np.float32)
    w = _layer()
    attnlab.multi_head_attention(x, num_heads=2, **w)
    bad = {**w, "w_k": np.ones((8, 6), np.float32)}
    messages = []
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^w_k: ") as e:
            attnlab.multi_head_attention(x, num_heads=2, **bad)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    # the same weights refused for another head count, accepted for this one
    with pytest.raises(ValueError, match="num_heads: 3 does not divide"):
        attnlab.multi_head_attention(x, num_heads=3, **w)


def test_stack_of_a_batched_array_is_a_view() -> None:
    q = np.ones((2, 3, 4, 8), np.float32)
    assert np.shares_memory(V.stack(q, (2,), np.dtype(np.float32), 3), q)
    assert V.stack(q, (2,), np.dtype(np.float64), 3).dtype == np.float64


def _mha_args(x: np.ndarray, w: dict[str, np.ndarray]) -> dict[str, object]:
    mask = (None, None, 0, -1, -1, 0.0, None, None)
    return dict(
        query=x, key=x, value=x, w_q=w["w_q"], b_q=None, w_k=w["w_k"], b_k=None,
        w_v=w["w_v"], b_v=None, w_o=w["w_o"], b_o=None,
        batch=1, n_q=4, n_k=4, heads=2, kv_heads=2, mask=mask, scale=0.5, weights_half=0,
        inputs_half=0, packed=None,
    )  # fmt: skip


@pytest.mark.parametrize("order", ["fields", "reversed", "built names"])
def test_args_object_keywords_in_any_form(order: str) -> None:
    """core.MhaArgs finds its keywords in any order and by their text when they are not the
    interned names (built at run time), and fills the same fields."""
    from attnlab._loader import core

    x = np.ones((4, 8), np.float32)
    kw = _mha_args(x, _layer())
    if order == "reversed":
        kw = dict(reversed(list(kw.items())))
    elif order == "built names":
        kw = {"".join(list(k)): v for k, v in kw.items()}
    a = core.MhaArgs(**kw)
    assert (a.batch, a.n_q, a.n_k, a.heads, a.kv_heads, a.scale) == (1, 4, 4, 2, 2, 0.5)
    assert a.query is x and a.w_o is kw["w_o"] and a.b_q is None
    out = np.empty((4, 8), np.float32)
    core.mha_forward(a, out, None)
    ref = np.empty_like(out)
    core.mha_forward(core.MhaArgs(**_mha_args(x, _layer())), ref, None)
    assert out.tobytes() == ref.tobytes()


def test_args_object_keyword_errors() -> None:
    from attnlab._loader import core

    kw = _mha_args(np.ones((4, 8), np.float32), _layer())
    with pytest.raises(TypeError, match=r"^MhaArgs: unexpected keyword argument 'queries'"):
        core.MhaArgs(**kw, queries=1)
    del kw["scale"]
    with pytest.raises(TypeError, match=r"^MhaArgs: missing keyword argument 'scale'"):
        core.MhaArgs(**kw)
    with pytest.raises(TypeError, match=r"^MhaArgs.batch: expected an int, got str"):
        core.MhaArgs(**{**kw, "scale": 0.5, "batch": "1"})


_PLAIN_SHAPES = [
    # (q shape, k shape, v shape): batch axes 0-2, grouped heads, d_v != d, one key
    ((2, 5, 8), (2, 7, 8), (2, 7, 8)),
    ((3, 4, 1, 16), (3, 4, 64, 16), (3, 4, 64, 16)),
    ((2, 8, 3, 8), (2, 2, 9, 8), (2, 2, 9, 5)),
    ((2, 1, 4, 2, 6), (2, 1, 2, 1, 6), (2, 1, 2, 1, 4)),
]


def _plain_inputs(shapes: tuple[tuple[int, ...], ...], dtype: str) -> list[np.ndarray]:
    """q, k, v of one dtype, or "float32 q, <half> cache"."""
    rng = np.random.default_rng(sum(map(len, shapes)))
    if dtype.startswith("float32 q, "):
        q, k, v = _plain_inputs(shapes, dtype.split(", ")[1].split()[0])
        return [q.astype(np.float32), k, v]
    dt = pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else dtype
    return [rng.standard_normal(s).astype(dt) for s in shapes]


@pytest.mark.parametrize("shapes", _PLAIN_SHAPES)
@pytest.mark.parametrize(
    "dtype",
    ["float32", "float64", "float16", "bfloat16", "float32 q, float16 cache",
     "float32 q, bfloat16 cache"],
)  # fmt: skip
@pytest.mark.parametrize("scale", [None, 0.3, 2])
def test_sdpa_plain_call_as_the_full_path(
    shapes: tuple[tuple[int, ...], ...],
    dtype: str,
    scale: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plain SDPA call (no option, contiguous float arrays) takes the short path, and
    gives bitwise what the full path gives for it, against the float64 reference too."""
    from attnlab import _mha, reference

    q, k, v = _plain_inputs(shapes, dtype)
    taken = []
    plain = _mha._sdpa_plain

    def spy(*a: object) -> object:
        out = plain(*a)  # type: ignore[arg-type]
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_mha, "_sdpa_plain", spy)
    fast = attnlab.scaled_dot_product_attention(q, k, v, scale=scale)
    assert taken == [True]
    monkeypatch.setattr(_mha, "_sdpa_plain", lambda *_: None)
    full = attnlab.scaled_dot_product_attention(q, k, v, scale=scale)
    assert fast.dtype == full.dtype == q.dtype and fast.shape == full.shape
    assert fast.tobytes() == full.tobytes()
    wide = [x.astype(np.float64) for x in (q, k, v)]
    ref = reference.scaled_dot_product_attention(*wide, scale=scale)
    # the half paths compute in float32 from exactly widened inputs, then round the output
    tol = {"float64": 1e-12, "float16": 2e-3, "bfloat16": 1.6e-2}.get(dtype, 1e-5)
    np.testing.assert_allclose(fast.astype(np.float64), ref, rtol=tol, atol=tol)


def _noncontiguous(x: np.ndarray) -> np.ndarray:
    return np.repeat(x, 2, axis=-1)[..., ::2]


@pytest.mark.parametrize(
    "case",
    ["float16 k", "float16 q, k, float32 v", "big-endian q", "strided v", "broadcast batch",
     "list q", "int q", "causal=np.False_", "mask", "return_lse", "empty keys"],
)  # fmt: skip
def test_sdpa_other_calls_take_the_full_path(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call the short path does not cover goes to the full one, which gives its usual
    answer (or error): the short path declines (None) before it computes anything."""
    from attnlab import _mha

    q, k, v = _plain_inputs(_PLAIN_SHAPES[1], "float32")
    kw: dict[str, object] = {}
    if case == "float16 k":  # q float32, v not
        k = k.astype(np.float16)
    elif case == "float16 q, k, float32 v":
        q, k = q.astype(np.float16), k.astype(np.float16)
    elif case == "big-endian q":
        q = q.astype(">f4")
    elif case == "strided v":
        v = _noncontiguous(v)
    elif case == "broadcast batch":
        q = q[:1]
    elif case == "list q":
        q = q.tolist()  # type: ignore[assignment]
    elif case == "int q":
        q = (q * 4).astype(np.int32)
    elif case == "causal=np.False_":
        kw["causal"] = np.False_
    elif case == "mask":
        kw["mask"] = np.ones((1, 64), bool)
    elif case == "return_lse":
        kw["return_lse"] = True
    else:
        k, v = k[..., :0, :], v[..., :0, :]
    results = []
    plain = _mha._sdpa_plain
    monkeypatch.setattr(_mha, "_sdpa_plain", lambda *a: results.append(plain(*a)))
    attnlab.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    assert all(r is None for r in results)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"scale": "2"}, TypeError, r"^scale: expected a real number"),
        ({"scale": float("nan")}, ValueError, r"^scale: expected a finite number"),
        ({"warn_empty_rows": 1}, TypeError, r"^warn_empty_rows: "),
        ({"causal": 0}, ValueError, r"^causal: expected False, True"),
        ({"return_weights": 0}, ValueError, r"^return_weights: "),
    ],
)
def test_sdpa_plain_call_checks_its_options(
    kw: dict[str, object], error: type[Exception], match: str
) -> None:
    q, k, v = _plain_inputs(_PLAIN_SHAPES[0], "float32")
    with pytest.raises(error, match=match):
        attnlab.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "q_shape, k_shape, match",
    [
        ((2, 5, 8), (2, 7, 6), r"^k: expected last dimension d = 8"),
        (
            (2, 1, 5, 8),
            (3, 1, 7, 8),
            r"^batch dimensions do not broadcast: q \(2,\), k \(3,\)",
        ),
        ((3, 5, 8), (2, 7, 8), r"^k: the number of kv heads \(2\) must divide"),
    ],
)
def test_sdpa_plain_shape_errors_as_the_full_path(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], match: str
) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, k_shape))
    with pytest.raises(ValueError, match=match):
        attnlab.scaled_dot_product_attention(q, k, v)


def test_sdpa_plain_mask_argument_is_the_full_paths() -> None:
    """The short path's mask argument is what the full path builds for a call with no option."""
    from attnlab import _mha

    q, k, v = _plain_inputs(_PLAIN_SHAPES[1], "float32")
    keep: dict[str, object] = {}
    attnlab.scaled_dot_product_attention(q, k, v, _keep=keep)
    assert keep["prepared"].m.core_mask() == _mha._NO_MASK  # type: ignore[attr-defined]
