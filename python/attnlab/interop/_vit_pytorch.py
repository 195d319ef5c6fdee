"""vit-pytorch (lucidrains) ``Attention`` in: :func:`from_vit_pytorch`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _docs
from .. import _validate as V
from ._common import _copy, _flag, _list, _put, _Scope, _t


@_docs.filled
def from_vit_pytorch(
    state_dict: Mapping[str, Any],
    heads: int,
    *,
    prefix: str | None = None,
    ignore_norm: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of :func:`attnlab.multi_head_attention` from vit-pytorch's ``Attention``.

    lucidrains' vit-pytorch ``Attention(dim, heads, dim_head)`` holds ``to_qkv.weight``
    ``(3 * inner, dim)`` (no bias; ``inner = heads * dim_head``; queries, keys and values are
    its three row blocks, head ``i`` the ``i``-th ``dim_head`` slice of each) and
    ``to_out.0.weight`` ``(dim, inner)`` / ``to_out.0.bias``. When ``heads == 1`` and
    ``dim_head == dim`` it has no output projection (``to_out`` is ``nn.Identity``): then
    ``w_o`` is the identity. ``to_out.weight`` (a bare Linear) and a ``to_qkv.bias`` are also
    accepted. Its scale ``dim_head ** -0.5`` is attnlab's default.

    Parameters
    ----------
    state_dict : mapping of str to array_like or torch.Tensor
        ``attn.state_dict()``, or a larger dict holding it under a prefix.
    heads : int
        The module's ``heads``.
    prefix : str, optional
        Take the keys starting with this prefix (``"transformer.layers.0.0."``); by default
        found from the key names.
    ignore_norm : bool
        Recent vit-pytorch versions start ``Attention.forward`` with a ``LayerNorm``
        (``norm.weight``, ``norm.bias``), which attention does not include. By default such a
        state dict is refused; with ``ignore_norm=True`` the norm keys are skipped and you apply
        the LayerNorm to ``x`` yourself before the call.

    Returns
    -------
    dict
        ``w_q, w_k, w_v (dim, inner)``, ``w_o (inner, dim)``, the biases present and
        ``num_heads``.

    {interop_examples}
    >>> from attnlab.interop import from_vit_pytorch
    >>> rng = np.random.default_rng(0)
    >>> dim, heads, dim_head = 16, 2, 4
    >>> sd = {"to_qkv.weight": rng.standard_normal((3 * heads * dim_head, dim)) / 4,
    ...       "to_out.0.weight": rng.standard_normal((dim, heads * dim_head)) / 3,
    ...       "to_out.0.bias": np.zeros(dim)}
    >>> kwargs = from_vit_pytorch(sd, heads=heads)
    >>> attnlab.multi_head_attention(rng.standard_normal((2, 5, dim)), **kwargs).shape
    (2, 5, 16)
    """
    h = V.check_positive_int(heads, "heads")
    skip_norm = _flag(ignore_norm, "ignore_norm")
    s = _Scope(state_dict, ("to_qkv.weight",), prefix, "vit-pytorch Attention")
    norm = [k for k in ("norm.weight", "norm.bias") if k in s]
    if norm and not skip_norm:
        raise ValueError(
            f"state_dict: {_list([s.full(k) for k in norm])}: this Attention applies a "
            "LayerNorm to x before attending, which multi_head_attention does not include; pass "
            "ignore_norm=True and normalise x yourself (x = (x - mean) / sqrt(var + 1e-5) * "
            "norm.weight + norm.bias over the last axis)"
        )
    s.used.update(norm)
    w = s.array("to_qkv.weight", (2,))
    if w.shape[0] % 3 or w.shape[0] == 0:
        raise ValueError(
            f"{s.full('to_qkv.weight')}: expected shape (3 * inner, dim), got "
            f"{V.shape_str(w.shape)}"
        )
    inner = w.shape[0] // 3
    if inner % h:
        raise ValueError(
            f"heads: inner = {inner} (to_qkv.weight rows / 3) is not divisible by heads = {h}"
        )
    b = s.optional("to_qkv.bias")
    if b is not None:
        s.expect("to_qkv.bias", b, (3 * inner,), "3 * inner")
    out: dict[str, Any] = {
        "w_q": _t(w[:inner]),
        "w_k": _t(w[inner : 2 * inner]),
        "w_v": _t(w[2 * inner :]),
    }
    if b is not None:
        _put(out, b_q=_copy(b[:inner]), b_k=_copy(b[inner : 2 * inner]), b_v=_copy(b[2 * inner :]))
    lin = next((p for p in ("to_out.0.", "to_out.") if p + "weight" in s), None)
    if lin is None:
        stray = [s.full(k) for k in s.items if k.startswith("to_out.")]
        if stray:
            raise ValueError(f"state_dict: {_list(stray)} without a to_out weight")
        out["w_o"] = np.eye(inner, dtype=w.dtype)  # to_out is nn.Identity (project_out False)
    else:
        wo = s.array(lin + "weight", (2,))
        s.expect(lin + "weight", wo, (wo.shape[0], inner), f"dim, inner = {inner}")
        out["w_o"] = _t(wo)
        bo = s.optional(lin + "bias")
        if bo is not None:
            s.expect(lin + "bias", bo, (wo.shape[0],), "dim")
        _put(out, b_o=_copy(bo))
    s.finish()
    out["num_heads"] = h
    return out
