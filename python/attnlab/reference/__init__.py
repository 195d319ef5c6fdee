"""Plain NumPy (float64) implementations of every forward function: the oracle for the tests.

Written for clarity, not speed, and independent of attnlab's kernels. A function with a
namesake in :mod:`attnlab` takes its signature from it (the same parameters, generated from
that function's ``def``), so the two cannot drift apart.
"""

from __future__ import annotations

from ._additive import additive_attention
from ._bilinear import (
    bilinear_attention,
    bilinear_logits,
    collapse_qk,
    factorize_qk,
    separate_logits,
)
from ._latent import latent_attention
from ._mha import multi_head_attention, scaled_dot_product_attention
from ._separable import separable_attention

__all__ = [
    "additive_attention",
    "bilinear_attention",
    "bilinear_logits",
    "collapse_qk",
    "factorize_qk",
    "latent_attention",
    "multi_head_attention",
    "scaled_dot_product_attention",
    "separable_attention",
    "separate_logits",
]
