"""MobileViT-v2's ``LinearSelfAttention`` (ml-cvnets, timm, Hugging Face) in:
:func:`from_mobilevitv2`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _docs
from .. import _validate as V
from ._common import _copy, _list, _put, _Scope, _t

_MOBILEVIT_STYLES = ("", "block.conv.", "convolution.")  # timm, ml-cvnets, transformers


@_docs.filled
def from_mobilevitv2(
    state_dict: Mapping[str, Any],
    *,
    prefix: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments of :func:`attnlab.separable_attention` from MobileViT-v2's attention.

    Reads the 1x1 convolutions ``qkv_proj`` ``(1 + 2d, d, 1, 1)`` and ``out_proj``
    ``(d_out, d, 1, 1)`` of ``LinearSelfAttention`` with their biases, under any of the names
    ``qkv_proj.weight`` (timm), ``qkv_proj.block.conv.weight`` (apple/ml-cvnets) and
    ``qkv_proj.convolution.weight`` (Hugging Face ``MobileViTV2LinearSelfAttention``).
    2-D ``(out, in)`` weights are accepted too.

    Parameters
    ----------
    state_dict : mapping of str to array_like or torch.Tensor
        The attention module's ``state_dict()``, or a larger dict holding it under a prefix.
    prefix : str, optional
        Take the keys starting with this prefix; by default found from the key names.

    Returns
    -------
    dict
        ``w_qkv (d, 1 + 2d)``, ``b_qkv``, ``w_o (d, d_out)``, ``b_o`` (biases when present).

    Notes
    -----
    The module works on unfolded maps ``(B, C, P, N)``: call
    ``separable_attention(fmap.transpose(0, 2, 3, 1), **kwargs).transpose(0, 3, 1, 2)``.

    {interop_examples}
    >>> from attnlab.interop import from_mobilevitv2
    >>> rng = np.random.default_rng(0)
    >>> d = 8
    >>> sd = {"qkv_proj.weight": rng.standard_normal((1 + 2 * d, d, 1, 1)) / 3,
    ...       "out_proj.weight": rng.standard_normal((d, d, 1, 1)) / 3}
    >>> kwargs = from_mobilevitv2(sd)
    >>> fmap = rng.standard_normal((2, d, 4, 16))
    >>> attnlab.separable_attention(fmap.transpose(0, 2, 3, 1), **kwargs).shape
    (2, 4, 16, 8)
    """
    anchors = tuple(f"qkv_proj.{st}weight" for st in _MOBILEVIT_STYLES)
    s = _Scope(state_dict, anchors, prefix, "MobileViT-v2 LinearSelfAttention")
    styles = [st for st in _MOBILEVIT_STYLES if f"qkv_proj.{st}weight" in s]
    if len(styles) != 1:
        raise ValueError(
            f"state_dict: expected one qkv_proj weight, got "
            f"{_list([s.full(f'qkv_proj.{st}weight') for st in styles])}"
        )
    st = styles[0]

    def conv(name: str) -> np.ndarray:
        w = s.array(name, (2, 4))
        if w.ndim == 4:
            if w.shape[2:] != (1, 1):
                raise ValueError(
                    f"{s.full(name)}: expected a 1x1 convolution (out, in, 1, 1), "
                    f"got shape {V.shape_str(w.shape)}"
                )
            w = w[:, :, 0, 0]
        return w

    wqkv = conv(f"qkv_proj.{st}weight")
    d = wqkv.shape[1]
    if wqkv.shape != (1 + 2 * d, d):
        raise ValueError(
            f"{s.full(f'qkv_proj.{st}weight')}: expected shape (1 + 2 d, d, 1, 1) "
            f"= ({1 + 2 * d}, {d}, 1, 1), got {V.shape_str(wqkv.shape)}"
        )
    bqkv = s.optional(f"qkv_proj.{st}bias")
    if bqkv is not None:
        s.expect(f"qkv_proj.{st}bias", bqkv, (1 + 2 * d,), "1 + 2 d")
    wo = conv(f"out_proj.{st}weight")
    if wo.shape[1] != d:
        raise ValueError(
            f"{s.full(f'out_proj.{st}weight')}: expected shape (d_out, d = {d}, "
            f"1, 1), got {V.shape_str(wo.shape)}"
        )
    bo = s.optional(f"out_proj.{st}bias")
    if bo is not None:
        s.expect(f"out_proj.{st}bias", bo, (wo.shape[0],), "d_out")
    s.finish()
    out: dict[str, Any] = {"w_qkv": _t(wqkv), "w_o": _t(wo)}
    return _put(out, b_qkv=_copy(bqkv), b_o=_copy(bo))
