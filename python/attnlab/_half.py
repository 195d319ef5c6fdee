"""Half-precision storage: float16 and bfloat16 (``ml_dtypes``) arrays are computed in float32
(products accumulated and softmax statistics kept in float32) and the results stored back in
the input dtype. The conversion in is exact; the one rounding out is the storage's own.

A call stores in half precision when every floating array argument that sets the computation
dtype has the same half dtype (float16 and float32 mixed compute and return float32, as
``np.result_type`` says; float16 and bfloat16 mixed compute and return float32)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, overload

import numpy as np

from . import _memory
from ._loader import core

__all__: list[str] = []  # private module

HALF_NAMES = frozenset({"float16", "bfloat16"})

# arguments whose dtype never sets the computation dtype (masks and per-head options are
# converted to it): they do not decide the storage either
_OPTIONS = frozenset(
    {"mask", "key_padding_mask", "positions", "alibi_slopes", "sinks", "rope_inv_freq"}
)


# the scalar options' types, which have no dtype (skipped without asking them for one)
_SCALARS = frozenset({bool, int, float, str})


# the verdicts of is_half on 2-byte dtypes: ``dtype.name`` is computed in Python on every read,
# and a float16 call asks for each of its arrays (docs/performance.md). Bounded; cleared when full.
_HALF_DTYPES: dict[np.dtype, bool] = {}


# an empty float32 array: what a half-precision array computes in, where the computation dtype
# is found from arrays (``_validate.result_dtype``) and a half one is passed on as stored
COMPUTED = np.empty(0, np.float32)


def is_half(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (``ml_dtypes``' is recognised by name, so that
    attnlab does not import ``ml_dtypes`` itself) in this machine's byte order: the kernels read
    their bits. A byte-swapped one is another dtype, converted as a big-endian float32 is."""
    if dtype.itemsize != 2:  # the common case, answered without a lookup
        return False
    found = _HALF_DTYPES.get(dtype)
    if found is None:
        if len(_HALF_DTYPES) >= 64:
            _HALF_DTYPES.clear()
        found = _HALF_DTYPES[dtype] = dtype.name in HALF_NAMES and dtype.isnative
    return found


def storage(args: Mapping[str, Any], skip: Iterable[str] = ()) -> np.dtype | None:
    """The half dtype the call's results are stored in, or None (stored in the computation
    dtype). ``args``: the call's arguments by name; ``skip``: further names that do not set
    the computation dtype."""
    skipped = _OPTIONS.union(skip)
    found: np.dtype | None = None
    for name, x in args.items():
        if x is None or type(x) in _SCALARS or name in skipped or name.startswith("_"):
            continue
        dt = getattr(x, "dtype", None)
        if not isinstance(dt, np.dtype) or dt.kind not in "fV":
            continue
        if not is_half(dt) or (found is not None and dt != found):
            return None
        found = dt
    return found


def code(dtype: np.dtype) -> int:
    """The kernels' name of a half dtype: 1 float16, 2 bfloat16."""
    return 1 if dtype == np.float16 else 2


def from_bits(a: np.ndarray, half: np.dtype | None) -> np.ndarray:
    """A kernel's uint16 output seen as the half dtype ``half`` it holds; ``a`` itself when
    ``half`` is None."""
    return a if half is None else a.view(half)


@overload
def bits(a: np.ndarray) -> np.ndarray: ...
@overload
def bits(a: None) -> None: ...
def bits(a: np.ndarray | None) -> np.ndarray | None:
    """A float16 or bfloat16 array as its bits (uint16), as the kernels take it; any other
    array, or None, as it is."""
    return a.view(np.uint16) if a is not None and is_half(a.dtype) else a


def widen(a: np.ndarray) -> np.ndarray:
    """A float16 or bfloat16 array as float32 (exact), converted on attnlab's threads (NumPy's
    ``astype`` converts one element at a time; docs/performance.md has the figures)."""
    out = _memory.empty(a.shape, np.float32)
    widen_into(a, out)
    return out


def widen_into(a: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = a`` for a float16 or bfloat16 ``a`` and a C-contiguous float32 ``out`` of
    its shape, as :func:`widen`."""
    src = a if a.flags.c_contiguous else a.copy(order="C")
    if out.size:
        core.widen_half(src.view(np.uint16), out, code(src.dtype))


def store(x: np.ndarray, half: np.dtype | None) -> np.ndarray:
    """``x`` rounded to the storage dtype ``half`` (round to nearest even, as ``astype``), or
    ``x`` itself (also when it is stored so already)."""
    if half is None or x.dtype == half:
        return x
    if x.dtype != np.float32 or not x.flags.c_contiguous or not x.size:
        return x.astype(half)
    out = _memory.empty(x.shape, half)  # recycled memory: no fresh pages to fault in
    core.narrow_half(x, out.view(np.uint16), code(half))
    return out


def halves(args: Mapping[str, Any]) -> dict[str, np.dtype]:
    """The half dtypes of the arguments given in one, by name (what :func:`store_grads`
    needs, kept by ``attnlab.vjp``'s forward without the arrays themselves)."""
    found = {}
    for name, x in args.items():
        dt = getattr(x, "dtype", None)
        if isinstance(dt, np.dtype) and is_half(dt):
            found[name] = dt
    return found


def store_grads(grads: dict[str, np.ndarray], hs: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
    """Each gradient in the dtype of its argument when that is a half dtype (``hs``: the
    call's :func:`halves`), as autograd gives a float16 parameter a float16 gradient; the
    others as computed."""
    return {n: store(g, hs[n]) if n in hs else g for n, g in grads.items()}


def own_bf16_rounding(args: Mapping[str, Any], names: Iterable[str]) -> bool:
    """Whether the arrays ``names`` of ``args`` (those given) are bfloat16 ndarrays holding no
    subnormal and no NaN: then rounding them to bfloat16 (``precision="bf16"``, as
    :func:`rounded_bf16`) leaves every value as it is, and they are read as stored."""
    given = [args[n] for n in names if args[n] is not None]
    if not given or not all(type(a) is np.ndarray and is_half(a.dtype) for a in given):
        return False
    if any(code(a.dtype) != 2 for a in given):  # float16 is rounded
        return False
    return not any(core.bf16_special(np.ascontiguousarray(a).view(np.uint16)) for a in given)


def rounded_bf16(*arrays: np.ndarray) -> list[np.ndarray]:
    """float32 ``arrays`` rounded to the nearest bfloat16 (ties to even), as float32 copies:
    subnormals to signed zero, NaN and Inf kept (the kernels' rounding, ``round_bf16`` in
    cpp/src/kernels/bf16.hpp). An array passed twice is rounded once (shared rows stay so)."""
    done: dict[int, np.ndarray] = {}
    for x in arrays:
        if id(x) not in done:
            u = x.view(np.uint32)
            r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(
                0xFFFF0000
            )
            r = np.where((u & np.uint32(0x7F800000)) == 0, u & np.uint32(0x80000000), r)
            done[id(x)] = np.where(np.isnan(x), x, r.view(np.float32))
    return [done[id(x)] for x in arrays]
