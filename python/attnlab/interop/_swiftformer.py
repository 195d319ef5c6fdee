"""SwiftFormer's efficient additive attention (official, timm, Hugging Face) in:
:func:`from_swiftformer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _docs
from .._additive import _variant_code
from ._common import _copy, _put, _Scope, _t


@_docs.filled
def from_swiftformer(
    state_dict: Mapping[str, Any],
    variant: str = "official",
    *,
    prefix: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments of :func:`attnlab.additive_attention` from SwiftFormer's attention.

    Reads ``to_query``, ``to_key`` (Linear ``(D, d_in)``), ``w_g`` ``(D, 1)``, the projection
    ``Proj`` (official Amshaker/SwiftFormer ``EfficientAdditiveAttnetion``) or ``proj`` (timm's
    ``EfficientAdditiveAttention`` and Hugging Face's ``SwiftFormerEfficientAdditiveAttention``)
    ``(D, D)`` and ``final`` ``(d_out, D)``, with their biases.

    Parameters
    ----------
    state_dict : mapping of str to array_like or torch.Tensor
        The attention module's ``state_dict()``, or a larger dict holding it under a prefix.
    variant : {"official", "hf"}
        What the weights will compute; the key names do not tell (timm uses ``proj`` with the
        official computation). ``"official"`` for the official repository, its checkpoints and
        timm; ``"hf"`` to reproduce Hugging Face ``transformers`` (and the original March 2023
        release), whose softmax over a singleton axis makes every token weight 1.
    prefix : str, optional
        Take the keys starting with this prefix; by default found from the key names.

    Returns
    -------
    dict
        ``w_q, w_k (d_in, D)``, ``b_q, b_k``, ``w_g (D, 1)``, ``w_proj (D, D)``, ``b_proj``,
        ``w_final (D, d_out)``, ``b_final`` (biases when present) and ``variant``. The default
        scale ``d_out ** -0.5`` is the original's ``token_dim ** -0.5``.

    Notes
    -----
    The modules take tokens ``(B, N, C)`` (official, Hugging Face) or a feature map
    ``(B, C, H, W)`` (timm): for the latter use ``x = fmap.reshape(B, C, H * W)
    .transpose(0, 2, 1)``.

    {interop_examples}
    >>> from attnlab.interop import from_swiftformer
    >>> rng = np.random.default_rng(0)
    >>> d = 8
    >>> sd = {f"{m}.weight": rng.standard_normal((d, d)) / 3
    ...       for m in ("to_query", "to_key", "Proj", "final")}
    >>> sd["w_g"] = rng.standard_normal((d, 1))
    >>> kwargs = from_swiftformer(sd)
    >>> attnlab.additive_attention(rng.standard_normal((2, 49, d)), **kwargs).shape
    (2, 49, 8)
    """
    _variant_code(variant)
    s = _Scope(state_dict, ("to_query.weight",), prefix, "SwiftFormer efficient additive attention")
    wq = s.array("to_query.weight", (2,))
    D, d_in = wq.shape
    bq = s.optional("to_query.bias")
    wk = s.array("to_key.weight", (2,))
    s.expect("to_key.weight", wk, (D, d_in), "D, d_in, as to_query.weight")
    bk = s.optional("to_key.bias")
    for name, bias in (("to_query.bias", bq), ("to_key.bias", bk)):
        if bias is not None:
            s.expect(name, bias, (D,), "D")
    wg = s.array("w_g", (1, 2))
    if wg.shape not in ((D,), (D, 1)):
        s.expect("w_g", wg, (D, 1), "D, 1")
    if "Proj.weight" in s and "proj.weight" in s:
        raise ValueError(
            f"state_dict: both {s.full('Proj.weight')!r} and "
            f"{s.full('proj.weight')!r}; expected one of them"
        )
    pj = "Proj." if "Proj.weight" in s else "proj."
    wp = s.array(pj + "weight", (2,))
    s.expect(pj + "weight", wp, (D, D), "D, D")
    bp = s.optional(pj + "bias")
    if bp is not None:
        s.expect(pj + "bias", bp, (D,), "D")
    wf = s.array("final.weight", (2,))
    s.expect("final.weight", wf, (wf.shape[0], D), f"d_out, D = {D}")
    bf = s.optional("final.bias")
    if bf is not None:
        s.expect("final.bias", bf, (wf.shape[0],), "d_out")
    s.finish()
    out: dict[str, Any] = {
        "w_q": _t(wq),
        "w_k": _t(wk),
        "w_g": np.array(wg, copy=True),
        "w_proj": _t(wp),
        "w_final": _t(wf),
    }
    _put(out, b_q=_copy(bq), b_k=_copy(bk), b_proj=_copy(bp), b_final=_copy(bf))
    out["variant"] = variant
    return out
