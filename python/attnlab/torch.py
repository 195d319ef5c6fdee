"""attnlab's kernels as differentiable PyTorch operations on CPU tensors (optional; imports torch).

Each function has the signature of its NumPy counterpart in :mod:`attnlab` but takes and
returns CPU ``torch.Tensor`` s: float32, float64, float16 or bfloat16 (half-precision tensors
are read and written as stored, as attnlab's half-precision arrays are; bfloat16 needs
``ml_dtypes``). It is a ``torch.autograd.Function``: the forward calls attnlab's C++ forward
through :func:`attnlab.vjp`, the backward its pullback (one forward per training step), so an
attnlab kernel can replace the attention inside a torch model and train with it::

    import torch, attnlab.torch as at
    out = at.multi_head_attention(x, w_q=wq, w_k=wk, w_v=wv, w_o=wo, num_heads=8)
    out.sum().backward()          # gradients for x, wq, wk, wv, wo

Gradients flow to every tensor argument except boolean masks and ``key_padding_mask``, which are
constants, as in attnlab; a float ``mask`` that requires grad is differentiated (a learned
additive bias, such as T5's or Swin's relative position bias). Weights follow attnlab's
convention ``(in, out)``, the transpose of ``nn.Linear.weight`` (see :mod:`attnlab.interop`).
Passing the same tensor as ``query`` and ``key`` (and ``value``) takes attnlab's self-attention
path. The backward is not itself differentiable (no double backward). Only this module imports
torch; the rest of attnlab never does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import _additive, _args, _bilinear, _docs, _latent, _mha
from . import _signature as _sig
from ._bilinear import BilinearQK
from ._vjp import vjp
from .interop._common import _plain

__all__ = [
    "additive_attention",
    "bilinear_attention",
    "latent_attention",
    "multi_head_attention",
    "scaled_dot_product_attention",
    "separable_attention",
]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _bfloat16(name: str) -> np.dtype:
    """NumPy's bfloat16 (``ml_dtypes``, which NumPy needs to name it), or ``TypeError``."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            f"{name}: a torch.bfloat16 tensor needs the ml_dtypes package (NumPy's bfloat16): "
            f"pip install ml_dtypes, or pass .float()"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def _check(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU tensor, got device {t.device} (use .cpu())")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in _FLOATS:
        raise TypeError(
            f"{name}: expected a float32, float64, float16 or bfloat16 tensor, got {t.dtype}"
        )
    if t.dtype == torch.bfloat16:
        _bfloat16(name)
    return t


def _array(t: torch.Tensor) -> np.ndarray:
    """A checked tensor as a NumPy array sharing its memory (bfloat16 as ``ml_dtypes``')."""
    t = t.detach()
    if t.dtype == torch.bfloat16:  # no NumPy dtype of torch's: the same bits, viewed
        return t.view(torch.int16).numpy().view(_bfloat16("tensor"))
    return t.numpy()


def _learned(m: Any) -> bool:
    """A float mask that requires grad: an input of the autograd Function, differentiated."""
    return isinstance(m, torch.Tensor) and m.requires_grad


def _mask(m: Any, name: str) -> Any:
    """A mask tensor as a NumPy array (bool or float; not differentiated); others as given."""
    if not isinstance(m, torch.Tensor):
        return m
    if m.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU tensor, got device {m.device} (use .cpu())")
    if m.dtype != torch.bool and not m.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a bool or floating-point tensor, got {m.dtype}")
    return np.array(_plain(m), copy=True)  # a snapshot: the backward must see the same mask


def _positions(p: Any) -> Any:
    """Rotary positions (a tensor, array or a pair of them) as NumPy snapshots."""
    if isinstance(p, tuple):
        return tuple(_positions(x) for x in p)
    return np.array(_plain(p), copy=True) if isinstance(p, torch.Tensor) else p


def _tensor(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    a = np.asarray(a)
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = np.array(a, order="C", copy=True)
    if a.dtype.name == "bfloat16":  # ml_dtypes': its bits, viewed as torch's
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


# what a forward returns after its output, in order, when asked: the weights and the
# log-sum-exp are not differentiated; latent attention's cache is
_EXTRA_OUTPUTS = ("weights", "lse", "cache")


class _Call:
    """One call: the NumPy forward, the tensor arguments' names, the constants, the names of
    what it returns (``"out"``, then those of :data:`_EXTRA_OUTPUTS` asked for)."""

    def __init__(
        self, forward: Callable[..., Any], tensors: dict[str, Any], consts: dict[str, Any]
    ) -> None:
        self.forward = forward
        self.names = [n for n, t in tensors.items() if t is not None]
        self.inputs = [_check(tensors[n], n) for n in self.names]
        self.consts = consts
        self.outputs = ("out",) + tuple(n for n in _EXTRA_OUTPUTS if consts.get(f"return_{n}"))

    def arrays(self, tensors: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
        return {n: _array(t) for n, t in zip(self.names, tensors, strict=True)}

    def apply(self) -> Any:
        inputs, self.inputs = self.inputs, []  # the autograd context keeps what it needs
        return _Attention.apply(self, *inputs)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        # one forward per step: the pullback reuses what this forward kept (attnlab.vjp), on
        # its own copies, so torch need not save the input tensors
        result, ctx.pullback = vjp(call.forward, **call.arrays(tensors), **call.consts)
        ctx.call = call
        ctx.dtypes = [t.dtype for t in tensors]
        if len(call.outputs) == 1:
            return _tensor(result)
        outs = tuple(_tensor(r) for r in result)
        for name, t in zip(call.outputs, outs, strict=True):
            if name in ("weights", "lse"):
                ctx.mark_non_differentiable(t)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor, *grad_extra: Any) -> Any:  # type: ignore[override]
        call: _Call = ctx.call
        g: Any = _array(grad_out)
        if "cache" in call.outputs:  # the pair (grad_out, grad_cache) of latent attention
            gc = grad_extra[call.outputs.index("cache") - 1]
            g = (g, None if gc is None else _array(gc))
        grads = ctx.pullback(g)
        result: list[torch.Tensor | None] = [None]
        for name, dtype, need in zip(call.names, ctx.dtypes, ctx.needs_input_grad[1:], strict=True):
            g = grads.get(name) if need else None
            result.append(None if g is None else _tensor(g, dtype))
        return tuple(result)


def _kv(query: Any, key: Any, value: Any) -> tuple[Any, Any]:
    """Drop ``key``/``value`` when they are the very tensor they default to (attnlab's
    self-attention path; autograd still sums the gradient once into that tensor)."""
    if key is query:
        key = None
    if value is (query if key is None else key):
        value = None
    return key, value


def _apply(forward: Callable[..., Any], tensor_names: tuple[str, ...], args: dict[str, Any]) -> Any:
    """One call of ``forward`` on tensors: masks and positions become NumPy constants, the
    tensor arguments given (in ``tensor_names`` order, the order they are checked in, then a
    float ``mask`` that requires grad) become the inputs of one autograd Function, everything
    else is passed as it is."""
    if "key" in args:
        args["key"], args["value"] = _kv(args["query"], args["key"], args["value"])
    learned = "mask" in args and _learned(args["mask"])
    for name in _args.MASK_ARGS:
        if name in args and not (name == "mask" and learned):
            args[name] = _mask(args[name], name)
    for name in ("positions", "rope_inv_freq"):  # constants
        if name in args:
            args[name] = _positions(args[name])
    names = [n for n in tensor_names if not isinstance(args[n], BilinearQK)]  # a constant
    if learned:
        names.append("mask")
    tensors = {n: args.pop(n) for n in names}
    return _Call(forward, tensors, args).apply()


def _wrapper(
    forward: Callable[..., Any],
    tensor_names: tuple[str, ...],
    doc: str,
    returns: str = "Any",
    *,
    origin: str = "",
    apart: tuple[str, ...] = (),
) -> Callable[..., Any]:
    """The torch version of ``forward``: its signature (tensors where it takes arrays), its
    validation, its kernels through :func:`_apply`.

    Its docstring opens as every wrapper's does (what it wraps, ``origin``: the model that
    introduced it, the Parameters heading), then ``doc``, with :mod:`attnlab._docs`' fragments
    filled in and ``{constants}`` standing for the list of ``forward``'s parameters that are
    neither tensors nor ``apart`` (those ``doc`` describes on their own): the options, as for
    ``forward``, whatever options it gains."""
    params = _sig.public_parameters(forward)
    annotations = {
        p.name: "torch.Tensor | None" if p.default is None else "torch.Tensor"
        for p in params
        if p.name in tensor_names
    }
    annotations.update({"w_qk": "torch.Tensor | BilinearQK", "return_weights": "bool | str"})
    head = (
        f"Differentiable :func:`attnlab.{forward.__name__}`{f' ({origin})' if origin else ''} "
        f"on CPU tensors.\n\n    Parameters\n    ----------\n"
    )
    return _sig.generate(
        forward.__name__,
        __name__,
        params,
        returns,
        _docs.fill(head + doc, {"constants": _sig.name_list(forward, but=tensor_names + apart)}),
        lambda args: _apply(forward, tensor_names, args),
        annotations=annotations,
    )


# The wrappers take their NumPy function's signature (a new keyword argument of a family
# reaches them, and the lists {constants} of their docs, with no edit here); the tuples name the
# tensor arguments, in checking order; each doc starts at the first parameter (_wrapper writes
# the opening).

_SDPA_DOC = """\
    q : torch.Tensor, shape (..., h, n_q, d)
    k : torch.Tensor, shape (..., h_kv, n_k, d)
    v : torch.Tensor, shape (..., h_kv, n_k, d_v)
        float32, float64, float16 or bfloat16, on the CPU.
    {constants}
        As for :func:`attnlab.scaled_dot_product_attention` (``True`` in a boolean mask means
        *may attend*, as in ``F.scaled_dot_product_attention``, the opposite of
        ``nn.MultiheadAttention``'s masks: see :func:`attnlab.interop.torch_masks`); a mask may
        be a tensor. The backward does not warn again.
    sinks : torch.Tensor, shape (h,) or (..., h), optional
        Attention sinks (a per-head logit in every softmax denominator), differentiated.

    Returns
    -------
    out : torch.Tensor, shape (..., h, n_q, d_v)
        Differentiable with respect to ``q``, ``k``, ``v``, ``sinks`` and a float ``mask``
        that requires grad.
    weights : torch.Tensor, optional
        When ``return_weights`` is set; not differentiable.

    {torch_examples}
    >>> q = torch.randn(2, 4, 8, requires_grad=True)
    >>> at.scaled_dot_product_attention(q, q, q, causal=True).sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 8])
    """
scaled_dot_product_attention = _wrapper(
    _mha.scaled_dot_product_attention, ("q", "k", "v", "sinks"), _SDPA_DOC
)

_MULTI_HEAD_DOC = """\
    query : torch.Tensor, shape (..., n_q, d_q)
    key : torch.Tensor, shape (..., n_k, d_k), optional
        Defaults to ``query``.
    value : torch.Tensor, shape (..., n_k, d_v), optional
        Defaults to ``key``.
    w_q, w_k, w_v, w_o : torch.Tensor
        ``(in, out)`` weights: ``nn.Linear.weight.T``.
    b_q, b_k, b_v, b_o : torch.Tensor, optional
    {constants}
        As for :func:`attnlab.multi_head_attention` (``True`` in a boolean mask means *may
        attend*; :func:`attnlab.interop.torch_masks` converts ``nn.MultiheadAttention``'s).
        The backward does not warn again.
    q_norm, k_norm : torch.Tensor, shape (d_head,), optional
        Per-head RMSNorm weights of the queries and keys, differentiated.
    sinks : torch.Tensor, shape (h,) or (..., h), optional
        Attention sinks (a per-head logit in every softmax denominator), differentiated.
    rope_theta, rope_dim, positions, rope_inv_freq, rope_scale
        Rotary embeddings, as for :func:`attnlab.multi_head_attention`; ``positions`` (array,
        tensor or a pair of them) and ``rope_inv_freq`` are constants, not differentiated.

    {torch_attention_returns}

    {torch_examples}
    >>> x = torch.randn(2, 5, 16, requires_grad=True)
    >>> w = [torch.randn(16, 16, requires_grad=True) for _ in range(4)]
    >>> out = at.multi_head_attention(x, w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3], num_heads=4)
    >>> out.square().mean().backward()
    >>> x.grad.shape, w[0].grad.shape
    (torch.Size([2, 5, 16]), torch.Size([16, 16]))
    """
multi_head_attention = _wrapper(
    _mha.multi_head_attention,
    (
        "query",
        "key",
        "value",
        "w_q",
        "w_k",
        "w_v",
        "w_o",
        "b_q",
        "b_k",
        "b_v",
        "b_o",
        "q_norm",
        "k_norm",
        "sinks",
    ),
    _MULTI_HEAD_DOC,
    apart=("rope_theta", "rope_dim", "positions", "rope_inv_freq", "rope_scale"),
)

_BILINEAR_DOC = """\
    query : torch.Tensor, shape (..., n_q, d_q)
    key : torch.Tensor, shape (..., n_k, d_k), optional
    value : torch.Tensor, shape (..., n_k, d_v), optional
    w_qk : torch.Tensor, shape (h, d_q, d_k), or BilinearQK
        A :class:`attnlab.BilinearQK` (NumPy arrays) is a constant: no gradient flows to it.
    u_k : torch.Tensor, shape (h, d_k), optional
    w_v, w_o, b_v, b_o : torch.Tensor
    sinks : torch.Tensor, shape (h,) or (..., h), optional
        Attention sinks, differentiated.
    {constants}
        As for :func:`attnlab.bilinear_attention` (``True`` in a boolean mask means *may
        attend*; :func:`attnlab.interop.torch_masks` converts ``nn.MultiheadAttention``'s).

    {torch_attention_returns}

    {torch_examples}
    >>> x = torch.randn(5, 8)
    >>> w_qk = torch.randn(2, 8, 8, requires_grad=True)
    >>> out = at.bilinear_attention(x, w_qk=w_qk, w_v=torch.randn(8, 8), w_o=torch.randn(8, 8),
    ...                             num_heads=2)
    >>> out.sum().backward()
    >>> w_qk.grad.shape
    torch.Size([2, 8, 8])
    """
bilinear_attention = _wrapper(
    _bilinear.bilinear_attention,
    ("query", "key", "value", "u_k", "w_v", "w_o", "b_v", "b_o", "w_qk", "sinks"),
    _BILINEAR_DOC,
)

_ADDITIVE_DOC = """\
    x : torch.Tensor, shape (..., n, d_in)
    w_q, w_k : torch.Tensor, shape (d_in, D)
    b_q, b_k : torch.Tensor, shape (D,), optional
    w_g : torch.Tensor, shape (D,) or (D, 1)
    w_proj : torch.Tensor, shape (D, D)
    b_proj : torch.Tensor, shape (D,), optional
    w_final : torch.Tensor, shape (D, d_out)
    b_final : torch.Tensor, shape (d_out,), optional
    scale, variant, eps, key_padding_mask, warn_empty_rows
        As for :func:`attnlab.additive_attention` (``True`` = real token, the opposite of
        ``nn.MultiheadAttention``'s; :func:`attnlab.interop.torch_masks` converts it).

    {torch_pooled_returns}

    {torch_examples}
    >>> x = torch.randn(2, 49, 8, requires_grad=True)
    >>> w = {k: torch.randn(8, 8) for k in ("w_q", "w_k", "w_proj", "w_final")}
    >>> at.additive_attention(x, w_g=torch.randn(8, 1), **w).sum().backward()
    >>> x.grad.shape
    torch.Size([2, 49, 8])
    """
additive_attention = _wrapper(
    _additive.additive_attention,
    ("x", "w_q", "b_q", "w_k", "b_k", "w_g", "w_proj", "b_proj", "w_final", "b_final"),
    _ADDITIVE_DOC,
    "torch.Tensor",
    origin="SwiftFormer",
)

_SEPARABLE_DOC = """\
    x : torch.Tensor, shape (..., n, d)
    w_qkv : torch.Tensor, shape (d, 1 + 2 d)
    b_qkv : torch.Tensor, shape (1 + 2 d,), optional
    w_o : torch.Tensor, shape (d, d_out)
    b_o : torch.Tensor, shape (d_out,), optional
    key_padding_mask, warn_empty_rows
        As for :func:`attnlab.separable_attention` (``True`` = real token, the opposite of
        ``nn.MultiheadAttention``'s; :func:`attnlab.interop.torch_masks` converts it).

    {torch_pooled_returns}

    {torch_examples}
    >>> x = torch.randn(2, 16, 8, requires_grad=True)
    >>> out = at.separable_attention(x, w_qkv=torch.randn(8, 17), w_o=torch.randn(8, 8))
    >>> out.sum().backward()
    >>> x.grad.shape
    torch.Size([2, 16, 8])
    """
separable_attention = _wrapper(
    _additive.separable_attention,
    ("x", "w_qkv", "b_qkv", "w_o", "b_o"),
    _SEPARABLE_DOC,
    "torch.Tensor",
    origin="MobileViT-v2",
)

_LATENT_DOC = """\
    x : torch.Tensor, shape (..., n, d)
    w_q, w_q_a, b_q_a, q_a_norm, w_q_b, w_kv_a, b_kv_a, kv_a_norm, w_kv_b, w_o, b_o : torch.Tensor
        ``(in, out)`` weights (``nn.Linear.weight.T``), biases and RMSNorm weights, as for
        :func:`attnlab.latent_attention`; those not given are ``None``.
    cache : torch.Tensor, shape (..., n_past, kv_lora_rank + d_rope), optional
        Differentiated too.
    {constants}
        As for :func:`attnlab.latent_attention` (``True`` in a boolean mask means *may
        attend*, the opposite of ``nn.MultiheadAttention``'s masks: see
        :func:`attnlab.interop.torch_masks`); ``positions`` and ``rope_inv_freq`` are
        constants.

    Returns
    -------
    out : torch.Tensor, shape (..., n, d_out)
        Differentiable with respect to every tensor argument but a boolean ``mask`` (a float
        ``mask`` is when it requires grad).
    weights, lse : torch.Tensor, optional
        With ``return_weights`` and ``return_lse``, as for :func:`attnlab.latent_attention`;
        not differentiable (``requires_grad`` is False: a loss through them gets no gradient
        from them).
    cache : torch.Tensor, shape (..., n_past + n, kv_lora_rank + d_rope), optional
        With ``return_cache``, last: differentiable, so a loss over several decode steps, each
        fed the cache the one before returned, trains through all of them.

    {torch_examples}
    >>> h, d, r, dn, dr, dv = 2, 16, 8, 4, 4, 4
    >>> w = dict(w_q=torch.randn(d, h * (dn + dr)) / 4, w_kv_a=torch.randn(d, r + dr) / 4,
    ...          kv_a_norm=torch.ones(r), w_kv_b=torch.randn(r, h * (dn + dv)) / 3,
    ...          w_o=torch.randn(h * dv, d) / 3)
    >>> x = torch.randn(3, d, requires_grad=True)
    >>> at.latent_attention(x, **w, num_heads=h, rope_theta=1e4).sum().backward()
    >>> x.grad.shape
    torch.Size([3, 16])
    """
latent_attention = _wrapper(
    _latent.latent_attention,
    ("x", *_latent.WEIGHTS, "cache", "sinks"),
    _LATENT_DOC,
    origin="DeepSeek-V2/V3",
)
