"""Multi-head latent attention (DeepSeek-V2/V3's MLA), forward and backward, in two evaluation
orders composed from the C++ pieces (the projection GEMM ``linear_forward``, the flash attention
core ``sdpa_forward`` / ``sdpa_backward``).

Per token ``x``: queries ``q = x w_q`` (or ``rms(x w_q_a + b_q_a) w_q_b``), per head a no-rope
part ``q_nope`` (``d_nope``) and a rotary part ``q_rope`` (``d_rope``); one latent per token
``[c | k_rope] = x w_kv_a + b_kv_a`` with ``c = rms(c) * kv_a_norm`` (``r = kv_lora_rank``) and a
rotary key ``k_rope`` shared by every head. The cache holds ``[c | rotate(k_rope)]``, ``r +
d_rope`` numbers per token. ``w_kv_b`` maps ``c`` to each head's no-rope key and its value.

- ``"expanded"``: ordinary multi-head attention over ``K_i = [c W_uk,i | k_rope]`` and
  ``V_i = c W_uv,i`` (every key up-projected: ``n_k r h (d_nope + d_v)`` multiply-adds).
- ``"absorbed"``: ``W_uk,i`` folded into the query (``q_nope,i W_uk,i^T``, width ``r``) and
  ``W_uv,i`` applied after the attention: multi-query attention with one key head of width
  ``r + d_rope`` over the cache itself (value: its first ``r`` features). One query token (a
  decode step) runs its ``h`` heads as ``h`` query rows of that one key head, so the cache is
  read once.

Both give the same result to rounding; :func:`attnlab.cost.plan_latent` picks by multiply-adds.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import _args, _docs, _grad, _half, _memory, _rope
from . import _signature as _sig
from . import _validate as V
from ._loader import core
from ._merge import merge_attention

__all__ = ["latent_attention", "latent_attention_backward"]

_FORMS = ("auto", "expanded", "absorbed")


class _Latent(NamedTuple):
    """A validated latent-attention call."""

    x: np.ndarray  # (B*n, d) rows
    x_shape: tuple[int, ...]
    cache: np.ndarray | None  # (B, n_past, r + d_rope), the call's dtype (or _stored)
    cache_shape: tuple[int, ...] | None
    w: dict[str, np.ndarray | None]  # weights and biases, contiguous, the call's dtype (or _stored)
    batch: tuple[int, ...]
    dtype: np.dtype
    h: int
    n: int  # new tokens (queries)
    n_past: int
    r: int  # kv_lora_rank
    dr: int  # rotary features per head (and of the shared key)
    dn: int  # no-rope query/key features per head
    dv: int
    d_out: int
    m: _args.Masks
    cos: np.ndarray  # (B or 1, n, 1, d_rope / 2)
    sin: np.ndarray
    interleave: bool
    eps: float
    form: str  # "expanded" or "absorbed"
    stacked: bool  # absorbed, one query: heads as query rows of the one key head
    bf16: bool = False  # precision="bf16": every product's operands rounded to bfloat16

    @property
    def B(self) -> int:
        return V.count(self.batch)

    @property
    def n_k(self) -> int:
        return self.n_past + self.n


def _stored(a: np.ndarray, dtype: np.dtype) -> np.dtype:
    """The dtype an array of the call is kept in: its own half dtype (``_READ_AS_STORED``), else
    the call's."""
    return a.dtype if _half.is_half(a.dtype) else dtype


def _w(a: _Latent, name: str) -> np.ndarray:
    w = a.w[name]
    assert w is not None
    return w


def _cols(w: np.ndarray, name: str, heads: int, what: str) -> int:
    """The per-head width of ``w``'s columns (a multiple of ``heads``)."""
    if w.shape[1] % heads or w.shape[1] == 0:
        raise ValueError(
            f"{name}: expected {heads} heads of {what} columns (num_heads = {heads}), got "
            f"shape {V.shape_str(w.shape)}"
        )
    return w.shape[1] // heads


def _rows_of(w: np.ndarray, name: str, rows: int, layout: str, whose: str) -> None:
    if w.shape[0] != rows:
        raise ValueError(
            f"{name}: expected shape {layout} with {rows} rows ({whose}), got "
            f"{V.shape_str(w.shape)}"
        )


# The weight arguments, in the signature's order (the torch wrapper's tensors too).
WEIGHTS = (
    "w_q",
    "w_q_a",
    "b_q_a",
    "q_a_norm",
    "w_q_b",
    "w_kv_a",
    "b_kv_a",
    "kv_a_norm",
    "w_kv_b",
    "w_o",
    "b_o",
)


# what a forward reads as stored when it is in half precision: the matrices of its projections
# (the GEMM widens them as it packs them) and the cache (widened into the keys' array)
_READ_AS_STORED = ("w_q", "w_q_a", "w_q_b", "w_kv_a", "w_o", "cache")


def _prepare(args: dict[str, Any], keep_half: np.dtype | None = None) -> _Latent:
    """Validate a call, in an order that finds the root cause: the heads, the input, the
    key-value path (it fixes r and d_rope), the query path, the output, the cache, the masks,
    the rotary settings and the form. ``keep_half`` (the forward): the arrays of
    ``_READ_AS_STORED`` in that half dtype stay in it."""
    h = V.check_positive_int(args["num_heads"], "num_heads")
    x = V.as_array(args["x"], "x", keep_half)  # (in keep_half: its rows read as stored)
    V.check_ndim(x, "x", 2, "(..., n, d)")
    n, d = x.shape[-2:]
    if d < 1:
        raise ValueError(f"x: the feature axis must be >= 1, got shape {V.shape_str(x.shape)}")

    def given(k: str) -> np.ndarray | None:
        return V.optional_array(args[k], k, keep_half if k in _READ_AS_STORED else None)

    arrs = {k: given(k) for k in WEIGHTS}
    for k in ("w_kv_a", "kv_a_norm", "w_kv_b", "w_o"):
        if arrs[k] is None:
            raise TypeError(f"{k}: expected an array, got None")
    cache_in = given("cache")
    x_half = _half.is_half(x.dtype)
    dtype = V.result_dtype(_half.COMPUTED if x_half else x, cache_in, *arrs.values())
    bf16 = V.precision_bf16(args["precision"], dtype)
    for k in ("w_q", "w_q_a", "w_q_b", "w_kv_a", "w_kv_b", "w_o"):
        mat = arrs[k]
        if mat is not None:
            V.check_matrix(mat, k, "(in, out)", 0 if k == "w_o" else 1)
    # key-value path: w_kv_b's rows fix r, the rest of w_kv_a's columns the rotary key
    w_kv_b = arrs["w_kv_b"]
    assert w_kv_b is not None
    r = w_kv_b.shape[0]
    g_kv = arrs["kv_a_norm"]
    assert g_kv is not None
    if g_kv.shape != (r,):
        raise ValueError(
            f"kv_a_norm: expected shape (kv_lora_rank,) = ({r},) (w_kv_b's rows), got "
            f"{V.shape_str(g_kv.shape)}"
        )
    w_kv_a = arrs["w_kv_a"]
    assert w_kv_a is not None
    _rows_of(w_kv_a, "w_kv_a", d, "(d, kv_lora_rank + d_rope)", "x's features")
    dr = w_kv_a.shape[1] - r
    if dr < 2 or dr % 2:
        raise ValueError(
            f"w_kv_a: expected shape (d, kv_lora_rank + d_rope) = ({d}, {r} + d_rope) with an "
            f"even d_rope >= 2 (kv_lora_rank = {r} from w_kv_b), got {V.shape_str(w_kv_a.shape)}"
        )
    # query path
    lora = [k for k in ("w_q_a", "b_q_a", "q_a_norm", "w_q_b") if arrs[k] is not None]
    if arrs["w_q"] is not None:
        if lora:
            raise ValueError(
                f"w_q: given with {', '.join(lora)}; pass w_q (no query compression) or "
                f"w_q_a, q_a_norm and w_q_b (q_lora_rank), not both"
            )
        w_qh = arrs["w_q"]
        q_name = "w_q"
        _rows_of(w_qh, "w_q", d, "(d, num_heads * (d_nope + d_rope))", "x's features")
    else:
        for k in ("w_q_a", "q_a_norm", "w_q_b"):
            if arrs[k] is None:
                raise TypeError(
                    f"{k}: expected an array (queries: w_q, or w_q_a, q_a_norm and w_q_b), got None"
                )
        w_q_a, g_q, w_qb = arrs["w_q_a"], arrs["q_a_norm"], arrs["w_q_b"]
        assert w_q_a is not None and g_q is not None and w_qb is not None
        w_qh = w_qb
        _rows_of(w_q_a, "w_q_a", d, "(d, q_lora_rank)", "x's features")
        rq = w_q_a.shape[1]
        if g_q.shape != (rq,):
            raise ValueError(
                f"q_a_norm: expected shape (q_lora_rank,) = ({rq},) (w_q_a's columns), got "
                f"{V.shape_str(g_q.shape)}"
            )
        q_name = "w_q_b"
        _rows_of(
            w_qh, "w_q_b", rq, "(q_lora_rank, num_heads * (d_nope + d_rope))", "w_q_a's columns"
        )
    assert w_qh is not None
    dq = _cols(w_qh, q_name, h, "d_nope + d_rope")
    dn = dq - dr
    if dn < 1:
        raise ValueError(
            f"{q_name}: expected {h} heads of d_nope + d_rope columns with d_rope = {dr} (from "
            f"w_kv_a) and d_nope >= 1, got shape {V.shape_str(w_qh.shape)}"
        )
    dkv = _cols(w_kv_b, "w_kv_b", h, "d_nope + d_v")
    dv = dkv - dn
    if dv < 1:
        raise ValueError(
            f"w_kv_b: expected shape (kv_lora_rank, num_heads * (d_nope + d_v)) with d_nope = "
            f"{dn} (from {q_name}) and d_v >= 1, got {V.shape_str(w_kv_b.shape)}"
        )
    w_o = arrs["w_o"]
    assert w_o is not None
    _rows_of(
        w_o,
        "w_o",
        h * dv,
        "(num_heads * d_v, d_out)",
        f"d_v = {dv}: w_kv_b's {dn + dv} columns per head less d_nope = {dn} from {q_name}",
    )
    d_out = w_o.shape[1]
    w: dict[str, np.ndarray | None] = {}
    for k in ("w_q", "w_q_a", "q_a_norm", "w_q_b", "w_kv_a", "kv_a_norm", "w_kv_b", "w_o"):
        a_ = arrs[k]
        w[k] = None if a_ is None else _memory.contiguous(a_, _stored(a_, dtype))
    w["b_q_a"] = V.vector(
        arrs["b_q_a"], "b_q_a", dtype, 0 if w["w_q_a"] is None else w["w_q_a"].shape[1]
    )
    w["b_kv_a"] = V.vector(arrs["b_kv_a"], "b_kv_a", dtype, r + dr)
    w["b_o"] = V.vector(arrs["b_o"], "b_o", dtype, d_out)
    # the cache and the batch
    shapes = [("x", x.shape[:-2])]
    n_past = 0
    if cache_in is not None:
        if cache_in.ndim < 2 or cache_in.shape[-1] != r + dr:
            raise ValueError(
                f"cache: expected shape (..., n_past, kv_lora_rank + d_rope) = (..., n_past, "
                f"{r + dr}), got {V.shape_str(cache_in.shape)}"
            )
        n_past = cache_in.shape[-2]
        shapes.append(("cache", cache_in.shape[:-2]))
    batch = V.batch_shape(shapes)
    B = V.count(batch)
    cache = None
    if cache_in is not None:
        cache = _memory.contiguous(
            np.broadcast_to(cache_in, batch + cache_in.shape[-2:]).reshape(B, n_past, r + dr),
            _stored(cache_in, dtype),
        )
    n_k = n_past + n
    m = _args.masks(args, batch, h, n, n_k, dtype, 1.0 / math.sqrt(dn + dr))
    # rotary embeddings on the d_rope features: the new tokens' positions
    cos, sin = _tables(args, dr, n, n_past, batch, dtype)
    interleave = V.check_flag(args["rope_interleave"], "rope_interleave")
    eps = args["norm_eps"]
    eps = 1e-6 if eps is None else V.positive_real(eps, "norm_eps", none="1e-6")
    form = _form(args["form"], B, n, n_k, h, r, dn, dr, dv)
    stacked = (
        form == "absorbed"
        and n == 1
        and m.causal != 1
        and m.window == (-1, -1)
        and m.alibi is None
        and m.sinks is None
    )
    x_dtype = x.dtype if x_half else dtype  # rows of a half-precision x read as stored
    xr = V.rows(x, batch, x_dtype) if B * n else _memory.empty((0, d), dtype)
    return _Latent(
        xr,
        x.shape,
        cache,
        None if cache_in is None else cache_in.shape,
        w,
        batch,
        dtype,
        h,
        n,
        n_past,
        r,
        dr,
        dn,
        dv,
        d_out,
        m,
        cos,
        sin,
        interleave,
        eps,
        form,
        stacked,
        bf16,
    )


def _tables(
    args: dict[str, Any],
    dr: int,
    n: int,
    n_past: int,
    batch: tuple[int, ...],
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``(B or 1, n, 1, d_rope / 2)`` of the new tokens' positions (default
    ``n_past + arange(n)``), with ``rope_scale`` applied."""
    theta, inv = args["rope_theta"], args["rope_inv_freq"]
    if theta is None and inv is None:
        raise ValueError(
            "rope_theta: latent attention rotates d_rope features of its queries and shared "
            "key; pass rope_theta (the base) or rope_inv_freq (scaled frequencies)"
        )
    if theta is not None and inv is not None:
        raise ValueError(
            f"rope_theta: got {theta!r} with rope_inv_freq; pass one of them (rope_inv_freq "
            f"replaces the frequencies rope_theta ** (-2j / d_rope))"
        )
    scale = (
        1.0
        if args["rope_scale"] is None
        else V.positive_real(args["rope_scale"], "rope_scale", none="1")
    )
    if inv is not None:
        freq = _rope._inv_freq(inv, None, dr)
        if 2 * freq.shape[0] != dr:
            raise ValueError(
                f"rope_inv_freq: expected shape (d_rope / 2,) = ({dr // 2},), got "
                f"{V.shape_str(freq.shape)}"
            )
    else:
        freq = _rope.inverse_frequencies(V.positive_real(theta, "rope_theta"), dr)
    pos = args["positions"]
    if pos is None:
        p = np.arange(n_past, n_past + n, dtype=np.float64)[None]
    else:
        p = _rope._positions_array(pos, "positions", n, batch)
    cos, sin = _rope.tables(freq, p, dtype, scale)
    return cos, sin


def _form(form: Any, B: int, n: int, n_k: int, h: int, r: int, dn: int, dr: int, dv: int) -> str:
    if not isinstance(form, str) or form not in _FORMS:
        raise ValueError(f"form: expected 'auto', 'expanded' or 'absorbed', got {form!r}")
    if form != "auto":
        return form
    from .cost import _latent_core_macs

    e = _latent_core_macs("expanded", B, n, n_k, h, r, dn, dr, dv)
    a = _latent_core_macs("absorbed", B, n, n_k, h, r, dn, dr, dv)
    return "absorbed" if a < e else "expanded"


# -- rotation ---------------------------------------------------------------------------------


def _pairs(x: np.ndarray, interleave: bool) -> tuple[np.ndarray, np.ndarray]:
    """The two members of every rotated pair: ``(2j, 2j+1)`` (DeepSeek's interleaved layout)
    or ``(j, j + d/2)`` (``rotate_half``), as views."""
    if interleave:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _rotate(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool, inverse: bool = False
) -> None:
    """Rotate the pairs of ``x`` in place (``inverse``: the transpose, for gradients)."""
    _rope.rotate_pairs(*_pairs(x, interleave), cos, sin, inverse)


# -- forward ----------------------------------------------------------------------------------


class _State(NamedTuple):
    """What the forward computed and the backward reads (O(n d); no n x n)."""

    qa: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # q_a rows before the norm, its r, after
    q: np.ndarray  # (B, n, h, d_nope + d_rope), rotated
    kv_pre: tuple[np.ndarray, np.ndarray]  # c before the norm (B*n, r) and its r
    lat: np.ndarray  # (B, n_k, r + d_rope): the cache and the new tokens' latents
    core: dict[str, np.ndarray]  # the form's own: keys/values, absorbed queries, core output
    lse: np.ndarray
    ctx: np.ndarray  # (B*n, h*d_v)


def _gemm(a: np.ndarray, b: np.ndarray, bf16: bool = False) -> np.ndarray:
    return _rope._gemm(a, b, bf16)


def _linear(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    y_half: bool = False,
    bf16: bool = False,
) -> np.ndarray:
    """``x w + b``, with ``w`` float16 or bfloat16 read as stored (computed in float32), and so
    ``x`` when it is stored as ``w`` is; ``y_half``: ``y`` written in ``w``'s half dtype (rounded
    once, as the GEMM finishes each block); ``bf16``: both operands rounded to bfloat16 (from
    their stored values), the products summed in float32."""
    half = _half.is_half(w.dtype)
    x_half = half and x.dtype == w.dtype
    y_half = half and y_half
    y = _memory.empty((x.shape[0], w.shape[1]), np.float32 if half and not y_half else w.dtype)
    if y.size:
        if half:
            x_in = _memory.contiguous(x).view(np.uint16) if x_half else _memory.contiguous(x)
            y_out = y.view(np.uint16) if y_half else y
            code = _half.code(w.dtype)
            core.linear_forward(x_in, w.view(np.uint16), b, y_out, bf16, code, x_half, y_half)
        else:
            core.linear_forward(_memory.contiguous(x), w, b, y, bf16)
    return y


def _heads(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 2, 1, 3)


def _stacked_mask(a: _Latent) -> _args.CoreMask:
    """One query, heads as its rows: the mask of ``(B, 1, h, n_k)`` (the one query sees every
    key unless a mask says otherwise)."""
    m = a.m
    m4 = None if m.mask4 is None else np.swapaxes(m.mask4, 1, 2)
    return m._replace(causal=0, mask4=m4).core_mask()


# Keys per part of a stacked call (one query, heads as rows): parts of fewer than twice the
# kernel's decode split (use_decode in cpp/src/kernels/decode.hpp) run the flash tile when the
# heads fill a vector, which keeps the h query rows in registers across a key tile.
_KEY_PART = 512


def _stacked_forward(
    a: _Latent,
    qq: np.ndarray,
    lat: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    weights: np.ndarray | None,
) -> None:
    """Attention of one query's ``h`` heads, as the rows ``(B, 1, h, .)`` of the one key head,
    over the latents ``(B, n_k, r + d_rope)`` into ``out`` ``(B, 1, h, r)`` and ``lse``.

    Many keys are cut into parts of :data:`_KEY_PART` that run as one batch (the parts in
    parallel) and are merged by their log-sum-exps in a fixed order, whatever the thread
    count; a call that asks for the weights, carries a mask array or has bf16 products runs
    whole."""
    B, n_k, r, h = a.B, a.n_k, a.r, a.h
    cm = _stacked_mask(a)
    parts = n_k // _KEY_PART
    # bf16 runs whole: the kernel's decode split rounds each key block as it reads it, where
    # the tiles of parts would pack every part's keys to bf16 first
    if weights is not None or cm.mask is not None or parts < 2 or a.bf16:
        core.sdpa_forward(
            qq, lat[:, None], lat[:, None, :, :r], out, cm, a.m.scale, weights, lse, a.bf16
        )
        return
    whole = parts * _KEY_PART
    keys = lat[:, :whole].reshape(B * parts, 1, _KEY_PART, lat.shape[-1])
    rows = np.broadcast_to(qq[:, None], (B, parts) + qq.shape[1:]).reshape(
        keys.shape[:2] + qq.shape[2:]
    )
    kp = cm.key_padding_mask
    o = _memory.empty((B * parts, 1, h, r), a.dtype)
    s = _memory.empty((B * parts, 1, h), a.dtype)
    part_kp = None if kp is None else kp[:, :whole].reshape(B * parts, _KEY_PART)
    core.sdpa_forward(
        rows,
        keys,
        keys[..., :r],
        o,
        cm._replace(key_padding_mask=part_kp),
        a.m.scale,
        None,
        s,
        a.bf16,
    )
    outs = list(o.reshape(B, parts, h, r).transpose(1, 0, 2, 3))
    lses = list(s.reshape(B, parts, h).transpose(1, 0, 2))
    if whole < n_k:  # the last, shorter part
        o_t = _memory.empty((B, 1, h, r), a.dtype)
        s_t = _memory.empty((B, 1, h), a.dtype)
        tail = lat[:, None, whole:]
        core.sdpa_forward(
            qq,
            tail,
            tail[..., :r],
            o_t,
            cm._replace(key_padding_mask=None if kp is None else kp[:, whole:]),
            a.m.scale,
            None,
            s_t,
            a.bf16,
        )
        outs.append(o_t.reshape(B, h, r))
        lses.append(s_t.reshape(B, h))
    merged, merged_lse = merge_attention(outs, lses)
    out[...] = merged.reshape(out.shape)
    lse[...] = merged_lse.reshape(lse.shape)


def _run(a: _Latent, weights: np.ndarray | None) -> tuple[np.ndarray, _State]:
    """The forward: the output rows ``(B*n, d_out)`` and the state."""
    B, n, h, r, dr, dn, dtype = a.B, a.n, a.h, a.r, a.dr, a.dn, a.dtype
    w = a.w
    qa = None
    if w["w_q"] is not None:
        q = _linear(a.x, _w(a, "w_q"), None, bf16=a.bf16)
    else:
        pre = _linear(a.x, _w(a, "w_q_a"), w["b_q_a"], bf16=a.bf16)
        normed, rr = _rope.rms_norm(pre, _w(a, "q_a_norm"), a.eps)
        qa = (pre, rr, normed)
        q = _linear(normed, _w(a, "w_q_b"), None, bf16=a.bf16)
    q = q.reshape(B, n, h, dn + dr)
    _rotate(q[..., dn:], a.cos, a.sin, a.interleave)
    ckv = _linear(a.x, _w(a, "w_kv_a"), w["b_kv_a"], bf16=a.bf16)  # (B*n, r + d_rope)
    c_pre = _memory.copy(ckv[:, :r])
    c, rr_kv = _rope.rms_norm(c_pre, _w(a, "kv_a_norm"), a.eps)
    ckv[:, :r] = c
    new = ckv.reshape(B, n, r + dr)
    _rotate(new[..., r:], a.cos[:, :, 0], a.sin[:, :, 0], a.interleave)
    if a.cache is None:
        lat = new
    else:
        lat = _memory.empty((B, a.n_k, r + dr), dtype)
        if _half.is_half(a.cache.dtype):  # read as stored: widened into place
            for b in range(B):
                _half.widen_into(a.cache[b], lat[b, : a.n_past])
        elif a.cache.dtype == dtype:  # on the threads: one thread's copy held a decoding step back
            cache = _memory.contiguous(a.cache)
            core.copy_arrays([(lat[b, : a.n_past], cache[b]) for b in range(B)])
        else:
            lat[:, : a.n_past] = a.cache
        lat[:, a.n_past :] = new
    kv_pre = (c_pre, rr_kv)
    if a.form == "expanded":
        core_, lse, ctx = _expanded(a, q, lat, weights)
    else:
        core_, lse, ctx = _absorbed(a, q, lat, weights)
    # inputs read as stored: the output written so (the call stores it in their half dtype)
    out = _linear(ctx, _w(a, "w_o"), w["b_o"], y_half=_half.is_half(a.x.dtype), bf16=a.bf16)
    return out, _State(qa, q, kv_pre, lat, core_, lse, ctx)


def _expanded(
    a: _Latent, q: np.ndarray, lat: np.ndarray, weights: np.ndarray | None
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    B, n, n_k, h, r, dr, dn, dv, dtype = a.B, a.n, a.n_k, a.h, a.r, a.dr, a.dn, a.dv, a.dtype
    kv = _gemm(lat[..., :r].reshape(B * n_k, r), _w(a, "w_kv_b"), a.bf16)
    kv = kv.reshape(B, n_k, h, dn + dv)
    k = _memory.empty((B, n_k, h, dn + dr), dtype)
    k[..., :dn] = kv[..., :dn]
    k[..., dn:] = lat[:, :, None, r:]
    out = _memory.empty((B, h, n, dv), dtype)
    lse = a.m.empty_lse(B, h, n, dtype)
    if n_k:
        core.sdpa_forward(
            _heads(q),
            _heads(k),
            _heads(kv[..., dn:]),
            out,
            a.m.core_mask(),
            a.m.scale,
            weights,
            lse,
            a.bf16,
        )
    else:
        out.fill(0)
    ctx = _memory.copy(_heads(out)).reshape(B * n, h * dv)
    return {"k": k, "kv": kv, "out": out}, lse, ctx


# The absorbed form's per-head products (W_uk into the queries, W_uv after attention) run on
# NumPy's matmul while each is below OpenBLAS's threading threshold (m n k < 4 * 65536: a decode
# step), which then runs them on the calling thread without copying the weights; larger ones on
# attnlab's GEMM, head by head: OpenBLAS's threads would fight attnlab's for the cores.
_BLAS_SERIAL = 4 * 65536


def _split_kv_b(a: _Latent, views: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``W_uk`` ``(h, r, d_nope)`` and ``W_uv`` ``(h, r, d_v)``: each head's columns of
    ``w_kv_b``, as contiguous blocks (copied by rows) for attnlab's GEMM, or as views."""
    wkv = _w(a, "w_kv_b").reshape(a.r, a.h, a.dn + a.dv).transpose(1, 0, 2)
    w_uk, w_uv = wkv[..., : a.dn], wkv[..., a.dn :]
    return (w_uk, w_uv) if views else (_memory.copy(w_uk), _memory.copy(w_uv))


def _per_head(x: np.ndarray) -> np.ndarray:
    """``(B, n, h, k)`` -> ``(h, B*n, k)``."""
    B, n, h, k = x.shape
    return x.transpose(2, 0, 1, 3).reshape(h, B * n, k)


def _absorbed(
    a: _Latent, q: np.ndarray, lat: np.ndarray, weights: np.ndarray | None
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    B, n, n_k, h, r, dr, dn, dv, dtype = a.B, a.n, a.n_k, a.h, a.r, a.dr, a.dn, a.dv, a.dtype
    few = B * n * r * max(dn, dv) < _BLAS_SERIAL and not a.bf16  # (bf16: attnlab's GEMM)
    w_uk, w_uv = _split_kv_b(a, views=few)
    qn = _per_head(q[..., :dn])  # (h, B*n, d_nope)
    qq = _memory.empty((B, n, h, r + dr), dtype)
    if few:
        qq[..., :r] = np.matmul(qn, w_uk.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(B, n, h, r)
    else:
        for i in range(h):  # q_nope,i W_uk,i^T as (W_uk,i q_nope,i^T)^T: no transposed copy
            qq[:, :, i, :r] = _gemm(w_uk[i], qn[i].T, a.bf16).T.reshape(B, n, r)
    qq[..., r:] = q[..., dn:]
    keys = lat[:, None]
    values = lat[:, None, :, :r]
    if a.stacked:  # (B, n=1, h, .) is (B, kv head, h rows, .)
        out = _memory.empty((B, 1, h, r), dtype)
        lse = a.m.empty_lse(B, 1, h, dtype)
        wv = None if weights is None else weights.reshape(B, 1, h, n_k)
        if n_k:
            _stacked_forward(a, qq, lat, out, lse, wv)
        ctx_lat = out  # (B, n=1, h, r)
    else:
        out = _memory.empty((B, h, n, r), dtype)
        lse = a.m.empty_lse(B, h, n, dtype)
        if n_k:
            core.sdpa_forward(
                _heads(qq), keys, values, out, a.m.core_mask(), a.m.scale, weights, lse, a.bf16
            )
        ctx_lat = _heads(out)  # (B, n, h, r) view
    if not n_k:
        out.fill(0)
    cl = _per_head(ctx_lat)  # (h, B*n, r)
    ctx = _memory.empty((B * n, h * dv), dtype)
    if few:
        ctx.reshape(B * n, h, dv)[...] = np.matmul(cl, w_uv).transpose(1, 0, 2)
    else:
        for i in range(h):
            ctx[:, i * dv : (i + 1) * dv] = _gemm(cl[i], w_uv[i], a.bf16)
    return {"qq": qq, "out": out}, lse, ctx


def _new_cache(a: _Latent, st: _State, kept: bool) -> np.ndarray:
    """The cache after the call: the latents themselves (this call's own array), or a copy
    when attnlab.vjp keeps them for the pullback (a caller may write into the cache)."""
    lat = st.lat.reshape(a.batch + (a.n_k, a.r + a.dr))
    return lat.copy() if kept else lat


@_docs.filled
def latent_attention(
    x: Any,
    *,
    w_q: Any = None,
    w_q_a: Any = None,
    b_q_a: Any = None,
    q_a_norm: Any = None,
    w_q_b: Any = None,
    w_kv_a: Any,
    b_kv_a: Any = None,
    kv_a_norm: Any,
    w_kv_b: Any,
    w_o: Any,
    b_o: Any = None,
    num_heads: int,
    cache: Any = None,
    positions: Any = None,
    mask: Any = None,
    key_padding_mask: Any = None,
    causal: bool | str = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    scale: float | None = None,
    rope_theta: float | None = None,
    rope_inv_freq: Any = None,
    rope_scale: float | None = None,
    rope_interleave: bool = True,
    norm_eps: float | None = None,
    form: str = "auto",
    precision: str | None = None,
    return_weights: bool | str = False,
    return_lse: bool = False,
    return_cache: bool = False,
    warn_empty_rows: bool = True,
    _keep: dict[str, Any] | None = None,
) -> Any:
    """Multi-head latent attention (DeepSeek-V2/V3's MLA), as ``transformers``'
    ``DeepseekV3Attention`` / ``DeepseekV2Attention`` compute it.

    Queries ``q = x w_q`` (or, with query compression, ``q = rms(x w_q_a + b_q_a) * q_a_norm
    @ w_q_b``), per head ``[q_nope (d_nope) | q_rope (d_rope)]``. One latent per token,
    ``[c | k_rope] = x w_kv_a + b_kv_a``, with ``c <- rms(c) * kv_a_norm`` (``r`` features,
    kv_lora_rank) and ``k_rope`` a rotary key shared by every head. ``w_kv_b`` maps ``c`` to
    each head's ``[k_nope (d_nope) | value (d_v)]``. Head ``i`` attends with
    ``softmax(scale * ([q_nope,i | rot(q_rope,i)] . [k_nope,i | rot(k_rope)]) + mask)``, and
    ``out = concat_i(context_i) w_o + b_o``.

    Parameters
    ----------
    x : array_like, shape (..., n, d)
        The new tokens (self-attention; with ``cache``, they follow the cached ones).
    w_q : array_like, shape (d, num_heads * (d_nope + d_rope)), optional
        Query projection without compression (``q_lora_rank`` None); else pass ``w_q_a``,
        ``q_a_norm`` and ``w_q_b``.
    w_q_a : array_like, shape (d, q_lora_rank), optional
    b_q_a : array_like, shape (q_lora_rank,), optional
    q_a_norm : array_like, shape (q_lora_rank,), optional
        The query latent's RMSNorm weight.
    w_q_b : array_like, shape (q_lora_rank, num_heads * (d_nope + d_rope)), optional
    w_kv_a : array_like, shape (d, kv_lora_rank + d_rope)
        The key-value latent and, in its last ``d_rope`` columns, the shared rotary key.
    b_kv_a : array_like, shape (kv_lora_rank + d_rope,), optional
    kv_a_norm : array_like, shape (kv_lora_rank,)
        The latent's RMSNorm weight.
    w_kv_b : array_like, shape (kv_lora_rank, num_heads * (d_nope + d_v))
        Head ``i``'s columns ``i*(d_nope+d_v) : (i+1)*(d_nope+d_v)`` are its no-rope key
        (``W_uk,i``, first ``d_nope``) and its value (``W_uv,i``).
    w_o : array_like, shape (num_heads * d_v, d_out)
    b_o : array_like, shape (d_out,), optional
        Weights are ``(in_features, out_features)``: ``y = x @ w + b``.
    num_heads : int
    cache : array_like, shape (..., n_past, kv_lora_rank + d_rope), optional
        The past tokens' ``[c | rot(k_rope)]`` (normalised latent, rotated key), as
        ``return_cache=True`` returns it. The keys are the cached tokens, then ``x``'s.
    positions : array_like, shape (..., n), optional
        Positions of ``x``'s tokens for the rotary embeddings; default ``n_past + arange(n)``.
    mask : array_like of bool or float, optional
        Broadcasts to ``(..., h, n, n_past + n)``; ``True`` means *may attend*, floats are
        added to the scaled scores. ``nn.MultiheadAttention``'s boolean masks mean the
        opposite (``True`` = masked out): convert them with
        :func:`attnlab.interop.torch_masks`.
    key_padding_mask : array_like of bool, optional
        ``(..., n_past + n)``, ``True`` for real tokens (the opposite of
        ``nn.MultiheadAttention``'s ``key_padding_mask``).
    causal : bool or {"top_left", "bottom_right"}
        As for :func:`attnlab.multi_head_attention`, over ``n`` queries and ``n_past + n``
        keys: decoding against a cache is ``"bottom_right"`` (``True`` equals it without a
        cache).
    {window}
    {logit_options}
    scale : float, optional
        Defaults to ``1 / sqrt(d_nope + d_rope)``; DeepSeek's YaRN configs multiply it by
        ``mscale**2`` (:func:`attnlab.interop.from_transformers` does).
    rope_theta : float, optional
        Rotary base; or ``rope_inv_freq``, shape ``(d_rope / 2,)`` (scaled frequencies, e.g.
        YaRN's), and ``rope_scale`` (multiplies cos and sin, YaRN's ``attention_factor``).
        One of ``rope_theta`` and ``rope_inv_freq`` is required.
    rope_interleave : bool
        ``True`` (DeepSeek's layout): feature pairs ``(2j, 2j+1)`` of the rotary parts rotate
        by ``p * inv_freq[j]``; ``False``: ``(j, j + d_rope/2)`` (``rotate_half``). The cache
        holds the rotated key in this layout.
    norm_eps : float, optional
        Epsilon of both RMSNorms; default ``1e-6`` (transformers' for these norms).
    form : {"auto", "expanded", "absorbed"}
        The evaluation order (equal to rounding): ``"expanded"`` up-projects every key and
        value and runs multi-head attention; ``"absorbed"`` folds ``W_uk`` into the queries and
        ``W_uv`` into the output, attending over the latents as multi-query attention (one key
        head of width ``kv_lora_rank + d_rope``). ``"auto"``: the one with fewer multiply-adds
        (:func:`attnlab.cost.plan_latent`): absorbed to decode, expanded for prefill.
    precision : {None, "bf16"}, optional
        ``None``: exact in the input dtype. ``"bf16"`` (float32 or half-precision inputs):
        every product (the projections, ``w_kv_b``'s up-projection or the absorbed form's
        per-head ``W_uk``, ``W_uv`` products, the attention core as
        :func:`scaled_dot_product_attention`'s ``precision="bf16"``) rounds both operands to
        bfloat16 and sums in float32, on ``VDPBF16PS`` or AMX tiles where the CPU has them
        and emulated elsewhere; the norms and rotations stay float32. The rounding points are
        the form's, so the two forms differ at the order of bfloat16's unit roundoff,
        ``2**-8``. Gradients (``latent_attention_backward``, ``vjp``) take float32 products
        over the bf16 forward's values, the attention's at its rounded operands.
    return_weights : bool or {"heads", "mean"}
        Also return the attention weights ``(..., h, n, n_past + n)`` (or their mean).
    return_cache : bool
        Also return the cache after this call, ``(..., n_past + n, kv_lora_rank + d_rope)``,
        last in the tuple. A gradient flows from it when its cotangent comes with the
        output's, as the pair ``(grad_out, grad_cache)``, to :func:`latent_attention_backward`
        or an :func:`attnlab.vjp` pullback (training through several decode steps).
    warn_empty_rows : bool
        As for :func:`attnlab.multi_head_attention`.

    Returns
    -------
    out : ndarray, shape (..., n, d_out)
    weights, lse, cache : ndarray, optional
        In this order, those asked for.

    Notes
    -----
    Composed in Python from attnlab's C++ GEMM and flash attention core (O(n d) memory
    unless the weights are asked for). Fully masked rows give an output of ``b_o``.
    {dtypes_mixed}

    {examples}
    >>> h, d, r, dn, dr, dv = 4, 32, 16, 8, 4, 8
    >>> w = dict(w_q=rng.standard_normal((d, h * (dn + dr))) / 6,
    ...          w_kv_a=rng.standard_normal((d, r + dr)) / 6, kv_a_norm=np.ones(r),
    ...          w_kv_b=rng.standard_normal((r, h * (dn + dv))) / 4,
    ...          w_o=rng.standard_normal((h * dv, d)) / 6)
    >>> x = rng.standard_normal((2, 5, d))
    >>> out, cache = attnlab.latent_attention(x, **w, num_heads=h, rope_theta=1e4,
    ...                                       causal=True, return_cache=True)
    >>> step = attnlab.latent_attention(x[:, -1:] * 0.5, **w, num_heads=h, rope_theta=1e4,
    ...                                 cache=cache, causal="bottom_right")
    >>> out.shape, cache.shape, step.shape
    ((2, 5, 32), (2, 5, 20), (2, 1, 32))
    """
    args = _sig.arguments(locals())
    half = _half.storage(args)
    a = _prepare(args, half)
    mode = V.weights_mode(return_weights)
    lse_wanted = V.check_flag(return_lse, "return_lse")
    cache_wanted = V.check_flag(return_cache, "return_cache")
    B, h, n = a.B, a.h, a.n
    weights = _memory.zeros((B, h, n, a.n_k), a.dtype) if mode else None
    if B * n:
        out, st = _run(a, weights)
    else:
        out, st = _memory.zeros((B * n, a.d_out), a.dtype), None
    if _keep is not None:
        _keep.update(prepared=_memory.owned(a), state=st, halves=_half.halves(args))
    lse = None
    if lse_wanted:
        lse = a.m.empty_lse(B, h, n, a.dtype) if st is None else st.lse.reshape(B, h, n)
    result = _args.with_weights(out, weights, mode, a.batch, (n, a.d_out), lse, half)
    if not cache_wanted:
        return result
    if st is not None:
        new_cache = _new_cache(a, st, _keep is not None)
    elif a.cache is not None:
        new_cache = a.cache.reshape(a.batch + a.cache.shape[1:]).copy()
    else:
        new_cache = _memory.zeros(a.batch + (0, a.r + a.dr), a.dtype)
    new_cache = _half.store(new_cache, half)  # a half-precision cache stays one
    return (*result, new_cache) if isinstance(result, tuple) else (result, new_cache)


# -- backward ---------------------------------------------------------------------------------


def _cotangents(g: Any, a: _Latent) -> tuple[Any, np.ndarray | None]:
    """``grad_out``, or the pair ``(grad_out, grad_cache)``: the cotangents of the output and of
    the cache ``return_cache`` returns, the latter as ``(B, n_k, r + d_rope)`` (or None)."""
    if not isinstance(g, tuple):
        return g, None
    if len(g) != 2:
        raise ValueError(
            f"grad_out: expected an array or the pair (grad_out, grad_cache), got a tuple of "
            f"{len(g)}"
        )
    if g[1] is None:
        return g[0], None
    gc = V.as_array(g[1], "grad_cache")
    expected = a.batch + (a.n_k, a.r + a.dr)
    if gc.shape != expected:
        raise ValueError(
            f"grad_cache: expected the returned cache's shape {V.shape_str(expected)}, got "
            f"{V.shape_str(gc.shape)}"
        )
    return g[0], _memory.contiguous(gc.reshape(a.B, a.n_k, a.r + a.dr), a.dtype)


def _grads(a: _Latent, st: _State | None, grad_out: Any) -> dict[str, np.ndarray]:
    """The gradients of a prepared call from its state (``None``: recompute it); ``grad_out``
    may carry the cache's cotangent too (:func:`_cotangents`)."""
    B, n, h, dtype = a.B, a.n, a.h, a.dtype
    grad_out, g_cache = _cotangents(grad_out, a)
    # read as stored when it is in the half dtype the output is stored in
    out_half = a.x.dtype if _half.is_half(a.x.dtype) else None
    go = _grad.grad_out_rows(grad_out, a.batch + (n, a.d_out), dtype, keep=out_half)
    go = _half.from_bits(go, out_half if go.dtype == np.uint16 else None)
    given = {k: v for k, v in a.w.items() if v is not None}
    kernel = B * n > 0
    new = _memory.empty if kernel else _memory.zeros  # _backward writes every element
    # the matrices kept in a half dtype (_READ_AS_STORED): their gradients written so by the
    # one GEMM that makes each (linear_grads); the others rounded on exit
    grads = {k: new(v.shape, _stored(v, dtype)) for k, v in given.items()}
    if not kernel:
        grads["x"] = _memory.zeros(a.x.shape, dtype)  # (else _backward's own)
    if a.cache is not None:
        grads["cache"] = new(a.cache.shape, dtype)
    logit = _grad.logit_buffers(a.m, B, h, n, a.n_k, dtype)
    if kernel:
        if st is None:
            st = _run(a, None)[1]
        _backward(a, st, go, grads, logit, g_cache)
    elif g_cache is not None and a.cache is not None:  # no new token: the cache passes through
        grads["cache"][...] = g_cache
    out = {k: v for k, v in grads.items() if k not in ("x", "cache")}
    out["x"] = _grad.unbroadcast(grads["x"].reshape(a.batch + (n, a.x.shape[1])), a.x_shape)
    if a.cache is not None:
        assert a.cache_shape is not None
        g = grads["cache"].reshape(a.batch + a.cache.shape[1:])
        out["cache"] = _grad.unbroadcast(g, a.cache_shape)
    out.update(_grad.logit_grads(logit, a.m, a.batch))
    return out


def _backward(
    a: _Latent,
    st: _State,
    go: np.ndarray,
    grads: dict[str, np.ndarray],
    logit: dict[str, np.ndarray],
    g_cache: np.ndarray | None,
) -> None:
    B, n, h, r, dr, dn, dv = a.B, a.n, a.h, a.r, a.dr, a.dn, a.dv
    w = a.w
    g_ctx = _memory.empty((B * n, h * dv), a.dtype)
    _grad.linear_grads(st.ctx, _w(a, "w_o"), go, g_ctx, grads["w_o"], grads.get("b_o"))
    g_ctx = g_ctx.reshape(B, n, h, dv)
    if a.form == "expanded":
        dq, dlat = _expanded_backward(a, st, g_ctx, grads, logit)
    else:
        dq, dlat = _absorbed_backward(a, st, g_ctx, grads, logit)
    if g_cache is not None:  # the returned cache holds every latent as attention read it
        dlat += g_cache
    if a.cache is not None:
        grads["cache"][...] = dlat[:, : a.n_past]
    dnew = _memory.copy(dlat[:, a.n_past :]).reshape(B * n, r + dr)
    # the new tokens' latents: inverse rotation of the key, the norm of c
    _rotate(dnew.reshape(B, n, r + dr)[..., r:], a.cos[:, :, 0], a.sin[:, :, 0], a.interleave, True)
    dc, grads["kv_a_norm"][...] = _rope.rms_norm_backward(
        dnew[:, :r], *st.kv_pre, _w(a, "kv_a_norm")
    )
    dnew[:, :r] = dc
    dx = _memory.empty(a.x.shape, a.dtype)
    _grad.linear_grads(a.x, _w(a, "w_kv_a"), dnew, dx, grads["w_kv_a"], grads.get("b_kv_a"))
    # the queries: inverse rotation, then the projection(s)
    _rotate(dq[..., dn:], a.cos, a.sin, a.interleave, True)
    dq2 = dq.reshape(B * n, h * (dn + dr))
    if w["w_q"] is not None:
        _grad.linear_grads(a.x, _w(a, "w_q"), dq2, dx, grads["w_q"], accumulate=True)
    else:
        assert st.qa is not None
        pre, rr, normed = st.qa
        dn_ = _memory.empty(normed.shape, a.dtype)
        _grad.linear_grads(normed, _w(a, "w_q_b"), dq2, dn_, grads["w_q_b"])
        dpre, grads["q_a_norm"][...] = _rope.rms_norm_backward(dn_, pre, rr, _w(a, "q_a_norm"))
        w_q_a = _w(a, "w_q_a")
        _grad.linear_grads(a.x, w_q_a, dpre, dx, grads["w_q_a"], grads.get("b_q_a"), True)
    grads["x"] = dx


def _core_backward(
    a: _Latent,
    st: _State,
    g: np.ndarray,
    qkv: tuple[np.ndarray, np.ndarray, np.ndarray],
    mask: _args.CoreMask,
    d_qkv: tuple[np.ndarray, np.ndarray, np.ndarray],
    d_logit: tuple[np.ndarray | None, np.ndarray | None],
) -> None:
    """The attention core's backward in either form: ``d_qkv`` from the gradient ``g`` of its
    output and its inputs ``qkv``, with the output and log-sum-exp the forward kept in ``st``;
    ``d_logit``: the buffers of the mask's and the sinks' gradients (``None``: not wanted).
    With bf16 products it recomputes the softmax at the rounded operands (in buffers of its
    own: the forward's output and log-sum-exp, of rounded probabilities, stay as they are)."""
    out, lse = st.core["out"], st.lse
    if a.bf16:
        out, lse = _memory.empty(out.shape, out.dtype), _memory.empty(lse.shape, lse.dtype)
    core.sdpa_backward(g, *qkv, mask, a.m.scale, out, lse, *d_qkv, a.bf16, *d_logit, a.bf16)


def _expanded_backward(
    a: _Latent,
    st: _State,
    g_ctx: np.ndarray,
    grads: dict[str, np.ndarray],
    logit: dict[str, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    B, n, n_k, h, r, dr, dn, dv, dtype = a.B, a.n, a.n_k, a.h, a.r, a.dr, a.dn, a.dv, a.dtype
    k, kv = st.core["k"], st.core["kv"]
    dq = _memory.zeros((B, h, n, dn + dr), dtype)
    dk = _memory.zeros((B, h, n_k, dn + dr), dtype)
    dvv = _memory.zeros((B, h, n_k, dv), dtype)
    if n_k:
        _core_backward(
            a,
            st,
            _memory.kernel_ready(_heads(g_ctx)),
            (_heads(st.q), _heads(k), _heads(kv[..., dn:])),
            a.m.core_mask(),
            (dq, dk, dvv),
            (logit.get("mask"), logit.get("sinks")),
        )
    dkv = _memory.empty((B, n_k, h, dn + dv), dtype)
    dkv[..., :dn] = _heads(dk)[..., :dn]
    dkv[..., dn:] = _heads(dvv)
    dkv2 = dkv.reshape(B * n_k, h * (dn + dv))
    c_all = st.lat.reshape(B * n_k, r + dr)[:, :r]  # rows of their own stride, read in place
    dlat = _memory.empty((B, n_k, r + dr), dtype)
    dc = dlat.reshape(B * n_k, r + dr)[:, :r]
    _grad.linear_grads(c_all, _w(a, "w_kv_b"), dkv2, dc, grads["w_kv_b"])
    dlat[..., r:] = dk[..., dn:].sum(axis=1)
    return _memory.copy(_heads(dq)), dlat


def _absorbed_backward(
    a: _Latent,
    st: _State,
    g_ctx: np.ndarray,
    grads: dict[str, np.ndarray],
    logit: dict[str, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    B, n, n_k, h, r, dr, dn, dv, dtype = a.B, a.n, a.n_k, a.h, a.r, a.dr, a.dn, a.dv, a.dtype
    w_uk, w_uv = _split_kv_b(a)
    qq, out = st.core["qq"], st.core["out"]
    ctx_lat = out if a.stacked else _heads(out)  # (B, n, h, r)
    cl = _per_head(ctx_lat)  # (h, B*n, r)
    gh = _per_head(g_ctx)  # (h, B*n, d_v)
    gw = grads["w_kv_b"].reshape(r, h, dn + dv)
    g_lat = _memory.empty((B, n, h, r), dtype)
    for i in range(h):  # ctx_i = ctx_lat,i W_uv,i
        gw[:, i, dn:] = _gemm(cl[i].T, gh[i])
        g_lat[:, :, i] = _gemm(w_uv[i], gh[i].T).T.reshape(B, n, r)
    keys = st.lat[:, None]
    values = st.lat[:, None, :, :r]
    dk = _memory.zeros((B, 1, n_k, r + dr), dtype)
    dvv = _memory.zeros((B, 1, n_k, r), dtype)
    if a.stacked:
        dqq = _memory.zeros((B, 1, h, r + dr), dtype)
        dm = logit.get("mask")
        dm_view = None if dm is None else _memory.zeros((B, 1, h, n_k), dtype)
        if n_k:
            _core_backward(
                a, st, g_lat, (qq, keys, values), _stacked_mask(a), (dqq, dk, dvv), (dm_view, None)
            )
        if dm is not None and dm_view is not None:
            dm[...] = dm_view.reshape(dm.shape)
        dqq_rows = dqq  # (B, n=1, h, .)
    else:
        dqq = _memory.zeros((B, h, n, r + dr), dtype)
        if n_k:
            _core_backward(
                a,
                st,
                _memory.copy(_heads(g_lat)),
                (_heads(qq), keys, values),
                a.m.core_mask(),
                (dqq, dk, dvv),
                (logit.get("mask"), logit.get("sinks")),
            )
        dqq_rows = _heads(dqq)
    dlat = dk[:, 0]
    dlat[..., :r] += dvv[:, 0]
    # q_lat = q_nope W_uk^T per head
    dql = _per_head(dqq_rows[..., :r])  # (h, B*n, r)
    qn = _per_head(st.q[..., :dn])  # (h, B*n, d_nope)
    dq = _memory.empty((B, n, h, dn + dr), dtype)
    for i in range(h):
        gw[:, i, :dn] = _gemm(dql[i].T, qn[i])
        dq[:, :, i, :dn] = _gemm(dql[i], w_uk[i]).reshape(B, n, dn)
    dq[..., dn:] = dqq_rows[..., r:]
    return dq, dlat


_BACKWARD_DOC = """\
    {forward_parameters}
        As for :func:`latent_attention`
        {mask_polarity}
        ``return_weights``, ``return_lse`` and ``return_cache`` are accepted and ignored:
        gradients flow from the output, and from the returned cache when ``grad_out`` is the
        pair ``(grad_out, grad_cache)`` (``grad_cache`` shaped like the cache
        ``return_cache=True`` returns, ``(..., n_past + n, kv_lora_rank + d_rope)``).
        Positions, boolean masks and key padding are not differentiated (a float mask is).

    Returns
    -------
    dict
        Keyed by argument name: ``"x"``, every weight, bias and norm weight given, ``"cache"``
        when given, ``"mask"`` (a float mask) and ``"sinks"`` when given.

    {examples}
    >>> h, d, r, dn, dr, dv = 2, 16, 8, 4, 4, 4
    >>> w = dict(w_q=rng.standard_normal((d, h * (dn + dr))) / 4,
    ...          w_kv_a=rng.standard_normal((d, r + dr)) / 4, kv_a_norm=np.ones(r),
    ...          w_kv_b=rng.standard_normal((r, h * (dn + dv))) / 3,
    ...          w_o=rng.standard_normal((h * dv, d)) / 3)
    >>> g = attnlab.latent_attention_backward(np.ones((3, d)), rng.standard_normal((3, d)),
    ...                                      **w, num_heads=h, rope_theta=1e4)
    >>> sorted(g)
    ['kv_a_norm', 'w_kv_a', 'w_kv_b', 'w_o', 'w_q', 'x']
    """


def _latent_backward(grad_out: Any, args: dict[str, Any]) -> dict[str, np.ndarray]:
    V.weights_mode(args["return_weights"])
    V.check_flag(args["return_lse"], "return_lse")
    V.check_flag(args["return_cache"], "return_cache")
    a = _prepare(args, _half.storage(args))  # half-precision arrays read as stored
    return _half.store_grads(_grads(a, None, grad_out), _half.halves(args))


latent_attention_backward = _sig.backward_of(
    latent_attention, _latent_backward, "(..., n, d_out)", _BACKWARD_DOC
)
