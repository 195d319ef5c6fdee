"""PyTorch's ``attn_mask`` / ``key_padding_mask`` in: :func:`torch_masks`."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as V
from ._common import _mask_array


def torch_masks(
    attn_mask: Any = None,
    key_padding_mask: Any = None,
    *,
    num_heads: int | None = None,
) -> dict[str, np.ndarray]:
    """PyTorch ``nn.MultiheadAttention`` masks as attnlab's ``mask`` and ``key_padding_mask``.

    PyTorch's boolean masks mark the positions *not* allowed to attend (``True`` = masked out);
    attnlab's mark those allowed (``True`` = may attend, as in
    ``F.scaled_dot_product_attention``), so boolean masks are inverted. Float masks are added to
    the scaled scores in both and pass unchanged.

    Parameters
    ----------
    attn_mask : array_like or torch.Tensor of bool or float, optional
        ``(L, S)``, or ``(N * num_heads, L, S)`` (then ``num_heads`` is needed, unless the first
        axis is 1).
    key_padding_mask : array_like or torch.Tensor of bool or float, optional
        ``(N, S)`` or ``(S,)``; ``True`` marks padding. A float one is additive: it is merged
        into ``mask`` as ``(N, 1, 1, S)`` (a boolean ``attn_mask`` then becomes 0 / -inf).
    num_heads : int, optional
        Splits a 3-D ``attn_mask`` into ``(N, num_heads, L, S)``.

    Returns
    -------
    dict
        ``{"mask": ..., "key_padding_mask": ...}``, only the entries given, ready for
        ``multi_head_attention(..., **torch_masks(...))``: ``mask`` broadcasts to
        ``(N, h, L, S)``, ``key_padding_mask`` is boolean ``(N, S)``, ``True`` for real tokens.

    Notes
    -----
    Query rows with every key masked give zeros in attnlab (output ``b_o``) where PyTorch may
    give NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.interop import torch_masks
    >>> causal = np.triu(np.ones((3, 3), dtype=bool), k=1)   # torch: True = masked out
    >>> torch_masks(attn_mask=causal)["mask"]
    array([[ True, False, False],
           [ True,  True, False],
           [ True,  True,  True]])
    """
    out: dict[str, np.ndarray] = {}
    mask: np.ndarray | None = None
    if attn_mask is not None:
        m = _mask_array(attn_mask, "attn_mask")
        if m.ndim == 3 and m.shape[0] != 1:
            if num_heads is None:
                raise ValueError(
                    f"num_heads: needed to split a 3-D attn_mask (N * num_heads, L, S), got "
                    f"shape {V.shape_str(m.shape)}"
                )
            h = V.check_positive_int(num_heads, "num_heads")
            if m.shape[0] % h:
                raise ValueError(
                    f"attn_mask: the first axis ({m.shape[0]}) is not a multiple of num_heads = {h}"
                )
            m = m.reshape((m.shape[0] // h, h) + m.shape[1:])
        elif m.ndim not in (2, 3):
            raise ValueError(
                f"attn_mask: expected shape (L, S) or (N * num_heads, L, S), got "
                f"{V.shape_str(m.shape)}"
            )
        mask = ~m if m.dtype.kind == "b" else np.array(m, copy=True)
    if key_padding_mask is not None:
        kp = _mask_array(key_padding_mask, "key_padding_mask")
        if kp.ndim not in (1, 2):
            raise ValueError(
                f"key_padding_mask: expected shape (N, S) or (S,), got {V.shape_str(kp.shape)}"
            )
        if kp.dtype.kind == "b":
            out["key_padding_mask"] = ~kp
        else:
            add = kp[..., None, None, :]
            if mask is None:
                mask = np.array(add, copy=True)
            else:
                if mask.dtype.kind == "b":
                    mask = np.where(mask, kp.dtype.type(0), kp.dtype.type(-np.inf))
                try:
                    mask = mask + add
                except ValueError:
                    raise ValueError(
                        f"key_padding_mask: shape {V.shape_str(kp.shape)} does not "
                        f"match attn_mask's"
                    ) from None
    if mask is not None:
        out = {"mask": mask, **out}
    return out
