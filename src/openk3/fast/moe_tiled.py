"""Expert-tiled routed experts for decode batches: each expert's weights read once, by Triton tiles, for all of
its (token, slot) pairs.

A decode step of a serving batch (tens to a few hundred tokens) routes each expert only a few pairs: at 64 tokens,
top-8 of 256 experts, about two per expert, and nearly every expert is touched, so the step reads nearly all the
expert weights. The two few-token layouts both lose there:

* the per-pair kernels of :mod:`openk3.fast.moe_small` read an expert's weights once per pair (twice the bytes at
  two pairs per expert), so they are taken only up to 16 tokens;
* the permuted grouped GEMMs of :func:`openk3.fast.moe.experts_grouped` read each expert once, but
  ``torch._grouped_mm`` is built for large groups: its tensor-core tiles are taller than a group of two real rows
  (padded to 16), so much of its work goes to padded products rather than to streaming the weights.

Here, on :class:`openk3.fast.moe.RowPlan`'s layout (pairs grouped by expert, no sort, no host synchronisation):

* :func:`_tiled_up_kernel`, one program per (expert, ``BI`` intermediate rows): the expert's gate and up rows
  streamed once in ``BK``-column steps through shared memory (Triton's pipeliner), multiplied by its pairs' token
  rows ``BM`` at a time (``tl.dot`` with M = ``BM``: 16- to 64-row tensor-core tiles, :func:`rows_per_step`), then
  the GLU; an expert without pairs returns at once;
* :func:`_tiled_down_kernel`, one program per (expert, ``BO`` output columns): the down projection of the same rows;
* :func:`openk3.fast.moe.combine2`: the fp32 mixture in slot order.

Rounding as ``openk3.ops.moe.experts_reference`` (gate, up and down outputs rounded to the activation dtype, the
activation of the rounded values rounded, the mixture in fp32), the GLU as the grouped path's (fast-math SiTU).
Taken by :func:`openk3.fast.moe.experts_grouped` without autograd for at most :data:`TILED`\\ ``["max_pairs_per_
expert"]`` pairs per expert on average (``OPENK3_MOE_TILED``: that bound, default 32; 0 = never).
"""

from __future__ import annotations

import torch

from openk3.fast._triton import HAS_TRITON, env_int, tl, triton

# Launch tiles and the dispatch bound; bench/diag_moe_tiled.py times them against the grouped GEMMs
# (bench/NOTES.md v33-v34). The bound: on an H100 the tiled kernels took 4-24 % less time than the grouped GEMMs up
# to 8 pairs per expert on average (the 48B, `medium` and K3 expert shapes) with 16-row steps, and with the taller
# steps of rows_per_step 19 % / 2 % less at 16 (`medium` / K3 widths) and 9 % less at 32 (`medium`); past 32 untimed.
TILED = {
    "max_pairs_per_expert": env_int("OPENK3_MOE_TILED", 32, "pairs per expert on average; 0 = off"),
    "bm": env_int("OPENK3_MOE_TILED_BM", 0, "pair rows per program step; 0 = auto"),  # see rows_per_step()
    "bm_max": 64,  # the auto rule's largest step
    "bi": 64,  # gate / up rows per program
    "bk": 128,  # input columns per pipeline step (gate / up)
    "bo": 64,  # down-projection output columns per program
    "bk_down": 128,  # intermediate columns per pipeline step (down)
    "stages": 3,
    "num_warps": 4,
}


def applies(x: torch.Tensor, idx: torch.Tensor, num_experts: int) -> bool:
    """Whether :func:`experts_tiled` takes these tokens: Triton on ``x``'s device, a 16-bit or fp32 dtype, and at
    most ``TILED["max_pairs_per_expert"]`` (token, slot) pairs per expert on average. (Autograd is the caller's to
    rule out: these kernels have no backward.)"""
    m = TILED["max_pairs_per_expert"]
    if m <= 0 or not HAS_TRITON or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if idx.numel() > m * num_experts:
        return False
    from openk3.fast._triton import INTERPRET, triton_ok

    if INTERPRET and x.dtype == torch.bfloat16:
        return False  # the CPU interpreter's tl.dot on bf16 operands is wrong (triton 3.6); fp16 / fp32 are right

    return triton_ok(x)[0]


if HAS_TRITON:
    from openk3.fast.moe import _glu_fast

    @triton.jit
    def _group(offs_ptr, e):
        """Rows [start, end) of expert ``e``'s group (``offs``: the groups' ends)."""
        end = tl.load(offs_ptr + e)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
        return start, end

    @triton.jit
    def _chunk(pair_ptr, r0, end, nk, BM: tl.constexpr):
        """Rows ``r0 .. r0 + BM`` of a group ending at ``end``: (the rows, their pairs, whether each is a real
        pair: not padding, not past the group)."""
        rows = r0 + tl.arange(0, BM)
        pr = tl.load(pair_ptr + rows, mask=rows < end, other=nk)
        return rows, pr, pr < nk

    @triton.jit
    def _mm_step(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _tiled_up_kernel(
        x_ptr, pair_ptr, offs_ptr, w1_ptr, w3_ptr, a_ptr, nk, s_x, s1_e, s1_i, s3_e, s3_i, b1, ib1, b2, ib2,
        W: tl.constexpr, I: tl.constexpr, K: tl.constexpr, SITU: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
        STAGES: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """a[r, i] = act(round(x[t] . w1[e, i]), round(x[t] . w3[e, i])) for each row r of expert e =
        program_id(0) whose pair p = pair_of_row[r] is real (token t = p // K); padding rows are not written."""
        e = tl.program_id(0)
        start, end = _group(offs_ptr, e)
        ii = tl.program_id(1) * BI + tl.arange(0, BI)
        im = ii < I
        e64 = e.to(tl.int64)
        g_col = w1_ptr + e64 * s1_e + ii[None, :] * s1_i  # [1, BI]: the tile's rows of w1 as columns
        u_col = w3_ptr + e64 * s3_e + ii[None, :] * s3_i
        dt = a_ptr.dtype.element_ty
        r0 = start
        while r0 < end:  # (a while loop: the CPU interpreter cannot take a loaded value as a range() bound)
            rows, pr, live = _chunk(pair_ptr, r0, end, nk, BM)
            tok = (pr // K).to(tl.int64)
            acc_g = tl.zeros([BM, BI], dtype=tl.float32)
            acc_u = tl.zeros([BM, BI], dtype=tl.float32)
            for k0 in tl.range(0, W, BK, num_stages=STAGES):
                kk = k0 + tl.arange(0, BK)
                km = kk < W
                xv = tl.load(
                    x_ptr + tok[:, None] * s_x + kk[None, :], mask=live[:, None] & km[None, :], other=0.0
                )
                wm = km[:, None] & im[None, :]
                wg = tl.load(g_col + kk[:, None], mask=wm, other=0.0)
                wu = tl.load(u_col + kk[:, None], mask=wm, other=0.0)
                acc_g = _mm_step(xv, wg, acc_g, IEEE)
                acc_u = _mm_step(xv, wu, acc_u, IEEE)
            g = acc_g.to(dt).to(tl.float32)
            u = acc_u.to(dt).to(tl.float32)
            a = _glu_fast(g, u, b1, ib1, b2, ib2, SITU)
            out = a_ptr + rows[:, None].to(tl.int64) * I + ii[None, :]
            tl.store(out, a.to(dt), mask=live[:, None] & im[None, :])
            r0 += BM

    @triton.jit
    def _tiled_down_kernel(
        a_ptr, pair_ptr, offs_ptr, w2_ptr, y_ptr, nk, s2_e, s2_w, W: tl.constexpr, I: tl.constexpr,
        BM: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """y[r, o] = round(a[r] . w2[e, o]) for each real row r of expert e = program_id(0)."""
        e = tl.program_id(0)
        start, end = _group(offs_ptr, e)
        oo = tl.program_id(1) * BO + tl.arange(0, BO)
        om = oo < W
        w_col = w2_ptr + e.to(tl.int64) * s2_e + oo[None, :] * s2_w  # [1, BO]
        r0 = start
        while r0 < end:
            rows, _, live = _chunk(pair_ptr, r0, end, nk, BM)
            r64 = rows.to(tl.int64)
            acc = tl.zeros([BM, BO], dtype=tl.float32)
            for k0 in tl.range(0, I, BK, num_stages=STAGES):
                kk = k0 + tl.arange(0, BK)
                km = kk < I
                av = tl.load(
                    a_ptr + r64[:, None] * I + kk[None, :], mask=live[:, None] & km[None, :], other=0.0
                )
                wv = tl.load(w_col + kk[:, None], mask=km[:, None] & om[None, :], other=0.0)
                acc = _mm_step(av, wv, acc, IEEE)
            out = y_ptr + r64[:, None] * W + oo[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=live[:, None] & om[None, :])
            r0 += BM


def rows_per_step(n_pairs: int, num_experts: int) -> int:
    """Pair rows per program step (``BM``). Each step of a program streams its expert's weight tile again (from L2
    after the first), so an expert with G pairs costs ceil(G / BM) passes. ``TILED["bm"]`` when set; else (auto)
    the power of two >= twice the average pairs per expert, clamped to [16, ``TILED["bm_max"]``], so that the
    busiest experts of a random routing mostly fit one or two steps: 16 up to 8 pairs per expert on average, 32 up
    to 16, 64 beyond. Chosen from the shapes only (no host sync). On an H100 (bench/NOTES.md v34) each choice was
    the fastest step at its load or within 4 % of it: `medium` at 16 pairs per expert 115 us with 32-row steps
    (145 with 16), at 32 pairs 136 us with 64-row steps (161 with 32, 236 with 16)."""
    c = TILED
    if c["bm"]:
        if c["bm"] not in (16, 32, 64):  # (the steps compiled, tested and timed)
            raise ValueError(
                f"TILED['bm'] (OPENK3_MOE_TILED_BM) must be 0 (auto), 16, 32 or 64, got {c['bm']}"
            )
        return int(c["bm"])
    avg2 = -(-2 * n_pairs // max(num_experts, 1))
    return max(16, min(int(c["bm_max"]), triton.next_power_of_2(max(avg2, 1))))


def _pow2_at_most(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def experts_tiled(x, idx, weights, w1, w2, w3, *, act="situ", beta1=4.0, beta2=25.0) -> torch.Tensor:
    """``openk3.ops.moe.experts_reference`` by expert-tiled kernels (no autograd). x: [N, W]; idx: [N, k] expert ids
    in [0, E); weights: [N, k] (fp32 mixture weights); w1, w3: [E, I, W]; w2: [E, W, I] (unit stride along the last
    dimension, other strides free). Returns [N, W] in x.dtype."""
    from openk3.fast.moe import RowPlan, combine2

    if act not in ("situ", "silu", "swiglu"):
        raise ValueError(f"unknown activation {act!r}; expected 'situ' or 'silu'")
    E, I, W = w1.shape
    if x.dim() != 2 or x.shape[1] != W:
        raise ValueError(f"experts_tiled: x must be [N, {W}], got {tuple(x.shape)}")
    N = x.shape[0]
    if idx.dim() != 2 or idx.shape[0] != N or weights.shape != idx.shape:
        raise ValueError(f"idx {tuple(idx.shape)} and weights {tuple(weights.shape)} must both be [{N}, k]")
    if w3.shape != w1.shape or w2.shape != (E, W, I):
        raise ValueError(f"expert weights: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}")
    if any(t.dtype != x.dtype or t.device != x.device for t in (w1, w2, w3)) or idx.device != x.device:
        raise ValueError(
            f"experts_tiled: x ({x.dtype} on {x.device}), idx (on {idx.device}) and the expert weights "
            f"({[f'{t.dtype} on {t.device}' for t in (w1, w2, w3)]}) must share a device and x's dtype"
        )
    if N == 0:
        return x.new_zeros(x.shape)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w1, w2, w3 = (t if t.stride(-1) == 1 else t.contiguous() for t in (w1, w2, w3))
    K = idx.shape[1]
    plan = RowPlan(idx.contiguous(), E, sparse=True)
    P, nk = plan.P, N * K
    c = TILED
    bm = rows_per_step(nk, E)
    bi = _pow2_at_most(I, c["bi"])
    bk = _pow2_at_most(W, c["bk"])
    bo = _pow2_at_most(W, c["bo"])
    bkd = _pow2_at_most(I, c["bk_down"])
    ieee = x.dtype == torch.float32
    a = torch.empty(P, I, dtype=x.dtype, device=x.device)
    _tiled_up_kernel[(E, triton.cdiv(I, bi))](
        x, plan.pair_of_row, plan.offs, w1, w3, a, nk, x.stride(0), w1.stride(0), w1.stride(1),
        w3.stride(0), w3.stride(1), float(beta1), 1.0 / float(beta1), float(beta2), 1.0 / float(beta2),
        W=W, I=I, K=K, SITU=act == "situ", BM=bm, BI=bi, BK=bk, STAGES=c["stages"], IEEE=ieee, num_warps=c["num_warps"],
    )  # fmt: skip
    y = torch.empty(P, W, dtype=x.dtype, device=x.device)
    _tiled_down_kernel[(E, triton.cdiv(W, bo))](
        a, plan.pair_of_row, plan.offs, w2, y, nk, w2.stride(0), w2.stride(1), W=W, I=I,
        BM=bm, BO=bo, BK=bkd, STAGES=c["stages"], IEEE=ieee, num_warps=c["num_warps"],
    )  # fmt: skip
    return combine2(y, plan.rows, weights.float().contiguous(), x.dtype)
