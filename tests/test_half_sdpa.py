"""Half-precision SDPA read and written as stored: ``q``, ``k``, ``v`` in float16 or bfloat16 are
widened inside the kernel (the flash tiles a kv head's key blocks at a time, the decode path as
its kernels load them) and the output rounded as it is written. Widening is exact and the
kernels sum in the same order, so each result must be bit for bit the float32 call on the
widened inputs, rounded: on the tiles' two ways of holding K and V (per thread for heads that
fit, per call for larger ones), the decode path, masks, grouped heads, nonfinite values,
strided and broadcast inputs, and any thread count."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import attnlab

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

DTYPES = [
    pytest.param(np.dtype(np.float16), id="float16"),
    pytest.param(
        np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else None,
        id="bfloat16",
        marks=pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes (bfloat16) not installed"),
    ),
]

# (batch, heads, kv heads, n_q, n_k, d, d_v): tiles with per-thread K/V (small heads, several
# query tiles), the per-call copies (n_k (d + d_v) above 2**20 floats), the decode path
SHAPES = [
    pytest.param((2, 4, 4, 200, 150, 32, 32), id="tiles"),
    pytest.param((1, 4, 2, 97, 300, 64, 48), id="tiles-gqa"),
    pytest.param((1, 2, 2, 100, 2100, 64, 64), id="tiles-large-head"),
    pytest.param((1, 2, 1, 100, 8300, 64, 64), id="tiles-call-copy"),
    pytest.param((2, 8, 2, 1, 700, 64, 64), id="decode"),
    pytest.param((1, 3, 3, 0, 5, 8, 8), id="no-queries"),
    pytest.param((1, 3, 3, 4, 0, 8, 8), id="no-keys"),
]


def _inputs(shape: tuple[int, ...], dtype: np.dtype, seed: int = 0) -> list[np.ndarray]:
    B, h, hk, nq, nk, d, dv = shape
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(s).astype(np.float32).astype(dtype)
        for s in ((B, h, nq, d), (B, hk, nk, d), (B, hk, nk, dv))
    ]


def _check(q: Any, k: Any, v: Any, **kw: Any) -> None:
    dtype = q.dtype
    got = attnlab.scaled_dot_product_attention(q, k, v, **kw)
    want = attnlab.scaled_dot_product_attention(
        *(np.asarray(x, np.float32) for x in (q, k, v)), **kw
    )
    if isinstance(want, tuple):  # (out, lse): the log-sum-exp stays float32
        assert got[1].dtype == np.float32
        np.testing.assert_array_equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(dtype).view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bitwise_the_float32_call_rounded(shape: tuple[int, ...], dtype: np.dtype) -> None:
    _check(*_inputs(shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True},
        {"window": (40, 3)},
        {"softcap": 5.0, "return_lse": True},
        {"sinks": "sinks"},
        {"mask": "additive"},
        {"mask": "padding"},
    ],
    ids=["causal", "window", "softcap-lse", "sinks", "additive", "padding"],
)
def test_bitwise_with_masks(shape: tuple[int, ...], dtype: np.dtype, kw: dict[str, Any]) -> None:
    q, k, v = _inputs(shape, dtype, seed=1)
    B, h, _, nq, nk = shape[:5]
    rng = np.random.default_rng(2)
    kw = dict(kw)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = rng.standard_normal(h).astype(np.float32)
    if kw.get("mask") == "additive":
        kw["mask"] = rng.standard_normal((nq, nk)).astype(np.float32)
    elif kw.get("mask") == "padding":
        pad = np.ones((B, 1, 1, nk), bool)
        pad[..., nk // 3 :] = False
        pad[-1] = False  # a sequence with no key: zero rows, never NaN
        kw["mask"] = pad
        kw["warn_empty_rows"] = False
    _check(q, k, v, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_nonfinite_values_as_in_float32(shape: tuple[int, ...], dtype: np.dtype) -> None:
    q, k, v = _inputs(shape, dtype, seed=3)
    v[..., 5, 0] = np.inf
    v[..., -2, -1] = np.nan
    with np.errstate(invalid="ignore"):
        _check(q, k, v, causal=True)
        _check(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_broadcast_inputs(dtype: np.dtype) -> None:
    rng = np.random.default_rng(4)
    # (B, n, h, d) views, as a layer's heads are: row strides of h * d
    q = rng.standard_normal((2, 130, 4, 32)).astype(np.float32).astype(dtype).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 90, 4, 32)).astype(np.float32).astype(dtype).transpose(0, 2, 1, 3)
    v = rng.standard_normal((90, 4, 16)).astype(np.float32).astype(dtype).transpose(1, 0, 2)
    _check(q, k, v)  # v broadcast over the batch
    _check(q[:, :, ::2], k, v, causal="bottom_right")


def test_same_bits_for_any_thread_count() -> None:
    code = (
        "import numpy as np, attnlab, hashlib\n"
        "rng = np.random.default_rng(5)\n"
        "outs = []\n"
        "for s in [(2, 4, 2, 300, 257, 64, 64), (1, 2, 1, 100, 2100, 64, 64),"
        " (3, 8, 2, 1, 900, 64, 64)]:\n"
        "    B, h, hk, nq, nk, d, dv = s\n"
        "    q, k, v = (rng.standard_normal(x).astype(np.float16) for x in"
        " ((B, h, nq, d), (B, hk, nk, d), (B, hk, nk, dv)))\n"
        "    outs.append(attnlab.scaled_dot_product_attention(q, k, v, causal=True))\n"
        "print(hashlib.sha256(b''.join(o.tobytes() for o in outs)).hexdigest())\n"
    )
    digests = set()
    for threads in ("1", "2", "3"):
        env = dict(os.environ, ATTNLAB_NUM_THREADS=threads)
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        digests.add(run.stdout.strip())
    assert len(digests) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_calls_of_other_shapes_between(dtype: np.dtype) -> None:
    """A thread's widened head belongs to one call: the next call (same head index, other data
    or shape) widens its own."""
    a = _inputs((1, 2, 2, 120, 100, 16, 16), dtype, seed=6)
    b = _inputs((1, 2, 2, 120, 100, 16, 16), dtype, seed=7)
    c = _inputs((1, 2, 2, 120, 60, 16, 24), dtype, seed=8)
    for x in (a, b, c, a):
        _check(*x)
