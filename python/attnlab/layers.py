"""Trainable attention layers over attnlab's functional kernels, for notebooks and small loops.

Each layer holds its parameters in ``params`` (a dict of arrays named like the functional
arguments), computes its forward with one call of the functional kernel, and after
``backward(grad_out)`` holds the gradients in ``grads`` (the same keys) and returns the
gradients of its inputs. There is no autograd: a layer remembers its last call only.

>>> import numpy as np
>>> from attnlab import layers, optim
>>> layer = layers.MultiHeadAttention(16, 4, seed=0)
>>> opt = optim.Adam(layer, lr=1e-2)
>>> x = np.random.default_rng(0).standard_normal((8, 10, 16))
>>> y = layer(x, causal=True)
>>> dx = layer.backward(2 * (y - x) / y.size)   # d(MSE)/dy
>>> opt.step()                                  # reads layer.grads
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import _rope, _vjp
from . import _validate as V
from . import init as _init
from ._additive import _check_eps, _variant_code, additive_attention, separable_attention
from ._bilinear import bilinear_attention, collapse_qk
from ._latent import latent_attention
from ._mha import multi_head_attention

__all__ = [
    "AdditiveAttention",
    "BilinearAttention",
    "LatentAttention",
    "MultiHeadAttention",
    "SeparableAttention",
]


def _optional_int(x: Any, name: str, default: int) -> int:
    return default if x is None else V.check_positive_int(x, name)


_bool = V.check_flag


class _Layer:
    """Shared machinery: parameters, the saved call, backward, state dicts.

    A subclass declares its parameters with :meth:`_declare` (weights with their fans, biases
    with the fan-in of their weight) in ``__init__`` and implements :meth:`_functional_kwargs`
    (the non-array arguments) and, for forward, calls :meth:`_run`.
    """

    _forward: Callable[..., Any]
    bias: bool  # set by the subclass before it declares its parameters

    def __init__(self, *, init: Any, seed: Any, dtype: Any) -> None:
        self.dtype = _init._dtype(dtype)  # as the initialisers check it
        self.init = _init.get(init)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self._saved: tuple[list[str], Callable[[Any], dict[str, np.ndarray]]] | None = None

    # -- parameters ---------------------------------------------------------------------------
    def _weight(self, name: str, fan_in: int, fan_out: int) -> None:
        w = np.asarray(self.init.weight(fan_in, fan_out, self._rng, self.dtype))
        if w.shape != (fan_in, fan_out):
            raise ValueError(
                f"init: the weight initialiser returned shape {V.shape_str(w.shape)} for {name}, "
                f"expected ({fan_in}, {fan_out})"
            )
        self.params[name] = np.ascontiguousarray(w, dtype=self.dtype)

    def _bias(self, name: str, fan_in: int, fan_out: int) -> None:
        b = np.asarray(self.init.bias(fan_in, fan_out, self._rng, self.dtype))
        if b.shape != (fan_out,):
            raise ValueError(
                f"init: the bias initialiser returned shape {V.shape_str(b.shape)} for {name}, "
                f"expected ({fan_out},)"
            )
        self.params[name] = np.ascontiguousarray(b, dtype=self.dtype)

    def _linears(self, *specs: tuple[str, int, int]) -> None:
        """For each ``(n, fan_in, fan_out)``, in order (it sets the random draws): the weight
        ``w_<n>`` and, when the layer has biases, ``b_<n>``."""
        for n, fan_in, fan_out in specs:
            self._weight(f"w_{n}", fan_in, fan_out)
            if self.bias:
                self._bias(f"b_{n}", fan_in, fan_out)

    @property
    def num_parameters(self) -> int:
        """Total number of scalars in ``params``."""
        return int(sum(p.size for p in self.params.values()))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the parameters, keyed as ``params``.

        Returns
        -------
        dict of str to ndarray
            One copy per parameter, with its shape (e.g. ``w_q (d_model, d_model)``,
            ``b_q (d_model,)``); changing them does not change the layer.

        Examples
        --------
        >>> from attnlab import layers
        >>> a = layers.MultiHeadAttention(8, 2, seed=0)
        >>> b = layers.MultiHeadAttention(8, 2, seed=1)
        >>> b.load_state_dict(a.state_dict())
        >>> bool((a.params["w_q"] == b.params["w_q"]).all())
        True
        """
        return {k: v.copy() for k, v in self.params.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy ``state`` into the parameters, in place (optimisers keep their references).

        Parameters
        ----------
        state : mapping of str to array_like
            Exactly the keys of ``params``, each of the same shape; values are cast to the
            layer's dtype.

        Raises
        ------
        KeyError
            Naming the missing and the unexpected keys.
        ValueError
            Naming a key whose shape differs.
        TypeError
            For a non-mapping or non-numeric values.

        Examples
        --------
        >>> import numpy as np
        >>> from attnlab import layers
        >>> layer = layers.MultiHeadAttention(8, 2, seed=0)
        >>> w_q = layer.params["w_q"]
        >>> layer.load_state_dict({k: np.zeros_like(v) for k, v in layer.params.items()})
        >>> layer.params["w_q"] is w_q, float(np.abs(w_q).max())     # same array, now zeros
        (True, 0.0)
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state: expected a mapping of parameter names to arrays, got "
                f"{type(state).__name__}"
            )
        missing = sorted(set(self.params) - set(state))
        unexpected = sorted(set(state) - set(self.params))
        if missing or unexpected:
            raise KeyError(
                f"state: keys do not match {type(self).__name__}'s parameters "
                f"(missing {missing}, unexpected {unexpected}; expected {list(self.params)})"
            )
        arrays = {
            k: V.array_shaped(state[k], f"state[{k!r}]", p.shape) for k, p in self.params.items()
        }
        for k, a in arrays.items():  # only after every check passed
            self.params[k][...] = a

    def zero_grad(self) -> None:
        """Set every gradient to zero (``grads`` gets one zero array per parameter).

        Examples
        --------
        >>> from attnlab import layers
        >>> layer = layers.MultiHeadAttention(8, 2, seed=0)
        >>> layer.zero_grad()
        >>> layer.grads["w_q"].shape, float(layer.grads["w_q"].sum())
        ((8, 8), 0.0)
        """
        self.grads = {k: np.zeros_like(p) for k, p in self.params.items()}

    # -- forward / backward -------------------------------------------------------------------
    def _functional_kwargs(self) -> dict[str, Any]:
        """The non-array keyword arguments of the functional call (num_heads, scale, ...)."""
        raise NotImplementedError

    def _param_kwargs(self, params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return dict(params)

    def _run(self, inputs: dict[str, Any], options: dict[str, Any]) -> Any:
        """Forward through the functional kernel; save what backward needs."""
        given = {k: v for k, v in inputs.items() if v is not None}
        kwargs = {**self._param_kwargs(self.params), **self._functional_kwargs(), **options}
        # One forward per step: vjp keeps what the backward needs (copies of the inputs and
        # parameters included, so an optimiser may update them in place before backward).
        out, pullback = _vjp.vjp(type(self)._forward, **given, **kwargs)
        self._saved = (list(given), pullback)
        return out

    def backward(self, grad_out: Any, *, accumulate: bool = False) -> Any:
        """Back-propagate ``grad_out`` through the last call.

        Parameters
        ----------
        grad_out : array_like
            Gradient of the loss with respect to the last output (same shape).
        accumulate : bool
            Add the parameter gradients to ``grads`` instead of replacing them (gradient
            accumulation over several calls; start from :meth:`zero_grad`).

        Returns
        -------
        ndarray or tuple of ndarray
            The gradient of each input given to the last call, shaped like it: a single array
            when only one input was given (self-attention, or ``x``), otherwise a tuple in
            argument order (``(d_query, d_key)`` or ``(d_query, d_key, d_value)``; with
            ``value`` but no ``key``, ``(d_query, d_value)``).

        Notes
        -----
        Differentiates the last call as it ran (its inputs and parameters as they were then;
        the forward kept what the backward needs, see :func:`attnlab.vjp`, so no forward runs
        again). May be called more than once. Masks get no gradient.

        Examples
        --------
        >>> import numpy as np
        >>> from attnlab import layers
        >>> layer = layers.MultiHeadAttention(8, 2, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((2, 5, 8))
        >>> out = layer(x)
        >>> dx = layer.backward(np.ones_like(out))
        >>> dx.shape, layer.grads["w_q"].shape
        ((2, 5, 8), (8, 8))
        """
        if self._saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward: call the layer first")
        acc = _bool(accumulate, "accumulate")
        given, pullback = self._saved
        g = pullback(grad_out)
        grads = self._param_grads(g)
        if acc and self.grads:
            for k, v in grads.items():
                self.grads[k] = self.grads[k] + v
        else:
            self.grads = grads
        out = tuple(g[k] for k in given)
        return out[0] if len(out) == 1 else out

    def _check_width(self, x: Any, name: str, attr: str) -> None:
        """An input's features must be the layer's ``attr`` (named: the user set it, not the
        weights the layer passes on)."""
        if x is None:
            return
        try:
            shape = np.shape(x)
        except Exception:  # noqa: BLE001 (ragged and the like: the functional call names it)
            return
        width = getattr(self, attr)
        if len(shape) >= 2 and shape[-1] != width:
            raise ValueError(
                f"{name}: expected last dimension {attr} = {width} (this "
                f"{type(self).__name__}'s {attr}), got shape {V.shape_str(shape)}"
            )

    def _param_grads(self, g: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {
            k: np.asarray(g[k], dtype=self.dtype).reshape(p.shape) for k, p in self.params.items()
        }

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={V.shape_str(p.shape)}" for k, p in self.params.items())
        return (
            f"{type(self).__name__}({shapes}; {self.num_parameters} parameters, "
            f"init={self.init.name!r}, dtype={self.dtype.name})"
        )


class _QKVLayer(_Layer):
    """Query/key/value call signature shared by the multi-head and bilinear layers."""

    num_heads: int
    num_kv_heads: int
    d_head: int
    scale: float

    def _functional_kwargs(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "scale": self.scale}

    def __call__(
        self,
        query: Any,
        key: Any = None,
        value: Any = None,
        *,
        mask: Any = None,
        key_padding_mask: Any = None,
        causal: bool | str = False,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
        alibi_slopes: Any = None,
        sinks: Any = None,
        return_weights: bool | str = False,
        positions: Any = None,
        warn_empty_rows: bool = True,
    ) -> Any:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Parameters
        ----------
        query : array_like, shape (..., n_q, d_model)
        key : array_like, shape (..., n_k, kdim), optional
            Defaults to ``query``.
        value : array_like, shape (..., n_k, vdim), optional
            Defaults to ``key``.
        mask, key_padding_mask, causal, return_weights, warn_empty_rows
            As for :func:`attnlab.multi_head_attention`: boolean ``True`` means *may attend*,
            the opposite of ``nn.MultiheadAttention``'s masks (convert those with
            :func:`attnlab.interop.torch_masks`); ``causal=True`` lets query ``i`` see keys
            ``j <= i``; ``warn_empty_rows=False`` silences the warning for query rows the
            boolean masks leave with no key (``backward`` does not warn again).
        window : (int or None, int or None), optional
            Sliding window ``(left, right)`` around each query's aligned key, as for
            :func:`attnlab.multi_head_attention`.
        softcap, alibi_slopes, sinks : optional
            Logit soft-capping, ALiBi slopes ``(h,)`` and attention sinks ``(h,)``, as for
            :func:`attnlab.multi_head_attention`: options of this call, not parameters of the
            layer (``backward`` gives them no gradient in ``grads``).
        positions : array_like, optional
            Token positions for a layer with rotary embeddings (``rope_theta``), as for
            :func:`attnlab.multi_head_attention`.

        Returns
        -------
        out : ndarray, shape (..., n_q, d_out)
        weights : ndarray, optional
            With ``return_weights``.
        """
        self._check_width(query, "query", "d_model")
        self._check_width(key, "key", "kdim")
        self._check_width(value, "value", "vdim")
        options = {
            "mask": mask,
            "key_padding_mask": key_padding_mask,
            "causal": causal,
            "window": window,
            "softcap": softcap,
            "alibi_slopes": alibi_slopes,
            "sinks": sinks,
            "return_weights": return_weights,
            "warn_empty_rows": warn_empty_rows,
        }
        if positions is not None:
            if getattr(self, "rope_theta", None) is None:
                raise ValueError(
                    f"positions: {type(self).__name__} has no rotary embeddings "
                    f"(rope_theta is None), so positions have no effect"
                )
            options["positions"] = positions
        return self._run({"query": query, "key": key, "value": value}, options)


def _heads(d_model: Any, num_heads: Any, num_kv_heads: Any, d_head: Any) -> tuple[int, ...]:
    d = V.check_positive_int(d_model, "d_model")
    h = V.check_positive_int(num_heads, "num_heads")
    h_kv = _optional_int(num_kv_heads, "num_kv_heads", h)
    if h % h_kv:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {h}, got {h_kv}")
    if d_head is None:
        if d % h:
            raise ValueError(f"num_heads: {h} does not divide d_model = {d}; pass d_head")
        d_head = d // h
    return d, h, h_kv, V.check_positive_int(d_head, "d_head")


class MultiHeadAttention(_QKVLayer):
    """Multi-head attention with per-head projections, over :func:`attnlab.multi_head_attention`.

    Parameters
    ----------
    d_model : int
        Query features ``d_q``.
    num_heads : int
        ``h``.
    num_kv_heads : int, optional
        ``h_kv`` (grouped-query attention); defaults to ``num_heads``.
    d_head : int, optional
        Width of each head (queries, keys and values); defaults to ``d_model // num_heads``.
    kdim : int, optional
        Key features; defaults to ``d_model``.
    vdim : int, optional
        Value features; defaults to ``kdim`` (the value defaults to the key).
    d_out : int, optional
        Output features; defaults to ``d_model``.
    bias : bool
        Include ``b_q, b_k, b_v, b_o``.
    init : str, callable or attnlab.init.Scheme
        The initialisation scheme (:func:`attnlab.init.get`); default ``"torch"``.
    seed : int or numpy.random.Generator, optional
        Parameters are drawn in the order ``w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o``.
    dtype : float32 or float64
    rope_theta : float, optional
        Rotary position embeddings on the query and key heads (see
        :func:`attnlab.multi_head_attention`); ``None``: off. Calls then take ``positions=``.
    rope_dim : int, optional
        Features rotated per head (even, ``<= d_head``); defaults to ``d_head``.

    Attributes
    ----------
    params : dict of ndarray
        ``w_q (d_model, h*d_head)``, ``w_k (kdim, h_kv*d_head)``, ``w_v (vdim, h_kv*d_head)``,
        ``w_o (h*d_head, d_out)`` and, with ``bias``, ``b_q, b_k, b_v, b_o``.
    grads : dict of ndarray
        Filled by :meth:`backward`.
    scale : float
        ``1 / sqrt(d_head)``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.layers import MultiHeadAttention
    >>> mha = MultiHeadAttention(16, 4, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))
    >>> y = mha(x, causal=True)
    >>> dx = mha.backward(np.ones_like(y))
    >>> y.shape, dx.shape, mha.num_parameters, sorted(mha.grads) == sorted(mha.params)
    ((2, 5, 16), (2, 5, 16), 1088, True)
    """

    _forward = staticmethod(multi_head_attention)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        d_head: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        d_out: int | None = None,
        bias: bool = True,
        init: Any = "torch",
        seed: Any = None,
        dtype: Any = np.float64,
        rope_theta: float | None = None,
        rope_dim: int | None = None,
    ) -> None:
        super().__init__(init=init, seed=seed, dtype=dtype)
        d, h, h_kv, dh = _heads(d_model, num_heads, num_kv_heads, d_head)
        self.d_model, self.num_heads, self.num_kv_heads, self.d_head = d, h, h_kv, dh
        _rope.prepare(rope_theta, rope_dim, None, dh, 0, 0, 0, (), self.dtype)  # validates
        self.rope_theta = None if rope_theta is None else float(rope_theta)
        self.rope_dim = None if rope_dim is None else int(rope_dim)
        self.kdim = _optional_int(kdim, "kdim", d)
        self.vdim = _optional_int(vdim, "vdim", self.kdim)
        self.d_out = _optional_int(d_out, "d_out", d)
        self.bias = _bool(bias, "bias")
        self.scale = 1.0 / math.sqrt(dh)
        self._linears(
            ("q", d, h * dh),
            ("k", self.kdim, h_kv * dh),
            ("v", self.vdim, h_kv * dh),
            ("o", h * dh, self.d_out),
        )

    def _functional_kwargs(self) -> dict[str, Any]:
        kwargs = super()._functional_kwargs()
        if self.rope_theta is not None:
            kwargs.update(rope_theta=self.rope_theta, rope_dim=self.rope_dim)
        return kwargs


class BilinearAttention(_QKVLayer):
    """Attention with collapsed query-key weights, over :func:`attnlab.bilinear_attention`.

    Logits ``scale * (x_q W_i x_k^T + u_i x_k^T)`` per head ``i``; values and output as in
    multi-head attention.

    Parameters
    ----------
    d_model, num_heads, num_kv_heads, d_head, kdim, vdim, d_out, bias, init, seed, dtype
        As for :class:`MultiHeadAttention`. ``d_head`` sets the value heads' width and the
        scale ``1/sqrt(d_head)``.

    Attributes
    ----------
    params : dict of ndarray
        ``w_qk (h, d_model, kdim)``, ``w_v (vdim, h_kv*d_head)``, ``w_o (h*d_head, d_out)`` and,
        with ``bias``, ``u_k (h, kdim)`` (the key-side term ``W_k,i b_q,i``), ``b_v``, ``b_o``.

    Notes
    -----
    Initialisation folds a multi-head layer drawn with the same arguments: a fresh
    ``BilinearAttention(..., seed=s)`` computes exactly what ``MultiHeadAttention(..., seed=s)``
    does (each ``W_i`` starts with rank ``d_head``; training may raise it).

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.layers import BilinearAttention, MultiHeadAttention
    >>> mha = MultiHeadAttention(16, 4, seed=0)
    >>> bil = BilinearAttention.from_mha(mha)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))
    >>> bool(np.allclose(bil(x), mha(x), atol=1e-12)), bil.params["w_qk"].shape
    (True, (4, 16, 16))
    """

    _forward = staticmethod(bilinear_attention)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        d_head: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        d_out: int | None = None,
        bias: bool = True,
        init: Any = "torch",
        seed: Any = None,
        dtype: Any = np.float64,
    ) -> None:
        mha = MultiHeadAttention(
            d_model,
            num_heads,
            num_kv_heads=num_kv_heads,
            d_head=d_head,
            kdim=kdim,
            vdim=vdim,
            d_out=d_out,
            bias=bias,
            init=init,
            seed=seed,
            dtype=dtype,
        )
        super().__init__(init=mha.init, seed=seed, dtype=mha.dtype)
        self._fold(mha)

    def _fold(self, mha: MultiHeadAttention) -> None:
        for k in (
            "d_model",
            "num_heads",
            "num_kv_heads",
            "d_head",
            "kdim",
            "vdim",
            "d_out",
            "bias",
            "scale",
        ):
            setattr(self, k, getattr(mha, k))
        p = mha.params
        qk = collapse_qk(
            p["w_q"],
            p["w_k"],
            p.get("b_q"),
            None,
            num_heads=mha.num_heads,
            num_kv_heads=mha.num_kv_heads,
        )
        self.params = {"w_qk": np.ascontiguousarray(qk.w, dtype=self.dtype)}
        if qk.u is not None:
            self.params["u_k"] = np.ascontiguousarray(qk.u, dtype=self.dtype)
        for k in ("w_v", "b_v", "w_o", "b_o"):
            if k in p:
                self.params[k] = p[k].astype(self.dtype, copy=True)
        self.grads = {}
        self._saved = None

    @classmethod
    def from_mha(cls, layer: MultiHeadAttention) -> BilinearAttention:
        """Fold a :class:`MultiHeadAttention` layer exactly (:func:`attnlab.collapse_qk`).

        ``w_qk = W_q,i W_k,i^T``; ``u_k = W_k,i b_q,i`` when the layer has biases (the terms
        from ``b_k`` cancel in the softmax and are dropped); ``w_v, b_v, w_o, b_o`` are copied;
        the scale stays ``1/sqrt(d_head)``. The result computes the same function as ``layer``
        (to rounding) and owns its parameters.

        Parameters
        ----------
        layer : MultiHeadAttention

        Returns
        -------
        BilinearAttention

        Examples
        --------
        >>> from attnlab.layers import BilinearAttention, MultiHeadAttention
        >>> BilinearAttention.from_mha(MultiHeadAttention(8, 2, seed=0)).num_parameters
        288
        """
        if not isinstance(layer, MultiHeadAttention):
            raise TypeError(f"layer: expected a MultiHeadAttention, got {type(layer).__name__}")
        if layer.rope_theta is not None:
            raise ValueError(
                f"layer: has rotary embeddings (rope_theta={layer.rope_theta}), which do not "
                "fold: the logits are q_m R(m) (k_n R(n))^T = x_m W_q,i R(n - m) W_k,i^T x_n^T, "
                "a different matrix for every offset n - m, not one W_i = W_q,i W_k,i^T"
            )
        obj = cls.__new__(cls)
        _Layer.__init__(obj, init=layer.init, seed=layer.seed, dtype=layer.dtype)
        obj._fold(layer)
        return obj

    def _param_kwargs(self, params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {
            "w_qk": params["w_qk"],
            "u_k": params.get("u_k"),
            "w_v": params["w_v"],
            "w_o": params["w_o"],
            "b_v": params.get("b_v"),
            "b_o": params.get("b_o"),
        }


class _PooledLayer(_Layer):
    """Token call signature shared by the additive and separable layers."""

    d_model: int

    def __call__(
        self, x: Any, *, key_padding_mask: Any = None, warn_empty_rows: bool = True
    ) -> np.ndarray:
        """Apply the layer to tokens ``x``.

        Parameters
        ----------
        x : array_like, shape (..., n, d_model)
        key_padding_mask : array_like of bool, shape (..., n), optional
            ``True`` for real tokens (``nn.MultiheadAttention``'s ``True`` marks padding:
            convert it with :func:`attnlab.interop.torch_masks`).
        warn_empty_rows : bool
            Warn (``UserWarning``, once per call) when ``key_padding_mask`` leaves a sequence
            with no real token; ``False`` when intended.

        Returns
        -------
        ndarray, shape (..., n, d_out)
        """
        self._check_width(x, "x", "d_model")
        return self._run(
            {"x": x}, {"key_padding_mask": key_padding_mask, "warn_empty_rows": warn_empty_rows}
        )


class AdditiveAttention(_PooledLayer):
    """SwiftFormer's efficient additive attention, over :func:`attnlab.additive_attention`.

    Parameters
    ----------
    d_model : int
        Input features ``d_in``.
    d_hidden : int, optional
        ``D``, the width of queries and keys; defaults to ``d_model``. The official module
        ``EfficientAdditiveAttnetion(in_dims, token_dim, num_heads)`` has ``d_model = in_dims``,
        ``d_hidden = token_dim * num_heads`` and ``d_out = token_dim``.
    d_out : int, optional
        Output features; defaults to ``d_model``.
    variant : {"official", "hf"}
        See :func:`attnlab.additive_attention`.
    scale : float, optional
        Defaults to ``d_out ** -0.5``.
    eps : float
        Floor of every norm.
    bias : bool
        Include ``b_q, b_k, b_proj, b_final``.
    init, seed, dtype
        As for :class:`MultiHeadAttention`. ``w_g`` is drawn as a ``(D, 1)`` weight of the
        scheme (the official code uses ``randn``; the L2 normalisation over tokens makes its
        scale irrelevant in the official variant).

    Attributes
    ----------
    params : dict of ndarray
        ``w_q (d_model, D)``, ``b_q``, ``w_k (d_model, D)``, ``b_k``, ``w_g (D,)``,
        ``w_proj (D, D)``, ``b_proj``, ``w_final (D, d_out)``, ``b_final``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.layers import AdditiveAttention
    >>> att = AdditiveAttention(16, d_hidden=32, d_out=8, seed=0)
    >>> att(np.ones((2, 49, 16))).shape, att.num_parameters
    ((2, 49, 8), 2440)
    """

    _forward = staticmethod(additive_attention)

    def __init__(
        self,
        d_model: int,
        *,
        d_hidden: int | None = None,
        d_out: int | None = None,
        variant: str = "official",
        scale: float | None = None,
        eps: float = 1e-12,
        bias: bool = True,
        init: Any = "torch",
        seed: Any = None,
        dtype: Any = np.float64,
    ) -> None:
        super().__init__(init=init, seed=seed, dtype=dtype)
        d = V.check_positive_int(d_model, "d_model")
        D = _optional_int(d_hidden, "d_hidden", d)
        self.d_model, self.d_hidden = d, D
        self.d_out = _optional_int(d_out, "d_out", d)
        _variant_code(variant)  # validates
        self.variant = variant
        self.scale = V.check_scale(scale, self.d_out**-0.5)
        self.eps = _check_eps(eps)
        self.bias = _bool(bias, "bias")
        self._linears(("q", d, D), ("k", d, D))
        self._weight("w_g", D, 1)
        self.params["w_g"] = self.params["w_g"].reshape(D)
        self._linears(("proj", D, D), ("final", D, self.d_out))

    def _functional_kwargs(self) -> dict[str, Any]:
        return {"scale": self.scale, "variant": self.variant, "eps": self.eps}


class SeparableAttention(_PooledLayer):
    """MobileViT-v2's separable self-attention, over :func:`attnlab.separable_attention`.

    Parameters
    ----------
    d_model : int
        Token features ``d``.
    d_out : int, optional
        Output features; defaults to ``d_model``.
    bias : bool
        Include ``b_qkv`` and ``b_o``.
    init, seed, dtype
        As for :class:`MultiHeadAttention` (``w_qkv`` is one ``(d, 1 + 2 d)`` weight, like the
        original's single 1x1 convolution).

    Attributes
    ----------
    params : dict of ndarray
        ``w_qkv (d_model, 1 + 2 d_model)``, ``b_qkv``, ``w_o (d_model, d_out)``, ``b_o``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.layers import SeparableAttention
    >>> sep = SeparableAttention(8, seed=0)
    >>> sep(np.ones((3, 16, 8))).shape, sep.num_parameters
    ((3, 16, 8), 225)
    """

    _forward = staticmethod(separable_attention)

    def __init__(
        self,
        d_model: int,
        *,
        d_out: int | None = None,
        bias: bool = True,
        init: Any = "torch",
        seed: Any = None,
        dtype: Any = np.float64,
    ) -> None:
        super().__init__(init=init, seed=seed, dtype=dtype)
        d = V.check_positive_int(d_model, "d_model")
        self.d_model = d
        self.d_out = _optional_int(d_out, "d_out", d)
        self.bias = _bool(bias, "bias")
        self._linears(("qkv", d, 1 + 2 * d), ("o", d, self.d_out))

    def _functional_kwargs(self) -> dict[str, Any]:
        return {}


class LatentAttention(_Layer):
    """DeepSeek's multi-head latent attention, over :func:`attnlab.latent_attention`.

    Parameters
    ----------
    d_model : int
        Input features ``d``.
    num_heads : int
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim : int
        ``r`` (the cached latent's width), ``d_nope``, ``d_rope`` (even), ``d_v``, as in
        transformers' DeepSeek configs.
    q_lora_rank : int, optional
        Compress the queries through a latent of this width (with its RMSNorm); ``None``: one
        query projection.
    d_out : int, optional
        Output features; defaults to ``d_model``.
    bias : bool
        Biases on the down-projections and the output (transformers' ``attention_bias``).
    rope_theta : float
        Rotary base of the rotary parts.
    rope_interleave : bool
        DeepSeek's interleaved rotary layout (default) or ``rotate_half``'s.
    init : str, callable or attnlab.init.Scheme
        For the projections (the norms start at 1); default ``"torch"``.
    seed : int or numpy.random.Generator, optional
    dtype : float32 or float64

    Attributes
    ----------
    params : dict of ndarray
        ``w_q`` (or ``w_q_a``, ``b_q_a``, ``q_a_norm``, ``w_q_b``), ``w_kv_a``, ``b_kv_a``,
        ``kv_a_norm``, ``w_kv_b``, ``w_o``, ``b_o`` (biases with ``bias``): the keyword
        arguments of :func:`attnlab.latent_attention`.
    grads : dict of ndarray
        Filled by :meth:`backward`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnlab.layers import LatentAttention
    >>> mla = LatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    ...                       v_head_dim=8, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 32))
    >>> y, cache = mla(x, causal=True, return_cache=True)
    >>> dx = mla.backward(np.ones_like(y))
    >>> step = mla(x[:, -1:], cache=cache, causal="bottom_right")
    >>> y.shape, cache.shape, step.shape, dx.shape
    ((2, 5, 32), (2, 5, 20), (2, 1, 32), (2, 5, 32))
    """

    _forward = staticmethod(latent_attention)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        d_out: int | None = None,
        bias: bool = False,
        rope_theta: float = 10000.0,
        rope_interleave: bool = True,
        init: Any = "torch",
        seed: Any = None,
        dtype: Any = np.float64,
    ) -> None:
        super().__init__(init=init, seed=seed, dtype=dtype)
        d = self.d_model = V.check_positive_int(d_model, "d_model")
        h = self.num_heads = V.check_positive_int(num_heads, "num_heads")
        r = V.check_positive_int(kv_lora_rank, "kv_lora_rank")
        dn = V.check_positive_int(qk_nope_head_dim, "qk_nope_head_dim")
        dr = V.check_positive_int(qk_rope_head_dim, "qk_rope_head_dim")
        if dr % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number, got {dr}")
        dv = V.check_positive_int(v_head_dim, "v_head_dim")
        self.d_out = _optional_int(d_out, "d_out", d)
        self.bias = _bool(bias, "bias")
        self.rope_theta = V.positive_real(rope_theta, "rope_theta")
        self.rope_interleave = _bool(rope_interleave, "rope_interleave")
        if q_lora_rank is None:
            self._weight("w_q", d, h * (dn + dr))
        else:
            qr = V.check_positive_int(q_lora_rank, "q_lora_rank")
            self._linears(("q_a", d, qr))
            self.params["q_a_norm"] = np.ones(qr, self.dtype)
            self._weight("w_q_b", qr, h * (dn + dr))
        self._linears(("kv_a", d, r + dr))
        self.params["kv_a_norm"] = np.ones(r, self.dtype)
        self._weight("w_kv_b", r, h * (dn + dv))
        self._linears(("o", h * dv, self.d_out))

    def _functional_kwargs(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads,
            "rope_theta": self.rope_theta,
            "rope_interleave": self.rope_interleave,
        }

    def __call__(
        self,
        x: Any,
        *,
        cache: Any = None,
        positions: Any = None,
        mask: Any = None,
        key_padding_mask: Any = None,
        causal: bool | str = False,
        window: tuple[int | None, int | None] | None = None,
        form: str = "auto",
        return_weights: bool | str = False,
        return_cache: bool = False,
        warn_empty_rows: bool = True,
    ) -> Any:
        """Attend over the cached tokens (``cache``) and ``x``'s.

        Parameters
        ----------
        x : array_like, shape (..., n, d_model)
        cache, positions, mask, key_padding_mask, causal, window, form, return_weights
        return_cache, warn_empty_rows
            As for :func:`attnlab.latent_attention` (``causal="bottom_right"`` to decode
            against a cache). A cache given is differentiated: :meth:`backward` then returns
            ``(d_x, d_cache)``.

        Returns
        -------
        out : ndarray, shape (..., n, d_out)
        weights, cache : ndarray, optional
        """
        self._check_width(x, "x", "d_model")
        options = {
            "positions": positions,
            "mask": mask,
            "key_padding_mask": key_padding_mask,
            "causal": causal,
            "window": window,
            "form": form,
            "return_weights": return_weights,
            "return_cache": return_cache,
            "warn_empty_rows": warn_empty_rows,
        }
        return self._run({"x": x, "cache": cache}, options)
