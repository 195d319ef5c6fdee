"""Plain NumPy (float64) implementations of every forward function: the oracle for the tests.

Same signatures as the functions in :mod:`attnlab`, written for clarity, not speed.
"""

from __future__ import annotations

from ._additive import additive_attention, separable_attention
from ._bilinear import (
    bilinear_attention,
    bilinear_logits,
    collapse_qk,
    factorize_qk,
    separate_logits,
)
from ._mha import multi_head_attention, scaled_dot_product_attention

__all__ = [
    "additive_attention",
    "bilinear_attention",
    "bilinear_logits",
    "collapse_qk",
    "factorize_qk",
    "multi_head_attention",
    "scaled_dot_product_attention",
    "separable_attention",
    "separate_logits",
]
