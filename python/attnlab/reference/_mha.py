"""Plain NumPy float64 scaled dot-product and multi-head attention: the oracle for the tests.

Written for clarity, not speed: one head at a time, the full score matrix, an explicit softmax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _mha as _public
from .. import _signature as _sig
from .._validate import ATTENTION_ROWS, warn_empty

__all__ = ["scaled_dot_product_attention", "multi_head_attention", "allowed_and_bias"]


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest bfloat16 (ties to even) via float32, subnormals to zero:
    the rounding of attnlab's ``precision="bf16"``, in float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    flushed = (u & 0x7F800000) == 0
    rounded = np.where(flushed, (u & 0x80000000).astype(np.uint32), rounded)
    return rounded.view(np.float32).astype(np.float64)


def _bias(b: Any) -> np.ndarray | float:
    """An optional bias in float64; absent, 0.0 (adding it changes nothing)."""
    return 0.0 if b is None else _f64(b)


def _qkv(query: Any, key: Any, value: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``query``, ``key``, ``value`` in float64, ``key`` defaulting to ``query`` and ``value``
    to ``key``."""
    xq = _f64(query)
    xk = xq if key is None else _f64(key)
    xv = xk if value is None else _f64(value)
    return xq, xk, xv


def _heads(num_heads: int, num_kv_heads: int | None) -> tuple[int, int]:
    """``(h, h_kv)``: the kv heads default to one per query head."""
    return num_heads, num_heads if num_kv_heads is None else num_kv_heads


def _scale(args: Mapping[str, Any], d_head: float) -> float:
    """The call's ``scale``, by default ``1 / sqrt(d_head)``."""
    scale = args["scale"]
    return 1.0 / math.sqrt(d_head) if scale is None else float(scale)


def _with_weights(out: np.ndarray, p: np.ndarray, args: Mapping[str, Any], lse: Any) -> Any:
    """``out``, then the per-head weights ``p (..., h, n_q, n_k)`` (or, for ``"mean"``, their
    mean over the heads) with ``return_weights``, then the log-sum-exp with ``return_lse``."""
    result = [out]
    if args["return_weights"] not in (False, None):
        result.append(p.mean(axis=-3) if args["return_weights"] == "mean" else p)
    if args["return_lse"]:
        result.append(lse)
    return result[0] if len(result) == 1 else tuple(result)


def attention_weights(
    args: Mapping[str, Any], scores: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """From the scaled scores ``(..., h, n_q, n_k)`` of a call to its final logits (soft cap,
    then the float mask and ALiBi added), which pairs may attend, the weights (a softmax over
    the allowed keys and the sink) and the log-sum-exp of each row: the one place the
    reference's SDPA, multi-head and bilinear bodies read the options of the logits."""
    n_q, n_k = scores.shape[-2:]
    cap = args["softcap"]
    if cap is not None:
        scores = cap * np.tanh(scores / cap)
    allowed, bias = call_masks(args, scores.shape)
    logits = add_mask(scores, bias)
    if args["alibi_slopes"] is not None:
        offset = n_k - n_q if args["causal"] == "bottom_right" else 0
        dist = np.abs(np.arange(n_q)[:, None] + offset - np.arange(n_k)[None, :])
        logits = logits - _f64(args["alibi_slopes"])[..., :, None, None] * dist
    sinks = None if args["sinks"] is None else _f64(args["sinks"])[..., :, None, None]
    p, lse = _softmax_rows(logits, np.broadcast_to(allowed, logits.shape), sinks)
    return logits, np.broadcast_to(allowed, logits.shape), p, lse


def allowed_and_bias(
    n_q: int,
    n_k: int,
    mask: Any = None,
    key_padding_mask: Any = None,
    causal: Any = False,
    window: Any = None,
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
    window : (int or None, int or None), optional
        Keys ``p(i) - left <= j <= p(i) + right`` around the key ``p(i)`` query ``i`` is
        aligned with (as ``causal`` aligns it).

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
    allowed: np.ndarray = np.ones((n_q, n_k), dtype=bool)
    bias: np.ndarray = np.zeros((), dtype=np.float64)
    offset = n_k - n_q if causal == "bottom_right" else 0
    p = np.arange(n_q)[:, None] + offset  # the key each query is aligned with
    j = np.arange(n_k)[None, :]
    if causal in (True, "top_left", "bottom_right"):
        allowed = allowed & (j <= p)
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (j >= p - left)
        if right is not None:
            allowed = allowed & (j <= p + right)
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


def warn_if_empty(
    allowed: np.ndarray, n_q: int, n_k: int, causal: Any, warn: Any, window: Any = None
) -> None:
    """attnlab's warning for query rows the boolean masks leave without a key (``allowed``,
    broadcast to ``(..., h, n_q, n_k)``), among those ``causal`` and ``window`` alone leave
    some key; counted here the plain way, as a check on the kernels' wrapper."""
    if not warn:
        return
    live = allowed_and_bias(n_q, n_k, causal=causal, window=window)[0].any(axis=-1)
    empty = int(np.sum(~allowed.any(axis=-1) & live))
    warn_empty(empty, int(np.prod(allowed.shape[:-1])), ATTENTION_ROWS)


def call_masks(args: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The mask arguments of a call (``mask``, ``key_padding_mask`` where the family has it,
    ``causal``) for scores of ``shape`` ``(..., h, n_q, n_k)``: ``allowed``, broadcast to that
    shape and the float mask's, and the float mask; with attnlab's warning for query rows left
    without a key unless ``warn_empty_rows=False``. The one place the reference's attention
    functions read the mask options."""
    n_q, n_k = shape[-2:]
    causal, window = args["causal"], args["window"]
    allowed, bias = allowed_and_bias(
        n_q, n_k, args["mask"], args.get("key_padding_mask"), causal, window
    )
    allowed = np.broadcast_to(allowed, np.broadcast_shapes(shape, bias.shape))
    warn_if_empty(allowed, n_q, n_k, causal, args["warn_empty_rows"], window)
    return allowed, bias


def add_mask(scores: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``scores + bias``, where a -inf in the float mask masks the key out even when its score
    is NaN (the kernels' rule: a masked-out key is never read)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(bias), -np.inf, scores + bias)


def _softmax_rows(
    scores: np.ndarray, allowed: np.ndarray, sinks: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the last axis among allowed entries, with ``sinks`` (``(..., h, 1, 1)``
    logits with no value) in the denominator; rows with none allowed give zeros. Also the
    log-sum-exp of each row (``-inf`` for a row with no key and no sink)."""
    s = np.where(allowed, scores, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # initial: n_k may be 0
    if sinks is not None:
        row_max = np.maximum(row_max, sinks)
    finite_max = np.where(np.isneginf(row_max), 0.0, row_max)
    with np.errstate(invalid="ignore"):  # an infinite logit makes its row NaN, as it should
        e = np.where(allowed, np.exp(s - finite_max), 0.0)
    e = np.where(np.isneginf(s), 0.0, e)  # -inf from a float mask
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks - finite_max)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
        lse = np.where(total > 0, finite_max + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    # NaN anywhere in a row's inputs makes that row NaN (propagation, not masking)
    nan_rows = np.isnan(total)
    return np.where(nan_rows, np.nan, p), np.where(nan_rows, np.nan, lse)[..., 0]


def _context(p: np.ndarray, v: np.ndarray, reads: np.ndarray) -> np.ndarray:
    """``p @ v`` over the keys each query reads: ``reads`` = may attend and a masked logit
    above -inf. A key not read contributes nothing, not 0 * NaN, even when its value row holds
    NaN or Inf; rows that read no key are exactly 0 (the kernels' rule, on every path)."""
    reads = np.broadcast_to(reads, p.shape)
    bad = ~np.isfinite(v).all(axis=-1)  # (..., n_k): value rows with NaN/Inf
    out = p @ np.where(bad[..., None], 0.0, v)
    flagged = bad.any(axis=tuple(range(bad.ndim - 1))) if bad.ndim > 1 else bad
    for j in np.nonzero(flagged)[0]:
        take = reads[..., :, j, None] & bad[..., j, None, None]
        with np.errstate(invalid="ignore"):
            out = out + np.where(take, p[..., :, j, None] * v[..., j, None, :], 0.0)
    return np.where(np.any(reads, axis=-1, keepdims=True), out, 0.0)


_Tables = tuple[np.ndarray, np.ndarray]  # cos, sin


def _rope_tables(inv_freq: np.ndarray, scale: float, pos: np.ndarray) -> _Tables:
    """``scale`` times cos and sin ``(..., n, r)`` of transformers' ``emb = cat(freqs,
    freqs)``."""
    freqs = pos[..., None] * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)
    return scale * np.cos(emb), scale * np.sin(emb)


def _rms_norm(x: np.ndarray, w: Any, eps: Any) -> np.ndarray:
    """``x * (mean(x**2) + eps) ** -0.5 * w`` over the last axis (q_norm, k_norm)."""
    e = 1e-6 if eps is None else float(eps)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + e) * _f64(w)


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` on the first ``r`` features; the rest unchanged."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = np.concatenate([-rot[..., r // 2 :], rot[..., : r // 2]], axis=-1)  # rotate_half
    return np.concatenate([rot * cos + half * sin, rest], axis=-1)


def _rope(
    args: Mapping[str, Any], n_q: int, n_k: int, d_head: int
) -> tuple[_Tables, _Tables] | None:
    """The cos and sin tables (:func:`_rope_tables`) of the query and of the key positions, or
    ``None`` without ``rope_theta`` and ``rope_inv_freq``."""
    theta, inv_freq = args["rope_theta"], args["rope_inv_freq"]
    if theta is None and inv_freq is None:
        return None
    if inv_freq is None:
        r = d_head if args["rope_dim"] is None else int(args["rope_dim"])
        inv_freq = 1.0 / float(theta) ** (np.arange(0, r, 2, dtype=np.float64) / r)
    inv_freq = _f64(inv_freq)
    scale = 1.0 if args["rope_scale"] is None else float(args["rope_scale"])
    offset = n_k - n_q if args["causal"] == "bottom_right" else 0
    positions = args["positions"]
    if isinstance(positions, tuple):
        pos_q, pos_k = _f64(positions[0]), _f64(positions[1])
    elif positions is None:
        pos_q, pos_k = np.arange(n_q) + float(offset), np.arange(n_k, dtype=np.float64)
    else:
        pos_k = _f64(positions)
        pos_q = pos_k[..., offset : offset + n_q]
    return _rope_tables(inv_freq, scale, pos_q), _rope_tables(inv_freq, scale, pos_k)


@_sig.reference_of(_public.scaled_dot_product_attention)
def scaled_dot_product_attention(args: dict[str, Any]) -> Any:
    """Reference for :func:`attnlab.scaled_dot_product_attention` (float64): the full score
    matrix of every head, grouped-query heads by repeating the kv heads.

    {parameters}

    Returns
    -------
    out : ndarray, shape (..., h, n_q, d_v)
        float64. Rows with every key masked are zeros.
    weights : ndarray, shape (..., h, n_q, n_k) or (..., n_q, n_k)
        Only with ``return_weights`` (``"mean"`` averages over heads).

    {reference_examples}
    >>> q = rng.standard_normal((2, 4, 5, 8))
    >>> out, w = reference.scaled_dot_product_attention(q, q, q, causal=True,
    ...                                                 return_weights=True)
    >>> out.shape, w.shape, bool(np.allclose(w.sum(-1), 1))
    ((2, 4, 5, 8), (2, 4, 5, 5), True)
    """
    q, k, v = _f64(args["q"]), _f64(args["k"]), _f64(args["v"])
    if args["precision"] == "bf16":  # the operands rounded (the products are exact here)
        q, k, v = _bf16(q), _bf16(k), _bf16(v)
    h, d = q.shape[-3], q.shape[-1]
    h_kv = k.shape[-3]
    group = h // h_kv
    # grouped-query: query head j reads kv head j // group
    k = np.repeat(k, group, axis=-3)
    v = np.repeat(v, group, axis=-3)
    scores = _scale(args, d) * (q @ np.swapaxes(k, -1, -2))
    logits, allowed, p, lse = attention_weights(args, scores)
    out = _context(p, v, allowed & ~np.isneginf(logits))
    return _with_weights(out, p, args, lse)


@_sig.reference_of(_public.multi_head_attention)
def multi_head_attention(args: dict[str, Any]) -> Any:
    """Reference for :func:`attnlab.multi_head_attention` (float64), one head at a time.

    Rotary embeddings are written as in ``transformers``: ``x * cos + rotate_half(x) * sin``
    on the first ``rope_dim`` features of each query and key head, after the heads' RMSNorm
    (``q_norm``, ``k_norm``).

    {parameters}

    {reference_attention_returns}

    {reference_examples}
    >>> w = [rng.standard_normal((16, 16)) / 4 for _ in range(4)]
    >>> x = rng.standard_normal((2, 5, 16))
    >>> reference.multi_head_attention(x, w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3],
    ...                                num_heads=4).shape
    (2, 5, 16)
    """
    xq, xk, xv = _qkv(args["query"], args["key"], args["value"])
    h, h_kv = _heads(args["num_heads"], args["num_kv_heads"])
    w_q, w_k, w_v, w_o = (_f64(args[n]) for n in ("w_q", "w_k", "w_v", "w_o"))
    # precision="bf16": every product's operands rounded to bfloat16 (products exact here); the
    # kernels also round the probabilities, within the bound the tests hold them to
    rnd = _bf16 if args["precision"] == "bf16" else (lambda a: a)
    xq, xk, xv, w_q, w_k, w_v = (rnd(a) for a in (xq, xk, xv, w_q, w_k, w_v))
    d_head = w_q.shape[1] // h
    d_vhead = w_v.shape[1] // h_kv
    Q = xq @ w_q + _bias(args["b_q"])
    K = xk @ w_k + _bias(args["b_k"])
    Vv = xv @ w_v + _bias(args["b_v"])
    s = _scale(args, d_head)
    n_q, n_k = xq.shape[-2], xk.shape[-2]
    batch = np.broadcast_shapes(xq.shape[:-2], xk.shape[:-2], xv.shape[:-2])
    rope = _rope(args, n_q, n_k, d_head)
    scores, values = [], []
    for i in range(h):
        j = i // (h // h_kv)  # the kv head this query head reads
        q_i = Q[..., i * d_head : (i + 1) * d_head]
        k_i = K[..., j * d_head : (j + 1) * d_head]
        if args["q_norm"] is not None:
            q_i = _rms_norm(q_i, args["q_norm"], args["norm_eps"])
        if args["k_norm"] is not None:
            k_i = _rms_norm(k_i, args["k_norm"], args["norm_eps"])
        if rope is not None:
            q_i = _apply_rope(q_i, *rope[0])
            k_i = _apply_rope(k_i, *rope[1])
        q_i, k_i = rnd(q_i), rnd(k_i)  # the attention core's operands
        values.append(rnd(Vv[..., j * d_vhead : (j + 1) * d_vhead]))
        scores.append(s * (q_i @ np.swapaxes(k_i, -1, -2)))
    full = np.broadcast_to(np.stack(scores, axis=-3), batch + (h, n_q, n_k))
    logits, allowed, p, lse = attention_weights(args, full)
    reads = allowed & ~np.isneginf(logits)  # keys each query reads
    contexts = [_context(p[..., i, :, :], values[i], reads[..., i, :, :]) for i in range(h)]
    ctx = np.concatenate(contexts, axis=-1)
    out = rnd(ctx) @ rnd(w_o) + _bias(args["b_o"])
    return _with_weights(out, p, args, lse)
