"""Hugging Face ``transformers`` attention modules in: :func:`from_transformers` and
:func:`transformers_masks` (exported by :mod:`attnlab.interop`).

The modules are read by duck typing (class name, sub-module and config attributes): torch and
transformers are never imported here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _validate as V
from .interop import _list, _mask_array, _plain, _t

__all__ = ["from_transformers", "transformers_masks"]

# q_proj / k_proj / v_proj / o_proj modules; True: they apply rotary embeddings.
_PROJ_FAMILIES = {
    "ViTAttention": False,
    "LlamaAttention": True,
    "MistralAttention": True,
    "Qwen2Attention": True,
}
_BERT_SELF = ("BertSelfAttention", "RobertaSelfAttention")
_BERT = ("BertAttention", "RobertaAttention")
_SUPPORTED = (*_BERT, *_BERT_SELF, "GPT2Attention", *_PROJ_FAMILIES)


def _linear(module: Any, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """An ``nn.Linear`` child as attnlab's ``(in, out)`` weight and its bias (or None)."""
    lin = getattr(module, name, None)
    w = None if lin is None else getattr(lin, "weight", None)
    if w is None:
        raise ValueError(
            f"module: {type(module).__name__} has no {name}.weight; expected the "
            f"module of a transformers model"
        )
    w = _weight(w, f"{name}.weight")
    b = getattr(lin, "bias", None)
    return _t(w), None if b is None else np.array(_weight(b, f"{name}.bias"), copy=True)


def _weight(t: Any, name: str) -> np.ndarray:
    return V.as_array(_plain(t), name)


def _refuse_children(module: Any, allowed: set[str]) -> None:
    """Refuse sub-modules the attention call does not model (q_norm, rotary tables, ...)."""
    children = getattr(module, "named_children", None)
    names = [n for n, _ in children()] if callable(children) else []
    extra = [n for n in names if n not in allowed]
    if extra:
        raise ValueError(
            f"module: {type(module).__name__} has sub-modules {_list(extra)} besides "
            f"{_list(sorted(allowed))}, which multi_head_attention does not model"
        )


def _rope_theta(module: Any) -> float:
    config = module.config
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"module: rotary embeddings of type {rope_type!r} rescale the frequencies "
            f"(rope_parameters = {params}); multi_head_attention implements the default "
            f"theta ** (-2j / d) frequencies only"
        )
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(
            f"module: partial_rotary_factor = {factor} is not supported for "
            f"{type(module).__name__} (its attention rotates whole heads)"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"module: no rope_theta in {type(module).__name__}'s config")
    return float(theta)


def _bert_self(module: Any) -> dict[str, Any]:
    if hasattr(module, "distance_embedding"):
        raise ValueError(
            "module: relative position scores (position_embedding_type "
            f"{getattr(module, 'position_embedding_type', '?')!r}) add a learned term per "
            "(query, key) distance, which multi_head_attention does not model"
        )
    _refuse_children(module, {"query", "key", "value", "dropout"})
    h = V.check_positive_int(module.num_attention_heads, "num_attention_heads")
    out: dict[str, Any] = {}
    for ours, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
        out[f"w_{ours}"], out[f"b_{ours}"] = _linear(module, theirs)
    out["w_o"] = np.eye(out["w_q"].shape[1], dtype=out["w_q"].dtype)  # no output projection
    out.update(
        num_heads=h, causal=bool(getattr(module, "is_causal", False)), scale=float(module.scaling)
    )
    return out


def _gpt2(module: Any) -> dict[str, Any]:
    _refuse_children(module, {"c_attn", "q_attn", "c_proj", "attn_dropout", "resid_dropout"})
    h = V.check_positive_int(module.num_heads, "num_heads")
    E = int(module.embed_dim)
    # Conv1D already stores (in, out), attnlab's layout: no transpose
    w = _weight(module.c_attn.weight, "c_attn.weight")
    b = _weight(module.c_attn.bias, "c_attn.bias")
    out: dict[str, Any] = {}
    if getattr(module, "is_cross_attention", False):  # q_attn for the queries, c_attn = [K | V]
        out["w_q"] = np.array(_weight(module.q_attn.weight, "q_attn.weight"), copy=True)
        out["b_q"] = np.array(_weight(module.q_attn.bias, "q_attn.bias"), copy=True)
        parts: tuple[str, ...] = ("k", "v")
    else:
        parts = ("q", "k", "v")
    if w.shape != (E, len(parts) * E):
        raise ValueError(
            f"c_attn.weight: expected shape ({E}, {len(parts)} * {E}), got {V.shape_str(w.shape)}"
        )
    for i, p in enumerate(parts):
        out[f"w_{p}"] = np.ascontiguousarray(w[:, i * E : (i + 1) * E])
        out[f"b_{p}"] = np.array(b[i * E : (i + 1) * E], copy=True)
    out["w_o"] = np.array(_weight(module.c_proj.weight, "c_proj.weight"), copy=True)
    out["b_o"] = np.array(_weight(module.c_proj.bias, "c_proj.bias"), copy=True)
    out.update(num_heads=h, causal=bool(module.is_causal), scale=float(module.scaling))
    return out


def _sliding_window(module: Any) -> int | None:
    """The layer's sliding window W (query i sees keys i - W < j <= i), or None.

    Layers that choose per layer (Qwen2, Gemma 2/3, gpt-oss: ``layer_types``) carry
    ``module.sliding_window``; Mistral, Mixtral and Phi-3 read ``config.sliding_window``."""
    if hasattr(module, "sliding_window"):
        w = module.sliding_window
    else:
        w = getattr(getattr(module, "config", None), "sliding_window", None)
    return None if w is None else int(w)


def _refuse_window(module: Any) -> None:
    w = _sliding_window(module)
    if w is not None:
        raise ValueError(
            f"module: {type(module).__name__} attends through a sliding window of "
            f"sliding_window = {w} tokens (query i sees keys i - {w} < j <= i; set in the "
            f"model's mask), which this attnlab's multi_head_attention cannot express (it has no "
            f"window= option); on sequences longer than {w} tokens the result would be wrong. "
            f"Use a model config without a sliding window (sliding_window=None, or "
            f"use_sliding_window=False for Qwen2), or an attnlab with window="
        )


def _proj_family(module: Any, rotary: bool) -> dict[str, Any]:
    _refuse_children(module, {"q_proj", "k_proj", "v_proj", "o_proj", "rotary_emb"})
    _refuse_window(module)
    config = module.config
    h = V.check_positive_int(config.num_attention_heads, "num_attention_heads")
    h_kv = V.check_positive_int(
        getattr(config, "num_key_value_heads", None) or h, "num_key_value_heads"
    )
    out: dict[str, Any] = {}
    for p in "qkvo":
        out[f"w_{p}"], out[f"b_{p}"] = _linear(module, f"{p}_proj")
    out.update(
        num_heads=h, num_kv_heads=h_kv, causal=bool(module.is_causal), scale=float(module.scaling)
    )
    if rotary:
        out["rope_theta"] = _rope_theta(module)
    return out


def from_transformers(module: Any, *, ignore_norm: bool = False) -> dict[str, Any]:
    """Keyword arguments of :func:`attnlab.multi_head_attention` from a ``transformers``
    attention module.

    Supported: ``BertSelfAttention`` / ``BertAttention`` (BERT, MiniLM, sentence-transformers;
    ``RobertaSelfAttention`` / ``RobertaAttention``), ``ViTAttention``, ``GPT2Attention``
    (self- and cross-attention; ``Conv1D`` weights are already ``(in, out)`` and ``c_attn``
    packs Q, K and V), and the grouped-query, rotary ``LlamaAttention``, ``MistralAttention``
    and ``Qwen2Attention``.

    Parameters
    ----------
    module : transformers attention module
        The module itself (``model.encoder.layer[0].attention``,
        ``model.transformer.h[0].attn``, ``model.model.layers[0].self_attn``); float32,
        float64 or bfloat16 (read as float32) weights.
    ignore_norm : bool
        ``BertAttention`` ends with ``LayerNorm(x + dense(context))``, a residual and a norm that
        attention does not include: it is refused unless ``ignore_norm=True``, and then the
        result stops at ``dense`` (apply ``module.output.LayerNorm`` to ``x + out`` yourself).

    Returns
    -------
    dict
        ``w_q, w_k, w_v, w_o`` (``(in, out)``), the biases the module has, ``num_heads``,
        ``num_kv_heads`` (Llama family), ``causal`` (True for GPT-2 and the Llama family, as
        their modules apply a causal mask when given none), ``scale`` (the module's own, e.g.
        GPT-2's ``scale_attn_by_inverse_layer_idx``) and ``rope_theta`` (Llama family). Copies:
        they do not follow later training of the module.

    Raises
    ------
    TypeError
        For another class of module (or a state dict: pass the module).
    ValueError
        For what ``multi_head_attention`` cannot represent: BERT's relative position scores,
        scaled rotary types (``llama3``, ``yarn``, ...), partial rotary factors, extra
        sub-modules (``q_norm``, ...), a sliding window (``sliding_window``),
        ``BertAttention`` without ``ignore_norm=True``.

    Notes
    -----
    Call the result on the module's inputs: ``multi_head_attention(x, **kwargs)`` for
    self-attention, ``multi_head_attention(x, encoder_states, **kwargs)`` for GPT-2's
    cross-attention. Masks: :func:`transformers_masks` converts a model's ``attention_mask``.
    Rotary positions default to ``0..n-1``; pass ``positions=position_ids`` otherwise. Dropout
    is not applied (eval mode). A layer with a sliding window (Mistral's
    ``config.sliding_window``, Qwen2's with ``use_sliding_window=True``) is refused.

    Examples
    --------
    >>> import numpy as np, attnlab
    >>> from attnlab.interop import from_transformers
    >>> from transformers import LlamaConfig
    >>> from transformers.models.llama.modeling_llama import LlamaAttention
    >>> cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> kw = from_transformers(LlamaAttention(cfg, layer_idx=0))
    >>> kw["num_kv_heads"], kw["causal"], kw["rope_theta"], kw["w_k"].shape
    (2, True, 10000.0, (64, 32))
    >>> attnlab.multi_head_attention(np.ones((5, 64), np.float32), **kw).shape
    (5, 64)
    """
    if not isinstance(ignore_norm, (bool, np.bool_)):
        raise TypeError(
            f"ignore_norm: expected True or False, got {type(ignore_norm).__name__} {ignore_norm!r}"
        )
    kwargs = _from_transformers(module, bool(ignore_norm))
    return {k: v for k, v in kwargs.items() if v is not None}  # biases the module lacks


def _from_transformers(module: Any, ignore_norm: bool) -> dict[str, Any]:
    name = type(module).__name__
    if name in _BERT_SELF:
        return _bert_self(module)
    if name in _BERT:
        if not ignore_norm:
            raise ValueError(
                f"module: {name} returns LayerNorm(x + dense(attention(x))); the residual and "
                "the LayerNorm are not attention. Pass ignore_norm=True to get the attention "
                "up to dense, then apply module.output.LayerNorm to x + out yourself (or pass "
                "module.self for the attention without the output projection)"
            )
        if getattr(module, "is_cross_attention", False):
            raise ValueError(
                f"module: cross-attention {name} (BertCrossAttention) is not supported"
            )
        out = _bert_self(module.self)
        out["w_o"], out["b_o"] = _linear(module.output, "dense")
        return out
    if name == "GPT2Attention":
        return _gpt2(module)
    if name in _PROJ_FAMILIES:
        return _proj_family(module, _PROJ_FAMILIES[name])
    raise TypeError(
        f"module: expected a transformers attention module, one of "
        f"{', '.join(_SUPPORTED)}; got {name}"
    )


def transformers_masks(attention_mask: Any) -> dict[str, np.ndarray]:
    """A ``transformers`` attention mask as attnlab's ``mask`` or ``key_padding_mask``.

    Parameters
    ----------
    attention_mask : array_like or torch.Tensor
        The model's ``(batch, n_k)`` mask, 1 (or True) for real tokens and 0 for padding; or the
        4-D ``(batch, 1 or h, n_q, n_k)`` mask its layers receive: boolean (``True`` = may
        attend, as attnlab's) or additive float (0 where allowed, ``finfo(dtype).min`` or
        ``-inf`` where not).

    Returns
    -------
    dict
        ``{"key_padding_mask": bool (batch, n_k)}`` for a 2-D mask; ``{"mask": ...}`` for a 4-D
        one: boolean when the float mask holds only 0 and the blocked value, else float with
        the blocked entries set to ``-inf`` (other values, such as ALiBi biases, kept).

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.interop import transformers_masks
    >>> transformers_masks(np.array([[1, 1, 0]]))["key_padding_mask"]
    array([[ True,  True, False]])
    >>> m = np.array([[[[0.0, np.finfo(np.float32).min]]]], np.float32)
    >>> transformers_masks(m)["mask"]
    array([[[[ True, False]]]])
    """
    m = _mask_array(
        attention_mask,
        "attention_mask",
        "a 2-D (batch, n) or 4-D (batch, 1 or h, n_q, n_k) mask",
        "biuf",
    )
    if m.ndim == 2:
        return {"key_padding_mask": m != 0}
    if m.ndim != 4:
        raise ValueError(
            f"attention_mask: expected shape (batch, n_k) or (batch, 1 or h, n_q, "
            f"n_k), got {V.shape_str(m.shape)}"
        )
    if m.dtype.kind == "b":
        return {"mask": np.array(m, copy=True)}
    if m.dtype.kind != "f":
        raise TypeError(
            f"attention_mask: a 4-D mask must be boolean or additive float, got dtype {m.dtype}"
        )
    blocked = m <= np.finfo(m.dtype).min / 2  # HF writes finfo(dtype).min (or -inf)
    if np.all(m[~blocked] == 0):
        return {"mask": ~blocked}
    return {"mask": np.where(blocked, m.dtype.type(-np.inf), m)}
