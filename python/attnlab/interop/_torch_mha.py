"""``torch.nn.MultiheadAttention`` in: :func:`from_torch_mha`."""

from __future__ import annotations

import warnings
from typing import Any

from .. import _docs
from .. import _validate as V
from ._common import _copy, _flag, _is_module, _put, _Scope, _t


@_docs.filled
def from_torch_mha(
    state_dict: Any,
    num_heads: int | None = None,
    *,
    prefix: str | None = None,
    add_zero_attn: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of :func:`attnlab.multi_head_attention` from ``nn.MultiheadAttention``.

    Reads the packed ``in_proj_weight`` ``(3E, E)`` (or ``q_proj_weight`` ``(E, E)``,
    ``k_proj_weight`` ``(E, kdim)`` and ``v_proj_weight`` ``(E, vdim)`` when ``kdim``/``vdim``
    differ from ``embed_dim``), ``in_proj_bias`` ``(3E,)``, ``out_proj.weight`` ``(E, E)`` and
    ``out_proj.bias`` ``(E,)`` (the biases are absent with ``bias=False``), and transposes the
    weights to ``(in, out)``.

    Pass the module itself when you can: then ``num_heads`` and ``add_zero_attn`` are read from
    it, and a module built with ``add_zero_attn=True`` is refused. A bare ``state_dict()`` does
    not record ``add_zero_attn`` (a constructor flag, not a tensor), so this function cannot
    detect it: pass ``add_zero_attn=mha.add_zero_attn``, or the result silently ignores the
    zero key and value such a module appends.

    Parameters
    ----------
    state_dict : torch.nn.MultiheadAttention, or mapping of str to array_like or torch.Tensor
        The module (anything with ``state_dict()``, ``num_heads``, ``add_zero_attn`` and
        ``bias_k`` attributes), or ``mha.state_dict()``, or a larger dict holding it under a
        prefix.
    num_heads : int, optional
        ``mha.num_heads`` (not stored in the state dict): required with a state dict; with a
        module it is read from it (if given, it must agree).
    prefix : str, optional
        Take the keys starting with this prefix (``"encoder.layers.0.self_attn."``; a missing
        final ``"."`` is added); by default the prefix is found from the key names.
    add_zero_attn : bool
        With a state dict, pass ``mha.add_zero_attn``: ``True`` (a zero key and value appended
        to every sequence) has no attnlab equivalent and raises ``ValueError``. With a module,
        the module's own flag is used (``True`` here refuses too).

    Returns
    -------
    dict
        ``w_q (E, E)``, ``w_k (kdim, E)``, ``w_v (vdim, E)``, ``w_o (E, E)``, ``b_q``, ``b_k``,
        ``b_v``, ``b_o`` when present, and ``num_heads``.

    Raises
    ------
    ValueError
        Missing or unexpected keys, wrong shapes, ``embed_dim`` not divisible by ``num_heads``,
        ``num_heads`` missing (state dict) or disagreeing with the module's, ``bias_k``/
        ``bias_v`` present (``add_bias_kv=True`` appends a learned key/value token, which
        attnlab does not model), or ``add_zero_attn`` True (argument or module).
    TypeError
        ``state_dict`` neither a mapping nor a module, ``add_zero_attn`` not a bool.

    Notes
    -----
    attnlab inputs are batch-first ``(..., n, d)``: with ``batch_first=False`` (PyTorch's
    default) swap the first two axes, ``x.transpose(1, 0, 2)``; given such a module, this
    function says so with a ``UserWarning``. PyTorch's boolean masks have the
    opposite polarity; convert them with :func:`torch_masks`. Dropout is not applied (eval
    mode).

    {interop_examples}
    >>> from attnlab.interop import from_torch_mha
    >>> E = 8
    >>> rng = np.random.default_rng(0)
    >>> sd = {"in_proj_weight": rng.standard_normal((3 * E, E)) / 3,
    ...       "in_proj_bias": np.zeros(3 * E),
    ...       "out_proj.weight": rng.standard_normal((E, E)) / 3, "out_proj.bias": np.zeros(E)}
    >>> kwargs = from_torch_mha(sd, num_heads=2)
    >>> kwargs["w_q"].shape, kwargs["w_o"].shape
    ((8, 8), (8, 8))
    >>> attnlab.multi_head_attention(rng.standard_normal((5, E)), **kwargs).shape
    (5, 8)

    With the module (``torch`` needed), ``from_torch_mha(mha)`` reads ``mha.num_heads`` and
    refuses ``add_zero_attn=True`` by itself.
    """
    zero_attn = _flag(add_zero_attn, "add_zero_attn")
    if _is_module(state_dict):
        module = state_dict
        h = V.check_positive_int(module.num_heads, "num_heads (the module's)")
        if num_heads is not None and V.check_positive_int(num_heads, "num_heads") != h:
            raise ValueError(f"num_heads: got {num_heads}, but the module has num_heads = {h}")
        if bool(module.add_zero_attn):
            raise ValueError(
                "add_zero_attn: the module was built with add_zero_attn=True, which appends a "
                "zero key and value to every sequence (they take softmax mass); attnlab's "
                "multi_head_attention has no equivalent"
            )
        if not getattr(module, "batch_first", True):
            warnings.warn(
                "from_torch_mha: the module is sequence-first (batch_first=False, PyTorch's "
                "default) and takes (n, B, d) inputs; attnlab's are batch-first (B, n, d): swap "
                "the first two axes, x.transpose(1, 0, 2) (NumPy) or x.transpose(0, 1) (torch), "
                "and the output's back",
                UserWarning,
                stacklevel=V.user_stacklevel(),
            )
        state_dict = module.state_dict()
    else:
        if num_heads is None:
            raise ValueError(
                "num_heads: needed with a state_dict (pass mha.num_heads), or pass "
                "the module itself"
            )
        h = V.check_positive_int(num_heads, "num_heads")
    if zero_attn:
        raise ValueError(
            "add_zero_attn: True appends a zero key and value to every sequence (they take "
            "softmax mass); attnlab's multi_head_attention has no equivalent"
        )
    s = _Scope(
        state_dict, ("in_proj_weight", "q_proj_weight"), prefix, "torch.nn.MultiheadAttention"
    )
    for name in ("bias_k", "bias_v"):
        if name in s:
            raise ValueError(
                f"{s.full(name)}: add_bias_kv=True appends a learned key/value token to every "
                "sequence; attnlab's multi_head_attention does not model it (build the module "
                "with add_bias_kv=False)"
            )
    if "in_proj_weight" in s:
        if "q_proj_weight" in s:
            raise ValueError(
                f"state_dict: both {s.full('in_proj_weight')!r} and "
                f"{s.full('q_proj_weight')!r}; expected one of them"
            )
        w = s.array("in_proj_weight", (2,))
        E = w.shape[1]
        s.expect("in_proj_weight", w, (3 * E, E), "3 * embed_dim, embed_dim")
        wq, wk, wv = w[:E], w[E : 2 * E], w[2 * E :]
    else:
        wq = s.array("q_proj_weight", (2,))
        E = wq.shape[0]
        s.expect("q_proj_weight", wq, (E, E), "embed_dim, embed_dim")
        wk = s.array("k_proj_weight", (2,))
        s.expect("k_proj_weight", wk, (E, wk.shape[1]), f"embed_dim = {E}, kdim")
        wv = s.array("v_proj_weight", (2,))
        s.expect("v_proj_weight", wv, (E, wv.shape[1]), f"embed_dim = {E}, vdim")
    if E % h:
        raise ValueError(f"num_heads: embed_dim = {E} is not divisible by num_heads = {h}")
    b = s.optional("in_proj_bias")
    if b is not None:
        s.expect("in_proj_bias", b, (3 * E,), "3 * embed_dim")
    wo = s.array("out_proj.weight", (2,))
    s.expect("out_proj.weight", wo, (E, E), "embed_dim, embed_dim")
    bo = s.optional("out_proj.bias")
    if bo is not None:
        s.expect("out_proj.bias", bo, (E,), "embed_dim")
    s.finish()
    out: dict[str, Any] = {"w_q": _t(wq), "w_k": _t(wk), "w_v": _t(wv), "w_o": _t(wo)}
    if b is not None:
        _put(out, b_q=_copy(b[:E]), b_k=_copy(b[E : 2 * E]), b_v=_copy(b[2 * E :]))
    _put(out, b_o=_copy(bo))
    out["num_heads"] = h
    return out
