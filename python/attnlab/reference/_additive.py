"""Plain NumPy float64 efficient additive attention (SwiftFormer) and separable self-attention
(MobileViT-v2): the oracle for the tests.

Written to read like the papers' equations and the official PyTorch modules, line by line:
materialises ``G * K`` and every intermediate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _docs
from .._validate import POOLED_ROWS, warn_empty
from ._mha import _bias, _f64

__all__ = ["additive_attention", "separable_attention"]


def _normalize(v: np.ndarray, axis: int, eps: float) -> np.ndarray:
    """``v / max(||v||_2, eps)`` along ``axis``, as ``torch.nn.functional.normalize``."""
    norm = np.sqrt(np.sum(v * v, axis=axis, keepdims=True))
    return v / np.maximum(norm, eps)


def _real_tokens(key_padding_mask: Any, batch: tuple[int, ...], n: int, warn: Any) -> np.ndarray:
    """(..., n, 1) boolean, True for tokens that take part in the pooling; with ``warn``,
    attnlab's warning for the sequences (n > 0) that have none."""
    if key_padding_mask is None:
        return np.ones(batch + (n, 1), dtype=bool)
    kp = np.broadcast_to(np.asarray(key_padding_mask, dtype=bool), batch + (n,))
    if warn and n:
        warn_empty(int(np.sum(~kp.any(axis=-1))), int(np.prod(batch)), POOLED_ROWS)
    return kp[..., None]


@_docs.filled
def additive_attention(
    x: Any,
    *,
    w_q: Any,
    b_q: Any = None,
    w_k: Any,
    b_k: Any = None,
    w_g: Any,
    w_proj: Any,
    b_proj: Any = None,
    w_final: Any,
    b_final: Any = None,
    scale: float | None = None,
    variant: str = "official",
    eps: float = 1e-12,
    key_padding_mask: Any = None,
    warn_empty_rows: Any = True,
) -> np.ndarray:
    """Reference for :func:`attnlab.additive_attention` (float64): SwiftFormer's efficient
    additive attention.

    Parameters
    ----------
    x : array_like, shape (..., n, d_in)
    w_q, w_k : array_like, shape (d_in, D)
    b_q, b_k : array_like, shape (D,), optional
    w_g : array_like, shape (D,) or (D, 1)
    w_proj : array_like, shape (D, D)
    b_proj : array_like, shape (D,), optional
    w_final : array_like, shape (D, d_out)
    b_final : array_like, shape (d_out,), optional
    scale : float, optional
        Defaults to ``d_out ** -0.5``.
    variant : {"official", "hf"}
    eps : float
        Floor of the L2 norms (as ``torch.nn.functional.normalize``).
    key_padding_mask : array_like of bool, shape (..., n), optional
        ``True`` for real tokens; the others are left out of the pooling.
    warn_empty_rows : bool
        As for :func:`attnlab.additive_attention`.

    {reference_pooled_returns}

    {reference_examples}
    >>> w = {k: rng.standard_normal((8, 8)) / 3 for k in ("w_q", "w_k", "w_proj", "w_final")}
    >>> reference.additive_attention(rng.standard_normal((2, 49, 8)), w_g=np.ones((8, 1)),
    ...                              **w).shape
    (2, 49, 8)
    """
    x = _f64(x)
    w_final = _f64(w_final)
    n = x.shape[-2]
    query = x @ _f64(w_q) + _bias(b_q)
    key = x @ _f64(w_k) + _bias(b_k)
    query = _normalize(query, -1, eps)  # (..., n, D)
    key = _normalize(key, -1, eps)
    real = _real_tokens(key_padding_mask, x.shape[:-2], n, warn_empty_rows)  # (..., n, 1)
    if variant == "official":
        s = scale if scale is not None else w_final.shape[1] ** -0.5
        a = (query @ _f64(w_g).reshape(-1, 1)) * s  # (..., n, 1)
        a = np.where(real, a, 0.0)  # padded tokens are left out of the norm
        a = _normalize(a, -2, eps)  # L2 over the tokens, not a softmax
    elif variant == "hf":
        a = np.ones(query.shape[:-1] + (1,))  # softmax over a singleton axis
    else:
        raise ValueError(f"variant: expected 'official' or 'hf', got {variant!r}")
    G = np.sum(np.where(real, a * query, 0.0), axis=-2, keepdims=True)  # (..., 1, D)
    out = (G * key) @ _f64(w_proj) + _bias(b_proj) + query
    return out @ w_final + _bias(b_final)


@_docs.filled
def separable_attention(
    x: Any,
    *,
    w_qkv: Any,
    b_qkv: Any = None,
    w_o: Any,
    b_o: Any = None,
    key_padding_mask: Any = None,
    warn_empty_rows: Any = True,
) -> np.ndarray:
    """Reference for :func:`attnlab.separable_attention` (float64): MobileViT-v2's separable
    self-attention.

    Parameters
    ----------
    x : array_like, shape (..., n, d)
    w_qkv : array_like, shape (d, 1 + 2 d)
        Context-score, key and value projections side by side.
    b_qkv : array_like, shape (1 + 2 d,), optional
    w_o : array_like, shape (d, d_out)
    b_o : array_like, shape (d_out,), optional
    key_padding_mask : array_like of bool, shape (..., n), optional
        ``True`` for real tokens; the others get no context score.
    warn_empty_rows : bool
        As for :func:`attnlab.separable_attention`.

    {reference_pooled_returns}

    {reference_examples}
    >>> x = rng.standard_normal((2, 16, 8))
    >>> reference.separable_attention(x, w_qkv=rng.standard_normal((8, 17)),
    ...                               w_o=rng.standard_normal((8, 4))).shape
    (2, 16, 4)
    """
    x = _f64(x)
    d = x.shape[-1]
    n = x.shape[-2]
    qkv = x @ _f64(w_qkv) + _bias(b_qkv)
    s, k, v = qkv[..., :1], qkv[..., 1 : 1 + d], qkv[..., 1 + d :]
    real = _real_tokens(key_padding_mask, x.shape[:-2], n, warn_empty_rows)  # (..., n, 1)
    s = np.where(real, s, -np.inf)
    m = np.max(s, axis=-2, keepdims=True, initial=-np.inf)  # initial: n may be 0
    m = np.where(np.isneginf(m), 0.0, m)  # no real token (or all -inf): avoid -inf - -inf
    e = np.where(real, np.exp(s - m), 0.0)
    z = np.sum(e, axis=-2, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
    c = np.where(np.isnan(z), np.nan, c)
    ctx = np.sum(np.where(real, c * k, 0.0), axis=-2, keepdims=True)  # (..., 1, d)
    return (np.maximum(v, 0.0) * ctx) @ _f64(w_o) + _bias(b_o)
