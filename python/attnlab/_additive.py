"""Efficient additive attention (SwiftFormer) and separable self-attention (MobileViT-v2).

Placeholder: being implemented (issue 4).
"""

from __future__ import annotations

from typing import Any

__all__ = ["additive_attention", "separable_attention"]


def additive_attention(x: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("additive_attention is not implemented yet")


def separable_attention(x: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("separable_attention is not implemented yet")
