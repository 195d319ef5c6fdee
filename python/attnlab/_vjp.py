"""``attnlab.vjp``: one forward, then gradients from what that forward kept (as ``jax.vjp``)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _additive, _bilinear, _docs, _half, _latent, _mha, _separable
from . import _signature as _sig

__all__ = ["vjp"]

Pullback = Callable[[Any], dict[str, np.ndarray]]


# The families whose forward keeps its state (``_keep``): the gradients from that state.
KEPT: dict[Any, Callable[[dict[str, Any], Any], dict[str, np.ndarray]]] = {
    _mha.multi_head_attention: lambda k, g: _mha._mha_grads(k["prepared"], g, k["state"], k["qk"]),
    _mha.scaled_dot_product_attention: lambda k, g: _mha._sdpa_grads(k["prepared"], g, k),
    _bilinear.bilinear_attention: lambda k, g: _bilinear._bilinear_grads(
        k["prepared"], g, k["state"]
    ),
    _additive.additive_attention: lambda k, g: _additive._additive_grads(
        k["prepared"], g, k["state"]
    ),
    _separable.separable_attention: lambda k, g: _separable._separable_grads(
        k["prepared"], g, k["state"]
    ),
    _latent.latent_attention: lambda k, g: _latent._grads(k["prepared"], k["state"], g),
}
# The families whose precision="bf16" forward keeps nothing, and the backward their pullback
# recomputes it with (its gradients are the float32 function's at the rounded operands).
_RECOMPUTED_BF16: dict[Any, Callable[..., dict[str, np.ndarray]]] = {
    _mha.multi_head_attention: _mha.multi_head_attention_backward,
    _additive.additive_attention: _additive.additive_attention_backward,
    _separable.separable_attention: _separable.separable_attention_backward,
}
for _forward in KEPT:  # ``_keep`` is vjp's, not the caller's: help() and the docs omit it
    _sig.hide_private(_forward)


def _recomputing(
    f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Pullback]:
    """A family of ``_RECOMPUTED_BF16`` with bf16 products, which keeps no state: the forward
    on a private copy of the arguments (later in-place changes of the caller's arrays do not
    reach the pullback), the pullback through the family's backward."""
    own = copy.deepcopy(dict(inspect.signature(f).bind(*args, **kwargs).arguments))
    out = f(**own)
    again = {**own, "warn_empty_rows": False}  # the forward warned already
    backward = _RECOMPUTED_BF16[f]
    return out, lambda grad_out: backward(grad_out, **again)


@_docs.filled
def vjp(f: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Pullback]:
    """Run an attnlab forward once and return its output with a pullback for its gradients.

    As ``jax.vjp``: ``out`` is exactly ``f(*args, **kwargs)``, and ``pullback(grad_out)``
    returns the dict that ``f_backward(grad_out, *args, **kwargs)`` returns (gradients keyed
    by argument name), without running the forward again: the forward keeps what the backward
    needs, in O(n d) memory (no n x n). ``multi_head_attention``,
    ``scaled_dot_product_attention`` and ``bilinear_attention`` keep the projections, the
    attention output and the log-sum-exp; ``additive_attention`` the normalised queries and
    keys with their norms, the scores and the pooled global query ``G``;
    ``separable_attention`` the scores, the keys, ``relu(v)`` and the context vector;
    ``latent_attention`` its projections, latents, keys (or absorbed queries), attention output
    and log-sum-exp.

    Parameters
    ----------
    f : callable
        One of ``attnlab.multi_head_attention``, ``attnlab.scaled_dot_product_attention``,
        ``attnlab.bilinear_attention``, ``attnlab.additive_attention``,
        ``attnlab.separable_attention``, ``attnlab.latent_attention``.
    *args, **kwargs
        The arguments of ``f``.

    Returns
    -------
    out : ndarray or tuple
        ``f(*args, **kwargs)`` (with ``return_weights``, the pair; the weights are not
        differentiated).
    pullback : callable
        ``pullback(grad_out) -> dict[str, ndarray]``, ``grad_out`` shaped like the output. It
        may be called any number of times; it computes the gradient at the values the forward
        saw, even if the caller's arrays were changed in place since (the forward keeps its own
        copies).

    Notes
    -----
    With ``return_weights`` the forward runs the dense path (the weights materialised), and the
    pullback differentiates that forward's intermediates: equal to ``f_backward`` (which
    recomputes the flash path) to rounding; otherwise bitwise.

    ``bilinear_attention`` keeps its state when the cost model evaluates it in the query order
    (the backward's); in the key order (many more queries than keys) its pullback recomputes
    the forward in the query order. ``multi_head_attention``, ``additive_attention`` and
    ``separable_attention`` with ``precision="bf16"`` keep copies of their arguments and their
    pullback recomputes the forward (their gradients are those of the float32 function at the
    rounded operands; for multi-head attention without the probabilities' rounding).

    {examples}
    >>> x = rng.standard_normal((2, 5, 8))
    >>> w = {n: rng.standard_normal((8, 8)) / 3 for n in ("w_q", "w_k", "w_v", "w_o")}
    >>> out, pullback = attnlab.vjp(attnlab.multi_head_attention, x, num_heads=2, **w)
    >>> grads = pullback(np.ones_like(out))
    >>> sorted(grads)
    ['query', 'w_k', 'w_o', 'w_q', 'w_v']
    >>> ref = attnlab.multi_head_attention_backward(np.ones_like(out), x, num_heads=2, **w)
    >>> all(np.allclose(grads[k], ref[k], rtol=1e-12, atol=1e-12) for k in ref)
    True
    """
    if f not in KEPT:
        names = ", ".join(f"attnlab.{g.__name__}" for g in KEPT)
        raise TypeError(f"f: expected one of {names}, got {f!r}")
    # precision="bf16" with multi-head, additive and separable attention keeps no state
    # (keyword-only: no signature binding, a cost on every training step, docs/performance.md)
    if f in _RECOMPUTED_BF16 and kwargs.get("precision") is not None:
        return _recomputing(f, args, kwargs)
    keep: dict[str, Any] = {}
    out = f(*args, **kwargs, _keep=keep)
    pull = KEPT[f]
    hs = keep.get("halves", {})  # gradients of half-precision arguments are stored in that dtype
    return out, lambda grad_out: _half.store_grads(pull(keep, grad_out), hs)
