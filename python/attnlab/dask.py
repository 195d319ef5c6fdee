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

Half precision: inputs of one half dtype (float16 or bfloat16; for multi-head attention its
weights too) are sent and read as stored, the parts of a key-chunked block computed in float32
and the merged result rounded to that dtype once: bit for bit the float32 graph on the widened
arrays, rounded. float32 ``q`` against a half-precision ``k``, ``v`` reads them as stored.

Threads: a task that runs on a ``dask.distributed`` worker sets that worker process's kernels
to one thread (unless ``ATTNLAB_NUM_THREADS`` or :func:`attnlab.set_num_threads` chose a count
there), so a worker with ``T`` threads runs at most ``T`` kernel threads, one per task it runs,
as dask's workers do with BLAS.

This module imports dask; ``pip install "attnlab[dask]"``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import _args, _docs, _half, _memory, _mha, _rope
from . import _signature as _sig
from . import _validate as V
from ._loader import core
from ._merge import merge_attention

__all__ = ["multi_head_attention", "scaled_dot_product_attention"]

_NATIVE = (np.dtype(np.float32), np.dtype(np.float64))


# --- the worker side: functions the tasks run -------------------------------------------------


_checked = {"threads": False}  # once per process: the first task on a worker sets the count


def _limit_threads() -> None:
    """On a ``dask.distributed`` worker: one kernel thread per task thread, unless the worker's
    process chose its count (``ATTNLAB_NUM_THREADS``, ``set_num_threads``)."""
    if _checked["threads"]:
        return
    try:
        from distributed import get_worker

        get_worker()
    except (ImportError, ValueError):  # not on a distributed worker: the caller's setting
        return
    _checked["threads"] = True
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
    """Attention of a query block over one key block: ``(out, lse)``, in float32 for a
    half-precision block (``q`` widened, ``k`` and ``v`` read as stored), so that the merge
    sums float32 parts and the result is rounded once."""
    _limit_threads()
    if _half.is_half(q.dtype):
        q = _half.widen(q)
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


def _stored(result: tuple[np.ndarray, ...], half: np.dtype | None) -> np.ndarray:
    """The output of a block's ``(out, lse)``, rounded to the inputs' half dtype (if any)."""
    return _half.store(result[0], half)


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


def _tree(dsk: dict, name: str, prefix: tuple, parts: list[Any], split_every: int) -> Any:
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


def _merged(
    dsk: dict,
    name: str,
    block: tuple,
    parts: list[Any],
    sinks: _Operand | None,
    idx: dict[Any, int],
    shape: tuple[int, ...],
    dtype: np.dtype,
    split_every: int,
) -> Any:
    """The root of the merge tree of a query block's parts (keys of ``(out, lse)``, one per key
    block it may see, outputs of ``shape``): with the sinks' part, and an empty part when no
    key block may be seen."""
    parts = list(parts)
    if sinks is not None:
        key = (f"{name}-sinks", *block)
        dsk[key] = (_sink_part, _key(sinks, idx), shape, dtype)
        parts.append(key)
    if not parts:
        key = (f"{name}-empty", *block)
        dsk[key] = (_empty_part, shape, dtype)
        parts.append(key)
    return _tree(dsk, name, block, parts, split_every)


def _lead(x: da.Array, nb: int, core_roles: tuple[Any, ...]) -> _Operand:
    """``x`` as an operand whose last axes have ``core_roles`` and whose leading axes are the
    last of the ``nb`` batch axes (axes of length 1 added in front up to the full rank)."""
    if x.ndim < nb + len(core_roles):
        x = x[(None,) * (nb + len(core_roles) - x.ndim)]
    batch_roles = tuple(("b", i) for i in range(nb))
    return _Operand(x, batch_roles[nb - (x.ndim - len(core_roles)) :] + core_roles)


def _split_every(split_every: Any) -> int:
    s = V.check_positive_int(split_every, "split_every")
    if s < 2:
        raise ValueError(f"split_every: expected an integer >= 2, got {s}")
    return s


def _spans(chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk."""
    starts: Any = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(int) if chunks else []
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
    {dask_mask}
    causal, window, softcap, alibi_slopes, sinks, scale
        As for :func:`attnlab.scaled_dot_product_attention`, relative to the whole call's
        positions. ``alibi_slopes`` and ``sinks`` are small: they are read on the client.
    {dask_options}

    Returns
    -------
    out : dask array, shape (..., h, n_q, d_v)
    lse : dask array, shape (..., h, n_q), optional

    Notes
    -----
    Attention weights (``return_weights``) are not offered: they are the ``n_q x n_k`` array
    that key blocks avoid. Rows that no key may attend give 0 (and ``lse`` ``-inf``) as in the
    one-machine call, which warns about them; these functions do not (see ``lse``).

    {dask_examples}
    >>> q, k, v = (rng.standard_normal((2, 4, 64, 8)) for _ in range(3))
    >>> out = attnlab.dask.scaled_dot_product_attention(
    ...     da.from_array(q, chunks=(1, 4, 64, 8)), da.from_array(k, chunks=(1, 4, 16, 8)), v,
    ...     causal=True)
    >>> out.chunks[0], out.shape
    ((1, 1), (2, 4, 64, 8))
    >>> bool(np.allclose(out.compute(), attnlab.scaled_dot_product_attention(q, k, v,
    ...                                                                      causal=True)))
    True
    """
    call = _sig.arguments(locals())
    qd, kd, vd = _dask(q, "q"), _dask(k, "k"), _dask(v, "v")
    s_every = _split_every(split_every)
    lse_wanted = V.check_flag(return_lse, "return_lse")
    dtypes = [_native(x.dtype, n) for x, n in ((qd, "q"), (kd, "k"), (vd, "v"))]
    dtype = np.dtype(np.result_type(*dtypes))
    # q, k, v of one half dtype: sent and read as stored, the result rounded to it once
    half = _half.storage({"q": qd, "k": kd, "v": vd})
    md = None if mask is None else _dask(mask, "mask")
    mask_dt = None if md is None else (np.bool_ if md.dtype.kind == "b" else dtype)
    if md is not None and not (md.dtype.kind == "b" or V.floating(md.dtype)):
        mask_dt = md.dtype  # refused by the check below, naming it
    args = dict(  # the call's options, its arrays as stand-ins
        call,
        q=_standin(qd, dtype),
        k=_standin(kd, dtype),
        v=_standin(vd, dtype),
        mask=None if md is None else _standin(md, mask_dt),
        precision=None,  # the blocks run in the input dtype: no bf16 option here
        warn_empty_rows=False,
    )
    a = _mha._prepare_sdpa(args)  # the one-machine checks, no data copied
    batch, nb, h = a.batch, len(a.batch), a.h
    bro = tuple(("b", i) for i in range(nb))

    stored = half or dtype
    # float32 queries against a k, v cache of one half dtype read it as stored too
    kv_half = _half.storage({"k": kd, "v": vd})
    kv_stored = kv_half if kv_half is not None and dtype == np.float32 else stored
    ops = {
        "q": _lead(qd.astype(stored), nb, (None, "q", None)),
        "k": _lead(kd.astype(kv_stored), nb, (None, "k", None)),
        "v": _lead(vd.astype(kv_stored), nb, (None, "k", None)),
    }
    if md is not None:
        ops["mask"] = _lead(md if md.dtype.kind == "b" else md.astype(dtype), nb, (None, "q", "k"))
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
                at = (*bidx, 0, qi, 0)
                roots[at] = key
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
            root = _merged(dsk, name, (*bidx, qi), parts, sinks_op, idx, out_shape, dtype, s_every)
            roots[tuple(bidx) + (0, qi, 0)] = root  # (mypy 3.10 mode misreads a starred key)
    deps = [op.x for op in ops.values()] + [o.x for o in (alibi, sinks_op) if o is not None]
    out_chunks = tuple(chunks[r] for r in bro) + ((h,), chunks["q"], (a.d_v,))
    for idx_, root in roots.items():
        dk: tuple[Any, ...] = (name, *idx_)
        dsk[dk] = (_stored, root, half)
        if lse_wanted:
            dk = (f"{name}-lse", *idx_[:-1])
            dsk[dk] = (operator.getitem, root, 1)
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)  # type: ignore[arg-type]
    out = da.Array(graph, name, out_chunks, meta=np.empty((0,) * len(out_chunks), stored))
    if not lse_wanted:
        return out
    lse = da.Array(
        graph, f"{name}-lse", out_chunks[:-1], meta=np.empty((0,) * (len(out_chunks) - 1), dtype)
    )
    return out, lse


# --- multi-head attention ---------------------------------------------------------------------


class _Params:
    """The prepared weights of a multi-head call (and its rotary and norm settings): one value
    in the graph, so each worker receives it once, whatever the number of blocks."""

    def __init__(self, **values: Any) -> None:
        self.values = values

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def __setstate__(self, state: dict[str, Any]) -> None:
        # arrays received by a worker may sit at any address in the message's buffer
        self.values = {
            n: _memory.contiguous(a) if isinstance(a, np.ndarray) else a
            for n, a in state["values"].items()
        }


def _project_heads(x: np.ndarray, p: _Params, side: str, pos: np.ndarray | None) -> np.ndarray:
    """``x`` ``(..., n, d_in)`` projected by ``w_{side}``, normalised and rotated as the
    one-machine composed path does (``_rope``), as heads ``(..., heads, n, d_head)``."""
    w, b, heads = p[f"w_{side}"], p[f"b_{side}"], p["heads_" + side]
    lead = x.shape[:-2]
    if pos is not None and side != "v":
        lead = np.broadcast_shapes(lead, pos.shape[:-1])
    n = x.shape[-2]
    x = np.broadcast_to(x, lead + x.shape[-2:])
    B = V.count(lead)
    rows = _memory.contiguous(x.reshape(B * n, x.shape[-1]), w.dtype)
    y = _rope._project(rows, w, b, B, n, heads)
    if side != "v":
        norm = p[f"{side}_norm"]
        if norm is not None:
            y, _ = _rope.rms_norm(y, norm, p["norm_eps"])
        if pos is not None:
            pos2 = (
                pos.reshape(1, n)
                if V.count(pos.shape[:-1]) == 1
                else (np.broadcast_to(pos, lead + (n,)).reshape(B, n))
            )
            cos, sin = _rope.tables(p["inv_freq"], pos2, w.dtype, p["rope_scale"])
            _rope.rotate(y, cos, sin, 2 * p["inv_freq"].shape[0])
    return np.moveaxis(y.reshape(lead + y.shape[1:]), -2, -3)


def _mha_queries(x: np.ndarray, p: _Params, pos: np.ndarray | None) -> np.ndarray:
    _limit_threads()
    return _project_heads(x, p, "q", pos)


def _mha_keys(
    xk: np.ndarray, xv: np.ndarray, p: _Params, pos: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    _limit_threads()
    return _project_heads(xk, p, "k", pos), _project_heads(xv, p, "v", None)


def _mha_part(
    qh: np.ndarray,
    kv: tuple[np.ndarray, np.ndarray],
    mask: np.ndarray | None,
    kp: np.ndarray | None,
    alibi: np.ndarray | None,
    span: _Span,
    opts: dict,
) -> tuple[np.ndarray, np.ndarray]:
    return _sdpa_part(qh, kv[0], kv[1], mask, kp, alibi, span, opts)


def _mha_output(merged: tuple[np.ndarray, np.ndarray], p: _Params) -> tuple:
    """The merged context ``(..., h, n_q, d_vhead)`` through the output projection."""
    _limit_threads()
    ctx, lse = merged
    lead, (h, n, dv) = ctx.shape[:-3], ctx.shape[-3:]
    rows = _memory.contiguous(np.moveaxis(ctx, -3, -2).reshape(V.count(lead) * n, h * dv))
    w_o = p["w_o"]
    y = _memory.empty((rows.shape[0], w_o.shape[1]), w_o.dtype)
    if y.size:
        core.linear_forward(rows, w_o, p["b_o"], y)
    return y.reshape(lead + (n, w_o.shape[1])), lse


def _mha_direct(
    xq: Any,
    xk: Any,
    xv: Any,
    p: _Params,
    mask: Any,
    kp: Any,
    alibi: Any,
    sinks: Any,
    pq: Any,
    pk: Any,
    opts: dict,
) -> Any:
    """A block that is the whole sequence: the one-machine call, every option as given."""
    _limit_threads()
    names = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "q_norm", "k_norm")
    return _mha.multi_head_attention(
        xq,
        xk,
        xv,
        **{n: p[n] for n in names},
        mask=mask,
        key_padding_mask=kp,
        alibi_slopes=alibi,
        sinks=sinks,
        positions=None if pq is None else (pq, pk),
        return_lse=True,
        warn_empty_rows=False,
        **opts,
    )


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
    return_lse: bool = False,
    rope_theta: float | None = None,
    rope_dim: int | None = None,
    positions: Any = None,
    rope_inv_freq: Any = None,
    rope_scale: float | None = None,
    q_norm: Any = None,
    k_norm: Any = None,
    norm_eps: float | None = None,
    split_every: int = 4,
) -> Any:
    """:func:`attnlab.multi_head_attention` on dask arrays, block by block.

    A block that holds whole sequences (one chunk along the queries' and the keys' tokens) is
    one fused one-machine call. Otherwise the queries of a block are projected once (norm and
    rotary embeddings included), the keys and values once per key block, each pair of blocks
    attended by the SDPA kernel with ``return_lse``, the key blocks merged in a tree
    (:func:`attnlab.merge_attention`) and the merged context projected by ``w_o``.

    Parameters
    ----------
    query : dask array or array_like, shape (..., n_q, d_q)
    key : dask array or array_like, shape (..., n_k, d_k), optional
    value : dask array or array_like, shape (..., n_k, d_v), optional
        Their chunks set the blocks: along the batch axes (from the first input not broadcast
        along an axis), the queries' tokens (``query``'s) and the keys' (``key``'s; ``value``
        is rechunked to them). Features are never split. NumPy inputs are one chunk.
    w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o : array_like
        NumPy weights: one value of the graph, sent to each worker once.
    {dask_mask}
    key_padding_mask : dask array or array_like of bool, optional
        ``(..., n_k)``, chunked with the keys.
    num_heads, num_kv_heads, causal, window, softcap, alibi_slopes, sinks, scale
        As for :func:`attnlab.multi_head_attention`.
    rope_theta, rope_dim, positions, rope_inv_freq, rope_scale, q_norm, k_norm, norm_eps
        As for :func:`attnlab.multi_head_attention`, relative to the whole call's positions.
        ``alibi_slopes``, ``sinks`` and ``positions`` are small: they are read on the client.
    {dask_options}

    Returns
    -------
    out : dask array, shape (..., n_q, d_out)
    lse : dask array, shape (..., h, n_q), optional

    Notes
    -----
    Attention weights (``return_weights``) are not offered. Rows that no key may attend give
    ``b_o`` (and ``lse`` ``-inf``) as in the one-machine call, without its warning.

    {dask_examples}
    >>> x = rng.standard_normal((2, 64, 16))
    >>> w = dict(zip(("w_q", "w_k", "w_v", "w_o"),
    ...              (rng.standard_normal((16, 16)) * 0.25 for _ in range(4))))
    >>> out = attnlab.dask.multi_head_attention(da.from_array(x, chunks=(1, 16, 16)),
    ...                                         num_heads=4, causal=True, **w)
    >>> bool(np.allclose(out.compute(),
    ...                  attnlab.multi_head_attention(x, num_heads=4, causal=True, **w)))
    True
    """
    call = _sig.arguments(locals())
    s_every = _split_every(split_every)
    lse_wanted = V.check_flag(return_lse, "return_lse")
    xq = _dask(query, "query")
    xk = xq if key is None else _dask(key, "key")
    xv = xk if value is None else _dask(value, "value")
    wnames = ("w_q", "w_k", "w_v", "w_o")
    given = dict(w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o)
    ws = {
        n: (V.as_array(x, n) if n in wnames else V.optional_array(x, n)) for n, x in given.items()
    }
    in_dt = [_native(x.dtype, n) for x, n in ((xq, "query"), (xk, "key"), (xv, "value"))]
    dtype = np.dtype(np.result_type(*in_dt, *(w.dtype for w in ws.values() if w is not None)))
    # inputs and weights of one half dtype: the inputs sent as stored (widened by the tasks that
    # project them), the weights widened once, the result rounded to that dtype once
    half = _half.storage({"query": xq, "key": xk, "value": xv, **given})
    std = {n: _standin(x, dtype) for n, x in (("query", xq), ("key", xk), ("value", xv))}
    x = _args.qkv(  # the inputs' own checks, on stand-ins: no data read or copied
        dict(
            query=std["query"],
            key=None if key is None else std["key"],
            value=None if value is None else std["value"],
        ),
        min_features=True,
    )
    d_q, d_k, d_v = x.widths
    tiny = {n: np.zeros((1, d), dtype) for n, d in (("query", d_q), ("key", d_k), ("value", d_v))}
    targs = dict(  # the call's options, tiny inputs and no per-call arrays
        call,
        query=tiny["query"],
        key=None if key is None else tiny["key"],
        value=None if value is None else tiny["value"],
        **ws,
        mask=None,
        key_padding_mask=None,
        alibi_slopes=None,
        sinks=None,
        warn_empty_rows=False,
    )
    a = _mha._prepare_mha(targs)  # heads and weights, checked and prepared once
    batch = x.batch()
    h, h_kv, n_q, n_k = a.h, a.h_kv, x.n_q, x.n_k
    md = None if mask is None else _dask(mask, "mask")
    kd = None if key_padding_mask is None else _dask(key_padding_mask, "key_padding_mask")
    mask_dt = None if md is None else (np.bool_ if md.dtype.kind == "b" else dtype)
    if md is not None and not (md.dtype.kind == "b" or V.floating(md.dtype)):
        mask_dt = md.dtype
    m = _args.masks(
        dict(  # the call's options, its masks as stand-ins
            call,
            mask=None if md is None else _standin(md, mask_dt),
            key_padding_mask=None if kd is None else _standin(kd),
            warn_empty_rows=False,
        ),
        batch,
        h,
        n_q,
        n_k,
        dtype,
        a.m.scale,
    )
    rope_args = dict(
        rope_theta=rope_theta,
        rope_dim=rope_dim,
        positions=None,
        rope_inv_freq=rope_inv_freq,
        rope_scale=rope_scale,
        q_norm=q_norm,
        k_norm=k_norm,
        norm_eps=norm_eps,
        precision=None,  # the blocks project in float32: no bf16 option here
    )
    if positions is not None and rope_theta is None and rope_inv_freq is None:
        raise ValueError(
            "positions: given without rope_theta or rope_inv_freq (rotary embeddings are off "
            "when both are None)"
        )
    comp = _rope.prepare_for(a, rope_args)
    d_head = a.w["w_q"].shape[1] // h  # type: ignore[union-attr]
    inv_freq = None
    pq = pk = None
    if comp is not None and comp.rope is not None:
        if rope_inv_freq is not None:
            inv_freq = _rope._inv_freq(rope_inv_freq, rope_dim, d_head)
        else:
            inv_freq = _rope.inverse_frequencies(float(rope_theta), comp.rope.dim)  # type: ignore[arg-type]
        pq2, pk2 = _rope.resolve_positions(positions, n_q, n_k, m.causal, batch)
        nb_ = len(batch)
        pq, pk = (
            p.reshape((1,) * nb_ + p.shape[1:])
            if p.shape[0] == 1 and V.count(batch) != 1
            else p.reshape(batch + p.shape[1:])
            for p in (pq2, pk2)
        )
    params = _Params(
        **a.w,
        heads_q=h,
        heads_k=h_kv,
        heads_v=h_kv,
        q_norm=None if comp is None else comp.q_norm,
        k_norm=None if comp is None else comp.k_norm,
        norm_eps=1e-6 if comp is None else comp.eps,
        inv_freq=inv_freq,
        rope_scale=1.0 if rope_scale is None else float(rope_scale),
    )
    nb = len(batch)
    bro = tuple(("b", i) for i in range(nb))

    stored = half or dtype
    ops: dict[str, _Operand] = {
        "query": _lead(xq.astype(stored), nb, ("q", None)),
        "key": _lead(xk.astype(stored), nb, ("k", None)),
        "value": _lead(xv.astype(stored), nb, ("k", None)),
    }
    if md is not None:
        ops["mask"] = _lead(md if md.dtype.kind == "b" else md.astype(dtype), nb, (None, "q", "k"))
    if kd is not None:
        ops["kp"] = _lead(kd, nb, ("k",))
    for nm, p in (("pq", pq), ("pk", pk)):
        if p is not None:
            ops[nm] = _lead(da.from_array(p, chunks=p.shape), nb, ("q" if nm == "pq" else "k",))
    chunks = _chunks_for([ops[n] for n in ("query", "key", "value")], batch)
    ops = {n: _aligned(op, chunks) for n, op in ops.items()}
    alibi = _per_head(m.alibi, batch, h, "attnlab-alibi")
    sinks_op = _per_head(m.sinks, batch, h, "attnlab-sinks")
    alibi, sinks_op = (None if o is None else _aligned(o, chunks) for o in (alibi, sinks_op))
    token = tokenize(
        xq,
        xk,
        xv,
        md,
        kd,
        a.w,
        causal,
        window,
        softcap,
        m.alibi,
        m.sinks,
        scale,
        num_heads,
        num_kv_heads,
        rope_theta,
        rope_dim,
        pq,
        pk,
        rope_inv_freq,
        rope_scale,
        q_norm,
        k_norm,
        norm_eps,
        key is None,
        value is None,
    )
    name = f"attnlab-mha-{token}"
    wkey = f"{name}-weights"
    dsk: dict[Any, Any] = {wkey: params}
    q_spans, k_spans = _spans(chunks["q"]), _spans(chunks["k"])
    direct = len(q_spans) == 1 and len(k_spans) == 1
    opts = dict(softcap=softcap, scale=m.scale)
    d_vhead = a.w["w_v"].shape[1] // h_kv  # type: ignore[union-attr]
    d_out = a.d_out
    out_keys: dict[tuple, Any] = {}
    for bidx in _batch_indices(chunks, nb):
        bsizes = tuple(chunks[("b", i)][j] for i, j in enumerate(bidx))
        idx: dict[Any, int] = {("b", i): j for i, j in enumerate(bidx)}
        if direct:
            idx["q"] = idx["k"] = 0
            key_ = (f"{name}-direct", *bidx)
            dsk[key_] = (
                _mha_direct,
                _key(ops["query"], idx),
                None if key is None else _key(ops["key"], idx),
                None if value is None else _key(ops["value"], idx),
                wkey,
                _key(ops.get("mask"), idx),
                _key(ops.get("kp"), idx),
                _key(alibi, idx),
                _key(sinks_op, idx),
                _key(ops.get("pq"), idx),
                _key(ops.get("pk"), idx),
                dict(
                    opts,
                    num_heads=h,
                    num_kv_heads=h_kv,
                    causal=causal,
                    window=window,
                    rope_theta=rope_theta,
                    rope_dim=rope_dim,
                    rope_inv_freq=rope_inv_freq,
                    rope_scale=rope_scale,
                    norm_eps=norm_eps,
                ),
            )
            at = (*bidx, 0)
            out_keys[at] = key_
            continue
        kv_keys = []
        for ki in range(len(k_spans)):
            idx["k"] = ki
            kv = (f"{name}-kv", *bidx, ki)
            dsk[kv] = (
                _mha_keys,
                _key(ops["key"], idx),
                _key(ops["value"], idx),
                wkey,
                _key(ops.get("pk"), idx),
            )
            kv_keys.append(kv)
        for qi, (q0, nq) in enumerate(q_spans):
            idx["q"] = qi
            qh = (f"{name}-q", *bidx, qi)
            dsk[qh] = (_mha_queries, _key(ops["query"], idx), wkey, _key(ops.get("pq"), idx))
            parts = []
            for ki, (k0, nk) in enumerate(k_spans):
                span = _Span(q0, nq, k0, nk, n_q, n_k, m.causal, m.window)
                if span.allowed() is False:
                    continue
                idx["k"] = ki
                part = (f"{name}-part", *bidx, qi, ki)
                dsk[part] = (
                    _mha_part,
                    qh,
                    kv_keys[ki],
                    _key(ops.get("mask"), idx),
                    _key(ops.get("kp"), idx),
                    _key(alibi, idx),
                    span,
                    opts,
                )
                parts.append(part)
            ctx_shape = bsizes + (h, nq, d_vhead)
            root = _merged(dsk, name, (*bidx, qi), parts, sinks_op, idx, ctx_shape, dtype, s_every)
            ok = (f"{name}-out", *bidx, qi)
            dsk[ok] = (_mha_output, root, wkey)
            at = (*bidx, qi)
            out_keys[at] = ok
    for idx_, src in out_keys.items():
        dk: tuple[Any, ...] = (name, *idx_, 0)
        dsk[dk] = (_stored, src, half)
        if lse_wanted:
            dk = (f"{name}-lse", *idx_[:-1], 0, idx_[-1])
            dsk[dk] = (operator.getitem, src, 1)
    deps = [op.x for op in ops.values()] + [o.x for o in (alibi, sinks_op) if o is not None]
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)  # type: ignore[arg-type]
    bchunks = tuple(chunks[r] for r in bro)
    out_chunks = bchunks + (chunks["q"], (d_out,))
    out = da.Array(graph, name, out_chunks, meta=np.empty((0,) * len(out_chunks), stored))
    if not lse_wanted:
        return out
    lse_chunks = bchunks + ((h,), chunks["q"])
    lse = da.Array(graph, f"{name}-lse", lse_chunks, meta=np.empty((0,) * len(lse_chunks), dtype))
    return out, lse
