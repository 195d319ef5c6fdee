"""Scaled dot-product and multi-head attention (forward) on NumPy arrays."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import _args, _docs, _grad, _half, _memory, _rope
from . import _signature as _sig
from . import _validate as V
from ._loader import core
from ._packed import PackedWeight

__all__ = [
    "multi_head_attention",
    "multi_head_attention_backward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
]

Weights = bool | str


class _Sdpa(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    q4: np.ndarray
    k4: np.ndarray
    v4: np.ndarray
    batch: tuple[int, ...]
    dtype: np.dtype
    h: int
    h_kv: int
    n_q: int
    n_k: int
    d: int
    d_v: int
    m: _args.Masks
    bf16: bool  # precision="bf16"


def _half_cache(args: dict[str, Any]) -> bool:
    """Whether ``q`` is float32 and ``k``, ``v`` are ndarrays of one half dtype: a cache the
    forward reads as stored (``sdpa_forward_half`` with float32 queries and output)."""
    q, k, v = args["q"], args["k"], args["v"]
    return (
        type(q) is np.ndarray
        and q.dtype == np.float32
        and type(k) is np.ndarray
        and type(v) is np.ndarray
        and k.dtype == v.dtype
        and _half.is_half(k.dtype)
    )


def _prepare_sdpa(args: dict[str, Any], half_qkv: bool = False, half_kv: bool = False) -> _Sdpa:
    """The validated arguments of an SDPA call (forward and backward). ``half_qkv``: ``q``,
    ``k`` and ``v`` (float16 or bfloat16, as :func:`_half.storage` found) stay in their dtype,
    for the kernel that reads them so (``sdpa_forward_half``); ``half_kv``: ``k`` and ``v``
    do, beside float32 ``q`` (:func:`_half_cache`)."""
    if half_qkv:
        q, k, v = np.asarray(args["q"]), np.asarray(args["k"]), np.asarray(args["v"])
    elif half_kv:
        q, k, v = args["q"], args["k"], args["v"]
    else:
        q = V.as_array(args["q"], "q")
        k = V.as_array(args["k"], "k")
        v = V.as_array(args["v"], "v")
    V.check_ndim(q, "q", 3, "(..., h, n_q, d)")
    V.check_ndim(k, "k", 3, "(..., h_kv, n_k, d)")
    V.check_ndim(v, "v", 3, "(..., h_kv, n_k, d_v)")
    h, n_q, d = q.shape[-3:]
    h_kv, n_k, d_k = k.shape[-3:]
    h_v, n_v, d_v = v.shape[-3:]
    if h < 1 or h_kv < 1:
        raise ValueError(
            f"q, k: the head axis must be >= 1, got q {V.shape_str(q.shape)}, "
            f"k {V.shape_str(k.shape)}"
        )
    if d < 1:
        raise ValueError(f"q: the feature axis must be >= 1, got shape {V.shape_str(q.shape)}")
    if d_k != d:
        raise ValueError(
            f"k: expected last dimension d = {d} (from q), got shape {V.shape_str(k.shape)}"
        )
    if (h_v, n_v) != (h_kv, n_k):
        raise ValueError(
            f"v: expected shape (..., {h_kv}, {n_k}, d_v) to match k, got {V.shape_str(v.shape)}"
        )
    if h % h_kv:
        raise ValueError(
            f"k: the number of kv heads ({h_kv}) must divide the number of query heads ({h})"
        )
    batch = V.batch_shape([("q", q.shape[:-3]), ("k", k.shape[:-3]), ("v", v.shape[:-3])])
    # computed in float32
    dtype = np.dtype(np.float32) if half_qkv or half_kv else V.result_dtype(q, k, v)
    m = _args.masks(args, batch, h, n_q, n_k, dtype, 1.0 / math.sqrt(d))
    return _Sdpa(
        q,
        k,
        v,
        V.stack(q, batch, q.dtype if half_qkv else dtype, 3),
        V.stack(k, batch, k.dtype if half_qkv or half_kv else dtype, 3),
        V.stack(v, batch, v.dtype if half_qkv or half_kv else dtype, 3),
        batch,
        dtype,
        h,
        h_kv,
        n_q,
        n_k,
        d,
        d_v,
        m,
        V.precision_bf16(args["precision"], dtype),
    )


# dtypes of the plain call, by identity: the native descriptors NumPy shares between arrays
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_NO_MASK = _args.CoreMask(None, None, 0)


def _sdpa_plain(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: Any) -> np.ndarray | None:
    """The output of the commonest SDPA call computed with only the checks that call needs:
    C-contiguous ndarrays of one batch shape, no option but ``scale``, and of one native
    float32 or float64 dtype, or one half dtype, or float32 ``q`` against a half-precision
    cache. The full path's argument handling outweighs the kernel in a small call (a decode step
    against a short cache; docs/performance.md, "Small calls on the AVX2 EPYC").
    None when the call is anything else: the full path then checks it and says what is wrong.
    The same kernel call with the same arguments: bitwise the full path's result."""
    dt, kt = q.dtype, k.dtype
    if v.dtype is not kt:
        return None
    if kt is dt and (dt is _F32 or dt is _F64):
        half = None
    elif (dt is _F32 or dt is kt) and _half.is_half(kt):
        half = kt
    else:
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    nd = len(qs)
    if nd < 3 or len(ks) != nd or len(vs) != nd:
        return None
    batch = qs[:-3]
    if ks[:-3] != batch or vs[:-3] != batch:
        return None
    h, n_q, d = qs[-3:]
    h_kv, n_k, d_k = ks[-3:]
    h_v, n_v, d_v = vs[-3:]
    if d_k != d or h_v != h_kv or n_v != n_k or min(h, n_q, d, h_kv, n_k, d_v) < 1 or h % h_kv:
        return None
    B = math.prod(batch)
    qf, kf, vf = q.flags, k.flags, v.flags
    if B < 1 or not (
        qf.c_contiguous and kf.c_contiguous and vf.c_contiguous
        and qf.aligned and kf.aligned and vf.aligned
    ):  # fmt: skip
        return None
    s = 1.0 / math.sqrt(d) if scale is None else V.check_scale(scale, 0.0)
    out = _memory.empty((B, h, n_q, d_v), dt)  # q's dtype: a half result of half arrays
    q4, k4, v4 = q.reshape(B, h, n_q, d), k.reshape(B, h_kv, n_k, d), v.reshape(B, h_kv, n_k, d_v)
    if half is None:
        core.sdpa_forward(q4, k4, v4, out, _NO_MASK, s, None, None, False)
    else:  # the halves' bits; float32 q and output as they are
        qh, oh = (q4, out) if dt is _F32 else (q4.view(np.uint16), out.view(np.uint16))
        core.sdpa_forward_half(
            qh, k4.view(np.uint16), v4.view(np.uint16), _half.code(kt), oh, _NO_MASK, s, None,
            None, False,
        )  # fmt: skip
    return out.reshape(batch + (h, n_q, d_v))


@_docs.filled
def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: bool | str = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    scale: float | None = None,
    return_weights: Weights = False,
    return_lse: bool = False,
    precision: str | None = None,
    warn_empty_rows: bool = True,
    _keep: dict[str, Any] | None = None,
) -> Any:
    """Attention of queries ``q`` over keys ``k`` and values ``v``, per head.

    ``softmax(scale * q k^T + mask) v`` with a flash-style kernel (O(n*d) memory unless the
    weights are requested).

    Parameters
    ----------
    q : array_like, shape (..., h, n_q, d)
    k : array_like, shape (..., h_kv, n_k, d)
    v : array_like, shape (..., h_kv, n_k, d_v)
        ``h % h_kv == 0``: grouped-query heads, query head ``j`` uses kv head
        ``j // (h // h_kv)``. Leading batch dimensions broadcast.
    mask : array_like of bool or float, optional
        Broadcasts to ``(..., h, n_q, n_k)``. Boolean ``True`` means *may attend*; a float
        mask is added to the scaled scores. ``nn.MultiheadAttention``'s boolean masks mean the
        opposite (``True`` = masked out): convert them with
        :func:`attnlab.interop.torch_masks`.
    causal : bool or {"top_left", "bottom_right"}
        ``False``: no causal mask. ``True`` or ``"top_left"``: query ``i`` sees keys
        ``j <= i`` (as SDPA's ``is_causal``). ``"bottom_right"``: the last query is aligned with
        the last key, query ``i`` sees keys ``j <= i + n_k - n_q`` (decoding with a cache).
        Combined with ``mask`` (both must allow a pair).
    {window}
    {logit_options}
    scale : float, optional
        Defaults to ``1 / sqrt(d)``.
    return_weights : bool or {"heads", "mean"}
        Also return the attention weights, per head ``(..., h, n_q, n_k)`` or their mean over
        heads ``(..., n_q, n_k)``.
    {precision_core}
    warn_empty_rows : bool
        Warn (a ``UserWarning``, once per call, with the count) when the boolean masks leave a
        query row with no key at all: the usual sign of a mask in PyTorch's polarity. Pass
        ``False`` when such rows are intended.

    Returns
    -------
    out : ndarray, shape (..., h, n_q, d_v)
    weights : ndarray, optional

    Notes
    -----
    A query row whose keys are all masked gets weights 0 and an output row of 0, never NaN.
    {dtypes_mixed}
    float32 ``q`` against ``k``, ``v`` of one half dtype (a half-precision cache) reads them as
    stored: the result is float32, the same as on the widened cache.

    Examples
    --------
    >>> import numpy as np, attnlab
    >>> q = k = v = np.ones((2, 4, 8))
    >>> attnlab.scaled_dot_product_attention(q, k, v, causal=True).shape
    (2, 4, 8)
    """
    args = _sig.arguments(locals())
    if (
        type(q) is np.ndarray
        and type(k) is np.ndarray
        and type(v) is np.ndarray
        and mask is None
        and causal is False
        and window is None
        and softcap is None
        and alibi_slopes is None
        and sinks is None
        and return_weights is False
        and return_lse is False
        and precision is None
        and (warn_empty_rows is True or warn_empty_rows is False)
        and _keep is None
    ):
        plain = _sdpa_plain(q, k, v, scale)
        if plain is not None:
            return plain
    half = _half.storage(args)
    mode = V.weights_mode(return_weights)
    # half-precision q, k, v are read and the output (and each head's weights) written as
    # stored (no float32 copies); for their mean over the heads the weights are kept in float32;
    # attnlab.vjp keeps the output in float32, then rounds it, for a pullback that reads q, k, v
    # as stored too (without weights, and when no gradient is summed over broadcast batch axes).
    # precision="bf16" too (the kernel reads a bfloat16 cache as stored when decoding, and
    # widens the arrays itself elsewhere)
    half_qkv = half is not None and (
        _keep is None or (not mode and _stacked(args["q"], args["k"], args["v"]))
    )
    # float32 queries against a half-precision cache: k and v read as stored, float32 result
    half_kv = half is None and _keep is None and _half_cache(args)
    a = _prepare_sdpa(args, half_qkv, half_kv)
    lse_wanted = V.check_flag(return_lse, "return_lse")
    batch, dtype, h, n_q, n_k, d_v = a.batch, a.dtype, a.h, a.n_q, a.n_k, a.d_v
    B = V.count(batch)
    stored = a.q4.dtype if half_qkv and _keep is None else dtype  # rounded in C++
    out = _memory.empty((B, h, n_q, d_v), stored)
    weights = _memory.empty((B, h, n_q, n_k), dtype if mode == "mean" else stored) if mode else None
    lse = None
    if _keep is not None:  # attnlab.vjp: the pullback reuses the output and log-sum-exp
        a = _memory.owned(a)
    if _keep is not None or lse_wanted:
        lse = a.m.empty_lse(B, h, n_q, dtype)  # what a call with no key leaves
    if (half_qkv or half_kv) and (
        out.size or (weights is not None and weights.size) or (lse is not None and lse.size)
    ):
        k16, v16 = a.k4.view(np.uint16), a.v4.view(np.uint16)  # the bits
        q16 = a.q4 if half_kv else a.q4.view(np.uint16)
        out16 = out if out.dtype == dtype else out.view(np.uint16)
        # the weights as bits, or in float32 (for their mean over the heads, or with float q)
        w16 = weights if weights is None or weights.dtype == dtype else weights.view(np.uint16)
        core.sdpa_forward_half(
            q16, k16, v16, _half.code(a.k4.dtype), out16, a.m.core_mask(), a.m.scale, lse, w16,
            a.bf16,
        )  # fmt: skip
    elif out.size or (weights is not None and weights.size) or (lse is not None and lse.size):
        core.sdpa_forward(a.q4, a.k4, a.v4, out, a.m.core_mask(), a.m.scale, weights, lse, a.bf16)
    if _keep is not None:  # (with half_qkv the caller gets a rounded copy of out: kept as is)
        kept_out = None if a.bf16 else out if half_qkv else out.copy()  # bf16: recomputes
        _keep.update(prepared=a, out=kept_out, lse=lse, halves=_half.halves(args))
    lse_out = lse if lse_wanted else None
    return _args.with_weights(out, weights, mode, batch, (h, n_q, d_v), lse_out, half)


class _Mha(NamedTuple):
    rq: np.ndarray  # (B*n_q, d_q) rows, C-contiguous
    rk: np.ndarray
    rv: np.ndarray
    key_omitted: bool  # key not given: it defaults to query
    value_omitted: bool  # value not given: it defaults to key
    shapes: dict[str, tuple[int, ...]]  # the user's input shapes, for gradient reduction
    w: dict[str, np.ndarray | None]  # w_q, b_q, ... prepared for the kernel
    batch: tuple[int, ...]
    dtype: np.dtype
    h: int
    h_kv: int
    n_q: int
    n_k: int
    d_out: int
    m: _args.Masks
    weights_half: int = 0  # w_q, w_k, w_v, w_o as float16 (1) / bfloat16 (2) bits, or 0
    inputs_half: bool = False  # rq, rk, rv (and the forward's out) as bits of that half too
    half: np.dtype | None = None  # the half dtype of weights_half
    # w_q, w_k, w_v, w_o's panels when given as PackedWeight (core.MhaArgs.packed), or None
    packed: tuple[np.ndarray | None, ...] | None = None

    @property
    def B(self) -> int:
        return V.count(self.batch)

    def core_args(self) -> core.MhaArgs:
        """The arguments core.mha_forward / mha_backward share."""
        w = self.w
        return _args.projected_args(
            core.MhaArgs, self, w, query=self.rq, key=self.rk, value=self.rv,
            w_q=w["w_q"], b_q=w["b_q"], w_k=w["w_k"], b_k=w["b_k"],
            weights_half=self.weights_half, inputs_half=int(self.inputs_half),
            packed=self.packed,
        )  # fmt: skip


# The weight layouts _check_weights accepted: its verdict depends on the head counts and the
# shapes alone, so a loop of calls of one shape checks them once. Bounded; cleared when full.
_LAYOUTS_OK: dict[tuple[Any, ...], None] = {}


def _check_weights(h: int, h_kv: int, kv_arg: str, x: _args.Qkv, ws: dict[str, np.ndarray]) -> None:
    """Each weight's rank, the head counts against the widths, each weight against the input
    it reads, then the weights against each other (``ValueError`` naming the first cause)."""
    key = (h, h_kv, *x.widths, *(w.shape for w in ws.values()))
    if key in _LAYOUTS_OK:
        return
    d_q, d_k, d_v = x.widths
    wq_, wk_, wv_, wo_ = ws["w_q"], ws["w_k"], ws["w_v"], ws["w_o"]
    lay = {
        "w_q": "(d_q, num_heads * d_head)",
        "w_k": f"(d_k, {kv_arg} * d_head)",
        "w_v": f"(d_v, {kv_arg} * d_vhead)",
        "w_o": "(num_heads * d_vhead, d_out)",
    }
    for name, w_ in ws.items():
        V.check_matrix(w_, name, lay[name], 0 if name == "w_o" else 1)
    by_h = lambda n: n % h == 0  # noqa: E731  (a valid column count for the query heads)
    by_kv = lambda n: n % h_kv == 0  # noqa: E731
    readers = {
        "w_q": V.reader(wq_, "w_q", lay["w_q"], by_h, d_q),
        "w_k": V.reader(wk_, "w_k", lay["w_k"], by_kv, d_k),
        "w_v": V.reader(wv_, "w_v", lay["w_v"], by_kv, d_v),
    }
    for name, heads, arg in (("w_q", h, "num_heads"), ("w_k", h_kv, kv_arg), ("w_v", h_kv, kv_arg)):
        V.check_heads(ws[name], heads, arg, readers[name], "from_torch_mha")
    V.check_readers(x.groups((readers["w_q"], readers["w_k"], readers["w_v"])), "from_torch_mha")
    d_head, d_khead, d_vhead = wq_.shape[1] // h, wk_.shape[1] // h_kv, wv_.shape[1] // h_kv
    o_head = wo_.shape[0] / h
    if d_head != d_khead:  # the odd one out: the value side usually has the same head width
        if d_khead == d_vhead == o_head:
            raise ValueError(
                f"w_q: expected shape {lay['w_q']} = ({d_q}, {h * d_khead}) with "
                f"d_head = {d_khead} as in w_k {V.shape_str(wk_.shape)}, got "
                f"{V.shape_str(wq_.shape)} (d_head = {d_head})"
            )
        raise ValueError(
            f"w_k: expected shape {lay['w_k']} = ({d_k}, {h_kv * d_head}) with "
            f"d_head = {d_head} from w_q {V.shape_str(wq_.shape)}, got "
            f"{V.shape_str(wk_.shape)}"
        )
    if wo_.shape[0] != h * d_vhead:
        if o_head == d_head != d_vhead:
            raise ValueError(
                f"w_v: expected shape {lay['w_v']} = ({d_v}, {h_kv * d_head}) with "
                f"d_vhead = {d_head} as in w_o {V.shape_str(wo_.shape)}, got "
                f"{V.shape_str(wv_.shape)}"
            )
        raise ValueError(
            f"w_o: expected shape {lay['w_o']} = ({h * d_vhead}, d_out) with "
            f"d_vhead = {d_vhead} from w_v {V.shape_str(wv_.shape)}, got "
            f"{V.shape_str(wo_.shape)}"
        )
    if len(_LAYOUTS_OK) >= 256:
        _LAYOUTS_OK.clear()
    _LAYOUTS_OK[key] = None


_WEIGHTS = ("w_q", "w_k", "w_v", "w_o")


def _half_weights(args: dict[str, Any]) -> np.dtype | None:
    """The half dtype all four weights are stored in (the C++ call's projections read them as
    stored, with float32 or bf16 products), or None."""
    dt = getattr(args["w_q"], "dtype", None)
    if not isinstance(dt, np.dtype) or not _half.is_half(dt):  # the common call stops here
        return None
    if any(not isinstance(args[n], np.ndarray) or args[n].dtype != dt for n in _WEIGHTS):
        return None
    return dt


def _prepare_mha(args: dict[str, Any], keep_half: bool = False) -> _Mha:
    """The validated arguments of an MHA call (forward and backward), checked in an order that
    finds the root cause: head counts, the inputs' own shapes, each weight's rank, head counts
    against widths, each weight against the input it reads, then biases and masks.
    ``keep_half``: weights stored in one half dtype stay so when the call computes in float32
    and runs the one C++ forward, with float32 or bf16 products (its GEMMs widen them, or round
    them to bf16, as they pack them: half the bytes read, no float32 copies)."""
    h, h_kv, kv_arg = _args.heads(args["num_heads"], args["num_kv_heads"])
    half = _half_weights(args) if keep_half else None
    # inputs stored as the weights are stay so (float32 or bf16 products): the projections read
    # their bits and the output projection writes them (no float32 copies of either)
    x = _args.qkv(args, min_features=True, keep=half)
    n_q, n_k = x.n_q, x.n_k
    # (and only when the output is stored so too: a float32 bias or mask makes it float32)
    inputs_half = half is not None and x.xq.dtype == half and _half.storage(args) == half
    if half is None:
        ws = {n: V.as_array(args[n], n) for n in _WEIGHTS}
    else:
        ws = {n: args[n] for n in _WEIGHTS}
    bs = {n: V.optional_array(args[n], n) for n in ("b_q", "b_k", "b_v", "b_o")}
    as_float = (_half.COMPUTED,) if half is not None else ws.values()
    xs = (_half.COMPUTED,) if inputs_half else (x.xq, x.xk, x.xv)
    dtype = V.result_dtype(*xs, *as_float, *bs.values())
    if half is not None and dtype != np.float32:  # float64 inputs: the weights widen with them
        half, ws = None, {n: V.as_array(args[n], n) for n in _WEIGHTS}
        inputs_half = False  # (and the inputs: x.rows below)
    _check_weights(h, h_kv, kv_arg, x, ws)
    wq_, wk_, wv_, wo_ = ws["w_q"], ws["w_k"], ws["w_v"], ws["w_o"]
    d_head, d_vhead = wq_.shape[1] // h, wv_.shape[1] // h_kv
    if half is None:
        wq = _memory.contiguous(wq_, dtype)
        wk = _memory.contiguous(wk_, dtype)
        wv = _memory.contiguous(wv_, dtype)
        wo = _memory.contiguous(wo_, dtype)
    else:  # their bits, as the kernels take them
        wq, wk, wv, wo = (_memory.contiguous(w_).view(np.uint16) for w_ in (wq_, wk_, wv_, wo_))
    d_out = wo.shape[1]
    # (precision="bf16" on float32: the bf16 tiles; a wrong precision is refused with the options)
    bf16 = dtype == np.float32 and args.get("precision") == "bf16"
    packed = _packed_panels(args, (wq, wk, wv, wo), dtype, bf16) if half is None else None
    bq = V.vector(bs["b_q"], "b_q", dtype, h * d_head)
    bk = V.vector(bs["b_k"], "b_k", dtype, h_kv * d_head)
    bv = V.vector(bs["b_v"], "b_v", dtype, h_kv * d_vhead)
    bo = V.vector(bs["b_o"], "b_o", dtype, d_out)

    batch = x.batch()
    m = _args.masks(args, batch, h, n_q, n_k, dtype, 1.0 / math.sqrt(d_head))
    w = {"w_q": wq, "b_q": bq, "w_k": wk, "b_k": bk, "w_v": wv, "b_v": bv, "w_o": wo, "b_o": bo}
    if inputs_half and half is not None:  # their bits, as the kernels take them
        rq, rk, rv = x.rows(batch, half, bits=True)
    else:
        rq, rk, rv = x.rows(batch, dtype)
    # Gradient keys follow the arguments given, not object identity (the rows may be shared
    # either way: same data, one copy).
    return _Mha(
        rq,
        rk,
        rv,
        x.key_omitted,
        x.value_omitted,
        x.shapes,
        w,
        batch,
        dtype,
        h,
        h_kv,
        n_q,
        n_k,
        d_out,
        m,
        0 if half is None else _half.code(half),
        inputs_half,
        half,
        packed,
    )


def _packed_panels(
    args: dict[str, Any], ws: tuple[np.ndarray, ...], dtype: np.dtype, bf16: bool
) -> tuple[np.ndarray | None, ...] | None:
    """The panels (``bf16``: the bf16 tiles) of the weights given as :class:`PackedWeight` that
    the call reads as they are (its dtype), for core.MhaArgs.packed; None when there are none."""
    found = [
        p._panels_for(dtype, bf16) if isinstance(p, PackedWeight) and w is p.array else None
        for p, w in zip((args[n] for n in _WEIGHTS), ws, strict=True)
    ]
    return tuple(found) if any(f is not None for f in found) else None


@_docs.filled
def multi_head_attention(
    query: Any,
    key: Any = None,
    value: Any = None,
    *,
    w_q: Any,
    w_k: Any,
    w_v: Any,
    w_o: Any,
    b_q: Any = None,
    b_k: Any = None,
    b_v: Any = None,
    b_o: Any = None,
    num_heads: int,
    num_kv_heads: int | None = None,
    mask: Any = None,
    key_padding_mask: Any = None,
    causal: bool | str = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    scale: float | None = None,
    return_weights: Weights = False,
    return_lse: bool = False,
    rope_theta: float | None = None,
    rope_dim: int | None = None,
    positions: Any = None,
    rope_inv_freq: Any = None,
    rope_scale: float | None = None,
    q_norm: Any = None,
    k_norm: Any = None,
    norm_eps: float | None = None,
    precision: str | None = None,
    warn_empty_rows: bool = True,
    _keep: dict[str, Any] | None = None,
) -> Any:
    """Multi-head attention with per-head projections (heads never share weights).

    ``out = concat_i(softmax(scale * Q_i K_i^T + mask) V_i) w_o + b_o`` with
    ``Q = query w_q + b_q`` and head ``i`` the column block ``i*d_head:(i+1)*d_head``.

    Parameters
    ----------
    query : array_like, shape (..., n_q, d_q)
    key : array_like, shape (..., n_k, d_k), optional
        Defaults to ``query`` (self-attention).
    value : array_like, shape (..., n_k, d_v), optional
        Defaults to ``key``.
    w_q : array_like, shape (d_q, h * d_head)
        Weights are ``(in_features, out_features)``: ``y = x @ w + b``.
    w_k : array_like, shape (d_k, h_kv * d_head)
    w_v : array_like, shape (d_v, h_kv * d_vhead)
    w_o : array_like, shape (h * d_vhead, d_out)
    b_q, b_k, b_v, b_o : array_like, optional
        Biases of matching widths.
    num_heads : int
        ``h``.
    num_kv_heads : int, optional
        ``h_kv`` for grouped-query (``1 < h_kv < h``) or multi-query (``h_kv = 1``) attention;
        defaults to ``num_heads``.
    mask : array_like of bool or float, optional
        Broadcasts to ``(..., h, n_q, n_k)``; ``True`` means *may attend*, floats are added to
        the scaled scores. ``nn.MultiheadAttention``'s boolean masks mean the opposite
        (``True`` = masked out): convert them with :func:`attnlab.interop.torch_masks`.
    key_padding_mask : array_like of bool, optional
        ``(..., n_k)``, ``True`` for real tokens (``nn.MultiheadAttention``'s ``True`` marks
        padding; :func:`attnlab.interop.torch_masks` converts it).
    causal : bool or {"top_left", "bottom_right"}
        ``False``: no causal mask. ``True`` or ``"top_left"``: query ``i`` sees keys
        ``j <= i`` (as SDPA's ``is_causal``). ``"bottom_right"``: the last query is aligned with
        the last key, query ``i`` sees keys ``j <= i + n_k - n_q`` (decoding with a cache).
        Combined with the masks (all must allow a pair).
    {window}
    {logit_options}
    scale : float, optional
        Defaults to ``1 / sqrt(d_head)``.
    return_weights : bool or {"heads", "mean"}
        ``True``/``"heads"``: also return ``(..., h, n_q, n_k)``; ``"mean"``: ``(..., n_q, n_k)``.
    rope_theta : float, optional
        Rotary position embeddings (RoPE) with this base (10000 in most models); ``None``: off.
        Applied to every query and key head after projection, in the half-split convention of
        Hugging Face ``transformers`` (``rotate_half``): within the first ``r`` features,
        feature ``j`` and ``j + r/2`` are rotated by ``p * rope_theta ** (-2j / r)`` for a
        token at position ``p``.
    rope_dim : int, optional
        ``r``, the (even) number of leading features of each head that rotate (partial
        rotary); defaults to ``d_head``.
    positions : array_like or (array_like, array_like), optional
        Token positions (integers or reals). Default: keys ``0..n_k-1`` and queries aligned as
        ``causal`` aligns them (``n_k - n_q + i`` for ``"bottom_right"``, else ``i``). One array
        ``(..., n_k)`` gives the positions of the key tokens, and query ``i`` takes that of the
        key it is aligned with by the same rule (self-attention: ``transformers``'
        ``position_ids``; decoding: the positions of the whole sequence). A pair
        ``(query_positions (..., n_q), key_positions (..., n_k))`` sets both.
    rope_inv_freq : array_like, shape (r/2,), optional
        Scaled rotary embeddings: the inverse frequencies, replacing
        ``rope_theta ** (-2j / r)`` (pass one of the two); feature ``j`` and ``j + r/2`` rotate
        by ``p * rope_inv_freq[j]``. Every static ``rope_type`` of ``transformers``
        (``linear``, ``llama3``, ``yarn``, ``longrope``, ``dynamic`` at a given length) is
        its ``inv_freq`` and ``attention_factor``: :func:`attnlab.interop.from_transformers`
        computes both.
    rope_scale : float, optional
        Multiplies cos and sin (``transformers``' ``attention_factor``: YaRN, LongRoPE);
        default 1.
    q_norm, k_norm : array_like, shape (d_head,), optional
        Per-head RMSNorm of the queries / keys after projection and before the rotary
        embeddings (Qwen3, Gemma 3): ``x * (mean(x**2) + norm_eps) ** -0.5 * q_norm`` over
        each head's features. Gemma 3 stores ``weight`` for ``1 + weight``: pass
        ``1 + weight``. Differentiated (gradients ``"q_norm"``, ``"k_norm"``).
    norm_eps : float, optional
        The norms' epsilon; default ``1e-6``.
    precision : {None, "bf16"}, optional
        ``None``: exact in the input dtype. ``"bf16"`` (float32 or half-precision inputs): the
        four projections round both operands to bfloat16 and sum the products in float32, on
        AMX tiles where the CPU has them, on ``VDPBF16PS`` on AMD CPUs with AVX512-BF16
        (``build_info()["bf16_kernel"]`` says which) and with the same rounding emulated
        elsewhere, so the answers agree across CPUs to the order of the
        float32 sums; the attention core as :func:`scaled_dot_product_attention`'s
        ``precision="bf16"``. :func:`attnlab.reference.multi_head_attention` computes the same
        rounding of the operands in float64. The error against the exact result grows to the
        order of bfloat16's unit roundoff, ``2**-8``, relative. Gradients (``*_backward``,
        ``vjp``) take float32 products over the bf16 forward's projections. Weights stored
        in float16 or bfloat16 are read as stored (no float32 copies).
    warn_empty_rows : bool
        Warn (a ``UserWarning``, once per call, with the count) when the boolean masks leave a
        query row with no key at all: the usual sign of a mask in PyTorch's polarity. Pass
        ``False`` when such rows are intended (their output is ``b_o``).

    {attention_returns}

    Notes
    -----
    Fully masked query rows give zero weights and a zero context, so their output is ``b_o``.
    {dtypes_mixed}

    Rotary embeddings and q/k norms are applied to each projected query and key head inside
    the one C++ call (O(n d), in its threads), forward and backward.

    {examples}
    >>> x = rng.standard_normal((2, 5, 16))
    >>> w = [rng.standard_normal((16, 16)) * 0.25 for _ in range(4)]
    >>> attnlab.multi_head_attention(x, w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3],
    ...                              num_heads=4).shape
    (2, 5, 16)
    """
    args = _sig.arguments(locals())
    a = _prepare_mha(args, keep_half=True)
    if _keep is not None and _summed_half(a):  # attnlab.vjp: gradients summed in float32
        a = _prepare_mha(args)
    options = _rope.prepare_for(a, args)
    mode = V.weights_mode(return_weights)
    batch, dtype, h, n_q, n_k, d_out = a.batch, a.dtype, a.h, a.n_q, a.n_k, a.d_out
    B = V.count(batch)
    half = _half.storage(args)
    if a.inputs_half:  # written by the kernel in that dtype (the weights too, but their mean)
        out = _memory.empty((B * n_q, d_out), half)
    else:
        out = _memory.empty((B * n_q, d_out), dtype)
    w_dtype = half if a.inputs_half and mode != "mean" else dtype
    weights = _memory.empty((B, h, n_q, n_k), w_dtype) if mode else None
    lse_wanted = V.check_flag(return_lse, "return_lse")
    state = None
    if _keep is not None:  # attnlab.vjp: keep projections, context and log-sum-exp
        a = _memory.owned(a)
        state = _mha_state(a)
        options = None if options is None else options.owned()
        _keep.update(prepared=a, state=state, halves=_half.halves(args), qk=options)
    lse = a.m.empty_lse(B, h, n_q, dtype) if lse_wanted else None
    if lse_wanted and state is None:
        state = _mha_state(a)
    if B * n_q > 0:
        out_arg = out.view(np.uint16) if a.inputs_half else out
        bf16 = options is not None and options.bf16
        qk = _rope.core_qk(options)
        core.mha_forward(a.core_args(), out_arg, _half.bits(weights), state, bf16, qk)
        if lse is not None and state is not None:
            lse = state["lse"]
    return _args.with_weights(out, weights, mode, batch, (n_q, d_out), lse, half)


_SDPA_BACKWARD_INTRO = """\
    Recomputes the forward (keeping only the log-sum-exp per query row), then back-propagates
    tile by tile: ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``. Memory O(n d).

"""
_SDPA_BACKWARD_DOC = """\
    {forward_parameters}
        As for :func:`scaled_dot_product_attention`
        {mask_polarity}
        ``return_weights`` is accepted for symmetry and ignored: gradients flow from the output
        only. Boolean masks, ``alibi_slopes`` and positions are not differentiated.

    Returns
    -------
    dict
        ``{"q": ..., "k": ..., "v": ...}`` shaped like the inputs (summed over broadcast batch
        axes), with ``"mask"`` for a float mask and ``"sinks"`` when given (each summed back to
        its shape). Fully masked query rows contribute zero gradient.

    Examples
    --------
    >>> import numpy as np, attnlab
    >>> q = k = v = np.ones((2, 4, 8))
    >>> g = attnlab.scaled_dot_product_attention_backward(np.ones((2, 4, 8)), q, k, v)
    >>> sorted(g)
    ['k', 'q', 'v']
    """


def _stacked(q: Any, k: Any, v: Any) -> bool:
    """Whether ``q``, ``k`` and ``v`` have the same batch axes (no gradient is then summed over
    broadcast ones)."""
    return np.shape(q)[:-3] == np.shape(k)[:-3] == np.shape(v)[:-3]


def _sdpa_grads(
    a: _Sdpa, grad_out: Any, kept: dict[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """The gradients of a prepared SDPA call; with ``kept`` (what the forward kept for
    attnlab.vjp) the forward is not recomputed. When ``q``, ``k`` and ``v`` were prepared as
    stored in one half dtype (not broadcast), the kernel reads them (and ``grad_out`` when it
    is stored so) and writes ``dq``, ``dk``, ``dv`` in that dtype, computed as the float32 call
    on the widened arrays would be; so too ``k`` and ``v`` (with ``dk``, ``dv``) prepared so
    beside float32 ``q`` (whose ``dq`` is float32)."""
    batch, dtype, h, h_kv, n_q, n_k, d, d_v = (
        a.batch,
        a.dtype,
        a.h,
        a.h_kv,
        a.n_q,
        a.n_k,
        a.d,
        a.d_v,
    )
    half = a.q4.dtype if _half.is_half(a.q4.dtype) else None
    kv_half = a.k4.dtype if _half.is_half(a.k4.dtype) else None  # (also beside float32 q)
    go = _grad.grad_out(grad_out, batch + (h, n_q, d_v), dtype, keep=half)
    B = V.count(batch)
    kernel = B * n_q * n_k > 0
    new = _memory.empty if kernel else _memory.zeros  # the kernel writes every element
    dq = new((B, h, n_q, d), dtype if half is None else half)
    dk = new((B, h_kv, n_k, d), dtype if kv_half is None else kv_half)
    dv = new((B, h_kv, n_k, d_v), dtype if kv_half is None else kv_half)
    logit = _grad.logit_buffers(a.m, B, h, n_q, n_k, dtype)
    if kernel:
        go4 = _memory.kernel_ready(go.reshape((B, h, n_q, d_v)))
        if a.bf16:  # the gradient at the rounded operands recomputes the unrounded softmax
            kept = None
        if kept is None:  # (in float32 for half-precision inputs: the backward reads it)
            out = _memory.empty((B, h, n_q, d_v), dtype)
            lse = _memory.empty((B, h, n_q), dtype)
        else:
            out, lse = kept["out"], kept["lse"]
        d_logit = (logit.get("mask"), logit.get("sinks"))
        if kv_half is None:
            core.sdpa_backward(
                go4, a.q4, a.k4, a.v4, a.m.core_mask(), a.m.scale, out, lse, dq, dk, dv,
                kept is None, *d_logit, a.bf16,
            )  # fmt: skip
        else:  # (q and dq float32 beside a half-precision k, v: as they are)
            q16, k16, v16, dq16, dk16, dv16 = (
                _half.bits(x) for x in (a.q4, a.k4, a.v4, dq, dk, dv)
            )
            go_half = go4.dtype == kv_half
            core.sdpa_backward_half(
                go4.view(np.uint16) if go_half else go4, q16, k16, v16, _half.code(kv_half),
                a.m.core_mask(), a.m.scale, out, lse, dq16, dk16, dv16, go_half, kept is None,
                *d_logit, a.bf16,
            )  # fmt: skip
    return {
        "q": _grad.unbroadcast(dq.reshape(batch + dq.shape[1:]), a.q.shape),
        "k": _grad.unbroadcast(dk.reshape(batch + dk.shape[1:]), a.k.shape),
        "v": _grad.unbroadcast(dv.reshape(batch + dv.shape[1:]), a.v.shape),
        **_grad.logit_grads(logit, a.m, batch),
    }


_MHA_BACKWARD_DOC = """\
    {forward_parameters}
        As for :func:`multi_head_attention`
        {mask_polarity}
        ``return_weights`` is accepted and ignored. Positions are not differentiated.

    Returns
    -------
    dict
        Keyed by argument name: ``"query"``, ``"key"`` and ``"value"`` when given (when
        ``key``/``value`` default to ``query`` their gradients are summed into ``"query"``),
        ``"w_q"``, ``"w_k"``, ``"w_v"``, ``"w_o"``, each bias and norm weight given,
        ``"mask"`` for a float mask and ``"sinks"`` when given. Boolean masks, key padding and
        ``alibi_slopes`` are not differentiated.

    {examples}
    >>> x = rng.standard_normal((5, 8))
    >>> w = {n: rng.standard_normal((8, 8)) / 3 for n in ("w_q", "w_k", "w_v", "w_o")}
    >>> g = attnlab.multi_head_attention_backward(np.ones((5, 8)), x, num_heads=2, **w)
    >>> sorted(g)
    ['query', 'w_k', 'w_o', 'w_q', 'w_v']
    """


def _mha_state(a: _Mha) -> dict[str, np.ndarray]:
    """Buffers for what the MHA forward keeps for attnlab.vjp's pullback (O(n d))."""
    wq = a.w["w_q"]
    wv = a.w["w_v"]
    wo = a.w["w_o"]
    assert wq is not None and wv is not None and wo is not None
    d_head, d_vhead, B = wq.shape[1] // a.h, wv.shape[1] // a.h_kv, a.B
    return _memory.empty_group(
        {
            "q": ((B * a.n_q, a.h * d_head), a.dtype),
            "k": ((B * a.n_k, a.h_kv * d_head), a.dtype),
            "v": ((B * a.n_k, a.h_kv * d_vhead), a.dtype),
            "ctx": ((B * a.n_q, wo.shape[0]), a.dtype),
            "lse": ((B, a.h, a.n_q), a.dtype),
        }
    )


def _summed_half(a: _Mha) -> bool:
    """Whether a call prepared with half-precision inputs has an input broadcast over the batch
    (its gradient is then summed over the batch, in float32: the call is prepared widened)."""
    return a.inputs_half and any(s[:-2] != a.batch for s in a.shapes.values())


def _mha_grads(
    a: _Mha,
    grad_out: Any,
    state: dict[str, np.ndarray] | None = None,
    qk: _rope.QkOptions | None = None,
) -> dict[str, np.ndarray]:
    """The gradients of a prepared MHA call; with ``state`` (what the forward kept for
    attnlab.vjp) the forward is not recomputed; ``qk``: its rotary embeddings, q/k norms and
    bf16 products (``_rope.QkOptions``)."""
    dtype, batch, B = a.dtype, a.batch, a.B
    # half-precision inputs: grad_out in their dtype read, and their gradients written, as
    # stored (the weights' gradients: below)
    half = a.half if a.inputs_half else None
    go2 = _grad.grad_out_rows(grad_out, batch + (a.n_q, a.d_out), dtype, keep=half)
    inputs = {"query": a.rq, "key": a.rk, "value": a.rv}
    kernel = B * a.n_q > 0
    # the kernel writes every element: buffers need no zeros when it runs
    # half-precision weights' gradients written in their dtype (rounded as the GEMM writes them)
    in_half = dict.fromkeys(_WEIGHTS, a.half) if a.half is not None else None
    grads = _grad.grad_buffers(a.w, dtype, zeroed=not kernel, stored=in_half)
    shapes = {n: r.shape for n, r in inputs.items()}
    in_dtype = dtype if half is None else half
    grads.update(_grad.input_buffers(shapes, a.key_omitted, a.value_omitted, in_dtype, not kernel))
    for name in ("q_norm", "k_norm"):
        w = None if qk is None else getattr(qk, name)
        if w is not None:
            grads[name] = (_memory.empty if kernel else _memory.zeros)(w.shape, dtype)
    logit = _grad.logit_buffers(a.m, B, a.h, a.n_q, a.n_k, dtype)
    grads.update(logit)
    if kernel:
        bits = {n: _half.bits(g) for n, g in grads.items()}  # shared buffers stay shared
        bf16 = qk is not None and qk.bf16
        core.mha_backward(go2, a.core_args(), bits, state, _rope.core_qk(qk), bf16)
    logit = {n: grads.pop(n) for n in logit}
    rows = {n: grads.pop(n) for n in ("query", "key", "value")}
    return {
        **_grad.input_grads(rows, batch, a.shapes, a.key_omitted, a.value_omitted),
        **grads,
        **_grad.logit_grads(logit, a.m, batch),
    }


def _sdpa_backward(grad_out: Any, args: dict[str, Any]) -> dict[str, np.ndarray]:
    V.weights_mode(args["return_weights"])
    # half-precision q, k, v read and dq, dk, dv written as stored, unless a gradient is summed
    # over broadcast batch axes (in float32, then rounded); precision="bf16" too (the kernel
    # reads bfloat16 arrays as their own rounding, and widens the others itself)
    qkv = (args["q"], args["k"], args["v"])
    half_qkv = _half.storage(args) is not None and _stacked(*qkv)
    # float32 q beside a half-precision k, v: those read, and dk, dv written, as stored
    half_kv = not half_qkv and _half_cache(args) and _stacked(*qkv)
    grads = _sdpa_grads(_prepare_sdpa(args, half_qkv, half_kv), grad_out)
    return _half.store_grads(grads, _half.halves(args))


def _mha_backward(grad_out: Any, args: dict[str, Any]) -> dict[str, np.ndarray]:
    V.weights_mode(args["return_weights"])
    # weights stored in one half dtype read as stored by the one C++ backward (and inputs stored
    # so too, with their gradients written so, unless summed over broadcast batch axes), with
    # float32 or bf16 products alike (the forward's bf16 products round what they read)
    a = _prepare_mha(args, keep_half=True)
    if _summed_half(a):
        a = _prepare_mha(args)
    grads = _mha_grads(a, grad_out, qk=_rope.prepare_for(a, args))
    return _half.store_grads(grads, _half.halves(args))


scaled_dot_product_attention_backward = _sig.backward_of(
    scaled_dot_product_attention,
    _sdpa_backward,
    "(..., h, n_q, d_v)",
    _SDPA_BACKWARD_DOC,
    wrt="``q``, ``k``, ``v``",
    intro=_SDPA_BACKWARD_INTRO,
)
multi_head_attention_backward = _sig.backward_of(
    multi_head_attention, _mha_backward, "(..., n_q, d_out)", _MHA_BACKWARD_DOC
)
