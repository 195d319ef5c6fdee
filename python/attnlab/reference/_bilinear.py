"""Plain NumPy float64 bilinear-collapsed attention: the oracle for the tests.

Written for clarity: one head at a time, loops over heads, the full score matrix. Every matrix
product goes through :func:`_matmul`, so a test can count the multiply-adds of each form (the
cost model in :mod:`attnlab.cost` is checked against those counts).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _bilinear as _public
from .. import _docs
from .. import _signature as _sig
from .._bilinear import BilinearQK
from ._mha import (
    _bf16,
    _bias,
    _context,
    _f64,
    _heads,
    _qkv,
    _scale,
    _with_weights,
    attention_weights,
)

__all__ = [
    "bilinear_attention",
    "bilinear_logits",
    "collapse_qk",
    "factorize_qk",
    "separate_logits",
]


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b``; the single place products happen (tests replace it to count operations)."""
    return a @ b


@_sig.reference_of(_public.collapse_qk)
def collapse_qk(args: dict[str, Any]) -> BilinearQK:
    """Reference for :func:`attnlab.collapse_qk`, head by head.

    Query head ``i`` pairs with key head ``i // (h // h_kv)``.

    {parameters}

    Returns
    -------
    BilinearQK
        ``w (h, d_q, d_k)`` with ``W_i = W_q,i W_k,i^T``; ``u (h, d_k)``, ``v (h, d_q)`` and
        ``c (h,)`` when the biases give them; ``d_head``.

    {reference_examples}
    >>> qk = reference.collapse_qk(rng.standard_normal((16, 8)), rng.standard_normal((12, 8)),
    ...                            b_q=np.ones(8), num_heads=2)
    >>> qk.w.shape, qk.u.shape, qk.v is None, qk.d_head
    ((2, 16, 12), (2, 12), True, 4)
    """
    w_q, w_k, b_q, b_k = _f64(args["w_q"]), _f64(args["w_k"]), args["b_q"], args["b_k"]
    h, h_kv = _heads(args["num_heads"], args["num_kv_heads"])
    d_head = w_q.shape[1] // h
    ws, us, vs, cs = [], [], [], []
    for i in range(h):
        j = i // (h // h_kv)
        wq_i = w_q[:, i * d_head : (i + 1) * d_head]
        wk_j = w_k[:, j * d_head : (j + 1) * d_head]
        ws.append(_matmul(wq_i, wk_j.T))
        bq_i = None if b_q is None else _f64(b_q)[i * d_head : (i + 1) * d_head]
        bk_j = None if b_k is None else _f64(b_k)[j * d_head : (j + 1) * d_head]
        if bq_i is not None:
            us.append(_matmul(wk_j, bq_i))
        if bk_j is not None:
            vs.append(_matmul(wq_i, bk_j))
        if bq_i is not None and bk_j is not None:
            cs.append(float(bq_i @ bk_j))
    return BilinearQK(
        w=np.stack(ws),
        u=np.stack(us) if us else None,
        v=np.stack(vs) if vs else None,
        c=np.array(cs) if cs else None,
        d_head=d_head,
    )


@_sig.reference_of(_public.factorize_qk)
def factorize_qk(args: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference for :func:`attnlab.factorize_qk`: SVD per head; the error is measured directly.

    {parameters}

    Returns
    -------
    w_q : ndarray, shape (d_q, h * rank)
    w_k : ndarray, shape (d_k, h * rank)
        Per-head column blocks with ``w_q,i w_k,i^T`` the best rank-``rank`` approximation
        of ``W_i``.
    rel_error : ndarray, shape (h,)
        ``||W_i - w_q,i w_k,i^T||_F / ||W_i||_F``, computed from the reconstruction (0 for a
        zero ``W_i``).

    {reference_examples}
    >>> w = rng.standard_normal((2, 6, 5))
    >>> w_q, w_k, err = reference.factorize_qk(w, 5)    # full rank: exact
    >>> w_q.shape, w_k.shape, bool(err.max() < 1e-12)
    ((6, 10), (5, 10), True)
    """
    w, rank = args["w"], args["rank"]
    w = _f64(w.w if isinstance(w, BilinearQK) else w)
    h = w.shape[0]
    fq, fk, err = [], [], []
    for i in range(h):
        u, s, vt = np.linalg.svd(w[i])
        a = u[:, :rank] * np.sqrt(s[:rank])
        b = vt[:rank].T * np.sqrt(s[:rank])
        fq.append(a)
        fk.append(b)
        norm = np.linalg.norm(w[i])
        err.append(np.linalg.norm(w[i] - a @ b.T) / norm if norm > 0 else 0.0)
    return np.concatenate(fq, axis=1), np.concatenate(fk, axis=1), np.array(err)


@_docs.filled
def separate_logits(
    query: Any,
    key: Any = None,
    *,
    w_q: Any,
    w_k: Any,
    b_q: Any = None,
    b_k: Any = None,
    num_heads: int,
    num_kv_heads: int | None = None,
    scale: float | None = None,
) -> np.ndarray:
    """Scaled logits ``(..., h, n_q, n_k)`` of multi-head attention: project, then ``Q_i K_i^T``.

    The separate (unfolded) form, against which :func:`bilinear_logits` is compared.

    Parameters
    ----------
    query, key, w_q, w_k, b_q, b_k, num_heads, num_kv_heads, scale
        As for :func:`attnlab.multi_head_attention`: the parameters of its query-key side,
        with its names, kinds and defaults (``tests/test_typing.py`` checks them against it).

    Returns
    -------
    ndarray, shape (..., h, n_q, n_k)
        float64 ``scale * Q_i K_i^T`` per head.

    {reference_examples}
    >>> wq, wk = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))
    >>> x = rng.standard_normal((3, 8))
    >>> sep = reference.separate_logits(x, w_q=wq, w_k=wk, num_heads=2)
    >>> fold = reference.bilinear_logits(x, w_qk=reference.collapse_qk(wq, wk, num_heads=2))
    >>> sep.shape, bool(np.allclose(sep, fold))
    ((2, 3, 3), True)
    """
    xq, xk, _ = _qkv(query, key, None)  # no value: the logits only
    wq, wk = _f64(w_q), _f64(w_k)
    h, h_kv = _heads(num_heads, num_kv_heads)
    d_head = wq.shape[1] // h
    q = _matmul(xq, wq) + _bias(b_q)
    k = _matmul(xk, wk) + _bias(b_k)
    s = _scale({"scale": scale}, d_head)
    out = []
    for i in range(h):
        j = i // (h // h_kv)
        q_i = q[..., i * d_head : (i + 1) * d_head]
        k_j = k[..., j * d_head : (j + 1) * d_head]
        out.append(s * _matmul(q_i, np.swapaxes(k_j, -1, -2)))
    return np.stack(out, axis=-3)


@_docs.filled
def bilinear_logits(
    query: Any,
    key: Any = None,
    *,
    w_qk: Any,
    u_k: Any = None,
    scale: Any = None,
    order: str = "query",
    precision: str | None = None,
) -> np.ndarray:
    """Scaled logits ``scale * (x_q W_i x_k^T + u_i x_k^T)``, ``(..., h, n_q, n_k)``.

    ``order="query"`` evaluates ``(X_q W_i + u_i) X_k^T``, ``"key"`` evaluates
    ``X_q (W_i X_k^T) + u_i X_k^T``. ``scale`` defaults to ``1/sqrt(d_q / h)``, or to
    ``1/sqrt(d_head)`` when ``w_qk`` is a BilinearQK (which also supplies ``u_k``).
    ``precision="bf16"`` (the query order) rounds the operands of both products to bfloat16:
    ``x_q``, ``W_i``, ``x_k`` and ``x_q W_i + u_i``, as :func:`attnlab.bilinear_attention`'s.

    Parameters
    ----------
    query : array_like, shape (..., n_q, d_q)
    key : array_like, shape (..., n_k, d_k), optional
        Defaults to ``query``.
    w_qk : array_like, shape (h, d_q, d_k), or BilinearQK
    u_k : array_like, shape (h, d_k), optional
        Ignored when ``w_qk`` is a BilinearQK (its ``u`` is used).
    scale : float, optional
    order : {"query", "key"}
        Which side ``W_i`` is applied to first (the two cost differently, same result).
    precision : {None, "bf16"}
        ``"bf16"``: the operands rounded (in float64, the products exact); query order only.

    Returns
    -------
    ndarray, shape (..., h, n_q, n_k)
        float64 scaled logits (``v_i`` and ``c_i`` of a BilinearQK are left out: they cancel
        in the softmax).

    {reference_examples}
    >>> w = rng.standard_normal((2, 8, 6))
    >>> xq, xk = rng.standard_normal((4, 8)), rng.standard_normal((5, 6))
    >>> a = reference.bilinear_logits(xq, xk, w_qk=w)
    >>> a.shape, bool(np.allclose(a, reference.bilinear_logits(xq, xk, w_qk=w, order="key")))
    ((2, 4, 5), True)
    """
    d_head = None
    if isinstance(w_qk, BilinearQK):
        u_k, d_head, w_qk = w_qk.u, w_qk.d_head, w_qk.w
    if precision not in (None, "bf16") or (precision == "bf16" and order != "query"):
        raise ValueError(
            f"precision: expected None, or 'bf16' with order='query', got {precision!r} with "
            f"order={order!r}"
        )
    rnd = _bf16 if precision == "bf16" else (lambda a: a)
    xq, xk, _ = _qkv(query, key, None)  # no value: the logits only
    xq, xk = rnd(xq), rnd(xk)
    w = rnd(_f64(w_qk))
    h, d_q, _ = w.shape
    if d_head is None:
        d_head = d_q / h
    s = 1.0 / math.sqrt(d_head) if scale is None else float(scale)
    xk_t = np.swapaxes(xk, -1, -2)
    out = []
    for i in range(h):
        u_i = None if u_k is None else _f64(u_k)[i]
        if order == "query":
            q_i = _matmul(xq, w[i])
            if u_i is not None:
                q_i = q_i + u_i
            logits = _matmul(rnd(q_i), xk_t)
        else:
            logits = _matmul(xq, _matmul(w[i], xk_t))
            if u_i is not None:
                logits = logits + _matmul(u_i, xk_t)[..., None, :]
        out.append(s * logits)
    return np.stack(out, axis=-3)


@_sig.reference_of(_public.bilinear_attention)
def bilinear_attention(args: dict[str, Any]) -> Any:
    """Reference for :func:`attnlab.bilinear_attention` (float64), one head at a time.

    The logits in the query order, ``(X_q W_i + u_i) X_k^T`` (:func:`bilinear_logits`). With
    ``precision="bf16"`` the operands of every product are rounded to bfloat16 (the products
    exact): the inputs, ``w_qk``, ``w_v``, ``w_o``, the projected queries, the values and the
    context (the kernels also round the probabilities, within the bound the tests hold them
    to).

    {parameters}

    {reference_attention_returns}

    {reference_examples}
    >>> w = [rng.standard_normal((8, 8)) / 3 for _ in range(4)]
    >>> x = rng.standard_normal((5, 8))
    >>> kw = dict(w_v=w[2], w_o=w[3], num_heads=2)
    >>> folded = reference.bilinear_attention(
    ...     x, w_qk=reference.collapse_qk(w[0], w[1], num_heads=2), **kw)
    >>> separate = reference.multi_head_attention(x, w_q=w[0], w_k=w[1], **kw)
    >>> folded.shape, bool(np.allclose(folded, separate))
    ((5, 8), True)
    """
    precision = args["precision"]
    rnd = _bf16 if precision == "bf16" else (lambda a: a)
    xq, xk, xv = _qkv(args["query"], args["key"], args["value"])
    h, h_kv = _heads(args["num_heads"], args["num_kv_heads"])
    w_v, w_o = rnd(_f64(args["w_v"])), rnd(_f64(args["w_o"]))
    d_vhead = w_v.shape[1] // h_kv
    logits = bilinear_logits(
        xq, xk, w_qk=args["w_qk"], u_k=args["u_k"], scale=args["scale"], precision=precision
    )
    vv = rnd(_matmul(rnd(xv), w_v) + _bias(args["b_v"]))
    logits, allowed, p, lse = attention_weights(args, logits)
    contexts = []
    for i in range(h):
        j = i // (h // h_kv)
        reads = allowed[..., i, :, :] & ~np.isneginf(logits[..., i, :, :])
        contexts.append(_context(p[..., i, :, :], vv[..., j * d_vhead : (j + 1) * d_vhead], reads))
    ctx = rnd(np.concatenate(contexts, axis=-1))
    out = _matmul(ctx, w_o) + _bias(args["b_o"])
    return _with_weights(out, p, args, lse)
