"""Two-phase Block AttnRes reader in Triton (SPEC.md §3.4), forward and backward, exact (fp32 mixing).

Phase 1 runs once per sealed set, at ``seal`` time: every read site announced for the block (up to 24 in K3) is
scored against all sealed sources in one batched pass. Per site and token it keeps the log-normaliser
``lse = max + log(sum exp(score - max))`` and the normalised numerator ``Pn = sum_i softmax_i * v_i`` (fp32 by
default; ``PARTIAL_DTYPE``) -- the online-softmax state with the max folded in.
Phase 2 runs at each read: it scores the live partial sum ``r`` and merges,
``out = lam * Pn + (1 - lam) * r`` with ``lam = sigmoid(lse - score(r))`` (``1 - lam`` is taken as
``sigmoid(score(r) - lse)``, without cancellation) -- the same softmax over ``[sealed..., r]`` as the reference.

Backward: phase 2 writes its numerator gradient ``lam * dout`` straight into the block's buffer (one fp32
``[Q, N, D]`` buffer instead of Q full-size autograd gradients) and hands ``d lse`` back through autograd; phase 1's
backward then produces the gradients of every sealed source and of every site's folded query in two kernels:
per-(source, site, token) coefficients (one pass over D), then the source / query gradients (elementwise over D,
queries reduced over token groups).

The sealed sources reach the kernels as a tuple of pointers (no stacked copy). Kernels (all fp32 arithmetic; ``S``
sources, ``Q`` sites, ``N`` tokens, width ``D``; tiles from ``_p1_tiles`` / ``_row_tiles`` / ``_groups``):

- ``_p1_fwd`` [N/BN]: per token tile, scores of all (source, site) pairs (each source tile loaded once for all
  sites), softmax over the sources, then a second pass over D writing every site's ``Pn`` (sources again, from L2);
  stores ``lse`` [Q, N] and ``Pn`` [Q, N, D].
- ``_p2_fwd`` [N/BN]: the read; BN whole rows (width padded to a power of two) in registers when ``D`` fits
  (``ROW_MAX``), so ``r`` and ``Pn`` are read once; wider rows are walked in chunks twice. Stores ``out`` and
  per-token ``score(r)``, ``1/rms(r)`` for the backward. At decode sizes (N = 1..64) this is one program.
- ``_p2_bwd`` [G]: G programs of NB strided token tiles; reads ``dout``, ``r``, ``Pn`` once (whole rows), writes
  ``dr`` and ``dPn`` (accumulating when a site is read twice), ``d lse`` and one query-gradient partial row per
  program (summed by torch).
- ``_p1_bwd_coef`` [N/BN]: per token tile, one pass over D reading every source and every site's ``dPn`` once;
  stores ``p``, ``d score / rms`` [Q, S, N] and the per-(source, token) RMS-gradient coefficient [S, N].
- ``_p1_bwd_dv`` [G, D/BD]: source gradients for all sources (reads sources and all sites' ``dPn`` once, writes
  ``dV``) and per-group query-gradient partials [G, Q, D].

They also run under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

import torch

from openk3.fast._triton import HAS_TRITON, INTERPRET, tl, triton, triton_ok
from openk3.ops.attnres.reference import attnres_read

PARTIAL_DTYPE = torch.float32


def available() -> tuple[bool, str]:
    ok, why = triton_ok()
    return (True, "two-phase Triton reader (fp32 partials)") if ok else (False, why)


if HAS_TRITON:

    @triton.jit
    def _p1_fwd(
        vs, w_ptr, pn_ptr, lse_ptr, N, eps,
        S: tl.constexpr, SP: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr, D: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        qs = tl.arange(0, QP)
        qm = qs < Q
        src = tl.arange(0, SP)
        # pass 1: scores of every (source, site, token); each source tile is loaded once for all sites
        dots = tl.zeros([SP, QP, BN], dtype=tl.float32)
        sqs = tl.zeros([SP, BN], dtype=tl.float32)
        for i in tl.static_range(S):
            dot = tl.zeros([QP, BN], dtype=tl.float32)
            sq = tl.zeros([BN], dtype=tl.float32)
            for d0 in tl.range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                dm = d < D
                v = tl.load(vs[i] + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
                v = v.to(tl.float32)
                w = tl.load(w_ptr + qs[:, None] * D + d[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
                dot += tl.sum(w[:, None, :] * v[None, :, :], axis=2)
                sq += tl.sum(v * v, axis=1)
            dots = tl.where(src[:, None, None] == i, dot[None, :, :], dots)
            sqs = tl.where(src[:, None] == i, sq[None, :], sqs)
        valid = (src < S)[:, None, None]
        inv = tl.rsqrt(sqs / D + eps)
        sc = tl.where(valid, dots * inv[:, None, :], float("-inf"))
        m = tl.max(sc, axis=0)
        e = tl.where(valid, tl.exp(sc - m[None, :, :]), 0.0)
        z = tl.sum(e, axis=0)
        p = e / z[None, :, :]
        tl.store(lse_ptr + qs[:, None] * N + n[None, :], m + tl.log(z), mask=qm[:, None] & nm[None, :])
        # pass 2: normalised numerators of every site (the source tiles come back from L2)
        for d0 in tl.range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            o = tl.zeros([QP, BN, BD], dtype=tl.float32)
            for i in tl.static_range(S):
                v = tl.load(vs[i] + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
                pi = tl.sum(tl.where(src[:, None, None] == i, p, 0.0), axis=0)
                o += pi[:, :, None] * v.to(tl.float32)[None, :, :]
            tl.store(
                pn_ptr + qs[:, None, None] * N * D + n[None, :, None] * D + d[None, None, :],
                o.to(pn_ptr.dtype.element_ty),
                mask=qm[:, None, None] & nm[None, :, None] & dm[None, None, :],
            )

    @triton.jit
    def _p2_fwd(
        r_ptr, w_ptr, pn_ptr, lse_ptr, out_ptr, s_ptr, inv_ptr, N, eps,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ONE: tl.constexpr,
    ):  # fmt: skip
        n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        lse = tl.load(lse_ptr + n, mask=nm, other=0.0)
        if ONE:  # the whole row lives in registers: r is read once
            d = tl.arange(0, BD)
            dm = d < D
            m2 = nm[:, None] & dm[None, :]
            r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + d, mask=dm, other=0.0)
            inv = tl.rsqrt(tl.sum(r * r, axis=1) / D + eps)
            s = tl.sum(r * w[None, :], axis=1) * inv
            lam = tl.sigmoid(lse - s)  # weight of the sealed part; its complement taken without cancellation
            lamc = tl.sigmoid(s - lse)
            pn = tl.load(pn_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            o = lam[:, None] * pn + lamc[:, None] * r
            tl.store(out_ptr + n[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=m2)
            tl.store(s_ptr + n, s, mask=nm)
            tl.store(inv_ptr + n, inv, mask=nm)
        else:  # wide rows: reductions, then the merge (r comes back from L2)
            dot = tl.zeros([BN], dtype=tl.float32)
            sq = tl.zeros([BN], dtype=tl.float32)
            for d0 in tl.range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                dm = d < D
                r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
                r = r.to(tl.float32)
                w = tl.load(w_ptr + d, mask=dm, other=0.0)
                dot += tl.sum(r * w[None, :], axis=1)
                sq += tl.sum(r * r, axis=1)
            inv = tl.rsqrt(sq / D + eps)
            s = dot * inv
            lam = tl.sigmoid(lse - s)  # weight of the sealed part; its complement taken without cancellation
            lamc = tl.sigmoid(s - lse)
            tl.store(s_ptr + n, s, mask=nm)
            tl.store(inv_ptr + n, inv, mask=nm)
            for d0 in tl.range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                dm = d < D
                m2 = nm[:, None] & dm[None, :]
                r = tl.load(r_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
                pn = tl.load(pn_ptr + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
                o = lam[:, None] * pn + lamc[:, None] * r
                tl.store(out_ptr + n[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _p2_bwd(
        dout_ptr, r_ptr, w_ptr, pn_ptr, lse_ptr, s_ptr, inv_ptr, dr_ptr, dpn_ptr, dl_ptr, dwp_ptr, N, G,
        D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, NB: tl.constexpr, ONE: tl.constexpr,
        ACCUM: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        if ONE:  # whole rows in registers: dout, r and pn are read once; query gradient summed in registers
            d = tl.arange(0, BD)
            dm = d < D
            w = tl.load(w_ptr + d, mask=dm, other=0.0)
            dw = tl.zeros([BD], dtype=tl.float32)
            for t in tl.range(0, NB):
                n = ((pid + t * G) * BN + tl.arange(0, BN)).to(tl.int64)
                nm = n < N
                m2 = nm[:, None] & dm[None, :]
                s = tl.load(s_ptr + n, mask=nm, other=0.0)
                inv = tl.load(inv_ptr + n, mask=nm, other=0.0)
                x = tl.load(lse_ptr + n, mask=nm, other=0.0) - s
                lam = tl.sigmoid(x)
                lamc = tl.sigmoid(-x)
                off = n[:, None] * D + d[None, :]
                g = tl.load(dout_ptr + off, mask=m2, other=0.0).to(tl.float32)
                r = tl.load(r_ptr + off, mask=m2, other=0.0).to(tl.float32)
                pn = tl.load(pn_ptr + off, mask=m2, other=0.0).to(tl.float32)
                gl = tl.sum(g * (pn - r), axis=1) * lam * lamc  # d lse; d score(r) = -gl
                tl.store(dl_ptr + n, gl, mask=nm)
                c_r = -gl * s * inv * inv / D
                c_w = -gl * inv
                dpn = lam[:, None] * g
                if ACCUM:
                    dpn += tl.load(dpn_ptr + off, mask=m2, other=0.0)
                tl.store(dpn_ptr + off, dpn, mask=m2)
                dr = lamc[:, None] * g + c_w[:, None] * w[None, :] - c_r[:, None] * r
                tl.store(dr_ptr + off, dr.to(dr_ptr.dtype.element_ty), mask=m2)
                dw += tl.sum(c_w[:, None] * r, axis=0)
            tl.store(dwp_ptr + pid * D + d, dw, mask=dm)
        else:  # wide rows: two passes over D per token tile; the query gradient accumulates in this program's row
            for t in tl.range(0, NB):
                n = ((pid + t * G) * BN + tl.arange(0, BN)).to(tl.int64)
                nm = n < N
                s = tl.load(s_ptr + n, mask=nm, other=0.0)
                inv = tl.load(inv_ptr + n, mask=nm, other=0.0)
                x = tl.load(lse_ptr + n, mask=nm, other=0.0) - s
                lam = tl.sigmoid(x)
                lamc = tl.sigmoid(-x)
                dl = tl.zeros([BN], dtype=tl.float32)
                for d0 in tl.range(0, D, BD):
                    d = d0 + tl.arange(0, BD)
                    m2 = nm[:, None] & (d < D)[None, :]
                    off = n[:, None] * D + d[None, :]
                    g = tl.load(dout_ptr + off, mask=m2, other=0.0).to(tl.float32)
                    r = tl.load(r_ptr + off, mask=m2, other=0.0).to(tl.float32)
                    pn = tl.load(pn_ptr + off, mask=m2, other=0.0).to(tl.float32)
                    dl += tl.sum(g * (pn - r), axis=1)
                gl = dl * lam * lamc
                tl.store(dl_ptr + n, gl, mask=nm)
                c_r = -gl * s * inv * inv / D
                c_w = -gl * inv
                for d0 in tl.range(0, D, BD):
                    d = d0 + tl.arange(0, BD)
                    dm = d < D
                    m2 = nm[:, None] & dm[None, :]
                    off = n[:, None] * D + d[None, :]
                    g = tl.load(dout_ptr + off, mask=m2, other=0.0).to(tl.float32)
                    r = tl.load(r_ptr + off, mask=m2, other=0.0).to(tl.float32)
                    w = tl.load(w_ptr + d, mask=dm, other=0.0)
                    dpn = lam[:, None] * g
                    if ACCUM:
                        dpn += tl.load(dpn_ptr + off, mask=m2, other=0.0)
                    tl.store(dpn_ptr + off, dpn, mask=m2)
                    dr = lamc[:, None] * g + c_w[:, None] * w[None, :] - c_r[:, None] * r
                    tl.store(dr_ptr + off, dr.to(dr_ptr.dtype.element_ty), mask=m2)
                    dwo = dwp_ptr + pid * D + d
                    tl.store(
                        dwo, tl.load(dwo, mask=dm, other=0.0) + tl.sum(c_w[:, None] * r, axis=0), mask=dm
                    )

    @triton.jit
    def _p1_bwd_coef(
        vs, w_ptr, lse_ptr, dpn_ptr, dl_ptr, pc_ptr, dc_ptr, aa_ptr, N, eps,
        S: tl.constexpr, SP: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr, D: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        nm = n < N
        qs = tl.arange(0, QP)
        qm = qs < Q
        src = tl.arange(0, SP)
        dots = tl.zeros([SP, QP, BN], dtype=tl.float32)
        dps = tl.zeros([SP, QP, BN], dtype=tl.float32)
        sqs = tl.zeros([SP, BN], dtype=tl.float32)
        for d0 in tl.range(0, D, BD):  # one pass over D: every source and every site's dpn loaded once
            d = d0 + tl.arange(0, BD)
            dm = d < D
            w = tl.load(w_ptr + qs[:, None] * D + d[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
            g = tl.load(
                dpn_ptr + qs[:, None, None] * N * D + n[None, :, None] * D + d[None, None, :],
                mask=qm[:, None, None] & nm[None, :, None] & dm[None, None, :],
                other=0.0,
            )
            for i in tl.static_range(S):
                v = tl.load(vs[i] + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
                v = v.to(tl.float32)
                sel = src[:, None, None] == i
                dots = tl.where(sel, dots + tl.sum(w[:, None, :] * v[None, :, :], axis=2)[None, :, :], dots)
                dps = tl.where(sel, dps + tl.sum(g * v[None, :, :], axis=2)[None, :, :], dps)
                sqs = tl.where(src[:, None] == i, sqs + tl.sum(v * v, axis=1)[None, :], sqs)
        inv = tl.rsqrt(sqs / D + eps)
        sc = dots * inv[:, None, :]
        m2 = qm[:, None] & nm[None, :]
        lse = tl.load(lse_ptr + qs[:, None] * N + n[None, :], mask=m2, other=0.0)
        ok = (src < S)[:, None, None] & m2[None, :, :]
        p = tl.where(ok, tl.exp(sc - lse[None, :, :]), 0.0)
        pdp = tl.sum(p * dps, axis=0)
        dlq = tl.load(dl_ptr + qs[:, None] * N + n[None, :], mask=m2, other=0.0)
        ds = p * (dps - pdp[None, :, :] + dlq[None, :, :])
        off = qs[None, :, None] * S * N + src[:, None, None] * N + n[None, None, :]
        tl.store(pc_ptr + off, p, mask=ok)
        tl.store(dc_ptr + off, ds * inv[:, None, :], mask=ok)
        aa = tl.sum(ds * sc, axis=1) * inv * inv / D
        tl.store(aa_ptr + src[:, None] * N + n[None, :], aa, mask=(src < S)[:, None] & nm[None, :])

    @triton.jit
    def _p1_bwd_dv(
        vs, w_ptr, dpn_ptr, pc_ptr, dc_ptr, aa_ptr, dv_ptr, dwp_ptr, N, G,
        S: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr, D: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr, NB: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        dm = d < D
        qs = tl.arange(0, QP)
        qm = qs < Q
        w = tl.load(w_ptr + qs[:, None] * D + d[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
        dw = tl.zeros([QP, BD], dtype=tl.float32)
        for t in tl.range(0, NB):
            n = ((pid + t * G) * BN + tl.arange(0, BN)).to(tl.int64)
            nm = n < N
            m2 = nm[:, None] & dm[None, :]
            mq = qm[:, None] & nm[None, :]
            g = tl.load(
                dpn_ptr + qs[:, None, None] * N * D + n[None, :, None] * D + d[None, None, :],
                mask=mq[:, :, None] & dm[None, None, :],
                other=0.0,
            )
            for i in tl.static_range(S):
                v = tl.load(vs[i] + n[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
                off = qs[:, None] * S * N + i * N + n[None, :]
                pc = tl.load(pc_ptr + off, mask=mq, other=0.0)
                dc = tl.load(dc_ptr + off, mask=mq, other=0.0)
                aa = tl.load(aa_ptr + i * N + n, mask=nm, other=0.0)
                acc = tl.sum(pc[:, :, None] * g, axis=0) + tl.sum(dc[:, :, None] * w[:, None, :], axis=0)
                acc -= aa[:, None] * v
                tl.store(
                    dv_ptr + i * N * D + n[:, None] * D + d[None, :], acc.to(dv_ptr.dtype.element_ty), mask=m2
                )
                dw += tl.sum(dc[:, :, None] * v[None, :, :], axis=1)
        tl.store(dwp_ptr + pid * Q * D + qs[:, None] * D + d[None, :], dw, mask=qm[:, None] & dm[None, :])


def _pow2(x: int, lo: int = 2) -> int:
    return max(lo, triton.next_power_of_2(x))


# Tile budgets (module attributes, read at each call; the interpreter tests shrink them to reach every code path).
E3 = 4096  # elements of the [sites, tokens, width] register tiles of the phase-1 kernels
ROW = 4096  # elements per operand of a phase-2 tile (tokens x padded width)
ROW_MAX = 8192  # widest padded row a phase-2 program holds in registers whole (K3: 7168 -> 8192)
ROW_CHUNK = 1024  # width chunk of phase-2 programs for wider rows (two passes over D per token tile)
WAVE = 528  # programs that fill an H200 (132 SMs x 4); the reducing kernels aim at one to two waves


def _p1_tiles(N: int, QP: int, D: int, BDT: int = 64) -> tuple[int, int]:
    """(BN, BD) of the phase-1 kernels: [QP, BN, BD] tiles of about E3 elements with chunks of about BDT columns;
    few tokens -> wider chunks."""
    BN = min(_pow2(N, 1), 32, max(1, E3 // (QP * BDT)))
    BD = min(_pow2(D, 16), max(16, E3 // (QP * BN)))
    return BN, BD


def _row_tiles(N: int, D: int) -> tuple[int, int, bool, int]:
    """(BN, BD, ONE, num_warps) of the phase-2 kernels. ONE: a program holds BN whole rows (padded to a power of
    two) in registers and reads every operand once; otherwise it walks D in ROW_CHUNK-wide chunks twice."""
    DP = _pow2(D, 16)
    if DP <= ROW_MAX:
        BN = min(_pow2(N, 1), max(1, ROW // DP))
        BD = DP
    else:
        BN, BD = min(_pow2(N, 1), 4), ROW_CHUNK
    return BN, BD, BD == DP, min(16, max(1, BN * BD // 512))


def _groups(ntiles: int, target: int) -> tuple[int, int]:
    """(G, NB): G programs of NB (a power of two) strided token tiles each, G >= target where ntiles allows; the
    query-gradient partials are per program, so fewer programs mean fewer partial rows to sum."""
    NB = 1
    while NB * 2 * max(1, target) <= ntiles:
        NB *= 2
    return triton.cdiv(ntiles, NB), NB


class _Block:
    """State of one sealed set: the announced sites, phase-1 partials and the numerator-gradient buffer."""

    def __init__(self, sites, eps):
        self.index = {sid: j for j, (sid, _, _) in enumerate(sites)}
        self.sites = sites
        self.eps = eps
        self.pn = None  # [Q, N, D] PARTIAL_DTYPE
        self.dpn = None  # [Q, N, D] fp32, filled by phase-2 backward
        self.written: set[int] = set()


def _fold(query: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    return norm_weight.float() * query.float().reshape(-1)


def _sources(sealed, D: int) -> tuple[torch.Tensor, ...]:
    """The sealed sources as [N, D] rows, passed to the kernels as a tuple of pointers (no stacked copy)."""
    return tuple(s.reshape(-1, D).contiguous() for s in sealed)


class _Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, W, *sealed):
        D = sealed[0].shape[-1]
        vs = _sources(sealed, D)
        S, N, Q = len(vs), vs[0].shape[0], W.shape[0]
        SP, QP = _pow2(S), _pow2(Q)
        W = W.contiguous()
        dev = vs[0].device
        lse = torch.empty(Q, N, dtype=torch.float32, device=dev)
        block.pn = torch.empty(Q, N, D, dtype=PARTIAL_DTYPE, device=dev)
        BN, BD = _p1_tiles(N, QP, D, 128)  # few tokens per tile: the second pass finds the sources in L2
        _p1_fwd[(triton.cdiv(N, BN),)](
            vs, W, block.pn, lse, N, block.eps, S=S, SP=SP, Q=Q, QP=QP, D=D, BN=BN, BD=BD, num_warps=8
        )
        ctx.block = block
        ctx.save_for_backward(W, lse, *sealed)
        return lse

    @staticmethod
    def backward(ctx, dlse):
        W, lse, *sealed = ctx.saved_tensors
        block = ctx.block
        D = sealed[0].shape[-1]
        vs = _sources(sealed, D)
        S, N, Q = len(vs), vs[0].shape[0], W.shape[0]
        SP, QP = _pow2(S), _pow2(Q)
        dev = vs[0].device
        dpn = block.dpn
        if dpn is None:
            dpn = torch.zeros(Q, N, D, dtype=torch.float32, device=dev)
        else:
            for j in range(Q):
                if j not in block.written:
                    dpn[j].zero_()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
        pc = torch.empty(Q, S, N, dtype=torch.float32, device=dev)
        dc = torch.empty_like(pc)
        aa = torch.empty(S, N, dtype=torch.float32, device=dev)
        BN, BD = _p1_tiles(N, QP, D)
        _p1_bwd_coef[(triton.cdiv(N, BN),)](
            vs, W, lse, dpn, dlse, pc, dc, aa, N, block.eps,
            S=S, SP=SP, Q=Q, QP=QP, D=D, BN=BN, BD=BD, num_warps=8,
        )  # fmt: skip
        nd = triton.cdiv(D, BD)
        G, NB = _groups(triton.cdiv(N, BN), triton.cdiv(2 * WAVE, nd))
        dv = torch.empty(S, N, D, dtype=vs[0].dtype, device=dev)
        dwp = torch.empty(G, Q, D, dtype=torch.float32, device=dev)
        _p1_bwd_dv[(G, nd)](
            vs, W, dpn, pc, dc, aa, dv, dwp, N, G, S=S, Q=Q, QP=QP, D=D, BN=BN, BD=BD, NB=NB, num_warps=8
        )
        block.dpn = None
        block.written = set()
        dW = dwp.sum(0) if G > 1 else dwp[0]
        return (None, dW, *[dv[j].view_as(sealed[j]).to(sealed[j].dtype) for j in range(S)])


class _Phase2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, qi, r, w, lse_all):
        D = r.shape[-1]
        rf = r.reshape(-1, D)
        N = rf.shape[0]
        out = torch.empty_like(rf)
        s = torch.empty(N, dtype=torch.float32, device=r.device)
        inv = torch.empty_like(s)
        BN, BD, one, nw = _row_tiles(N, D)
        _p2_fwd[(triton.cdiv(N, BN),)](
            rf, w, block.pn[qi], lse_all[qi], out, s, inv, N, block.eps,
            D=D, BN=BN, BD=BD, ONE=one, num_warps=nw,
        )  # fmt: skip
        ctx.block, ctx.qi = block, qi
        ctx.save_for_backward(r, w, lse_all, s, inv)
        return out.view_as(r)

    @staticmethod
    def backward(ctx, dout):
        r, w, lse_all, s, inv = ctx.saved_tensors
        block, qi = ctx.block, ctx.qi
        D = r.shape[-1]
        rf = r.reshape(-1, D)
        N = rf.shape[0]
        Q = lse_all.shape[0]
        if block.dpn is None:
            block.dpn = torch.empty(Q, N, D, dtype=torch.float32, device=r.device)
            block.written = set()
        accum = qi in block.written
        dr = torch.empty_like(rf)
        dlse = torch.zeros_like(lse_all)
        BN, BD, one, nw = _row_tiles(N, D)
        G, NB = _groups(triton.cdiv(N, BN), WAVE)
        dwp = (torch.empty if one else torch.zeros)(G, D, dtype=torch.float32, device=r.device)
        _p2_bwd[(G,)](
            dout.contiguous().view(-1, D), rf, w, block.pn[qi], lse_all[qi], s, inv, dr, block.dpn[qi], dlse[qi],
            dwp, N, G, D=D, BN=BN, BD=BD, NB=NB, ONE=one, ACCUM=accum, num_warps=nw,
        )  # fmt: skip
        block.written.add(qi)
        return None, None, dr.view_as(r), dwp.sum(0) if G > 1 else dwp[0], dlse


class TritonAttnResReader:
    """AttnRes reader with the interface of :class:`openk3.ops.attnres.reference.AttnResReader`: ``seal`` runs
    phase 1 for the announced sites, ``read`` runs phase 2. Sites that were not announced, CPU tensors (without
    the Triton interpreter) and single-source reads fall back to the reference read."""

    def __init__(self, eps: float):
        self.eps = eps
        self.sealed: list[torch.Tensor] = []
        self._block: _Block | None = None
        self._lse: torch.Tensor | None = None

    @property
    def num_sealed(self) -> int:
        return len(self.sealed)

    def _fast(self, t: torch.Tensor) -> bool:
        return (
            HAS_TRITON
            and (t.is_cuda or INTERPRET)
            and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )

    def seal(self, r: torch.Tensor, sites) -> None:
        self.sealed.append(r)
        self._block, self._lse = None, None
        if not sites or not self._fast(r):
            return
        block = _Block(list(sites), self.eps)
        W = torch.stack([_fold(q, nw) for _, q, nw in block.sites])  # [Q, D] fp32
        self._lse = _Phase1.apply(block, W, *self.sealed)
        self._block = block

    def read(
        self, site_id: int, query: torch.Tensor, norm_weight: torch.Tensor, r: torch.Tensor
    ) -> torch.Tensor:
        block = self._block
        if (
            block is None
            or site_id not in block.index
            or not self._fast(r)
            or r.dtype != self.sealed[0].dtype
        ):
            return attnres_read([*self.sealed, r], query, norm_weight, self.eps)
        return _Phase2.apply(
            block, block.index[site_id], r.contiguous(), _fold(query, norm_weight), self._lse
        )


def attnres_read_fast(sources, query, norm_weight, eps):
    """One-shot read through the two-phase kernels (for tests/benches): seal ``sources[:-1]`` for this one site."""
    rd = TritonAttnResReader(eps)
    for s in sources[:-1]:
        rd.sealed.append(s)
    block = _Block([(0, query, norm_weight)], eps)
    W = _fold(query, norm_weight)[None]
    rd._lse = _Phase1.apply(block, W, *rd.sealed)
    rd._block = block
    return rd.read(0, query, norm_weight, sources[-1])
