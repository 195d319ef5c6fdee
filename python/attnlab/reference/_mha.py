"""Plain NumPy float64 scaled dot-product and multi-head attention: the oracle for the tests.

Written for clarity, not speed: one head at a time, the full score matrix, an explicit softmax.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["scaled_dot_product_attention", "multi_head_attention", "allowed_and_bias"]


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def allowed_and_bias(
    n_q: int, n_k: int, mask: Any = None, key_padding_mask: Any = None, causal: Any = False
) -> tuple[np.ndarray, np.ndarray]:
    """Which (query, key) pairs may attend and the float mask to add, before broadcasting.

    Returns ``allowed`` (bool) and ``bias`` (float64) that broadcast against
    ``(..., h, n_q, n_k)``; ``key_padding_mask`` (..., n_k) is placed as (..., 1, 1, n_k).
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


def _softmax_rows(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over the last axis among allowed entries; rows with none allowed give zeros."""
    s = np.where(allowed, scores, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)
    finite_max = np.where(np.isneginf(row_max), 0.0, row_max)
    e = np.where(allowed, np.exp(s - finite_max), 0.0)
    e = np.where(np.isneginf(s), 0.0, e)  # -inf from a float mask
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    # NaN anywhere in a row's inputs makes that row NaN (propagation, not masking)
    nan_rows = np.isnan(total)
    return np.where(nan_rows, np.nan, p)


def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, mask: Any = None, causal: Any = False, scale: Any = None,
    return_weights: Any = False,
) -> Any:
    """Reference for :func:`attnlab.scaled_dot_product_attention` (float64)."""
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
    p = _softmax_rows(scores, allowed)
    out = p @ v
    if return_weights in (False, None):
        return out
    return out, (p.mean(axis=-3) if return_weights == "mean" else p)


def multi_head_attention(
    query: Any, key: Any = None, value: Any = None, *, w_q: Any, w_k: Any, w_v: Any, w_o: Any,
    b_q: Any = None, b_k: Any = None, b_v: Any = None, b_o: Any = None, num_heads: int,
    num_kv_heads: int | None = None, mask: Any = None, key_padding_mask: Any = None,
    causal: Any = False, scale: Any = None, return_weights: Any = False,
) -> Any:
    """Reference for :func:`attnlab.multi_head_attention` (float64), one head at a time."""
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
        contexts.append(p @ v_i)
        weights.append(p)
    ctx = np.concatenate(contexts, axis=-1)
    out = ctx @ w_o + (0.0 if b_o is None else _f64(b_o))
    if return_weights in (False, None):
        return out
    w = np.stack(weights, axis=-3)
    return out, (w.mean(axis=-3) if return_weights == "mean" else w)
