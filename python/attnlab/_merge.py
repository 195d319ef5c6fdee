"""Attention over disjoint key sets combined into attention over their union, by the
log-sum-exp of each part (the merge step of split-key and ring attention)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _half, _memory
from . import _validate as V
from ._loader import core

__all__ = ["merge_attention"]


def _as_part(o: Any, name: str) -> np.ndarray:
    """An output part as an array: a float16 or bfloat16 ndarray as it is (widened when its
    turn comes), any other as :func:`V.as_array` makes it."""
    keep = o.dtype if type(o) is np.ndarray and _half.is_half(o.dtype) else None
    return V.as_array(o, name, keep)


def _in_dtype(o: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A part as a C-contiguous array of the computation dtype (a half-precision one widened)."""
    return _memory.contiguous(_half.widen(o) if _half.is_half(o.dtype) else o, dtype)


def _computed(o: np.ndarray) -> np.ndarray:
    """The array that stands for a part in the computation dtype: float32 for a half one."""
    return _half.COMPUTED if _half.is_half(o.dtype) else o


def merge_attention(outs: Sequence[Any], lses: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Combine attention over disjoint key sets into attention over their union.

    With ``out_k, lse_k = scaled_dot_product_attention(q, k_k, v_k, return_lse=True)`` for a
    partition of the keys into parts ``k``, the attention over all keys is
    ``sum_k exp(lse_k - lse) out_k`` with ``lse = log(sum_k exp(lse_k))``.

    Parameters
    ----------
    outs : sequence of array_like, each shape (..., n_q, d_v)
        The outputs of each part (e.g. ``(..., h, n_q, d_v)`` from SDPA).
    lses : sequence of array_like, each shape (..., n_q)
        Their log-sum-exps (``return_lse=True``); ``-inf`` for a row that saw no key of a part.

    Returns
    -------
    out : ndarray, shape (..., n_q, d_v)
        Zero on rows that saw no key in any part.
    lse : ndarray, shape (..., n_q)

    Notes
    -----
    Sinks (``sinks=``) belong to one softmax: pass them to one part only, or the sink is
    counted once per part. The dtype is ``np.result_type`` of the inputs (float32 or float64);
    float16 and bfloat16 are computed in float32, and ``out`` is stored in the outputs' dtype
    when they all have the same one (as the parts' attention returned them; ``lse`` stays in
    the computation dtype, float32 for an SDPA part's log-sum-exp).

    Examples
    --------
    >>> import numpy as np, attnlab
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 5, 8)) for _ in range(3))
    >>> parts = [attnlab.scaled_dot_product_attention(q, k[:, s], v[:, s], return_lse=True)
    ...          for s in (slice(0, 2), slice(2, 5))]
    >>> out, lse = attnlab.merge_attention(*zip(*parts))
    >>> bool(np.allclose(out, attnlab.scaled_dot_product_attention(q, k, v)))
    True
    """
    if isinstance(outs, np.ndarray) or isinstance(lses, np.ndarray):
        raise TypeError("outs, lses: expected sequences of arrays (one per key part), not arrays")
    # half-precision outputs stay as stored until their turn below (one float32 copy at a time)
    outs_a = [_as_part(o, f"outs[{i}]") for i, o in enumerate(outs)]
    lses_a = [V.as_array(s, f"lses[{i}]") for i, s in enumerate(lses)]
    if not outs_a or len(outs_a) != len(lses_a):
        raise ValueError(
            f"outs, lses: expected the same number (>= 1) of outputs and log-sum-exps, got "
            f"{len(outs_a)} and {len(lses_a)}"
        )
    shape = outs_a[0].shape
    for i, (o, s) in enumerate(zip(outs_a, lses_a, strict=True)):
        if o.ndim < 2 or o.shape != shape:
            raise ValueError(
                f"outs[{i}]: expected shape {V.shape_str(shape)} (..., n_q, d_v) like outs[0], "
                f"got {V.shape_str(o.shape)}"
            )
        if s.shape != shape[:-1]:
            raise ValueError(
                f"lses[{i}]: expected shape {V.shape_str(shape[:-1])} (outs' without d_v), got "
                f"{V.shape_str(s.shape)}"
            )
    dtype = V.result_dtype(*(_computed(o) for o in outs_a), *lses_a)
    lse_stack = np.stack([s.astype(dtype, copy=False) for s in lses_a])
    top = np.max(lse_stack, axis=0)
    shift = np.where(np.isneginf(top), 0.0, top).astype(dtype)  # rows with no key anywhere
    with np.errstate(invalid="ignore"):
        w = np.exp(lse_stack - shift)  # exp(-inf) = 0 for a part that saw no key
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), top)
        frac = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)
    # out = sum_k frac_k out_k, row by row, by the kernel: the parts read as stored (float16 and
    # bfloat16 widened a row at a time) when all are of one half dtype, the output then rounded
    # as it is written
    rows, d = V.count(shape[:-1]), shape[-1]
    half = _half.storage({f"outs[{i}]": o for i, o in enumerate(outs)})
    as_stored = half is not None and dtype == np.float32 and all(o.dtype == half for o in outs_a)
    out = _memory.empty(shape, half if as_stored and half is not None else dtype)
    if out.size:
        parts: list[np.ndarray]
        if as_stored:
            parts = [_memory.contiguous(o).view(np.uint16).reshape(rows, d) for o in outs_a]
        else:
            parts = [_in_dtype(o, dtype).reshape(rows, d) for o in outs_a]
        weights = _memory.contiguous(frac.reshape(len(parts), rows), dtype)
        target = out.view(np.uint16) if as_stored else out
        core.merge_parts(
            parts, _half.code(out.dtype) if as_stored else 0, weights, target.reshape(rows, d)
        )
    return _half.store(out, half), lse.astype(dtype, copy=False)
