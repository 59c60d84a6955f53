from __future__ import annotations

import torch
from torch import nn

from openk3.ops import backend as _backend
from openk3.ops.norm import gated_rms_norm, rms_norm

# Fast-path hooks for the "norm" op, filled by openk3.fast: name -> fn with the signature of the reference
# ``rms_norm(x, weight, eps)`` / ``gated_rms_norm(x, weight, gate, eps)``.
FAST_RMS_NORM: dict[str, callable] = {}
FAST_GATED_NORM: dict[str, callable] = {}


def gated_norm(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, backend: str | None = None
) -> torch.Tensor:
    """``gated_rms_norm`` through the "norm" backend (``backend`` forces one; ``None`` = environment / auto)."""
    be = _backend.resolve("norm", x.is_cuda, backend)
    fn = FAST_GATED_NORM.get(be, gated_rms_norm) if be != "reference" else gated_rms_norm
    return fn(x, weight, gate, eps)


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain; ``weight: [dim]``. ``backend``: "norm" op backend (``None`` = auto)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        be = _backend.resolve("norm", x.is_cuda, self.backend)
        fn = FAST_RMS_NORM.get(be, rms_norm) if be != "reference" else rms_norm
        return fn(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
