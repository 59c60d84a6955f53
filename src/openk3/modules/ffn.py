from __future__ import annotations

import torch
from torch import nn

from openk3.ops.activations import glu_act


class GLUMLP(nn.Module):
    """Dense gated FFN (layer-0 FFN and the fused shared experts): ``down(act(gate x, up x))``.
    gate_proj/up_proj: [I, D]; down_proj: [D, I]."""

    def __init__(self, hidden: int, inter: int, act: str, beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act, self.beta1, self.beta2 = act, beta1, beta2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_act(self.gate_proj(x), self.up_proj(x), self.act, self.beta1, self.beta2))
