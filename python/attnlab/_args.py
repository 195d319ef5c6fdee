"""Argument normalisers shared by every family: head counts, the query/key/value inputs, the
masks (``mask``, ``key_padding_mask``, ``causal``, ``warn_empty_rows``) and the returned
weights. Each checks in one fixed order and names the argument in its errors, so that every
family validates an option the same way and a new option is added here once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np

from . import _half, _memory
from . import _validate as V

__all__: list[str] = []  # private module

T = TypeVar("T")

# The mask options of the attention families, in the order the normaliser reads them: the
# torch adapter passes these as constants (never differentiated), converting tensors.
MASK_ARGS = ("mask", "key_padding_mask")


def heads(num_heads: Any, num_kv_heads: Any) -> tuple[int, int, str]:
    """``(h, h_kv, kv_arg)``: the head counts, and the name of the argument that set
    ``h_kv`` (the one the user passed: error messages name it)."""
    h = V.check_positive_int(num_heads, "num_heads")
    h_kv = h if num_kv_heads is None else V.check_positive_int(num_kv_heads, "num_kv_heads")
    if h % h_kv:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {h}, got {h_kv}")
    return h, h_kv, "num_heads" if num_kv_heads is None else "num_kv_heads"


class Qkv(NamedTuple):
    """``query``, ``key`` and ``value`` as arrays (``key`` is ``query`` and ``value`` is
    ``key`` when omitted: the same object, so the kernels read one copy)."""

    xq: np.ndarray
    xk: np.ndarray
    xv: np.ndarray
    key_omitted: bool
    value_omitted: bool

    @property
    def n_q(self) -> int:
        return int(self.xq.shape[-2])

    @property
    def n_k(self) -> int:
        return int(self.xk.shape[-2])

    @property
    def widths(self) -> tuple[int, int, int]:
        """``(d_q, d_k, d_v)``."""
        return int(self.xq.shape[-1]), int(self.xk.shape[-1]), int(self.xv.shape[-1])

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The caller's input shapes, for reducing the gradients."""
        return {"query": self.xq.shape, "key": self.xk.shape, "value": self.xv.shape}

    def batch(self) -> tuple[int, ...]:
        """The broadcast batch shape (``ValueError`` naming the inputs that disagree)."""
        return V.batch_shape(
            [
                ("query", self.xq.shape[:-2]),
                ("key", self.xk.shape[:-2]),
                ("value", self.xv.shape[:-2]),
            ]
        )

    def groups(
        self, readers: tuple[V.Reader, V.Reader, V.Reader]
    ) -> list[tuple[str, np.ndarray, list[V.Reader]]]:
        """Each distinct input with the readers of its features (for ``check_readers``: an
        input read by two weights is checked once, against both)."""
        out: dict[int, tuple[str, np.ndarray, list[V.Reader]]] = {}
        inputs = (("query", self.xq), ("key", self.xk), ("value", self.xv))
        for (name, x), r in zip(inputs, readers, strict=True):
            out.setdefault(id(x), (name, x, []))[2].append(r)
        return list(out.values())

    def rows(
        self, batch: tuple[int, ...], dtype: np.dtype, bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Contiguous ``(B * n, d)`` rows of the result dtype, shared where the inputs are;
        ``bits``: those of a half dtype as their bits (uint16), as the kernels take them."""
        B = V.count(batch)

        def rows_of(x: np.ndarray) -> np.ndarray:
            n, d = x.shape[-2:]
            r = V.rows(x, batch, dtype) if B * n else _memory.empty((0, d), dtype)
            return r.view(np.uint16) if bits else r

        # one object per distinct input: self-attention's rows stay one array, so that vjp
        # keeps one copy and its pullback transposes X once (not once per projection)
        rq = rows_of(self.xq)
        rk = rq if self.xk is self.xq else rows_of(self.xk)
        rv = rk if self.xv is self.xk else rows_of(self.xv)
        return rq, rk, rv


def qkv(
    args: Mapping[str, Any], *, min_features: bool = False, keep: np.dtype | None = None
) -> Qkv:
    """``query``, ``key``, ``value`` of a call checked in order: each as an array, each at
    least 2-D, (with ``min_features``) each with features, then value's tokens against key's.
    ``keep``: a half dtype the three stay in when each is an ndarray of it (else each is
    widened, as :func:`V.as_array` does)."""
    query, key, value = args["query"], args["key"], args["value"]
    if keep is not None and all(
        type(x) is np.ndarray and x.dtype == keep
        for x in (query, key, value)
        if x is not None or x is query
    ):
        xq: np.ndarray = query
        xk = xq if key is None else key
        xv = xk if value is None else value
    else:
        xq = V.as_array(query, "query")
        xk = xq if key is None else V.as_array(key, "key")
        xv = xk if value is None else V.as_array(value, "value")
    V.check_ndim(xq, "query", 2, "(..., n_q, d_q)")
    V.check_ndim(xk, "key", 2, "(..., n_k, d_k)")
    V.check_ndim(xv, "value", 2, "(..., n_k, d_v)")
    if min_features:
        for name, arr in (("query", xq), ("key", xk), ("value", xv)):
            if arr.shape[-1] < 1:
                raise ValueError(
                    f"{name}: the feature axis must be >= 1, got shape {V.shape_str(arr.shape)}"
                )
    n_k = xk.shape[-2]
    if xv.shape[-2] != n_k:
        raise ValueError(
            f"value: expected {n_k} tokens (as key), got shape {V.shape_str(xv.shape)}"
        )
    return Qkv(xq, xk, xv, key is None, value is None)


class CoreMask(NamedTuple):
    """The mask options as one argument of the kernel calls that mask (``core.sdpa_*``,
    ``mha_*``, ``bilinear_*``): ``MaskArgs`` in cpp/bindings/common.hpp, whose ``mask_args``
    reads these fields in this order: the arrays, then the scalar options in the order of
    ``for_each_option`` (cpp/include/attnlab/common.hpp), as ints."""

    mask: np.ndarray | None
    key_padding_mask: np.ndarray | None
    causal: int
    # the options after causal default to "off", so a tuple built by hand names only its own
    window_left: int = -1  # -1: unbounded
    window_right: int = -1
    softcap: float = 0.0  # 0: off
    alibi_slopes: np.ndarray | None = None  # (B, h)
    sinks: np.ndarray | None = None  # (B, h)


class Masks(NamedTuple):
    """The masks of a call as the kernels take them."""

    causal: int  # 0 none, 1 top-left, 2 bottom-right
    scale: float
    mask4: np.ndarray | None  # (B, h, n_q, n_k) view, broadcast, never copied
    kp: np.ndarray | None  # (B, n_k) key padding
    window: tuple[int, int] = (-1, -1)  # (left, right) keys around p(i); -1: unbounded
    softcap: float = 0.0
    alibi: np.ndarray | None = None  # (B, h) view of the slopes
    sinks: np.ndarray | None = None  # (B, h) view
    given: dict[str, tuple[int, ...]] = {}  # noqa: RUF012 (read only) the shapes of mask, sinks

    def core_mask(self) -> CoreMask:
        """The mask argument of the kernel calls, built here alone: the call sites pass it on
        unchanged, so that a new mask option changes none of them."""
        return CoreMask(
            self.mask4, self.kp, self.causal, *self.window, self.softcap, self.alibi, self.sinks
        )

    def empty_lse(self, B: int, h: int, n_q: int, dtype: np.dtype) -> np.ndarray:
        """The log-sum-exp ``(B, h, n_q)`` of rows with no key: the sink's logit, or -inf."""
        lse = np.full((B, h, n_q), -np.inf, dtype)
        if self.sinks is not None:
            lse[...] = self.sinks[:, :, None]
        return lse

    def key_intervals(self, n_q: int, n_k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)``: query ``i`` may see keys ``lo[i] <= j < hi[i]`` under the scalar
        options, the rule of the kernels' ``key_interval`` (cpp/include/attnlab/common.hpp),
        for the warning about rows left without a key."""
        align = np.arange(n_q) + (n_k - n_q if self.causal == 2 else 0)  # query i's key
        lo: np.ndarray = np.zeros(n_q, np.int64)
        hi: np.ndarray = np.full(n_q, n_k, np.int64)
        if self.causal:
            hi = np.minimum(hi, align + 1)
        left, right = self.window
        if left >= 0:
            lo = np.maximum(lo, align - min(left, n_q + n_k))
        if right >= 0:
            hi = np.minimum(hi, align + min(right, n_q + n_k) + 1)
        lo = np.clip(lo, 0, n_k)
        return lo, np.clip(hi, lo, n_k)


def window_sides(window: Any) -> tuple[int, int]:
    """``window=(left, right)`` as two ints, ``-1`` for an unbounded side (``None``)."""
    if window is None:
        return -1, -1
    if isinstance(window, (str, bytes)) or not isinstance(window, (tuple, list)):
        raise TypeError(
            f"window: expected a pair (left, right) of ints >= 0 or None, got "
            f"{type(window).__name__} {window!r} (transformers' sliding_window=w is "
            f"window=(w - 1, 0) with causal=True)"
        )
    if len(window) != 2:
        raise ValueError(f"window: expected a pair (left, right), got {len(window)} items")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(-1)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(
                f"window: the {name} side must be an int >= 0 or None, got "
                f"{type(side).__name__} {side!r}"
            )
        if side < 0:
            raise ValueError(f"window: the {name} side must be >= 0 or None, got {int(side)}")
        sides.append(min(int(side), 2**62))  # wider than any sequence: unbounded in effect
    return sides[0], sides[1]


def softcap_value(softcap: Any) -> float:
    """``softcap`` as a float > 0, or 0.0 (off) for ``None``."""
    return 0.0 if softcap is None else V.positive_real(softcap, "softcap", off=True)


def per_head(
    value: Any, name: str, batch: tuple[int, ...], h: int, dtype: np.dtype
) -> np.ndarray | None:
    """A per-head parameter (``alibi_slopes``, ``sinks``): shape ``(h,)`` or with leading
    batch axes that broadcast to the call's, finite reals; as a ``(B, h)`` view of ``dtype``."""
    if value is None:
        return None
    a = V.as_array(value, name)
    if a.ndim < 1 or a.shape[-1] != h:
        raise ValueError(
            f"{name}: expected shape (h,) = ({h},) or (..., {h}) with batch axes, got "
            f"{V.shape_str(a.shape)}"
        )
    try:
        lead = np.broadcast_shapes(a.shape[:-1], batch)
    except ValueError:
        lead = None
    if lead != tuple(batch):
        raise ValueError(
            f"{name}: shape {V.shape_str(a.shape)} does not broadcast to the batch "
            f"{V.shape_str(batch)} + ({h},)"
        )
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")
    full = np.broadcast_to(a.astype(dtype, copy=False), tuple(batch) + (h,))
    return full.reshape(V.count(batch), h)


def masks(
    args: Mapping[str, Any],
    batch: tuple[int, ...],
    h: int,
    n_q: int,
    n_k: int,
    dtype: np.dtype,
    default_scale: float,
) -> Masks:
    """The causal mode, the scale, ``mask`` (broadcast to ``(B, h, n_q, n_k)``) and
    ``key_padding_mask`` (``(B, n_k)``; absent from SDPA's arguments) of an attention call,
    checked in that order; then the warning when the boolean masks leave a query row with no
    key (unless ``warn_empty_rows=False``)."""
    code = V.causal_code(args["causal"])
    window = window_sides(args["window"])
    cap = softcap_value(args["softcap"])
    s = V.check_scale(args["scale"], default_scale)
    m4 = V.mask4(args["mask"], batch, h, n_q, n_k, dtype)
    kp = V.key_padding2(args.get("key_padding_mask"), batch, n_k)
    alibi = per_head(args["alibi_slopes"], "alibi_slopes", batch, h, dtype)
    sinks = per_head(args["sinks"], "sinks", batch, h, dtype)
    given = {}  # the caller's shapes of the arrays with a gradient: a float mask, the sinks
    if m4 is not None and m4.dtype != np.bool_:
        given["mask"] = np.shape(args["mask"])
    if sinks is not None:
        given["sinks"] = np.shape(args["sinks"])
    m = Masks(code, s, m4, kp, window, cap, alibi, sinks, given)
    # only a mask array can leave a row empty that the scalar options do not
    if V.check_flag(args["warn_empty_rows"], "warn_empty_rows") and (
        m4 is not None or kp is not None
    ):
        keys = m.key_intervals(n_q, n_k)
        V.warn_empty(*V.empty_rows(m4, kp, keys, V.count(batch), h, n_q, n_k), V.ATTENTION_ROWS)
    return m


def pooled_tokens(x: Any, keep: np.dtype | None = None) -> np.ndarray:
    """The input ``x`` of a pooled family (additive, separable) as an array ``(..., n, d)``;
    ``keep``: a half dtype ``x`` stays in when it is an ndarray of it (the forward reads its
    bits), else it is widened as :func:`V.as_array` does."""
    a = V.as_array(x, "x", keep)
    V.check_ndim(a, "x", 2, "(..., n, d)")
    return a


def pooled_rows(xa: np.ndarray, batch: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, int]:
    """The rows ``(B*n, d)`` a pooled forward reads, and the ``half`` field of its arguments:
    a half-precision ``x`` (kept by :func:`pooled_tokens`) as its bits and the code of its dtype
    (1 float16, 2 bfloat16), else in ``dtype`` and 0."""
    if _half.is_half(xa.dtype):
        return V.rows(xa, batch, xa.dtype).view(np.uint16), _half.code(xa.dtype)
    return V.rows(xa, batch, dtype), 0


def pooled_weight(
    w: np.ndarray, name: str, dtype: np.dtype, rows: int | None, cols: int | None, layout: str
) -> np.ndarray:
    """A pooled family's weight matrix as its kernels read it: checked as ``V.matrix`` does, a
    half-precision one kept by ``V.as_array`` as its (contiguous) bits, else in ``dtype``."""
    if _half.is_half(w.dtype):
        return V.matrix(w, name, w.dtype, rows, cols, layout).view(np.uint16)
    return V.matrix(w, name, dtype, rows, cols, layout)


def pooled_padding(args: Mapping[str, Any], batch: tuple[int, ...], n: int) -> np.ndarray | None:
    """``key_padding_mask`` of a pooled family (additive, separable) as ``(B, n)``, with the
    warning when it leaves a sequence with no real token (unless ``warn_empty_rows=False``)."""
    kp = V.key_padding2(args["key_padding_mask"], batch, n)
    if V.check_flag(args["warn_empty_rows"], "warn_empty_rows"):
        V.warn_empty(*V.empty_rows(None, kp, None, V.count(batch), 1, 1, n), V.POOLED_ROWS)
    return kp


def pooled_bf16_operands(
    arrays: dict[str, np.ndarray], names: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """The arrays a pooled family's kernels read, those ``names`` rounded to bfloat16 (float32
    copies): where its float32 backward runs for ``precision="bf16"``."""
    given = [n for n in names if arrays[n] is not None]  # no rows of x without features
    return {
        **arrays,
        **dict(zip(given, _half.rounded_bf16(*(arrays[n] for n in given)), strict=True)),
    }


def with_weights(
    out: np.ndarray,
    weights: np.ndarray | None,
    mode: str | None,
    batch: tuple[int, ...],
    out_shape: tuple[int, ...],
    lse: np.ndarray | None = None,
    half: np.dtype | None = None,
) -> Any:
    """The result of a forward from the kernel's buffers: ``out`` as ``batch + out_shape``, or
    ``(out, weights)`` with the weights ``(B, h, n_q, n_k)`` as ``batch + (h, n_q, n_k)``
    (averaged over the heads for ``return_weights="mean"``), then the log-sum-exp
    ``(B, h, n_q)`` as ``batch + (h, n_q)`` when ``return_lse`` asked for it. ``half``: the
    storage dtype of the output and weights (the log-sum-exp stays float32, as a softmax
    statistic)."""
    result = [_half.store(out.reshape(batch + out_shape), half)]
    if mode is not None:
        assert weights is not None
        weights = weights.reshape(batch + weights.shape[1:])
        result.append(_half.store(weights.mean(axis=-3) if mode == "mean" else weights, half))
    if lse is not None:
        result.append(lse.reshape(batch + lse.shape[1:]).copy())
    return result[0] if len(result) == 1 else tuple(result)


def projected_args(
    kind: Callable[..., T], a: Any, layers: Mapping[str, np.ndarray | None], **own: Any
) -> T:
    """The kernels' argument object ``kind`` (``core.MhaArgs`` or ``core.BilinearArgs``) of a
    prepared call ``a`` (its ``B``, ``n_q``, ``n_k``, ``h``, ``h_kv`` and masks ``m``): the
    family's ``own`` fields, then those the two share, the value and output ``layers``
    (``w_v``, ``b_v``, ``w_o``, ``b_o``), the sizes, the mask and the scale."""
    return kind(
        **own,
        w_v=layers["w_v"],
        b_v=layers["b_v"],
        w_o=layers["w_o"],
        b_o=layers["b_o"],
        batch=a.B,
        n_q=a.n_q,
        n_k=a.n_k,
        heads=a.h,
        kv_heads=a.h_kv,
        mask=a.m.core_mask(),
        scale=a.m.scale,
    )
