"""Few-token MoE path (decode): router and routed experts in five Triton launches, no token permutation.

At decode a MoE layer sees one to a few tokens. The permuted path of :mod:`openk3.fast.moe` then spends most of its
time on launches: the router (an fp32 copy of the activations and of the router weight, one GEMV, sigmoid, bias add,
top-k, gather, renormalisation, scaling: about ten kernels) and the experts (row planning in five launches, a
gather, two grouped GEMMs over 16-row padded groups, the GLU and the combine). Here:

* :func:`route_small`: one kernel for the fp32 logits (bf16 weights and activations read as they are, products and
  sums in fp32, i.e. ``linear(x.float(), weight.float())``) and one for the selection (activation, correction bias,
  top-k, mixture weights from the unbiased scores, renormalisation, scaling) -- ``openk3.ops.moe.route``'s
  semantics for ``n_group == 1``;
* :func:`experts_small`: one kernel per (token, slot) pair for the gate and up rows of its expert (read straight
  from the stacked weights by expert index) and the GLU, one kernel for the down projection of each pair, and the
  fp32 weighted combine of :func:`openk3.fast.moe.combine2`. Rounding as in
  ``openk3.ops.moe.experts_reference``: gate, up and the down projection's output are rounded to the activation
  dtype before the activation / the weighting, the mixture is accumulated in fp32.

Each pair reads its expert's weights once, so tokens that share an expert read it twice: the path pays only for a
few tokens. It is taken with gradients off for at most :data:`SMALL_N` tokens (``OPENK3_MOE_SMALL_N``, default 16;
0 turns it off) and at most :data:`PAIRS_PER_EXPERT` (token, slot) pairs per expert of the layer: past that the
pairs read more expert weights than the permuted path, which reads each touched expert once. Both defaults come from
an H200 (``bench/bench_decode.py --sections moe``, ``bench/bench_e2e_decode.py --moe-small``; bench/NOTES.md): the
experts at 16 tokens run 4x faster than the permuted path at 2 pairs per expert (``medium``), 0.7x at 4 pairs per
expert.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.fast._triton import (
    HAS_TRITON,
    env_flag,
    env_int,
    head_tail,
    pdl_launch,
    pdl_on,
    sm_count,
    tanh_f32,
    tl,
    triton,
    triton_ok,
)
from openk3.fast.moe import combine2


def _env_tokens(name: str, default: int) -> int:
    return env_int(name, default, "a token count; 0 = off")


SMALL_N = _env_tokens("OPENK3_MOE_SMALL_N", 16)
# the routing selection formed inside the experts' gate/up kernel (route_logits_small + experts_small with a
# PendingRoute) instead of its own launch; OPENK3_MOE_FUSE_SELECT=0 keeps the separate selection kernel
FUSE_SELECT = env_flag("OPENK3_MOE_FUSE_SELECT", True)
# ... for at most this many tokens: every gate/up program forms its token's top-k, so the work grows with the
# programs (tokens x slots x row tiles); measured faster at one token (H200, bench/NOTES.md v13)
FUSE_SELECT_MAX_TOKENS = 1
# the routing selection's top-k as tl.topk (a bitonic top-k: fewer block-wide barriers) instead of K sequential
# max-reductions; same picks. Measured -0.02 to -0.03 ms per 48B batch-1 step (H200, bench/NOTES.md v24): on.
# OPENK3_MOE_SELECT_TOPK=0 keeps the K max-reductions (benchmarks: bench_e2e_decode.py's variant select_max)
SELECT_TOPK = {"on": env_flag("OPENK3_MOE_SELECT_TOPK", True)}
PAIRS_PER_EXPERT = (
    2  # the path is taken for N tokens of top-k routing only while N * k <= PAIRS_PER_EXPERT * experts
)
# tiles: (gate/up rows per program, input columns per step, pipeline stages), (down-projection rows per program,
# columns per step, stages); stages >= 2 stream the weight tiles through shared memory (Triton's pipeliner), 1 loads
# them straight into registers; gate/up columns per step 0: whole rows, every weight byte of a program requested at
# once (a power-of-two head and tail tile)
UP_TILE = (16, 256, 3)
_ut = os.environ.get("OPENK3_MOE_UP_TILE", "").strip()  # "rows,columns,stages", e.g. "4,0,1" (benchmarks)
if _ut:
    _parts = _ut.split(",")
    _ok = len(_parts) == 3 and all(v.strip().isdigit() for v in _parts)
    if _ok:
        UP_TILE = tuple(int(v) for v in _parts)
        _ok = UP_TILE[0] >= 1 and UP_TILE[2] >= 1 and all(v & (v - 1) == 0 for v in UP_TILE[:2])
    if not _ok:
        raise ValueError(
            f"OPENK3_MOE_UP_TILE must be 'rows,columns,stages' (powers of two, columns 0 = whole rows), got {_ut!r}"
        )
DOWN_TILE = (32, 128, 3)
ROUTER_ROWS_MAX = 16  # experts per program of the logits kernel (fewer for few tokens, to fill the SMs)
# up to this many tokens the down projection and the weighted combine run as one kernel: each program owns
# BLOCK_O output columns of one token and walks the token's K experts, each expert's whole row of I columns one
# tile, the next expert's tile requested before the current one is used (no per-pair output round trip, no
# combine launch). BLOCK_O: the largest power of two (at most "max_bo") that leaves "programs_per_sm" programs per
# SM; 0 tokens: the per-pair down kernel and combine2 always
DOWN_COMBINE_MAX_TOKENS = _env_tokens("OPENK3_MOE_DOWN_COMBINE", 1)
# (Two experts' tiles in flight instead of one measured no faster on an H200, bench/NOTES.md v20.)
DOWN_COMBINE = {"programs_per_sm": 4, "max_bo": 16, "num_warps": 4}
# up to this many tokens the router logits come from openk3.infer.gemv's whole-row GEMV (fp32 sums, not rounded),
# which requests its weight rows before waiting on the kernel before it (programmatic dependent launch); 0: the
# logits kernel above always
ROUTER_GEMV_MAX_TOKENS = _env_tokens("OPENK3_MOE_ROUTER_GEMV", 1)


def enabled(x: torch.Tensor, top_k: int | None = None, num_experts: int | None = None) -> bool:
    """Whether the few-token path applies to activations ``x`` [N, D]: at most SMALL_N tokens, gradients off (the
    kernels have no backward; with gradients on, the router and expert weights may need them even when ``x`` does
    not) and, given the layer's ``top_k`` and ``num_experts``, at most PAIRS_PER_EXPERT (token, slot) pairs per
    expert."""
    if SMALL_N <= 0 or x.dim() != 2 or not 0 < x.shape[0] <= SMALL_N:
        return False
    if top_k is not None and num_experts is not None and x.shape[0] * top_k > PAIRS_PER_EXPERT * num_experts:
        return False
    if torch.is_grad_enabled():
        return False
    return triton_ok(x)[0]


if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait
    from openk3.fast._triton import round_to as _round

    @triton.jit
    def _router_logits_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        D,
        E,
        s_x,
        s_w,
        BLOCK_E: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ND: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """out[n, e] = sum_d x[n, d] * w[e, d] in fp32 (inputs read in their own dtype)."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        n = tl.program_id(0).to(tl.int64)
        es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        em = es < E
        acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
        for t in range(ND):  # ND = cdiv(D, BLOCK_D): a constexpr trip count
            ds = t * BLOCK_D + tl.arange(0, BLOCK_D)
            dm = ds < D
            xv = tl.load(x_ptr + n * s_x + ds, mask=dm, other=0.0).to(tl.float32)
            wv = tl.load(
                w_ptr + es[:, None].to(tl.int64) * s_w + ds[None, :],
                mask=em[:, None] & dm[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += wv * xv[None, :]
        tl.store(out_ptr + n * E + es, tl.sum(acc, 1), mask=em)

    @triton.jit
    def _router_select_kernel(
        logit_ptr,
        bias_ptr,
        idx_ptr,
        wt_ptr,
        score_ptr,
        E,
        scaling,
        K: tl.constexpr,
        KP: tl.constexpr,
        EP: tl.constexpr,
        SOFTMAX: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RENORM: tl.constexpr,
        PDL: tl.constexpr,
        TOPK: tl.constexpr = False,
    ):
        """The routing of token ``program_id(0)`` (:func:`_select`) stored: expert ids, scaled weights, scores."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        n = tl.program_id(0).to(tl.int64)
        _select(
            logit_ptr, bias_ptr, idx_ptr, wt_ptr, score_ptr, n, E, scaling, True, 0,
            K, KP, EP, SOFTMAX, HAS_BIAS, RENORM, TOPK,
        )  # fmt: skip

    @triton.jit
    def _select(
        logit_ptr, bias_ptr, idx_ptr, wt_ptr, score_ptr, n, E, scaling, STORE, slot,
        K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
        RENORM: tl.constexpr, TOPK: tl.constexpr = False,
    ):  # fmt: skip
        """Token ``n``'s routing from its fp32 logits: scores, top-k of scores + bias (NaN counts as the largest, as
        in torch.topk; ties: lowest index), mixture weights from the unbiased scores, renormalised (+1e-20) and
        scaled. Returns the expert id of slot ``slot`` (int32); where ``STORE``, also stores the ids, the scaled
        weights and the scores.

        Each pick is one max-reduction over 64-bit keys (the choice's order-preserving integer bits above, the
        complement of the expert index below), so the largest key is the largest choice at its lowest index: K
        reductions where a (max, argmin-index, gather) per pick took 3K, on the path every gate/up program of a
        fused selection walks before its first weight load. ``TOPK``: the KP largest keys by ``tl.topk`` (a bitonic
        top-k, sorted: the same picks in the same order, with 5 block-wide barriers at 4 warps instead of 23 for K = 8
        of 256 in the sm_90 compile)."""
        es = tl.arange(0, EP)
        em = es < E
        lg = tl.load(logit_ptr + n * E + es, mask=em, other=float("-inf"))
        if SOFTMAX:
            p = tl.exp(lg - tl.max(lg, 0))
            p = tl.where(em, p, 0.0)
            s = p / tl.sum(p, 0)
        else:
            s = tl.where(em, tl.sigmoid(lg), 0.0)
        choice = s
        if HAS_BIAS:
            choice = s + tl.load(bias_ptr + es, mask=em, other=0.0).to(tl.float32)
        # NaN as +inf; + 0.0 turns -0.0 into +0.0, which compare equal as floats but not as bits
        choice = tl.where(choice != choice, float("inf"), choice) + 0.0
        b = choice.to(tl.int32, bitcast=True)
        order = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed-integer order == float order
        low = (EP - 1 - es).to(tl.int64)
        key = tl.where(em, (order.to(tl.int64) << 32) | low, -9223372036854775807 - 1)
        ks = tl.arange(0, KP)
        if TOPK and KP > 1:  # keys are distinct (the index bits): the sorted top KP are the K picks in order
            sel_i = (EP - 1 - (tl.topk(key, KP) & 0xFFFFFFFF)).to(tl.int32)
            mine = tl.sum(tl.where((ks == slot) & (ks < K), sel_i, 0), 0)  # (0 past K, as the loop leaves it)
        else:
            sel_i = tl.zeros([KP], dtype=tl.int32)
            mine = 0
            for j in tl.static_range(K):
                top = tl.max(key, 0)
                i = (EP - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
                sel_i = tl.where(ks == j, i, sel_i)
                mine = tl.where(slot == j, i, mine)
                key = tl.where(es == i, -9223372036854775807 - 1, key)
        if STORE:
            km = ks < K
            hit = (es[None, :] == sel_i[:, None]) & km[:, None]
            sel_w = tl.sum(tl.where(hit, s[None, :], 0.0), 1)  # one nonzero term per slot: exact
            if RENORM:
                sel_w = sel_w / (tl.sum(sel_w, 0) + 1e-20)
            tl.store(score_ptr + n * E + es, s, mask=em)
            tl.store(idx_ptr + n * K + ks, sel_i.to(tl.int64), mask=km)
            tl.store(wt_ptr + n * K + ks, sel_w * scaling, mask=km)
        return mine

    @triton.jit
    def _shared_act(g, u, dt, MODE: tl.constexpr, sb1, isb1, sb2, isb2):
        """The shared experts' gated activation of their rounded gate / up projections ``g``, ``u`` (fp32 holding
        ``dt`` values): MODE 1 SwiGLU as their module forms it (``F.silu(g) * u``, each rounded), 2 SiTU-GLU."""
        sg = tl.sigmoid(g)
        if MODE == 1:
            a = _round(_round(g * sg, dt) * u, dt)
        else:
            a = (sb1 * tanh_f32(g * isb1)) * sg * (sb2 * tanh_f32(u * isb2))
        return a

    @triton.jit
    def _experts_up_kernel(
        x_ptr,
        idx_ptr,
        w1_ptr,
        w3_ptr,
        a_ptr,
        E,
        W,
        I,
        s_x,
        s1_e,
        s1_i,
        s3_e,
        s3_i,
        b1,
        ib1,
        b2,
        ib2,
        K: tl.constexpr,
        SITU: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_W: tl.constexpr,
        NW: tl.constexpr,
        STAGES: tl.constexpr,
        PDL: tl.constexpr,
        logit_ptr=None,
        bias_ptr=None,
        wt_ptr=None,
        score_ptr=None,
        scaling=1.0,
        SELECT: tl.constexpr = False,
        KP: tl.constexpr = 1,
        EP: tl.constexpr = 1,
        SOFTMAX: tl.constexpr = False,
        HAS_BIAS: tl.constexpr = False,
        RENORM: tl.constexpr = False,
        K1: tl.constexpr = 0,
        KT: tl.constexpr = 0,
        w1s_ptr=None,
        w3s_ptr=None,
        s1s_i=0,
        s3s_i=0,
        sb1=1.0,
        isb1=1.0,
        sb2=1.0,
        isb2=1.0,
        SHARED: tl.constexpr = 0,
        TOPK: tl.constexpr = False,
    ):
        """a[p, i] = act(round(x[p // K] . w1[e_p, i]), round(x[p // K] . w3[e_p, i])) for pair p, expert e_p (NaN
        for an expert id outside [0, E): no out-of-bounds read, and the bad id shows in the output). ``SELECT``: the
        routing is formed here from the router logits (:func:`_select`, every program its own token's), and the
        first program of each token stores it (ids, scaled weights, scores) for the down projection and combine.
        ``BLOCK_W`` 0: whole rows, as a power-of-two head of ``K1`` columns and a tail tile of ``KT`` (0: none),
        every weight byte of the program requested at once instead of streamed in ``BLOCK_W``-column steps.
        ``SHARED`` (1 SwiGLU as ``F.silu(g) * u``, each rounded; 2 SiTU-GLU): each token has a slot ``K`` more, its
        shared experts (``w1s``, ``w3s``: ``[I, W]``, betas ``sb1``, ``sb2``), and the pairs are ``(token, slot)``
        with ``K + 1`` slots per token."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        KS: tl.constexpr = K + (SHARED > 0)
        p = tl.program_id(0).to(tl.int64)
        n = p // KS
        j = p - n * KS
        if SELECT:
            first = (tl.program_id(1) == 0) & (j == 0)
            e = _select(
                logit_ptr, bias_ptr, idx_ptr, wt_ptr, score_ptr, n, E, scaling, first, j,
                K, KP, EP, SOFTMAX, HAS_BIAS, RENORM, TOPK,
            ).to(tl.int64)  # fmt: skip
        else:
            e = tl.load(idx_ptr + n * K + tl.minimum(j, K - 1)).to(tl.int64)
        ok = (e >= 0) & (e < E)
        e = tl.where(ok, e, 0)
        ii = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        im = ii < I
        g_row = w1_ptr + e * s1_e + ii * s1_i  # [BLOCK_I] row pointers
        u_row = w3_ptr + e * s3_e + ii * s3_i
        if SHARED > 0:
            sh = j == K
            ok = ok | sh
            g_row = tl.where(sh, w1s_ptr + ii * s1s_i, g_row)
            u_row = tl.where(sh, w3s_ptr + ii * s3s_i, u_row)
        if BLOCK_W == 0:
            c1 = tl.arange(0, K1)
            m1 = im[:, None] & (c1 < W)[None, :] & ok
            wg = tl.load(g_row[:, None] + c1[None, :], mask=m1, other=0.0)
            wu = tl.load(u_row[:, None] + c1[None, :], mask=m1, other=0.0)
            if KT > 0:
                c2 = K1 + tl.arange(0, KT)
                mt = im[:, None] & (c2 < W)[None, :] & ok
                wg2 = tl.load(g_row[:, None] + c2[None, :], mask=mt, other=0.0)
                wu2 = tl.load(u_row[:, None] + c2[None, :], mask=mt, other=0.0)
            xv = tl.load(x_ptr + n * s_x + c1, mask=c1 < W, other=0.0).to(tl.float32)
            gs = tl.sum(wg.to(tl.float32) * xv[None, :], 1)
            us = tl.sum(wu.to(tl.float32) * xv[None, :], 1)
            if KT > 0:
                x2 = tl.load(x_ptr + n * s_x + c2, mask=c2 < W, other=0.0).to(tl.float32)
                gs += tl.sum(wg2.to(tl.float32) * x2[None, :], 1)
                us += tl.sum(wu2.to(tl.float32) * x2[None, :], 1)
        else:
            g_acc = tl.zeros([BLOCK_I, BLOCK_W], dtype=tl.float32)
            u_acc = tl.zeros([BLOCK_I, BLOCK_W], dtype=tl.float32)
            for t in tl.range(NW, num_stages=STAGES):
                cols = t * BLOCK_W + tl.arange(0, BLOCK_W)
                cm = cols < W
                m2 = im[:, None] & cm[None, :] & ok
                xv = tl.load(x_ptr + n * s_x + cols, mask=cm, other=0.0).to(tl.float32)
                wg = tl.load(g_row[:, None] + cols[None, :], mask=m2, other=0.0)
                wu = tl.load(u_row[:, None] + cols[None, :], mask=m2, other=0.0)
                g_acc += wg.to(tl.float32) * xv[None, :]
                u_acc += wu.to(tl.float32) * xv[None, :]
            gs = tl.sum(g_acc, 1)
            us = tl.sum(u_acc, 1)
        dt = a_ptr.dtype.element_ty
        g = gs.to(dt).to(tl.float32)
        u = us.to(dt).to(tl.float32)
        sg = tl.sigmoid(g)
        if SITU:
            a = (b1 * tanh_f32(g * ib1)) * sg * (b2 * tanh_f32(u * ib2))
        else:
            a = g * sg * u
        if SHARED > 0:  # the shared experts' own activation (SwiGLU with their module's roundings, or SiTU)
            a = tl.where(sh, _shared_act(g, u, dt, SHARED, sb1, isb1, sb2, isb2), a)
        a = tl.where(ok, a, float("nan"))
        tl.store(a_ptr + p * I + ii, a.to(dt), mask=im)

    @triton.jit
    def _experts_down_kernel(
        a_ptr,
        idx_ptr,
        w2_ptr,
        y_ptr,
        E,
        W,
        I,
        s2_e,
        s2_w,
        BLOCK_O: tl.constexpr,
        BLOCK_I: tl.constexpr,
        NI: tl.constexpr,
        STAGES: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """y[p, o] = round(a[p] . w2[e_p, o]) for pair p (NaN for an expert id outside [0, E))."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        p = tl.program_id(0).to(tl.int64)
        e = tl.load(idx_ptr + p).to(tl.int64)
        ok = (e >= 0) & (e < E)
        e = tl.where(ok, e, 0)
        oo = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        om = oo < W
        acc = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
        for t in tl.range(NI, num_stages=STAGES):
            ii = t * BLOCK_I + tl.arange(0, BLOCK_I)
            im = ii < I
            av = tl.load(a_ptr + p * I + ii, mask=im, other=0.0).to(tl.float32)
            wv = tl.load(
                w2_ptr + e * s2_e + oo[:, None] * s2_w + ii[None, :],
                mask=om[:, None] & im[None, :] & ok,
                other=0.0,
            )
            acc += wv.to(tl.float32) * av[None, :]
        y = tl.where(ok, tl.sum(acc, 1), float("nan"))
        tl.store(y_ptr + p * W + oo, y.to(y_ptr.dtype.element_ty), mask=om)


if HAS_TRITON:

    @triton.jit
    def _down_tile(idx_ptr, w2_ptr, n, j, K: tl.constexpr, E, s2_e, s2_w, oo, ii, m):
        """Slot ``j``'s expert of token ``n``: (whether its id is in [0, E), its down-projection tile [rows oo, columns
        ii]; zeros for a bad id)."""
        e = tl.load(idx_ptr + n * K + j).to(tl.int64)
        ok = (e >= 0) & (e < E)
        e = tl.where(ok, e, 0)
        return ok, tl.load(w2_ptr + e * s2_e + oo[:, None] * s2_w + ii[None, :], mask=m & ok, other=0.0)

    @triton.jit
    def _experts_down_combine_kernel(
        a_ptr, idx_ptr, wt_ptr, w2_ptr, out_ptr, E, W, I, s2_e, s2_w, add_ptr, s_add, res_ptr, s_res, w2s_ptr,
        s2s_w, K: tl.constexpr, BLOCK_O: tl.constexpr, IP: tl.constexpr, PDL: tl.constexpr,
        ADD: tl.constexpr = False, RES: tl.constexpr = False, SHARED: tl.constexpr = False,
        gu_ptr=None, s_gu=0, sb1=1.0, isb1=1.0, sb2=1.0, isb2=1.0, GU: tl.constexpr = 0,
    ):  # fmt: skip
        """out[n, o] = sum_j wt[n, j] * round(a[n * K + j] . w2[e_j, o]), the sum in fp32 in slot order (the
        per-pair down kernel followed by combine2, in one pass; NaN for an expert id outside [0, E)). ``ADD``: then
        ``+ add[n, o]``, ``RES``: then ``res[n, o] +``, each rounded to the output dtype (separate adds' roundings).
        ``SHARED``: ``a`` holds ``K + 1`` rows per token, the last the shared experts' activation: their down
        projection (``w2s [W, I]``) rounded and added to the rounded mixture (before ``add``). ``GU`` (with
        ``SHARED``; 1 SwiGLU, 2 SiTU, as :func:`_shared_act`): that activation formed here instead, from the shared
        experts' gate and up projections' fp32 sums at ``gu [n, :I]``, ``gu [n, I:2I]`` (``a`` then holds ``K`` rows
        per token)."""
        ii = tl.arange(0, IP)
        im = ii < I
        oo = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        om = oo < W
        if SHARED:  # a weight: requested before the wait
            ws = tl.load(
                w2s_ptr + oo[:, None] * s2s_w + ii[None, :], mask=om[:, None] & im[None, :], other=0.0
            )
        pdl_wait(PDL)
        pdl_trigger(PDL)
        KS: tl.constexpr = K + (SHARED and GU == 0)
        n = tl.program_id(0).to(tl.int64)
        dt = out_ptr.dtype.element_ty
        m = om[:, None] & im[None, :]
        # the next expert's tile requested before the current one is used (registers)
        ok, w = _down_tile(idx_ptr, w2_ptr, n, 0, K, E, s2_e, s2_w, oo, ii, m)
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        for j in tl.static_range(K):
            if j + 1 < K:
                okf, wf = _down_tile(idx_ptr, w2_ptr, n, j + 1, K, E, s2_e, s2_w, oo, ii, m)
            av = tl.load(a_ptr + (n * KS + j) * I + ii, mask=im, other=0.0).to(tl.float32)
            y = tl.sum(w.to(tl.float32) * av[None, :], 1)
            y = tl.where(ok, y, float("nan")).to(dt).to(tl.float32)
            acc += y * tl.load(wt_ptr + n * K + j)
            if j + 1 < K:
                w = wf
                ok = okf
        y = _round(acc, dt)
        if SHARED:
            if GU > 0:
                g = tl.load(gu_ptr + n * s_gu + ii, mask=im, other=0.0).to(dt).to(tl.float32)
                u = tl.load(gu_ptr + n * s_gu + I + ii, mask=im, other=0.0).to(dt).to(tl.float32)
                av = _shared_act(g, u, dt, GU, sb1, isb1, sb2, isb2).to(dt).to(tl.float32)
            else:
                av = tl.load(a_ptr + (n * KS + K) * I + ii, mask=im, other=0.0).to(tl.float32)
            y = _round(y + _round(tl.sum(ws.to(tl.float32) * av[None, :], 1), dt), dt)
        if ADD:
            y = _round(y + tl.load(add_ptr + n * s_add + oo, mask=om, other=0.0).to(tl.float32), dt)
        if RES:
            y = _round(tl.load(res_ptr + n * s_res + oo, mask=om, other=0.0).to(tl.float32) + y, dt)
        tl.store(out_ptr + n * W + oo, y.to(dt), mask=om)


def _down_combine(
    a, idx, weights, w2, N, K, E, W, I, dtype, add=None, residual=None, w2s=None, gu=None
) -> torch.Tensor:
    """The down projection and weighted combine of :func:`experts_small` in one launch (``DOWN_COMBINE``), with the
    shared experts' down projection (``w2s``; ``gu``: their :class:`SharedExperts` whose gate / up sums are formed,
    the activation then formed here), the addend and the residual of :func:`experts_small` in its store."""
    c = DOWN_COMBINE
    slots = c["programs_per_sm"] * sm_count(a.device)
    bo = 1
    while bo * 2 <= c["max_bo"] and N * triton.cdiv(W, bo * 2) >= slots:
        bo *= 2
    out = torch.empty(N, W, dtype=dtype, device=a.device)
    pdl = pdl_on(a)
    ad = out if add is None else add
    rs = out if residual is None else residual
    _experts_down_combine_kernel[(N, triton.cdiv(W, bo))](
        a, idx, weights, w2, out, E, W, I, w2.stride(0), w2.stride(1), ad, ad.stride(0), rs, rs.stride(0),
        w2 if w2s is None else w2s, 0 if w2s is None else w2s.stride(0),
        K=K, BLOCK_O=bo, IP=triton.next_power_of_2(I), PDL=pdl, ADD=add is not None, RES=residual is not None,
        SHARED=w2s is not None, num_warps=c["num_warps"], **_gu_args(gu), **pdl_launch(pdl),
    )  # fmt: skip
    return out


def _shared_act_args(sx: SharedExperts) -> tuple[dict, int]:
    """The shared experts' activation arguments of the kernels (:func:`_shared_act`'s betas and reciprocals) and
    its mode (1 SwiGLU, 2 SiTU)."""
    b1, b2 = float(sx.beta1), float(sx.beta2)
    return dict(sb1=b1, isb1=1.0 / b1, sb2=b2, isb2=1.0 / b2), 2 if sx.act == "situ" else 1


def _gu_args(sx: SharedExperts | None) -> dict:
    """The down + combine kernel's arguments for shared experts whose gate / up sums are formed (``sx.gu``)."""
    if sx is None:
        return {}
    betas, mode = _shared_act_args(sx)
    return dict(gu_ptr=sx.gu, s_gu=sx.gu.stride(0), GU=mode, **betas)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (the kernels take the other strides as arguments)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_2d(name: str, t: torch.Tensor, cols: int | None = None) -> None:
    if t.dim() != 2 or (cols is not None and t.shape[1] != cols):
        raise ValueError(
            f"{name}: expected a 2-D tensor{'' if cols is None else f' with {cols} columns'}, got {tuple(t.shape)}"
        )


@dataclass
class SharedExperts:
    """A MoE layer's shared experts for :func:`experts_small`: ``w2 @ act(round(w1 x), round(w3 x))`` with ``w1``,
    ``w3``: ``[I, W]``, ``w2``: ``[W, I]`` (the routed experts' I), ``act`` "silu" (``F.silu(g) * u``, each rounded,
    as their module forms it) or "situ". ``gu`` (``[N, 2I]`` fp32, unit column stride): the tokens' gate and up
    projections already formed as unrounded fp32 sums (gate then up; e.g. by the router's GEMV, whose weight holds
    their rows behind the router's: :func:`route_logits_small` ``extra``); only ``w2`` is then read, and the
    activation is formed from ``gu`` rounded to the activation dtype."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    act: str = "silu"
    beta1: float = 4.0
    beta2: float = 25.0
    gu: torch.Tensor | None = None

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        from openk3.ops.activations import glu_act

        if self.gu is not None:
            I = self.w2.shape[1]
            g, u = self.gu[:, :I].to(x.dtype), self.gu[:, I:].to(x.dtype)
        else:
            g, u = F.linear(x, self.w1), F.linear(x, self.w3)
        return F.linear(glu_act(g, u, self.act, self.beta1, self.beta2), self.w2)


@dataclass
class PendingRoute:
    """Router logits whose selection :func:`experts_small` forms inside its first kernel (:func:`route_logits_small`).
    ``idx`` / ``weights`` / ``scores`` are filled by that call."""

    logits: torch.Tensor  # [N, E] fp32
    bias: torch.Tensor | None
    top_k: int
    activation: str
    renormalize: bool
    scaling: float
    idx: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    # [N, extra] fp32: the products of the router weight's rows past E (route_logits_small ``extra``)
    extra: torch.Tensor | None = None


def route_logits_small(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    activation: str = "sigmoid",
    renormalize: bool = True,
    scaling: float = 1.0,
    extra: int = 0,
) -> PendingRoute:
    """The router logits of :func:`route_small` (one kernel); the selection is left to :func:`experts_small`, which
    forms it in its gate/up kernel (one launch fewer on the path from the router to the experts).

    ``x`` may be an ``openk3.infer.gemv.Normed`` (the tokens' RMSNorm, written to its ``out`` when given): where the
    logits come from the GEMV, the norm is formed there and the normed rows written by the same launch; otherwise
    it is applied first.

    ``extra``: ``weight`` holds ``E + extra`` rows, the router's first; the products of the last ``extra`` rows with
    the (normed) input, fp32 sums like the logits, are returned in the route's ``extra`` ``[N, extra]`` -- e.g. the
    shared experts' gate and up projections, formed by the router's own launch (:class:`SharedExperts` ``gu``)."""
    if activation not in ("sigmoid", "softmax"):
        raise ValueError(f"unknown router activation {activation!r}")
    if weight.dim() != 2 or not 0 <= extra < weight.shape[0]:
        raise ValueError(
            f"router weight {tuple(weight.shape)}: expected [E + extra, D] with extra={extra} < rows"
        )
    E, D = weight.shape[0] - extra, weight.shape[1]
    from openk3.infer import gemv as _gemv

    normed = x if isinstance(x, _gemv.Normed) else None
    if normed is not None:
        _gemv._segments(normed)  # validated (shapes, gain, eps, out)
    elif not isinstance(x, torch.Tensor):
        raise ValueError(f"router input: expected a tensor or a Normed, got {type(x).__name__}")
    _check_2d("router input", x if normed is None else normed.x, D)
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    if bias is not None and bias.shape != (E,):
        raise ValueError(f"correction bias: expected shape ({E},), got {tuple(bias.shape)}")
    N = x.shape[0]
    weight = _row_major(weight)
    if 0 < N <= ROUTER_GEMV_MAX_TOKENS and _gemv.triton_gemv_ok(x, weight):
        out = _gemv.gemv(x, weight, out_dtype=torch.float32, rounded=False)
        return PendingRoute(
            out[:, :E],
            bias,
            top_k,
            activation,
            bool(renormalize),
            float(scaling),
            extra=out[:, E:] if extra else None,
        )
    if normed is not None:
        x = normed.value()
        if normed.out is not None:
            normed.out.copy_(x)
    x = _row_major(x)
    more = F.linear(x.float(), weight[E:].float()) if extra else None
    dev = x.device
    logits = torch.empty(N, E, dtype=torch.float32, device=dev)
    # experts per program: enough programs to spread the weight read over the SMs
    be = 1
    while be * 2 <= min(ROUTER_ROWS_MAX, N * E // 128):
        be *= 2
    bd = min(1024, triton.next_power_of_2(D))
    pdl = pdl_on(x)
    _router_logits_kernel[(N, triton.cdiv(E, be))](
        x,
        weight,
        logits,
        D,
        E,
        x.stride(0),
        weight.stride(0),
        BLOCK_E=be,
        BLOCK_D=bd,
        ND=triton.cdiv(D, bd),
        PDL=pdl,
        **pdl_launch(pdl),
    )
    return PendingRoute(logits, bias, top_k, activation, bool(renormalize), float(scaling), extra=more)


def _routing_args(pr: PendingRoute) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Fresh (idx, weights, scores) outputs for the pending route and the selection's compile-time constants."""
    N, E = pr.logits.shape
    dev = pr.logits.device
    pr.idx = torch.empty(N, pr.top_k, dtype=torch.long, device=dev)
    pr.weights = torch.empty(N, pr.top_k, dtype=torch.float32, device=dev)
    pr.scores = torch.empty(N, E, dtype=torch.float32, device=dev)
    consts = dict(
        KP=triton.next_power_of_2(pr.top_k),
        EP=triton.next_power_of_2(E),
        SOFTMAX=pr.activation == "softmax",
        HAS_BIAS=pr.bias is not None,
        RENORM=pr.renormalize,
        TOPK=SELECT_TOPK["on"],
    )
    return pr.idx, pr.weights, pr.scores, consts


def route_small(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    activation: str = "sigmoid",
    renormalize: bool = True,
    scaling: float = 1.0,
):
    """``openk3.ops.moe.route`` for ``n_group == 1`` in two kernels. x: [N, D]; weight: [E, D]; bias: [E] or None.
    Returns (topk_idx [N, k] int64, topk_weight [N, k] fp32, scores [N, E] fp32)."""
    pr = route_logits_small(
        x, weight, bias, top_k=top_k, activation=activation, renormalize=renormalize, scaling=scaling
    )
    idx, w, scores, consts = _routing_args(pr)
    pdl = pdl_on(x)
    _router_select_kernel[(x.shape[0],)](
        pr.logits,
        bias if bias is not None else pr.logits,
        idx,
        w,
        scores,
        pr.logits.shape[1],
        pr.scaling,
        K=top_k,
        PDL=pdl,
        **consts,
        **pdl_launch(pdl),
    )
    return idx, w, scores


def experts_small(
    x,
    idx,
    weights,
    w1,
    w2,
    w3,
    *,
    act="situ",
    beta1=4.0,
    beta2=25.0,
    add=None,
    residual=None,
    before_down=None,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """``openk3.ops.moe.experts_reference`` for a few tokens (no autograd). x: [N, W]; idx, weights: [N, k];
    w1, w3: [E, I, W]; w2: [E, W, I] (unit stride along the last dimension). Returns [N, W] in x.dtype. A token
    routed to an expert id outside [0, E) gets NaN (checked in the kernels: no host synchronisation, no
    out-of-bounds read). ``idx`` may instead be a :class:`PendingRoute` (``weights`` None): the selection is then
    formed in the gate/up kernel and left in the route's ``idx`` / ``weights`` / ``scores``.

    ``add``, ``residual`` ([N, W], x.dtype): returns ``residual + (mixture + add)`` instead, each add rounded to
    x.dtype (a MoE layer's shared-expert output and its residual; in the down + combine kernel's store where it
    runs). ``before_down``: called between the gate/up and the down launches (e.g. a stream wait for the kernels
    that write ``add``). ``shared``: the layer's shared experts (:class:`SharedExperts`), whose output is added to
    the mixture first, rounded (the MoE layer's output ``routed + shared``): at most ``DOWN_COMBINE_MAX_TOKENS``
    tokens as one more slot of the gate/up and the down + combine kernels, otherwise by PyTorch ops."""
    if act not in ("situ", "silu", "swiglu"):
        raise ValueError(f"unknown activation {act!r}; expected 'situ' or 'silu'")
    E, I, W = w1.shape
    _check_2d("expert input", x, W)
    N = x.shape[0]
    pending = idx if isinstance(idx, PendingRoute) else None
    if pending is not None:
        if pending.logits.shape != (N, E):
            raise ValueError(f"router logits {tuple(pending.logits.shape)} do not match [{N}, {E}]")
        idx, weights, scores, sel = _routing_args(pending)
        sel = dict(
            logit_ptr=pending.logits.contiguous(),  # (the kernel reads row n at n * E)
            bias_ptr=pending.bias if pending.bias is not None else pending.logits,
            wt_ptr=weights,
            score_ptr=scores,
            scaling=pending.scaling,
            SELECT=True,
            **sel,
        )
    else:
        sel = {}
    if idx.shape != weights.shape or idx.dim() != 2 or idx.shape[0] != N:
        raise ValueError(f"idx {tuple(idx.shape)} and weights {tuple(weights.shape)} must both be [{N}, k]")
    if w3.shape != w1.shape or w2.shape != (E, W, I):
        raise ValueError(f"expert weights: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}")
    for name, t in (("add", add), ("residual", residual)):
        if t is not None and (
            not isinstance(t, torch.Tensor) or t.shape != (N, W) or t.dtype != x.dtype or t.device != x.device
        ):
            raise ValueError(
                f"experts_small: {name} must be a [{N}, {W}] {x.dtype} tensor on {x.device}, got "
                + (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t))
            )
    if shared is not None:
        if not isinstance(shared, SharedExperts) or shared.act not in ("situ", "silu", "swiglu"):
            raise ValueError(
                f"experts_small: shared must be a SharedExperts with a known activation, got {shared!r}"
            )
        sw = (shared.w1, shared.w3, shared.w2)
        if (
            shared.w1.shape != (I, W)
            or shared.w3.shape != (I, W)
            or shared.w2.shape != (W, I)
            or any(t.dtype != w1.dtype or t.device != w1.device for t in sw)
        ):
            raise ValueError(
                f"experts_small: shared experts' weights {[tuple(t.shape) for t in sw]} must be [{I}, {W}], "
                f"[{I}, {W}], [{W}, {I}] in {w1.dtype} on {w1.device}"
            )
        gu = shared.gu
        if gu is not None and not (
            isinstance(gu, torch.Tensor)
            and gu.shape == (N, 2 * I)
            and gu.dtype == torch.float32
            and gu.device == x.device
            and gu.stride(-1) == 1
        ):
            raise ValueError(
                f"experts_small: the shared experts' formed gate / up sums must be a [{N}, {2 * I}] float32 tensor "
                f"on {x.device} with unit column stride, got "
                + (
                    f"{tuple(gu.shape)} {gu.dtype} on {gu.device}"
                    if isinstance(gu, torch.Tensor)
                    else repr(gu)
                )
            )
    K = idx.shape[1]
    if N == 0:
        if before_down is not None:
            before_down()
        return x.new_zeros(x.shape)
    x, w1, w2, w3 = (_row_major(t) for t in (x, w1, w2, w3))
    idx = idx.contiguous()
    dev = x.device
    # the shared experts in the down + combine kernel: as one more slot of both kernels, or (their gate / up sums
    # formed) in that kernel alone
    slot = shared is not None and N <= DOWN_COMBINE_MAX_TOKENS
    formed = slot and shared.gu is not None
    sd = None
    if shared is not None and not slot:
        sd = shared.reference(x)
    KS = K + int(slot and not formed)
    a = torch.empty(N * KS, I, dtype=x.dtype, device=dev)
    if slot:
        s2 = _row_major(shared.w2)
    if slot and not formed:
        s1, s3 = (_row_major(t) for t in (shared.w1, shared.w3))
        betas, mode = _shared_act_args(shared)
        sel = dict(sel, w1s_ptr=s1, w3s_ptr=s3, s1s_i=s1.stride(0), s3s_i=s3.stride(0), SHARED=mode, **betas)
    bi, bw, ups = UP_TILE
    if bw:
        bw = min(bw, triton.next_power_of_2(W))
        k1 = kt = 0
    else:  # whole rows: a power-of-two head and tail tile
        k1, kt = head_tail(W)
    pdl = pdl_on(x)
    _experts_up_kernel[(N * KS, triton.cdiv(I, bi))](
        x,
        idx,
        w1,
        w3,
        a,
        E,
        W,
        I,
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        w3.stride(0),
        w3.stride(1),
        float(beta1),
        1.0 / float(beta1),
        float(beta2),
        1.0 / float(beta2),
        K=K,
        SITU=act == "situ",
        BLOCK_I=bi,
        BLOCK_W=bw,
        NW=triton.cdiv(W, bw) if bw else 1,
        STAGES=ups,
        PDL=pdl,
        K1=k1,
        KT=kt,
        **sel,
        **pdl_launch(pdl),
    )
    if before_down is not None:
        before_down()
    if N <= DOWN_COMBINE_MAX_TOKENS:
        return _down_combine(
            a, idx, weights.float().contiguous(), w2, N, K, E, W, I, x.dtype,
            None if add is None else _row_major(add), None if residual is None else _row_major(residual),
            s2 if slot else None, shared if formed else None,
        )  # fmt: skip
    y = torch.empty(N * K, W, dtype=x.dtype, device=dev)
    bo, bk, dns = DOWN_TILE
    bk = min(bk, triton.next_power_of_2(I))
    _experts_down_kernel[(N * K, triton.cdiv(W, bo))](
        a,
        idx,
        w2,
        y,
        E,
        W,
        I,
        w2.stride(0),
        w2.stride(1),
        BLOCK_O=bo,
        BLOCK_I=bk,
        NI=triton.cdiv(I, bk),
        STAGES=dns,
        PDL=pdl,
        **pdl_launch(pdl),
    )
    out = combine2(y, None, weights.float().contiguous(), x.dtype, shape=(N, K))
    if sd is not None:
        out = out + sd
    if add is not None:
        out = out + add
    return out if residual is None else residual + out
