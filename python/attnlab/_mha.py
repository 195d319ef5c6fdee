"""Scaled dot-product and multi-head attention (forward) on NumPy arrays."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _validate as V
from ._loader import core

__all__ = ["scaled_dot_product_attention", "multi_head_attention"]

Weights = bool | str


def _finish(out: np.ndarray, weights: np.ndarray | None, mode: str | None) -> Any:
    if mode is None:
        return out
    assert weights is not None
    if mode == "mean":
        weights = weights.mean(axis=-3)
    return out, weights


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: bool | str = False,
    scale: float | None = None,
    return_weights: Weights = False,
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
        mask is added to the scaled scores.
    causal : bool or {"top_left", "bottom_right"}
        ``True``/``"top_left"``: query ``i`` sees keys ``j <= i``. ``"bottom_right"``: the last
        query is aligned with the last key (decoding with a cache).
    scale : float, optional
        Defaults to ``1 / sqrt(d)``.
    return_weights : bool or {"heads", "mean"}
        Also return the attention weights, per head ``(..., h, n_q, n_k)`` or their mean over
        heads ``(..., n_q, n_k)``.

    Returns
    -------
    out : ndarray, shape (..., h, n_q, d_v)
    weights : ndarray, optional

    Notes
    -----
    A query row whose keys are all masked gets weights 0 and an output row of 0, never NaN.

    Examples
    --------
    >>> import numpy as np, attnlab
    >>> q = k = v = np.ones((2, 4, 8))
    >>> attnlab.scaled_dot_product_attention(q, k, v, causal=True).shape
    (2, 4, 8)
    """
    q = V.as_array(q, "q")
    k = V.as_array(k, "k")
    v = V.as_array(v, "v")
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
    dtype = V.result_dtype(q, k, v)
    code = V.causal_code(causal)
    s = V.check_scale(scale, 1.0 / math.sqrt(d))
    mode = V.weights_mode(return_weights)
    m4 = V.mask4(mask, batch, h, n_q, n_k, dtype)

    B = int(np.prod(batch, dtype=np.int64)) if batch else 1
    out = np.empty((B, h, n_q, d_v), dtype=dtype)
    weights = np.empty((B, h, n_q, n_k), dtype=dtype) if mode else None
    if out.size or (weights is not None and weights.size):
        core.sdpa_forward(
            V.stack(q, batch, dtype, 3), V.stack(k, batch, dtype, 3), V.stack(v, batch, dtype, 3),
            out, m4, None, code, s, weights, None,
        )
    out = out.reshape(batch + (h, n_q, d_v))
    if weights is not None:
        weights = weights.reshape(batch + (h, n_q, n_k))
    return _finish(out, weights, mode)


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
    scale: float | None = None,
    return_weights: Weights = False,
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
        the scaled scores.
    key_padding_mask : array_like of bool, optional
        ``(..., n_k)``, ``True`` for real tokens.
    causal : bool or {"top_left", "bottom_right"}
    scale : float, optional
        Defaults to ``1 / sqrt(d_head)``.
    return_weights : bool or {"heads", "mean"}
        ``True``/``"heads"``: also return ``(..., h, n_q, n_k)``; ``"mean"``: ``(..., n_q, n_k)``.

    Returns
    -------
    out : ndarray, shape (..., n_q, d_out)
    weights : ndarray, optional

    Notes
    -----
    Fully masked query rows give zero weights and a zero context, so their output is ``b_o``.

    Examples
    --------
    >>> import numpy as np, attnlab
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 5, 16))
    >>> w = [rng.standard_normal((16, 16)) * 0.25 for _ in range(4)]
    >>> attnlab.multi_head_attention(x, w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3],
    ...                              num_heads=4).shape
    (2, 5, 16)
    """
    h = V.check_positive_int(num_heads, "num_heads")
    h_kv = h if num_kv_heads is None else V.check_positive_int(num_kv_heads, "num_kv_heads")
    if h % h_kv:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {h}, got {h_kv}")
    xq = V.as_array(query, "query")
    xk = xq if key is None else V.as_array(key, "key")
    xv = xk if value is None else V.as_array(value, "value")
    V.check_ndim(xq, "query", 2, "(..., n_q, d_q)")
    V.check_ndim(xk, "key", 2, "(..., n_k, d_k)")
    V.check_ndim(xv, "value", 2, "(..., n_k, d_v)")
    n_q, d_q = xq.shape[-2:]
    n_k, d_k = xk.shape[-2:]
    if xv.shape[-2] != n_k:
        raise ValueError(
            f"value: expected {n_k} tokens (as key), got shape {V.shape_str(xv.shape)}"
        )
    d_v = xv.shape[-1]
    ws = {n: V.as_array(a, n) for n, a in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v), ("w_o", w_o))}
    bs = {n: V.optional_array(a, n) for n, a in (("b_q", b_q), ("b_k", b_k), ("b_v", b_v),
                                                    ("b_o", b_o))}
    dtype = V.result_dtype(xq, xk, xv, *ws.values(), *bs.values())
    wq_ = ws["w_q"]
    if wq_.ndim != 2 or wq_.shape[0] != d_q or wq_.shape[1] % h or wq_.shape[1] == 0:
        raise ValueError(
            f"w_q: expected shape (d_q, h * d_head) = ({d_q}, {h} * d_head), got "
            f"{V.shape_str(wq_.shape)}"
        )
    d_head = wq_.shape[1] // h
    wv_ = ws["w_v"]
    if wv_.ndim != 2 or wv_.shape[0] != d_v or wv_.shape[1] % h_kv:
        raise ValueError(
            f"w_v: expected shape (d_v, h_kv * d_vhead) = ({d_v}, {h_kv} * d_vhead), got "
            f"{V.shape_str(wv_.shape)}"
        )
    d_vhead = wv_.shape[1] // h_kv
    wq = V.matrix(wq_, "w_q", dtype, d_q, h * d_head, f"({d_q}, {h * d_head})")
    wk = V.matrix(ws["w_k"], "w_k", dtype, d_k, h_kv * d_head,
                  f"(d_k, h_kv * d_head) = ({d_k}, {h_kv * d_head})")
    wv = V.matrix(wv_, "w_v", dtype, d_v, h_kv * d_vhead, f"({d_v}, {h_kv * d_vhead})")
    wo_ = ws["w_o"]
    wo = V.matrix(wo_, "w_o", dtype, h * d_vhead, None,
                  f"(h * d_vhead, d_out) = ({h * d_vhead}, d_out)")
    d_out = wo.shape[1]
    bq = V.vector(bs["b_q"], "b_q", dtype, h * d_head)
    bk = V.vector(bs["b_k"], "b_k", dtype, h_kv * d_head)
    bv = V.vector(bs["b_v"], "b_v", dtype, h_kv * d_vhead)
    bo = V.vector(bs["b_o"], "b_o", dtype, d_out)

    names = [("query", xq.shape[:-2]), ("key", xk.shape[:-2]), ("value", xv.shape[:-2])]
    batch = V.batch_shape(names)
    code = V.causal_code(causal)
    s = V.check_scale(scale, 1.0 / math.sqrt(d_head))
    mode = V.weights_mode(return_weights)
    m4 = V.mask4(mask, batch, h, n_q, n_k, dtype)
    kp = V.key_padding2(key_padding_mask, batch, n_k)

    B = int(np.prod(batch, dtype=np.int64)) if batch else 1
    out = np.empty((B * n_q, d_out), dtype=dtype)
    weights = np.empty((B, h, n_q, n_k), dtype=dtype) if mode else None
    if B * n_q > 0:
        rq = V.rows(xq, batch, dtype)
        rk = rq if xk is xq else V.rows(xk, batch, dtype)
        rv = rk if xv is xk else V.rows(xv, batch, dtype)
        core.mha_forward(rq, rk, rv, wq, bq, wk, bk, wv, bv, wo, bo, B, n_q, n_k, h, h_kv,
                         m4, kp, code, s, out, weights)
    out = out.reshape(batch + (n_q, d_out))
    if weights is not None:
        weights = weights.reshape(batch + (h, n_q, n_k))
    return _finish(out, weights, mode)
