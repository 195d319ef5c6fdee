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
