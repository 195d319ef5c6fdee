"""Plain NumPy float64 efficient additive attention (SwiftFormer): the oracle for the tests.

Written to read like the papers' equations and the official PyTorch modules, line by line:
materialises ``G * K`` and every intermediate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _additive as _public
from .. import _signature as _sig
from .._validate import POOLED_ROWS, warn_empty
from ._mha import _bf16, _bias, _f64

__all__ = ["additive_attention"]


def _normalize(v: np.ndarray, axis: int, eps: float) -> np.ndarray:
    """``v / max(||v||_2, eps)`` along ``axis``, as ``torch.nn.functional.normalize``."""
    norm = np.sqrt(np.sum(v * v, axis=axis, keepdims=True))
    return v / np.maximum(norm, eps)


def _real_tokens(args: Mapping[str, Any], batch: tuple[int, ...], n: int) -> np.ndarray:
    """(..., n, 1) boolean, True for the tokens the call's ``key_padding_mask`` lets take part
    in the pooling; unless ``warn_empty_rows=False``, attnlab's warning for the sequences
    (n > 0) that have none."""
    key_padding_mask = args["key_padding_mask"]
    if key_padding_mask is None:
        return np.ones(batch + (n, 1), dtype=bool)
    kp = np.broadcast_to(np.asarray(key_padding_mask, dtype=bool), batch + (n,))
    if args["warn_empty_rows"] and n:
        warn_empty(int(np.sum(~kp.any(axis=-1))), int(np.prod(batch)), POOLED_ROWS)
    return kp[..., None]


@_sig.reference_of(_public.additive_attention)
def additive_attention(args: dict[str, Any]) -> np.ndarray:
    """Reference for :func:`attnlab.additive_attention` (float64): SwiftFormer's efficient
    additive attention.

    Written as the paper's equations, materialising ``G * K``.

    {parameters}

    {reference_pooled_returns}

    {reference_examples}
    >>> w = {k: rng.standard_normal((8, 8)) / 3 for k in ("w_q", "w_k", "w_proj", "w_final")}
    >>> reference.additive_attention(rng.standard_normal((2, 49, 8)), w_g=np.ones((8, 1)),
    ...                              **w).shape
    (2, 49, 8)
    """
    x, w_final, eps, scale = _f64(args["x"]), _f64(args["w_final"]), args["eps"], args["scale"]
    n = x.shape[-2]
    # precision="bf16": each weight product's operands rounded to bfloat16 (products exact here)
    rnd = _bf16 if args["precision"] == "bf16" else (lambda a: a)
    query = rnd(x) @ rnd(_f64(args["w_q"])) + _bias(args["b_q"])
    key = rnd(x) @ rnd(_f64(args["w_k"])) + _bias(args["b_k"])
    query = _normalize(query, -1, eps)  # (..., n, D)
    key = _normalize(key, -1, eps)
    real = _real_tokens(args, x.shape[:-2], n)  # (..., n, 1)
    variant = args["variant"]
    if variant == "official":
        s = scale if scale is not None else w_final.shape[1] ** -0.5
        a = (query @ _f64(args["w_g"]).reshape(-1, 1)) * s  # (..., n, 1)
        a = np.where(real, a, 0.0)  # padded tokens are left out of the norm
        a = _normalize(a, -2, eps)  # L2 over the tokens, not a softmax
    elif variant == "hf":
        a = np.ones(query.shape[:-1] + (1,))  # softmax over a singleton axis
    else:
        raise ValueError(f"variant: expected 'official' or 'hf', got {variant!r}")
    G = np.sum(np.where(real, a * query, 0.0), axis=-2, keepdims=True)  # (..., 1, D)
    out = rnd(G * key) @ rnd(_f64(args["w_proj"])) + _bias(args["b_proj"]) + query
    return rnd(out) @ rnd(w_final) + _bias(args["b_final"])
