"""Argument normalisation and validation shared by every public function.

Every error names the argument, what it got and what was expected (docs/architecture.md, section 3).
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import types
import warnings
from typing import Any, NamedTuple

import numpy as np

from ._half import is_half, widen
from ._memory import _zero_strides_to_one, contiguous, copy, kernel_ready

__all__: list[str] = []  # private module

_NATIVE = (np.dtype(np.float32), np.dtype(np.float64))


def as_array(x: Any, name: str, keep: np.dtype | None = None) -> np.ndarray:
    """Return ``x`` as a float32/float64 array following the dtype rules.

    float32 and float64 are kept; float16 and bfloat16 become float32 (exactly: see
    :mod:`attnlab._half`); other real numeric dtypes (ints, ...) become float64; bool, complex,
    object and string data raise ``TypeError``. ``keep``: a half dtype ``x`` stays in when it
    is an ndarray of it (for a kernel that reads it as stored).
    """
    if keep is not None and type(x) is np.ndarray and x.dtype == keep:
        return x
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    try:
        a = np.asarray(x)
    except Exception as exc:  # noqa: BLE001 (ragged lists, or whatever __array__ raises)
        raise TypeError(f"{name}: could not be converted to an array ({exc})") from None
    kind = a.dtype.kind
    if is_half(a.dtype):
        return widen(a)
    if kind == "b":
        raise TypeError(f"{name}: expected real floating-point data, got dtype bool")
    if kind not in "fiu":
        raise TypeError(f"{name}: expected real floating-point data, got dtype {a.dtype}")
    if a.dtype not in _NATIVE:
        a = a.astype(np.float64)
    return a


def optional_array(x: Any, name: str, keep: np.dtype | None = None) -> np.ndarray | None:
    return None if x is None else as_array(x, name, keep)


def array_shaped(x: Any, name: str, shape: tuple[int, ...], whose: str = "") -> np.ndarray:
    """``x`` as by :func:`as_array`, refused unless its shape is ``shape`` (``whose``: what
    the expected shape belongs to, for the message, e.g. ``" (the parameter's)"``)."""
    a = as_array(x, name)
    if a.shape != shape:
        raise ValueError(
            f"{name}: expected shape {shape_str(shape)}{whose}, got {shape_str(a.shape)}"
        )
    return a


def result_dtype(*arrays: np.ndarray | None) -> np.dtype:
    """The computation dtype: ``np.result_type`` of the (already normalised) inputs."""
    present = [a.dtype for a in arrays if a is not None]
    if present and present[0] in _NATIVE and all(d is present[0] for d in present):
        return present[0]  # one native dtype: its own result type (the common call)
    return np.dtype(np.result_type(*present)) if present else np.dtype(np.float64)


def shape_str(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_ndim(a: np.ndarray, name: str, min_ndim: int, layout: str) -> None:
    if a.ndim < min_ndim:
        raise ValueError(
            f"{name}: expected an array of shape {layout}, got shape {shape_str(a.shape)}"
        )


def check_positive_int(x: Any, name: str, minimum: int = 1) -> int:
    if type(x) is int:  # the usual argument, without the ABC check (bool is not int here)
        if x < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {x}")
        return x
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__} {x!r}")
    v = int(x)
    if v < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {v}")
    return v


def check_scale(scale: Any, default: float) -> float:
    if scale is None:
        return default
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale: expected a finite number, got {s}")
    return s


def positive_real(x: Any, name: str, *, none: str = "", off: bool = False) -> float:
    """``x`` as a finite float > 0, for an option that may also be None (handled by the
    caller): the TypeError says what None means (``none``), the ValueError, with ``off``, that
    None turns the option off."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        meaning = f" ({none})" if none else ""
        raise TypeError(
            f"{name}: expected a positive real number or None{meaning}, got "
            f"{type(x).__name__} {x!r}"
        )
    t = float(x)
    if not (np.isfinite(t) and t > 0):
        hint = " (or None for off)" if off else ""
        raise ValueError(f"{name}: expected a finite number > 0{hint}, got {t}")
    return t


def precision_bf16(precision: Any, dtype: np.dtype) -> bool:
    """Whether ``precision`` asks for bf16 products: ``None`` (exact in the input dtype) or
    ``"bf16"`` (float32 inputs, or half-precision ones computed in float32)."""
    if precision is None:
        return False
    if not isinstance(precision, str) or precision != "bf16":
        raise ValueError(f"precision: expected None or 'bf16', got {precision!r}")
    if dtype != np.float32:
        raise ValueError(
            f"precision: 'bf16' rounds float32 operands to bfloat16 and takes float32 inputs, "
            f"got {dtype} (cast them with .astype(np.float32))"
        )
    return True


_CAUSAL = {False: 0, None: 0, True: 1, "top_left": 1, "bottom_right": 2}


def causal_code(causal: Any) -> int:
    """0 (none), 1 (top-left, as SDPA's is_causal) or 2 (bottom-right)."""
    if isinstance(causal, (bool, np.bool_)) or causal is None:
        return 1 if causal else 0
    if isinstance(causal, str) and causal in _CAUSAL:
        return _CAUSAL[causal]
    raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}")


def weights_mode(return_weights: Any) -> str | None:
    """None, "heads" or "mean"."""
    if isinstance(return_weights, (bool, np.bool_)):
        return "heads" if return_weights else None
    if isinstance(return_weights, str) and return_weights in ("heads", "mean"):
        return return_weights
    raise ValueError(
        f"return_weights: expected False, True, 'heads' or 'mean', got {return_weights!r}"
    )


def batch_shape(name_shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """Broadcast the leading batch shapes of several inputs, naming them on failure."""
    first = tuple(name_shapes[0][1]) if name_shapes else ()
    if all(tuple(s) == first for _, s in name_shapes):
        return first  # nothing to broadcast (the common call)
    try:
        return tuple(np.broadcast_shapes(*[s for _, s in name_shapes]))
    except ValueError:
        desc = ", ".join(f"{n} {shape_str(s)}" for n, s in name_shapes)
        raise ValueError(f"batch dimensions do not broadcast: {desc}") from None


def count(shape: tuple[int, ...]) -> int:
    """Number of elements of ``shape`` (1 for ``()``), as an exact Python int."""
    return math.prod(shape)


def stack(a: np.ndarray, batch: tuple[int, ...], dtype: np.dtype, core: int) -> np.ndarray:
    """Broadcast ``a`` to ``batch + a.shape[-core:]`` and view it as ``(B,) + core shape``.

    Copies only when the batch axes cannot be merged into one stride or the dtype differs.
    """
    tail = a.shape[a.ndim - core :]
    b = count(batch)
    if a.dtype == dtype and a.shape == (b,) + tail:  # already (B,) + core: viewed as it is
        return kernel_ready(a)
    if a.shape[: a.ndim - core] != batch:  # broadcasting needed (skipped otherwise: it is slow)
        a = np.broadcast_to(a, batch + tail)
    r = a.reshape((b,) + tail)
    if r.dtype != dtype or not np.may_share_memory(r, a):  # a copy anyway: one, aligned
        r = copy(a, dtype).reshape((b,) + tail)
    return kernel_ready(r)


def rows(a: np.ndarray, batch: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``a`` (..., n, d) broadcast to ``batch`` as a C-contiguous (B*n, d) matrix."""
    n, d = a.shape[-2:]
    if a.shape[:-2] != batch:
        a = np.broadcast_to(a, batch + (n, d))
    total = count(batch + (n,))  # not -1: ambiguous when d == 0
    if not (a.flags.c_contiguous and a.dtype == dtype):
        a = copy(a, dtype)  # one aligned copy for the dtype, the layout and the broadcast
    return contiguous(a.reshape(total, d))


def matrix(
    w: np.ndarray, name: str, dtype: np.dtype, rows_: int | None, cols: int | None, layout: str
) -> np.ndarray:
    if (
        w.ndim != 2
        or (rows_ is not None and w.shape[0] != rows_)
        or (cols is not None and w.shape[1] != cols)
    ):
        raise ValueError(f"{name}: expected shape {layout}, got {shape_str(w.shape)}")
    return contiguous(w, dtype)


def vector(b: np.ndarray | None, name: str, dtype: np.dtype, n: int) -> np.ndarray | None:
    if b is None:
        return None
    if b.ndim != 1 or b.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},), got {shape_str(b.shape)}")
    return contiguous(b, dtype)


def floating(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a real floating type: NumPy's (kind ``"f"``) or bfloat16."""
    return dtype.kind == "f" or is_half(dtype)


def mask4(
    mask: Any, batch: tuple[int, ...], heads: int, n_q: int, n_k: int, dtype: np.dtype
) -> np.ndarray | None:
    """The attention mask broadcast to (B, heads, n_q, n_k): bool ("may attend") or additive."""
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype.kind == "b":
        pass
    elif floating(m.dtype):
        m = m.astype(dtype, copy=False)
    else:
        raise TypeError(f"mask: expected a bool or floating-point array, got dtype {m.dtype}")
    target = batch + (heads, n_q, n_k)
    try:
        m = np.broadcast_to(m, target)
    except ValueError:
        raise ValueError(
            f"mask: shape {shape_str(m.shape)} does not broadcast to "
            f"(..., h, n_q, n_k) = {shape_str(target)}"
        ) from None
    b = count(batch)
    m = m.reshape((b, heads, n_q, n_k))
    if not m.flags.aligned or any(s < 0 or s % m.itemsize for s in m.strides):
        m = np.array(m, copy=True)
    return m


def key_padding2(kpm: Any, batch: tuple[int, ...], n_k: int) -> np.ndarray | None:
    """The key padding mask (True = real token) broadcast to (B, n_k)."""
    if kpm is None:
        return None
    m = np.asarray(kpm)
    if m.dtype.kind != "b":
        raise TypeError(
            f"key_padding_mask: expected a bool array (True = real token), got dtype {m.dtype}"
        )
    target = batch + (n_k,)
    try:
        m = np.broadcast_to(m, target)
    except ValueError:
        raise ValueError(
            f"key_padding_mask: shape {shape_str(m.shape)} does not broadcast to "
            f"(..., n_k) = {shape_str(target)}"
        ) from None
    b = count(batch)
    m = m.reshape((b, n_k))
    if any(s < 0 for s in m.strides):
        m = np.ascontiguousarray(m)
    return m


def check_flag(x: Any, name: str) -> bool:
    """A True/False argument, refusing other truthy or falsy values (1, None, "yes")."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(x).__name__} {x!r}")
    return bool(x)


# -- shape checks that find the root cause -------------------------------------------------------
# Order (every family): each input's own shape, each weight's own rank, the head counts against
# the weights' widths, each weight against the input it reads, then the weights against each
# other. A weight whose transpose would fit is named with the PyTorch hint.

TORCH_HINT = "PyTorch's nn.Linear.weight is (out, in): pass weight.T, or use attnlab.interop.{}"


def check_matrix(w: np.ndarray, name: str, layout: str, min_cols: int = 1) -> None:
    """``w`` must be 2-D with at least ``min_cols`` columns: its own shape, checked first."""
    if w.ndim != 2 or w.shape[1] < min_cols:
        more = f" with at least {min_cols} column{'s' if min_cols > 1 else ''}" if min_cols else ""
        raise ValueError(
            f"{name}: expected a 2-D array {layout}{more}, got shape {shape_str(w.shape)}"
        )


class Reader(NamedTuple):
    """One weight axis that reads an input's features."""

    name: str  # the argument, e.g. "w_q"
    shape: tuple[int, ...]  # its shape
    width: int  # the length of the axis that reads the input
    axis: str  # that axis in words: "rows", "axis 1 (d_q)"
    layout: str  # the expected layout, e.g. "(d_q, num_heads * d_head)"
    transposed_fits: bool  # the weight would fit if transposed (the PyTorch habit)


def reader(w: np.ndarray, name: str, layout: str, cols_ok: Any, width: int) -> Reader:
    """A 2-D weight reading an input of ``width`` features through its rows; ``cols_ok(n)``
    says whether ``n`` columns would be valid (to detect a transposed weight)."""
    return Reader(
        name,
        w.shape,
        w.shape[0],
        "rows",
        layout,
        w.shape[0] != width and w.shape[1] == width and bool(cols_ok(w.shape[0])),
    )


def transposed(r: Reader, interop: str) -> ValueError:
    """The error for a weight given as PyTorch stores it, ``(out, in)``."""
    return ValueError(
        f"{r.name}: expected shape {r.layout}, got {shape_str(r.shape)}; "
        + TORCH_HINT.format(interop)
    )


def check_heads(w: np.ndarray, heads: int, arg: str, r: Reader, interop: str) -> None:
    """``heads`` (the argument ``arg`` the user passed) must divide the columns of weight ``w``
    (``r`` its reader); when its transpose would fit, the weight is the cause, not the count."""
    if w.shape[1] % heads == 0:
        return
    if r.transposed_fits:
        raise transposed(r, interop)
    raise ValueError(
        f"{arg}: {heads} does not divide the {w.shape[1]} columns of {r.name} "
        f"{shape_str(w.shape)}, which is {r.layout}"
    )


def check_readers(groups: list[tuple[str, np.ndarray, list[Reader]]], interop: str) -> None:
    """Each weight axis must match the width of the input it reads.

    ``groups`` are ``(input name, input, readers)``; one input object may feed several weights
    (self-attention). Blame, in order: a weight whose transpose fits (with the PyTorch hint);
    the input, when every weight reading it disagrees with it and they agree among themselves;
    else the weight that disagrees.
    """
    for _, _, readers in groups:
        for r in readers:
            if r.transposed_fits:
                raise transposed(r, interop)
    for x_name, x, readers in groups:
        d = x.shape[-1]
        bad = [r for r in readers if r.width != d]
        if not bad:
            continue
        if len(bad) == len(readers) and len({r.width for r in bad}) == 1:
            names = ", ".join(f"{r.name} {shape_str(r.shape)}" for r in bad)
            raise ValueError(
                f"{x_name}: expected last dimension {bad[0].width}, as read by "
                f"{names}, got shape {shape_str(x.shape)}"
            )
        r = bad[0]
        raise ValueError(
            f"{r.name}: expected {d} {r.axis} (the features of {x_name} "
            f"{shape_str(x.shape)}) in shape {r.layout}, got {shape_str(r.shape)}"
        )


# -- rows left empty by boolean masks ------------------------------------------------------------

_POLARITY = (
    'In attnlab a boolean True means "may attend" (as in torch\'s '
    "scaled_dot_product_attention); nn.MultiheadAttention's masks use the opposite (True = "
    "masked out): convert them with attnlab.interop.torch_masks. If these rows are meant to be "
    "empty, pass warn_empty_rows=False."
)


def empty_rows(
    m4: np.ndarray | None,
    kp: np.ndarray | None,
    keys: tuple[np.ndarray, np.ndarray] | None,
    B: int,
    h: int,
    n_q: int,
    n_k: int,
) -> tuple[int, int]:
    """``(empty, total)``: the query rows of ``(B, h, n_q)`` that the boolean masks (``m4``
    ``(B, h, n_q, n_k)``, when bool; ``kp`` ``(B, n_k)``), combined with the scalar options,
    leave without a key, among the rows that the scalar options alone leave some key;
    ``total = B h n_q``. ``keys``: ``(lo, hi)``, query ``i`` may see keys ``lo[i] <= j < hi[i]``
    under the scalar options (``_args.Masks.key_intervals``); ``None``: every key.

    Works on the masks' distinct data (broadcast axes are not expanded) and in blocks of query
    rows, so it needs no (n_q, n_k) temporary for the whole batch.
    """
    m = _zero_strides_to_one(m4) if m4 is not None and m4.dtype.kind == "b" else None
    p = _zero_strides_to_one(kp)[:, None, None, :] if kp is not None else None
    total = B * h * n_q
    if (m is None and p is None) or n_q == 0 or n_k == 0:
        return 0, total
    lo, hi = keys if keys is not None else (np.zeros(n_q, np.int64), np.full(n_q, n_k))
    live = lo < hi  # rows the scalar options alone leave some key
    # every query row alike
    same = (m is None or m.shape[2] == 1) and bool(np.all(lo == lo[0]) and np.all(hi == hi[0]))
    rows_ = 1 if same else n_q
    parts = [a for a in (m, p) if a is not None]
    lead = np.broadcast_shapes(*[a.shape[:2] for a in parts])
    step = max(1, (1 << 22) // max(1, count(lead) * n_k))
    empty = 0
    for r0 in range(0, rows_, step):
        r1 = min(rows_, r0 + step)
        j = np.arange(n_k)
        ok = (j >= lo[r0:r1, None]) & (j < hi[r0:r1, None])  # (rows, n_k)
        for a in parts:
            ok = ok & (a[:, :, r0:r1] if a.shape[2] > 1 else a)
        dead = ~ok.any(axis=-1) & live[r0:r1]
        empty += int(dead.sum()) * (n_q if same else 1)
    empty *= (B * h) // count(lead)  # the broadcast axes repeat the same rows
    return empty, total


ATTENTION_ROWS = (
    "query rows (counted over batch and heads) have no key they may attend to: the "
    "boolean masks (mask, key_padding_mask, with causal) leave none, so their "
    "attention weights are all 0"
)
POOLED_ROWS = (
    "sequences have no token that key_padding_mask marks as real (True), so nothing "
    "is pooled for them"
)


def warn_empty(empty: int, total: int, what: str) -> None:
    """The warning for ``empty`` of ``total`` rows (``what`` says which) left with no key."""
    if empty:
        warnings.warn(
            f"{empty} of {total} {what}. {_POLARITY}", UserWarning, stacklevel=user_stacklevel()
        )


def user_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the first caller outside attnlab (and
    outside torch.autograd, through which attnlab.torch calls attnlab)."""
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level = 1
    f: types.FrameType | None = sys._getframe(1)
    while f is not None and (
        f.f_code.co_filename.startswith(pkg)
        or str(f.f_globals.get("__name__", "")).startswith("torch.autograd")
    ):
        f, level = f.f_back, level + 1
    return level
