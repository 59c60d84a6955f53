"""Two-phase Block AttnRes reader in Triton (SPEC.md §3.4), forward and backward, exact (fp32 mixing).

Phase 1 runs once per sealed set, at ``seal`` time: every read site announced for the block (up to 24 in K3) is
scored against all sealed sources in one batched pass. Per site and token it keeps the log-normaliser
``lse = max + log(sum exp(score - max))`` and the normalised numerator ``Pn = sum_i softmax_i * v_i`` (fp32 by
default; ``PARTIAL_DTYPE``) -- the online-softmax state with the max folded in.
Phase 2 runs at each read: it scores the live partial sum ``r`` and merges,
``out = lam * Pn + (1 - lam) * r`` with ``lam = sigmoid(lse - score(r))`` -- the same softmax over
``[sealed..., r]`` as the reference.

Backward: phase 2 copies its output gradient ``g`` (the output's dtype) into the block's ``[Q, N, D]`` buffer and
keeps the merge weight ``lam`` per token; the numerator gradient ``lam * g`` is formed in fp32 where it is read (the
same products the reference forms), so no fp32 ``[Q, N, D]`` gradient is written. ``d lse`` goes back through
autograd. Phase 1's backward then produces the gradients of every sealed source and of every site's folded query in
two kernels: per-(site, token) coefficients (one pass over D), then per source the source gradient and the query
gradient partials (fp32 dots over the token tiles).

Read + RMSNorm (``read_normed``, the model's default on this reader): phase 2 writes only the normed rows; its
backward recomputes the read's output from the same operands, runs the norm's backward (the output gradient,
rounded to the output dtype, goes to the block's buffer as above) and the gain-gradient partials, so neither the
read's output nor its gradient passes through memory.

The reader copies each source into one ``[capacity, N, D]`` buffer when it is sealed, so phase 1 and its backward
read the sources in place (no per-seal stack of all of them).

Kernels (all fp32 arithmetic; ``S`` sources, ``Q`` sites, ``N`` tokens, width ``D``; launch tiles in :data:`TILES`):
``_p1_scores`` [Q, N/BN] (sites fastest: the Q programs of one token tile read its sources once from memory, then
from L2), ``_p1_mix`` [N/BN, D/BD], ``_p2_fwd`` [N/BN], ``_p2_bwd`` [N/(BN*RB)], ``_p1_bwd_coef`` [Q, N/BN],
``_p1_bwd_dv`` [S, groups, D/BD]. They also run under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

import os
import weakref

import torch

from openk3.fast._triton import HAS_TRITON, INTERPRET, pdl_launch, pdl_on, sm_count, tl, triton, triton_ok
from openk3.ops.attnres.reference import attnres_read

PARTIAL_DTYPE = torch.float32
# Sealed sets of at most this many sources keep no partials: phase 2 mixes the numerator from the sources itself
# (the same fp32 sum) and writes phase 1's score gradients in its backward, which drops the mix kernel, the
# [Q, N, D] partials and the source pass of phase 1's coefficient kernel. Per read that costs 2*S bytes of sources
# per element instead of 4 of fp32 partials (OPENK3_ATTNRES_DIRECT_MAX; 0 stores partials for every set).
_dmax = os.environ.get("OPENK3_ATTNRES_DIRECT_MAX", "3")
if not _dmax.isdigit():
    raise ValueError(
        f"OPENK3_ATTNRES_DIRECT_MAX={_dmax!r}: expected a source count (0: partials for every set)"
    )
DIRECT_MAX = int(_dmax)
NBG = 16  # token blocks per program in the source-gradient kernel (query gradients are reduced over these groups)
# the source-gradient kernel's two small fp32 products ([tokens, sites] x [sites, columns] and its transpose):
# "fma" (the first as one outer product per site instead of a dot over sites padded to 16, the second an fp32 FMA
# dot), "ieee" (both fp32 FMA dots) or "tf32x3" (tensor cores, three TF32 products per fp32 product: about fp32's
# rounding error). With the site loop below, "fma" 1.12 ms per 6-source set against 1.24 ("ieee"; 1.36 unrolled)
# at N=16384 D=2048 Q=8 on an H200, bench/NOTES.md v12 (OPENK3_ATTNRES_DOT)
DV_DOT = os.environ.get("OPENK3_ATTNRES_DOT", "fma")
if DV_DOT not in ("ieee", "tf32x3", "fma"):
    raise ValueError(f"OPENK3_ATTNRES_DOT={DV_DOT!r}: expected 'ieee', 'tf32x3' or 'fma'")
# the source-gradient kernel's loop over the sites of a token tile: 0 unrolls it (every site's tile load issued
# together: ~250 registers, two programs per SM), n >= 1 a loop with n tiles in flight (1: 96 registers, five
# programs per SM) (OPENK3_ATTNRES_DV_STAGES)
_dvs = os.environ.get("OPENK3_ATTNRES_DV_STAGES", "1")
if not _dvs.isdigit():
    raise ValueError(f"OPENK3_ATTNRES_DV_STAGES={_dvs!r}: expected 0 (unrolled) or a stage count")
DV_STAGES = int(_dvs)
# tokens per program of the one-pass normed phase-2 backward (its gain- and query-gradient partials are summed over
# them in registers; fewer programs, fewer partial rows to reduce afterwards), halved while that leaves fewer than
# two programs per SM. 16: the two [N/16, D] column sums of each read take 0.69 ms of a medium step; at 64 (halved
# to 32 there) torch's column sums of the [N/32, D] partials took 0.42 ms more, bench/NOTES.md v12
# (OPENK3_ATTNRES_P2_ROWS)
_rows = os.environ.get("OPENK3_ATTNRES_P2_ROWS", "16")
if not _rows.isdigit() or int(_rows) < 1:
    raise ValueError(f"OPENK3_ATTNRES_P2_ROWS={_rows!r}: expected a positive token count")
P2_NORM_ROWS = int(_rows)
# the one-pass normed backward holds the rows of at most this many sources in registers (direct sets with more take
# the column-tiled form)
ONE_PASS_MAX_SOURCES = 3
# Phase 1 of at most FEW_TOKENS tokens (a decode step) scores them in one [tokens, columns] tile of at most
# FEW_TILE_VALUES values per source: with the training tile (32 x 64) a batch-1 seal walked a 2048-wide row in 32
# dependent steps (21.5 us per seal on an H200, 4 seals per `medium` step).
FEW_TOKENS = 16
FEW_TILE_VALUES = 4096


def available() -> tuple[bool, str]:
    ok, why = triton_ok()
    return (True, "two-phase Triton reader (fp32 partials)") if ok else (False, why)


if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait

    @triton.jit
    def _p1_scores(
        v_ptr, w_ptr, p_ptr, lse_ptr, inv_ptr, s_ptr, N, eps,
        S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
        STORE_S: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        pdl_trigger(PDL)
        q = tl.program_id(0)  # sites vary fastest: the Q programs of one token tile share its sources in L2
        pid_n = tl.program_id(1)
        n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        cols = tl.arange(0, SP)
        dots = tl.zeros([BN, SP], dtype=tl.float32)
        sqs = tl.zeros([BN, SP], dtype=tl.float32)
        for d0 in tl.range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            w = tl.load(w_ptr + q * D + d, mask=dm, other=0.0)
            for i in tl.static_range(S):
                v = tl.load(
                    v_ptr + i * N * D + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0
                )
                v = v.to(tl.float32)
                sel = cols[None, :] == i
                dots = tl.where(sel, dots + tl.sum(v * w[None, :], axis=1)[:, None], dots)
                sqs = tl.where(sel, sqs + tl.sum(v * v, axis=1)[:, None], sqs)
        valid = cols[None, :] < S
        inv = tl.rsqrt(sqs / D + eps)
        s = tl.where(valid, dots * inv, float("-inf"))
        m = tl.max(s, axis=1)
        e = tl.where(valid, tl.exp(s - m[:, None]), 0.0)
        z = tl.sum(e, axis=1)
        p = e / z[:, None]
        tl.store(lse_ptr + q * N + n, m + tl.log(z), mask=nm)
        pm = nm[:, None] & valid
        tl.store(p_ptr + q * S * N + cols[None, :] * N + n[:, None], p, mask=pm)
        tl.store(inv_ptr + cols[None, :] * N + n[:, None], inv, mask=pm & (q == 0))
        if STORE_S:
            tl.store(s_ptr + q * S * N + cols[None, :] * N + n[:, None], s, mask=pm)

    @triton.jit
    def _pn_tile(
        v_ptr, p_ptr, pn_ptr, n, d, m2, N,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, S: tl.constexpr, DIRECT: tl.constexpr,
    ):  # fmt: skip
        """The normalised numerator of the sealed sources at rows n, columns d (fp32): read from the stored
        partials, or (DIRECT) mixed here from the sources with the site's phase-1 weights p [S, N]."""
        if DIRECT:
            pn = tl.zeros([BN, BD], dtype=tl.float32)
            for i in tl.static_range(S):
                pi = tl.load(p_ptr + i * N + n, mask=n < N, other=0.0)
                v = tl.load(v_ptr + i * N * D + n[:, None] * D + d[None, :], mask=m2, other=0.0)
                pn += pi[:, None] * v.to(tl.float32)
        else:
            pn = tl.load(pn_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        return pn

    @triton.jit
    def _p1_mix(
        v_ptr, p_ptr, o_ptr, N,
        S: tl.constexpr, SP: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        pdl_trigger(PDL)
        n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        nm = n < N
        dm = d < D
        i = tl.arange(0, SP)
        im = i < S
        m3 = im[:, None, None] & nm[None, :, None] & dm[None, None, :]
        v = tl.load(
            v_ptr + i[:, None, None] * N * D + n[None, :, None] * D + d[None, None, :], mask=m3, other=0.0
        )
        v = v.to(tl.float32)
        for q in tl.range(0, Q):
            p = tl.load(
                p_ptr + q * S * N + i[:, None] * N + n[None, :], mask=im[:, None] & nm[None, :], other=0.0
            )
            o = tl.sum(p[:, :, None] * v, axis=0)
            tl.store(
                o_ptr + q * N * D + n[:, None] * D + d[None, :],
                o.to(o_ptr.dtype.element_ty),
                mask=nm[:, None] & dm[None, :],
            )

    @triton.jit
    def _h_tile(lam, pn, r, ref_ptr):
        """The read's output rows as they would be stored (rounded to ``ref_ptr``'s dtype, the output's), fp32."""
        return (lam[:, None] * pn + (1.0 - lam[:, None]) * r).to(ref_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _out_tile(
        out_ptr, r_ptr, v_ptr, pp_ptr, pn_ptr, lam, n, d, m2, N,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, S: tl.constexpr, DIRECT: tl.constexpr,
        STORED: tl.constexpr,
    ):  # fmt: skip
        """One tile of the read's output (fp32): loaded from ``out`` (STORED) or recomputed from its operands."""
        if STORED:
            h = tl.load(out_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        else:
            r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            h = _h_tile(lam, _pn_tile(v_ptr, pp_ptr, pn_ptr, n, d, m2, N, D, BN, BD, S, DIRECT), r, out_ptr)
        return h

    @triton.jit
    def _p2_fwd_one(
        r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, lse_ptr, out_ptr, s_ptr, inv_ptr, N, eps, g_ptr, x_ptr, neps, n, nm,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, S: tl.constexpr, DIRECT: tl.constexpr,
        NORM: tl.constexpr, STORE_OUT: tl.constexpr,
    ):  # fmt: skip
        """:func:`_p2_fwd` with the whole row in one tile: the same values, every load issued before the math."""
        d = tl.arange(0, BD)
        dm = d < D
        m2 = nm[:, None] & dm[None, :]
        r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=dm, other=0.0)
        pn = _pn_tile(v_ptr, pp_ptr, pn_ptr, n, d, m2, N, D, BN, BD, S, DIRECT)
        lse = tl.load(lse_ptr + n, mask=nm, other=0.0)
        inv = tl.rsqrt(tl.sum(r * r, axis=1) / D + eps)
        s = tl.sum(r * w[None, :], axis=1) * inv
        lam = tl.sigmoid(lse - s)
        tl.store(s_ptr + n, s, mask=nm)
        tl.store(inv_ptr + n, inv, mask=nm)
        h = _h_tile(lam, pn, r, out_ptr)  # the output as stored
        if STORE_OUT:
            tl.store(out_ptr + n[:, None] * D + d[None, :], h.to(out_ptr.dtype.element_ty), mask=m2)
        if NORM:
            dt = x_ptr.dtype.element_ty
            g = tl.load(g_ptr + d, mask=dm, other=0.0).to(dt).to(tl.float32)
            hinv = tl.rsqrt(tl.sum(h * h, axis=1) / D + neps)
            y = (h * hinv[:, None]).to(dt).to(tl.float32)
            tl.store(x_ptr + n[:, None] * D + d[None, :], (g[None, :] * y).to(dt), mask=m2)

    @triton.jit
    def _p2_fwd(
        r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, lse_ptr, out_ptr, s_ptr, inv_ptr, N, eps, g_ptr, x_ptr, neps,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, S: tl.constexpr, DIRECT: tl.constexpr,
        NORM: tl.constexpr, PDL: tl.constexpr, STORE_OUT: tl.constexpr = True, ONE: tl.constexpr = False,
    ):  # fmt: skip
        """Phase 2 of one read for BN tokens. ``ONE`` (decode: few tokens, ``BD >= D``): the whole row is one tile,
        every operand is requested up front and the output and its norm are formed in registers (one memory
        latency instead of one per pass over the row). ``NORM``: also the RMSNorm of the output (gain ``g``, eps ``neps``) into
        ``x``, as ``openk3.ops.norm.rms_norm`` computes it from the stored output (fp32 mean of squares, the
        normalised value rounded to the output dtype before the gain, the product rounded again). ``NORM`` without
        ``STORE_OUT`` (training): the output is not stored; the norm is taken of the output recomputed in registers,
        rounded to the output dtype as it would have been stored, and only ``x`` is written."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        if ONE:
            _p2_fwd_one(
                r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, lse_ptr, out_ptr, s_ptr, inv_ptr, N, eps, g_ptr, x_ptr, neps,
                n, nm, D, BN, BD, S, DIRECT, NORM, STORE_OUT,
            )  # fmt: skip
            return
        dot = tl.zeros([BN], dtype=tl.float32)
        sq = tl.zeros([BN], dtype=tl.float32)
        for d0 in tl.range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            m2 = nm[:, None] & dm[None, :]
            r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + d, mask=dm, other=0.0)
            dot += tl.sum(r * w[None, :], axis=1)
            sq += tl.sum(r * r, axis=1)
        inv = tl.rsqrt(sq / D + eps)
        s = dot * inv
        lam = tl.sigmoid(tl.load(lse_ptr + n, mask=nm, other=0.0) - s)
        tl.store(s_ptr + n, s, mask=nm)
        tl.store(inv_ptr + n, inv, mask=nm)
        if STORE_OUT:
            for d0 in tl.range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                dm = d < D
                m2 = nm[:, None] & dm[None, :]
                r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
                pn = _pn_tile(v_ptr, pp_ptr, pn_ptr, n, d, m2, N, D, BN, BD, S, DIRECT)
                o = lam[:, None] * pn + (1.0 - lam[:, None]) * r
                tl.store(out_ptr + n[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=m2)
        # the RMSNorm of the output rows: re-read as stored (other threads of this program wrote part of them), or
        # without STORE_OUT recomputed in registers
        if NORM:
            if STORE_OUT:
                tl.debug_barrier()
            hs = tl.zeros([BN], dtype=tl.float32)
            for d0 in tl.range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                m2 = nm[:, None] & (d < D)[None, :]
                h = _out_tile(
                    out_ptr, r_ptr, v_ptr, pp_ptr, pn_ptr, lam, n, d, m2, N, D, BN, BD, S, DIRECT, STORE_OUT
                )
                hs += tl.sum(h * h, axis=1)
            hinv = tl.rsqrt(hs / D + neps)
            dt = x_ptr.dtype.element_ty
            for d0 in tl.range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                dm = d < D
                m2 = nm[:, None] & dm[None, :]
                h = _out_tile(
                    out_ptr, r_ptr, v_ptr, pp_ptr, pn_ptr, lam, n, d, m2, N, D, BN, BD, S, DIRECT, STORE_OUT
                )
                y = (h * hinv[:, None]).to(dt).to(tl.float32)
                g = tl.load(g_ptr + d, mask=dm, other=0.0).to(dt).to(tl.float32)
                tl.store(x_ptr + n[:, None] * D + d[None, :], (g[None, :] * y).to(dt), mask=m2)

    @triton.jit
    def _acc_row(ptr, pid, d, dm, rb, val, D: tl.constexpr):
        """``ptr[pid, d] += val``: the program's own row of a per-program partial (its first block writes it)."""
        prev = tl.load(ptr + pid * D + d, mask=dm & (rb > 0), other=0.0)
        tl.store(ptr + pid * D + d, prev + val, mask=dm)

    @triton.jit
    def _norm_bwd_tile(dy, h, gn, hinv, hk, g_ptr, n, d, m2, D: tl.constexpr):
        """The RMSNorm's backward for one tile: (the output gradient, rounded to the output dtype and stored into g,
        in fp32; the tile's gain-gradient partial, summed over its tokens)."""
        dt = g_ptr.dtype.element_ty
        y = (h * hinv[:, None]).to(dt).to(tl.float32)
        g = (hinv[:, None] * gn[None, :] * dy - hk[:, None] * h).to(dt)
        tl.store(g_ptr + n[:, None] * D + d[None, :], g, mask=m2)
        return g.to(tl.float32), tl.sum(dy * y, axis=0)

    @triton.jit
    def _dps_tile(v_ptr, n, d, m2, N, g, dps, cols, D: tl.constexpr, S: tl.constexpr):
        """``dps[:, i] += v_i . g`` over one tile, for every source i."""
        for i in tl.static_range(S):
            v = tl.load(v_ptr + i * N * D + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            dps = tl.where(cols[None, :] == i, dps + tl.sum(v * g, axis=1)[:, None], dps)
        return dps

    @triton.jit
    def _dr_tile(g, r, lam, c_w, c_r, w, dr_ptr, n, d, m2, D: tl.constexpr):
        """The live sum's gradient for one tile (stored); returns the tile's query-gradient partial."""
        dr = (1.0 - lam[:, None]) * g + c_w[:, None] * w[None, :] - c_r[:, None] * r
        tl.store(dr_ptr + n[:, None] * D + d[None, :], dr.to(dr_ptr.dtype.element_ty), mask=m2)
        return tl.sum(c_w[:, None] * r, axis=0)

    @triton.jit
    def _p2_bwd(
        dout_ptr, r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, dps_ptr, lse_ptr, s_ptr, inv_ptr, dr_ptr, g_ptr, lam_ptr,
        dl_ptr, dwp_ptr, N, gn_ptr, dgp_ptr, neps,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr,
        S: tl.constexpr, SP: tl.constexpr, DIRECT: tl.constexpr, NORM: tl.constexpr = False,
        ONE_PASS: tl.constexpr = False,
    ):  # fmt: skip
        """RB blocks of BN tokens per program; the query-gradient partial of the program's tokens goes to one row
        of dwp (accumulated there across the blocks: the program owns that row). DIRECT: the numerator is mixed
        from the sources here, and the site's phase-1 score gradients ``dps[i] = v_i . (lam * dout)`` are written
        on the way (phase 1's backward then needs no pass over the sources for them). NORM: ``dout`` is the gradient
        of the read's RMSNorm (gain ``gn``, eps ``neps``; forward ``_p2_fwd`` with NORM and without STORE_OUT); the
        read's output is recomputed, the norm's backward gives the output gradient (rounded to the output dtype, as
        a stored gradient would be) and the gain-gradient partial of the program's tokens goes to one row of dgp."""
        pid = tl.program_id(0)
        if ONE_PASS:  # NORM, whole rows in registers, the next block's loads ahead (see _p2_backward)
            _p2_bwd_norm_rows(
                dout_ptr, r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, dps_ptr, lse_ptr, s_ptr, inv_ptr, dr_ptr, g_ptr,
                lam_ptr, dl_ptr, dwp_ptr, N, pid, gn_ptr, dgp_ptr, neps, D, BN, BD, RB, S, SP, DIRECT,
            )  # fmt: skip
        else:
            for rb in tl.range(0, RB):
                _p2_bwd_rows(
                    dout_ptr, r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, dps_ptr, lse_ptr, s_ptr, inv_ptr, dr_ptr, g_ptr,
                    lam_ptr, dl_ptr, dwp_ptr, N, pid, rb, gn_ptr, dgp_ptr, neps, D, BN, BD, RB, S, SP, DIRECT, NORM,
                )  # fmt: skip

    @triton.jit
    def _src_rows(v_ptr, pp_ptr, i: tl.constexpr, n, nm, d, m2, N, D: tl.constexpr, S: tl.constexpr):
        """Source i's rows n (as stored) and their phase-1 weights (fp32); zeros for i >= S."""
        if i < S:
            p = tl.load(pp_ptr + i * N + n, mask=nm, other=0.0)
            v = tl.load(v_ptr + i * N * D + n[:, None] * D + d[None, :], mask=m2, other=0.0)
        else:
            p = tl.zeros(n.shape, dtype=tl.float32)
            v = tl.zeros(m2.shape, dtype=v_ptr.dtype.element_ty)
        return p, v

    @triton.jit
    def _row_operands(s_ptr, inv_ptr, lse_ptr, dout_ptr, r_ptr, n, nm, d, m2, D: tl.constexpr):
        """Rows n's phase-2 statistics (score, inverse rms, lse) and their dy and live-sum rows, as stored."""
        s = tl.load(s_ptr + n, mask=nm, other=0.0)
        inv = tl.load(inv_ptr + n, mask=nm, other=0.0)
        lse = tl.load(lse_ptr + n, mask=nm, other=0.0)
        dy = tl.load(dout_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0)
        r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0)
        return s, inv, lse, dy, r

    @triton.jit
    def _row_sums2(a, b):
        """Row sums of two [BN, BD] tiles in one reduction (one exchange between warps instead of two)."""
        return tl.split(tl.sum(tl.join(a, b), axis=1))

    @triton.jit
    def _row_sums4(a, b, c, e):
        """Row sums of four [BN, BD] tiles in one reduction."""
        ab, ce = tl.split(tl.sum(tl.join(tl.join(a, b), tl.join(c, e)), axis=1))  # join adds the last dim
        sa, sb = tl.split(ab)
        sc, se = tl.split(ce)
        return sa, sb, sc, se

    @triton.jit
    def _p2_bwd_norm_rows(
        dout_ptr, r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, dps_ptr, lse_ptr, s_ptr, inv_ptr, dr_ptr, g_ptr, lam_ptr,
        dl_ptr, dwp_ptr, N, pid, gn_ptr, dgp_ptr, neps,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr,
        S: tl.constexpr, SP: tl.constexpr, DIRECT: tl.constexpr,
    ):  # fmt: skip
        """``_p2_bwd_rows`` with NORM for rows that fit one tile (BD >= D; DIRECT sets of at most 3 sources): the
        same arithmetic in one pass. A block's row reductions are a dependent chain (the norm's statistics, then
        the merge-weight and score gradients), so: every operand of the program's next block of rows is loaded
        before this block's reductions, the independent row sums of each step share one reduction, and the gain-
        and query-gradient partials are summed in registers over the program's blocks and stored once."""
        d = tl.arange(0, BD)
        dm = d < D
        dt = g_ptr.dtype.element_ty
        dg_acc = tl.zeros([BD], dtype=tl.float32)
        dw_acc = tl.zeros([BD], dtype=tl.float32)
        n = (pid * RB * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        m2 = nm[:, None] & dm[None, :]
        # the first block's operands, as stored (converted where they are used)
        s, inv, lse, dy, r = _row_operands(s_ptr, inv_ptr, lse_ptr, dout_ptr, r_ptr, n, nm, d, m2, D)
        if DIRECT:
            p0, v0 = _src_rows(v_ptr, pp_ptr, 0, n, nm, d, m2, N, D, S)
            p1, v1 = _src_rows(v_ptr, pp_ptr, 1, n, nm, d, m2, N, D, S)
            p2, v2 = _src_rows(v_ptr, pp_ptr, 2, n, nm, d, m2, N, D, S)
        else:
            pn = tl.load(pn_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0)
        for rb in tl.range(0, RB):
            # the next block's loads (masked off after the program's last block)
            n1 = n + BN
            nm1 = (n1 < N) & (rb + 1 < RB)
            m21 = nm1[:, None] & dm[None, :]
            s1, inv1, lse1, dy1, r1 = _row_operands(
                s_ptr, inv_ptr, lse_ptr, dout_ptr, r_ptr, n1, nm1, d, m21, D
            )
            if DIRECT:
                q0, u0 = _src_rows(v_ptr, pp_ptr, 0, n1, nm1, d, m21, N, D, S)
                q1, u1 = _src_rows(v_ptr, pp_ptr, 1, n1, nm1, d, m21, N, D, S)
                q2, u2 = _src_rows(v_ptr, pp_ptr, 2, n1, nm1, d, m21, N, D, S)
                # the numerator in the order _pn_tile sums it (fp32, sources in order)
                pnf = p0[:, None] * v0.to(tl.float32)
                if S > 1:
                    pnf += p1[:, None] * v1.to(tl.float32)
                if S > 2:
                    pnf += p2[:, None] * v2.to(tl.float32)
            else:
                pn1 = tl.load(pn_ptr + n1[:, None] * D + d[None, :], mask=m21, other=0.0)
                pnf = pn.to(tl.float32)
            dyf = dy.to(tl.float32)
            rf = r.to(tl.float32)
            lam = tl.sigmoid(lse - s)
            h = _h_tile(lam, pnf, rf, g_ptr)
            gn = tl.load(gn_ptr + d, mask=dm, other=0.0).to(dt).to(tl.float32)  # from L1 (fewer registers)
            hs, hc = _row_sums2(h * h, dyf * gn[None, :] * h)
            hinv = tl.rsqrt(hs / D + neps)
            hk = hinv * hinv * hinv * hc / D
            g, dg = _norm_bwd_tile(dyf, h, gn, hinv, hk, g_ptr, n, d, m2, D)
            dg_acc += dg
            if DIRECT:  # the merge-weight gradient and the score gradients v_i . g in one reduction
                dl, c0, c1, c2 = _row_sums4(g * (pnf - rf), v0.to(tl.float32) * g, v1.to(tl.float32) * g,
                                            v2.to(tl.float32) * g)  # fmt: skip
                cols = tl.arange(0, SP)
                dps = tl.where(
                    cols[None, :] == 0, c0[:, None], tl.where(cols[None, :] == 1, c1[:, None], c2[:, None])
                )
                dpm = nm[:, None] & (cols[None, :] < S)
                tl.store(dps_ptr + cols[None, :] * N + n[:, None], dps * lam[:, None], mask=dpm)
            else:
                dl = tl.sum(g * (pnf - rf), axis=1)
            gl = dl * lam * (1.0 - lam)  # d lse; d score(r) = -gl
            tl.store(dl_ptr + n, gl, mask=nm)
            tl.store(lam_ptr + n, lam, mask=nm)
            ds = -gl
            w = tl.load(w_ptr + d, mask=dm, other=0.0)
            dw_acc += _dr_tile(g, rf, lam, ds * inv, ds * s * inv * inv / D, w, dr_ptr, n, d, m2, D)
            n, nm, m2, s, inv, lse, dy, r = n1, nm1, m21, s1, inv1, lse1, dy1, r1
            if DIRECT:
                p0, v0, p1, v1, p2, v2 = q0, u0, q1, u1, q2, u2
            else:
                pn = pn1
        tl.store(dgp_ptr + pid * D + d, dg_acc, mask=dm)
        tl.store(dwp_ptr + pid * D + d, dw_acc, mask=dm)

    @triton.jit
    def _p2_bwd_rows(
        dout_ptr, r_ptr, w_ptr, pn_ptr, v_ptr, pp_ptr, dps_ptr, lse_ptr, s_ptr, inv_ptr, dr_ptr, g_ptr, lam_ptr,
        dl_ptr, dwp_ptr, N, pid, rb, gn_ptr, dgp_ptr, neps,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr,
        S: tl.constexpr, SP: tl.constexpr, DIRECT: tl.constexpr, NORM: tl.constexpr,
    ):  # fmt: skip
        n = ((pid * RB + rb) * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        s = tl.load(s_ptr + n, mask=nm, other=0.0)
        inv = tl.load(inv_ptr + n, mask=nm, other=0.0)
        lam = tl.sigmoid(tl.load(lse_ptr + n, mask=nm, other=0.0) - s)
        dt = g_ptr.dtype.element_ty
        if NORM:  # the recomputed output h's mean of squares and sum(dy * gain * h), per token
            hs = tl.zeros([BN], dtype=tl.float32)
            hc = tl.zeros([BN], dtype=tl.float32)
            for d0 in tl.range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                dm = d < D
                m2 = nm[:, None] & dm[None, :]
                dy = tl.load(dout_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
                h = _out_tile(
                    g_ptr, r_ptr, v_ptr, pp_ptr, pn_ptr, lam, n, d, m2, N, D, BN, BD, S, DIRECT, False
                )
                gn = tl.load(gn_ptr + d, mask=dm, other=0.0).to(dt).to(tl.float32)
                hs += tl.sum(h * h, axis=1)
                hc += tl.sum(dy * gn[None, :] * h, axis=1)
            hinv = tl.rsqrt(hs / D + neps)
            hk = hinv * hinv * hinv * hc / D
        dl = tl.zeros([BN], dtype=tl.float32)
        cols = tl.arange(0, SP)
        dps = tl.zeros([BN, SP], dtype=tl.float32)
        for d0 in tl.range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            m2 = nm[:, None] & dm[None, :]
            g = tl.load(dout_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            if DIRECT:
                pn = tl.zeros([BN, BD], dtype=tl.float32)
                for i in tl.static_range(S):
                    pi = tl.load(pp_ptr + i * N + n, mask=nm, other=0.0)
                    v = tl.load(v_ptr + i * N * D + n[:, None] * D + d[None, :], mask=m2, other=0.0)
                    v = v.to(tl.float32)
                    pn += pi[:, None] * v
                    if not NORM:
                        dps = tl.where(cols[None, :] == i, dps + tl.sum(v * g, axis=1)[:, None], dps)
            else:
                pn = tl.load(pn_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            if NORM:  # g: dy here; the output gradient from the norm's backward, stored for phase 1 and below
                gn = tl.load(gn_ptr + d, mask=dm, other=0.0).to(dt).to(tl.float32)
                h = _h_tile(lam, pn, r, g_ptr)
                g, dg = _norm_bwd_tile(g, h, gn, hinv, hk, g_ptr, n, d, m2, D)
                _acc_row(dgp_ptr, pid, d, dm, rb, dg, D)
                if DIRECT:  # the score gradients need the output gradient: a second pass over the sources
                    dps = _dps_tile(v_ptr, n, d, m2, N, g, dps, cols, D, S)
            dl += tl.sum(g * (pn - r), axis=1)
        gl = dl * lam * (1.0 - lam)  # d lse; d score(r) = -gl
        tl.store(dl_ptr + n, gl, mask=nm)
        tl.store(lam_ptr + n, lam, mask=nm)
        if DIRECT:
            dpm = nm[:, None] & (cols[None, :] < S)
            tl.store(dps_ptr + cols[None, :] * N + n[:, None], dps * lam[:, None], mask=dpm)
        ds = -gl
        c_r = ds * s * inv * inv / D
        c_w = ds * inv
        if NORM:  # the output gradient rows just stored (other threads of this program wrote part of them)
            tl.debug_barrier()
        for d0 in tl.range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            m2 = nm[:, None] & dm[None, :]
            if NORM:
                g = tl.load(g_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            else:
                g = tl.load(dout_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
                tl.store(g_ptr + n[:, None] * D + d[None, :], g.to(dt), mask=m2)
            r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + d, mask=dm, other=0.0)
            _acc_row(dwp_ptr, pid, d, dm, rb, _dr_tile(g, r, lam, c_w, c_r, w, dr_ptr, n, d, m2, D), D)

    @triton.jit
    def _p1_bwd_coef(
        v_ptr, w_ptr, lse_ptr, g_ptr, lam_ptr, dl_ptr, pc_ptr, dc_ptr, ac_ptr, inv_ptr, N, eps,
        S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        q = tl.program_id(0)  # sites vary fastest: the Q programs of one token tile share its sources in L2
        pid_n = tl.program_id(1)
        n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        cols = tl.arange(0, SP)
        dots = tl.zeros([BN, SP], dtype=tl.float32)
        sqs = tl.zeros([BN, SP], dtype=tl.float32)
        dps = tl.zeros([BN, SP], dtype=tl.float32)
        lam = tl.load(lam_ptr + q * N + n, mask=nm, other=0.0)
        for d0 in tl.range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            m2 = nm[:, None] & dm[None, :]
            w = tl.load(w_ptr + q * D + d, mask=dm, other=0.0)
            g = tl.load(g_ptr + q * N * D + n[:, None] * D + d[None, :], mask=m2, other=0.0)
            g = g.to(tl.float32) * lam[:, None]  # the numerator gradient lam * dout, as phase 2 defines it
            for i in tl.static_range(S):
                v = tl.load(v_ptr + i * N * D + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(
                    tl.float32
                )
                sel = cols[None, :] == i
                dots = tl.where(sel, dots + tl.sum(v * w[None, :], axis=1)[:, None], dots)
                sqs = tl.where(sel, sqs + tl.sum(v * v, axis=1)[:, None], sqs)
                dps = tl.where(sel, dps + tl.sum(v * g, axis=1)[:, None], dps)
        valid = cols[None, :] < S
        inv = tl.rsqrt(sqs / D + eps)
        s = dots * inv
        lse = tl.load(lse_ptr + q * N + n, mask=nm, other=0.0)
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        pdp = tl.sum(p * dps, axis=1)
        dlq = tl.load(dl_ptr + q * N + n, mask=nm, other=0.0)
        ds = p * (dps - pdp[:, None] + dlq[:, None])
        pm = nm[:, None] & valid
        off = q * S * N + cols[None, :] * N + n[:, None]
        tl.store(pc_ptr + off, p, mask=pm)
        tl.store(dc_ptr + off, ds * inv, mask=pm)
        tl.store(ac_ptr + off, ds * s, mask=pm)
        tl.store(inv_ptr + cols[None, :] * N + n[:, None], inv, mask=pm & (q == 0))

    @triton.jit
    def _dv_site(acc, q, lam_ptr, pc_ptr, g_ptr, dc_ptr, w_ptr, i, n0, nl, nm, loc, m2, d, dm,
                 N, S: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
        """Site q's terms of a source-gradient tile: pc[q,i] lam_q g_q, and with PREC "fma" dc[q,i] w_q."""
        lam = tl.load(lam_ptr + (q * N + n0) + nl, mask=nm, other=0.0)
        pcq = tl.load(pc_ptr + ((q * S + i) * N + n0) + nl, mask=nm, other=0.0)
        gq = tl.load(g_ptr + (q * N + n0) * D + loc, mask=m2, other=0.0)
        acc += (pcq * lam)[:, None] * gq.to(tl.float32)
        if PREC == "fma":
            dcq = tl.load(dc_ptr + ((q * S + i) * N + n0) + nl, mask=nm, other=0.0)
            wq = tl.load(w_ptr + q * D + d, mask=dm, other=0.0)
            acc += dcq[:, None] * wq[None, :]
        return acc

    @triton.jit
    def _p1_bwd_dv(
        v_ptr, w_ptr, g_ptr, lam_ptr, pc_ptr, dc_ptr, ac_ptr, inv_ptr, dv_ptr, dwp_ptr, N,
        S: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr, D: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr, NB: tl.constexpr, PREC: tl.constexpr = "ieee", QSTAGES: tl.constexpr = 0,
    ):  # fmt: skip
        """Gradient of source i over NB token tiles x BD columns (grid [S, groups, D/BD], sources fastest so the S
        programs of a tile share the site gradients in L2):
        dv_i = sum_q pc[q,i] * lam_q g_q + dc_i @ W - (sum_q ac[q,i]) inv_i^2 / D * v_i, and the query-gradient
        partial dc_i^T @ v_i ([QP, BD], one fp32 dot per tile) summed over this program's tiles."""
        i = tl.program_id(0)
        grp = tl.program_id(1)
        d = tl.program_id(2) * BD + tl.arange(0, BD)
        dm = d < D
        qs = tl.arange(0, QP)
        qm = qs < Q
        wt = tl.load(w_ptr + qs[:, None] * D + d[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
        dw = tl.zeros([QP, BD], dtype=tl.float32)
        nl = tl.arange(0, BN)
        loc = nl[:, None] * D + d[None, :]  # int32 offsets within a tile; the tile's base is an int64 scalar
        for tb in tl.range(0, NB):
            n0 = ((grp * NB + tb) * BN).to(tl.int64)
            nm = nl < N - n0
            m2 = nm[:, None] & dm[None, :]
            v = tl.load(v_ptr + (i * N + n0) * D + loc, mask=m2, other=0.0).to(tl.float32)
            inv = tl.load(inv_ptr + i * N + n0 + nl, mask=nm, other=0.0)
            cm = nm[:, None] & qm[None, :]
            off = qs[None, :] * (S * N) + nl[:, None]  # [BN, QP] from the tile's base i * N + n0
            dc = tl.load(dc_ptr + (i * N + n0) + off, mask=cm, other=0.0)
            asum = tl.sum(tl.load(ac_ptr + (i * N + n0) + off, mask=cm, other=0.0), axis=1)
            if PREC == "fma":  # the W-term as Q outer products (the dot pads the sites to QP)
                acc = tl.zeros([BN, BD], dtype=tl.float32)
            else:
                acc = tl.dot(dc, wt, input_precision=PREC)  # [BN, BD]
            # QSTAGES 0 unrolls the sites (their tile loads issued together: more registers, fewer programs)
            if QSTAGES == 0:
                for q in tl.static_range(Q):
                    acc = _dv_site(acc, q, lam_ptr, pc_ptr, g_ptr, dc_ptr, w_ptr, i, n0, nl, nm, loc, m2, d, dm,
                                   N, S, D, PREC)  # fmt: skip
            else:  # a loop over the sites with QSTAGES tiles in flight
                for q in tl.range(0, Q, num_stages=QSTAGES):
                    acc = _dv_site(acc, q, lam_ptr, pc_ptr, g_ptr, dc_ptr, w_ptr, i, n0, nl, nm, loc, m2, d, dm,
                                   N, S, D, PREC)  # fmt: skip
            acc -= (asum * inv * inv / D)[:, None] * v
            tl.store(dv_ptr + (i * N + n0) * D + loc, acc.to(dv_ptr.dtype.element_ty), mask=m2)
            dw += tl.dot(tl.trans(dc), v, input_precision="ieee" if PREC == "fma" else PREC)
        tl.store(
            dwp_ptr + (grp * S + i).to(tl.int64) * QP * D + qs[:, None] * D + d[None, :],
            dw,
            mask=qm[:, None] & dm[None, :],
        )


def _pow2(x: int, lo: int = 2) -> int:
    return max(lo, triton.next_power_of_2(x))


def _tiles(SP: int) -> tuple[int, int]:
    """(BN, BD) for the [SP, BN, BD] register tiles of the mix / source-gradient kernels."""
    if SP <= 4:
        return 16, 64
    if SP <= 8:
        return 16, 32
    return 8, 32


# phase 2's forward for at most this many tokens (decode) and rows at most this wide: one program per token with
# the whole row in one tile (every operand requested up front; the passes over the row become one)
P2_ONE_TILE_TOKENS = 16
P2_ONE_TILE_WIDTH = 8192
# (tokens, columns, warps) per program of each kernel; OPENK3_ATTNRES_TILES="p2_bwd=32x64x8,..." overrides
# (measured on an H200 at N=16384 D=2048, bench/diag_attnres.py --sweep; columns are capped at D's power of 2)
TILES = {
    "p1_scores": (32, 64, 4),
    "p1_bwd_coef": (16, 128, 4),
    "p1_bwd_dv": (16, 128, 4),
    "p2_fwd": (1, 2048, 4),
    "p2_bwd": (2, 2048, 8),
    "p2_fwd_direct": (1, 2048, 4),  # phase 2 of sets without partials (reads the sources)
    "p2_bwd_direct": (1, 2048, 8),
    # phase 2's backward with the RMSNorm's (read_normed with gradients): rows that fit the columns take the one-pass
    # kernel (every operand loaded once); wider rows loop over column tiles in three passes. Stored partials at 16
    # warps (0.126 against 0.138 ms per read at 8); direct sets at 8 warps with 128 registers (fewer instructions per
    # row: 0.193 against 0.241 ms with 3 sources, 0.150 against 0.198 with 2; bench/NOTES.md v12)
    "p2_bwd_norm": (1, 2048, 16),
    "p2_bwd_norm_direct": (1, 2048, 8),
}


def _parse_tiles(spec: str) -> None:
    for item in filter(None, (t.strip() for t in spec.split(","))):
        name, _, val = item.partition("=")
        if name not in TILES:
            raise ValueError(
                f"OPENK3_ATTNRES_TILES: unknown kernel {name!r}; expected one of {sorted(TILES)}"
            )
        parts = val.split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(
                f"OPENK3_ATTNRES_TILES: {item!r}: expected name=TOKENSxCOLUMNSxWARPS (positive integers)"
            )
        TILES[name] = tuple(int(x) for x in parts)


_parse_tiles(os.environ.get("OPENK3_ATTNRES_TILES", ""))

# register cap per thread (ptxas maxnreg) of a kernel's launch, by TILES name, optionally for one source count
# ("name.S3"); 0 or absent: the compiler's choice. The one-pass normed backward loads the next block of rows ahead,
# which takes it past 64 registers at 16 warps (sm_90) and so from two programs per SM to one; at 64 it keeps two
# (stored partials: no spills, 0.123 against 0.166 ms per read at N=16384 D=2048: bench/NOTES.md v11). Direct sets
# run 8 warps, where 128 registers keep two programs per SM (139 and 195 uncapped with 2 and 3 sources; uncapped
# with 2 sources: 0.253 against 0.150 ms per read: bench/NOTES.md v12).
# OPENK3_ATTNRES_MAXNREG="p2_bwd_norm=0,p2_bwd_norm_direct.S3=64,..." overrides
MAXNREG = {"p2_bwd_norm": 64, "p2_bwd_norm_direct": 128}


def _parse_maxnreg(spec: str) -> None:
    for item in filter(None, (t.strip() for t in spec.split(","))):
        name, _, val = item.partition("=")
        base, _, srcs = name.partition(".S")
        if base not in TILES or (srcs and not srcs.isdigit()):
            raise ValueError(
                f"OPENK3_ATTNRES_MAXNREG: unknown kernel {name!r}; expected one of {sorted(TILES)}, "
                "optionally with .S<sources>"
            )
        if not val.isdigit():
            raise ValueError(f"OPENK3_ATTNRES_MAXNREG: {item!r}: expected name=REGISTERS (0: no cap)")
        MAXNREG[name] = int(val)


_parse_maxnreg(os.environ.get("OPENK3_ATTNRES_MAXNREG", ""))


def _regs(name: str, S: int) -> dict:
    """The launch option capping the registers of kernel ``name`` for ``S`` sources (none under the
    interpreter)."""
    n = MAXNREG.get(f"{name}.S{S}", MAXNREG.get(name, 0))
    return {"maxnreg": n} if n and not INTERPRET else {}


class _Block:
    """State of one sealed set: the announced sites, phase-1 partials and the buffers phase 2's backward fills."""

    def __init__(self, sites, eps):
        self.index = {sid: j for j, (sid, _, _) in enumerate(sites)}
        self.sites = sites
        self.eps = eps
        self.W = None  # [Q, D] fp32 folded queries of the sites (detached), set at the seal
        # [Q, D] fp32 folded-query gradients of the reads that took W[qi], added to phase 1's in its backward
        self.dW2 = None
        self.direct = False  # no partials: phase 2 mixes from the sources (see DIRECT_MAX)
        self.pn = None  # [Q, N, D] PARTIAL_DTYPE (stored mode)
        self.V = self.p = None  # direct mode: [S, N, D] sources and [Q, S, N] fp32 phase-1 weights
        self.dps = None  # direct mode: [Q, S, N] fp32 v_i . (lam g), filled by phase-2 backward
        self.g = None  # [Q, N, D] each site's output gradient (its dtype), filled by phase-2 backward
        self.lam = None  # [Q, N] fp32 each site's merge weight; the numerator gradient is lam * g
        self.written: set[int] = set()  # sites whose phase-2 backward has run
        self.read: set[int] = set()  # sites read (phase 2) in the forward


def _fold_plain(query: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    return norm_weight.float() * query.float().reshape(-1)


class _FoldCache:
    """Folded queries ``norm_weight * query`` (fp32) of parameters that do not change between forwards, kept while
    gradients are off (inference): a decode step otherwise spends three small kernels per read and three per site
    at every seal on recomputing them. An entry is used only for the very same tensors (held by weak reference, so
    a new tensor at a recycled address never matches) at the same version counters (an in-place update, such as an
    optimizer step or ``load_state_dict``, invalidates it)."""

    def __init__(self):
        self._entries: dict[tuple[int, ...], tuple] = {}

    def get(self, pairs) -> torch.Tensor:
        """``[len(pairs), D]`` fp32 stack of the folded queries of ``pairs`` = ((query, norm_weight), ...)."""
        flat = [t for pair in pairs for t in pair]
        if any(t.is_inference() for t in flat):  # no version counter to tell an in-place update: not cached
            return torch.stack([_fold_plain(q, nw) for q, nw in pairs])
        key = tuple(id(t) for t in flat)
        hit = self._entries.get(key)
        if hit is not None:
            refs, versions, value = hit
            if all(r() is t for r, t in zip(refs, flat)) and versions == tuple(t._version for t in flat):
                return value
        value = torch.stack([_fold_plain(q, nw) for q, nw in pairs])

        def drop(_ref, key=key, entries=self._entries):
            entries.pop(key, None)

        refs = tuple(weakref.ref(t, drop) for t in flat)
        self._entries[key] = (refs, tuple(t._version for t in flat), value)
        return value


_FOLDS = _FoldCache()


def _fold(query: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """The folded query ``norm_weight * query`` as fp32 ``[D]`` (cached while gradients are off)."""
    if torch.is_grad_enabled():
        return _fold_plain(query, norm_weight)
    return _FOLDS.get(((query, norm_weight),))[0]


def _fold_stack(pairs) -> torch.Tensor:
    """``[Q, D]`` fp32 folded queries of ``pairs`` (cached while gradients are off); with gradients one product
    of the stacked weights and queries (the same values as folding each pair, in five kernels instead of 3Q)."""
    if torch.is_grad_enabled():
        nws = torch.stack([nw.reshape(-1) for _, nw in pairs]).float()
        return nws * torch.stack([q.reshape(-1) for q, _ in pairs]).float()
    return _FOLDS.get(tuple(pairs))


def _sources(V, sealed) -> torch.Tensor:
    """[S, N, D] sealed sources: the reader's source buffer when it holds them, else one stacked copy."""
    if V is not None:
        return V
    D = sealed[0].shape[-1]
    return torch.stack([s.reshape(-1, D) for s in sealed])


class _Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, W, V, *sealed):
        # V: a view of the reader's source buffer, or None. Kept on ctx, not saved: later seals write other slots
        # of the same buffer (which bumps the version counter the saved-tensor check would trip on).
        ctx.V = V
        V = _sources(V, sealed)
        D = V.shape[-1]
        S, N = V.shape[0], V.shape[1]
        Q = W.shape[0]
        SP = _pow2(S)
        W = W.contiguous()
        p = torch.empty(Q, S, N, dtype=torch.float32, device=V.device)
        lse = torch.empty(Q, N, dtype=torch.float32, device=V.device)
        inv = torch.empty(S, N, dtype=torch.float32, device=V.device)
        direct = S <= DIRECT_MAX
        sc = torch.empty_like(p) if direct else p  # raw scores, kept for the backward in direct mode
        bn, bd, nw = TILES["p1_scores"]
        # decode: all tokens in one tile, the row in as few column steps as the tile allows
        if N <= FEW_TOKENS:
            bn = _pow2(N, 1)
            bd = min(_pow2(D, 16), FEW_TILE_VALUES // bn)
        pdl = pdl_on(V) and not torch.is_grad_enabled()
        _p1_scores[(Q, triton.cdiv(N, bn))](
            V, W, p, lse, inv, sc, N, block.eps, S=S, SP=SP, D=D, BN=bn, BD=bd, STORE_S=direct, PDL=pdl,
            num_warps=nw, **pdl_launch(pdl),
        )  # fmt: skip
        ctx.block, ctx.direct = block, direct
        block.direct = direct
        if direct:
            block.V, block.p = V, p
            ctx.save_for_backward(W, lse, p, sc, inv, *sealed)
            return lse
        BN, BD = _tiles(SP)
        block.pn = torch.empty(Q, N, D, dtype=PARTIAL_DTYPE, device=V.device)
        _p1_mix[(triton.cdiv(N, BN), triton.cdiv(D, BD))](
            V, p, block.pn, N, S=S, SP=SP, Q=Q, D=D, BN=BN, BD=BD, PDL=pdl, **pdl_launch(pdl)
        )
        ctx.save_for_backward(W, lse, *sealed)
        return lse

    @staticmethod
    def backward(ctx, dlse):
        if ctx.direct:
            W, lse, p, sc, inv, *sealed = ctx.saved_tensors
        else:
            W, lse, *sealed = ctx.saved_tensors
        block = ctx.block
        V = _sources(ctx.V, sealed)
        D = V.shape[-1]
        S, N = V.shape[0], V.shape[1]
        Q = W.shape[0]
        SP = _pow2(S)
        if block.g is None:  # no read of this block got a gradient
            block.g = torch.zeros(Q, N, D, dtype=V.dtype, device=V.device)
            block.lam = torch.zeros(Q, N, dtype=torch.float32, device=V.device)
            if ctx.direct:
                block.dps = torch.zeros(Q, S, N, dtype=torch.float32, device=V.device)
        else:
            for j in range(Q):
                if j not in block.written:
                    block.g[j].zero_()
                    block.lam[j].zero_()
                    if ctx.direct:
                        block.dps[j].zero_()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
        if ctx.direct:  # coefficients from the stored scores and phase 2's score gradients, fp32 [Q, S, N]
            pc, dps = p, block.dps
            ds = p * (dps - (p * dps).sum(1, keepdim=True) + dlse[:, None])
            dc, ac = ds * inv, ds * sc
        else:
            pc = torch.empty(Q, S, N, dtype=torch.float32, device=V.device)
            dc, ac = torch.empty_like(pc), torch.empty_like(pc)
            inv = torch.empty(S, N, dtype=torch.float32, device=V.device)
            bn, bd, nw = TILES["p1_bwd_coef"]
            _p1_bwd_coef[(Q, triton.cdiv(N, bn))](
                V, W, lse, block.g, block.lam, dlse, pc, dc, ac, inv, N, block.eps,
                S=S, SP=SP, D=D, BN=bn, BD=bd, num_warps=nw,
            )  # fmt: skip
        bn, bd, nw = TILES["p1_bwd_dv"]
        G = triton.cdiv(N, bn * NBG)
        QP16 = _pow2(Q, 16)
        dv = torch.empty(S, N, D, dtype=V.dtype, device=V.device)
        dwp = torch.empty(G, S, QP16, D, dtype=torch.float32, device=V.device)
        _p1_bwd_dv[(S, G, triton.cdiv(D, bd))](
            V, W, block.g, block.lam, pc, dc, ac, inv, dv, dwp, N,
            S=S, Q=Q, QP=QP16, D=D, BN=bn, BD=bd, NB=NBG, PREC=DV_DOT, QSTAGES=DV_STAGES, num_warps=nw,
        )  # fmt: skip
        block.g = block.lam = block.dps = None
        block.written = set()
        dW = dwp.sum((0, 1))[:Q]
        if block.dW2 is not None:  # the reads' folded-query gradients (they ran first: they use lse)
            dW = dW + block.dW2
            block.dW2 = None
        return (None, dW, None, *[dv[j].view_as(sealed[j]) for j in range(S)])


def _p2_operands(block: _Block, qi: int):
    """(partials, sources, weights) for phase 2 of site qi; the operands the mode does not use are stand-ins."""
    if block.direct:
        return block.V, block.V, block.p[qi]
    pn = block.pn[qi]
    return pn, pn, pn


def _nsrc(block: _Block) -> int:
    """Phase 2's source count constant: the sources it mixes (direct mode), else 1 (it reads the partials; a
    token-count-sized constant would compile the kernels anew for every N)."""
    return block.V.shape[0] if block.direct else 1


def _p2_forward(
    block: _Block, qi: int, rf: torch.Tensor, w: torch.Tensor, lse: torch.Tensor, norm=None, store_out=True
):
    """Phase 2 of site ``qi`` for the rows ``rf [N, D]``: (output, scores, inverse rms); with ``norm`` = (gain,
    eps) of an RMSNorm, also the normed output (else None), written by the same launch. ``store_out=False`` (with
    ``norm``): the output is not written (None is returned for it)."""
    N, D = rf.shape
    out = torch.empty_like(rf) if store_out else None
    x = torch.empty_like(rf) if norm is not None else out
    s = torch.empty(N, dtype=torch.float32, device=rf.device)
    inv = torch.empty_like(s)
    bn, bd, nw = TILES["p2_fwd_direct" if block.direct else "p2_fwd"]
    bd = min(bd, _pow2(D, 16))
    one = N <= P2_ONE_TILE_TOKENS and _pow2(D, 16) <= P2_ONE_TILE_WIDTH
    if one:  # decode: one token per program, the whole row in one tile (up to 16 values per thread)
        bn, bd = 1, _pow2(D, 16)
        nw = max(nw, min(16, bd // 512))
    pn, V, pp = _p2_operands(block, qi)
    g, neps = (norm[0], float(norm[1])) if norm is not None else (w, 0.0)
    pdl = pdl_on(rf) and not torch.is_grad_enabled()
    _p2_fwd[(triton.cdiv(N, bn),)](
        rf, w, pn, V, pp, lse, x if out is None else out, s, inv, N, block.eps, g, x, neps,
        D=D, BN=bn, BD=bd, S=_nsrc(block), DIRECT=block.direct, NORM=norm is not None, PDL=pdl,
        STORE_OUT=out is not None, ONE=one, num_warps=nw, **pdl_launch(pdl),
    )  # fmt: skip
    return out, s, inv, (x if norm is not None else None)


class _Phase2(torch.autograd.Function):
    """One phase-2 read. ``w``: the site's folded query; ``shared``: it is the block's ``W[qi]`` (the seal's folded
    queries), whose gradient phase 1's backward returns (summed into ``block.dW2``), so that a read costs no fold
    kernels of its own."""

    @staticmethod
    def forward(ctx, block, qi, r, w, lse_all, shared):
        ctx.shared = shared
        out, s, inv, _ = _p2_forward(block, qi, r.reshape(-1, r.shape[-1]), w, lse_all[qi])
        ctx.block, ctx.qi = block, qi
        ctx.save_for_backward(r, w, lse_all, s, inv)
        return out.view_as(r)

    @staticmethod
    def backward(ctx, dout):
        r, w, lse_all, s, inv = ctx.saved_tensors
        dr, dw, dlse, _ = _p2_backward(ctx.block, ctx.qi, dout, r, w, lse_all, s, inv, shared=ctx.shared)
        return None, None, dr, dw, dlse, None


class _Phase2Normed(torch.autograd.Function):
    """``rms_norm(read, gain, eps)`` of one phase-2 read, with gradients: the forward writes only the normed rows
    (the read's output is not stored), the backward recomputes the output and runs the norm's backward in the same
    kernel as phase 2's. ``w``, ``shared``: as in :class:`_Phase2`."""

    @staticmethod
    def forward(ctx, block, qi, r, w, lse_all, gain, eps, shared):
        ctx.shared = shared
        _, s, inv, x = _p2_forward(
            block, qi, r.reshape(-1, r.shape[-1]), w, lse_all[qi], (gain, eps), store_out=False
        )
        ctx.block, ctx.qi, ctx.eps = block, qi, eps
        ctx.save_for_backward(r, w, lse_all, s, inv, gain)
        return x.view_as(r)

    @staticmethod
    def backward(ctx, dx):
        r, w, lse_all, s, inv, gain = ctx.saved_tensors
        dr, dw, dlse, dgain = _p2_backward(
            ctx.block, ctx.qi, dx, r, w, lse_all, s, inv, (gain, ctx.eps), shared=ctx.shared
        )
        return None, None, dr, dw, dlse, dgain.to(gain.dtype), None, None


def _p2_backward(block, qi, dout, r, w, lse_all, s, inv, norm=None, shared=False):
    """Phase 2's backward of site ``qi``: (d r, d folded query, d lse of every site, d gain or None). ``dout``: the
    output's gradient, or with ``norm`` = (gain, eps) the gradient of the normed output. Fills the block's
    gradient buffers for phase 1's backward; ``shared``: ``w`` is the block's ``W[qi]``, whose gradient goes to
    ``block.dW2[qi]`` (None returned)."""
    D = r.shape[-1]
    rf = r.reshape(-1, D)
    N = rf.shape[0]
    Q = lse_all.shape[0]
    if block.g is None:
        block.g = torch.empty(Q, N, D, dtype=r.dtype, device=r.device)
        block.lam = torch.empty(Q, N, dtype=torch.float32, device=r.device)
        if block.direct:
            block.dps = torch.empty(Q, block.V.shape[0], N, dtype=torch.float32, device=r.device)
        block.written = set()
    pn, V, pp = _p2_operands(block, qi)
    dps = block.dps[qi] if block.direct else pp
    dr = torch.empty_like(rf)
    dlse = torch.zeros_like(lse_all)
    kname = "p2_bwd" + ("_norm" if norm is not None else "") + ("_direct" if block.direct else "")
    bn, bd, nw = TILES[kname]
    bd = min(bd, _pow2(D, 16))
    S = _nsrc(block)
    one_pass = norm is not None and bd >= D and (not block.direct or S <= ONE_PASS_MAX_SOURCES)
    rb = max(1, (P2_NORM_ROWS if one_pass else 16) // bn)  # at least 16 tokens per query-gradient partial
    while rb * bn > 16 and triton.cdiv(N, bn * rb) < 2 * sm_count(r.device):  # two programs per SM at least
        rb //= 2
    nprog = triton.cdiv(N, bn * rb)
    dwp = torch.empty(nprog, D, dtype=torch.float32, device=r.device)
    gain, neps = norm if norm is not None else (w, 0.0)
    dgp = torch.empty(nprog, D, dtype=torch.float32, device=r.device) if norm is not None else dwp
    _p2_bwd[(nprog,)](
        dout.contiguous().view(-1, D), rf, w, pn, V, pp, dps, lse_all[qi], s, inv, dr, block.g[qi],
        block.lam[qi], dlse[qi], dwp, N, gain, dgp, float(neps),
        D=D, BN=bn, BD=bd, RB=rb, S=S, SP=_pow2(S), DIRECT=block.direct, NORM=norm is not None,
        ONE_PASS=one_pass, num_warps=nw, **_regs(kname, S),
    )  # fmt: skip
    block.written.add(qi)
    if shared:
        if block.dW2 is None:
            block.dW2 = torch.zeros(Q, D, dtype=torch.float32, device=r.device)
        torch.sum(dwp, 0, out=block.dW2[qi])
        dw = None
    else:
        dw = dwp.sum(0)
    return dr.view_as(r), dw, dlse, (dgp.sum(0) if norm is not None else None)


class TritonAttnResReader:
    """AttnRes reader with the interface of :class:`openk3.ops.attnres.reference.AttnResReader`: ``seal`` runs
    phase 1 for the announced sites, ``read`` runs phase 2. Sites that were not announced, a second read of the
    same site within one sealed set, CPU tensors (without the Triton interpreter) and single-source reads fall back
    to the reference read.

    ``seal`` also copies each sealed source into one ``[capacity, N, D]`` buffer owned by the reader (capacity
    ``max_sources``, grown by doubling when exceeded), so phase 1 and its backward read the sources in place
    instead of stacking all of them at every seal and again in the backward. The buffer holds copies taken at seal
    time: like the reference, a sealed tensor must not be modified in place afterwards."""

    fuses_read_norm = True  # read_normed is one kernel (forward and backward), see the module docstring

    def __init__(self, eps: float, max_sources: int | None = None):
        self.eps = eps
        self.sealed: list[torch.Tensor] = []
        self._block: _Block | None = None
        self._lse: torch.Tensor | None = None
        self._cap = max(1, int(max_sources)) if max_sources else 4
        self._buf: torch.Tensor | None = None  # [capacity, N, D] copies of self._staged
        self._staged: list[torch.Tensor] = []  # the sealed tensors held by the buffer, in order

    @property
    def num_sealed(self) -> int:
        return len(self.sealed)

    def _fast(self, t: torch.Tensor) -> bool:
        return (
            HAS_TRITON
            and (t.is_cuda or INTERPRET)
            and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )

    @torch.no_grad()
    def _stage(self) -> torch.Tensor:
        """[S, N, D] view of the source buffer holding ``self.sealed`` (copying only what it does not hold yet)."""
        sealed = self.sealed
        r = sealed[-1]
        S, D = len(sealed), r.shape[-1]
        N = r.numel() // D
        buf = self._buf
        k = len(self._staged)
        same = (
            buf is not None
            and buf.shape[1:] == (N, D)
            and buf.dtype == r.dtype
            and buf.device == r.device
            and k < S
            and all(a is b for a, b in zip(self._staged, sealed))
        )
        if not same:
            buf, k = None, 0
        if buf is None or buf.shape[0] < S:
            grown = torch.empty(max(S, self._cap, 2 * buf.shape[0] if buf is not None else 0), N, D,
                                dtype=r.dtype, device=r.device)  # fmt: skip
            if k:
                grown[:k].copy_(buf[:k])
            buf = grown
        for i in range(k, S):
            buf[i].copy_(sealed[i].reshape(N, D))
        self._buf, self._staged = buf, list(sealed)
        return buf[:S]

    def seal(self, r: torch.Tensor, sites) -> None:
        self.sealed.append(r)
        self._block, self._lse = None, None
        if (
            not sites
            or not self._fast(r)
            or any(s.shape != r.shape or s.dtype != r.dtype for s in self.sealed)
        ):
            return
        block = _Block(list(sites), self.eps)
        W = _fold_stack([(q, nw) for _, q, nw in block.sites])  # [Q, D] fp32
        block.W = W.detach()
        self._lse = _Phase1.apply(block, W, self._stage(), *self.sealed)
        self._block = block

    def _w(self, qi: int, query: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Phase 2's folded-query operand and whether it is the seal's ``W[qi]`` (the announced tensors: shared),
        else the read's own fold."""
        _, q0, nw0 = self._block.sites[qi]
        if query is q0 and norm_weight is nw0:
            return self._block.W[qi], True
        return _fold(query, norm_weight), False

    def _site(self, site_id: int, r: torch.Tensor) -> int | None:
        """The phase-1 index of ``site_id`` when its read of ``r`` takes the two-phase kernels (announced at the
        latest seal, not read yet, ``r`` like the sealed sources), marked as read; None for the reference path."""
        block = self._block
        qi = None if block is None else block.index.get(site_id)
        if (
            qi is None
            or qi in block.read
            or not self._fast(r)
            or r.dtype != self.sealed[0].dtype
            or r.shape != self.sealed[0].shape
        ):
            return None
        block.read.add(qi)
        return qi

    def read(
        self, site_id: int, query: torch.Tensor, norm_weight: torch.Tensor, r: torch.Tensor
    ) -> torch.Tensor:
        qi = self._site(site_id, r)
        if qi is None:
            return attnres_read([*self.sealed, r], query, norm_weight, self.eps)
        w, shared = self._w(qi, query, norm_weight)
        return _Phase2.apply(self._block, qi, r.contiguous(), w, self._lse, shared)

    def read_normed(
        self, site_id: int, query: torch.Tensor, norm_weight: torch.Tensor, r: torch.Tensor, norm
    ) -> torch.Tensor:
        """``norm(read(...))`` for an :class:`~openk3.modules.norm.RMSNorm` ``norm``. With the read on the fast path
        (see :meth:`read`) one phase-2 launch writes the normed rows directly, with the reference norm's rounding
        (the read's output is not stored: with gradients on, the backward recomputes it and runs the norm's
        backward in phase 2's backward kernel); otherwise the read, then ``norm``."""
        from openk3.modules.norm import RMSNorm

        gain = norm.weight if isinstance(norm, RMSNorm) else None
        if gain is None or gain.shape != r.shape[-1:]:
            return norm(self.read(site_id, query, norm_weight, r))
        qi = self._site(site_id, r)
        if qi is None:
            return norm(attnres_read([*self.sealed, r], query, norm_weight, self.eps))
        (w, shared), eps = self._w(qi, query, norm_weight), float(norm.eps)
        if torch.is_grad_enabled():
            return _Phase2Normed.apply(self._block, qi, r.contiguous(), w, self._lse, gain, eps, shared)
        rf = r.contiguous().view(-1, r.shape[-1])
        return _p2_forward(self._block, qi, rf, w, self._lse[qi], (gain, eps))[3].view_as(r)


def attnres_read_fast(sources, query, norm_weight, eps):
    """One-shot read through the two-phase kernels (for tests/benches): seal ``sources[:-1]`` for this one site."""
    if len(sources) < 2:
        return attnres_read(sources, query, norm_weight, eps)
    rd = TritonAttnResReader(eps)
    rd.sealed.extend(sources[:-2])
    rd.seal(sources[-2], [(0, query, norm_weight)])
    return rd.read(0, query, norm_weight, sources[-1])
