"""Triton import guard and small device helpers shared by the fast kernels."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing
    triton = tl = None
    HAS_TRITON = False
    tanh_f32 = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_ok(t=None) -> tuple[bool, str]:
    """Whether our Triton kernels can run on tensors like ``t`` (CUDA, or anything under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        return False, "triton not installed"
    if INTERPRET:
        return True, "triton (interpreter)"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if t is not None and not t.is_cuda:
        return False, "tensor not on CUDA"
    return True, "triton"


if HAS_TRITON:

    @triton.jit
    def tanh_f32(x):
        """tanh in fp32 without cancellation near 0 (odd Taylor series below |x| = 1/16)."""
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        big = (1.0 - e) / (1.0 + e)
        x2 = x * x
        small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        return tl.where(ax < 0.0625, small, tl.where(x < 0, -big, big))
