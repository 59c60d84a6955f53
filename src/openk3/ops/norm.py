"""RMSNorm variants (variance in fp32, SPEC.md §5.3)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. ``x: [..., D]``, ``weight: [D]``. Variance in fp32; the normalised value is cast
    back to ``x.dtype`` before the gain is applied (the released models' order)."""
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(dtype)
    return y if weight is None else weight.to(dtype) * y


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: ``RMSNorm(x) * weight * sigmoid(gate)``, all in fp32, cast to ``x.dtype``.
    ``x, gate: [..., D]``, ``weight: [D]``."""
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight.float() * y * torch.sigmoid(gate.float())
    return y.to(dtype)
