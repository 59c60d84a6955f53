"""Small fused pieces of the inference engine's decode step, with PyTorch references of the same signatures.

* :func:`add_rms_norm`: the residual stream's pending adds and the RMSNorm that reads the result, in one launch on
  CUDA (models without AttnRes: every layer half ends in ``r = r + y`` and the next half starts with ``norm(r)``).
  Same roundings as the unfused ops: each add rounded to the dtype, then :func:`openk3.ops.norm.rms_norm`.
* :func:`l2_prefetch`: asks for a set of weight tensors to be brought into L2 (``prefetch.global.L2``, nothing waits
  for the lines and no register holds them). The engine issues it on a side stream while a latency-bound kernel runs
  (the KDA step, the MLA glue), for the GEMVs that follow; it changes no value.
"""

from __future__ import annotations

import torch

from openk3.fast._triton import HAS_TRITON, INTERPRET, tl, triton
from openk3.ops.norm import rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_reference", "l2_prefetch", "triton_add_norm_ok"]

# rows per launch above which the add + norm keeps the separate ops (one program per row; any width up to this)
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

    @triton.jit
    def _rnd(x, dtype: tl.constexpr):
        """``x`` (fp32) rounded to ``dtype`` and back (bf16 by bit arithmetic: the interpreter's cast truncates)."""
        if dtype == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) << 16
            y = u.to(tl.float32, bitcast=True)
        else:
            y = x.to(dtype).to(tl.float32)
        return y

    @triton.jit
    def _add_norm_kernel(
        r_ptr, p0_ptr, p1_ptr, w_ptr, out_ptr, rout_ptr, s_r, s_p0, s_p1, s_o, s_ro, D, eps,
        NP: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        dtype = out_ptr.dtype.element_ty
        c = tl.arange(0, BD)
        m = c < D
        x = tl.load(r_ptr + b * s_r + c, mask=m, other=0.0).to(tl.float32)
        if NP > 0:
            s = tl.load(p0_ptr + b * s_p0 + c, mask=m, other=0.0).to(tl.float32)
            if NP > 1:
                s = _rnd(s + tl.load(p1_ptr + b * s_p1 + c, mask=m, other=0.0).to(tl.float32), dtype)
            x = _rnd(x + s, dtype)
            tl.store(rout_ptr + b * s_ro + c, x.to(dtype), mask=m)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        y = _rnd(x * (1.0 / tl.sqrt(tl.sum(x * x) / D + eps)), dtype)
        tl.store(out_ptr + b * s_o + c, _rnd(_rnd(w, dtype) * y, dtype).to(dtype), mask=m)

    @triton.jit
    def _l2_prefetch_kernel(ptr, n_lines, LINES: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)
        i = tl.minimum(i, n_lines - 1)  # never a line past the tensor
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + i * 128], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip


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
        _add_norm_kernel[(B,)](
            r, p0, p1, weight, out, rout, r.stride(0), p0.stride(0), p1.stride(0), out.stride(0), rout.stride(0),
            D, float(eps), NP=len(parts), BD=triton.next_power_of_2(D), num_warps=4 if D <= 4096 else 8,
        )  # fmt: skip
    return out, rout


# lines (128 bytes) per program of the prefetch kernel
PREFETCH_LINES = 1024


def l2_prefetch(tensors) -> int:
    """Request every (contiguous) tensor of ``tensors`` into L2; compiled kernels on CUDA only (a no-op elsewhere).
    Returns the number of bytes requested."""
    total = 0
    for t in tensors:
        if (
            t is None
            or not t.is_cuda
            or INTERPRET
            or not HAS_TRITON
            or not t.is_contiguous()
            or not t.numel()
        ):
            continue
        nbytes = t.numel() * t.element_size()
        lines = triton.cdiv(nbytes, 128)
        _l2_prefetch_kernel[(triton.cdiv(lines, PREFETCH_LINES),)](
            t.view(-1).view(torch.uint8), lines, LINES=PREFETCH_LINES, num_warps=4
        )
        total += nbytes
    return total
