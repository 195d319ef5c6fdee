"""Hugging Face ``transformers`` attention modules in: :func:`from_transformers` and
:func:`transformers_masks` (exported by :mod:`attnlab.interop`).

The modules are read by duck typing (class name, sub-module and config attributes): torch and
transformers are never imported here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _docs, _mha
from .. import _signature as _sig
from .. import _validate as V
from ._common import _flag, _list, _mask_array, _t, _weight_array

__all__ = ["from_transformers", "transformers_masks"]

# Decoder attention modules with q_proj / k_proj / v_proj / o_proj (Phi-3: qkv_proj / o_proj)
# and rotary embeddings; the value: what else their attention does, beyond the config's
# sliding window and rotary settings, which every one of them reads.
_ROTARY = {
    "LlamaAttention": (),
    "MistralAttention": (),
    "MixtralAttention": (),
    "Qwen2Attention": (),
    "Qwen3Attention": ("qk_norm",),
    "Qwen3MoeAttention": ("qk_norm",),
    "GemmaAttention": (),
    "Gemma2Attention": ("softcap",),
    "Gemma3Attention": ("qk_norm",),
    "GptOssAttention": ("sinks",),
    "Phi3Attention": ("packed",),
}
_BERT_SELF = ("BertSelfAttention", "RobertaSelfAttention")
_BERT = ("BertAttention", "RobertaAttention")
_PACKED = ("GPTNeoXAttention", "FalconAttention", "BloomAttention", "MptAttention")
# DeepSeek's multi-head latent attention: loaded as attnlab.latent_attention's kwargs
_LATENT = ("DeepseekV2Attention", "DeepseekV3Attention")
_SUPPORTED = (
    *_BERT,
    *_BERT_SELF,
    "ViTAttention",
    "GPT2Attention",
    *_ROTARY,
    *_PACKED,
    *_LATENT,
)

# Settings of a module or its config that change what attention computes: the loaders read
# those they reproduce; an unknown module naming any of them is refused naming it.
_FEATURES = {
    "sliding_window": "a sliding window",
    "attn_logit_softcapping": "soft-capped logits",
    "sinks": "attention sinks",
    "q_norm": "a per-head query norm",
    "k_norm": "a per-head key norm",
    "alibi": "ALiBi position biases",
    "relative_attention_bias": "a relative position bias table",
    "distance_embedding": "relative position scores",
    "rope_parameters": "rotary position embeddings",
    "clip_qkv": "clipped projections",
}


def _linear(module: Any, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """An ``nn.Linear`` child as attnlab's ``(in, out)`` weight and its bias (or None)."""
    lin = getattr(module, name, None)
    w = None if lin is None else getattr(lin, "weight", None)
    if w is None:
        raise ValueError(
            f"module: {type(module).__name__} has no {name}.weight; expected the "
            f"module of a transformers model"
        )
    w = _weight_array(w, f"{name}.weight")
    b = getattr(lin, "bias", None)
    return _t(w), None if b is None else np.array(_weight_array(b, f"{name}.bias"), copy=True)


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
    w = _weight_array(module.c_attn.weight, "c_attn.weight")
    b = _weight_array(module.c_attn.bias, "c_attn.bias")
    out: dict[str, Any] = {}
    if getattr(module, "is_cross_attention", False):  # q_attn for the queries, c_attn = [K | V]
        out["w_q"] = np.array(_weight_array(module.q_attn.weight, "q_attn.weight"), copy=True)
        out["b_q"] = np.array(_weight_array(module.q_attn.bias, "q_attn.bias"), copy=True)
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
    out["w_o"] = np.array(_weight_array(module.c_proj.weight, "c_proj.weight"), copy=True)
    out["b_o"] = np.array(_weight_array(module.c_proj.bias, "c_proj.bias"), copy=True)
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


def _options() -> set[str]:
    """The keyword options of this attnlab's ``multi_head_attention``."""
    return {p.name for p in _sig.public_parameters(_mha.multi_head_attention)}


def _option(out: dict[str, Any], name: str, value: Any, module: Any, setting: str) -> None:
    """``out[name] = value``, or a refusal naming ``setting`` when this attnlab's
    ``multi_head_attention`` has no option ``name``."""
    if name not in _options():
        raise ValueError(
            f"module: {type(module).__name__} has {setting}, which needs multi_head_attention's "
            f"{name}= option; this attnlab has none, and without it the result would be wrong. "
            f"Use an attnlab with {name}=, or a model config without this setting"
        )
    out[name] = value


def _config_get(config: Any, params: dict[str, Any], key: str, default: Any = None) -> Any:
    """A rotary setting from ``rope_parameters``, else from the config itself."""
    v = params.get(key)
    return getattr(config, key, default) if v is None else v


def _rope_params(module: Any, config: Any) -> dict[str, Any]:
    """The module's ``rope_parameters`` (per layer type for Gemma 3's sliding/full layers)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    layer_type = getattr(module, "layer_type", None)
    if "rope_type" not in params and "rope_theta" not in params and layer_type in params:
        params = dict(params[layer_type] or {})
    return params


def _inverse_frequencies(
    module: Any, config: Any, head_dim: int, rope_length: int | None
) -> tuple[str, float, int, np.ndarray, float]:
    """``(rope_type, theta, r, inv_freq, attention_factor)`` of a module's rotary embeddings,
    computed in float64 by transformers' formulas (``modeling_rope_utils``) from its config."""
    params = _rope_params(module, config)
    rope_type = params.get("rope_type", "default")
    theta = _config_get(config, params, "rope_theta")
    if theta is None:
        raise ValueError(f"module: no rope_theta in {type(module).__name__}'s config")
    base = float(theta)
    prf = _config_get(config, params, "partial_rotary_factor", 1.0) or 1.0
    dim = int(head_dim * prf)
    if rope_type == "proportional":  # the whole head, the last pairs with frequency 0
        n_rot = int(prf * head_dim // 2)
        inv = base ** (-np.arange(0, 2 * n_rot, 2, dtype=np.float64) / head_dim)
        inv = np.concatenate([inv, np.zeros(head_dim // 2 - n_rot)]) / float(
            params.get("factor", 1.0)
        )
        return rope_type, base, head_dim, inv, 1.0
    if dim % 2 or dim < 2:
        raise ValueError(
            f"module: rotary embeddings over {dim} features (head_dim {head_dim} x "
            f"partial_rotary_factor {prf}) do not rotate pairs"
        )
    exps = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv = base**-exps
    factor = params.get("factor")
    attention_factor = 1.0
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv = inv / float(params["factor"])
    elif rope_type == "dynamic":
        max_pos = int(config.max_position_embeddings)
        length = _rope_length(module, rope_type, rope_length)
        if length > max_pos:  # transformers rescales the base beyond the trained length
            f = float(params["factor"])
            base = base * ((f * length / max_pos) - (f - 1)) ** (dim / (dim - 2))
            inv = base**-exps
    elif rope_type == "llama3":
        f = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / low, inv / f, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        orig = float(params["original_max_position_embeddings"])
        f = float(config.max_position_embeddings / orig if factor is None else factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        af = params.get("attention_factor")
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if af is None:
            af = mscale(f, m) / mscale(f, m_all) if m and m_all else mscale(f)
        attention_factor = float(af)
        fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction(fast), correction(slow)
        # transformers reads truncate from the top level of rope_parameters
        if (getattr(config, "rope_parameters", None) or {}).get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        inv = inv / f * (1 - extrapolation) + inv * extrapolation
    elif rope_type == "longrope":
        orig = float(params["original_max_position_embeddings"])
        f = float(config.max_position_embeddings / orig if factor is None else factor)
        af = params.get("attention_factor")
        if af is None:
            af = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(orig))
        attention_factor = float(af)
        length = _rope_length(module, rope_type, rope_length)
        ext = params["long_factor"] if length > orig else params["short_factor"]
        inv = 1.0 / (np.asarray(ext, dtype=np.float64) * base**exps)
    else:
        raise ValueError(
            f"module: rotary embeddings of type {rope_type!r} (rope_parameters = {params}) "
            f"are not reproduced; supported: default, linear, dynamic, yarn, longrope, "
            f"llama3, proportional"
        )
    return rope_type, base, dim, np.asarray(inv, dtype=np.float64), attention_factor


def _rope_length(module: Any, rope_type: str, rope_length: int | None) -> int:
    if rope_length is None:
        raise ValueError(
            f"rope_length: {type(module).__name__}'s rotary embeddings of type {rope_type!r} "
            f"depend on the sequence length (transformers uses the largest position id + 1); "
            f"pass rope_length= (that length) to from_transformers"
        )
    return V.check_positive_int(rope_length, "rope_length")


def _rope_kwargs(
    module: Any, config: Any, head_dim: int, rope_length: int | None
) -> dict[str, Any]:
    """``rope_theta`` (and ``rope_dim`` when partial) for the default frequencies, else
    ``rope_inv_freq`` (and ``rope_scale`` when not 1)."""
    rope_type, theta, dim, inv, factor = _inverse_frequencies(module, config, head_dim, rope_length)
    if rope_type == "default":
        return {"rope_theta": theta} if dim == head_dim else {"rope_theta": theta, "rope_dim": dim}
    out: dict[str, Any] = {"rope_inv_freq": inv}
    if factor != 1.0:
        out["rope_scale"] = factor
    return out


def _window(module: Any, out: dict[str, Any]) -> None:
    """The sliding window as ``window=(W - 1, 0)`` (transformers: query i sees keys
    i - W < j <= i), or a refusal without that option."""
    w = _sliding_window(module)
    if w is None:
        return
    if not out.get("causal"):
        raise ValueError(
            f"module: {type(module).__name__} is bidirectional (is_causal False) with a sliding "
            f"window of {w}, whose bidirectional form is not reproduced"
        )
    _option(
        out,
        "window",
        (w - 1, 0),
        module,
        f"a sliding window of sliding_window = {w} tokens (query i sees keys i - {w} < j <= i)",
    )


def _norm_weight(module: Any, name: str) -> tuple[np.ndarray, float]:
    """A q/k RMSNorm child as the weight it multiplies by and its epsilon (Gemma's norms
    multiply by ``1 + weight``)."""
    norm = getattr(module, name)
    cls = type(norm).__name__
    if not cls.endswith("RMSNorm"):
        raise ValueError(
            f"module: {type(module).__name__}.{name} is a {cls}, not an RMSNorm; "
            f"multi_head_attention's {name} is a per-head RMSNorm"
        )
    w = np.array(_weight_array(norm.weight, f"{name}.weight"), copy=True)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise ValueError(f"module: {type(module).__name__}.{name} has no epsilon")
    return (1 + w if cls.startswith("Gemma") else w), float(eps)


def _rotary(module: Any, rope_length: int | None) -> dict[str, Any]:
    """Llama and the decoders that follow its layout (see ``_ROTARY``)."""
    name = type(module).__name__
    extras = _ROTARY[name]
    config = module.config
    allowed = {"o_proj", "rotary_emb", "q_norm", "k_norm"}
    allowed |= {"qkv_proj"} if "packed" in extras else {"q_proj", "k_proj", "v_proj"}
    _refuse_children(module, allowed)
    h = V.check_positive_int(config.num_attention_heads, "num_attention_heads")
    h_kv = V.check_positive_int(
        getattr(config, "num_key_value_heads", None) or h, "num_key_value_heads"
    )
    d = int(module.head_dim)
    out: dict[str, Any] = {}
    if "packed" in extras:  # Phi-3: rows [Q | K | V] of one Linear
        w, b = _linear(module, "qkv_proj")
        bounds = {"q": (0, h * d), "k": (h * d, (h + h_kv) * d), "v": ((h + h_kv) * d, None)}
        for p, (lo, hi) in bounds.items():
            out[f"w_{p}"] = np.ascontiguousarray(w[:, lo:hi])
            out[f"b_{p}"] = None if b is None else np.array(b[lo:hi], copy=True)
        out["w_o"], out["b_o"] = _linear(module, "o_proj")
    else:
        for p in "qkvo":
            out[f"w_{p}"], out[f"b_{p}"] = _linear(module, f"{p}_proj")
    out.update(
        num_heads=h, num_kv_heads=h_kv, causal=bool(module.is_causal), scale=float(module.scaling)
    )
    out.update(_rope_kwargs(module, config, d, rope_length))
    norms = [n for n in ("q_norm", "k_norm") if hasattr(module, n)]
    if norms:
        eps = set()
        for n in norms:
            weight, e = _norm_weight(module, n)
            eps.add(e)
            _option(out, n, weight, module, f"a per-head RMSNorm {n}")
        if len(eps) > 1:
            raise ValueError(f"module: q_norm and k_norm have different epsilons {sorted(eps)}")
        out["norm_eps"] = eps.pop()
    _window(module, out)
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap is not None and "softcap" in extras:
        _option(out, "softcap", float(cap), module, f"soft-capped logits (softcap = {cap})")
    sinks = getattr(module, "sinks", None)
    if sinks is not None:
        _option(
            out,
            "sinks",
            np.array(_weight_array(sinks, "sinks"), copy=True),
            module,
            "attention sinks (a per-head logit in every softmax)",
        )
    return out


def _alibi_slopes(h: int) -> np.ndarray:
    """BLOOM's (and Falcon's) ALiBi slopes, ``build_alibi_tensor``'s recipe, float64."""
    p = 2 ** math.floor(math.log2(h))
    slopes = (2.0 ** (-(2.0 ** -(math.log2(p) - 3)))) ** np.arange(1, 1 + p)
    if p != h:
        extra = (2.0 ** (-(2.0 ** -(math.log2(2 * p) - 3)))) ** np.arange(
            1, 1 + 2 * min(p, h - p), 2
        )
        slopes = np.concatenate([slopes, extra])
    return np.asarray(slopes, dtype=np.float64)


def _split_rows(w: np.ndarray, b: np.ndarray | None, cols: dict[str, np.ndarray]) -> dict:
    """Column sets of a packed ``(in, out)`` projection as ``w_p`` and ``b_p``."""
    out: dict[str, Any] = {}
    for p, idx in cols.items():
        out[f"w_{p}"] = np.ascontiguousarray(w[:, idx])
        out[f"b_{p}"] = None if b is None else np.array(b[idx], copy=True)
    return out


def _interleaved(h: int, parts: int, d: int) -> list[np.ndarray]:
    """The columns of part ``i`` of a per-head interleaved packing ``(h, parts, d)``."""
    grid = np.arange(h * parts * d).reshape(h, parts, d)
    return [grid[:, i].reshape(-1) for i in range(parts)]


def _packed(module: Any, rope_length: int | None, ignore_residual: bool) -> dict[str, Any]:
    """GPT-NeoX / Pythia, Falcon, BLOOM and MPT: one packed query_key_value (Wqkv)."""
    name = type(module).__name__
    if name == "GPTNeoXAttention":
        _refuse_children(module, {"query_key_value", "dense", "rotary_emb", "attention_dropout"})
        config = module.config
        h = V.check_positive_int(config.num_attention_heads, "num_attention_heads")
        d = int(module.head_size)
        w, b = _linear(module, "query_key_value")
        q, k, v = _interleaved(h, 3, d)  # view(h, 3 d): per head [q | k | v]
        out = _split_rows(w, b, {"q": q, "k": k, "v": v})
        out["w_o"], out["b_o"] = _linear(module, "dense")
        out.update(num_heads=h, causal=bool(module.is_causal), scale=float(module.scaling))
        out.update(_rope_kwargs(module, config, d, rope_length))
        return out
    if name == "FalconAttention":
        _refuse_children(module, {"query_key_value", "dense", "attention_dropout", "rotary_emb"})
        config = module.config
        h, d = int(module.num_heads), int(module.head_dim)
        w, b = _linear(module, "query_key_value")
        if module.new_decoder_architecture:  # per kv group: [q_1 .. q_g | k | v]
            h_kv = int(module.num_kv_heads)
            g = h // h_kv
            grid = np.arange(h_kv * (g + 2) * d).reshape(h_kv, g + 2, d)
            cols = {
                "q": grid[:, :g].reshape(-1),
                "k": grid[:, g].reshape(-1),
                "v": grid[:, g + 1].reshape(-1),
            }
        elif module.multi_query:  # [q_1 .. q_h | k | v]
            h_kv = 1
            cols = {
                "q": np.arange(h * d),
                "k": np.arange(h * d, (h + 1) * d),
                "v": np.arange((h + 1) * d, (h + 2) * d),
            }
        else:
            h_kv = h
            q, k, v = _interleaved(h, 3, d)
            cols = {"q": q, "k": k, "v": v}
        out = _split_rows(w, b, cols)
        out["w_o"], out["b_o"] = _linear(module, "dense")
        out.update(num_heads=h, num_kv_heads=h_kv, causal=True)
        if config.alibi:
            raise ValueError(
                "module: FalconAttention with config.alibi = True builds its ALiBi biases in "
                "bfloat16 (slopes and slope * position rounded to 8 bits), which "
                "multi_head_attention's exact alibi_slopes do not reproduce; use a rotary "
                "Falcon (alibi=False)"
            )
        out["scale"] = 1.0 / math.sqrt(d)
        out.update(_rope_kwargs(module, config, d, rope_length))
        return out
    if name == "BloomAttention":
        _refuse_children(module, {"query_key_value", "dense", "attention_dropout"})
        if not ignore_residual:
            raise ValueError(
                "module: BloomAttention returns x_residual + dense(attention(x)) (its forward "
                "takes the residual); the residual is not attention. Pass ignore_residual=True "
                "to get the attention up to dense, then add the residual yourself"
            )
        h, d = int(module.num_heads), int(module.head_dim)
        w, b = _linear(module, "query_key_value")
        q, k, v = _interleaved(h, 3, d)
        out = _split_rows(w, b, {"q": q, "k": k, "v": v})
        out["w_o"], out["b_o"] = _linear(module, "dense")
        out.update(num_heads=h, causal=True, scale=float(module.inv_norm_factor))
        # BLOOM adds slope * j; with the causal mask that is -slope * (i - j) plus a constant
        # per row, which the softmax removes
        _option(out, "alibi_slopes", _alibi_slopes(h), module, "ALiBi position biases")
        return out
    # MptAttention
    _refuse_children(module, {"Wqkv", "out_proj"})
    if module.clip_qkv:
        raise ValueError(
            f"module: MptAttention with clip_qkv = {module.clip_qkv} clamps the projections, "
            f"which multi_head_attention does not do"
        )
    h, d = int(module.n_heads), int(module.head_dim)
    w, b = _linear(module, "Wqkv")
    E = h * d
    out = _split_rows(
        w, b, {"q": np.arange(E), "k": np.arange(E, 2 * E), "v": np.arange(2 * E, 3 * E)}
    )
    out["w_o"], out["b_o"] = _linear(module, "out_proj")
    out.update(num_heads=h, causal=True, scale=float(module.softmax_scale))
    # MptModel adds its ALiBi tensor to every layer, whatever attn_config.alibi says, with
    # build_mpt_alibi_tensor's default alibi_bias_max = 8 (not the config's)
    p = 2 ** math.ceil(math.log2(h))
    slopes = 1.0 / 2.0 ** (np.arange(1, p + 1) * (8.0 / p))
    if p != h:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:h]
    _option(out, "alibi_slopes", slopes, module, "ALiBi position biases")
    return out


def _unknown(module: Any) -> TypeError:
    """The refusal of an unsupported module class, naming what its attention does."""
    name = type(module).__name__
    config = getattr(module, "config", None)
    found = []
    for attr, what in _FEATURES.items():
        for owner in (module, config):
            if owner is not None and getattr(owner, attr, None) not in (None, False):
                found.append(f"{what} ({attr})")
                break
    does = f"; its attention has {', '.join(found)}" if found else ""
    return TypeError(
        f"module: {name} is not a transformers attention module from_transformers reads"
        f"{does}. Supported: {', '.join(_SUPPORTED)}. For another family, pass its "
        f"projections to multi_head_attention yourself and check the result against the module"
    )


def _vit(module: Any) -> dict[str, Any]:
    _refuse_children(module, {"q_proj", "k_proj", "v_proj", "o_proj"})
    h = V.check_positive_int(module.num_attention_heads, "num_attention_heads")
    out: dict[str, Any] = {}
    for p in "qkvo":
        out[f"w_{p}"], out[f"b_{p}"] = _linear(module, f"{p}_proj")
    out.update(num_heads=h, causal=bool(module.is_causal), scale=float(module.scaling))
    return out


@_docs.filled
def from_transformers(
    module: Any,
    *,
    ignore_norm: bool = False,
    ignore_residual: bool = False,
    rope_length: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of :func:`attnlab.multi_head_attention` from a ``transformers``
    attention module: the module's attention exactly, or an error naming what is not
    reproduced (never an approximation).

    Supported (transformers 5):

    - encoders: ``BertSelfAttention`` / ``BertAttention`` (BERT, MiniLM, sentence-transformers;
      ``Roberta*`` too), ``ViTAttention``;
    - ``GPT2Attention`` (self- and cross-attention; ``Conv1D`` weights are already
      ``(in, out)`` and ``c_attn`` packs Q, K and V);
    - rotary decoders: ``LlamaAttention``, ``MistralAttention``, ``MixtralAttention``,
      ``Qwen2Attention`` (sliding or full layers), ``Qwen3Attention`` / ``Qwen3MoeAttention``
      (q/k RMSNorm), ``GemmaAttention``, ``Gemma2Attention`` (soft-capping, sliding layers,
      ``query_pre_attn_scalar``), ``Gemma3Attention`` (q/k norm with ``1 + weight``, sliding
      layers with their own rotary base), ``GptOssAttention`` (sinks, sliding layers, YaRN),
      ``Phi3Attention`` (packed ``qkv_proj``, partial rotary, LongRoPE);
    - packed projections: ``GPTNeoXAttention`` (GPT-NeoX, Pythia; partial rotary),
      ``FalconAttention`` (rotary; multi-query, grouped (new decoder architecture) or
      multi-head; its bfloat16 ALiBi is refused), ``BloomAttention`` and ``MptAttention``
      (ALiBi);
    - multi-head latent attention: ``DeepseekV2Attention``, ``DeepseekV3Attention`` (with or
      without ``q_lora_rank``, interleaved or half-split rotary, YaRN with its ``mscale``):
      the keyword arguments of :func:`attnlab.latent_attention`, not of
      ``multi_head_attention``.

    T5's relative position bias: :func:`t5_position_bias`.

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
    ignore_residual : bool
        ``BloomAttention`` returns ``residual + dense(context)``: it is refused unless
        ``ignore_residual=True``, and then the result stops at ``dense`` (add the residual
        yourself).
    rope_length : int, optional
        For rotary embeddings whose frequencies depend on the sequence length (``dynamic``:
        NTK scaling beyond ``max_position_embeddings``; ``longrope``: the long factors beyond
        ``original_max_position_embeddings``): the length transformers sees, its largest
        position id + 1. Required for those types, ignored otherwise.

    Returns
    -------
    dict
        ``w_q, w_k, w_v, w_o`` (``(in, out)``), the biases the module has, ``num_heads``,
        ``num_kv_heads`` (decoders), ``causal`` (True for the decoders, whose modules apply a
        causal mask), ``scale`` (the module's own: GPT-2's ``scale_attn_by_inverse_layer_idx``,
        Gemma's ``query_pre_attn_scalar``); the rotary embeddings as ``rope_theta`` (and
        ``rope_dim`` when partial) for the default frequencies, else ``rope_inv_freq`` and
        ``rope_scale`` (``attention_factor``) computed in float64 from the config by
        transformers' formulas; ``q_norm``, ``k_norm`` and ``norm_eps``; ``window=(W - 1, 0)``
        for a sliding window of ``W`` (transformers' query ``i`` sees keys ``i - W < j <= i``);
        ``softcap``; ``sinks``; ``alibi_slopes``. Copies: they do not follow later training of
        the module.

    Raises
    ------
    TypeError
        For another class of module (naming what its attention does that attnlab would have
        to reproduce), or a state dict (pass the module).
    ValueError
        For what ``multi_head_attention`` cannot represent, naming the setting: an option this
        attnlab lacks (``window``, ``softcap``, ``sinks``, ``alibi_slopes``), BERT's relative
        position scores, unknown rotary types, MPT's ``clip_qkv`` / ``qk_ln``, extra
        sub-modules, ``BertAttention`` without ``ignore_norm=True``, ``BloomAttention``
        without ``ignore_residual=True``, length-dependent rotary types without
        ``rope_length``.

    Notes
    -----
    Call the result on the module's inputs: ``multi_head_attention(x, **kwargs)`` for
    self-attention, ``multi_head_attention(x, encoder_states, **kwargs)`` for GPT-2's
    cross-attention. Masks: :func:`transformers_masks` converts a model's ``attention_mask``
    (the sliding window and ALiBi come from the kwargs: convert only the padding, the 2-D
    mask). Rotary positions default to ``0..n-1``; pass ``positions=position_ids`` otherwise.
    Dropout is not applied (eval mode). transformers computes its rotary tables in float32:
    a float64 module agrees with attnlab (float64 tables) to that rounding; its RMSNorms run
    in float32 too.

    {interop_examples}
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
    norm = _flag(ignore_norm, "ignore_norm")
    residual = _flag(ignore_residual, "ignore_residual")
    if rope_length is not None:
        V.check_positive_int(rope_length, "rope_length")
    kwargs = _from_transformers(module, norm, residual, rope_length)
    return {k: v for k, v in kwargs.items() if v is not None}  # biases the module lacks


def _from_transformers(
    module: Any, ignore_norm: bool, ignore_residual: bool, rope_length: int | None
) -> dict[str, Any]:
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
    if name == "ViTAttention":
        return _vit(module)
    if name == "GPT2Attention":
        return _gpt2(module)
    if name in _ROTARY:
        return _rotary(module, rope_length)
    if name in _PACKED:
        return _packed(module, rope_length, ignore_residual)
    if name in _LATENT:
        return _latent(module, rope_length)
    if name == "T5Attention":
        raise ValueError(
            "module: T5Attention adds a relative position bias that its stack's first layer "
            "owns (not visible from the other layers), and a decoder's T5Attention is causal "
            "self-attention or cross-attention by where it sits; read its q, k, v, o weights "
            "(scale=1.0, no biases) and pass mask=attnlab.interop.t5_position_bias(first "
            "layer's attention, n_q, n_k) for self-attention"
        )
    raise _unknown(module)


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


def _latent(module: Any, rope_length: int | None) -> dict[str, Any]:
    """DeepSeek-V2/V3's multi-head latent attention as ``latent_attention``'s kwargs."""
    name = type(module).__name__
    config = module.config
    lora = getattr(module, "q_lora_rank", None) is not None
    queries = {"q_a_proj", "q_a_layernorm", "q_b_proj"} if lora else {"q_proj"}
    _refuse_children(
        module, queries | {"kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"}
    )
    out: dict[str, Any] = {}
    eps = set()
    if lora:
        out["w_q_a"], out["b_q_a"] = _linear(module, "q_a_proj")
        out["q_a_norm"], e = _norm_weight(module, "q_a_layernorm")
        eps.add(e)
        out["w_q_b"], b = _linear(module, "q_b_proj")
    else:
        out["w_q"], b = _linear(module, "q_proj")
    if b is not None:
        raise ValueError(f"module: {name}'s query up-projection has a bias, not reproduced")
    out["w_kv_a"], out["b_kv_a"] = _linear(module, "kv_a_proj_with_mqa")
    out["kv_a_norm"], e = _norm_weight(module, "kv_a_layernorm")
    eps.add(e)
    if len(eps) > 1:
        raise ValueError(f"module: {name}'s two RMSNorms have different epsilons {sorted(eps)}")
    out["w_kv_b"], b = _linear(module, "kv_b_proj")
    if b is not None:
        raise ValueError(f"module: {name}'s kv_b_proj has a bias, not reproduced")
    out["w_o"], out["b_o"] = _linear(module, "o_proj")
    dr = V.check_positive_int(config.qk_rope_head_dim, "qk_rope_head_dim")
    rope_type, theta, dim, inv, factor = _inverse_frequencies(module, config, dr, rope_length)
    if dim != dr:
        raise ValueError(
            f"module: {name}'s rotary embeddings turn {dim} features, not qk_rope_head_dim = "
            f"{dr}; latent_attention rotates the whole rotary part"
        )
    if rope_type == "default":
        out["rope_theta"] = theta
    else:
        out["rope_inv_freq"] = inv
        if factor != 1.0:
            out["rope_scale"] = factor
    # V2 rotates complex pairs (interleaved); V3 as its config says
    interleave = name == "DeepseekV2Attention" or bool(getattr(config, "rope_interleave", True))
    out.update(
        num_heads=V.check_positive_int(module.num_heads, "num_attention_heads"),
        causal=bool(module.is_causal),
        scale=float(module.scaling),
        rope_interleave=interleave,
        norm_eps=eps.pop(),
    )
    return out
