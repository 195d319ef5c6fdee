"""Diagnostics of attention: entropy of the weights, statistics of the logits, effective rank,
and the size of the softmax Jacobian.

Pure NumPy, for notebooks and tests. Inputs follow attnlab's conventions (docs/architecture.md,
section 3): any array-like of real numbers, float32 and float64 kept (other real dtypes become
float64), boolean masks mean *may attend*, and bad input raises ``ValueError``/``TypeError``
naming the argument. Rows with no allowed key give 0 (entropy, Jacobian norm), never NaN.

>>> import numpy as np
>>> from attnlab import diagnostics
>>> uniform = np.full((3, 8), 1 / 8)
>>> bool(np.allclose(diagnostics.attention_entropy(uniform), np.log(8)))
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _validate as V
from .interop._common import _flag, _mask_array

__all__ = [
    "attention_entropy",
    "effective_rank",
    "logit_stats",
    "softmax_jacobian_norm",
]


def _bool_mask(mask: Any, shape: tuple[int, ...], layout: str) -> np.ndarray | None:
    """``mask`` (True = may attend; an array or a torch tensor) broadcast to ``shape``; None
    stays None."""
    if mask is None:
        return None
    m = _mask_array(mask, "mask", "a bool array (True = may attend)", "b")
    return _broadcast_mask(m, shape, layout)


def _broadcast_mask(m: np.ndarray, shape: tuple[int, ...], layout: str) -> np.ndarray:
    try:
        return np.broadcast_to(m, shape)
    except ValueError:
        raise ValueError(
            f"mask: shape {V.shape_str(m.shape)} does not broadcast to {layout} = "
            f"{V.shape_str(shape)}"
        ) from None


def attention_entropy(weights: Any, mask: Any = None, *, normalize: bool = False) -> np.ndarray:
    """Shannon entropy (in nats) of each row of attention weights.

    ``H = -sum_j p_j log p_j`` over the allowed keys ``j`` of a row, with ``0 log 0 = 0``. Each
    row is first divided by its sum over the allowed keys (weights from attnlab already sum to
    1; this only removes rounding), so masked keys are ignored whatever they hold. ``H`` is 0
    for a one-hot row and ``log m`` for a uniform row over ``m`` allowed keys.

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Non-negative attention weights, e.g. ``multi_head_attention(..., return_weights=True)``
        (shape ``(..., h, n_q, n_k)``). Only the last axis is a distribution; any leading axes
        (batch, heads, queries) are kept.
    mask : array_like of bool, optional
        Broadcasts to ``weights.shape``; ``True`` means *may attend*. Keys that are False are
        left out, and they do not count in ``m`` below.
    normalize : bool
        Divide by ``log m``, ``m`` the number of allowed keys of the row, so a uniform row gives
        1 and a one-hot row 0. Rows with ``m <= 1`` give 0.

    Returns
    -------
    ndarray, shape weights.shape[:-1]
        float64 unless ``weights`` is float32. Rows with no allowed key, or whose weights sum to
        0, give 0. NaN in a row gives NaN.

    Raises
    ------
    ValueError
        If ``weights`` has fewer than one axis, holds negative values at allowed keys, or
        ``mask`` does not broadcast.
    TypeError
        For non-real ``weights`` or a non-bool ``mask``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.diagnostics import attention_entropy
    >>> w = np.array([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
    >>> np.round(attention_entropy(w), 6)
    array([1.386294, 0.      ])
    >>> attention_entropy(w, normalize=True)
    array([1., 0.])
    >>> attention_entropy([[0.5, 0.5, 0.0]], mask=[True, True, False], normalize=True)
    array([1.])
    >>> attention_entropy([[0.5, -1.0, 0.5]], mask=[True, False, True], normalize=True)
    array([1.])
    """
    w = V.as_array(weights, "weights")
    V.check_ndim(w, "weights", 1, "(..., n_k)")
    norm = _flag(normalize, "normalize")
    out_dtype = w.dtype
    p = w.astype(np.float64)
    m = _bool_mask(mask, p.shape, "weights.shape")
    if m is not None:
        p = np.where(m, p, 0.0)  # masked keys are ignored, whatever they hold (even < 0)
    if np.any(p < 0):  # NaN compares False: it propagates instead
        raise ValueError(
            f"weights: expected non-negative attention weights at the allowed keys, got a "
            f"minimum of {float(np.nanmin(p)):.6g}"
        )
    total = p.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
        p = np.where(np.isnan(total), np.nan, p)
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        plogp = np.where(np.isnan(p), np.nan, plogp)
    h = -plogp.sum(axis=-1)
    h = np.maximum(h, 0.0)  # -0.0 and tiny negative rounding of one-hot rows
    if norm:
        allowed = (
            np.full(p.shape[:-1], p.shape[-1], dtype=np.float64)
            if m is None
            else m.sum(axis=-1).astype(np.float64)
        )
        logm = np.log(np.maximum(allowed, 1.0))
        with np.errstate(invalid="ignore", divide="ignore"):
            h = np.where(
                logm > 0, h / np.where(logm > 0, logm, 1.0), np.where(np.isnan(h), np.nan, 0.0)
            )
    return np.asarray(h, dtype=out_dtype)


def logit_stats(
    q: Any, k: Any, *, scale: float | None = None, mask: Any = None
) -> dict[str, float]:
    """Statistics of the attention logits ``scale * q k^T``.

    Parameters
    ----------
    q : array_like, shape (..., n_q, d)
        Queries, e.g. one head's ``x w_q[:, i*d_head:(i+1)*d_head] + b_q[...]``, or all heads
        as ``(..., h, n_q, d)``.
    k : array_like, shape (..., n_k, d)
        Keys; the leading axes broadcast against ``q``'s.
    scale : float, optional
        Defaults to ``1 / sqrt(d)`` (as attention's).
    mask : array_like of bool, optional
        Broadcasts to the logits ``(..., n_q, n_k)``; only logits where it is True are counted.

    Returns
    -------
    dict of float
        ``"mean"``, ``"std"`` (over all counted logits), ``"max_abs"``, ``"row_std"`` (the root
        mean square over query rows of the standard deviation within a row: the spread the
        softmax sees, since adding a constant to a row does not change it) and ``"count"``.
        With no counted logit every statistic is NaN and ``count`` 0.

    Raises
    ------
    ValueError
        If ``q`` or ``k`` has fewer than two axes, their feature sizes differ, the leading axes
        do not broadcast, or ``mask`` does not broadcast.
    TypeError
        For non-real ``q``/``k``, a non-numeric ``scale`` or a non-bool ``mask``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.diagnostics import logit_stats
    >>> q = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> s = logit_stats(q, q, scale=1.0)      # logits = identity matrix
    >>> s["mean"], s["max_abs"], s["count"]
    (0.5, 1.0, 4.0)
    """
    qa = V.as_array(q, "q")
    ka = V.as_array(k, "k")
    V.check_ndim(qa, "q", 2, "(..., n_q, d)")
    V.check_ndim(ka, "k", 2, "(..., n_k, d)")
    d = qa.shape[-1]
    if ka.shape[-1] != d:
        raise ValueError(
            f"k: expected the feature size of q ({d}), got shape {V.shape_str(ka.shape)}"
        )
    V.batch_shape([("q", qa.shape[:-2]), ("k", ka.shape[:-2])])
    s = V.check_scale(scale, 1.0 / np.sqrt(d) if d else 1.0)
    logits = s * np.matmul(qa.astype(np.float64), np.swapaxes(ka.astype(np.float64), -1, -2))
    m = _bool_mask(mask, logits.shape, "the logits (..., n_q, n_k)")
    if m is None:
        m = np.ones(logits.shape, dtype=bool)
    count = int(m.sum())
    nan = float("nan")
    if count == 0:
        return {"mean": nan, "std": nan, "max_abs": nan, "row_std": nan, "count": 0.0}
    vals = logits[m]
    rows = m.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        row_mean = np.where(m, logits, 0.0).sum(axis=-1) / rows
        row_var = np.where(m, (logits - row_mean[..., None]) ** 2, 0.0).sum(axis=-1) / rows
    row_var = row_var[rows > 0]
    return {
        "mean": float(vals.mean()),
        "std": float(vals.std()),
        "max_abs": float(np.abs(vals).max()),
        "row_std": float(np.sqrt(row_var.mean())),
        "count": float(count),
    }


def effective_rank(matrix: Any) -> np.ndarray | float:
    """Effective rank (Roy and Vetterli, 2007): ``exp`` of the entropy of the normalised
    singular values.

    With singular values ``sigma_i`` and ``p_i = sigma_i / sum_j sigma_j``,
    ``erank = exp(-sum_i p_i log p_i)``. It lies in ``[1, rank]``: it equals the rank when the
    non-zero singular values are equal and approaches 1 when one dominates.

    Parameters
    ----------
    matrix : array_like, shape (..., m, n)
        A matrix or a stack of them (e.g. attention weights ``(..., h, n_q, n_k)``, or a folded
        ``W_i`` stack ``(h, d_q, d_k)``).

    Returns
    -------
    float or ndarray, shape matrix.shape[:-2]
        A Python float for a single matrix. The zero matrix (and an empty one) gives 0.

    Raises
    ------
    ValueError
        If ``matrix`` has fewer than two axes or holds NaN or Inf (the SVD is undefined).
    TypeError
        For non-real data.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.diagnostics import effective_rank
    >>> round(effective_rank(np.diag([1.0, 1.0, 1.0, 0.0])), 12)
    3.0
    >>> round(effective_rank(np.outer([1.0, 2.0], [3.0, 4.0, 5.0])), 12)   # rank 1
    1.0
    """
    a = V.as_array(matrix, "matrix")
    V.check_ndim(a, "matrix", 2, "(..., m, n)")
    if not np.all(np.isfinite(a)):
        raise ValueError("matrix: expected finite values (the SVD of NaN or Inf is undefined)")
    a = a.astype(np.float64)
    if a.shape[-1] == 0 or a.shape[-2] == 0:
        r = np.zeros(a.shape[:-2])
    else:
        sv = np.linalg.svd(a, compute_uv=False)
        total = sv.sum(axis=-1, keepdims=True)
        p = np.where(total > 0, sv / np.where(total > 0, total, 1.0), 0.0)
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        r = np.where(total[..., 0] > 0, np.exp(-plogp.sum(axis=-1)), 0.0)
    return float(r) if r.ndim == 0 else r


def _softmax(z: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Row softmax over ``allowed`` entries; rows with nothing allowed (or all -inf) give 0."""
    z = np.where(allowed, z, -np.inf)
    mx = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(allowed & (z != -np.inf), np.exp(z - mx), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    return np.where(np.isnan(total), np.nan, p)


def softmax_jacobian_norm(logits: Any, mask: Any = None, *, ord: str = "fro") -> np.ndarray:
    """Norm of the Jacobian of the softmax of each row of logits.

    For ``p = softmax(z)`` the Jacobian is ``J = diag(p) - p p^T`` (symmetric, positive
    semi-definite, rows summing to 0): the factor by which a gradient on the weights reaches
    the logits, and through them ``Q`` and ``K``. A uniform row over ``m`` keys gives
    ``||J||_2 = 1/m`` and ``||J||_F = sqrt(m - 1)/m``; a saturated (one-hot) row gives 0.

    Parameters
    ----------
    logits : array_like, shape (..., n_k)
        Scaled attention scores, one softmax per row (the last axis). ``-inf`` entries get
        weight 0.
    mask : array_like of bool or float, optional
        Broadcasts to ``logits.shape``. Boolean ``True`` means *may attend*; a float mask is
        added to the logits (as attention's).
    ord : {"fro", 2}
        ``"fro"``: Frobenius norm, from the closed form
        ``||J||_F^2 = sum p^2 - 2 sum p^3 + (sum p^2)^2``, evaluated without cancellation: a
        nearly saturated row with ``p_max = 1 - eps`` gets ``||J||_F ~ eps sqrt(1 + 3 sum_j
        p_j^2 / eps^2)`` over the other keys ``j`` (``2 eps`` with two keys,
        ``eps sqrt(1 + 3 / (m - 1))`` with the rest spread evenly over ``m - 1`` keys: 1.58 eps
        for 3 keys, 1.15 eps for 10), not rounding noise. ``2``: spectral norm (the largest
        eigenvalue of ``J``), computed with ``numpy.linalg.eigvalsh`` per row (``n_k x n_k``
        each: use it on modest sizes).

    Returns
    -------
    ndarray, shape logits.shape[:-1]
        float64 unless ``logits`` is float32. Rows with no allowed key give 0. Large logits
        (1e4) are handled stably (the row maximum is subtracted).

    Raises
    ------
    ValueError
        If ``logits`` has no axis, ``ord`` is not "fro" or 2, or ``mask`` does not broadcast.
    TypeError
        For non-real ``logits`` or a mask that is neither bool nor float.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.diagnostics import softmax_jacobian_norm
    >>> z = np.zeros(4)                       # uniform over 4 keys
    >>> float(softmax_jacobian_norm(z)), float(softmax_jacobian_norm(z, ord=2))
    (0.4330127018922193, 0.25)
    >>> # saturated: p = (1 - 2 d, d, d) with d ~ e^-100, so ||J||_F ~ sqrt(10) d
    >>> f"{float(softmax_jacobian_norm([100.0, 0.0, 0.0])):.4g}"
    '1.176e-43'
    """
    z = V.as_array(logits, "logits")
    V.check_ndim(z, "logits", 1, "(..., n_k)")
    if isinstance(ord, str) and ord == "fro":
        spectral = False
    elif not isinstance(ord, (bool, np.bool_)) and isinstance(ord, (int, np.integer)) and ord == 2:
        spectral = True
    else:
        raise ValueError(f"ord: expected 'fro' or 2, got {ord!r}")
    out_dtype = z.dtype
    zf = z.astype(np.float64)
    allowed = np.ones(zf.shape, dtype=bool)
    if mask is not None:
        m = _mask_array(mask, "mask", "a bool or floating-point array")
        if m.dtype.kind == "b":
            allowed = _broadcast_mask(m, zf.shape, "logits.shape")
        else:
            zf = zf + _broadcast_mask(m.astype(np.float64), zf.shape, "logits.shape")
    if zf.shape[-1] == 0:  # no key: nothing to differentiate
        return np.zeros(zf.shape[:-1], dtype=out_dtype)
    p = _softmax(zf, allowed)
    # 1 - p_i without cancellation: for the largest weight of a row it is the sum of the others
    # (a saturated row has p_max = 1 - eps, and ||J|| ~ eps..2 eps must not drown in rounding)
    top = np.argmax(np.where(np.isnan(p), -1.0, p), axis=-1)[..., None]
    is_top = np.arange(p.shape[-1]) == top
    others = np.where(is_top, 0.0, p)
    rest = others.sum(axis=-1, keepdims=True)  # sum of the non-top weights
    one_minus = np.where(is_top, rest, 1.0 - p)
    if spectral:
        n = p.shape[-1]
        flat_p = p.reshape(-1, n)
        flat_c = one_minus.reshape(-1, n)
        res = np.zeros(flat_p.shape[0])
        for i in range(flat_p.shape[0]):
            row = flat_p[i]
            if np.isnan(row).any():
                res[i] = np.nan
            else:
                jac = -np.outer(row, row)
                jac[np.diag_indices(n)] = row * flat_c[i]
                res[i] = max(float(np.linalg.eigvalsh(jac)[-1]), 0.0)
        out = res.reshape(p.shape[:-1])
    else:
        # ||J||_F^2 = sum_i p_i^2 (1 - p_i)^2 + sum_{i != j} p_i^2 p_j^2, the pair sum split
        # into pairs with the top weight k and pairs among the others (no cancellation):
        # sum_{i != j} r_i r_j = 2 r_k S' + S'^2 - sum_{j != k} r_j^2,
        # with r = p^2 and S' = sum_{j != k} r_j
        diag = np.sum((p * one_minus) ** 2, axis=-1)
        r_top = np.sum(np.where(is_top, p * p, 0.0), axis=-1)
        r_others = others * others
        s_others = r_others.sum(axis=-1)
        pairs = 2.0 * r_top * s_others + s_others * s_others - np.sum(r_others * r_others, axis=-1)
        out = np.sqrt(np.maximum(diag + pairs, 0.0))
        out = np.where(np.isnan(p).any(axis=-1), np.nan, out)
    return np.asarray(out, dtype=out_dtype)
