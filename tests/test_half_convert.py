"""The half-precision conversions at the Python boundary (core.widen_half / narrow_half, used for
every float16 / bfloat16 argument and result) against NumPy's and ml_dtypes' ``astype``: bit for
bit, NaN kept as NaN, over random bit patterns, the edges of each format and odd shapes."""

import numpy as np
import pytest

from attnlab import _half
from attnlab._loader import core

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
