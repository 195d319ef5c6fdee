"""attnlab on dask arrays: scaled dot-product and multi-head attention, block by block.

The inputs' chunks set the blocks. Along batch axes each block is one kernel call. Along the
key axis each key block is attended separately with ``return_lse=True`` and the blocks of a
query block are combined with :func:`attnlab.merge_attention`, pairs of partial results merged
in a tree (``split_every`` at a time), so that no task holds more than a few blocks. Queries
may be chunked along their tokens too. The result is a dask array, computed by whatever
scheduler computes it (``dask.distributed`` clusters of processes included).

Exactness: every block runs the one-machine kernel. Options that depend on absolute token
positions (``causal``, ``window``, ``alibi_slopes``) are given to a block that is not the whole
sequence as an explicit mask of that block (a boolean mask, or an additive one with ``-inf``
where a pair may not attend), computed from the whole call's positions; blocks that no query
may see are skipped; ``sinks`` join the merge once, as a part with no value. ``mask`` and
``key_padding_mask`` are chunked with the queries and keys.

Threads: a task that runs on a ``dask.distributed`` worker sets that worker process's kernels
to one thread (unless ``ATTNLAB_NUM_THREADS`` or :func:`attnlab.set_num_threads` chose a count
there), so a worker with ``T`` threads runs at most ``T`` kernel threads, one per task it runs,
as dask's workers do with BLAS.

This module imports dask; ``pip install "attnlab[dask]"``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import _args, _mha, _rope
from . import _validate as V
from ._loader import core
from ._merge import merge_attention

__all__ = ["multi_head_attention", "scaled_dot_product_attention"]

_NATIVE = (np.dtype(np.float32), np.dtype(np.float64))


# --- the worker side: functions the tasks run -------------------------------------------------


_threads_checked = False  # once per process: the first task on a worker sets the count


def _limit_threads() -> None:
    """On a ``dask.distributed`` worker: one kernel thread per task thread, unless the worker's
    process chose its count (``ATTNLAB_NUM_THREADS``, ``set_num_threads``)."""
    global _threads_checked
    if _threads_checked:
        return
    try:
        from distributed import get_worker

        get_worker()
    except (ImportError, ValueError):  # not on a distributed worker: the caller's setting
        return
    _threads_checked = True
    from . import build_info, set_num_threads

    if not str(build_info()["num_threads_source"]).startswith(
        ("ATTNLAB_NUM_THREADS", "set_num_threads")
    ):
        set_num_threads(1)


class _Span(NamedTuple):
    """Where a block sits in the whole call: its first query and key, and the call's sizes and
    scalar mask options, from which the block's own mask is computed."""

    q0: int
    nq: int
    k0: int
    nk: int
    n_q: int
    n_k: int
    causal: int
    window: tuple[int, int]

    def allowed(self) -> np.ndarray | bool:
        """The pairs the call's ``causal`` and ``window`` allow in this block: ``True`` (all),
        ``False`` (none) or a boolean ``(nq, nk)`` array."""
        if not self.causal and self.window == (-1, -1):
            return True
        m = _args.Masks(self.causal, 1.0, None, None, self.window)
        lo, hi = m.key_intervals(self.n_q, self.n_k)
        lo, hi = lo[self.q0 : self.q0 + self.nq], hi[self.q0 : self.q0 + self.nq]
        k1 = self.k0 + self.nk
        if self.nq == 0 or self.nk == 0:
            return True
        if np.all((lo <= self.k0) & (hi >= k1)):
            return True
        if np.all((hi <= self.k0) | (lo >= k1) | (hi <= lo)):
            return False
        j = np.arange(self.k0, k1)
        return (lo[:, None] <= j) & (j < hi[:, None])

    def alibi_bias(self, slopes: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """ALiBi's ``-slope * |p(i) - j|`` over this block, ``slopes`` ``(..., h)`` ->
        ``(..., h, nq, nk)``, with the whole call's alignment ``p``."""
        p = np.arange(self.q0, self.q0 + self.nq) + (self.n_k - self.n_q if self.causal == 2 else 0)
        dist = np.abs(p[:, None] - np.arange(self.k0, self.k0 + self.nk)[None, :]).astype(dtype)
        return -slopes.astype(dtype)[..., None, None] * dist


def _block_mask(
    span: _Span,
    mask: np.ndarray | None,
    kp: np.ndarray | None,
    alibi: np.ndarray | None,
    dtype: np.dtype,
) -> np.ndarray | None:
    """One mask for a block's SDPA call: the user's ``mask`` block, the key padding block
    ``(..., nk)``, the block's share of ``causal``/``window`` and the ALiBi bias; boolean when
    nothing is additive, else additive with ``-inf`` where a pair may not attend (the kernels
    never read such a pair, as for a ``False``)."""
    allowed: Any = span.allowed()
    keep = None if allowed is True else allowed  # (nq, nk)
    if kp is not None:
        kpm = kp[..., None, None, :]  # (..., 1(h), 1(q), nk)
        keep = kpm if keep is None else keep & kpm
    additive = alibi is not None or (mask is not None and mask.dtype != np.bool_)
    if not additive:
        if mask is None:
            return keep
        return mask if keep is None else mask & keep
    bias: Any = 0
    if mask is not None and mask.dtype != np.bool_:
        bias = mask.astype(dtype, copy=False)
    elif mask is not None:
        keep = mask if keep is None else mask & keep
    if alibi is not None:
        bias = bias + span.alibi_bias(alibi, dtype)
    bias = np.asarray(bias, dtype)
    if keep is not None:
        bias = np.where(keep, bias, dtype.type(-np.inf))
    return bias


def _sdpa_direct(q: Any, k: Any, v: Any, mask: Any, alibi: Any, sinks: Any, opts: dict) -> Any:
    """A block that is the whole sequence: the one-machine call, every option as given."""
    _limit_threads()
    return _mha.scaled_dot_product_attention(
        q, k, v, mask=mask, alibi_slopes=alibi, sinks=sinks, return_lse=True, **opts
    )


def _sdpa_part(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    kp: np.ndarray | None,
    alibi: np.ndarray | None,
    span: _Span,
    opts: dict,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of a query block over one key block: ``(out, lse)``."""
    _limit_threads()
    dtype = np.result_type(q, k, v)
    m = _block_mask(span, mask, kp, alibi, dtype)
    out, lse = _mha.scaled_dot_product_attention(
        q, k, v, mask=m, return_lse=True, warn_empty_rows=False, **opts
    )
    return out, lse


def _sink_part(sinks: np.ndarray, out_shape: tuple[int, ...], dtype: np.dtype) -> tuple:
    """The sinks as one more part of the merge: no value (output 0), log-sum-exp the sink's
    logit, so that each sink joins the softmax exactly once."""
    lse = np.broadcast_to(sinks.astype(dtype)[..., None], out_shape[:-1])
    return np.zeros(out_shape, dtype), lse


def _empty_part(out_shape: tuple[int, ...], dtype: np.dtype) -> tuple:
    """A query block that no key may attend: output 0, log-sum-exp -inf."""
    return np.zeros(out_shape, dtype), np.full(out_shape[:-1], -np.inf, dtype)


def _merge(*parts: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    shape = np.broadcast_shapes(*(p[0].shape for p in parts))
    outs = [np.broadcast_to(p[0], shape) for p in parts]
    lses = [np.broadcast_to(p[1], shape[:-1]) for p in parts]
    return merge_attention(outs, lses)


# --- the client side: chunks and the graph ----------------------------------------------------


class _Operand(NamedTuple):
    """A dask array and, per axis, the role that sets its chunks: ``("b", i)`` batch axis ``i``,
    ``"q"`` or ``"k"`` the tokens, ``None`` one chunk. Axes of length 1 broadcast."""

    x: da.Array
    roles: tuple[Any, ...]


def _dask(x: Any, name: str) -> da.Array:
    if isinstance(x, da.Array):
        return x
    try:
        return da.asarray(x)
    except Exception as exc:  # noqa: BLE001 (whatever the array-like's __array__ raises)
        raise TypeError(f"{name}: could not be converted to a dask array ({exc})") from None


def _standin(x: da.Array, dtype: Any = None) -> np.ndarray:
    """A read-only NumPy array of ``x``'s shape that holds no memory (zero strides but the last
    axis), for the one-machine argument checks."""
    dt = np.dtype(dtype if dtype is not None else x.dtype)
    last = x.shape[-1] if x.ndim else 1
    base = np.zeros(max(int(last), 0), dt) if x.ndim else np.zeros((), dt)
    return np.broadcast_to(base, x.shape)


def _native(dt: np.dtype, name: str) -> np.dtype:
    """The dtype ``V.as_array`` turns ``dt`` into (``TypeError`` naming ``name`` for data
    attnlab refuses)."""
    return V.as_array(np.zeros(0, dt), name).dtype


def _chunks_for(ops: Sequence[_Operand], batch: tuple[int, ...]) -> dict[Any, tuple[int, ...]]:
    """The blocks of the call: per batch axis the chunks of the first operand that is not
    broadcast along it; ``"q"`` and ``"k"`` from the first operand with that role."""
    chunks: dict[Any, tuple[int, ...]] = {}
    nb = len(batch)
    for i, n in enumerate(batch):
        chunks[("b", i)] = (n,) if n == 1 else ()
    for op in ops:
        for ax, role in enumerate(op.roles):
            if role is None or chunks.get(role):
                continue
            if op.x.shape[ax] != 1 or (role in ("q", "k") and op.x.shape[ax] == 1):
                chunks[role] = op.x.chunks[ax]
    for i in range(nb):
        if not chunks[("b", i)]:
            chunks[("b", i)] = (batch[i],)
    return chunks


def _aligned(op: _Operand, chunks: dict[Any, tuple[int, ...]]) -> _Operand:
    """``op`` rechunked to the call's blocks (a no-op when it already is)."""
    target = []
    for ax, role in enumerate(op.roles):
        n = op.x.shape[ax]
        target.append((n,) if role is None or (n == 1 and role not in ("q", "k")) else chunks[role])
    return _Operand(op.x.rechunk(tuple(target)), op.roles)


def _key(op: _Operand | None, idx: dict[Any, int]) -> Any:
    """The key of ``op``'s block at the block index ``idx`` (role -> index)."""
    if op is None:
        return None
    out: list[Any] = [op.x.name]
    for ax, role in enumerate(op.roles):
        broadcast = role is None or (len(op.x.chunks[ax]) == 1 and role not in ("q", "k"))
        out.append(0 if broadcast else idx[role])
    return tuple(out)


def _tree(
    dsk: dict, name: str, prefix: tuple, parts: list[Any], split_every: int
) -> Any:
    """Merge ``parts`` (keys of ``(out, lse)``) in a tree, ``split_every`` at a time; the key of
    the root."""
    level = 0
    while len(parts) > 1:
        nxt = []
        for g in range(0, len(parts), split_every):
            group = parts[g : g + split_every]
            if len(group) == 1:
                nxt.append(group[0])
                continue
            key = (f"{name}-merge-{level}", *prefix, g // split_every)
            dsk[key] = (_merge, *group)
            nxt.append(key)
        parts, level = nxt, level + 1
    return parts[0]


def _split_every(split_every: Any) -> int:
    s = V.check_positive_int(split_every, "split_every")
    if s < 2:
        raise ValueError(f"split_every: expected an integer >= 2, got {s}")
    return s


def _spans(chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk."""
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(int) if chunks else []
    return [(int(s), int(c)) for s, c in zip(starts, chunks, strict=True)]


def _batch_indices(chunks: dict[Any, tuple[int, ...]], nb: int) -> list[tuple[int, ...]]:
    return [tuple(i) for i in np.ndindex(*(len(chunks[("b", a)]) for a in range(nb)))]


def _per_head(values: np.ndarray | None, batch: tuple[int, ...], h: int, name: str) -> Any:
    """``(B, h)`` per-head values (``_args.per_head``) as a dask operand ``batch + (h,)``."""
    if values is None:
        return None
    full = np.ascontiguousarray(values).reshape(batch + (h,))
    roles = tuple(("b", i) for i in range(len(batch))) + (None,)
    return _Operand(da.from_array(full, chunks=full.shape, name=f"{name}-{tokenize(full)}"), roles)



# --- scaled dot-product attention -------------------------------------------------------------


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
    return_lse: bool = False,
    split_every: int = 4,
) -> Any:
    """:func:`attnlab.scaled_dot_product_attention` on dask arrays, block by block.

    Parameters
    ----------
    q : dask array or array_like, shape (..., h, n_q, d)
    k : dask array or array_like, shape (..., h_kv, n_k, d)
    v : dask array or array_like, shape (..., h_kv, n_k, d_v)
        Their chunks set the blocks: along the batch axes (from the first input not broadcast
        along an axis), along the queries (``q``'s) and along the keys (``k``'s; ``v`` is
        rechunked to them). Heads and features are never split. NumPy inputs are one chunk.
    mask : dask array or array_like of bool or float, optional
        Broadcasts to ``(..., h, n_q, n_k)``, chunked with the queries and keys.
    causal, window, softcap, alibi_slopes, sinks, scale
        As for :func:`attnlab.scaled_dot_product_attention`, relative to the whole call's
        positions. ``alibi_slopes`` and ``sinks`` are small: they are read on the client.
    return_lse : bool
        Also return the log-sum-exp ``(..., h, n_q)`` (a dask array).
    split_every : int
        How many partial results of key blocks one merge task combines (>= 2).

    Returns
    -------
    out : dask array, shape (..., h, n_q, d_v)
    lse : dask array, shape (..., h, n_q), optional

    Notes
    -----
    Attention weights (``return_weights``) are not offered: they are the ``n_q x n_k`` array
    that key blocks avoid. Rows that no key may attend give 0 (and ``lse`` ``-inf``) as in the
    one-machine call, which warns about them; these functions do not (see ``lse``).

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnlab, attnlab.dask
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 64, 8)) for _ in range(3))
    >>> out = attnlab.dask.scaled_dot_product_attention(
    ...     da.from_array(q), da.from_array(k, chunks=(1, 4, 16, 8)), da.from_array(v),
    ...     causal=True)
    >>> out.chunks[0], out.shape
    ((1, 1), (2, 4, 64, 8))
    >>> bool(np.allclose(out.compute(), attnlab.scaled_dot_product_attention(q, k, v,
    ...                                                                      causal=True)))
    True
    """
    qd, kd, vd = _dask(q, "q"), _dask(k, "k"), _dask(v, "v")
    s_every = _split_every(split_every)
    lse_wanted = V.check_flag(return_lse, "return_lse")
    dtypes = [_native(x.dtype, n) for x, n in ((qd, "q"), (kd, "k"), (vd, "v"))]
    dtype = np.dtype(np.result_type(*dtypes))
    md = None if mask is None else _dask(mask, "mask")
    mask_dt = None if md is None else (np.bool_ if md.dtype.kind == "b" else dtype)
    if md is not None and md.dtype.kind not in "bf":
        mask_dt = md.dtype  # refused by the check below, naming it
    args = dict(
        q=_standin(qd, dtype),
        k=_standin(kd, dtype),
        v=_standin(vd, dtype),
        mask=None if md is None else _standin(md, mask_dt),
        causal=causal,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        scale=scale,
        warn_empty_rows=False,
    )
    a = _mha._prepare_sdpa(args)  # the one-machine checks, no data copied
    batch, nb, h = a.batch, len(a.batch), a.h
    bro = tuple(("b", i) for i in range(nb))

    def lead(x: da.Array, core_roles: tuple[Any, ...]) -> _Operand:
        x = x[(None,) * (nb + len(core_roles) - x.ndim)] if x.ndim < nb + len(core_roles) else x
        return _Operand(x, bro[nb - (x.ndim - len(core_roles)) :] + core_roles)

    ops = {
        "q": lead(qd.astype(dtype), (None, "q", None)),
        "k": lead(kd.astype(dtype), (None, "k", None)),
        "v": lead(vd.astype(dtype), (None, "k", None)),
    }
    if md is not None:
        ops["mask"] = lead(md if md.dtype.kind == "b" else md.astype(dtype), (None, "q", "k"))
    chunks = _chunks_for(list(ops.values()), batch)
    ops = {n: _aligned(op, chunks) for n, op in ops.items()}
    alibi = _per_head(a.m.alibi, batch, h, "attnlab-alibi")
    sinks_op = _per_head(a.m.sinks, batch, h, "attnlab-sinks")
    alibi, sinks_op = (None if o is None else _aligned(o, chunks) for o in (alibi, sinks_op))
    opts = dict(softcap=softcap, scale=a.m.scale)
    token = tokenize(qd, kd, vd, md, causal, window, softcap, a.m.alibi, a.m.sinks, scale)
    name = f"attnlab-sdpa-{token}"
    dsk: dict[Any, Any] = {}
    q_spans, k_spans = _spans(chunks["q"]), _spans(chunks["k"])
    direct = len(q_spans) == 1 and len(k_spans) == 1
    roots: dict[tuple, Any] = {}
    for bidx in _batch_indices(chunks, nb):
        bsizes = tuple(chunks[("b", i)][j] for i, j in enumerate(bidx))
        for qi, (q0, nq) in enumerate(q_spans):
            idx: dict[Any, int] = {("b", i): j for i, j in enumerate(bidx)}
            idx["q"] = qi
            out_shape = bsizes + (h, nq, a.d_v)
            if direct:
                idx["k"] = 0
                key = (f"{name}-part", *bidx, qi, 0)
                dsk[key] = (
                    _sdpa_direct,
                    _key(ops["q"], idx),
                    _key(ops["k"], idx),
                    _key(ops["v"], idx),
                    _key(ops.get("mask"), idx),
                    _key(alibi, idx),
                    _key(sinks_op, idx),
                    dict(opts, causal=causal, window=window),
                )
                roots[(*bidx, 0, qi, 0)] = key
                continue
            parts = []
            for ki, (k0, nk) in enumerate(k_spans):
                span = _Span(q0, nq, k0, nk, a.n_q, a.n_k, a.m.causal, a.m.window)
                if span.allowed() is False:
                    continue  # no query of the block may see a key of it
                idx["k"] = ki
                key = (f"{name}-part", *bidx, qi, ki)
                dsk[key] = (
                    _sdpa_part,
                    _key(ops["q"], idx),
                    _key(ops["k"], idx),
                    _key(ops["v"], idx),
                    _key(ops.get("mask"), idx),
                    None,
                    _key(alibi, idx),
                    span,
                    opts,
                )
                parts.append(key)
            if sinks_op is not None:
                key = (f"{name}-sinks", *bidx, qi)
                dsk[key] = (_sink_part, _key(sinks_op, idx), out_shape, dtype)
                parts.append(key)
            if not parts:
                key = (f"{name}-empty", *bidx, qi)
                dsk[key] = (_empty_part, out_shape, dtype)
                parts.append(key)
            roots[(*bidx, 0, qi, 0)] = _tree(dsk, name, (*bidx, qi), parts, s_every)
    deps = [op.x for op in ops.values()] + [o.x for o in (alibi, sinks_op) if o is not None]
    out_chunks = tuple(chunks[r] for r in bro) + ((h,), chunks["q"], (a.d_v,))
    for idx_, root in roots.items():
        dsk[(name, *idx_)] = (operator.getitem, root, 0)
        if lse_wanted:
            dsk[(f"{name}-lse", *idx_[:-1])] = (operator.getitem, root, 1)
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)
    out = da.Array(graph, name, out_chunks, meta=np.empty((0,) * len(out_chunks), dtype))
    if not lse_wanted:
        return out
    lse = da.Array(
        graph, f"{name}-lse", out_chunks[:-1], meta=np.empty((0,) * (len(out_chunks) - 1), dtype)
    )
    return out, lse
