"""Bilinear-collapsed attention. Placeholder: being implemented (issue 3)."""

from __future__ import annotations

from typing import Any

__all__ = ["bilinear_attention", "collapse_qk", "factorize_qk", "BilinearQK"]


class BilinearQK:  # replaced by the frozen dataclass of issue 3
    pass


def collapse_qk(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def factorize_qk(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def bilinear_attention(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
