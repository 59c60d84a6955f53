"""KDA decay gate and the L2 normalisation used on queries/keys.

Both functions return fp32 tensors (fp64 when the input is fp64, so that exactness tests are possible).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["GATE_KINDS", "compute_dtype", "kda_gate", "l2norm"]

GATE_KINDS = ("lowerbound", "softplus")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Internal compute dtype: fp64 if any input is fp64, otherwise fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise over the last dimension: ``x / sqrt(sum(x * x, -1) + eps)``.

    Computed and returned in fp32 (fp64 for fp64 input). Shape is preserved.
    """
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _per_head(A_log: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    flat = A_log.reshape(-1)
    if flat.numel() < num_heads:
        raise ValueError(
            f"A_log must hold at least num_heads={num_heads} values (after flattening); got shape "
            f"{tuple(A_log.shape)}"
        )
    return flat[:num_heads].to(dtype)


def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    *,
    kind: str = "lowerbound",
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Turn raw decay logits into the KDA log decay ``g = log(alpha) <= 0``.

    Args:
        z: ``[..., H, K]`` raw decay logits (any float dtype).
        A_log: per-head log scale; the first ``H`` entries after flattening are used, so ``[H]``,
            a zero-padded ``[H_padded >= H]`` vector, or ``[1, 1, H, 1]`` are all accepted.
        dt_bias: ``[H * K]`` or ``[H, K]`` bias added to ``z`` (``None`` means no bias).
        kind: ``"lowerbound"`` (Kimi K3): ``g = lower_bound * sigmoid(exp(A_h) * (z + dt_bias))``, which lies
            in ``(lower_bound, 0)``; ``"softplus"`` (Kimi Linear): ``g = -exp(A_h) * softplus(z + dt_bias)``.
        lower_bound: per-step floor of the lower-bounded gate, in ``[-10, 0)``.

    Returns:
        ``g`` with ``z``'s shape, fp32 (fp64 if ``z`` is fp64).
    """
    if kind not in GATE_KINDS:
        raise ValueError(f"kda_gate: kind must be one of {GATE_KINDS}, got {kind!r}")
    if z.dim() < 2:
        raise ValueError(f"kda_gate: z must have shape [..., H, K], got {tuple(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"kda_gate: z must be a floating-point tensor, got {z.dtype}")
    if kind == "lowerbound":
        lb = float(lower_bound)
        if not (-10.0 <= lb < 0.0):
            raise ValueError(f"kda_gate: lower_bound must lie in [-10, 0), got {lower_bound}")
    H, K = z.shape[-2], z.shape[-1]
    dtype = compute_dtype(z)
    x = z.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != H * K or dt_bias.dim() not in (1, 2):
            raise ValueError(
                f"kda_gate: dt_bias must have shape [H*K]={H * K} or [H, K]=[{H}, {K}], got "
                f"{tuple(dt_bias.shape)}"
            )
        x = x + dt_bias.reshape(H, K).to(dtype)
    a = torch.exp(_per_head(A_log, H, dtype)).unsqueeze(-1)  # [H, 1]
    if kind == "lowerbound":
        return lb * torch.sigmoid(a * x)
    return -a * F.softplus(x, beta=1.0, threshold=20.0)
