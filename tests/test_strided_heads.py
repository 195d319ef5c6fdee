"""Heads whose rows lie apart in memory: transposed views of (B, n, h, d) arrays, and the heads of
``multi_head_attention`` (column blocks of its projections); and rows of whole cache lines that
do not start on one (NumPy aligns arrays to 16 bytes). With many query tiles per head the
forward copies K and V to contiguous rows first (rows a power-of-two multiple of 512 bytes apart
would share a few L1 sets; rows off a line are loaded two lines at a time); the products then
read the same values in the same order, so the result is bit for bit that of aligned contiguous
arrays. A counter (``attention_copied_calls``) says whether the copy ran, so that each test
knows which path it checked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab import _memory
from attnlab._loader import core

N_COPY = 8 * 96  # queries from which the copy runs: 8 tiles of 96 (attention_forward.cpp)


def _heads(rng: np.random.Generator, b: int, n: int, h: int, d: int, dtype: Any) -> np.ndarray:
    """(b, h, n, d) as a transposed view of a (b, n, h, d) array: rows h * d apart."""
    return rng.standard_normal((b, n, h, d)).astype(dtype).transpose(0, 2, 1, 3)


def _both(q: np.ndarray, k: np.ndarray, v: np.ndarray, copies: int, **kw: Any) -> None:
    """The call on the strided views against the call on contiguous copies (on a cache line):
    bitwise."""
    before = core.attention_copied_calls()
    got = attnlab.scaled_dot_product_attention(q, k, v, **kw)
    assert core.attention_copied_calls() - before == copies
    dense = [_memory.copy(a) for a in (q, k, v)]
    before = core.attention_copied_calls()
    ref = attnlab.scaled_dot_product_attention(*dense, **kw)
    assert core.attention_copied_calls() == before  # contiguous rows: nothing to copy
    for g, r in zip(got, ref, strict=True) if isinstance(got, tuple) else [(got, ref)]:
        np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"causal": True},
        {"window": (100, 20)},
        {"softcap": 4.0},
        {"return_lse": True},
        "sinks",
        "alibi",
        "key_padding",
    ],
    ids=["plain", "causal", "window", "softcap", "lse", "sinks", "alibi", "key_padding"],
)
def test_strided_heads_equal_contiguous(dtype, opts):
    rng = np.random.default_rng(3)
    b, h, n, d = 2, 2, N_COPY + 37, 32
    q, k, v = (_heads(rng, b, n, h, d, dtype) for _ in range(3))
    if opts == "sinks":
        opts = {"sinks": rng.standard_normal(h).astype(dtype)}
    elif opts == "alibi":
        opts = {"alibi_slopes": np.array([0.5, 0.125], dtype)}
    elif opts == "key_padding":
        keep = np.ones((b, 1, 1, n), bool)
        keep[0, ..., 500:] = False
        opts = {"mask": keep}
    _both(q, k, v, 1, **opts)


def test_grouped_query_heads_and_cross_attention():
    """4 query heads on 2 kv heads, more keys than queries, v wider than q and k."""
    rng = np.random.default_rng(4)
    q = _heads(rng, 1, N_COPY, 4, 64, np.float32)
    k = _heads(rng, 1, 1000, 2, 64, np.float32)
    v = _heads(rng, 1, 1000, 2, 96, np.float32)
    _both(q, k, v, 1)


def test_only_values_strided():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, N_COPY, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, N_COPY, 32)).astype(np.float32)
    v = _heads(rng, 1, N_COPY, 2, 32, np.float32)
    _both(q, k, v, 1)


def _off_line(a: np.ndarray, offset: int) -> np.ndarray:
    """A contiguous copy of ``a`` whose data starts ``offset`` bytes past a cache line."""
    buf = np.empty(a.nbytes + 128, np.uint8)
    start = -buf.ctypes.data % 64 + offset
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == offset
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["k", "v"])
def test_rows_off_a_cache_line_copied(dtype, which):
    """Contiguous K or V whose rows are whole cache lines starting 16 bytes past one (where
    NumPy puts large arrays): copied onto lines, the aligned arrays' bits; rows that are not
    whole lines (40 float32: copying would not align them) are read where they are."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, N_COPY, 32)).astype(dtype) for _ in range(3))
    args = {"k": k, "v": v}
    args[which] = _off_line(args[which], 16)
    _both(q, args["k"], args["v"], 1, causal=True)
    narrow = {n: _off_line(rng.standard_normal((1, 2, N_COPY, 40)).astype(np.float32), 16)
              for n in ("q", "k", "v")}  # fmt: skip
    _both(narrow["q"], narrow["k"], narrow["v"], 0)


@pytest.mark.parametrize("masked", [False, True])
def test_nonfinite_values(masked):
    """NaN and Inf in V reach exactly the outputs that read them, as with contiguous rows."""
    rng = np.random.default_rng(6)
    n = N_COPY + 5
    q, k, v = (_heads(rng, 1, n, 2, 32, np.float32) for _ in range(3))
    base = np.ascontiguousarray(v.transpose(0, 2, 1, 3))
    base[0, 300, 0, 3] = np.nan
    base[0, 700, 1, 0] = np.inf
    v = base.transpose(0, 2, 1, 3)
    kw: dict[str, Any] = {"causal": True} if masked else {}
    _both(q, k, v, 1, **kw)


def test_copy_in_groups_of_heads():
    """More K and V than one copy group holds (64 MiB): the heads are copied group by group."""
    rng = np.random.default_rng(7)
    b, h, n, d = 2, 24, N_COPY, 256  # 48 kv heads of 1.5 MiB: two groups
    q, k, v = (_heads(rng, b, n, h, d, np.float32) for _ in range(3))
    _both(q, k, v, 1)


def test_few_query_tiles_read_in_place():
    """Fewer than 8 query tiles per head: the rows are read where they are."""
    rng = np.random.default_rng(8)
    q, k, v = (_heads(rng, 2, N_COPY - 96, 2, 32, np.float32) for _ in range(3))
    _both(q, k, v, 0)


def test_multi_head_attention_long_rows_copy():
    """The MHA forward's heads are column blocks of its projections: a long sequence takes the
    copy, bit for bit the heads' attention on contiguous arrays."""
    rng = np.random.default_rng(9)
    n, d, h = N_COPY + 10, 64, 2
    x = rng.standard_normal((1, n, d)).astype(np.float32)
    w = {k: (rng.standard_normal((d, d)) / 8).astype(np.float32) for k in ("w_q", "w_k", "w_v")}
    w["w_o"] = np.eye(d, dtype=np.float32)
    before = core.attention_copied_calls()
    got = attnlab.multi_head_attention(x, num_heads=h, **w)
    assert core.attention_copied_calls() - before == 1

    def heads_of(name: str) -> np.ndarray:  # the projection, as contiguous (h, n, d_head) heads
        y = np.empty((n, d), np.float32)
        core.linear_forward(x[0], w[name], None, y, False)
        return np.ascontiguousarray(y.reshape(n, h, -1).transpose(1, 0, 2))

    q, k, v = (heads_of(name) for name in ("w_q", "w_k", "w_v"))
    ctx = attnlab.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(got[0], ctx.transpose(1, 0, 2).reshape(n, d))


def test_a_head_larger_than_a_copy_group_is_read_in_place():
    """A kv head whose K and V exceed the copy group (64 MiB) is not copied (no copy of that
    size): read where it is, with the same result."""
    rng = np.random.default_rng(10)
    q = _heads(rng, 1, N_COPY, 2, 256, np.float64)
    k = _heads(rng, 1, 16400, 2, 256, np.float64)  # 16400 x 512 doubles: 64.06 MiB per head
    v = _heads(rng, 1, 16400, 2, 256, np.float64)
    _both(q, k, v, 0)
