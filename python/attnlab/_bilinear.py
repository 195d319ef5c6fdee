"""Bilinear-collapsed attention: the query-key projections folded into one matrix per head.

Per head ``i`` the logits of multi-head attention are
``(X_q W_q,i + b_q,i)(X_k W_k,i + b_k,i)^T = X_q W_i X_k^T + X_q v_i + u_i X_k^T + c_i`` with
``W_i = W_q,i W_k,i^T``, ``v_i = W_q,i b_k,i``, ``u_i = W_k,i b_q,i`` and ``c_i = b_q,i . b_k,i``.
``v`` and ``c`` are constant along a query's row and cancel in the softmax; ``u`` does not.
None of this holds with rotary position embeddings (RoPE): the rotation depends on the positions
and sits between ``W_q,i`` and ``W_k,i``, so there is no single ``W_i`` to fold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _args, _docs, _grad, _half, _memory
from . import _signature as _sig
from . import _validate as V
from ._loader import core
from .cost import collapsed_order

__all__ = [
    "bilinear_attention",
    "bilinear_attention_backward",
    "collapse_qk",
    "factorize_qk",
    "BilinearQK",
]

_ORDERS = {"query": 0, "key": 1}


@dataclass(frozen=True, eq=False)
class BilinearQK:
    """Folded query-key weights of ``h`` heads: logits ``x_q W_i x_k^T + x_q v_i + u_i x_k^T +
    c_i``.

    Attributes
    ----------
    w : ndarray, shape (h, d_q, d_k)
        ``W_i = W_q,i @ W_k,i.T``, rank at most ``d_head``.
    u : ndarray, shape (h, d_k), or None
        Key-side term ``W_k,i @ b_q,i`` (from ``b_q``): it changes the attention.
    v : ndarray, shape (h, d_q), or None
        Query-side term ``W_q,i @ b_k,i`` (from ``b_k``): constant along a query's row, it
        cancels in the softmax.
    c : ndarray, shape (h,), or None
        ``b_q,i . b_k,i`` (both biases given): cancels in the softmax.
    d_head : int
        The head width the weights were folded from; the default scale is ``1/sqrt(d_head)``.

    Notes
    -----
    Not valid with rotary position embeddings (see the module notes).
    """

    w: np.ndarray
    u: np.ndarray | None
    v: np.ndarray | None
    c: np.ndarray | None
    d_head: int

    @property
    def num_heads(self) -> int:
        return int(self.w.shape[0])

    @_docs.filled
    def homogeneous(self) -> np.ndarray:
        """The ``(h, d_q + 1, d_k + 1)`` matrices ``[[W_i, v_i], [u_i, c_i]]``.

        Acting on homogeneous coordinates, ``[x_q, 1] M_i [x_k, 1]^T`` is the exact logit
        ``(x_q W_q,i + b_q,i) . (x_k W_k,i + b_k,i)`` (before scaling); absent terms are 0.

        Returns
        -------
        ndarray, shape (h, d_q + 1, d_k + 1)
            A new array, dtype of ``w``.

        {examples}
        >>> w_q, w_k = rng.standard_normal((6, 4)), rng.standard_normal((5, 4))
        >>> b_q, b_k = rng.standard_normal(4), rng.standard_normal(4)
        >>> qk = attnlab.collapse_qk(w_q, w_k, b_q, b_k, num_heads=2)
        >>> m = qk.homogeneous()
        >>> xq, xk = rng.standard_normal(6), rng.standard_normal(5)
        >>> exact = (xq @ w_q[:, :2] + b_q[:2]) @ (xk @ w_k[:, :2] + b_k[:2])
        >>> m.shape, bool(np.isclose(np.r_[xq, 1] @ m[0] @ np.r_[xk, 1], exact))
        ((2, 7, 6), True)
        """
        h, dq, dk = self.w.shape
        m = np.zeros((h, dq + 1, dk + 1), dtype=self.w.dtype)
        m[:, :dq, :dk] = self.w
        if self.v is not None:
            m[:, :dq, dk] = self.v
        if self.u is not None:
            m[:, dq, :dk] = self.u
        if self.c is not None:
            m[:, dq, dk] = self.c
        return m

    @_docs.filled
    def rank(self, tol: float | None = None) -> np.ndarray:
        """Numerical rank of each ``W_i`` (``np.linalg.matrix_rank``): at most ``d_head``.

        Parameters
        ----------
        tol : float, optional
            Singular values at or below it count as zero; by default NumPy's
            ``S.max() * max(d_q, d_k) * eps``.

        Returns
        -------
        ndarray of int64, shape (h,)

        {examples}
        >>> qk = attnlab.collapse_qk(rng.standard_normal((16, 8)), rng.standard_normal((16, 8)),
        ...                          num_heads=2)
        >>> qk.w.shape, qk.rank().tolist()          # d_head = 4 bounds the rank of 16 x 16
        ((2, 16, 16), [4, 4])
        """
        if tol is not None:
            tol = V.check_scale(tol, 0.0)
        return np.array([np.linalg.matrix_rank(w, tol=tol) for w in self.w], dtype=np.int64)

    @_docs.filled
    def scores(self, query: Any, key: Any = None, scale: float | None = None) -> np.ndarray:
        """Exact logits ``scale * (x_q W_i x_k^T + x_q v_i + u_i x_k^T + c_i)``.

        Equal to multi-head attention's scaled ``Q_i K_i^T`` (biases included).

        Parameters
        ----------
        query : array_like, shape (..., n_q, d_q)
        key : array_like, shape (..., n_k, d_k), optional
            Defaults to ``query``; the leading axes broadcast against ``query``'s.
        scale : float, optional
            Defaults to ``1/sqrt(d_head)``.

        Returns
        -------
        ndarray, shape (..., h, n_q, n_k)
            float32 only when the inputs and ``w`` all are, else float64.

        {examples}
        >>> w_q, w_k = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))
        >>> qk = attnlab.collapse_qk(w_q, w_k, num_heads=2)
        >>> x = rng.standard_normal((3, 5, 8))
        >>> s = qk.scores(x)
        >>> q, k = (x @ w_q)[..., :4], (x @ w_k)[..., :4]      # head 0, d_head = 4
        >>> s.shape, bool(np.allclose(s[:, 0], q @ k.swapaxes(-1, -2) / 2))
        ((3, 2, 5, 5), True)
        """
        xq = V.as_array(query, "query")
        xk = xq if key is None else V.as_array(key, "key")
        V.check_ndim(xq, "query", 2, "(..., n_q, d_q)")
        V.check_ndim(xk, "key", 2, "(..., n_k, d_k)")
        _, dq, dk = self.w.shape
        if xq.shape[-1] != dq:
            raise ValueError(
                f"query: expected last dimension d_q = {dq}, got shape {V.shape_str(xq.shape)}"
            )
        if xk.shape[-1] != dk:
            raise ValueError(
                f"key: expected last dimension d_k = {dk}, got shape {V.shape_str(xk.shape)}"
            )
        V.batch_shape([("query", xq.shape[:-2]), ("key", xk.shape[:-2])])
        s = V.check_scale(scale, 1.0 / math.sqrt(self.d_head))
        dtype = V.result_dtype(xq, xk, self.w)
        xq = xq.astype(dtype, copy=False)[..., None, :, :]
        xk = xk.astype(dtype, copy=False)[..., None, :, :]
        w = self.w.astype(dtype, copy=False)
        logits = (xq @ w) @ np.swapaxes(xk, -1, -2)
        if self.v is not None:
            logits = logits + (xq @ self.v.astype(dtype, copy=False)[:, :, None])
        if self.u is not None:
            logits = logits + (
                self.u.astype(dtype, copy=False)[:, None, :] @ np.swapaxes(xk, -1, -2)
            )
        if self.c is not None:
            logits = logits + self.c.astype(dtype, copy=False)[:, None, None]
        return logits * dtype.type(s)


@_docs.filled
def collapse_qk(
    w_q: Any,
    w_k: Any,
    b_q: Any = None,
    b_k: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
) -> BilinearQK:
    """Fold per-head query and key projections into ``W_i = W_q,i W_k,i^T`` (exactly).

    Parameters
    ----------
    w_q : array_like, shape (d_q, h * d_head)
    w_k : array_like, shape (d_k, h_kv * d_head)
        Weights are ``(in_features, out_features)``; head ``i`` is a column block.
    b_q : array_like, shape (h * d_head,), optional
    b_k : array_like, shape (h_kv * d_head,), optional
    num_heads : int
    num_kv_heads : int, optional
        Grouped-query keys: query head ``i`` pairs with key head ``i // (h // h_kv)``. The
        result still has one ``W_i`` per *query* head, since ``W_q,i`` differs per query head.

    Returns
    -------
    BilinearQK
        ``w (h, d_q, d_k)``, ``u = W_k,i b_q,i`` (if ``b_q``), ``v = W_q,i b_k,i`` (if ``b_k``),
        ``c = b_q,i . b_k,i`` (if both), ``d_head``.

    Notes
    -----
    ``v`` and ``c`` cancel in the softmax, ``u`` does not. Invalid with rotary position
    embeddings.

    {examples}
    >>> qk = attnlab.collapse_qk(rng.standard_normal((16, 16)), rng.standard_normal((16, 16)),
    ...                          num_heads=4)
    >>> qk.w.shape, qk.rank().tolist()
    ((4, 16, 16), [4, 4, 4, 4])
    """
    h, h_kv, _ = _args.heads(num_heads, num_kv_heads)
    wq_ = V.as_array(w_q, "w_q")
    wk_ = V.as_array(w_k, "w_k")
    bq_ = V.optional_array(b_q, "b_q")
    bk_ = V.optional_array(b_k, "b_k")
    dtype = V.result_dtype(wq_, wk_, bq_, bk_)
    if wq_.ndim != 2 or wq_.shape[1] % h or wq_.shape[1] == 0:
        raise ValueError(
            f"w_q: expected shape (d_q, h * d_head) with h = {h}, got {V.shape_str(wq_.shape)}"
        )
    d_q, d_head = wq_.shape[0], wq_.shape[1] // h
    wq = V.matrix(wq_, "w_q", dtype, d_q, h * d_head, f"(d_q, {h * d_head})")
    wk = V.matrix(
        wk_, "w_k", dtype, None, h_kv * d_head, f"(d_k, h_kv * d_head) = (d_k, {h_kv * d_head})"
    )
    d_k = wk.shape[0]
    bq = V.vector(bq_, "b_q", dtype, h * d_head)
    bk = V.vector(bk_, "b_k", dtype, h_kv * d_head)
    group = h // h_kv
    # (d, heads, d_head) views, then key heads repeated to pair with their query heads
    wq3 = wq.reshape(d_q, h, d_head).transpose(1, 0, 2)  # (h, d_q, d_head)
    wk3 = np.repeat(wk.reshape(d_k, h_kv, d_head).transpose(1, 0, 2), group, axis=0)
    w = np.ascontiguousarray(wq3 @ np.swapaxes(wk3, -1, -2))  # (h, d_q, d_k)
    bq2 = None if bq is None else bq.reshape(h, d_head)
    bk2 = None if bk is None else np.repeat(bk.reshape(h_kv, d_head), group, axis=0)
    u = None if bq2 is None else np.ascontiguousarray((wk3 @ bq2[:, :, None])[..., 0])
    v = None if bk2 is None else np.ascontiguousarray((wq3 @ bk2[:, :, None])[..., 0])
    c = None if bq2 is None or bk2 is None else np.einsum("hd,hd->h", bq2, bk2)
    return BilinearQK(w=w, u=u, v=v, c=c, d_head=int(d_head))


@_docs.filled
def factorize_qk(w: Any, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Factor each ``W_i`` back into query and key projections of width ``rank`` (truncated SVD).

    ``W_i ~= U_r S_r^(1/2) (V_r S_r^(1/2))^T``, the best rank-``r`` approximation in the
    Frobenius norm (Eckart-Young).

    Parameters
    ----------
    w : array_like, shape (h, d_q, d_k), or a BilinearQK (its ``w``)
    rank : int
        ``1 <= rank <= min(d_q, d_k)``; at ``rank >= rank(W_i)`` the factorisation is exact.

    Returns
    -------
    w_q : ndarray, shape (d_q, h * rank)
    w_k : ndarray, shape (d_k, h * rank)
        Packed per-head column blocks, ready for ``multi_head_attention(..., num_heads=h)``
        (then pass ``scale`` explicitly: the default would be ``1/sqrt(rank)``).
    rel_error : ndarray, shape (h,)
        ``||W_i - w_q,i w_k,i^T||_F / ||W_i||_F = sqrt(sum of dropped sigma^2) / ||W_i||_F``
        (0 for a zero ``W_i``).

    {examples}
    >>> qk = attnlab.collapse_qk(rng.standard_normal((8, 8)), rng.standard_normal((8, 8)),
    ...                          num_heads=2)
    >>> w_q, w_k, err = attnlab.factorize_qk(qk, 4)
    >>> w_q.shape, bool(err.max() < 1e-12)
    ((8, 8), True)
    """
    arr = V.as_array(w.w if isinstance(w, BilinearQK) else w, "w")
    if arr.ndim != 3 or 0 in arr.shape:
        raise ValueError(
            f"w: expected a non-empty array of shape (h, d_q, d_k), got {V.shape_str(arr.shape)}"
        )
    h, dq, dk = arr.shape
    r = V.check_positive_int(rank, "rank")
    if r > min(dq, dk):
        raise ValueError(f"rank: expected an integer <= min(d_q, d_k) = {min(dq, dk)}, got {r}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("w: contains NaN or Inf; the SVD is undefined")
    u, s, vt = np.linalg.svd(arr, full_matrices=False)  # (h, dq, m), (h, m), (h, m, dk)
    root = np.sqrt(s[:, :r])
    fq = u[:, :, :r] * root[:, None, :]  # (h, dq, r)
    fk = np.swapaxes(vt[:, :r, :], -1, -2) * root[:, None, :]  # (h, dk, r)
    w_q = np.ascontiguousarray(fq.transpose(1, 0, 2).reshape(dq, h * r))
    w_k = np.ascontiguousarray(fk.transpose(1, 0, 2).reshape(dk, h * r))
    s64 = s.astype(np.float64)
    total = np.sqrt(np.sum(s64 * s64, axis=1))
    dropped = np.sqrt(np.sum(s64[:, r:] ** 2, axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(total > 0, dropped / np.where(total > 0, total, 1.0), 0.0)
    return w_q, w_k, rel.astype(arr.dtype)


class _Prepared(NamedTuple):
    """Validated arguments of bilinear_attention, as the core takes them."""

    dtype: np.dtype
    batch: tuple[int, ...]
    B: int
    n_q: int
    n_k: int
    d_out: int
    h: int
    h_kv: int
    x: _args.Qkv
    wqk: np.ndarray
    uk: np.ndarray | None
    wv: np.ndarray
    bv: np.ndarray | None
    wo: np.ndarray
    bo: np.ndarray | None
    m: _args.Masks
    mode: str | None
    order: str
    bf16: bool  # precision="bf16" (the query order)
    weights_half: int = 0  # w_qk, w_v, w_o as float16 (1) / bfloat16 (2) bits, or 0
    inputs_half: bool = False  # query, key, value (and the forward's out) as bits of that half
    half: np.dtype | None = None  # the half dtype of weights_half

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """query, key, value as contiguous (B * n, d) rows (shared when key/value default), as
        the bits of their half dtype with ``inputs_half``."""
        if not self.inputs_half:
            return self.x.rows(self.batch, self.dtype)
        assert self.half is not None
        return self.x.rows(self.batch, self.half, bits=True)

    def core_args(self) -> core.BilinearArgs:
        """The arguments core.bilinear_forward / bilinear_backward share; with ``bf16`` (the
        backward's) the inputs and the weights ``w_qk``, ``w_v``, ``w_o`` rounded to bfloat16."""
        query, key, value = self.rows()
        wqk, wv, wo = self.wqk, self.wv, self.wo
        if self.bf16:
            query, key, value, wqk, wv, wo = _half.rounded_bf16(query, key, value, wqk, wv, wo)
        layers = {"w_v": wv, "b_v": self.bv, "w_o": wo, "b_o": self.bo}
        return _args.projected_args(
            core.BilinearArgs, self, layers, query=query, key=key, value=value, w_qk=wqk,
            u_k=self.uk, weights_half=self.weights_half, inputs_half=int(self.inputs_half),
        )  # fmt: skip


def _half_weights(w_qk: Any, args: dict[str, Any]) -> np.dtype | None:
    """The half dtype ``w_qk``, ``w_v`` and ``w_o`` are all stored in (ndarrays), or None."""
    dt = getattr(w_qk, "dtype", None)
    if not isinstance(dt, np.dtype) or not _half.is_half(dt):
        return None
    ws = (w_qk, args["w_v"], args["w_o"])
    return dt if all(isinstance(w, np.ndarray) and w.dtype == dt for w in ws) else None


def _prepare(args: dict[str, Any], keep_half: bool = False) -> _Prepared:
    """The validated arguments of a bilinear_attention call (forward and backward).
    ``keep_half``: ``w_qk``, ``w_v`` and ``w_o`` stored in one half dtype stay so (the kernel
    widens ``w_qk`` a head at a time, the GEMMs the others as they pack them, or round them
    with bf16 products: no float32 copies), and so do ``query``, ``key``, ``value`` and the
    output when every array of the call is stored so."""
    h, h_kv, kv_arg = _args.heads(args["num_heads"], args["num_kv_heads"])
    w_qk, u_k, _order = args["w_qk"], args["u_k"], args["_order"]
    d_head: float | None = None
    if isinstance(w_qk, BilinearQK):
        spoilt = [n for n in ("softcap", "sinks") if args[n] is not None]
        if spoilt and (w_qk.v is not None or w_qk.c is not None):
            # the per-row terms cancel in a plain softmax, not through tanh nor against a
            # sink's logit: dropping them would silently change the answer
            raise ValueError(
                f"{spoilt[0]}: this BilinearQK has query-side terms v, c (from b_k), which "
                f"bilinear attention drops because a plain softmax cancels them; with "
                f"{spoilt[0]} they do not cancel. Fold without b_k, or use multi_head_attention"
            )
        if u_k is not None:
            raise ValueError("u_k: must be None when w_qk is a BilinearQK (it carries its own u)")
        u_k = w_qk.u
        d_head = float(w_qk.d_head)
        w_qk = w_qk.w
    half = _half_weights(w_qk, args) if keep_half else None
    x = _args.qkv(args, keep=half)
    n_q, n_k = x.n_q, x.n_k
    d_q, d_k, d_v = x.widths
    # (the inputs' bits only when the output is stored so too: a float32 bias makes it float32)
    inputs_half = half is not None and x.xq.dtype == half and _half.storage(args) == half
    uk_ = V.optional_array(u_k, "u_k")
    bv_ = V.optional_array(args["b_v"], "b_v")
    bo_ = V.optional_array(args["b_o"], "b_o")
    if half is not None:
        wqk_, wv_, wo_ = w_qk, args["w_v"], args["w_o"]
        xs = (_half.COMPUTED,) if inputs_half else (x.xq, x.xk, x.xv)
        dtype = V.result_dtype(*xs, _half.COMPUTED, uk_, bv_, bo_)
        if dtype != np.float32:  # float64 inputs: the weights widen with them
            half = None
            inputs_half = False
    if half is None:
        wqk_ = V.as_array(w_qk, "w_qk")
        wv_ = V.as_array(args["w_v"], "w_v")
        wo_ = V.as_array(args["w_o"], "w_o")
        dtype = V.result_dtype(x.xq, x.xk, x.xv, wqk_, uk_, wv_, wo_, bv_, bo_)
    lay_qk, lay_v = "(num_heads, d_q, d_k)", f"(d_v, {kv_arg} * d_vhead)"
    if wqk_.ndim != 3:
        raise ValueError(
            f"w_qk: expected a 3-D array {lay_qk}, got shape {V.shape_str(wqk_.shape)}"
        )
    V.check_matrix(wv_, "w_v", lay_v)
    V.check_matrix(wo_, "w_o", "(num_heads * d_vhead, d_out)", 0)
    if wqk_.shape[0] != h:
        raise ValueError(
            f"num_heads: {h} does not match the {wqk_.shape[0]} heads of w_qk "
            f"{V.shape_str(wqk_.shape)}, which is {lay_qk}"
        )
    rv = V.reader(wv_, "w_v", lay_v, lambda n: n % h_kv == 0, d_v)
    V.check_heads(wv_, h_kv, kv_arg, rv, "from_torch_mha")
    rq = V.Reader("w_qk", wqk_.shape, wqk_.shape[1], "entries on axis 1", lay_qk, False)
    rk = V.Reader("w_qk", wqk_.shape, wqk_.shape[2], "entries on axis 2", lay_qk, False)
    V.check_readers(x.groups((rq, rk, rv)), "from_torch_mha")
    # half-precision weights as their bits, as the kernel takes them
    as_stored = (lambda w: _memory.contiguous(w).view(np.uint16)) if half is not None else None
    wqk = as_stored(wqk_) if as_stored else _memory.contiguous(wqk_, dtype)
    uk = None
    if uk_ is not None:
        if uk_.shape != (h, d_k):
            raise ValueError(
                f"u_k: expected shape (h, d_k) = ({h}, {d_k}), got {V.shape_str(uk_.shape)}"
            )
        uk = _memory.contiguous(uk_, dtype)
    d_vhead = wv_.shape[1] // h_kv
    wv = as_stored(wv_) if as_stored else _memory.contiguous(wv_, dtype)
    if wo_.shape[0] != h * d_vhead:
        raise ValueError(
            f"w_o: expected shape (num_heads * d_vhead, d_out) = ({h * d_vhead}, "
            f"d_out) with d_vhead = {d_vhead} from w_v {V.shape_str(wv_.shape)}, "
            f"got {V.shape_str(wo_.shape)}"
        )
    wo = as_stored(wo_) if as_stored else _memory.contiguous(wo_, dtype)
    d_out = wo.shape[1]
    bv = V.vector(bv_, "b_v", dtype, h_kv * d_vhead)
    bo = V.vector(bo_, "b_o", dtype, d_out)

    batch = x.batch()
    if d_head is None:
        d_head = d_q / h
    mode = V.weights_mode(args["return_weights"])
    m = _args.masks(args, batch, h, n_q, n_k, dtype, 1.0 / math.sqrt(d_head) if d_head > 0 else 1.0)
    B = V.count(batch)
    bf16 = V.precision_bf16(args["precision"], dtype)
    if bf16 and _order == "key":
        raise ValueError("_order: precision='bf16' evaluates the query order only, got 'key'")
    if bf16:  # one definition of the rounded products: the query order's
        order = "query"
    elif _order is None:
        order = collapsed_order(
            n_q=n_q, n_k=n_k, d_q=d_q, d_k=d_k, num_heads=h, batch=B, key_bias=uk is not None
        )
    elif _order in _ORDERS:
        order = _order
    else:
        raise ValueError(f"_order: expected None, 'query' or 'key', got {_order!r}")
    return _Prepared(
        dtype, batch, B, n_q, n_k, d_out, h, h_kv, x, wqk, uk, wv, bv, wo, bo, m, mode, order, bf16,
        0 if half is None else _half.code(half),
        inputs_half,
        half,
    )  # fmt: skip


@_docs.filled
def bilinear_attention(
    query: Any,
    key: Any = None,
    value: Any = None,
    *,
    w_qk: Any,
    u_k: Any = None,
    w_v: Any,
    w_o: Any,
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
    return_weights: bool | str = False,
    return_lse: bool = False,
    precision: str | None = None,
    warn_empty_rows: bool = True,
    _order: str | None = None,
    _keep: dict[str, Any] | None = None,
) -> Any:
    """Attention with collapsed query-key weights: logits ``scale * (x_q W_i x_k^T + u_i x_k^T)``.

    ``out = concat_i(softmax(logits_i + mask) V_i) w_o + b_o`` with ``V = value w_v + b_v``.
    With ``w_qk = collapse_qk(w_q, w_k, b_q, b_k, ...)`` it equals
    :func:`attnlab.multi_head_attention` with the same ``w_v, w_o, b_v, b_o``, biases included
    (the dropped ``v`` and ``c`` terms cancel in the softmax).

    Parameters
    ----------
    {query_key_value}
    w_qk : array_like, shape (h, d_q, d_k), or BilinearQK
        One matrix per query head. A :class:`BilinearQK` also supplies ``u_k`` and the default
        scale ``1/sqrt(d_head)``.
    u_k : array_like, shape (h, d_k), optional
        Key-side term ``W_k,i b_q,i``; not allowed together with a BilinearQK.
    w_v : array_like, shape (d_v, h_kv * d_vhead)
    w_o : array_like, shape (h * d_vhead, d_out)
    b_v, b_o : array_like, optional
    num_heads : int
    num_kv_heads : int, optional
        Grouped values: query head ``i`` reads value head ``i // (h // h_kv)``.
    mask, key_padding_mask, causal, return_weights, warn_empty_rows
        As in :func:`attnlab.multi_head_attention`: boolean ``True`` means *may attend*, the
        opposite of ``nn.MultiheadAttention``'s masks (convert those with
        :func:`attnlab.interop.torch_masks`); ``causal=True`` lets query ``i`` see keys
        ``j <= i``, ``"bottom_right"`` keys ``j <= i + n_k - n_q``; ``warn_empty_rows=False``
        silences the warning for query rows the boolean masks leave with no key.
    {window}
    {logit_options}
    scale : float, optional
        Default ``1/sqrt(d_head)`` for a BilinearQK, ``1/sqrt(d_q / num_heads)`` for a raw
        ``w_qk``.
    precision : {None, "bf16"}, optional
        ``None``: exact in the input dtype. ``"bf16"`` (float32 or half-precision inputs): the
        query order
        ``(X_q W_i + u_i) X_k^T`` whatever the cost model says, every matrix product's operands
        rounded to bfloat16 (round to nearest even, subnormals to zero) and summed in float32.
        The rounded operands are ``query``, ``key``, ``value``, ``w_qk`` (the folded matrices
        as given: fold in float32, then round), ``w_v`` and ``w_o``, and the products that feed
        a further product: the projected queries ``X_q W_i + u_i``, the values
        ``X_v w_v + b_v`` and the context; ``u_k``, ``b_v`` and ``b_o`` are added unrounded, in
        float32. The softmax statistics are float32 and the probabilities are rounded to
        bfloat16 for their product with the values, as in
        :func:`scaled_dot_product_attention`'s ``precision="bf16"``: on AMX tiles or
        ``VDPBF16PS`` where the CPU has them (``build_info()["bf16_kernel"]``), with the same
        rounding emulated elsewhere.
        :func:`attnlab.reference.bilinear_attention` rounds the same operands in float64 (not
        the probabilities: their rounding is within the bound). The error against the exact
        result is of the order of bfloat16's unit roundoff ``2**-8``, relative (the bound is in
        ``docs/guide.md``, "Precision"). Gradients (``*_backward``, ``vjp``) are those of the
        float32 bilinear attention at ``query``, ``key``, ``value``, ``w_qk``, ``w_v`` and
        ``w_o`` rounded to bfloat16 (``vjp``'s pullback recomputes them).

    {attention_returns}

    Notes
    -----
    The kernel evaluates either ``(X_q W_i + u_i) X_k^T`` (query order: one parallel GEMM for
    all heads, keys read unprojected and shared by every head) or ``[X_q, 1] [X_k W_i^T,
    X_k u_i]^T`` (key order), whichever :func:`attnlab.cost.collapsed_order` says is cheaper:
    the key order wins when ``n_q`` is much larger than ``n_k``. Fully masked query rows give
    zero weights and an output row of ``b_o``. Not valid with rotary position embeddings.
    {dtypes_mixed}

    {examples}
    >>> x = rng.standard_normal((2, 5, 16))
    >>> w = [rng.standard_normal((16, 16)) * 0.25 for _ in range(4)]
    >>> qk = attnlab.collapse_qk(w[0], w[1], num_heads=4)
    >>> out = attnlab.bilinear_attention(x, w_qk=qk, w_v=w[2], w_o=w[3], num_heads=4)
    >>> ref = attnlab.multi_head_attention(x, w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3],
    ...                                    num_heads=4)
    >>> bool(np.allclose(out, ref, atol=1e-12))
    True
    """
    args = _sig.arguments(locals())
    lse_wanted = V.check_flag(return_lse, "return_lse")
    if lse_wanted and _order is None:  # the log-sum-exp is kept by the query order's kernel
        args["_order"] = "query"
    # (the bf16 pullback recomputes from float32 copies, rounded as the backward rounds them)
    a = _prepare(args, keep_half=precision is None or _keep is None)
    B, n_q, n_k, h, d_out, dtype, mode = a.B, a.n_q, a.n_k, a.h, a.d_out, a.dtype, a.mode
    batch = a.batch
    half = _half.storage(args)
    out = _memory.empty((B * n_q, d_out), half if a.inputs_half else dtype)  # rounded in C++
    # (their mean in float32; the bf16 composition's rounded in Python)
    w_dtype = half if a.inputs_half and mode != "mean" and not a.bf16 else dtype
    weights = _memory.empty((B, h, n_q, n_k), w_dtype) if mode else None
    if a.bf16:
        lse = a.m.empty_lse(B, h, n_q, dtype) if lse_wanted else None  # what no key leaves
        if _keep is not None:  # the pullback recomputes, at the rounded operands
            a = _memory.owned(a)
            _keep.update(prepared=a, state=None, halves=_half.halves(args))
        if B * n_q > 0:
            _bf16_forward(a, out, weights, lse)
        return _args.with_weights(out, weights, mode, batch, (n_q, d_out), lse, half)
    state = None
    if _keep is not None:  # attnlab.vjp
        a = _memory.owned(a)
        # the backward evaluates in the query order: its state is kept when the forward runs
        # in that order too (else the pullback recomputes, and the output stays the one the
        # cost model's order gives)
        state = _bilinear_state(a) if a.order == "query" else None
        _keep.update(prepared=a, state=state, halves=_half.halves(args))
    if lse_wanted and state is None:
        state = _bilinear_state(a)
    if B * n_q > 0:
        out_arg = out.view(np.uint16) if a.inputs_half else out
        core.bilinear_forward(a.core_args(), _ORDERS[a.order], out_arg, _half.bits(weights), state)
    lse = None
    if lse_wanted:
        assert state is not None
        lse = state["lse"] if B * n_q > 0 else a.m.empty_lse(B, h, n_q, dtype)
    return _args.with_weights(out, weights, mode, batch, (n_q, d_out), lse, half)


def _bf16_forward(
    a: _Prepared, out: np.ndarray, weights: np.ndarray | None, lse: np.ndarray | None
) -> None:
    """precision="bf16" into ``out`` ``(B*n_q, d_out)`` (and ``weights``, ``lse``), composed
    of the bf16 kernels: the projections ``X_q W_i + u_i`` (head by head: no copy of ``w_qk``
    side by side), ``X_v w_v + b_v`` and the output's by
    ``linear_forward``, the attention core by ``sdpa_forward`` with the key rows as every
    value head's keys (a zero-stride view: the rows are not copied per head). Half-precision
    weights and inputs are read as stored but for the key rows, widened: the attention core
    takes no half-precision keys beside float32 values."""
    B, h, h_kv, n_q, n_k, dtype = a.B, a.h, a.h_kv, a.n_q, a.n_k, a.dtype
    query, key, value = a.rows()
    wh, xh = a.weights_half, a.inputs_half  # weights as bits of that format; inputs too with xh
    if xh:
        assert a.half is not None
        key = _half.widen(key.view(a.half))
    d_k = a.wqk.shape[2]
    d_vhead = a.wv.shape[1] // h_kv
    proj = _memory.empty((h, B * n_q, d_k), dtype)
    for i in range(h):
        uk = None if a.uk is None else a.uk[i]
        core.linear_forward(query, a.wqk[i], uk, proj[i], True, wh, xh)
    vals = _memory.empty((B * n_k, h_kv * d_vhead), dtype)
    core.linear_forward(value, a.wv, a.bv, vals, True, wh, xh)
    ctx = _memory.empty((B, n_q, h, d_vhead), dtype)
    core.sdpa_forward(
        proj.reshape(h, B, n_q, d_k).transpose(1, 0, 2, 3),
        np.broadcast_to(key.reshape(B, 1, n_k, d_k), (B, h_kv, n_k, d_k)),
        vals.reshape(B, n_k, h_kv, d_vhead).transpose(0, 2, 1, 3),
        ctx.transpose(0, 2, 1, 3),
        a.m.core_mask(),
        a.m.scale,
        weights,
        lse,
        True,
    )
    y = out.view(np.uint16) if xh else out
    core.linear_forward(ctx.reshape(B * n_q, h * d_vhead), a.wo, a.bo, y, True, wh, False, xh)


_BACKWARD_DOC = """\
    {forward_parameters}
        As for :func:`bilinear_attention`
        {mask_polarity}
        ``return_weights`` is accepted and ignored.

    Returns
    -------
    dict
        Keyed by argument name: ``"query"``, ``"key"`` and ``"value"`` when given (when
        ``key``/``value`` default to ``query`` their gradients are summed into ``"query"``),
        ``"w_qk"`` as an ``(h, d_q, d_k)`` array (also when ``w_qk`` is a :class:`BilinearQK`),
        ``"u_k"`` of shape ``(h, d_k)`` when ``u_k`` is given or the BilinearQK carries a ``u``,
        ``"w_v"``, ``"w_o"``, each bias given, ``"mask"`` for a float mask and ``"sinks"``
        when given. Boolean masks, key padding and ``alibi_slopes`` are not differentiated;
        fully masked query rows contribute zero gradient (except to ``b_o``, whose gradient is
        the sum of ``grad_out`` over all rows).

    Notes
    -----
    The forward is recomputed in the query order ``(X_q W_i + u_i) X_k^T`` whatever order the
    forward chose; the gradient is the same function. Results are bitwise the same for any
    thread count.

    {examples}
    >>> x = rng.standard_normal((5, 8))
    >>> w = {n: rng.standard_normal((8, 8)) / 3 for n in ("w_q", "w_k", "w_v", "w_o")}
    >>> qk = attnlab.collapse_qk(w["w_q"], w["w_k"], num_heads=2)
    >>> from attnlab import bilinear_attention_backward
    >>> g = bilinear_attention_backward(np.ones((5, 8)), x, w_qk=qk, w_v=w["w_v"],
    ...                                 w_o=w["w_o"], num_heads=2)
    >>> sorted(g), g["w_qk"].shape
    (['query', 'w_o', 'w_qk', 'w_v'], (2, 8, 8))
    """


def _bilinear_state(a: _Prepared) -> dict[str, np.ndarray]:
    """Buffers for what the forward keeps for attnlab.vjp's pullback (O(n d))."""
    B, h, dtype = a.B, a.h, a.dtype
    return _memory.empty_group(
        {
            "v": ((B * a.n_k, a.wv.shape[1]), dtype),
            "proj": ((B * a.n_q, h * a.wqk.shape[2]), dtype),
            "ctx": ((B * a.n_q, a.wo.shape[0]), dtype),
            "lse": ((B, h, a.n_q), dtype),
        }
    )


def _bilinear_grads(
    a: _Prepared, grad_out: Any, state: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """The gradients of a prepared call; with ``state`` (what the forward kept for
    attnlab.vjp) the forward is not recomputed."""
    dtype, batch, B = a.dtype, a.batch, a.B
    # half-precision weights are read as stored; with half-precision inputs grad_out in their
    # dtype read, and their gradients written, as stored (the weights' gradients: below)
    keep = a.half if a.inputs_half else None
    go2 = _grad.grad_out_rows(grad_out, batch + (a.n_q, a.d_out), dtype, keep=keep)
    kernel = B * a.n_q > 0  # it writes every element: buffers need no zeros when it runs
    params = {"w_qk": a.wqk, "u_k": a.uk, "w_v": a.wv, "b_v": a.bv, "w_o": a.wo, "b_o": a.bo}
    # half-precision w_v's and w_o's gradients written in their dtype (rounded as written)
    in_half = {"w_v": a.half, "w_o": a.half} if a.half is not None else None
    grads = _grad.grad_buffers(params, dtype, zeroed=not kernel, stored=in_half)
    shapes, x = a.x.shapes, a.x
    rows = {name: (B * shp[-2], shp[-1]) for name, shp in shapes.items()}
    in_dtype = dtype if keep is None else keep
    buffers = _grad.input_buffers(rows, x.key_omitted, x.value_omitted, in_dtype, not kernel)
    logit = _grad.logit_buffers(a.m, B, a.h, a.n_q, a.n_k, dtype)
    if kernel:
        # as their bits where stored in half precision (shared buffers stay shared)
        bits = {n: _half.bits(g) for n, g in {**grads, **buffers}.items()}
        core.bilinear_backward(go2, a.core_args(), {**bits, **logit}, state)
    inputs = _grad.input_grads(buffers, batch, shapes, x.key_omitted, x.value_omitted)
    return {**inputs, **grads, **_grad.logit_grads(logit, a.m, batch)}


def _bilinear_backward(grad_out: Any, args: dict[str, Any]) -> dict[str, np.ndarray]:
    # the query order, whatever order the forward chose: the gradient is the same function
    # (bf16: the operands rounded in Python, from float32 copies)
    keep = args["precision"] is None
    grads = _bilinear_grads(_prepare({**args, "_order": "query"}, keep_half=keep), grad_out)
    return _half.store_grads(grads, _half.halves(args))


bilinear_attention_backward = _sig.backward_of(
    bilinear_attention, _bilinear_backward, "(..., n_q, d_out)", _BACKWARD_DOC
)
