"""Plain NumPy float64 multi-head latent attention (DeepSeek's MLA): the oracle for the tests.

Written as ``transformers``' ``DeepseekV3Attention`` computes it: the latent up-projected to
every head's keys and values (the expanded form), one head at a time, the full score matrix.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _latent as _public
from .. import _signature as _sig
from ._mha import _bf16, _bias, _context, _f64, _with_weights, attention_weights

__all__ = ["latent_attention"]


def _rms(x: np.ndarray, w: Any, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(w)


def _rotary(x: np.ndarray, angles: np.ndarray, scale: float, interleave: bool) -> np.ndarray:
    """Rotate the pairs of ``x`` (``(2j, 2j+1)`` interleaved, else ``(j, j + d/2)``) by
    ``angles[..., j]``, cos and sin times ``scale``; a new array."""
    cos, sin = scale * np.cos(angles), scale * np.sin(angles)
    out = x.copy()
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = b * cos + a * sin
    return out


@_sig.reference_of(_public.latent_attention)
def latent_attention(args: dict[str, Any]) -> Any:
    """Reference for :func:`attnlab.latent_attention` (float64): the expanded form, head by
    head, whatever ``form`` says (with ``precision="bf16"``, the expanded form's operands
    rounded: every product's, not the probabilities).

    {parameters}

    {reference_attention_returns}
    cache : ndarray, shape (..., n_past + n, kv_lora_rank + d_rope)
        Only with ``return_cache``.

    {reference_examples}
    >>> h, d, r, dn, dr, dv = 2, 16, 8, 4, 4, 4
    >>> w = dict(w_q=rng.standard_normal((d, h * (dn + dr))),
    ...          w_kv_a=rng.standard_normal((d, r + dr)), kv_a_norm=np.ones(r),
    ...          w_kv_b=rng.standard_normal((r, h * (dn + dv))),
    ...          w_o=rng.standard_normal((h * dv, d)))
    >>> reference.latent_attention(rng.standard_normal((3, d)), **w, num_heads=h,
    ...                            rope_theta=1e4).shape
    (3, 16)
    """
    x = _f64(args["x"])
    # precision="bf16": each product's operands rounded to bfloat16 (products exact here)
    rnd = _bf16 if args["precision"] == "bf16" else (lambda a: a)
    h = int(args["num_heads"])
    eps = 1e-6 if args["norm_eps"] is None else float(args["norm_eps"])
    w_kv_b = _f64(args["w_kv_b"])
    r = w_kv_b.shape[0]
    w_kv_a = _f64(args["w_kv_a"])
    dr = w_kv_a.shape[1] - r
    if args["w_q"] is not None:
        q = rnd(x) @ rnd(_f64(args["w_q"]))
    else:
        pre = rnd(x) @ rnd(_f64(args["w_q_a"])) + _bias(args["b_q_a"])
        qa = _rms(pre, args["q_a_norm"], eps)
        q = rnd(qa) @ rnd(_f64(args["w_q_b"]))
    dq = q.shape[-1] // h
    dn = dq - dr
    dv = w_kv_b.shape[1] // h - dn
    ckv = rnd(x) @ rnd(w_kv_a) + _bias(args["b_kv_a"])
    c = _rms(ckv[..., :r], args["kv_a_norm"], eps)
    k_rope = ckv[..., r:]
    n = x.shape[-2]
    cache = None if args["cache"] is None else _f64(args["cache"])
    n_past = 0 if cache is None else cache.shape[-2]
    # rotary angles of the new tokens
    if args["rope_inv_freq"] is not None:
        inv = _f64(args["rope_inv_freq"])
    else:
        inv = 1.0 / float(args["rope_theta"]) ** (np.arange(0, dr, 2, dtype=np.float64) / dr)
    pos = args["positions"]
    p = np.arange(n_past, n_past + n, dtype=np.float64) if pos is None else _f64(pos)
    angles = p[..., None] * inv  # (..., n, d_rope / 2)
    rs = 1.0 if args["rope_scale"] is None else float(args["rope_scale"])
    inter = bool(args["rope_interleave"])
    k_rope = _rotary(k_rope, angles, rs, inter)
    new = np.concatenate([c, k_rope], axis=-1)
    if cache is not None:
        batch = np.broadcast_shapes(new.shape[:-2], cache.shape[:-2])
        lat = np.concatenate(
            [
                np.broadcast_to(cache, batch + cache.shape[-2:]),
                np.broadcast_to(new, batch + new.shape[-2:]),
            ],
            axis=-2,
        )
    else:
        lat = new
    kv = rnd(lat[..., :r]) @ rnd(w_kv_b)
    scale = 1.0 / math.sqrt(dq) if args["scale"] is None else float(args["scale"])
    scores, values = [], []
    for i in range(h):
        q_i = q[..., i * dq : (i + 1) * dq]
        q_i = np.concatenate([q_i[..., :dn], _rotary(q_i[..., dn:], angles, rs, inter)], axis=-1)
        kv_i = kv[..., i * (dn + dv) : (i + 1) * (dn + dv)]
        k_i = np.concatenate([kv_i[..., :dn], lat[..., r:]], axis=-1)
        values.append(rnd(kv_i[..., dn:]))
        scores.append(scale * (rnd(q_i) @ np.swapaxes(rnd(k_i), -1, -2)))
    batch = np.broadcast_shapes(q.shape[:-2], lat.shape[:-2])
    full = np.broadcast_to(np.stack(scores, axis=-3), batch + (h, n, lat.shape[-2]))
    logits, allowed, prob, lse = attention_weights(args, full)
    reads = allowed & ~np.isneginf(logits)
    ctx = np.concatenate(
        [_context(prob[..., i, :, :], values[i], reads[..., i, :, :]) for i in range(h)], axis=-1
    )
    out = rnd(ctx) @ rnd(_f64(args["w_o"])) + _bias(args["b_o"])
    result = _with_weights(out, prob, args, lse)
    if args["return_cache"]:
        result = (*result, lat) if isinstance(result, tuple) else (result, lat)
    return result
