"""A small Adam optimiser that updates NumPy parameter arrays in place."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _validate as V

__all__ = ["Adam"]


def _real(
    x: Any,
    name: str,
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(x).__name__} {x!r}")
    v = float(x)
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}: expected a finite number in {interval}, got {v}")
    return v


class Adam:
    """Adam (Kingma and Ba, 2015), as ``torch.optim.Adam``, on NumPy arrays in place.

    For each parameter ``p`` with gradient ``g``, at step ``t = 1, 2, ...``::

        g = g + weight_decay * p                (L2 penalty, as torch.optim.Adam; not AdamW)
        m = beta1 m + (1 - beta1) g
        v = beta2 v + (1 - beta2) g^2
        p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

    Parameters
    ----------
    params : layer, dict of ndarray, or a sequence of them
        A layer (anything with ``params`` and ``grads`` dicts, e.g. :mod:`attnlab.layers`), a
        dict of float arrays, or a list mixing both. The arrays are updated in place, so a
        layer keeps working with the same objects.
    lr : float
        Learning rate (> 0).
    betas : (float, float)
        Decay rates of the first and second moments, each in [0, 1).
    eps : float
        Added to the denominator (>= 0).
    weight_decay : float
        L2 penalty coefficient (>= 0).

    Attributes
    ----------
    t : int
        Steps taken.
    state : list of dict
        Per group, ``{name: (m, v)}`` moment arrays.

    Examples
    --------
    Minimise ``|w - 3|^2``:

    >>> import numpy as np
    >>> from attnlab.optim import Adam
    >>> w = np.zeros(4)
    >>> opt = Adam({"w": w}, lr=0.1)
    >>> for _ in range(300):
    ...     opt.step({"w": 2 * (w - 3)})
    >>> bool(np.allclose(w, 3, atol=1e-2))
    True

    With a layer, ``step()`` reads ``layer.grads`` (filled by ``layer.backward``):

    >>> from attnlab.layers import MultiHeadAttention
    >>> layer = MultiHeadAttention(8, 2, seed=0)
    >>> opt = Adam(layer, lr=1e-3)
    >>> x = np.ones((1, 3, 8))
    >>> _ = layer.backward(np.ones_like(layer(x)))
    >>> opt.step()
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self.lr = _real(lr, "lr", 0.0, lo_open=True)
        if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
            raise TypeError(f"betas: expected a pair of numbers, got {betas!r}")
        self.betas = (
            _real(betas[0], "betas[0]", 0.0, 1.0, hi_open=True),
            _real(betas[1], "betas[1]", 0.0, 1.0, hi_open=True),
        )
        self.eps = _real(eps, "eps", 0.0)
        self.weight_decay = _real(weight_decay, "weight_decay", 0.0)
        groups = list(params) if isinstance(params, (list, tuple)) else [params]
        if not groups:
            raise ValueError("params: expected at least one layer or dict of arrays, got none")
        self.groups: list[Any] = []
        for i, g in enumerate(groups):
            arrays = g.params if hasattr(g, "params") else g
            if not isinstance(arrays, Mapping):
                raise TypeError(
                    f"params[{i}]: expected a layer or a dict of arrays, got {type(g).__name__}"
                )
            for k, a in arrays.items():
                if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
                    got = f"ndarray {a.dtype}" if isinstance(a, np.ndarray) else type(a).__name__
                    raise TypeError(
                        f"params[{i}][{k!r}]: expected a float ndarray (updated in "
                        f"place), got {got}"
                    )
                if not a.flags.writeable:
                    raise ValueError(f"params[{i}][{k!r}]: the array is read-only")
            self.groups.append(g)
        self.t = 0
        self.state: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in self.groups]

    @staticmethod
    def _arrays(group: Any) -> Mapping[str, np.ndarray]:
        return group.params if hasattr(group, "params") else group

    def _grads(self, grads: Any) -> list[Mapping[str, Any]]:
        if grads is None:
            out = []
            for i, g in enumerate(self.groups):
                if not hasattr(g, "grads"):
                    raise TypeError(
                        f"grads: params[{i}] is a dict, so step() needs its gradients: step(grads)"
                    )
                if not g.grads:
                    raise RuntimeError(
                        f"grads: params[{i}] ({type(g).__name__}) has no "
                        f"gradients; call its backward() first"
                    )
                out.append(g.grads)
            return out
        if isinstance(grads, Mapping):
            grads = [grads]
        if not isinstance(grads, (list, tuple)):
            raise TypeError(
                f"grads: expected a dict of gradients, or a list of one per "
                f"parameter group ({len(self.groups)}), got {type(grads).__name__}"
            )
        if len(grads) != len(self.groups):
            raise ValueError(
                f"grads: expected a dict of gradients per parameter group "
                f"({len(self.groups)}), got a sequence of length {len(grads)}"
            )
        return list(grads)

    def step(self, grads: Any = None) -> None:
        """Update every parameter in place.

        Parameters
        ----------
        grads : dict of array_like, or a list of them, optional
            The gradients, keyed like the parameters (one dict per group, in order). Omit it
            when every group is a layer: its ``grads`` are used.

        Raises
        ------
        KeyError
            If a parameter has no gradient.
        ValueError
            If a gradient's shape differs from its parameter's.

        Examples
        --------
        >>> import numpy as np
        >>> from attnlab.optim import Adam
        >>> w = np.zeros((2, 3))
        >>> Adam({"w": w}, lr=0.5).step({"w": np.ones((2, 3))})   # first step moves by lr
        >>> w
        array([[-0.5, -0.5, -0.5],
               [-0.5, -0.5, -0.5]])
        """
        all_grads = self._grads(grads)
        # check everything before touching any array
        checked: list[dict[str, np.ndarray]] = []
        for i, (group, gd) in enumerate(zip(self.groups, all_grads, strict=True)):
            arrays = self._arrays(group)
            missing = sorted(set(arrays) - set(gd))
            if missing:
                raise KeyError(f"grads: no gradient for params[{i}] {missing}")
            checked.append(
                {
                    k: V.array_shaped(gd[k], f"grads[{k!r}]", p.shape, " (the parameter's)")
                    for k, p in arrays.items()
                }
            )
        self.t += 1
        b1, b2 = self.betas
        bc1 = 1.0 - b1**self.t
        bc2 = 1.0 - b2**self.t
        for group, gd, state in zip(self.groups, checked, self.state, strict=True):
            for k, p in self._arrays(group).items():
                g = gd[k].astype(p.dtype, copy=False)
                if self.weight_decay:
                    g = g + self.weight_decay * p
                if k not in state:
                    state[k] = (np.zeros_like(p), np.zeros_like(p))
                m, v = state[k]
                m *= b1
                m += (1.0 - b1) * g
                v *= b2
                v += (1.0 - b2) * (g * g)
                denom = np.sqrt(v / bc2)
                denom += self.eps
                p[...] -= (self.lr / bc1) * m / denom  # in place: p is the parameter

    def zero_grad(self) -> None:
        """Zero the gradients of every layer group (dict groups hold no gradients).

        Layers overwrite ``grads`` on each ``backward`` unless asked to accumulate, so this is
        only needed with ``backward(..., accumulate=True)``.

        Examples
        --------
        >>> import numpy as np
        >>> from attnlab.layers import MultiHeadAttention
        >>> from attnlab.optim import Adam
        >>> layer = MultiHeadAttention(8, 2, seed=0)
        >>> x = np.ones((1, 3, 8))
        >>> _ = layer.backward(np.ones_like(layer(x)), accumulate=True)
        >>> opt = Adam(layer)
        >>> opt.zero_grad()
        >>> all(not np.any(g) for g in layer.grads.values())
        True
        """
        for g in self.groups:
            if hasattr(g, "zero_grad"):
                g.zero_grad()
