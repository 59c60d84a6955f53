from __future__ import annotations

import torch
from torch import nn

from openk3.ops import backend as _backend
from openk3.ops.activations import glu_act

# Fast-path hook for the "glu" op (the gated activation of GLUMLP): name -> fn with the signature of
# ``openk3.ops.activations.glu_act(gate, up, kind, beta1, beta2)``; filled by openk3.fast.
FAST_GLU: dict[str, callable] = {}


class GLUMLP(nn.Module):
    """Dense gated FFN (layer-0 FFN and the fused shared experts): ``down(act(gate x, up x))``.
    gate_proj/up_proj: [I, D]; down_proj: [D, I]. ``backend``: "glu" op backend of the activation (``None`` = auto).
    """

    def __init__(self, hidden: int, inter: int, act: str, beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act, self.beta1, self.beta2 = act, beta1, beta2
        self.backend: str | None = None

    def forward(self, x: torch.Tensor, projections: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``down(act(gate x, up x))``. ``projections``: the gate and up projections of ``x`` computed elsewhere (e.g.
        by one GEMM over their weights stored side by side, as the inference engine does)."""
        return self.down_proj(self.pre_output(x, projections))

    def pre_output(self, x: torch.Tensor, projections: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``act(gate x, up x)``, the input of ``down_proj`` (from ``projections`` = [gate x, up x] when given)."""
        gate, up = (self.gate_proj(x), self.up_proj(x)) if projections is None else projections
        be = _backend.resolve("glu", gate.is_cuda, self.backend)
        fn = glu_act if be == "reference" else FAST_GLU.get(be, glu_act)
        return fn(gate, up, self.act, self.beta1, self.beta2)

    def input_projections(self) -> list[nn.Linear]:
        """The Linear layers that read the FFN input, in the order of ``projections``."""
        return [self.gate_proj, self.up_proj]
