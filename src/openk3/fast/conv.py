"""KDA short convolution (depthwise, causal, + SiLU) on fla-core's Triton ``causal_conv1d`` (forward, backward,
packed sequences, carried state).

Plugs into :data:`openk3.modules.kda.FAST_CONV` under the name ``"fla"`` with the signature of the reference
``openk3.ops.conv.causal_conv1d``. fla-core is optional: :func:`available` says why it cannot be used.

State layouts. Ours (the reference, the caches): ``[N, C, W-1]``, the ``W-1`` previous *inputs*, oldest first, so
slot ``j`` holds the input ``W-1-j`` steps before the first token. fla's: ``[N, C, W]``, slot ``w`` holds the input
``W-w`` steps back; slot 0 (``W`` steps back) is never read by the convolution and is zero on the way in. So our slot
``j`` is fla's slot ``j+1``: :func:`conv_state_to_fla` pads one zero slot in front, :func:`conv_state_from_fla` drops
fla's slot 0 (its final state holds the last ``W`` inputs of each sequence). Both are plain torch ops, so gradients
flow through them to the initial state.

Numerics: fla accumulates in fp32 with the weight cast to fp32 (our conv weights are fp32 parameters next to bf16
activations), applies SiLU in fp32 and rounds once to ``x.dtype``, like the reference. Its backward recomputes the
pre-activation in ``x.dtype`` (bf16) before the SiLU derivative, so bf16 input gradients differ from the reference's
(fp32 pre-activation) by about one bf16 rounding. Gradients come back in each input's dtype (the fp32 weight gets an
fp32 gradient). The final state is returned in fp32 like the reference's; fla stores it in ``x.dtype`` first, which
is exact for the model (the carried values are earlier ``x.dtype`` inputs) but would round an fp32 initial state
that is not representable in bf16 for a sequence shorter than ``W-1`` tokens. fp64 inputs and ``W < 2`` use the
reference.

Autotuning: fla's conv kernels use a subclass of Triton's autotuner, so ``OPENK3_AUTOTUNE_MAX`` (see
``openk3.fast.kda.limit_autotune``) caps their configs too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.conv import causal_conv1d

_fla = False
_why = ""
try:  # fla-core is an optional dependency
    from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d

    _fla = True
except Exception as e:  # ImportError, or a Triton/driver problem at import time
    _fla_causal_conv1d = None
    _why = (
        "fla-core not installed"
        if isinstance(e, ImportError)
        else f"fla-core unusable ({type(e).__name__}: {e})"
    )


def available() -> tuple[bool, str]:
    if not _fla:
        return False, _why or "fla-core not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, "fla-core causal_conv1d (Triton)"


def conv_state_to_fla(state: torch.Tensor) -> torch.Tensor:
    """Our conv state ``[N, C, W-1]`` (previous inputs, oldest first) -> fla's ``[N, C, W]`` (zero slot 0 in front).
    Contiguous, same dtype; differentiable."""
    return F.pad(state, (1, 0))


def conv_state_from_fla(state: torch.Tensor) -> torch.Tensor:
    """fla's conv state ``[N, C, W]`` (the last ``W`` inputs, oldest first) -> ours ``[N, C, W-1]`` (a view)."""
    return state[..., 1:]


def causal_conv1d_fla(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    output_final_state: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as :func:`openk3.ops.conv.causal_conv1d`: ``x: [B, T, C]``, ``weight: [C, W]`` or ``[C, 1, W]``
    (last tap on the current token), ``initial_state: [N, C, W-1]``, ``cu_seqlens: [N+1]`` (B == 1; with a host
    copy ``cu_seqlens_cpu`` fla builds its chunk indices without reading the device tensor back). Returns
    ``(y [B, T, C] in x.dtype, final_state [N, C, W-1] fp32 or None)``."""
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    C, W = weight.shape
    B, T, Cx = x.shape
    if Cx != C:
        raise ValueError(f"causal_conv1d: x has {Cx} channels but the weight has {C}")
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    if x.dtype == torch.float64 or W < 2 or T == 0:
        return causal_conv1d(
            x,
            weight,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            activation=activation,
            output_final_state=output_final_state,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, C, W - 1):
        raise ValueError(f"conv initial_state must be [{N}, {C}, {W - 1}], got {tuple(initial_state.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"causal_conv1d: packed sequences (cu_seqlens) need batch size 1, got {B}")
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
    h0 = conv_state_to_fla(initial_state) if initial_state is not None else None
    y, final = _fla_causal_conv1d(
        x=x,
        weight=weight,
        bias=None,
        residual=None,
        initial_state=h0,
        output_final_state=output_final_state,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=None if cu_seqlens is None or cu_seqlens_cpu is None else cu_seqlens_cpu.long(),
    )
    if output_final_state:
        final = conv_state_from_fla(final).float()
    return y, final if output_final_state else None
