"""Rotary position embeddings (RoPE) and q/k norms for multi_head_attention: validation and
tables (the C++ call applies them), and the NumPy forms latent attention and attnlab.dask
compose.

Convention (that of Hugging Face ``transformers``, ``rotate_half``): within the first ``r =
rope_dim`` features of each query and key head, feature ``j < r/2`` is paired with feature
``j + r/2`` and the pair is rotated by the angle ``p * theta ** (-2j / r)`` for a token at
position ``p``::

    x[j]       <- x[j] cos - x[j + r/2] sin
    x[j + r/2] <- x[j + r/2] cos + x[j] sin

Features ``r..d_head`` pass unchanged (partial rotary, as GPT-NeoX and Phi).

Scaled rotary embeddings (transformers' ``rope_type`` ``linear``, ``llama3``, ``yarn``,
``longrope``, ``dynamic``) are given as their inverse frequencies ``rope_inv_freq`` (``r/2``
angles per unit of position, replacing ``theta ** (-2j / r)``) and ``rope_scale``, the factor
that multiplies cos and sin (transformers' ``attention_factor``).

Per-head RMSNorm of queries and keys (``q_norm``, ``k_norm``, Qwen3 and Gemma 3) runs after the
projection and before the rotation: ``x * (mean(x**2) + norm_eps) ** -0.5 * w`` over each
head's ``d_head`` features.

Multi-head attention normalises and rotates each projected query and key head inside its one
C++ call (``mha_forward`` / ``mha_backward`` with ``core.QkArgs``: :func:`core_qk`), after the
projection GEMMs, forward and backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import _memory
from . import _validate as V
from ._loader import core

if TYPE_CHECKING:
    from ._mha import _Mha

__all__: list[str] = []  # private module


class Rope(NamedTuple):
    """The rotation tables, broadcastable to ``(B, n, 1, r/2)`` (B may be 1)."""

    dim: int  # r, features rotated per head
    cos_q: np.ndarray
    sin_q: np.ndarray
    cos_k: np.ndarray
    sin_k: np.ndarray


class QkOptions(NamedTuple):
    """What a multi-head call adds to its projections: rotation tables and q/k norms, and
    whether its products are bf16 (``precision="bf16"``)."""

    rope: Rope | None
    q_norm: np.ndarray | None  # (d_head,), the call's dtype
    k_norm: np.ndarray | None
    eps: float
    bf16: bool = False

    def transforms(self) -> bool:
        """Whether Q and K are normalised or rotated."""
        return self.rope is not None or self.q_norm is not None or self.k_norm is not None

    def owned(self) -> QkOptions:
        """With private copies of the norm weights (attnlab.vjp keeps them for its pullback;
        the tables are the call's own)."""
        own = lambda w: None if w is None else w.copy()  # noqa: E731
        return self._replace(q_norm=own(self.q_norm), k_norm=own(self.k_norm))


def core_qk(c: QkOptions | None) -> core.QkArgs | None:
    """The norms and rotary tables of ``c`` for the C++ call (``None``: neither)."""
    if c is None or not c.transforms():
        return None
    r = c.rope
    tables: dict[str, np.ndarray | None] = dict.fromkeys(("cos_q", "sin_q", "cos_k", "sin_k"))
    if r is not None:  # (B or 1, n, 1, r/2) -> (B or 1, n, r/2)
        for name in tables:
            t = getattr(r, name)
            tables[name] = t.reshape(t.shape[0], t.shape[1], t.shape[3])
    return core.QkArgs(
        q_norm=c.q_norm,
        k_norm=c.k_norm,
        norm_eps=c.eps,
        rope_dim=0 if r is None else r.dim,
        **tables,
    )


def _positions_array(p: Any, name: str, n: int, batch: tuple[int, ...]) -> np.ndarray:
    """Token positions as float64 ``(B or 1, n)``."""
    try:
        a = np.asarray(p)
    except Exception as exc:  # noqa: BLE001 (any array-like: __array__ may raise anything)
        raise TypeError(f"{name}: could not be converted to an array ({exc})") from None
    if a.dtype.kind not in "iuf" or a.dtype.kind == "b":
        raise TypeError(f"{name}: expected integer or real token positions, got dtype {a.dtype}")
    if a.ndim < 1 or a.shape[-1] != n:
        raise ValueError(
            f"{name}: expected shape (..., {n}) (one position per token), got "
            f"{V.shape_str(a.shape)}"
        )
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: positions must be finite")
    lead = a.shape[:-1]
    try:
        np.broadcast_shapes(lead, batch)
    except ValueError:
        raise ValueError(
            f"{name}: shape {V.shape_str(a.shape)} does not broadcast to the "
            f"batch {V.shape_str(batch)} + (n,)"
        ) from None
    if not lead or V.count(lead) == 1:
        return a.reshape(1, n)
    return np.broadcast_to(a, batch + (n,)).reshape(V.count(batch), n)


def resolve_positions(
    positions: Any, n_q: int, n_k: int, causal: int, batch: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Query and key positions, ``(B or 1, n_q)`` and ``(B or 1, n_k)``, float64.

    ``None``: keys ``arange(n_k)``, queries aligned as the causal mask aligns them
    (``arange(n_q) + n_k - n_q`` for ``"bottom_right"``, ``arange(n_q)`` otherwise). One array
    ``(..., n_k)``: the positions of the key tokens; query ``i`` takes that of the key it is
    aligned with (the same rule). A pair ``(query_positions, key_positions)``: each given.
    """
    offset = n_k - n_q if causal == 2 else 0
    if isinstance(positions, tuple):
        if len(positions) != 2:
            raise ValueError(
                f"positions: expected an array or a pair (query_positions, "
                f"key_positions), got a tuple of {len(positions)}"
            )
        return (
            _positions_array(positions[0], "positions[0] (queries)", n_q, batch),
            _positions_array(positions[1], "positions[1] (keys)", n_k, batch),
        )
    if positions is None:
        pk = np.arange(n_k, dtype=np.float64)[None]
        return np.arange(offset, offset + n_q, dtype=np.float64)[None], pk
    pk = _positions_array(positions, "positions", n_k, batch)
    if offset < 0 or offset + n_q > n_k:
        raise ValueError(
            f"positions: {n_q} queries cannot be aligned with {n_k} keys "
            f"(causal={'bottom_right' if causal == 2 else 'top_left/False'}); pass a pair "
            f"(query_positions, key_positions)"
        )
    return pk[:, offset : offset + n_q], pk


def inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """``theta ** (-2j / dim)`` for ``j < dim/2``, float64."""
    return np.asarray(theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim))


def tables(
    inv_freq: np.ndarray, pos: np.ndarray, dtype: np.dtype, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """``scale`` times cos and sin of the angles ``pos * inv_freq``, ``(B or 1, n, 1, r/2)``,
    computed in float64 and rounded once to ``dtype``."""
    ang = pos[:, :, None, None] * inv_freq
    return (scale * np.cos(ang)).astype(dtype), (scale * np.sin(ang)).astype(dtype)


def _inv_freq(rope_inv_freq: Any, rope_dim: Any, d_head: int) -> np.ndarray:
    """``rope_inv_freq`` checked: finite reals, shape ``(r/2,)`` with ``r <= d_head`` (and
    ``r == rope_dim`` when that is given); float64."""
    f = V.as_array(rope_inv_freq, "rope_inv_freq").astype(np.float64)
    if f.ndim != 1 or not 1 <= 2 * f.shape[0] <= d_head:
        raise ValueError(
            f"rope_inv_freq: expected shape (r/2,) with 2 <= r <= d_head = {d_head} (one "
            f"frequency per rotated pair of features), got {V.shape_str(f.shape)}"
        )
    if not np.all(np.isfinite(f)):
        raise ValueError("rope_inv_freq: expected finite frequencies")
    if rope_dim is not None and V.check_positive_int(rope_dim, "rope_dim") != 2 * f.shape[0]:
        raise ValueError(
            f"rope_dim: got {rope_dim}, but rope_inv_freq {V.shape_str(f.shape)} rotates "
            f"r = {2 * f.shape[0]} features (rope_dim may be omitted)"
        )
    return f


def prepare(
    rope_theta: Any,
    rope_dim: Any,
    positions: Any,
    d_head: int,
    n_q: int,
    n_k: int,
    causal: int,
    batch: tuple[int, ...],
    dtype: np.dtype,
    rope_inv_freq: Any = None,
    rope_scale: Any = None,
) -> Rope | None:
    """Validate the rotary arguments; ``None`` when ``rope_theta`` and ``rope_inv_freq`` are
    both ``None`` (off)."""
    if rope_theta is None and rope_inv_freq is None:
        for name, val in (
            ("rope_dim", rope_dim),
            ("positions", positions),
            ("rope_scale", rope_scale),
        ):
            if val is not None:
                raise ValueError(
                    f"{name}: given without rope_theta or rope_inv_freq (rotary embeddings "
                    f"are off when both are None)"
                )
        return None
    scale = (
        1.0 if rope_scale is None else V.positive_real(rope_scale, "rope_scale", none="1: unscaled")
    )
    if rope_inv_freq is not None:
        if rope_theta is not None:
            raise ValueError(
                f"rope_theta: got {rope_theta!r} with rope_inv_freq; pass one of them "
                f"(rope_inv_freq replaces the frequencies rope_theta ** (-2j / r))"
            )
        inv = _inv_freq(rope_inv_freq, rope_dim, d_head)
        return _rope_for(inv, positions, n_q, n_k, causal, batch, dtype, scale)
    theta = V.positive_real(rope_theta, "rope_theta")
    if rope_dim is None:
        if d_head % 2:
            raise ValueError(
                f"rope_dim: d_head = {d_head} is odd, and rotary embeddings "
                f"rotate pairs of features; pass an even rope_dim <= {d_head}"
            )
        dim = d_head
    else:
        dim = V.check_positive_int(rope_dim, "rope_dim")
        if dim % 2 or dim > d_head:
            raise ValueError(f"rope_dim: expected an even number <= d_head = {d_head}, got {dim}")
    inv = inverse_frequencies(theta, dim)
    return _rope_for(inv, positions, n_q, n_k, causal, batch, dtype, scale)


# Tables of the default positions 0..n-1, by (frequencies, n, dtype, scale): read-only, shared
# by the calls of a loop (computing cos and sin took longer than the rotation itself); at most
# 8 of at most 4 MiB each.
_DEFAULT_TABLES: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
_DEFAULT_TABLE_BYTES = 4 << 20


def _rope_for(
    inv: np.ndarray,
    positions: Any,
    n_q: int,
    n_k: int,
    causal: int,
    batch: tuple[int, ...],
    dtype: np.dtype,
    scale: float,
) -> Rope:
    """The tables of ``positions`` (see :func:`resolve_positions`) for frequencies ``inv``."""
    dim = 2 * inv.shape[0]
    offset = n_k - n_q if causal == 2 else 0  # the queries' first default position
    if positions is not None or offset < 0:
        pq, pk = resolve_positions(positions, n_q, n_k, causal, batch)
        return Rope(dim, *tables(inv, pq, dtype, scale), *tables(inv, pk, dtype, scale))
    n = max(n_k, offset + n_q)
    key = (inv.tobytes(), n, np.dtype(dtype).str, scale)
    cached = _DEFAULT_TABLES.get(key)  # (one lookup: another thread may clear the dict)
    if cached is None:
        cached = tables(inv, np.arange(n, dtype=np.float64)[None], dtype, scale)
        cached[0].flags.writeable = cached[1].flags.writeable = False
        if 2 * cached[0].nbytes <= _DEFAULT_TABLE_BYTES:
            if len(_DEFAULT_TABLES) >= 8:
                _DEFAULT_TABLES.clear()
            _DEFAULT_TABLES[key] = cached
    c, s = cached
    q = slice(offset, offset + n_q)
    return Rope(dim, c[:, q], s[:, q], c[:, :n_k], s[:, :n_k])


def _norm_weight(w: Any, name: str, d_head: int, dtype: np.dtype) -> np.ndarray | None:
    if w is None:
        return None
    a = V.as_array(w, name)
    if a.shape != (d_head,):
        raise ValueError(
            f"{name}: expected shape ({d_head},) (one weight per feature of a head, d_head = "
            f"{d_head}), got {V.shape_str(a.shape)}"
        )
    return _memory.contiguous(a, dtype)


def prepare_for(a: _Mha, args: dict[str, Any]) -> QkOptions | None:
    """The QkOptions of a prepared multi-head call (``args``: the call's arguments by name),
    validated; ``None`` when the call has no rotary embeddings, q/k norm or bf16 products."""
    w_q = a.w["w_q"]
    assert w_q is not None  # (biases are optional, weights never)
    d_head = w_q.shape[1] // a.h
    rope = prepare(
        args["rope_theta"],
        args["rope_dim"],
        args["positions"],
        d_head,
        a.n_q,
        a.n_k,
        a.m.causal,
        a.batch,
        a.dtype,
        args["rope_inv_freq"],
        args["rope_scale"],
    )
    q_norm = _norm_weight(args["q_norm"], "q_norm", d_head, a.dtype)
    k_norm = _norm_weight(args["k_norm"], "k_norm", d_head, a.dtype)
    bf16 = V.precision_bf16(args["precision"], a.dtype)
    eps = args["norm_eps"]
    if q_norm is None and k_norm is None:
        if eps is not None:
            raise ValueError("norm_eps: given without q_norm or k_norm")
        if rope is None and not bf16:
            return None
    eps = 1e-6 if eps is None else V.positive_real(eps, "norm_eps", none="1e-6")
    return QkOptions(rope, q_norm, k_norm, eps, bf16)


def rotate(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dim: int, inverse: bool = False
) -> None:
    """Rotate ``x`` ``(B, n, heads, d_head)`` in place; ``inverse`` applies the transpose."""
    half = dim // 2
    rotate_pairs(x[..., :half], x[..., half:dim], cos, sin, inverse)


def rotate_pairs(
    x1: np.ndarray, x2: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False
) -> None:
    """Rotate the pairs ``(x1, x2)`` (two views of one array) in place by the angles of
    ``cos`` and ``sin``; ``inverse`` applies the transpose (for gradients)."""
    if inverse:
        sin = -sin
    a = x1 * cos - x2 * sin
    x2 *= cos
    x2 += x1 * sin
    x1[...] = a


def _project(
    rows: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    B: int,
    n: int,
    heads: int,
    bf16: bool = False,
    w_half: int = 0,
    x_half: bool = False,
) -> np.ndarray:
    """``rows w + b`` by the C++ GEMM (bf16 products with ``bf16``), viewed as
    ``(B, n, heads, d_head)``; ``w_half``: ``w`` as float16 (1) / bfloat16 (2) bits, and the
    rows too with ``x_half`` (read as stored; the result float32)."""
    y = _memory.empty((rows.shape[0], w.shape[1]), np.float32 if w_half else w.dtype)
    if y.size:
        core.linear_forward(rows, w, b, y, bf16, w_half, x_half)
    return y.reshape(B, n, heads, w.shape[1] // heads)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``x * r * w`` over the last axis with ``r = (mean(x**2) + eps) ** -0.5``; and ``r``."""
    r = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + x.dtype.type(eps))
    return x * r * w, r


def rms_norm_backward(
    g: np.ndarray, x: np.ndarray, r: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gradients of :func:`rms_norm` for ``g``: ``(d x, d w)``."""
    gw = g * w
    dx = r * gw - x * (r**3 * np.mean(gw * x, axis=-1, keepdims=True))
    dw = (g * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dw


def _gemm(a: np.ndarray, b: np.ndarray, bf16: bool = False) -> np.ndarray:
    """``a @ b`` by attnlab's GEMM (its threads; NumPy's BLAS threads spin when the machine is
    shared, which made this backward 2-3x slower); transposed operands are copied, O(n d).
    ``bf16``: both operands rounded to bfloat16, the products summed in float32."""
    a, b = _memory.contiguous(a), _memory.contiguous(b)
    y = _memory.empty((a.shape[0], b.shape[1]), b.dtype)
    if y.size:
        if a.shape[1]:
            core.linear_forward(a, b, None, y, bf16)
        else:
            y.fill(0)
    return y
