"""Plain NumPy float64 separable self-attention (MobileViT-v2): the oracle for the tests.

Written to read like the paper's equations and the official PyTorch module, line by line.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _separable as _public
from .. import _signature as _sig
from ._additive import _real_tokens
from ._mha import _bf16, _bias, _f64

__all__ = ["separable_attention"]


@_sig.reference_of(_public.separable_attention)
def separable_attention(args: dict[str, Any]) -> np.ndarray:
    """Reference for :func:`attnlab.separable_attention` (float64): MobileViT-v2's separable
    self-attention.

    {parameters}

    {reference_pooled_returns}

    {reference_examples}
    >>> x = rng.standard_normal((2, 16, 8))
    >>> reference.separable_attention(x, w_qkv=rng.standard_normal((8, 17)),
    ...                               w_o=rng.standard_normal((8, 4))).shape
    (2, 16, 4)
    """
    x = _f64(args["x"])
    d = x.shape[-1]
    n = x.shape[-2]
    # precision="bf16": each weight product's operands rounded to bfloat16 (products exact here)
    rnd = _bf16 if args["precision"] == "bf16" else (lambda a: a)
    qkv = rnd(x) @ rnd(_f64(args["w_qkv"])) + _bias(args["b_qkv"])
    s, k, v = qkv[..., :1], qkv[..., 1 : 1 + d], qkv[..., 1 + d :]
    real = _real_tokens(args, x.shape[:-2], n)  # (..., n, 1)
    s = np.where(real, s, -np.inf)
    m = np.max(s, axis=-2, keepdims=True, initial=-np.inf)  # initial: n may be 0
    m = np.where(np.isneginf(m), 0.0, m)  # no real token (or all -inf): avoid -inf - -inf
    e = np.where(real, np.exp(s - m), 0.0)
    z = np.sum(e, axis=-2, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
    c = np.where(np.isnan(z), np.nan, c)
    ctx = np.sum(np.where(real, c * k, 0.0), axis=-2, keepdims=True)  # (..., 1, d)
    return rnd(np.maximum(v, 0.0) * ctx) @ rnd(_f64(args["w_o"])) + _bias(args["b_o"])
