"""RMSNorm and the KDA gated output norm on fla-core's fused Triton kernels (forward and backward in one kernel each,
fp32 statistics, any weight dtype).

Plugs into :data:`openk3.modules.norm.FAST_RMS_NORM` / :data:`~openk3.modules.norm.FAST_GATED_NORM` under the name
``"fla"`` with the signatures of the references ``openk3.ops.norm.rms_norm(x, weight, eps)`` and
``gated_rms_norm(x, weight, gate, eps)``. fla-core is optional: :func:`available` says why it cannot be used.

Numerics against the references:

* ``rms_norm``: the reference casts the normalised value to ``x.dtype`` *before* multiplying by the gain (the released
  models' order), fla multiplies by the gain in fp32 and rounds once. In fp32 the two agree to rounding (~1e-7
  relative); in bf16 they differ by one bf16 rounding of the output (~1e-3 relative), and fla's is the more exact.
* ``gated_rms_norm``: both compute ``RMSNorm(x) * weight * sigmoid(gate)`` in fp32 and round once (fla applies the
  sigmoid gate after the norm, like the reference).
* Gradients are accumulated in fp32 and returned in each input's dtype (an fp32 gain with bf16 activations gets an
  fp32 gradient). fp64 inputs, empty inputs, a gate whose shape differs from ``x`` and rows wider than fla's limit
  (64 KiB per row) use the reference.

Autotuning: both kernels use Triton's autotuner, so ``OPENK3_AUTOTUNE_MAX`` (see ``openk3.fast.kda.limit_autotune``)
caps their configs too.
"""

from __future__ import annotations

import torch

from openk3.ops.norm import gated_rms_norm, rms_norm

_fla = False
_why = ""
try:  # fla-core is an optional dependency
    from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm as _fla_rms_norm

    _fla = True
except Exception as e:  # ImportError, or a Triton/driver problem at import time
    _fla_rms_norm = _fla_rms_norm_gated = None
    _why = (
        "fla-core not installed"
        if isinstance(e, ImportError)
        else f"fla-core unusable ({type(e).__name__}: {e})"
    )

_MAX_ROW_BYTES = 65536  # fla's fused norms keep one row in registers/shared memory, at most 64 KiB


def available() -> tuple[bool, str]:
    if not _fla:
        return False, _why or "fla-core not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, "fla-core fused rms_norm / rms_norm_gated"


def _use_reference(x: torch.Tensor) -> bool:
    return x.dtype == torch.float64 or x.numel() == 0 or x.shape[-1] * x.element_size() > _MAX_ROW_BYTES


def rms_norm_fla(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x: [..., D]``, ``weight: [D]`` (any float dtype) or None. Returns ``x.dtype``; the gain is applied in fp32
    before the single rounding (see the module docstring for the one-rounding difference in bf16)."""
    if _use_reference(x):
        return rms_norm(x, weight, eps)
    return _fla_rms_norm(x, weight, None, eps=float(eps))


def gated_rms_norm_fla(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(x) * weight * sigmoid(gate)`` in fp32, returned in ``x.dtype``. ``x, gate: [..., D]`` (same shape),
    ``weight: [D]`` (the KDA ``o_norm.weight`` is fp32 while activations are bf16; its gradient stays fp32)."""
    if _use_reference(x) or gate.shape != x.shape or gate.dtype == torch.float64:
        return gated_rms_norm(x, weight, gate, eps)
    return _fla_rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=float(eps))
