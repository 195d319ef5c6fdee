"""attnlab's kernels as differentiable PyTorch operations on CPU tensors (optional; imports torch).

Each function has the signature of its NumPy counterpart in :mod:`attnlab` but takes and
returns CPU ``torch.Tensor`` s (float32 or float64). It is a ``torch.autograd.Function``: the
forward calls attnlab's C++ forward through :func:`attnlab.vjp`, the backward its pullback (one
forward per training step), so an attnlab kernel can replace the attention inside a torch model
and train with it::

    import torch, attnlab.torch as at
    out = at.multi_head_attention(x, w_q=wq, w_k=wk, w_v=wv, w_o=wo, num_heads=8)
    out.sum().backward()          # gradients for x, wq, wk, wv, wo

Gradients flow to every tensor argument except the masks (``mask``, ``key_padding_mask``),
which are constants, as in attnlab. Weights follow attnlab's convention ``(in, out)``, the
transpose of ``nn.Linear.weight`` (see :mod:`attnlab.interop`). Passing the same tensor as
``query`` and ``key`` (and ``value``) takes attnlab's self-attention path. The backward is not
itself differentiable (no double backward). Only this module imports torch; the rest of attnlab
never does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import _additive, _bilinear, _mha
from ._bilinear import BilinearQK
from ._vjp import vjp
from .interop import _plain

__all__ = [
    "additive_attention",
    "bilinear_attention",
    "multi_head_attention",
    "scaled_dot_product_attention",
    "separable_attention",
]

_FLOATS = (torch.float32, torch.float64)


def _check(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU tensor, got device {t.device} (use .cpu())")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected a float32 or float64 tensor, got {t.dtype}")
    return t


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
    t = torch.from_numpy(a)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


class _Call:
    """One call: the NumPy forward, the tensor arguments' names, the constants."""

    def __init__(self, forward: Callable[..., Any], tensors: dict[str, Any],
                 consts: dict[str, Any], weights: bool) -> None:
        self.forward = forward
        self.names = [n for n, t in tensors.items() if t is not None]
        self.inputs = [_check(tensors[n], n) for n in self.names]
        self.consts = consts
        self.weights = weights

    def arrays(self, tensors: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
        return {n: _plain(t) for n, t in zip(self.names, tensors, strict=True)}

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
        if call.weights:
            out, w = result
            wt = _tensor(w)
            ctx.mark_non_differentiable(wt)
            return _tensor(out), wt
        return _tensor(result)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor, *_weights_grad: Any) -> Any:  # type: ignore[override]
        call: _Call = ctx.call
        grads = ctx.pullback(_plain(grad_out))
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


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = None,
    causal: bool | str = False,
    scale: float | None = None,
    return_weights: bool | str = False,
    warn_empty_rows: bool = True,
) -> Any:
    """Differentiable :func:`attnlab.scaled_dot_product_attention` on CPU tensors.

    Parameters
    ----------
    q : torch.Tensor, shape (..., h, n_q, d)
    k : torch.Tensor, shape (..., h_kv, n_k, d)
    v : torch.Tensor, shape (..., h_kv, n_k, d_v)
        float32 or float64, on the CPU.
    mask, causal, scale, return_weights, warn_empty_rows
        As for :func:`attnlab.scaled_dot_product_attention` (``True`` in a boolean mask means
        *may attend*, as in ``F.scaled_dot_product_attention``, the opposite of
        ``nn.MultiheadAttention``'s masks: see :func:`attnlab.interop.torch_masks`); a mask may
        be a tensor. The backward does not warn again.

    Returns
    -------
    out : torch.Tensor, shape (..., h, n_q, d_v)
        Differentiable with respect to ``q``, ``k`` and ``v``.
    weights : torch.Tensor, optional
        When ``return_weights`` is set; not differentiable.

    Examples
    --------
    >>> import torch, attnlab.torch as at
    >>> q = torch.randn(2, 4, 8, requires_grad=True)
    >>> at.scaled_dot_product_attention(q, q, q, causal=True).sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 8])
    """
    consts = dict(mask=_mask(mask, "mask"), causal=causal, scale=scale,
                  return_weights=return_weights, warn_empty_rows=warn_empty_rows)
    call = _Call(_mha.scaled_dot_product_attention, dict(q=q, k=k, v=v), consts,
                 bool(return_weights))
    return call.apply()


def multi_head_attention(
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    w_o: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    b_o: torch.Tensor | None = None,
    num_heads: int,
    num_kv_heads: int | None = None,
    mask: Any = None,
    key_padding_mask: Any = None,
    causal: bool | str = False,
    scale: float | None = None,
    return_weights: bool | str = False,
    rope_theta: float | None = None,
    rope_dim: int | None = None,
    positions: Any = None,
    warn_empty_rows: bool = True,
) -> Any:
    """Differentiable :func:`attnlab.multi_head_attention` on CPU tensors.

    Parameters
    ----------
    query : torch.Tensor, shape (..., n_q, d_q)
    key : torch.Tensor, shape (..., n_k, d_k), optional
        Defaults to ``query``.
    value : torch.Tensor, shape (..., n_k, d_v), optional
        Defaults to ``key``.
    w_q, w_k, w_v, w_o : torch.Tensor
        ``(in, out)`` weights: ``nn.Linear.weight.T``.
    b_q, b_k, b_v, b_o : torch.Tensor, optional
    num_heads, num_kv_heads, mask, key_padding_mask, causal, scale, return_weights,
    warn_empty_rows
        As for :func:`attnlab.multi_head_attention` (``True`` in a boolean mask means *may
        attend*; :func:`attnlab.interop.torch_masks` converts ``nn.MultiheadAttention``'s).
        The backward does not warn again.
    rope_theta, rope_dim, positions
        Rotary embeddings, as for :func:`attnlab.multi_head_attention`; ``positions`` (array,
        tensor or a pair of them) is a constant, not differentiated.

    Returns
    -------
    out : torch.Tensor, shape (..., n_q, d_out)
        Differentiable with respect to every tensor argument but the masks.
    weights : torch.Tensor, optional
        When ``return_weights`` is set; not differentiable.

    Examples
    --------
    >>> import torch, attnlab.torch as at
    >>> x = torch.randn(2, 5, 16, requires_grad=True)
    >>> w = [torch.randn(16, 16, requires_grad=True) for _ in range(4)]
    >>> out = at.multi_head_attention(x, w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3], num_heads=4)
    >>> out.square().mean().backward()
    >>> x.grad.shape, w[0].grad.shape
    (torch.Size([2, 5, 16]), torch.Size([16, 16]))
    """
    key, value = _kv(query, key, value)
    tensors = dict(query=query, key=key, value=value, w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o,
                   b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o)
    consts = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, mask=_mask(mask, "mask"),
                  key_padding_mask=_mask(key_padding_mask, "key_padding_mask"), causal=causal,
                  scale=scale, return_weights=return_weights, rope_theta=rope_theta,
                  rope_dim=rope_dim, positions=_positions(positions),
                  warn_empty_rows=warn_empty_rows)
    call = _Call(_mha.multi_head_attention, tensors, consts,
                 bool(return_weights))
    return call.apply()


def bilinear_attention(
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    w_qk: torch.Tensor | BilinearQK,
    u_k: torch.Tensor | None = None,
    w_v: torch.Tensor,
    w_o: torch.Tensor,
    b_v: torch.Tensor | None = None,
    b_o: torch.Tensor | None = None,
    num_heads: int,
    num_kv_heads: int | None = None,
    mask: Any = None,
    key_padding_mask: Any = None,
    causal: bool | str = False,
    scale: float | None = None,
    return_weights: bool | str = False,
    warn_empty_rows: bool = True,
) -> Any:
    """Differentiable :func:`attnlab.bilinear_attention` on CPU tensors.

    Parameters
    ----------
    query : torch.Tensor, shape (..., n_q, d_q)
    key : torch.Tensor, shape (..., n_k, d_k), optional
    value : torch.Tensor, shape (..., n_k, d_v), optional
    w_qk : torch.Tensor, shape (h, d_q, d_k), or BilinearQK
        A :class:`attnlab.BilinearQK` (NumPy arrays) is a constant: no gradient flows to it.
    u_k : torch.Tensor, shape (h, d_k), optional
    w_v, w_o, b_v, b_o : torch.Tensor
    num_heads, num_kv_heads, mask, key_padding_mask, causal, scale, return_weights,
    warn_empty_rows
        As for :func:`attnlab.bilinear_attention` (``True`` in a boolean mask means *may
        attend*; :func:`attnlab.interop.torch_masks` converts ``nn.MultiheadAttention``'s).

    Returns
    -------
    out : torch.Tensor, shape (..., n_q, d_out)
        Differentiable with respect to every tensor argument but the masks.
    weights : torch.Tensor, optional
        When ``return_weights`` is set; not differentiable.

    Examples
    --------
    >>> import torch, attnlab.torch as at
    >>> x = torch.randn(5, 8)
    >>> w_qk = torch.randn(2, 8, 8, requires_grad=True)
    >>> out = at.bilinear_attention(x, w_qk=w_qk, w_v=torch.randn(8, 8), w_o=torch.randn(8, 8),
    ...                             num_heads=2)
    >>> out.sum().backward()
    >>> w_qk.grad.shape
    torch.Size([2, 8, 8])
    """
    key, value = _kv(query, key, value)
    tensors: dict[str, Any] = dict(query=query, key=key, value=value, u_k=u_k, w_v=w_v, w_o=w_o,
                                   b_v=b_v, b_o=b_o)
    consts: dict[str, Any] = dict(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  mask=_mask(mask, "mask"), causal=causal, scale=scale,
                                  key_padding_mask=_mask(key_padding_mask, "key_padding_mask"),
                                  return_weights=return_weights,
                                  warn_empty_rows=warn_empty_rows)
    if isinstance(w_qk, BilinearQK):
        consts["w_qk"] = w_qk
    else:
        tensors["w_qk"] = w_qk
    call = _Call(_bilinear.bilinear_attention, tensors,
                 consts, bool(return_weights))
    return call.apply()


def additive_attention(
    x: torch.Tensor,
    *,
    w_q: torch.Tensor,
    b_q: torch.Tensor | None = None,
    w_k: torch.Tensor,
    b_k: torch.Tensor | None = None,
    w_g: torch.Tensor,
    w_proj: torch.Tensor,
    b_proj: torch.Tensor | None = None,
    w_final: torch.Tensor,
    b_final: torch.Tensor | None = None,
    scale: float | None = None,
    variant: str = "official",
    eps: float = 1e-12,
    key_padding_mask: Any = None,
    warn_empty_rows: bool = True,
) -> torch.Tensor:
    """Differentiable :func:`attnlab.additive_attention` (SwiftFormer) on CPU tensors.

    Parameters
    ----------
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

    Returns
    -------
    out : torch.Tensor, shape (..., n, d_out)
        Differentiable with respect to every tensor argument but the mask.

    Examples
    --------
    >>> import torch, attnlab.torch as at
    >>> x = torch.randn(2, 49, 8, requires_grad=True)
    >>> w = {k: torch.randn(8, 8) for k in ("w_q", "w_k", "w_proj", "w_final")}
    >>> at.additive_attention(x, w_g=torch.randn(8, 1), **w).sum().backward()
    >>> x.grad.shape
    torch.Size([2, 49, 8])
    """
    tensors = dict(x=x, w_q=w_q, b_q=b_q, w_k=w_k, b_k=b_k, w_g=w_g, w_proj=w_proj,
                   b_proj=b_proj, w_final=w_final, b_final=b_final)
    consts = dict(scale=scale, variant=variant, eps=eps,
                  key_padding_mask=_mask(key_padding_mask, "key_padding_mask"),
                  warn_empty_rows=warn_empty_rows)
    call = _Call(_additive.additive_attention, tensors,
                 consts, False)
    out: torch.Tensor = call.apply()
    return out


def separable_attention(
    x: torch.Tensor,
    *,
    w_qkv: torch.Tensor,
    b_qkv: torch.Tensor | None = None,
    w_o: torch.Tensor,
    b_o: torch.Tensor | None = None,
    key_padding_mask: Any = None,
    warn_empty_rows: bool = True,
) -> torch.Tensor:
    """Differentiable :func:`attnlab.separable_attention` (MobileViT-v2) on CPU tensors.

    Parameters
    ----------
    x : torch.Tensor, shape (..., n, d)
    w_qkv : torch.Tensor, shape (d, 1 + 2 d)
    b_qkv : torch.Tensor, shape (1 + 2 d,), optional
    w_o : torch.Tensor, shape (d, d_out)
    b_o : torch.Tensor, shape (d_out,), optional
    key_padding_mask, warn_empty_rows
        As for :func:`attnlab.separable_attention` (``True`` = real token, the opposite of
        ``nn.MultiheadAttention``'s; :func:`attnlab.interop.torch_masks` converts it).

    Returns
    -------
    out : torch.Tensor, shape (..., n, d_out)
        Differentiable with respect to every tensor argument but the mask.

    Examples
    --------
    >>> import torch, attnlab.torch as at
    >>> x = torch.randn(2, 16, 8, requires_grad=True)
    >>> out = at.separable_attention(x, w_qkv=torch.randn(8, 17), w_o=torch.randn(8, 8))
    >>> out.sum().backward()
    >>> x.grad.shape
    torch.Size([2, 16, 8])
    """
    tensors = dict(x=x, w_qkv=w_qkv, b_qkv=b_qkv, w_o=w_o, b_o=b_o)
    consts = dict(key_padding_mask=_mask(key_padding_mask, "key_padding_mask"),
                  warn_empty_rows=warn_empty_rows)
    call = _Call(_additive.separable_attention, tensors,
                 consts, False)
    out: torch.Tensor = call.apply()
    return out
