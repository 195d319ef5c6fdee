"""T5's relative position bias as a float ``mask``: :func:`t5_position_bias`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _docs
from .. import _validate as V
from ._common import _flag, _weight_array

__all__ = ["t5_position_bias"]


@_docs.filled
def t5_position_bias(
    module: Any,
    n_q: int,
    n_k: int | None = None,
    *,
    query_offset: int = 0,
    bidirectional: bool | None = None,
) -> np.ndarray:
    """A ``T5Attention``'s relative position bias as attnlab's float ``mask``.

    T5 (and its descendants: mT5, T5 v1.1, UMT5's first layer, LongT5's local attention) adds a
    learned bias per head and per bucket of relative distance ``j - i`` to the unscaled logits
    (T5 attends with ``scale=1``). The first layer of each stack owns the table
    (``has_relative_attention_bias``) and its bias is reused by the stack's other layers.
    Passed as ``mask=``, the bias is differentiated with the float-mask gradient of
    ``multi_head_attention_backward`` (summed back to this shape), so the table can be
    trained by scattering that gradient into its buckets.

    Parameters
    ----------
    module : T5Attention
        The attention module that owns the table (``relative_attention_bias``).
    n_q, n_k : int
        Query and key counts (``n_k`` defaults to ``n_q``).
    query_offset : int
        Position of the first query among the keys (decoding with a cache: the number of
        cached tokens), as ``compute_bias``' ``past_seen_tokens``.
    bidirectional : bool, optional
        Buckets for both signs of ``j - i`` (encoders) or only the past (decoders); defaults
        to ``not module.is_decoder``, as the module does.

    Returns
    -------
    ndarray, shape (h, n_q, n_k)
        The bias (the table's dtype; bfloat16 becomes float32), equal to the module's
        ``compute_bias(n_q, n_k)[0]``.

    Raises
    ------
    ValueError
        A module without a relative attention table, or bad lengths.

    Notes
    -----
    The buckets are computed in float32, as transformers computes them, so that bucket
    boundaries fall where they fall for the module.

    {interop_examples}
    >>> from attnlab.interop import t5_position_bias
    >>> from transformers import T5Config
    >>> from transformers.models.t5.modeling_t5 import T5Attention
    >>> cfg = T5Config(d_model=32, d_kv=8, num_heads=4)
    >>> att = T5Attention(cfg, has_relative_attention_bias=True)
    >>> bias = t5_position_bias(att, 6)
    >>> bias.shape
    (4, 6, 6)
    >>> w = {f"w_{p}": getattr(att, p).weight.detach().numpy().T for p in "qkvo"}
    >>> x = np.ones((6, 32), np.float32)
    >>> attnlab.multi_head_attention(x, num_heads=4, scale=1.0, mask=bias, **w).shape
    (6, 32)
    """
    emb = getattr(module, "relative_attention_bias", None)
    if emb is None or not getattr(module, "has_relative_attention_bias", True):
        raise ValueError(
            f"module: {type(module).__name__} has no relative_attention_bias table; pass the "
            f"attention of the first layer of the stack (the one that owns it)"
        )
    nq = V.check_positive_int(n_q, "n_q", 0)
    nk = nq if n_k is None else V.check_positive_int(n_k, "n_k", 0)
    off = V.check_positive_int(query_offset, "query_offset", 0)
    bidi = (
        (not module.is_decoder) if bidirectional is None else _flag(bidirectional, "bidirectional")
    )
    table = _weight_array(emb.weight, "relative_attention_bias.weight")  # (num_buckets, h)
    num_buckets = int(module.relative_attention_num_buckets)
    max_distance = int(module.relative_attention_max_distance)
    rel = np.arange(nk)[None, :] - (np.arange(nq)[:, None] + off)
    buckets = np.zeros(rel.shape, dtype=np.int64)
    if bidi:
        num_buckets //= 2
        buckets += (rel > 0) * num_buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):  # log(0) in the rows the small branch takes
        large = np.log(rel.astype(np.float32) / np.float32(max_exact))
    large = (
        large / np.float32(math.log(max_distance / max_exact)) * np.float32(num_buckets - max_exact)
    )
    large_bucket = max_exact + np.where(rel < max_exact, 0, large).astype(np.int64)
    large_bucket = np.minimum(large_bucket, num_buckets - 1)
    buckets += np.where(rel < max_exact, rel, large_bucket)
    return np.ascontiguousarray(np.moveaxis(table[buckets], -1, 0))
