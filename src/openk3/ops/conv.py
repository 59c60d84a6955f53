"""Causal depthwise short convolution (KDA q/k/v), with carried state and packed sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    output_final_state: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv: ``y[t, c] = sum_j w[c, j] * x[t - (W-1) + j, c]`` then SiLU.

    x: [B, T, C]; weight: [C, W] or [C, 1, W] (last tap multiplies the current token);
    initial_state: [N, C, W-1] -- the W-1 previous *inputs* (oldest first), N = B or number of sequences;
    cu_seqlens: [N+1] packed boundaries (B == 1): history resets at each boundary; ``cu_seqlens_cpu`` an optional
    host copy of them (read instead of the device tensor, no synchronisation).
    Returns (y [B, T, C] in x.dtype, final_state [N, C, W-1] or None). Computed in fp32.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    C, W = weight.shape
    B, T, Cx = x.shape
    if Cx != C:
        raise ValueError(f"causal_conv1d: x has {Cx} channels but the weight has {C}")
    w = weight.float().unsqueeze(1)  # [C, 1, W]
    xf = x.float().transpose(1, 2)  # [B, C, T]
    if cu_seqlens is None:
        segs = [(slice(None), 0, T)]
        N = B
    else:
        bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        segs = [(slice(0, 1), bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        N = len(segs)
    if initial_state is not None and initial_state.shape != (N, C, W - 1):
        raise ValueError(f"conv initial_state must be [{N}, {C}, {W - 1}], got {tuple(initial_state.shape)}")
    outs, finals = [], []
    for n, (bsl, s, e) in enumerate(segs):
        seg = xf[bsl, :, s:e]
        nb = seg.shape[0]
        if initial_state is None:
            hist = seg.new_zeros(nb, C, W - 1)
        elif cu_seqlens is None:
            hist = initial_state.float()
        else:
            hist = initial_state[n : n + 1].float()
        full = torch.cat([hist, seg], dim=-1)
        y = F.conv1d(full, w, groups=C)
        outs.append(y)
        if output_final_state:
            finals.append(full[..., full.shape[-1] - (W - 1) :])
    y = torch.cat(outs, dim=-1) if cu_seqlens is not None else outs[0]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    final = torch.cat(finals, dim=0) if output_final_state else None
    return y.transpose(1, 2).to(x.dtype), final
