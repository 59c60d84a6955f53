from __future__ import annotations

import torch
from torch import nn

from openk3.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain; ``weight: [dim]``."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
