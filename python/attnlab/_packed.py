"""Weights packed once for the projections of many calls (what ONNX Runtime does to the
constant weights of a session)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _docs
from . import _validate as V
from ._loader import core


@_docs.filled
class PackedWeight:
    """A weight matrix copied once and packed for this CPU's projection kernel.

    Every call of :func:`multi_head_attention` packs each weight's column panels into the
    layout its matrix-product kernel reads (a copy of the weight, made as the products start).
    A ``PackedWeight`` holds that layout, made once: pass it in place of ``w_q``, ``w_k``,
    ``w_v`` or ``w_o`` when the same weights serve many calls (inference). The results are
    bitwise the same as with the array: the same products, in the same order.

    Parameters
    ----------
    w : array_like, shape (in_features, out_features)
        A float32 or float64 weight, ``(in, out)`` as everywhere in attnlab. It is copied: later
        changes to ``w`` do not reach the ``PackedWeight``.

    Attributes
    ----------
    array : ndarray, shape (in_features, out_features)
        The copy of ``w`` (read-only). ``np.asarray(packed)`` returns it, so a ``PackedWeight``
        is accepted wherever a weight array is.
    shape : tuple of int
    dtype : numpy.dtype
    nbytes : int
        The copy and its packed panels together (about twice the weight's bytes).

    Notes
    -----
    The packed panels are read by :func:`multi_head_attention`'s projections (forward, and the
    forward a backward recomputes) when the call computes in the weight's dtype with
    ``precision=None``. With ``precision="bf16"`` (a float32 weight), where the bf16 products
    run on AMX or AVX512-BF16 (``build_info()["bf16_kernel"]``), they read the weight rounded
    to bfloat16 in their own tile layout, packed at the first such call and kept (``nbytes``
    then counts it). Every other use reads ``array`` (the same result, no gain): calls
    promoted to another dtype, the emulated bf16 products, weight gradients, the other
    families. The packed layouts depend on the instruction set the module chose at import; a
    pickled ``PackedWeight`` stores the array and packs it again when loaded.

    {examples}
    >>> x = rng.standard_normal((1, 128, 64), dtype=np.float32)
    >>> w = {{n: rng.standard_normal((64, 64), dtype=np.float32) / 8
    ...      for n in ("w_q", "w_k", "w_v", "w_o")}}
    >>> packed = {{n: attnlab.PackedWeight(a) for n, a in w.items()}}
    >>> out = attnlab.multi_head_attention(x, num_heads=4, **packed)
    >>> out.tobytes() == attnlab.multi_head_attention(x, num_heads=4, **w).tobytes()
    True
    """

    __slots__ = ("_array", "_panels", "_tiles")

    def __init__(self, w: Any) -> None:
        if isinstance(w, PackedWeight):
            w = w.array
        dt = getattr(w, "dtype", None)  # an array's own dtype, before any conversion
        if isinstance(dt, np.dtype) and dt not in (np.float32, np.float64):
            raise TypeError(
                f"w: expected a float32 or float64 array, got {dt} (convert it first, "
                "e.g. w.astype(np.float32): the packed panels are read in the weight's dtype)"
            )
        a = V.as_array(w, "w")
        if a.ndim != 2:
            raise ValueError(f"w: expected a 2-d (in_features, out_features) array, got {a.ndim}-d")
        copy = np.array(a, dtype=a.dtype, order="C", copy=True)
        copy.flags.writeable = False
        panels = core.pack_weight(copy)
        panels.flags.writeable = False
        self._array: np.ndarray = copy
        self._panels: np.ndarray = panels
        self._tiles: np.ndarray | bool | None = False  # False: not packed yet (_tiles_bf16)

    @property
    def array(self) -> np.ndarray:
        return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        tiles = self._tiles.nbytes if isinstance(self._tiles, np.ndarray) else 0
        return int(self._array.nbytes + self._panels.nbytes + tiles)

    def _panels_for(self, dtype: np.dtype, bf16: bool = False) -> np.ndarray | None:
        """The packed panels for a call computing in ``dtype`` (None for another dtype), or
        with ``bf16`` (``precision="bf16"``) the bf16 tiles (None where the products are
        emulated)."""
        if dtype != self._array.dtype:
            return None
        return self._tiles_bf16() if bf16 else self._panels

    def _tiles_bf16(self) -> np.ndarray | None:
        """The weight as the bf16 products' tiles, packed at the first call that asks (two
        threads packing at once make the same array)."""
        if self._tiles is False:
            tiles = core.pack_bf16_tiles(self._array)  # (bf16 calls compute in float32)
            if tiles is not None:
                tiles.flags.writeable = False
            self._tiles = tiles
        return self._tiles if isinstance(self._tiles, np.ndarray) else None

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy:
            return np.array(self._array, dtype=dtype, copy=True)
        if dtype is None or np.dtype(dtype) == self._array.dtype:
            return self._array
        if copy is False:
            raise ValueError(f"PackedWeight: cannot give {np.dtype(dtype)} without a copy")
        return self._array.astype(dtype)

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        return (PackedWeight, (np.array(self._array),))

    def __repr__(self) -> str:
        return f"PackedWeight(shape={self.shape}, dtype={self.dtype})"
