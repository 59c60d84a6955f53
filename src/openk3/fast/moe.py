"""Routed-expert compute with token permutation + ``torch._grouped_mm`` (forward and backward), SiTU-GLU in Triton.

Plugs into :data:`openk3.modules.moe.FAST_EXPERTS` as ``"grouped_mm"`` with the signature of
``openk3.ops.moe.experts_reference``: ``fn(x [N,W], idx [N,k], weights [N,k] fp32, w1 [E,I,W], w2 [E,W,I],
w3 [E,I,W], *, act, beta1, beta2) -> [N,W]``.

Layout: the N*k (token, expert) pairs are sorted by expert into a padded buffer of ``P`` rows in which each expert
owns a group of rows padded to a multiple of :data:`ALIGN` (in training at least ``ALIGN`` rows, so no group is
empty; without autograd, e.g. decode, an expert with no token gets no rows and its weights are not read); padding
rows are zeros. ``P = N*k + E*ALIGN`` (without autograd ``N*k + (ALIGN-1)*min(E, N*k)``) is a static bound, so
planning needs no host synchronisation (CUDA-graph safe); rows past the last group are never read. Per layer, forward: gather x rows -> two grouped GEMMs (gate, up) -> SiTU-GLU (Triton) ->
grouped GEMM (down) -> weighted combine (Triton, fp32 accumulation, like the reference). Backward: the same GEMMs
transposed plus three 2-D x 2-D grouped GEMMs for the weight gradients (grouped over the token dimension).

``torch._grouped_mm`` runs bf16 on sm90+. Other dtypes (fp32 tests) or GPUs use the same permuted layout with one
``mm`` per expert (host sync for the group offsets) -- slower, same numbers.

Variants (``OPENK3_MOE_VARIANT`` at import, or :data:`VARIANT` / the ``variant=`` argument at call time), all with
the same semantics and the same row layout:

* ``base``: the path above -- torch planning (argsort, ~15 small launches), separate gate and up GEMMs,
  SiTU-GLU recomputed in the backward, gather-then-reduce combine.
* ``lean``: planning by three small Triton kernels + one cumsum (:class:`RowPlan`: no sort), which records the
  (token, slot) pair of each padded row (``pair_of_row``: ``n*k + j``, ``N*k`` on padding; the forward gather takes
  the token as ``pair // k``, the backward the mixture weight as ``weights[pair]``), fast-math SiTU-GLU (approximate
  fp32 division; the result is rounded to bf16 anyway), a combine that accumulates one expert row at a time, a
  combine backward that is ONE kernel over the padded rows (:func:`dy_dweights`: reads the output gradient of the
  row's token and, for the mixture-weight gradient, the row of ``y`` once, writes the weighted row gradient, zero
  on padding, and the weight gradient's dot product in fp32; ``base`` reads the output gradient in two kernels, a
  dot product and a gather; on an H200 at the ``fused_keepx`` shape below 0.195 ms against 0.229 ms for those two),
  and a backward GLU kernel that re-emits ``a`` for the down-projection weight gradient instead of a separate
  recompute pass. Gate and up stay two GEMMs.
* ``fused``: ``lean`` + gate and up as ONE grouped GEMM over ``[E, 2I, W]`` (one read of the permuted rows, one
  launch, N = 2I per GEMM); in the backward one GEMM for the input gradient (K = 2I, no add) and one 2-D x 2-D GEMM
  for both weight gradients (returned as views of its halves). The parameters stay separate ``w1``/``w3``: the
  stacked operand is a free view when ``w1`` and ``w3`` already are the two halves of one buffer, else a per-call
  ``torch.cat`` (a weight copy, kept for the backward), taken only when the layer has at least
  :data:`FUSE_MIN_ROWS_PER_EXPERT` (token, expert) pairs per expert on average (below that the copy costs more
  than the fusion saves; ``lean`` is used then).
* ``fused_keepx`` (default): ``fused`` that keeps the permuted rows of x (``P x W``) for the backward instead of
  gathering them again (more activation memory, one gather less). Measured on an H200 (bench/NOTES.md, E64 top-8
  W1024 I640, 16k tokens, fwd+bwd from cleared gradients, v4): 3.71-3.81 ms timed back to back as in a training
  step (``timeit_pipelined`` in bench/run_all.py, host launch latency hidden), 75-80 % of the dense GEMMs of the
  same FLOPs timed the same way; synchronised per call 4.00-4.11 ms, 69-70 % (v3: 4.15 ms, 66 %).

In the fused variants the gate and up weight gradients come from two grouped GEMMs writing each parameter's
contiguous gradient (:data:`SPLIT_DW13`; one ``[E, 2I, W]`` GEMM would need autograd to copy its halves out).
``openk3.modules.moe.Experts`` stores ``w1`` / ``w3`` as the two halves of one buffer, so the stacked gate|up
operand of the forward is a view, not a per-call copy.
"""

from __future__ import annotations

import os

import torch

from openk3.fast._triton import HAS_TRITON, tanh_f32, tl, triton, triton_ok
from openk3.modules.moe import gate_up_view

ALIGN = 16
VARIANTS = ("base", "lean", "fused", "fused_keepx")
VARIANT = os.environ.get("OPENK3_MOE_VARIANT", "fused_keepx")
FUSE_MIN_ROWS_PER_EXPERT = 1024
# fused variants: gate and up weight gradients as two grouped GEMMs, each writing its parameter's contiguous gradient,
# instead of one [E, 2I, W] GEMM whose two halves autograd then copies into contiguous gradients (OPENK3_MOE_SPLIT_DW=0)
SPLIT_DW13 = os.environ.get("OPENK3_MOE_SPLIT_DW", "1") != "0"


def grouped_mm_ok(dtype=torch.bfloat16) -> bool:
    if not hasattr(torch, "_grouped_mm") or not torch.cuda.is_available():
        return False
    if dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def glu_available() -> tuple[bool, str]:
    ok, why = triton_ok()
    return (True, "fused Triton SiTU-GLU / SwiGLU") if ok else (False, why)


def available() -> tuple[bool, str]:
    ok, why = triton_ok()
    if not ok:
        return False, why
    if grouped_mm_ok():
        return True, "torch._grouped_mm (bf16, sm90+) + Triton SiTU/combine"
    return True, "per-expert mm fallback (torch._grouped_mm needs bf16 on sm90+) + Triton SiTU/combine"


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels

if HAS_TRITON:

    @triton.jit
    def _glu_fwd_kernel(g_ptr, u_ptr, o_ptr, n, b1, b2, SITU: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        sg = tl.sigmoid(g)
        if SITU:
            a = (b1 * tanh_f32(g / b1)) * sg * (b2 * tanh_f32(u / b2))
        else:
            a = g * sg * u
        tl.store(o_ptr + offs, a.to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _glu_bwd_kernel(
        g_ptr, u_ptr, da_ptr, dg_ptr, du_ptr, n, b1, b2, SITU: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + offs, mask=m, other=0.0).to(tl.float32)
        sg = tl.sigmoid(g)
        if SITU:
            t1 = tanh_f32(g / b1)
            t2 = tanh_f32(u / b2)
            left = b1 * t1 * sg
            right = b2 * t2
            dleft = (1.0 - t1 * t1) * sg + b1 * t1 * sg * (1.0 - sg)
            dright = 1.0 - t2 * t2
        else:
            left = g * sg
            right = u
            dleft = sg * (1.0 + g * (1.0 - sg))
            dright = 1.0
        tl.store(dg_ptr + offs, (da * right * dleft).to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(du_ptr + offs, (da * left * dright).to(du_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gather_rows_kernel(
        src_ptr, idx_ptr, scale_ptr, out_ptr, n_src, W, HAS_SCALE: tl.constexpr, BLOCK_W: tl.constexpr
    ):
        """out[r] = src[idx[r]] * scale[r] (zero where idx[r] >= n_src)."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        cm = cols < W
        t = tl.load(idx_ptr + r).to(tl.int64)
        valid = t < n_src
        v = tl.load(src_ptr + t * W + cols, mask=cm & valid, other=0.0)
        if HAS_SCALE:
            v = v.to(tl.float32) * tl.load(scale_ptr + r)
        tl.store(out_ptr + r * W + cols, v.to(out_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _combine_kernel(
        y_ptr,
        rows_ptr,
        w_ptr,
        out_ptr,
        W,
        K: tl.constexpr,
        KP: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """out[n] = sum_j w[n, j] * y[rows[n, j]] accumulated in fp32."""
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        cm = cols < W
        j = tl.arange(0, KP)
        jm = j < K
        rows = tl.load(rows_ptr + n * K + j, mask=jm, other=0).to(tl.int64)
        y = tl.load(y_ptr + rows[:, None] * W + cols[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
        y = y.to(tl.float32)
        if HAS_W:
            wt = tl.load(w_ptr + n * K + j, mask=jm, other=0.0).to(tl.float32)
            y = y * wt[:, None]
        tl.store(out_ptr + n * W + cols, tl.sum(y, axis=0).to(out_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _combine_dw_kernel(
        dout_ptr,
        y_ptr,
        rows_ptr,
        dw_ptr,
        W: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """dw[n, j] = <dout[n], y[rows[n, j]]> in fp32."""
        n = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        jm = j < K
        rows = tl.load(rows_ptr + n * K + j, mask=jm, other=0).to(tl.int64)
        acc = tl.zeros([KP], dtype=tl.float32)
        for c0 in range(0, W, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            cm = cols < W
            d = tl.load(dout_ptr + n * W + cols, mask=cm, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + rows[:, None] * W + cols[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
            acc += tl.sum(y.to(tl.float32) * d[None, :], axis=1)
        tl.store(dw_ptr + n * K + j, acc, mask=jm)


if HAS_TRITON:
    # Kernels of the "lean" / "fused" variants (see experts_grouped): fast-math SiTU-GLU on strided [rows, I]
    # views, a combine without cross-lane reductions, and a sync-free planner (no sort).

    @triton.jit
    def _tanh_fast(x):
        """tanh in fp32 with approximate division (<= 2 ulp); odd Taylor series below |x| = 1/16 (no cancellation)."""
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        big = tl.fdiv(1.0 - e, 1.0 + e)
        x2 = x * x
        small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        return tl.where(ax < 0.0625, small, tl.where(x < 0, -big, big))

    @triton.jit
    def _sigmoid_fast(x):
        return tl.fdiv(1.0, 1.0 + tl.exp(-x))

    @triton.jit
    def _glu_fast(g, u, b1, ib1, b2, ib2, SITU: tl.constexpr):
        """act(g, u) in fp32 with the fast-math sigmoid / tanh: SiTU-GLU (betas b1, b2; ib = 1 / b) or SwiGLU."""
        sg = _sigmoid_fast(g)
        if SITU:
            a = (b1 * _tanh_fast(g * ib1)) * sg * (b2 * _tanh_fast(u * ib2))
        else:
            a = g * sg * u
        return a

    @triton.jit
    def _glu2_fwd_kernel(
        g_ptr,
        u_ptr,
        o_ptr,
        R,
        C,
        s_g,
        s_u,
        b1,
        ib1,
        b2,
        ib2,
        SITU: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
    ):
        """o[r, c] = act(g[r, c], u[r, c]); g, u: row strides s_g, s_u; o contiguous [R, C]."""
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (r < R)[:, None] & (c < C)[None, :]
        g = tl.load(g_ptr + r[:, None] * s_g + c[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r[:, None] * s_u + c[None, :], mask=m, other=0.0).to(tl.float32)
        a = _glu_fast(g, u, b1, ib1, b2, ib2, SITU)
        tl.store(o_ptr + r[:, None] * C + c[None, :], a.to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _glu2_bwd_kernel(
        g_ptr,
        u_ptr,
        da_ptr,
        dg_ptr,
        du_ptr,
        a_ptr,
        R,
        C,
        s_g,
        s_u,
        s_dg,
        s_du,
        b1,
        ib1,
        b2,
        ib2,
        SITU: tl.constexpr,
        WRITE_A: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
    ):
        """dg, du from g, u, da (da and a contiguous [R, C]); also re-emits a = act(g, u) when WRITE_A."""
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (r < R)[:, None] & (c < C)[None, :]
        g = tl.load(g_ptr + r[:, None] * s_g + c[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r[:, None] * s_u + c[None, :], mask=m, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + r[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        sg = _sigmoid_fast(g)
        if SITU:
            t1 = _tanh_fast(g * ib1)
            t2 = _tanh_fast(u * ib2)
            left = b1 * t1 * sg
            right = b2 * t2
            dleft = (1.0 - t1 * t1) * sg + left * (1.0 - sg)
            dright = 1.0 - t2 * t2
        else:
            left = g * sg
            right = u
            dleft = sg * (1.0 + g * (1.0 - sg))
            dright = 1.0
        tl.store(
            dg_ptr + r[:, None] * s_dg + c[None, :], (da * right * dleft).to(dg_ptr.dtype.element_ty), mask=m
        )
        tl.store(
            du_ptr + r[:, None] * s_du + c[None, :], (da * left * dright).to(du_ptr.dtype.element_ty), mask=m
        )
        if WRITE_A:
            tl.store(a_ptr + r[:, None] * C + c[None, :], (left * right).to(a_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _combine2_kernel(
        y_ptr,
        rows_ptr,
        w_ptr,
        out_ptr,
        W,
        s_y,
        K: tl.constexpr,
        HAS_W: tl.constexpr,
        IDENT: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """out[n] = sum_j w[n, j] * y[rows[n, j]] accumulated in fp32, one row of y at a time (no cross-lane
        reduction). IDENT: rows[n, j] = n * K + j (one row of y per pair, rows_ptr unused). A negative row (a pair
        that :class:`RowPlan` found routed to an expert id outside [0, E)) makes the token's output NaN."""
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        cm = cols < W
        acc = tl.zeros([BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(K):
            if IDENT:
                r = n * K + j
            else:
                r = tl.load(rows_ptr + n * K + j).to(tl.int64)
            v = tl.load(y_ptr + r * s_y + cols, mask=cm & (r >= 0), other=float("nan")).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + n * K + j)
            acc += v
        tl.store(out_ptr + n * W + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _plan_hist_kernel(e_ptr, hist_ptr, nk, nb, E: tl.constexpr, BLK: tl.constexpr, BE: tl.constexpr):
        """hist[e, b] = number of pairs of block b (BLK consecutive (token, slot) pairs) routed to expert e
        (one-hot compare + sum over BE experts at a time: plain loads/reductions, no histogram op). Expert-major,
        so the running count over blocks is a scan along the contiguous dimension (an outer-dimension scan of a
        [blocks, E] table took ~0.18 ms at 1024 blocks on an H200)."""
        b = tl.program_id(0)
        offs = b * BLK + tl.arange(0, BLK)
        m = offs < nk
        e = tl.load(e_ptr + offs, mask=m, other=-1).to(tl.int32)
        for e0 in range(0, E, BE):
            bins = e0 + tl.arange(0, BE)
            h = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
            tl.store(hist_ptr + bins * nb + b, h, mask=bins < E)

    @triton.jit
    def _plan_offs_kernel(
        counts_ptr,
        c_stride,
        pstart_ptr,
        offs_ptr,
        E,
        ALIGN: tl.constexpr,
        MIN_ROWS: tl.constexpr,
        EP: tl.constexpr,
    ):
        """Group sizes (count rounded up to ALIGN, at least MIN_ROWS), their ends (int32 offs) and starts."""
        e = tl.arange(0, EP)
        m = e < E
        c = tl.load(counts_ptr + e * c_stride, mask=m, other=0)
        padded = tl.maximum((c + ALIGN - 1) // ALIGN * ALIGN, MIN_ROWS)
        padded = tl.where(m, padded, 0)
        ends = tl.cumsum(padded, 0)
        tl.store(offs_ptr + e, ends.to(tl.int32), mask=m)
        tl.store(pstart_ptr + e, ends - padded, mask=m)

    @triton.jit
    def _plan_scatter_kernel(
        e_ptr,
        cum_ptr,
        hist_ptr,
        pstart_ptr,
        rows_ptr,
        pair_ptr,
        nk,
        nb,
        E,
        BLK: tl.constexpr,
    ):
        """Row of each pair = its group start + pairs of the same expert in earlier blocks + earlier in this block
        (so rows within a group follow the pair order, like a stable sort). Writes rows and pair_of_row (the flat
        (token, slot) index of each row's pair). A pair routed to an expert id outside [0, E) gets row -1 and no
        row of its own (the histogram kernel does not count it): no out-of-bounds access, and the combine turns
        its token's output into NaN."""
        b = tl.program_id(0)
        i = tl.arange(0, BLK)
        offs = b * BLK + i
        m = offs < nk
        e = tl.load(e_ptr + offs, mask=m, other=-1).to(tl.int32)
        ok = m & (e >= 0) & (e < E)
        same_before = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
        rank = tl.sum(same_before.to(tl.int32), axis=1)
        ec = tl.where(ok, e, 0)
        before = tl.load(cum_ptr + ec * nb + b, mask=ok, other=0) - tl.load(
            hist_ptr + ec * nb + b, mask=ok, other=0
        )
        row = tl.load(pstart_ptr + ec, mask=ok, other=0) + before + rank
        tl.store(rows_ptr + offs, tl.where(ok, row, -1), mask=m)
        tl.store(pair_ptr + row, offs, mask=ok)

    @triton.jit
    def _gather_pairs_kernel(src_ptr, pair_ptr, out_ptr, nk, W, K: tl.constexpr, BLOCK_W: tl.constexpr):
        """out[r] = src[pair[r] // K] (zero where pair[r] >= nk: padding)."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        cm = cols < W
        p = tl.load(pair_ptr + r)
        t = (p // K).to(tl.int64)
        v = tl.load(src_ptr + t * W + cols, mask=cm & (p < nk), other=0.0)
        tl.store(out_ptr + r * W + cols, v.to(out_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _dy_dw_kernel(
        dout_ptr,
        y_ptr,
        pair_ptr,
        w_ptr,
        dy_ptr,
        dw_ptr,
        nk,
        s_y,
        W: tl.constexpr,
        K: tl.constexpr,
        NEED_DW: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """Backward of the weighted combine, one padded row r per program, pair p = pair[r], token n = p // K:
        dy[r] = dout[n] * w[p] and (NEED_DW) dw[p] = <dout[n], y[r]> accumulated in fp32; dy[r] = 0 on padding
        (p >= nk: every load masked off, so a padding row costs only its store)."""
        r = tl.program_id(0).to(tl.int64)
        p = tl.load(pair_ptr + r)
        valid = p < nk
        n = (p // K).to(tl.int64)
        wt = tl.load(w_ptr + p, mask=valid, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_W], dtype=tl.float32)
        for c0 in range(0, W, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            cm = cols < W
            d = tl.load(dout_ptr + n * W + cols, mask=cm & valid, other=0.0).to(tl.float32)
            tl.store(dy_ptr + r * W + cols, (d * wt).to(dy_ptr.dtype.element_ty), mask=cm)
            if NEED_DW:
                yv = tl.load(y_ptr + r * s_y + cols, mask=cm & valid, other=0.0).to(tl.float32)
                acc += d * yv
        if NEED_DW:
            tl.store(dw_ptr + p, tl.sum(acc, axis=0), mask=valid)


_BLOCK = 1024


def _bw(W: int) -> int:
    return min(1024, triton.next_power_of_2(W))


def glu_fwd(g: torch.Tensor, u: torch.Tensor, act: str, b1: float, b2: float) -> torch.Tensor:
    out = torch.empty_like(g)
    n = g.numel()
    _glu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](
        g, u, out, n, float(b1), float(b2), SITU=act == "situ", BLOCK=_BLOCK
    )
    return out


def glu_bwd(g, u, da, act, b1, b2):
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    _glu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
        g, u, da.contiguous(), dg, du, n, float(b1), float(b2), SITU=act == "situ", BLOCK=_BLOCK
    )
    return dg, du


def gather_rows(src: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    P, W = idx.shape[0], src.shape[1]
    out = torch.empty(P, W, dtype=src.dtype, device=src.device)
    BW = _bw(W)
    _gather_rows_kernel[(P, triton.cdiv(W, BW))](
        src.contiguous(),
        idx,
        scale if scale is not None else idx,
        out,
        src.shape[0],
        W,
        HAS_SCALE=scale is not None,
        BLOCK_W=BW,
    )
    return out


def combine(y: torch.Tensor, rows: torch.Tensor, w: torch.Tensor | None, dtype) -> torch.Tensor:
    N, K = rows.shape
    W = y.shape[1]
    out = torch.empty(N, W, dtype=dtype, device=y.device)
    BW = min(_bw(W), 512)
    _combine_kernel[(N, triton.cdiv(W, BW))](
        y,
        rows,
        w if w is not None else rows,
        out,
        W,
        K=K,
        KP=triton.next_power_of_2(K),
        HAS_W=w is not None,
        BLOCK_W=BW,
    )
    return out


def combine_dw(dout: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    N, K = rows.shape
    W = y.shape[1]
    dw = torch.empty(N, K, dtype=torch.float32, device=y.device)
    _combine_dw_kernel[(N,)](
        dout.contiguous(), y, rows, dw, W, K=K, KP=triton.next_power_of_2(K), BLOCK_W=min(_bw(W), 256)
    )
    return dw


_GLU_BR, _GLU_BC = 16, 128


def _glu_consts(act, b1, b2):
    return dict(b1=float(b1), ib1=1.0 / float(b1), b2=float(b2), ib2=1.0 / float(b2), SITU=act == "situ")


def glu2_fwd(g: torch.Tensor, u: torch.Tensor, act: str, b1: float, b2: float) -> torch.Tensor:
    """act(g, u) for [R, C] views with unit column stride (e.g. the two halves of a [R, 2C] buffer)."""
    R, C = g.shape
    out = torch.empty(R, C, dtype=g.dtype, device=g.device)
    grid = (triton.cdiv(R, _GLU_BR), triton.cdiv(C, _GLU_BC))
    _glu2_fwd_kernel[grid](
        g, u, out, R, C, g.stride(0), u.stride(0), **_glu_consts(act, b1, b2), BR=_GLU_BR, BC=_GLU_BC
    )
    return out


def glu2_bwd(g, u, da, dg, du, act, b1, b2, want_a: bool):
    """Writes dg, du (views like g, u) from da [R, C]; returns a = act(g, u) when ``want_a`` (else None)."""
    R, C = g.shape
    da = da.contiguous()
    a = torch.empty(R, C, dtype=g.dtype, device=g.device) if want_a else None
    grid = (triton.cdiv(R, _GLU_BR), triton.cdiv(C, _GLU_BC))
    _glu2_bwd_kernel[grid](
        g,
        u,
        da,
        dg,
        du,
        a if want_a else da,
        R,
        C,
        g.stride(0),
        u.stride(0),
        dg.stride(0),
        du.stride(0),
        **_glu_consts(act, b1, b2),
        WRITE_A=want_a,
        BR=_GLU_BR,
        BC=_GLU_BC,
    )
    return a


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, act, b1, b2):
        ctx.save_for_backward(g, u)
        ctx.cfg = (act, b1, b2)
        return glu2_fwd(g, u, act, b1, b2)

    @staticmethod
    def backward(ctx, da):
        g, u = ctx.saved_tensors
        act, b1, b2 = ctx.cfg
        dg, du = torch.empty_like(g), torch.empty_like(u)
        glu2_bwd(g, u, da, dg, du, act, b1, b2, want_a=False)
        return dg, du, None, None, None


def glu_act_triton(
    gate: torch.Tensor, up: torch.Tensor, kind: str, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """The "glu" op's Triton backend: ``openk3.ops.activations.glu_act`` (SiTU-GLU or SwiGLU, fp32 math, result in
    the input dtype) as one fused kernel forward and one backward, with the fast-math tanh / sigmoid of the expert
    path. Inputs of different shapes / dtypes or other activations raise like the reference."""
    if kind not in ("situ", "silu", "swiglu"):
        raise ValueError(f"unknown activation {kind!r}; expected 'situ' or 'silu'")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"glu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
        )
    C = gate.shape[-1]
    g, u = gate.reshape(-1, C), up.reshape(-1, C)
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    if g.shape[0] == 0:
        return gate.new_empty(gate.shape)
    return _GLU.apply(g, u, kind, float(beta1), float(beta2)).view(gate.shape)


def combine2(
    y: torch.Tensor,
    rows: torch.Tensor | None,
    w: torch.Tensor | None,
    dtype,
    shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Same as :func:`combine` with a per-slot loop (fp32 accumulation); y may have a padded row stride.
    ``rows=None``: y holds one row per (token, slot) pair in order (row n * K + j), ``shape=(N, K)``."""
    N, K = rows.shape if rows is not None else shape
    W = y.shape[1]
    out = torch.empty(N, W, dtype=dtype, device=y.device)
    BW = _bw(W)
    _combine2_kernel[(N, triton.cdiv(W, BW))](
        y,
        rows if rows is not None else y,
        w if w is not None else y,
        out,
        W,
        y.stride(0),
        K=K,
        HAS_W=w is not None,
        IDENT=rows is None,
        BLOCK_W=BW,
    )
    return out


def gather_pairs(src: torch.Tensor, pair_of_row: torch.Tensor, K: int) -> torch.Tensor:
    """[P, W]: row r = src[pair_of_row[r] // K] (the token of the row's pair), zero on padding rows."""
    P, (N, W) = pair_of_row.shape[0], src.shape
    out = torch.empty(P, W, dtype=src.dtype, device=src.device)
    BW = _bw(W)
    _gather_pairs_kernel[(P, triton.cdiv(W, BW))](
        src.contiguous(), pair_of_row, out, N * K, W, K=K, BLOCK_W=BW
    )
    return out


_DYDW_MAX_BW = 1024  # chunk of W per loop step of _dy_dw_kernel (a power of 2)
# measured on an H200 at W = 1024 (bf16, 131k rows, with the weight gradient): 0.204 ms with 2 warps, 0.229 ms with
# 4, 0.300 ms with 8; the same order at chunks of 256 and 512
_DYDW_WARPS = 2


def dy_dweights(
    dout: torch.Tensor,
    y: torch.Tensor,
    pair_of_row: torch.Tensor,
    weights: torch.Tensor,
    need_dw: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of ``combine2(y, rows, weights)`` in one pass over the padded rows: ``dy`` [P, W] (dout's dtype,
    or written into ``out``): dout[token] * weight of each row, zero on padding; ``dweights`` [N, K] fp32 (None
    unless ``need_dw``): <dout[n], y[rows[n, j]]>. ``weights``: fp32 contiguous [N, K]; y may have a padded row
    stride."""
    N, K = weights.shape
    P, W = pair_of_row.shape[0], dout.shape[1]
    dout = dout.contiguous()
    dy = out if out is not None else torch.empty(P, W, dtype=dout.dtype, device=dout.device)
    # NaN-filled: a pair without a row (an expert id outside [0, E), see RowPlan) keeps NaN as its weight gradient
    dw = torch.full((N, K), float("nan"), dtype=torch.float32, device=dout.device) if need_dw else None
    _dy_dw_kernel[(P,)](
        dout,
        y,
        pair_of_row,
        weights,
        dy,
        dw if need_dw else weights,
        N * K,
        y.stride(0),
        W=W,
        K=K,
        NEED_DW=need_dw,
        BLOCK_W=min(_DYDW_MAX_BW, triton.next_power_of_2(W)),
        num_warps=_DYDW_WARPS,
    )
    return dy, dw


# ---------------------------------------------------------------------------------------------------------------
# planning and grouped GEMMs


class Plan:
    """Permutation of the N*k (token, expert) pairs into expert-sorted, padded rows."""

    def __init__(self, idx: torch.Tensor, num_experts: int, align: int = ALIGN, *, sparse: bool = False):
        N, K = idx.shape
        E = num_experts
        dev = idx.device
        flat = idx.reshape(-1)
        # scatter_add, not bincount: bincount on CUDA reads the maximum back to the host (breaks CUDA graphs)
        counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
        padded = (counts + align - 1) // align * align
        if not sparse:
            padded = torch.clamp(padded, min=align)
        ends = torch.cumsum(padded, 0)
        pstart = ends - padded
        cstart = torch.cumsum(counts, 0) - counts
        order = torch.argsort(flat, stable=True)
        e_sorted = flat[order]
        nk = N * K
        row_sorted = pstart[e_sorted] + (torch.arange(nk, device=dev) - cstart[e_sorted])
        rows = torch.empty(nk, dtype=torch.long, device=dev)
        rows[order] = row_sorted
        # static bound on the padded rows: each group adds at most align - 1 (sparse) or align (dense) rows
        self.P = nk + (align - 1) * min(E, nk) if sparse else nk + E * align
        tok = torch.full((self.P,), N, dtype=torch.long, device=dev)
        tok[rows] = torch.arange(nk, device=dev) // K
        self.rows = rows.view(N, K)  # [N, k] padded row of each (token, slot)
        self.tok_of_row = tok  # [P] source token of each padded row (N = padding)
        self.offs = ends.to(torch.int32)  # [E] cumulative group ends
        self.N, self.K, self.E = N, K, E

    def row_scale(self, weights: torch.Tensor) -> torch.Tensor:
        """[P] fp32: the mixture weight of each padded row (0 on padding)."""
        s = torch.zeros(self.P, dtype=torch.float32, device=weights.device)
        s[self.rows.reshape(-1)] = weights.reshape(-1).float()
        return s


_PLAN_BLK = 128


class RowPlan:
    """:class:`Plan`'s layout (the same rows in the same order) from three small Triton kernels and one cumsum: no
    sort, no host synchronisation, five launches. ``rows`` ([N, k]) and ``pair_of_row`` ([P]) are int32:
    ``pair_of_row[r]`` is the flat (token, slot) index ``n * k + j`` of row r's pair (so its token is
    ``pair // k`` and its mixture weight ``weights.reshape(-1)[pair]``), ``N * k`` on padding rows and on the rows
    past the last group."""

    def __init__(self, idx: torch.Tensor, num_experts: int, align: int = ALIGN, *, sparse: bool = False):
        N, K = idx.shape
        E = num_experts
        dev = idx.device
        nk = N * K
        flat = idx.reshape(-1)
        nb = triton.cdiv(nk, _PLAN_BLK)
        EP = triton.next_power_of_2(E)
        hist = torch.empty(E, nb, dtype=torch.int32, device=dev)  # expert-major: the scan runs along blocks
        _plan_hist_kernel[(nb,)](flat, hist, nk, nb, E, BLK=_PLAN_BLK, BE=min(EP, 64))
        cum = torch.cumsum(hist, 1, dtype=torch.int32)
        offs = torch.empty(E, dtype=torch.int32, device=dev)
        pstart = torch.empty(E, dtype=torch.int32, device=dev)
        _plan_offs_kernel[(1,)](
            cum[:, nb - 1], nb, pstart, offs, E, ALIGN=align, MIN_ROWS=0 if sparse else align, EP=EP
        )
        self.P = nk + (align - 1) * min(E, nk) if sparse else nk + E * align
        pair = torch.full((self.P,), nk, dtype=torch.int32, device=dev)
        rows = torch.empty(nk, dtype=torch.int32, device=dev)
        _plan_scatter_kernel[(nb,)](flat, cum, hist, pstart, rows, pair, nk, nb, E, BLK=_PLAN_BLK)
        self.rows = rows.view(N, K)
        self.pair_of_row = pair
        self.offs = offs
        self.N, self.K, self.E = N, K, E


_LAYOUTS: dict = {}


def _variants(t: torch.Tensor):
    yield "as_is", t
    yield "row", t.contiguous()
    if t.dim() == 3:
        yield "col", t.mT.contiguous().mT


def _apply(t, how):
    if how == "as_is":
        return t
    if how == "row":
        return t.contiguous()
    return t.mT.contiguous().mT


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, key: str) -> torch.Tensor:
    """torch._grouped_mm with a layout fix-up remembered per call site ``key`` (the first layout pair that the
    installed PyTorch accepts)."""
    fix = _LAYOUTS.get(key)
    if fix is not None:
        return torch._grouped_mm(_apply(a, fix[0]), _apply(b, fix[1]), offs=offs)
    err = None
    for ha, aa in _variants(a):
        for hb, bb in _variants(b):
            try:
                out = torch._grouped_mm(aa, bb, offs=offs)
            except RuntimeError as e:
                err = e
                continue
            _LAYOUTS[key] = (ha, hb)
            return out
    raise err


def _loop_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Reference semantics of torch._grouped_mm (2-D x 3-D and 2-D x 2-D), one mm per group."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # a [P, K] x b [E, K, N] -> [P, N]
        out = torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[s:t] = a[s:t] @ b[e]
        return out
    # a [M, P] x b [P, N] -> [E, M, N], grouped over P
    out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    for e, (s, t) in enumerate(zip(starts, ends)):
        if t > s:
            out[e] = a[:, s:t] @ b[s:t]
    return out


def _mm(a, b, offs, key):
    if a.dtype == torch.bfloat16 and grouped_mm_ok(a.dtype) and a.is_cuda:
        return gmm(a, b, offs, key)
    return _loop_mm(a, b, offs)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, w1, w2, w3, idx, act, b1, b2):
        # without autograd (inference) experts that got no token get no rows, so their weights are never read (what
        # decode needs); training keeps every group non-empty (zero-size groups have given wrong weight gradients
        # in some grouped-GEMM builds). A pair routed to an expert id outside [0, E) goes to expert 0 with a NaN
        # weight: its token's output is NaN (no out-of-bounds access, no host synchronisation), as on the other paths
        E = w1.shape[0]
        bad = (idx < 0) | (idx >= E)
        idx = idx.clamp(0, E - 1)
        weights = weights.masked_fill(bad, float("nan"))
        plan = Plan(idx, E, sparse=not any(ctx.needs_input_grad[:5]))
        xs = gather_rows(x, plan.tok_of_row)  # [P, W]
        h1 = _mm(xs, w1.mT, plan.offs, "x_w1")  # [P, I]
        h3 = _mm(xs, w3.mT, plan.offs, "x_w1")
        a = glu_fwd(h1, h3, act, b1, b2)
        y = _mm(a, w2.mT, plan.offs, "a_w2")  # [P, W]
        out = combine(y, plan.rows, weights, x.dtype)
        ctx.save_for_backward(x, weights, w1, w2, w3, h1, h3, y, plan.rows, plan.tok_of_row, plan.offs)
        ctx.cfg = (act, b1, b2)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weights, w1, w2, w3, h1, h3, y, rows, tok_of_row, offs = ctx.saved_tensors
        act, b1, b2 = ctx.cfg
        dout = dout.contiguous()
        P = tok_of_row.shape[0]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_w1, need_w2, need_w3 = ctx.needs_input_grad[2:5]
        dweights = combine_dw(dout, y, rows) if need_w else None
        scale = torch.zeros(P, dtype=torch.float32, device=x.device)
        scale[rows.reshape(-1)] = weights.reshape(-1).float()
        dy = gather_rows(dout, tok_of_row, scale)  # [P, W]: dout[token] * weight, zero on padding
        da = _mm(dy, w2, offs, "dy_w2")  # [P, I]
        a = glu_fwd(h1, h3, act, b1, b2) if need_w2 else None
        dw2 = _mm(dy.t(), a, offs, "dyT_a") if need_w2 else None  # [E, W, I]
        dh1, dh3 = glu_bwd(h1, h3, da, act, b1, b2)
        dx = dw1 = dw3 = None
        if need_w1 or need_w3:
            xs = gather_rows(x, tok_of_row)
            dw1 = _mm(dh1.t(), xs, offs, "dhT_x") if need_w1 else None  # [E, I, W]
            dw3 = _mm(dh3.t(), xs, offs, "dhT_x") if need_w3 else None
        if need_x:
            dxs = _mm(dh1, w1, offs, "dh_w1")
            dxs += _mm(dh3, w3, offs, "dh_w1")
            dx = combine(dxs, rows, None, x.dtype)
        return dx, dweights, dw1, dw2, dw3, None, None, None, None


def stack13(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[E, 2I, W]: gate rows then up rows of each expert (a view when possible, else one copy)."""
    v = gate_up_view(w1, w3)
    return v if v is not None else torch.cat([w1, w3], 1)


class _ExpertsV2(torch.autograd.Function):
    """The "lean" / "fused" / "fused_keepx" variants (see :func:`experts_grouped`)."""

    @staticmethod
    def forward(ctx, x, weights, w1, w2, w3, idx, act, b1, b2, fuse, keep_x):
        E, I = w1.shape[0], w1.shape[1]
        train = any(ctx.needs_input_grad[:5])
        plan = RowPlan(idx, E, sparse=not train)
        offs, K = plan.offs, plan.K
        xs = gather_pairs(x, plan.pair_of_row, K)  # [P, W]
        w13 = None
        if fuse:
            w13 = stack13(w1, w3)
            h = _mm(xs, w13.mT, offs, "v2_x_w13")  # [P, 2I]: gate | up
            g, u = h[:, :I], h[:, I:]
        else:
            g = _mm(xs, w1.mT, offs, "v2_x_w1")
            u = _mm(xs, w3.mT, offs, "v2_x_w1")
        a = glu2_fwd(g, u, act, b1, b2)
        y = _mm(a, w2.mT, offs, "v2_a_w2")  # [P, W]
        out = combine2(y, plan.rows, weights, x.dtype)
        if train:
            ctx.save_for_backward(
                xs if keep_x else x, weights, w1, w2, w3, w13, g, u, y, plan.rows, plan.pair_of_row, offs
            )
        ctx.cfg = (act, b1, b2, keep_x, I, K)
        return out

    @staticmethod
    def backward(ctx, dout):
        xk, weights, w1, w2, w3, w13, g, u, y, rows, pair, offs = ctx.saved_tensors
        act, b1, b2, keep_x, I, K = ctx.cfg
        need_x, need_w, need_w1, need_w2, need_w3 = ctx.needs_input_grad[:5]
        # one pass over the rows: dy [P, W] = dout[token] * weight (zero on padding) and, when needed, the
        # mixture-weight gradient <dout[token], y[row]>
        dy, dweights = dy_dweights(dout, y, pair, weights, need_dw=need_w)
        da = _mm(dy, w2, offs, "v2_dy_w2")  # [P, I]
        dh = torch.empty(pair.shape[0], 2 * I, dtype=g.dtype, device=g.device)  # gate | up gradients
        dg, du = dh[:, :I], dh[:, I:]
        a = glu2_bwd(g, u, da, dg, du, act, b1, b2, want_a=need_w2)  # a re-emitted here, not recomputed apart
        dw2 = _mm(dy.t(), a, offs, "v2_dyT_a") if need_w2 else None  # [E, W, I]
        dx = dw1 = dw3 = None
        if need_w1 or need_w3:
            xs = xk if keep_x else gather_pairs(xk, pair, K)
            if need_w1 and need_w3 and w13 is not None and not SPLIT_DW13:
                dw13 = _mm(dh.t(), xs, offs, "v2_dhT_x")  # [E, 2I, W]
                dw1, dw3 = dw13[:, :I], dw13[:, I:]
            else:
                dw1 = _mm(dg.t(), xs, offs, "v2_dgT_x") if need_w1 else None
                dw3 = _mm(du.t(), xs, offs, "v2_dgT_x") if need_w3 else None
        if need_x:
            if w13 is not None:
                dxs = _mm(dh, w13, offs, "v2_dh_w13")  # one GEMM over K = 2I
            else:
                dxs = _mm(dg, w1, offs, "v2_dg_w1")
                dxs += _mm(du, w3, offs, "v2_dg_w1")
            dx = combine2(dxs, rows, None, dout.dtype)
        return dx, dweights, dw1, dw2, dw3, None, None, None, None, None, None


def experts_grouped(x, idx, weights, w1, w2, w3, *, act="situ", beta1=4.0, beta2=25.0, variant=None):
    """Drop-in for ``openk3.ops.moe.experts_reference`` (see module docstring). x: [N, W] -> [N, W] (x.dtype).

    ``variant`` (default :data:`VARIANT`): one of :data:`VARIANTS`, see the module docstring. Without autograd and
    with few (token, slot) pairs per expert (a decode batch), the expert-tiled kernels of
    :mod:`openk3.fast.moe_tiled` run instead, whatever the variant, where ``moe_tiled.TILED`` allows (up to 32
    pairs per expert on average by default; ``OPENK3_MOE_TILED``). A (token, slot) routed to an expert id outside
    [0, E) makes that token's output NaN (and, with autograd, its input gradient and that slot's weight gradient),
    with no out-of-bounds access and no host synchronisation; the reference raises instead."""
    if act not in ("situ", "silu", "swiglu"):
        raise ValueError(f"unknown activation {act!r}; expected 'situ' or 'silu'")
    v = variant or VARIANT
    if v not in VARIANTS:
        raise ValueError(f"unknown MoE variant {v!r} (OPENK3_MOE_VARIANT); expected one of {VARIANTS}")
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w1, w2, w3))):
        from openk3.fast import moe_tiled

        if moe_tiled.applies(x, idx, w1.shape[0]):  # few pairs per expert, no autograd (decode batches)
            return moe_tiled.experts_tiled(x, idx, weights, w1, w2, w3, act=act, beta1=beta1, beta2=beta2)
    args = (
        x.contiguous(),
        weights.float().contiguous(),
        w1,
        w2,
        w3,
        idx.contiguous(),
        act,
        float(beta1),
        float(beta2),
    )
    if v == "base":
        return _Experts.apply(*args)
    E = w1.shape[0]
    fuse = v != "lean" and (gate_up_view(w1, w3) is not None or idx.numel() >= FUSE_MIN_ROWS_PER_EXPERT * E)
    return _ExpertsV2.apply(*args, fuse, v == "fused_keepx")
