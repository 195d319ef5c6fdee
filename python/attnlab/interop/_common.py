"""Helpers shared by the loaders of attnlab.interop (and by attnlab.torch, attnlab.diagnostics):
tensors to NumPy without importing torch, a module's keys in a state dict, transposed weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _validate as V


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
    if a.dtype.kind not in kinds and not ("f" in kinds and V.floating(a.dtype)):
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
