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
