"""A small fused piece of the inference engine's decode step, with a PyTorch reference of the same signature.

:func:`add_rms_norm`: the residual stream's pending adds and the RMSNorm that reads the result, in one launch on
  CUDA (models without AttnRes: every layer half ends in ``r = r + y`` and the next half starts with ``norm(r)``).
  Same roundings as the unfused ops: each add rounded to the dtype, then :func:`openk3.ops.norm.rms_norm`.
"""

from __future__ import annotations

import torch

from openk3.fast._triton import HAS_TRITON, INTERPRET, pdl_launch, pdl_on, tl, triton
from openk3.ops.norm import rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_reference", "triton_add_norm_ok"]

# the widest row the add + norm kernel takes (one program holds a whole row); wider rows take the separate ops
ADD_NORM_MAX_WIDTH = 16384


def add_rms_norm_reference(
    r: torch.Tensor, parts: list[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(r'), r')`` with ``r' = r + (parts[0] + parts[1] + ...)``: the parts summed left to right and then
    added to ``r``, each sum rounded to ``r.dtype`` (the order of the model's FFN output sum and residual add)."""
    if not parts:
        return rms_norm(r, weight, eps), r
    s = parts[0]
    for p in parts[1:]:
        s = s + p
    r = r + s
    return rms_norm(r, weight, eps), r


if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait
    from openk3.infer.kernels import _rms_norm_vec, _round

    @triton.jit
    def _add_norm_kernel(
        r_ptr, p0_ptr, p1_ptr, w_ptr, out_ptr, rout_ptr, s_r, s_p0, s_p1, s_o, s_ro, D, eps,
        NP: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        dtype = out_ptr.dtype.element_ty
        c = tl.arange(0, BD)
        m = c < D
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)  # a weight: read before the wait
        pdl_wait(PDL)
        pdl_trigger(PDL)
        x = tl.load(r_ptr + b * s_r + c, mask=m, other=0.0).to(tl.float32)
        if NP > 0:
            s = tl.load(p0_ptr + b * s_p0 + c, mask=m, other=0.0).to(tl.float32)
            if NP > 1:
                s = _round(s + tl.load(p1_ptr + b * s_p1 + c, mask=m, other=0.0).to(tl.float32), dtype)
            x = _round(x + s, dtype)
            tl.store(rout_ptr + b * s_ro + c, x.to(dtype), mask=m)
        tl.store(out_ptr + b * s_o + c, _rms_norm_vec(x, w, D, eps, dtype).to(dtype), mask=m)

    @triton.jit
    def _gated_norm_kernel(
        x_ptr, g_ptr, w_ptr, out_ptr, N, D, s_x, s_g, s_o, eps, BR: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        """``BR`` rows per program: ``w * (x * rsqrt(mean(x^2) + eps)) * sigmoid(g)`` in fp32, rounded once."""
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        c = tl.arange(0, BD)
        cm = c < D
        m = (rows < N)[:, None] & cm[None, :]
        x = tl.load(x_ptr + rows[:, None] * s_x + c[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * s_g + c[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        y = w[None, :] * (x * rstd[:, None]) * tl.sigmoid(g)
        tl.store(out_ptr + rows[:, None] * s_o + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm_rows(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``openk3.ops.norm.gated_rms_norm(x, weight, gate, eps)`` (the KDA output norm) for rows ``x, gate [N, D]``
    (unit column stride, same shape), ``weight [D]`` (any float dtype) in one launch: fp32 throughout, one rounding
    to ``x.dtype``, equal to the reference up to fp32 summation order. No autograd. CUDA or the Triton interpreter
    (:func:`triton_add_norm_ok`); the reference otherwise."""
    if x.shape != gate.shape or x.dim() != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"gated_rms_norm_rows: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}"
        )
    if not triton_add_norm_ok(x) or x.stride(-1) != 1 or gate.stride(-1) != 1:
        from openk3.ops.norm import gated_rms_norm

        return gated_rms_norm(x, weight, gate, eps)
    N, D = x.shape
    out = torch.empty_like(x)
    if N:
        BD = triton.next_power_of_2(D)
        BR = max(1, min(16, 2048 // BD))
        _gated_norm_kernel[(triton.cdiv(N, BR),)](
            x, gate, weight, out, N, D, x.stride(0), gate.stride(0), out.stride(0), float(eps), BR=BR, BD=BD,
            num_warps=4,
        )  # fmt: skip
    return out


def triton_add_norm_ok(r: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm` runs the Triton kernel for ``r`` (CUDA or the interpreter, 2-D rows of width
    at most ``ADD_NORM_MAX_WIDTH``)."""
    return HAS_TRITON and (r.is_cuda or INTERPRET) and r.dim() == 2 and r.shape[-1] <= ADD_NORM_MAX_WIDTH


def add_rms_norm(
    r: torch.Tensor, parts: list[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_reference` in one launch where :func:`triton_add_norm_ok` (``r`` and each part
    ``[B, D]``, at most two parts, ``weight [D]``); the reference otherwise. Returns ``(normed, r')``; with no parts
    ``r'`` is ``r`` itself."""
    if len(parts) > 2 or not triton_add_norm_ok(r):
        return add_rms_norm_reference(r, parts, weight, eps)
    B, D = r.shape
    for p in parts:
        if p.shape != r.shape or p.dtype != r.dtype or p.stride(-1) != 1:
            raise ValueError(
                f"add_rms_norm: part {tuple(p.shape)} {p.dtype} does not match r {tuple(r.shape)}"
            )
    if weight.shape != (D,) or r.stride(-1) != 1:
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} / r {tuple(r.shape)} do not match")
    out = torch.empty_like(r)
    rout = torch.empty_like(r) if parts else r
    p0 = parts[0] if parts else r
    p1 = parts[1] if len(parts) > 1 else p0
    if B:
        pdl = pdl_on(r)
        _add_norm_kernel[(B,)](
            r, p0, p1, weight, out, rout, r.stride(0), p0.stride(0), p1.stride(0), out.stride(0), rout.stride(0),
            D, float(eps), NP=len(parts), BD=triton.next_power_of_2(D), num_warps=4 if D <= 4096 else 8, PDL=pdl,
            **pdl_launch(pdl),
        )  # fmt: skip
    return out, rout
