"""PyTorch modules transcribed from code that is not installed here, shared by the tests that
compare attnlab with them (import torch first; nothing here imports it)."""

from __future__ import annotations

from typing import Any


def official_swiftformer_module(torch: Any, in_dims: int, token_dim: int, num_heads: int) -> Any:
    """A transcription of Amshaker/SwiftFormer's EfficientAdditiveAttnetion (July 2023 on)."""
    nn = torch.nn
    F = torch.nn.functional

    class EfficientAdditiveAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_query = nn.Linear(in_dims, token_dim * num_heads)
            self.to_key = nn.Linear(in_dims, token_dim * num_heads)
            self.w_g = nn.Parameter(torch.randn(token_dim * num_heads, 1))
            self.scale_factor = token_dim**-0.5
            self.Proj = nn.Linear(token_dim * num_heads, token_dim * num_heads)
            self.final = nn.Linear(token_dim * num_heads, token_dim)

        def forward(self, x):
            query = F.normalize(self.to_query(x), dim=-1)
            key = F.normalize(self.to_key(x), dim=-1)
            A = (query @ self.w_g) * self.scale_factor
            A = F.normalize(A, dim=1)
            G = torch.sum(A * query, dim=1)
            G = G.unsqueeze(1).expand(-1, key.shape[1], -1)
            return self.final(self.Proj(G * key) + query)

    return EfficientAdditiveAttention()
