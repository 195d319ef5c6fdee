"""PyTorch weights in: keyword arguments for attnlab's functions from PyTorch state dicts.

Each loader takes a module's ``state_dict()`` (values may be NumPy arrays or torch tensors; torch
is never imported here) and returns the keyword arguments of the matching attnlab call, ready
for ``f(x, **kwargs)``:

- :func:`from_torch_mha`: ``torch.nn.MultiheadAttention`` -> ``multi_head_attention`` (also
  takes the module itself, which lets it detect ``add_zero_attn=True``)
- :func:`from_vit_pytorch`: vit-pytorch (lucidrains) ``Attention`` -> ``multi_head_attention``
- :func:`from_swiftformer`: SwiftFormer's efficient additive attention (official, timm,
  Hugging Face) -> ``additive_attention``
- :func:`from_mobilevitv2`: MobileViT-v2's ``LinearSelfAttention`` (ml-cvnets, timm, Hugging
  Face) -> ``separable_attention``
- :func:`from_transformers`: Hugging Face ``transformers`` attention modules (BERT, ViT, GPT-2,
  Llama, Mistral, Mixtral, Qwen2/3, Gemma 1/2/3, gpt-oss, Phi-3, GPT-NeoX, Falcon, BLOOM, MPT)
  -> ``multi_head_attention``, :func:`transformers_masks` for their attention masks and
  :func:`t5_position_bias` for T5's relative position bias as a float ``mask``
- :func:`torch_masks`: PyTorch's ``attn_mask`` / ``key_padding_mask`` -> ``mask=``,
  ``key_padding_mask=`` (boolean polarity inverted)

PyTorch's ``nn.Linear`` stores weights as ``(out, in)``; attnlab's are ``(in, out)`` with
``y = x @ W + b``, so every weight is transposed (and copied: the result does not change when
the model trains on). The dtype is kept (bfloat16 tensors become float32).

Keys may carry a leading prefix (``encoder.layers.0.self_attn.in_proj_weight``): a loader finds
the module's keys by their names and strips the prefix. When the dict holds more than one such
module, or keys outside the module, pass ``prefix=`` to choose one (keys outside it are then
ignored; ``"enc.1"`` means ``"enc.1."``, so it does not take ``enc.10.*``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _docs
from . import _validate as V
from ._additive import _variant_code

__all__ = [
    "from_mobilevitv2",
    "from_swiftformer",
    "from_torch_mha",
    "from_transformers",
    "from_vit_pytorch",
    "t5_position_bias",
    "torch_masks",
    "transformers_masks",
]


def _is_tensor(value: Any) -> bool:
    """Whether ``value`` looks like a torch tensor (duck typing: torch is not imported)."""
    return hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy")


def _plain(value: Any) -> Any:
    """A torch tensor as a NumPy array (bfloat16 and friends become float32); others as given.

    The one tensor-to-NumPy conversion of attnlab.interop, attnlab.torch and
    attnlab.diagnostics (the array may share memory with the tensor).
    """
    if _is_tensor(value):
        t = value.detach().cpu()
        try:
            return t.numpy()
        except TypeError:  # bfloat16 and friends have no NumPy dtype
            return t.float().numpy()
    return value


def _mask_array(
    value: Any, name: str, expected: str = "a boolean or floating-point mask", kinds: str = "bf"
) -> np.ndarray:
    """A mask (array_like or torch tensor) as a NumPy array whose dtype kind is in ``kinds``
    (``"b"`` bool, ``"f"`` floating point), else ``TypeError`` naming ``name`` and saying what
    was ``expected``. Shared by attnlab.interop, attnlab.torch and attnlab.diagnostics."""
    try:
        a = np.asarray(_plain(value))
    except Exception as exc:  # noqa: BLE001 (any array-like: __array__ may raise anything)
        raise TypeError(f"{name}: could not be converted to an array ({exc})") from None
    if a.dtype.kind not in kinds:
        raise TypeError(f"{name}: expected {expected}, got dtype {a.dtype}")
    return a


_flag = V.check_flag  # a True/False argument, refusing other truthy or falsy values


def _weight_array(value: Any, name: str) -> np.ndarray:
    return V.as_array(_plain(value), name)


class _Scope:
    """The keys of one module inside a state dict: lookup by short name, with full names in
    errors, and a final check that every key was used."""

    def __init__(
        self, state_dict: Any, anchors: tuple[str, ...], prefix: str | None, module: str
    ) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict: expected a mapping of names to arrays or tensors (a module's "
                f"state_dict()), got {type(state_dict).__name__}"
            )
        bad = [k for k in state_dict if not isinstance(k, str)]
        if bad:
            raise TypeError(f"state_dict: keys must be strings, got {bad[0]!r}")
        keys: list[str] = list(state_dict)
        if prefix is not None:
            if not isinstance(prefix, str):
                raise TypeError(f"prefix: expected a string or None, got {type(prefix).__name__}")
            if prefix and not prefix.endswith("."):
                prefix += "."  # "enc.1" must not take enc.10.*, nor make "enc.1q_proj_weight"
            inside = [k for k in keys if k.startswith(prefix)]
            if not inside:
                raise ValueError(
                    f"prefix: no key of state_dict starts with {prefix!r}; keys: {_list(keys)}"
                )
        else:
            found = {
                k[: len(k) - len(a)] for k in keys for a in anchors if k == a or k.endswith("." + a)
            }
            if not found:
                names = " or ".join(repr(a) for a in anchors)
                raise ValueError(
                    f"state_dict: no key {names} (nor one ending in it): not the state_dict of "
                    f"{module}? Got keys {_list(keys)}"
                )
            if len(found) > 1:
                raise ValueError(
                    f"state_dict: holds {len(found)} {module} modules (prefixes "
                    f"{_list(sorted(found))}); pass prefix= to choose one"
                )
            prefix = found.pop()
            outside = [k for k in keys if not k.startswith(prefix)]
            if outside:
                raise ValueError(
                    f"state_dict: keys {_list(outside)} are not part of the {module} module "
                    f"under {prefix!r}; pass prefix={prefix!r} to take only that module"
                )
            inside = keys
        self.prefix = prefix
        self.items = {k[len(prefix) :]: state_dict[k] for k in inside}
        self.used: set[str] = set()
        self.module = module

    def __contains__(self, name: str) -> bool:
        return name in self.items

    def full(self, name: str) -> str:
        return self.prefix + name

    def array(self, name: str, ndims: tuple[int, ...] = (1, 2)) -> np.ndarray:
        if name not in self.items:
            raise ValueError(f"state_dict: missing key {self.full(name)!r} ({self.module})")
        self.used.add(name)
        a = _weight_array(self.items[name], self.full(name))
        if a.ndim not in ndims:
            raise ValueError(
                f"{self.full(name)}: expected {' or '.join(map(str, ndims))} "
                f"dimensions, got shape {V.shape_str(a.shape)}"
            )
        return a

    def optional(self, name: str, ndims: tuple[int, ...] = (1,)) -> np.ndarray | None:
        return self.array(name, ndims) if name in self.items else None

    def expect(self, name: str, a: np.ndarray, shape: tuple[int, ...], meaning: str) -> None:
        if a.shape != shape:
            raise ValueError(
                f"{self.full(name)}: expected shape {V.shape_str(shape)} "
                f"({meaning}), got {V.shape_str(a.shape)}"
            )

    def finish(self) -> None:
        extra = [self.full(k) for k in self.items if k not in self.used]
        if extra:
            raise ValueError(f"state_dict: unexpected keys {_list(extra)} for {self.module}")


def _list(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8])
    return f"[{shown}{', ...' if len(keys) > 8 else ''}]"


def _t(w: np.ndarray) -> np.ndarray:
    """(out, in) -> (in, out), as a fresh C-contiguous array."""
    return np.ascontiguousarray(w.T)


def _copy(b: np.ndarray | None) -> np.ndarray | None:
    return None if b is None else np.array(b, copy=True)


def _put(kwargs: dict[str, Any], **items: Any) -> dict[str, Any]:
    kwargs.update({k: v for k, v in items.items() if v is not None})
    return kwargs


def _is_module(obj: Any) -> bool:
    """Whether ``obj`` looks like an ``nn.MultiheadAttention`` (duck typing, no torch import)."""
    return (
        not isinstance(obj, Mapping)
        and callable(getattr(obj, "state_dict", None))
        and all(hasattr(obj, a) for a in ("num_heads", "add_zero_attn", "bias_k"))
    )


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


# defined in a module of its own, which uses the helpers above
from ._hf import from_transformers, t5_position_bias, transformers_masks  # noqa: E402
