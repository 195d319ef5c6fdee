"""Finishing gradients, shared by every family's backward: the incoming ``grad_out`` checked
against the output's shape, and kernel gradients of ``(B * n, d)`` rows turned back into
gradients shaped like the arguments the caller passed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _half, _memory
from . import _validate as V

if TYPE_CHECKING:
    from ._args import Masks

__all__: list[str] = []  # private module


def grad_out(
    g: Any, expected: tuple[int, ...], dtype: np.dtype, keep: np.dtype | None = None
) -> np.ndarray:
    """``grad_out`` as an array of the result dtype, refused unless shaped like the output.
    ``keep``: a half dtype it stays in when it is an ndarray of it (read as stored)."""
    a = V.as_array(g, "grad_out", keep)
    if a.shape != expected:
        raise ValueError(
            f"grad_out: expected the output's shape {V.shape_str(expected)}, got "
            f"{V.shape_str(a.shape)}"
        )
    return a if keep is not None and a.dtype == keep else a.astype(dtype, copy=False)


def grad_out_rows(
    g: Any, expected: tuple[int, ...], dtype: np.dtype, keep: np.dtype | None = None
) -> np.ndarray:
    """``grad_out`` checked, then as contiguous ``(B * n, d_out)`` rows for a kernel (``keep``:
    as :func:`grad_out`; such rows are passed as their bits, uint16)."""
    rows = V.count(expected[:-1])  # not -1: ambiguous when d_out == 0
    a = _memory.contiguous(grad_out(g, expected, dtype, keep).reshape(rows, expected[-1]))
    return a.view(np.uint16) if keep is not None and a.dtype == keep else a


def unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a gradient over the axes along which its input was broadcast."""
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g


def input_grads(
    rows: dict[str, np.ndarray],
    batch: tuple[int, ...],
    shapes: dict[str, tuple[int, ...]],
    key_omitted: bool,
    value_omitted: bool,
) -> dict[str, np.ndarray]:
    """Gradients of ``query``, ``key`` and ``value`` from the kernel's row gradients, shaped
    as given (summed over broadcast batch axes). An omitted ``key``/``value`` has none of its
    own: the kernel added it into the buffer of the argument it defaulted to
    (:func:`input_buffers`; gradient keys follow the arguments given, not identity)."""
    omitted = {n for n, o in (("key", key_omitted), ("value", value_omitted)) if o}
    inputs = {}
    for name, r in rows.items():
        if name in omitted:
            continue
        g = r.reshape(batch + (shapes[name][-2], r.shape[-1]))
        inputs[name] = unbroadcast(g, shapes[name])
    return inputs


def input_buffers(
    rows: Mapping[str, tuple[int, ...]],
    key_omitted: bool,
    value_omitted: bool,
    dtype: np.dtype,
    zeroed: bool = True,
) -> dict[str, np.ndarray]:
    """Row gradients of ``query``, ``key`` and ``value`` (their row shapes given), one buffer
    shared by an omitted ``key``/``value`` and the argument it defaulted to: a kernel that adds
    into an aliased buffer sums them itself (no two extra arrays, no additions). Zeroed unless
    ``zeroed`` is False (for a kernel that writes every element)."""
    new = _memory.zeros if zeroed else _memory.empty
    out = {"query": new(rows["query"], dtype)}
    out["key"] = out["query"] if key_omitted else new(rows["key"], dtype)
    out["value"] = out["key"] if value_omitted else new(rows["value"], dtype)
    return out


def grad_buffers(
    arrays: dict[str, np.ndarray | None],
    dtype: np.dtype,
    zeroed: bool = True,
    stored: Mapping[str, np.dtype] | None = None,
) -> dict[str, np.ndarray]:
    """Gradient buffers for the arrays given (``None``: an omitted bias, no entry); zeroed
    unless ``zeroed`` is False (for a kernel that writes every element: filling them first is a
    cost on every training step, docs/performance.md); ``stored``: names whose gradient the
    kernel writes in another dtype (a half-precision weight's, rounded as it is written)."""
    new = _memory.zeros if zeroed else _memory.empty
    other = stored or {}
    return {n: new(a.shape, other.get(n, dtype)) for n, a in arrays.items() if a is not None}


def logit_buffers(
    m: Masks, B: int, h: int, n_q: int, n_k: int, dtype: np.dtype
) -> dict[str, np.ndarray]:
    """Zeroed kernel buffers for the gradients of the logits' own parameters: a float
    ``mask`` ``(B, h, n_q, n_k)`` (the kernel writes only the tiles it visits) and
    ``sinks`` ``(B, h)``; only those the call was given."""
    out: dict[str, np.ndarray] = {}
    if "mask" in m.given:
        out["mask"] = _memory.zeros((B, h, n_q, n_k), dtype)
    if "sinks" in m.given:
        out["sinks"] = _memory.zeros((B, h), dtype)
    return out


def logit_grads(
    bufs: dict[str, np.ndarray], m: Masks, batch: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """The buffers of :func:`logit_buffers` summed back to the shapes the caller gave."""
    return {
        name: unbroadcast(g.reshape(batch + g.shape[1:]), m.given[name]).copy()
        for name, g in bufs.items()
    }


def linear_grads(
    x: np.ndarray,
    w: np.ndarray,
    dy: np.ndarray,
    dx: np.ndarray | None = None,
    dw: np.ndarray | None = None,
    db: np.ndarray | None = None,
    accumulate: bool = False,
) -> None:
    """The gradients of ``y = x w + b`` (2-d, one float dtype) for ``dy``, by the C++ GEMM
    without transposed copies: ``dx = dy w^T`` (``+=`` with ``accumulate``), ``dw = x^T dy``,
    ``db`` the column sums of ``dy``, each written when given; ``x`` and ``dx`` may be views of
    rows with a stride of their own. Any of ``x``, ``w``, ``dy`` in one half dtype (float16 or
    bfloat16) is read as stored, the others float32 (one of a second half dtype is refused by
    name); a ``dw`` of that dtype is written so (rounded as the GEMM writes it), ``dx`` and
    ``db`` float32."""
    from ._loader import core

    if x.strides[-1] != x.itemsize:  # (rows of their own stride are read in place)
        x = _memory.contiguous(x)
    w, dy = _memory.contiguous(w), _memory.contiguous(dy)
    half = next((a.dtype for a in (x, w, dy, dw) if a is not None and _half.is_half(a.dtype)), None)
    if half is None:
        core.linear_backward(x, w, dy, dx, dw, db, accumulate)
        return

    def stored(a: np.ndarray) -> np.ndarray:  # (another half dtype: refused by the binding)
        return a.view(np.uint16) if a.dtype == half else a

    dw_ = None if dw is None else stored(dw)
    core.linear_backward(
        stored(x), stored(w), stored(dy), dx, dw_, db, accumulate, _half.code(half)
    )
