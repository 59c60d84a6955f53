"""Gated activations used by every FFN site (routed experts, shared experts, dense layer 0)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU (SPEC.md §4.3): ``[b1 tanh(g/b1) * sigmoid(g)] * [b2 tanh(u/b2)]``, computed in fp32.

    Bounded by ``b1 * b2`` in magnitude; equals SwiGLU to first order near the origin."""
    g = gate.float()
    u = up.float()
    y = (beta1 * torch.tanh(g / beta1)) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return y.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Kimi Linear): ``silu(g) * u``."""
    return F.silu(gate) * up


def glu_act(
    gate: torch.Tensor, up: torch.Tensor, kind: str, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    if kind == "situ":
        return situ_glu(gate, up, beta1, beta2)
    if kind in ("silu", "swiglu"):
        return swiglu(gate, up)
    raise ValueError(f"unknown activation {kind!r}; expected 'situ' or 'silu'")
