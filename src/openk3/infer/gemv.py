"""Matrix-vector products for the decode step: ``y = x @ w.T`` for a few rows ``x [M, K]`` (``M <=
GEMV_MAX_ROWS``) and a weight ``w [N, K]`` stored row-major (an ``nn.Linear`` weight), in one Triton launch.

At one to a few rows a decode step's projections are pure weight streams: every byte of ``w`` is read once and
used ``M`` times. cuBLAS splits such a product over K and adds a reduction launch, and its kernels start reading
only after the kernel before them has drained. This kernel gives each program ``BN`` whole rows of ``w`` (no
split, no second launch, a fixed summation order), and in its whole-row form (``BK == 0``) requests all of a
program's weights before anything else: with programmatic dependent launch (``openk3.fast._triton.PDL``) those
reads overlap the previous kernel's tail, since weights are never written during a step.

Values: fp32 products and sums of the operands, rounded once to ``x.dtype`` (as ``F.linear``; only the order of
the fp32 sum differs). ``out_dtype=torch.float32`` returns those rounded values as fp32 (the LM head's
``F.linear(h, w).float()`` in one launch), and with ``rounded=False`` the fp32 sums themselves (a router's
``F.linear(x.float(), w.float())`` of bf16 operands).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.fast._triton import (
    HAS_TRITON,
    INTERPRET,
    env_int,
    head_tail,
    pdl_launch,
    pdl_on,
    sm_count,
    tl,
    triton,
)
from openk3.ops.activations import glu_act
from openk3.ops.norm import rms_norm

__all__ = [
    "GLU",
    "Normed",
    "GEMV_CONFIG",
    "GEMV_DECODE",
    "GEMV_MAX_ROWS",
    "decode_gemv_ok",
    "gemv",
    "gemv_config",
    "gemv_reference",
    "triton_gemv_ok",
]

# the most rows one launch takes (each program multiplies its weight tile by every row)
GEMV_MAX_ROWS = 4

# Where the engine's decode step (EngineConfig.triton_gemv) takes the GEMV instead of cuBLAS: at most `max_rows`
# rows and weights of at most `max_bytes`. H200 (bench/diag_gemv.py, bench/NOTES.md v14): the GEMV is ahead at one
# row for weights of up to ~20 MB, where a launch's fixed latency is a large share; cuBLAS is ahead on larger
# weights and at 4 rows.
GEMV_DECODE = {"max_rows": 1, "max_bytes": 32 << 20, "normed_max_bytes": 64 << 20}
# "normed_max_bytes": the cap for a product whose input is a `Normed` (the engine's fold_norms: the GEMV then also
# replaces a norm launch). 64 MB takes the 48B shape's KDA input projection (58 MB; cuBLAS 17.6 us + a norm launch
# against the GEMV's 20.3 us with the norm, bench/NOTES.md v17); OPENK3_GEMV_NORMED_MAX_MB overrides it (benchmarks)
GEMV_DECODE["normed_max_bytes"] = (
    env_int("OPENK3_GEMV_NORMED_MAX_MB", GEMV_DECODE["normed_max_bytes"] >> 20, "MB") << 20
)

# Launch parameters (`gemv_config`): the whole-row form (BK 0) up to `whole_max_k` columns, with BN rows per
# program chosen so that the grid has at least `programs_per_sm` programs per SM; otherwise a loop over BK-column
# tiles pipelined through `num_stages` buffers.
GEMV_CONFIG = {
    "whole_max_k": 8192,
    "whole_max_elems": 16384,  # BN x padded K per program in the whole-row form
    "programs_per_sm": 8,
    "max_bn": 64,
    "bk": 512,
    "num_warps": 4,
    "num_stages": 3,
    # the persistent whole-row form for weights of at least `persist_min_bytes`: `persist` programs per SM walk the
    # row tiles of `persist_bn` rows, each requesting its next tile before using the current one
    "persist_min_bytes": 1 << 62,
    "persist": 4,
    "persist_bn": 4,
}
# benchmarks: the persistent form from OPENK3_GEMV_PERSIST_MIN_MB on
GEMV_CONFIG["persist_min_bytes"] = (
    env_int("OPENK3_GEMV_PERSIST_MIN_MB", GEMV_CONFIG["persist_min_bytes"] >> 20, "MB") << 20
)


@dataclass
class GLU:
    """An FFN's gated activation ``openk3.ops.activations.glu_act(gate, up, kind, beta1, beta2)`` as a GEMV input
    (``gate``, ``up``: ``[M, I]``): the GEMV forms it while loading its input instead of a kernel of its own."""

    gate: torch.Tensor
    up: torch.Tensor
    kind: str
    beta1: float = 4.0
    beta2: float = 25.0

    @property
    def shape(self) -> torch.Size:
        return self.gate.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.gate.dtype

    def value(self) -> torch.Tensor:
        return glu_act(self.gate, self.up, self.kind, self.beta1, self.beta2)


@dataclass
class Normed:
    """``openk3.ops.norm.rms_norm(x, weight, eps)`` of ``x [M, K]`` as a GEMV input (the first or only segment):
    the GEMV forms the norm of each row while loading it instead of a kernel of its own. ``out`` (``[M, K]``, x's
    dtype and device, unit column stride): the GEMV also writes the normed rows there, for a later kernel that reads
    them (one program of the launch stores them)."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    out: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def value(self) -> torch.Tensor:
        return rms_norm(self.x, self.weight, self.eps)


XInput = torch.Tensor | GLU | Normed | tuple


def _segments(x: XInput) -> list:
    """``x`` as a list of one or two row segments (a GLU last only, a Normed first only)."""
    segs = list(x) if isinstance(x, (tuple, list)) else [x]
    if not 1 <= len(segs) <= 2 or any(not isinstance(t, (torch.Tensor, GLU, Normed)) for t in segs):
        raise ValueError(
            "gemv: x must be a tensor, a GLU, a Normed, or a pair (tensor or Normed, tensor or GLU)"
        )
    if isinstance(segs[0], GLU) and len(segs) == 2:
        raise ValueError("gemv: a GLU segment must come last")
    if len(segs) == 2 and isinstance(segs[1], Normed):
        raise ValueError("gemv: a Normed segment must come first")
    for t in segs:
        if isinstance(t, Normed):
            if t.x.dim() != 2 or t.weight.shape != (t.x.shape[-1],) or t.weight.device != t.x.device:
                raise ValueError(
                    f"gemv: Normed x {tuple(t.x.shape)} and weight {tuple(t.weight.shape)} do not match"
                )
            if not t.weight.is_floating_point() or not float(t.eps) >= 0:
                raise ValueError(f"gemv: Normed needs a floating weight and eps >= 0, got eps {t.eps!r}")
            o = t.out
            if o is not None and (
                not isinstance(o, torch.Tensor)
                or o.shape != t.x.shape
                or o.dtype != t.x.dtype
                or o.device != t.x.device
                or (o.numel() > 0 and o.stride(1) != 1)
            ):
                raise ValueError(
                    f"gemv: Normed out must be a row-major [{', '.join(map(str, t.x.shape))}] {t.x.dtype} tensor "
                    f"on {t.x.device}, got "
                    + (
                        f"{tuple(o.shape)} {o.dtype} on {o.device}"
                        if isinstance(o, torch.Tensor)
                        else repr(o)
                    )
                )
        if isinstance(t, GLU):
            if t.gate.shape != t.up.shape or t.gate.dtype != t.up.dtype or t.gate.device != t.up.device:
                raise ValueError(
                    f"gemv: GLU gate {tuple(t.gate.shape)} and up {tuple(t.up.shape)} do not match"
                )
            if t.kind not in ("situ", "silu", "swiglu"):
                raise ValueError(f"gemv: unknown activation {t.kind!r}; expected 'situ' or 'silu'")
        if (
            t.dim() if isinstance(t, torch.Tensor) else t.x.dim() if isinstance(t, Normed) else t.gate.dim()
        ) != 2:
            raise ValueError(f"gemv: x segments must be [M, K], got {tuple(t.shape)}")
    if len(segs) == 2 and (segs[0].shape[0] != segs[1].shape[0] or segs[0].dtype != segs[1].dtype):
        raise ValueError(
            f"gemv: segments {tuple(segs[0].shape)} {segs[0].dtype} and {tuple(segs[1].shape)} {segs[1].dtype} "
            "do not match"
        )
    return segs


def _dense(x: XInput) -> torch.Tensor:
    """The row(s) ``x`` stands for, materialised (segments concatenated, GLUs applied)."""
    segs = [t if isinstance(t, torch.Tensor) else t.value() for t in _segments(x)]
    return segs[0] if len(segs) == 1 else torch.cat(segs, dim=-1)


def _fill_outs(x: XInput) -> None:
    """Write the normed rows of a :class:`Normed` segment with an ``out`` (the reference path's share of it)."""
    for t in _segments(x):
        if isinstance(t, Normed) and t.out is not None:
            t.out.copy_(t.value())


def gemv_reference(
    x: XInput,
    w: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    rounded: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, w)`` (rounded to ``x.dtype``), converted to ``out_dtype`` when given; ``x`` a tensor, a
    :class:`GLU` or a pair (tensor, tensor or GLU) standing for their concatenation along the row. ``rounded=False``
    (with ``out_dtype=torch.float32``): ``F.linear`` of the operands in fp32, no rounding. ``residual``:
    ``residual + F.linear(x, w)``, both in ``x.dtype``."""
    _fill_outs(x)
    if not rounded:
        return F.linear(_dense(x).float(), w.float())
    y = F.linear(_dense(x), w)
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait, tanh_f32
    from openk3.infer.kernels import _round

    @triton.jit
    def _gemv_tile(w_ptr, rn, kk, nmask, s_wn, K: tl.constexpr, EVEN: tl.constexpr):
        """Weight tile ``[BN, BK]`` at rows ``rn`` and columns ``kk`` (zeros outside the matrix)."""
        if EVEN:
            return tl.load(w_ptr + rn[:, None] * s_wn + kk[None, :])
        return tl.load(
            w_ptr + rn[:, None] * s_wn + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0
        )

    @triton.jit
    def _gemv_x(
        x_ptr, b_ptr, u_ptr, rm, kk, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv, xo_ptr, s_xom,
        K: tl.constexpr, KA: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, XOUT: tl.constexpr,
    ):  # fmt: skip
        """``[MP, BK]`` fp32: the rows ``rm`` of x at the columns ``kk`` (zeros outside). Columns below ``KA`` from
        ``x_ptr``, the rest from ``b_ptr`` (``ACT`` 0), or the gated activation of ``b_ptr`` (gate) and ``u_ptr``
        (up): 1 SwiGLU (``F.silu(g) * u``, each rounded), 2 SiTU-GLU (fp32, one rounding). ``NORM``: the columns
        below ``KA`` are RMS-normed with the rows' ``rinv`` and the gain at ``nw_ptr``
        (``openk3.ops.norm.rms_norm``'s roundings); ``XOUT``: program 0 also stores those normed values at
        ``xo_ptr``."""
        dtype = x_ptr.dtype.element_ty
        m = mmask[:, None] & (kk < K)[None, :]
        x = tl.zeros([rm.shape[0], kk.shape[0]], tl.float32)
        if KA > 0:
            ma = m & (kk < KA)[None, :]
            x = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :], mask=ma, other=0.0)
            x = x.to(tl.float32)
            if NORM:
                gain = _round(tl.load(nw_ptr + kk, mask=kk < KA, other=0.0).to(tl.float32), dtype)
                x = _round(gain[None, :] * _round(x * rinv[:, None], dtype), dtype)
                if XOUT:
                    tl.store(
                        xo_ptr + rm[:, None] * s_xom + kk[None, :],
                        x.to(dtype),
                        mask=ma & (tl.program_id(0) == 0),
                    )
        if KA < K:
            mb = m & (kk >= KA)[None, :]
            kb = kk - KA
            g = tl.load(b_ptr + rm[:, None] * s_bm + kb[None, :], mask=mb, other=0.0).to(tl.float32)
            if ACT == 0:
                xb = g
            else:
                u = tl.load(u_ptr + rm[:, None] * s_um + kb[None, :], mask=mb, other=0.0).to(tl.float32)
                if ACT == 1:
                    xb = _round(_round(g * tl.sigmoid(g), dtype) * u, dtype)
                else:
                    xb = _round((b1 * tanh_f32(g / b1)) * tl.sigmoid(g) * (b2 * tanh_f32(u / b2)), dtype)
            x = tl.where(mb, xb, x)
        return x

    @triton.jit
    def _gemv_mul(w, x):
        """``[MP, BN]`` fp32: the tile ``w [BN, BK]`` times the rows ``x [MP, BK]``, summed over the columns."""
        return tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)

    @triton.jit
    def _gemv_dot(
        x_ptr, b_ptr, u_ptr, w, rm, kk, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv, xo_ptr, s_xom,
        K: tl.constexpr, KA: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, XOUT: tl.constexpr,
    ):  # fmt: skip
        """``[MP, BN]`` fp32 partial products of the rows ``rm`` of x (:func:`_gemv_x`) over the columns ``kk``
        with the tile ``w``."""
        x = _gemv_x(
            x_ptr, b_ptr, u_ptr, rm, kk, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv, xo_ptr, s_xom,
            K, KA, ACT, NORM, XOUT,
        )  # fmt: skip
        return _gemv_mul(w, x)

    @triton.jit
    def _gemv_rinv(x_ptr, rm, mmask, s_xm, eps, KA: tl.constexpr, KAP: tl.constexpr, NORM: tl.constexpr):
        """``[MP]``: 1 / RMS (+ eps) of the first ``KA`` columns of each row where ``NORM``; ones otherwise."""
        if NORM:
            ka = tl.arange(0, KAP)
            xa = tl.load(
                x_ptr + rm[:, None] * s_xm + ka[None, :], mask=mmask[:, None] & (ka < KA)[None, :], other=0.0
            )
            xa = xa.to(tl.float32)
            return tl.rsqrt(tl.sum(xa * xa, axis=1) / KA + eps)
        return tl.full([rm.shape[0]], 1.0, tl.float32)

    @triton.jit
    def _gemv_store(
        acc, y_ptr, r_ptr, rm, rn, mmask, nmask, s_ym, s_rm, dtype: tl.constexpr, ROUND: tl.constexpr,
        RES: tl.constexpr,
    ):  # fmt: skip
        """Store the ``[MP, BN]`` sums: rounded to ``dtype`` (``ROUND``), plus a residual (``RES``: added to the
        rounded product and rounded again, a separate add's two roundings)."""
        y = _round(acc, dtype) if ROUND else acc
        omask = mmask[:, None] & nmask[None, :]
        if RES:
            r = tl.load(r_ptr + rm[:, None] * s_rm + rn[None, :], mask=omask, other=0.0)
            y = _round(y + r.to(tl.float32), dtype)
        tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _gemv_kernel(
        x_ptr, b_ptr, u_ptr, w_ptr, y_ptr, N, s_xm, s_bm, s_um, s_wn, s_ym, b1, b2, nw_ptr, eps, r_ptr, s_rm,
        xo_ptr, s_xom, NT,
        K: tl.constexpr, KA: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, KAP: tl.constexpr,
        K1: tl.constexpr, KT: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, EVEN_N: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr, ROUND: tl.constexpr = True,
        RES: tl.constexpr = False, XOUT: tl.constexpr = False, PERSIST: tl.constexpr = False,
    ):  # fmt: skip
        dtype = x_ptr.dtype.element_ty
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)
        if WIDE:  # weight offsets past 2**31 elements
            rn = rn.to(tl.int64)
        rm = tl.arange(0, MP)
        nmask = rn < N
        mmask = rm < M
        if PERSIST:
            # whole rows (head + tail tile), a fixed grid walking the row tiles pid, pid + G, ...: the next tile's
            # weights requested before the current one is used, the input rows formed once
            G = tl.num_programs(0)
            rk = tl.arange(0, K1)
            w = _gemv_tile(w_ptr, rn, rk, nmask, s_wn, K, False)
            if KT > 0:
                rk2 = K1 + tl.arange(0, KT)
                w2 = _gemv_tile(w_ptr, rn, rk2, nmask, s_wn, K, False)
            pdl_wait(PDL)
            pdl_trigger(PDL)
            rinv = _gemv_rinv(x_ptr, rm, mmask, s_xm, eps, KA, KAP, NORM)
            xh = _gemv_x(
                x_ptr, b_ptr, u_ptr, rm, rk, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv, xo_ptr, s_xom,
                K, KA, ACT, NORM, XOUT,
            )  # fmt: skip
            if KT > 0:
                xt = _gemv_x(
                    x_ptr, b_ptr, u_ptr, rm, rk2, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv, xo_ptr, s_xom,
                    K, KA, ACT, NORM, XOUT,
                )  # fmt: skip
            t = pid
            while t < NT:  # (a while loop: the CPU interpreter cannot take a program id as a range() bound)
                rn_next = rn + G * BN
                nmask_next = rn_next < N
                w_next = _gemv_tile(w_ptr, rn_next, rk, nmask_next, s_wn, K, False)
                acc = _gemv_mul(w, xh)
                if KT > 0:
                    w2_next = _gemv_tile(w_ptr, rn_next, rk2, nmask_next, s_wn, K, False)
                    acc += _gemv_mul(w2, xt)
                    w2 = w2_next
                _gemv_store(acc, y_ptr, r_ptr, rm, rn, mmask, nmask, s_ym, s_rm, dtype, ROUND, RES)
                w = w_next
                rn = rn_next
                nmask = nmask_next
                t += G
        elif BK == 0:
            # whole rows, as a power-of-two head of K1 columns and a tail tile of KT (K = 2304: 2048 + 256, no
            # masked-off lanes when the tail is a power of two): every weight byte of the program requested before
            # the previous kernel is waited on
            rk = tl.arange(0, K1)
            w = _gemv_tile(w_ptr, rn, rk, nmask, s_wn, K, EVEN_N)
            if KT > 0:
                rk2 = K1 + tl.arange(0, KT)
                w2 = _gemv_tile(w_ptr, rn, rk2, nmask, s_wn, K, EVEN_N and K1 + KT == K)
            pdl_wait(PDL)
            pdl_trigger(PDL)
            rinv = _gemv_rinv(x_ptr, rm, mmask, s_xm, eps, KA, KAP, NORM)
            acc = _gemv_dot(
                x_ptr, b_ptr, u_ptr, w, rm, rk, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv, xo_ptr, s_xom,
                K, KA, ACT, NORM, XOUT,
            )  # fmt: skip
            if KT > 0:
                acc += _gemv_dot(
                    x_ptr, b_ptr, u_ptr, w2, rm, rk2, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv, xo_ptr,
                    s_xom, K, KA, ACT, NORM, XOUT,
                )  # fmt: skip
            _gemv_store(acc, y_ptr, r_ptr, rm, rn, mmask, nmask, s_ym, s_rm, dtype, ROUND, RES)
        else:  # BK-column tiles, the next one requested before the current one is used (two in flight)
            EVEN: tl.constexpr = EVEN_N and K % BK == 0
            rk = tl.arange(0, BK)
            w = _gemv_tile(w_ptr, rn, rk, nmask, s_wn, K, EVEN)
            pdl_wait(PDL)
            pdl_trigger(PDL)
            rinv = _gemv_rinv(x_ptr, rm, mmask, s_xm, eps, KA, KAP, NORM)
            acc = tl.zeros([MP, BN], tl.float32)
            for k0 in tl.range(BK, K, BK):
                w_next = _gemv_tile(w_ptr, rn, k0 + rk, nmask, s_wn, K, EVEN)
                acc += _gemv_dot(
                    x_ptr, b_ptr, u_ptr, w, rm, k0 - BK + rk, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv,
                    xo_ptr, s_xom, K, KA, ACT, NORM, XOUT,
                )  # fmt: skip
                w = w_next
            k_last: tl.constexpr = (K - 1) // BK * BK
            acc += _gemv_dot(
                x_ptr, b_ptr, u_ptr, w, rm, k_last + rk, mmask, s_xm, s_bm, s_um, b1, b2, nw_ptr, rinv,
                xo_ptr, s_xom, K, KA, ACT, NORM, XOUT,
            )  # fmt: skip
            _gemv_store(acc, y_ptr, r_ptr, rm, rn, mmask, nmask, s_ym, s_rm, dtype, ROUND, RES)


def _leaves(x: XInput) -> list:
    """The tensors ``x`` is made of (a GLU's gate and up), unchecked."""
    segs = list(x) if isinstance(x, (tuple, list)) else [x]
    return [
        t
        for s in segs
        for t in ((s.gate, s.up) if isinstance(s, GLU) else (s.x,) if isinstance(s, Normed) else (s,))
    ]


def triton_gemv_ok(x: XInput, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` runs the Triton kernel for ``x`` and ``w``: Triton on CUDA (or the interpreter), ``x``
    (a tensor, a :class:`GLU` or a pair, see :func:`gemv`) of 2-D segments of at most ``GEMV_MAX_ROWS`` rows, a 2-D
    ``w`` of the same floating dtype and device, row-major."""
    ts = _leaves(x)
    if not HAS_TRITON or not ts or any(not isinstance(t, torch.Tensor) for t in ts):
        return False
    t0 = ts[0]
    return (
        (t0.is_cuda or INTERPRET)
        and all(t.dim() == 2 and t.dtype == t0.dtype and t.device == t0.device for t in ts)
        and 0 < t0.shape[0] <= GEMV_MAX_ROWS
        and w.dim() == 2
        and t0.dtype == w.dtype
        and t0.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and t0.device == w.device
        and w.stride(1) == 1
    )


def decode_gemv_ok(x: XInput, w: torch.Tensor) -> bool:
    """Whether the engine's decode step takes :func:`gemv` for ``x @ w.T`` (:func:`triton_gemv_ok` within
    ``GEMV_DECODE``'s rows and weight bytes: ``normed_max_bytes`` where ``x`` starts with a :class:`Normed`)."""
    first = x[0] if isinstance(x, (tuple, list)) and x else x
    cap = GEMV_DECODE["normed_max_bytes" if isinstance(first, Normed) else "max_bytes"]
    return (
        w.numel() * w.element_size() <= cap
        and triton_gemv_ok(x, w)
        and _leaves(x)[0].shape[0] <= GEMV_DECODE["max_rows"]
    )


def gemv_config(M: int, N: int, K: int, device=None) -> dict:
    """Launch parameters for ``[M, K] x [N, K]^T`` from ``GEMV_CONFIG``: ``BN`` rows per program, ``BK`` columns per
    loop step (0: whole rows in one tile), ``num_warps``, ``num_stages``, ``persist`` (programs per SM of the
    persistent whole-row form; 0: one tile per program)."""
    c = GEMV_CONFIG
    sms = sm_count(device) if device is not None else 132
    kp = _whole_width(K)
    if K <= c["whole_max_k"] and N * K * 2 >= c["persist_min_bytes"]:
        bn = min(c["persist_bn"], _pow2_floor(c["whole_max_elems"] // kp))
        return dict(BN=bn, BK=0, num_warps=c["num_warps"], num_stages=1, persist=c["persist"])
    bn = 1
    while bn * 2 <= c["max_bn"] and triton.cdiv(N, bn * 2) >= c["programs_per_sm"] * sms:
        bn *= 2
    if K <= c["whole_max_k"]:
        return dict(
            BN=min(bn, _pow2_floor(c["whole_max_elems"] // kp)), BK=0, num_warps=c["num_warps"], num_stages=1
        )
    bk = min(c["bk"], triton.next_power_of_2(K))
    bn = min(bn, _pow2_floor(c["whole_max_elems"] // bk))
    return dict(BN=bn, BK=bk, num_warps=c["num_warps"], num_stages=c["num_stages"])


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _whole_width(K: int) -> int:
    """Columns the whole-row form holds per weight row (head plus tail tile)."""
    return sum(head_tail(K))


def gemv(
    x: XInput,
    w: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    rounded: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, w)`` for ``x [M, K]``, ``w [N, K]`` (optionally as ``out_dtype``, which must be ``x.dtype`` or
    fp32) in one Triton launch where :func:`triton_gemv_ok`; :func:`gemv_reference` otherwise. ``x`` may also be a
    :class:`GLU` (its activation formed in the load) or a pair ``(a, b)`` standing for ``cat([a, b], -1)`` with
    ``b`` a tensor or a GLU (no concatenated copy). ``config`` overrides :func:`gemv_config`'s launch parameters
    (benchmarks; ``wide``: 64-bit weight offsets, which weights of 2**31 elements or more take anyway).
    ``rounded=False`` (only with ``out_dtype=torch.float32``): the fp32 sums, not rounded to ``x.dtype``.
    ``residual [M, N]`` (``x.dtype``, output in ``x.dtype``): ``residual + F.linear(x, w)`` with the separate add's
    roundings (the product rounded, then the sum), read and added in the store instead of a kernel of its own."""
    segs = _segments(x)
    widths = [t.shape[1] for t in segs]
    if w.dim() != 2 or sum(widths) != w.shape[1]:
        raise ValueError(
            f"gemv: x [M, K] and w [N, K] expected, got x of width {'+'.join(map(str, widths))} and w "
            f"{tuple(w.shape)}"
        )
    dtype = segs[0].dtype
    if out_dtype is not None and out_dtype not in (dtype, torch.float32):
        raise ValueError(f"gemv: out_dtype must be {dtype} or torch.float32, got {out_dtype}")
    if not rounded and out_dtype != torch.float32:
        raise ValueError("gemv: rounded=False returns fp32 sums; pass out_dtype=torch.float32")
    if residual is not None:
        M0 = segs[0].shape[0]
        if not isinstance(residual, torch.Tensor) or residual.shape != (M0, w.shape[0]):
            raise ValueError(
                f"gemv: residual must be [{M0}, {w.shape[0]}], got "
                f"{tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__}"
            )
        if (
            not rounded
            or residual.dtype != dtype
            or out_dtype not in (None, dtype)
            or residual.device != w.device
        ):
            raise ValueError(
                f"gemv: a residual is added in the operands' dtype {dtype} on {w.device}, got {residual.dtype} on "
                f"{residual.device} (out_dtype {out_dtype})"
            )
    if not triton_gemv_ok(x, w):
        return gemv_reference(x, w, out_dtype, rounded, residual)
    M = segs[0].shape[0]
    N, K = w.shape

    def rows(t):  # row-major rows (any row stride)
        return t if t.stride(1) == 1 else t.contiguous()

    # kernel operands: a = the plain columns below KA, b = the rest (or the GLU's gate), u = the GLU's up
    glu = segs[-1] if isinstance(segs[-1], GLU) else None
    normed = segs[0] if isinstance(segs[0], Normed) else None
    plain = [rows(t.x if isinstance(t, Normed) else t) for t in segs if not isinstance(t, GLU)]
    KA = widths[0] if plain else 0
    b = rows(glu.gate) if glu is not None else plain[-1]
    a = plain[0] if plain else b
    u = rows(glu.up) if glu is not None else b
    act = 0 if glu is None else 2 if glu.kind == "situ" else 1
    b1, b2 = (float(glu.beta1), float(glu.beta2)) if glu is not None else (1.0, 1.0)
    y = torch.empty(M, N, device=w.device, dtype=out_dtype or dtype)
    if N == 0:
        _fill_outs(x)
        return y
    if K == 0:
        return y.zero_() if residual is None else gemv_reference(x, w, out_dtype, rounded, residual)
    cfg = dict(gemv_config(M, N, K, w.device))
    if config:
        cfg.update(config)
    BN, BK = cfg["BN"], cfg["BK"]
    persist = int(cfg.get("persist", 0))
    if persist < 0 or (persist and BK):
        raise ValueError(f"gemv: persist (programs per SM, whole rows only: BK 0) must be >= 0, got {cfg}")
    K1, KT = head_tail(K)
    pdl = pdl_on(w)
    res = y if residual is None else rows(residual)
    xo = normed.out if normed is not None else None
    NT = triton.cdiv(N, BN)
    grid = min(NT, persist * sm_count(w.device)) if persist else NT
    _gemv_kernel[(grid,)](
        a, b, u, w, y, N, a.stride(0), b.stride(0), u.stride(0), w.stride(0), y.stride(0), b1, b2,
        normed.weight.contiguous() if normed is not None else w, float(normed.eps) if normed is not None else 0.0,
        res, res.stride(0), xo if xo is not None else y, xo.stride(0) if xo is not None else 0, NT,
        K=K, KA=KA, ACT=act, NORM=normed is not None, KAP=triton.next_power_of_2(max(KA, 1)), K1=K1, KT=KT, M=M, MP=triton.next_power_of_2(M), BN=BN, BK=BK, EVEN_N=N % BN == 0,
        WIDE=cfg.get("wide", N * w.stride(0) >= 2**31), PDL=pdl, ROUND=rounded, RES=residual is not None,
        XOUT=xo is not None, PERSIST=persist > 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(pdl),
    )  # fmt: skip
    return y
