"""RMSNorm and the KDA gated output norm on fla-core's fused Triton kernels (forward and backward in one kernel each,
fp32 statistics, any weight dtype).

Plugs into :data:`openk3.modules.norm.FAST_RMS_NORM` / :data:`~openk3.modules.norm.FAST_GATED_NORM` under the name
``"fla"`` with the signatures of the references ``openk3.ops.norm.rms_norm(x, weight, eps)`` and
``gated_rms_norm(x, weight, gate, eps)``. fla-core is optional: :func:`available` says why it cannot be used.

Numerics against the references:

* ``rms_norm``: the reference casts the normalised value to ``x.dtype`` *before* multiplying by the gain (the released
  models' order), fla multiplies by the gain in fp32 and rounds once. In fp32 the two agree to rounding (~1e-7
  relative); in bf16 they differ by one bf16 rounding of the output (~1e-3 relative), and fla's is the more exact.
  Without autograd the row kernel below runs instead, with the reference's order.
* ``gated_rms_norm``: both compute ``RMSNorm(x) * weight * sigmoid(gate)`` in fp32 and round once (fla applies the
  sigmoid gate after the norm, like the reference).
* Gradients are accumulated in fp32 and returned in each input's dtype (an fp32 gain with bf16 activations gets an
  fp32 gradient). fp64 inputs, empty inputs, a gate whose shape differs from ``x`` and rows wider than fla's limit
  (64 KiB per row) use the reference.

Autotuning: both kernels use Triton's autotuner, so ``OPENK3_AUTOTUNE_MAX`` (see ``openk3.fast.kda.limit_autotune``)
caps their configs too.

Without autograd (inference: the engine's prefill, ``torch.no_grad`` forwards), ``rms_norm`` takes one launch of
openk3's own row kernel instead (``openk3.infer.glue.add_rms_norm`` with no parts: one program per row, the
reference's roundings, so it equals ``openk3.ops.norm.rms_norm`` up to fp32 summation order). fla's wrapper is an
autograd function behind an autotuner and a compiler guard, ~0.1-0.3 ms of host time per call on the GPU machines,
which a prefill forward of ~60 norms, bound by the host, pays in full. ``gated_rms_norm`` likewise takes
``openk3.infer.glue.gated_rms_norm_rows`` (several rows per program, fp32 throughout, one rounding: the reference up
to fp32 summation order). ``NO_GRAD_KERNEL`` (``OPENK3_NORM_NO_GRAD=0`` turns both off) switches this.
"""

from __future__ import annotations

import torch

from openk3.fast._triton import env_flag
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

NO_GRAD_KERNEL = env_flag("OPENK3_NORM_NO_GRAD", True)

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
    """``x: [..., D]``, ``weight: [D]`` (any float dtype) or None. Returns ``x.dtype``. With autograd, fla's kernel:
    the gain is applied in fp32 before the single rounding (see the module docstring for the one-rounding difference
    in bf16); without it (``NO_GRAD_KERNEL``), openk3's row kernel with the reference's roundings."""
    if _use_reference(x):
        return rms_norm(x, weight, eps)
    y = _no_grad_rms_norm(x, weight, eps) if NO_GRAD_KERNEL else None
    return y if y is not None else _fla_rms_norm(x, weight, None, eps=float(eps))


def _no_grad_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """``rms_norm(x, weight, eps)`` in one launch of the row kernel where no gradient is wanted and ``x``'s rows are
    a [-1, D] view (with a gain of shape [D]); None otherwise (the caller takes fla's kernel)."""
    if weight is None or weight.shape != x.shape[-1:]:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    from openk3.infer.glue import add_rms_norm, triton_add_norm_ok

    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError:  # rows not evenly strided
        return None
    if rows.stride(-1) != 1 or not triton_add_norm_ok(rows) or weight.device != x.device:
        return None
    return add_rms_norm(rows, [], weight, eps)[0].view(x.shape)


def gated_rms_norm_fla(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(x) * weight * sigmoid(gate)`` in fp32, returned in ``x.dtype``. ``x, gate: [..., D]`` (same shape),
    ``weight: [D]`` (the KDA ``o_norm.weight`` is fp32 while activations are bf16; its gradient stays fp32)."""
    if _use_reference(x) or gate.shape != x.shape or gate.dtype == torch.float64:
        return gated_rms_norm(x, weight, gate, eps)
    y = _no_grad_gated_rms_norm(x, weight, gate, eps) if NO_GRAD_KERNEL else None
    if y is not None:
        return y
    return _fla_rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=float(eps))


def _no_grad_gated_rms_norm(x, weight, gate, eps) -> torch.Tensor | None:
    """``gated_rms_norm(x, weight, gate, eps)`` in one launch of openk3's row kernel where no gradient is wanted and
    ``x`` and ``gate``'s rows are [-1, D] views (a gain of shape [D]); None otherwise (the caller takes fla's)."""
    if weight.shape != x.shape[-1:] or weight.device != x.device:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad or weight.requires_grad):
        return None
    from openk3.infer.glue import gated_rms_norm_rows, triton_add_norm_ok

    try:
        rows, grows = x.view(-1, x.shape[-1]), gate.view(-1, x.shape[-1])
    except RuntimeError:  # rows not evenly strided
        return None
    if rows.stride(-1) != 1 or grows.stride(-1) != 1 or not triton_add_norm_ok(rows):
        return None
    return gated_rms_norm_rows(rows, grows, weight, eps).view(x.shape)
