"""Weight initialisers: the schemes a layer's ``init=`` accepts.

Every weight initialiser is a function ``(fan_in, fan_out, rng, dtype) -> ndarray`` of shape
``(fan_in, fan_out)`` (attnlab's weights are ``(in_features, out_features)``); every scheme also
has a bias initialiser ``(fan_in, fan_out, rng, dtype) -> ndarray`` of shape ``(fan_out,)``.

==================== =========================================== ==================================
name                 weights                                     biases
==================== =========================================== ==================================
``"torch"``          U(-1/sqrt(fan_in), +1/sqrt(fan_in))         the same (``nn.Linear``'s default)
``"xavier_uniform"`` U(+-sqrt(6 / (fan_in + fan_out)))           zeros
``"xavier_normal"``  N(0, 2 / (fan_in + fan_out))                zeros
``"randn"``          N(0, 1) (``nn.Parameter(torch.randn(..))``) zeros
``"trunc_normal"``   N(0, 0.02^2) cut at +-2 std = +-0.04        zeros
==================== =========================================== ==================================

The variance of a weight decides the scale of the attention logits: with std-1 weights
(``"randn"``) the logit std grows like ``d_model``, the softmax saturates and the query/key
projections get almost no gradient; ``"torch"`` keeps it O(1).

Samples are drawn in float64 and then cast, so a seed gives the same values (up to rounding) in
float32 and float64.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _docs

__all__ = [
    "Scheme",
    "get",
    "names",
    "randn",
    "torch_default",
    "torch_default_bias",
    "trunc_normal",
    "xavier_normal",
    "xavier_uniform",
    "zeros_bias",
]

Initializer = Callable[[int, int, np.random.Generator, Any], np.ndarray]

_TRUNC_STD = 0.02
_TRUNC_CUT = 2.0  # in standard deviations


def _fans(fan_in: Any, fan_out: Any) -> tuple[int, int]:
    for name, v in (("fan_in", fan_in), ("fan_out", fan_out)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name}: expected an integer, got {type(v).__name__} {v!r}")
        if int(v) < 0:
            raise ValueError(f"{name}: expected an integer >= 0, got {int(v)}")
    return int(fan_in), int(fan_out)


def _rng(rng: Any) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, np.random.SeedSequence):
        return np.random.default_rng(rng)
    if isinstance(rng, numbers.Integral):
        return np.random.default_rng(int(rng))
    raise TypeError(
        f"rng: expected a numpy.random.Generator, an integer seed or None, got {type(rng).__name__}"
    )


def _dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected float32 or float64, got {dtype!r}") from None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype: expected float32 or float64, got {dt}")
    return dt


def _uniform(bound: float, shape: tuple[int, ...], rng: Any, dtype: Any) -> np.ndarray:
    return _rng(rng).uniform(-bound, bound, size=shape).astype(_dtype(dtype), copy=False)


_PARAMETERS = """Parameters
    ----------
    fan_in, fan_out : int
        Input and output features (>= 0); the result is ``(fan_in, fan_out)``.{fans}
    rng : numpy.random.Generator or int or None
        The generator (an integer seeds a new one; None draws fresh entropy).
    dtype : float32 or float64
        The result's dtype; the samples are drawn in float64 and cast.

    Returns
    -------
    ndarray, shape (fan_in, fan_out)"""


def _weight_scheme(fans: str = "") -> Callable[[Initializer], Initializer]:
    """Writes the Parameters and Returns sections every weight initialiser shares (they all
    have the signature ``(fan_in, fan_out, rng, dtype)``) into its ``{parameters}`` and fills
    in :mod:`attnlab._docs`' fragments; ``fans`` adds a sentence about the fans."""
    text = _PARAMETERS.format(fans=f"\n        {fans}" if fans else "")

    def fill(f: Initializer) -> Initializer:
        f.__doc__ = _docs.fill((f.__doc__ or "").replace("{parameters}", text))
        return f

    return fill


@_weight_scheme()
def torch_default(fan_in: int, fan_out: int, rng: Any, dtype: Any = np.float64) -> np.ndarray:
    """``nn.Linear``'s default weights: U(-1/sqrt(fan_in), +1/sqrt(fan_in)).

    (``kaiming_uniform_(a=sqrt(5))``, whose bound works out to ``1/sqrt(fan_in)``.) Registered
    as ``"torch"``. Variance ``1 / (3 fan_in)``.

    {parameters}

    {init_examples}
    >>> w = init.torch_default(64, 32, np.random.default_rng(0), np.float64)
    >>> w.shape, bool(np.abs(w).max() <= 1 / 8)
    ((64, 32), True)
    """
    fi, fo = _fans(fan_in, fan_out)
    return _uniform(1.0 / math.sqrt(fi) if fi else 0.0, (fi, fo), rng, dtype)


@_docs.filled
def torch_default_bias(fan_in: int, fan_out: int, rng: Any, dtype: Any = np.float64) -> np.ndarray:
    """``nn.Linear``'s default bias: U(-1/sqrt(fan_in), +1/sqrt(fan_in)), shape ``(fan_out,)``.

    Registered as the bias of ``"torch"``.

    Parameters
    ----------
    fan_in : int
        Fan-in of the weight the bias belongs to (the bound is ``1/sqrt(fan_in)``; 0 gives zeros).
    fan_out : int
        Output features: the length of the bias.
    rng : numpy.random.Generator or int or None
        The generator (an integer seeds a new one).
    dtype : float32 or float64

    Returns
    -------
    ndarray, shape (fan_out,)

    {init_examples}
    >>> init.torch_default_bias(16, 4, np.random.default_rng(0), np.float64).shape
    (4,)
    """
    fi, fo = _fans(fan_in, fan_out)
    return _uniform(1.0 / math.sqrt(fi) if fi else 0.0, (fo,), rng, dtype)


@_docs.filled
def zeros_bias(fan_in: int, fan_out: int, rng: Any, dtype: Any = np.float64) -> np.ndarray:
    """Zero bias of shape ``(fan_out,)``: the bias of every scheme but ``"torch"``.

    Parameters
    ----------
    fan_in : int
        Fan-in of the weight the bias belongs to (not used; checked only).
    fan_out : int
        Output features: the length of the bias.
    rng : numpy.random.Generator or int or None
        Not used: nothing is drawn from the generator.
    dtype : float32 or float64

    Returns
    -------
    ndarray, shape (fan_out,)

    {init_examples}
    >>> init.zeros_bias(16, 3, None, np.float32)
    array([0., 0., 0.], dtype=float32)
    """
    del rng  # in the signature of every scheme; zeros draw nothing
    _, fo = _fans(fan_in, fan_out)
    return np.zeros(fo, dtype=_dtype(dtype))


@_weight_scheme()
def xavier_uniform(fan_in: int, fan_out: int, rng: Any, dtype: Any = np.float64) -> np.ndarray:
    """Glorot uniform: U(+-sqrt(6 / (fan_in + fan_out))), variance ``2 / (fan_in + fan_out)``.

    Registered as ``"xavier_uniform"`` (with zero biases).

    {parameters}

    {init_examples}
    >>> w = init.xavier_uniform(10, 14, np.random.default_rng(0), np.float64)
    >>> w.shape
    (10, 14)
    >>> bool(np.abs(w).max() <= 0.5)
    True
    """
    fi, fo = _fans(fan_in, fan_out)
    return _uniform(math.sqrt(6.0 / (fi + fo)) if fi + fo else 0.0, (fi, fo), rng, dtype)


@_weight_scheme()
def xavier_normal(fan_in: int, fan_out: int, rng: Any, dtype: Any = np.float64) -> np.ndarray:
    """Glorot normal: N(0, 2 / (fan_in + fan_out)).

    Registered as ``"xavier_normal"`` (with zero biases).

    {parameters}

    {init_examples}
    >>> w = init.xavier_normal(8, 8, np.random.default_rng(0), np.float32)
    >>> w.shape, w.dtype
    ((8, 8), dtype('float32'))
    """
    fi, fo = _fans(fan_in, fan_out)
    std = math.sqrt(2.0 / (fi + fo)) if fi + fo else 0.0
    return (_rng(rng).standard_normal((fi, fo)) * std).astype(_dtype(dtype), copy=False)


@_weight_scheme(fans="They do not change the variance.")
def randn(fan_in: int, fan_out: int, rng: Any, dtype: Any = np.float64) -> np.ndarray:
    """Standard normal N(0, 1) whatever the fans: ``nn.Parameter(torch.randn(...))``.

    The scheme behind notebook 03 (why std-1 weights train worse): its logits grow like
    ``d_model`` and saturate the softmax. Registered as ``"randn"`` (with zero biases).

    {parameters}

    {init_examples}
    >>> init.randn(4, 2, np.random.default_rng(0), np.float64).shape
    (4, 2)
    """
    fi, fo = _fans(fan_in, fan_out)
    return _rng(rng).standard_normal((fi, fo)).astype(_dtype(dtype), copy=False)


@_weight_scheme(fans="They do not change the variance.")
def trunc_normal(fan_in: int, fan_out: int, rng: Any, dtype: Any = np.float64) -> np.ndarray:
    """N(0, 0.02^2) truncated to +-2 std = +-0.04 (ViT/timm-style init, fans ignored).

    Values outside the cut are redrawn until none remains (rejection: about 4.6 % per round),
    which samples the truncated normal exactly. Because of the cut the standard deviation of
    the result is ``0.02 * 0.8796 = 0.0176``, as ``torch.nn.init.trunc_normal_(w, std=0.02,
    a=-0.04, b=0.04)``. (timm's ``trunc_normal_(w, std=.02)`` keeps its default absolute cut
    ``a=-2, b=2``, i.e. +-100 std: practically untruncated.)

    Registered as ``"trunc_normal"`` (with zero biases).

    {parameters}

    {init_examples}
    >>> w = init.trunc_normal(32, 32, np.random.default_rng(0), np.float64)
    >>> w.shape
    (32, 32)
    >>> bool(np.abs(w).max() <= 0.04)
    True
    """
    fi, fo = _fans(fan_in, fan_out)
    g = _rng(rng)
    z = g.standard_normal(fi * fo)
    bad = np.flatnonzero(np.abs(z) > _TRUNC_CUT)
    while bad.size:
        z[bad] = g.standard_normal(bad.size)
        bad = bad[np.abs(z[bad]) > _TRUNC_CUT]
    return (z * _TRUNC_STD).reshape(fi, fo).astype(_dtype(dtype), copy=False)


class Scheme(NamedTuple):
    """An initialisation scheme: a name, a weight and a bias initialiser.

    Attributes
    ----------
    name : str
    weight : callable ``(fan_in, fan_out, rng, dtype) -> ndarray (fan_in, fan_out)``
    bias : callable ``(fan_in, fan_out, rng, dtype) -> ndarray (fan_out,)``

    Examples
    --------
    >>> from attnlab import init
    >>> init.get("torch").bias is init.torch_default_bias
    True
    """

    name: str
    weight: Initializer
    bias: Initializer


_REGISTRY: dict[str, Scheme] = {
    "torch": Scheme("torch", torch_default, torch_default_bias),
    "xavier_uniform": Scheme("xavier_uniform", xavier_uniform, zeros_bias),
    "xavier_normal": Scheme("xavier_normal", xavier_normal, zeros_bias),
    "randn": Scheme("randn", randn, zeros_bias),
    "trunc_normal": Scheme("trunc_normal", trunc_normal, zeros_bias),
}


def names() -> list[str]:
    """The registered scheme names, in registration order.

    Returns
    -------
    list of str
        The names :func:`get` accepts (a new list each call).

    Examples
    --------
    >>> from attnlab import init
    >>> init.names()
    ['torch', 'xavier_uniform', 'xavier_normal', 'randn', 'trunc_normal']
    """
    return list(_REGISTRY)


def get(name_or_callable: str | Callable[..., np.ndarray] | Scheme) -> Scheme:
    """Resolve an ``init=`` argument to a :class:`Scheme`.

    Parameters
    ----------
    name_or_callable : str, callable or Scheme
        A registered name (see :func:`names`), a :class:`Scheme`, or a weight initialiser
        ``(fan_in, fan_out, rng, dtype) -> (fan_in, fan_out)``. A callable's biases are zeros
        unless it carries its own bias initialiser as an attribute ``bias``. The registered
        functions themselves (e.g. ``init.torch_default``) resolve to their registered scheme.

    Returns
    -------
    Scheme

    Examples
    --------
    >>> from attnlab import init
    >>> init.get("xavier_uniform").weight is init.xavier_uniform
    True
    >>> init.get(init.torch_default).name
    'torch'
    """
    if isinstance(name_or_callable, Scheme):
        return name_or_callable
    if isinstance(name_or_callable, str):
        try:
            return _REGISTRY[name_or_callable]
        except KeyError:
            raise ValueError(
                f"init: expected one of {names()} or a callable, got {name_or_callable!r}"
            ) from None
    if callable(name_or_callable):
        for scheme in _REGISTRY.values():
            if scheme.weight is name_or_callable:
                return scheme
        bias = getattr(name_or_callable, "bias", zeros_bias)
        if not callable(bias):
            raise TypeError(f"init: the attribute 'bias' of {name_or_callable!r} is not callable")
        name = getattr(name_or_callable, "__name__", repr(name_or_callable))
        return Scheme(name, name_or_callable, bias)
    raise TypeError(
        f"init: expected a scheme name {names()}, a callable or a Scheme, got "
        f"{type(name_or_callable).__name__}"
    )
