"""Plain NumPy float64 scaled dot-product and multi-head attention: the oracle for the tests.

Written for clarity, not speed: one head at a time, the full score matrix, an explicit softmax.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._validate import ATTENTION_ROWS, warn_empty

__all__ = ["scaled_dot_product_attention", "multi_head_attention", "allowed_and_bias"]


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def allowed_and_bias(
    n_q: int, n_k: int, mask: Any = None, key_padding_mask: Any = None, causal: Any = False
) -> tuple[np.ndarray, np.ndarray]:
    """Which (query, key) pairs may attend and the float mask to add, before broadcasting.

    Parameters
    ----------
    n_q, n_k : int
        Query and key counts.
    mask : array_like of bool or float, optional
        Broadcasts to ``(..., h, n_q, n_k)``: boolean ``True`` = may attend, float = added.
    key_padding_mask : array_like of bool, shape (..., n_k), optional
        ``True`` for real tokens; placed as ``(..., 1, 1, n_k)``.
    causal : bool or {"top_left", "bottom_right"}

    Returns
    -------
    allowed : ndarray of bool
        Broadcasts against ``(..., h, n_q, n_k)``.
    bias : ndarray of float64
        The float mask (a 0-d zero when there is none), same broadcasting.

    Examples
    --------
    >>> from attnlab.reference._mha import allowed_and_bias
    >>> allowed, bias = allowed_and_bias(2, 3, causal="bottom_right")
    >>> allowed.astype(int).tolist(), bias.shape
    ([[1, 1, 0], [1, 1, 1]], ())
    """
    allowed = np.ones((n_q, n_k), dtype=bool)
    bias = np.zeros((), dtype=np.float64)
    if causal in (True, "top_left", "bottom_right"):
        offset = n_k - n_q if causal == "bottom_right" else 0
        i = np.arange(n_q)[:, None]
        j = np.arange(n_k)[None, :]
        allowed = allowed & (j <= i + offset)
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype == bool:
            allowed = allowed & m
        else:
            bias = m.astype(np.float64)
    if key_padding_mask is not None:
        kp = np.asarray(key_padding_mask, dtype=bool)
        allowed = allowed & kp[..., None, None, :]
    return allowed, bias


def warn_if_empty(allowed: np.ndarray, n_q: int, n_k: int, causal: Any, warn: Any) -> None:
    """attnlab's warning for query rows the boolean masks leave without a key (``allowed``,
    broadcast to ``(..., h, n_q, n_k)``), among those ``causal`` alone leaves some key; counted
    here the plain way, as a check on the kernels' wrapper."""
    if not warn:
        return
    live = allowed_and_bias(n_q, n_k, causal=causal)[0].any(axis=-1)
    empty = int(np.sum(~allowed.any(axis=-1) & live))
    warn_empty(empty, int(np.prod(allowed.shape[:-1])), ATTENTION_ROWS)


def _softmax_rows(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over the last axis among allowed entries; rows with none allowed give zeros."""
    s = np.where(allowed, scores, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # initial: n_k may be 0
    finite_max = np.where(np.isneginf(row_max), 0.0, row_max)
    e = np.where(allowed, np.exp(s - finite_max), 0.0)
    e = np.where(np.isneginf(s), 0.0, e)  # -inf from a float mask
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    # NaN anywhere in a row's inputs makes that row NaN (propagation, not masking)
    nan_rows = np.isnan(total)
    return np.where(nan_rows, np.nan, p)


def _context(p: np.ndarray, v: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``p @ v``, with rows that may attend to no key exactly 0 (even if ``v`` holds NaN or Inf:
    a masked key contributes nothing, not 0 * NaN)."""
    return np.where(np.any(allowed, axis=-1, keepdims=True), p @ v, 0.0)


def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, mask: Any = None, causal: Any = False, scale: Any = None,
    return_weights: Any = False, warn_empty_rows: Any = True,
) -> Any:
    """Reference for :func:`attnlab.scaled_dot_product_attention` (float64).

    Parameters
    ----------
    q : array_like, shape (..., h, n_q, d)
    k : array_like, shape (..., h_kv, n_k, d)
        ``h`` a multiple of ``h_kv`` (grouped-query: query head ``i`` reads key head
        ``i // (h // h_kv)``).
    v : array_like, shape (..., h_kv, n_k, d_v)
    mask : array_like of bool or float, optional
        Broadcasts to ``(..., h, n_q, n_k)``; boolean ``True`` = may attend, float = added.
    causal : bool or {"top_left", "bottom_right"}
    scale : float, optional
        Defaults to ``1 / sqrt(d)``.
    return_weights : bool or "mean"
    warn_empty_rows : bool
        As for :func:`attnlab.scaled_dot_product_attention`.

    Returns
    -------
    out : ndarray, shape (..., h, n_q, d_v)
        float64. Rows with every key masked are zeros.
    weights : ndarray, shape (..., h, n_q, n_k) or (..., n_q, n_k)
        Only with ``return_weights`` (``"mean"`` averages over heads).

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab import reference
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 5, 8))
    >>> out, w = reference.scaled_dot_product_attention(q, q, q, causal=True,
    ...                                                 return_weights=True)
    >>> out.shape, w.shape, bool(np.allclose(w.sum(-1), 1))
    ((2, 4, 5, 8), (2, 4, 5, 5), True)
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    h, n_q, d = q.shape[-3:]
    h_kv, n_k = k.shape[-3], k.shape[-2]
    group = h // h_kv
    # grouped-query: query head j reads kv head j // group
    k = np.repeat(k, group, axis=-3)
    v = np.repeat(v, group, axis=-3)
    s = (1.0 / math.sqrt(d)) if scale is None else float(scale)
    scores = s * (q @ np.swapaxes(k, -1, -2))
    allowed, bias = allowed_and_bias(n_q, n_k, mask, None, causal)
    scores = scores + bias
    allowed = np.broadcast_to(allowed, scores.shape)
    warn_if_empty(allowed, n_q, n_k, causal, warn_empty_rows)
    p = _softmax_rows(scores, allowed)
    out = _context(p, v, allowed)
    if return_weights in (False, None):
        return out
    return out, (p.mean(axis=-3) if return_weights == "mean" else p)


def multi_head_attention(
    query: Any, key: Any = None, value: Any = None, *, w_q: Any, w_k: Any, w_v: Any, w_o: Any,
    b_q: Any = None, b_k: Any = None, b_v: Any = None, b_o: Any = None, num_heads: int,
    num_kv_heads: int | None = None, mask: Any = None, key_padding_mask: Any = None,
    causal: Any = False, scale: Any = None, return_weights: Any = False,
    warn_empty_rows: Any = True,
) -> Any:
    """Reference for :func:`attnlab.multi_head_attention` (float64), one head at a time.

    Parameters
    ----------
    query : array_like, shape (..., n_q, d_q)
    key : array_like, shape (..., n_k, d_k), optional
        Defaults to ``query``.
    value : array_like, shape (..., n_k, d_v), optional
        Defaults to ``key``.
    w_q : array_like, shape (d_q, h * d_head)
    w_k : array_like, shape (d_k, h_kv * d_head)
    w_v : array_like, shape (d_v, h_kv * d_vhead)
    w_o : array_like, shape (h * d_vhead, d_out)
        ``(in, out)`` weights: ``y = x @ W + b``.
    b_q, b_k, b_v, b_o : array_like, optional
        Biases of the matching widths.
    num_heads : int
    num_kv_heads : int, optional
        Defaults to ``num_heads``.
    mask, key_padding_mask, causal, scale, return_weights, warn_empty_rows
        As for :func:`attnlab.multi_head_attention` (``scale`` defaults to
        ``1 / sqrt(d_head)``).

    Returns
    -------
    out : ndarray, shape (..., n_q, d_out)
        float64.
    weights : ndarray, shape (..., h, n_q, n_k) or (..., n_q, n_k)
        Only with ``return_weights`` (``"mean"`` averages over heads).

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab import reference
    >>> rng = np.random.default_rng(0)
    >>> w = [rng.standard_normal((16, 16)) / 4 for _ in range(4)]
    >>> x = rng.standard_normal((2, 5, 16))
    >>> reference.multi_head_attention(x, w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3],
    ...                                num_heads=4).shape
    (2, 5, 16)
    """
    xq = _f64(query)
    xk = xq if key is None else _f64(key)
    xv = xk if value is None else _f64(value)
    h = num_heads
    h_kv = h if num_kv_heads is None else num_kv_heads
    w_q, w_k, w_v, w_o = _f64(w_q), _f64(w_k), _f64(w_v), _f64(w_o)
    d_head = w_q.shape[1] // h
    d_vhead = w_v.shape[1] // h_kv
    Q = xq @ w_q + (0.0 if b_q is None else _f64(b_q))
    K = xk @ w_k + (0.0 if b_k is None else _f64(b_k))
    Vv = xv @ w_v + (0.0 if b_v is None else _f64(b_v))
    s = (1.0 / math.sqrt(d_head)) if scale is None else float(scale)
    n_q, n_k = xq.shape[-2], xk.shape[-2]
    batch = np.broadcast_shapes(xq.shape[:-2], xk.shape[:-2], xv.shape[:-2])
    allowed, bias = allowed_and_bias(n_q, n_k, mask, key_padding_mask, causal)
    allowed = np.broadcast_to(allowed, batch + (h, n_q, n_k))
    warn_if_empty(allowed, n_q, n_k, causal, warn_empty_rows)
    bias = np.broadcast_to(bias, batch + (h, n_q, n_k))
    contexts, weights = [], []
    for i in range(h):
        j = i // (h // h_kv)  # the kv head this query head reads
        q_i = Q[..., i * d_head:(i + 1) * d_head]
        k_i = K[..., j * d_head:(j + 1) * d_head]
        v_i = Vv[..., j * d_vhead:(j + 1) * d_vhead]
        scores = s * (q_i @ np.swapaxes(k_i, -1, -2))
        scores = scores + bias[..., i, :, :]
        p = _softmax_rows(scores, np.broadcast_to(allowed[..., i, :, :], scores.shape))
        contexts.append(_context(p, v_i, allowed[..., i, :, :]))
        weights.append(p)
    ctx = np.concatenate(contexts, axis=-1)
    out = ctx @ w_o + (0.0 if b_o is None else _f64(b_o))
    if return_weights in (False, None):
        return out
    w = np.stack(weights, axis=-3)
    return out, (w.mean(axis=-3) if return_weights == "mean" else w)
