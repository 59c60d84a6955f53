"""A plain MoE layer's decode step for one token in one persistent Triton launch.

At batch 1 the MoE half of a layer is three weight streams that depend on each other: the router (with, in the
engine's ``FOLD_SHARED`` "router" layout, the shared experts' gate and up rows behind the router's), the routed
experts' gate / up rows (the experts known only once the router is done), and the down projections with the
weighted combine. As three launches (``openk3.fast.moe_small``) each boundary costs the drain of one kernel and the
ramp of the next: on an H200 the 48B shape's MoE half took ~45 us for ~31 us of bytes (bench/NOTES.md v18-v20).

:func:`moe_token` runs them as phases of one launch of one program per SM, separated by grid-wide barriers (an
arrival counter in global memory, released and acquired at GPU scope; every program must be resident at once, so the
grid is the SM count and the programs wait on nothing but each other):

1. ``RMSNorm(r)`` and the router rows (plus the shared experts' gate / up rows) as fp32 sums, each program a
   contiguous range of rows held whole in registers, requested before the PDL wait (weights only);
2. every program forms the top-k from the logits (the selection of :func:`moe_small._select`), then its contiguous
   range of the ``k x I`` routed activations (gate / up rows streamed through shared memory) and of the shared
   experts' activations (from their sums of phase 1);
3. units of ``rb`` output rows of one picked expert's down projection (then of the shared experts'), dealt to the
   programs in turn, each unit's rows rounded and stored;
4. each program a range of output columns: the mixture in fp32 in slot order, the shared output, the residual.

Values and roundings are those of ``moe_small``'s router GEMV + ``experts_small`` with formed shared gate / up sums
(``openk3.ops.moe``'s reference up to fp32 summation order). Off CUDA (the interpreter runs programs one after
another, so a barrier between programs would never open) the same phases run as three launches (``split``).
"""

from __future__ import annotations

import torch

from openk3.fast._triton import (
    HAS_TRITON,
    INTERPRET,
    head_tail,
    pdl_launch,
    pdl_on,
    resident_per_sm,
    sm_count,
    tl,
    triton,
)
from openk3.fast.moe_small import SELECT_TOPK

# launch settings: warps per program, programs per SM asked for (fewer where the compiled kernel's registers or shared
# memory do not let that many be resident at once), pipeline stages of the gate/up and down loops, columns per step
# of the router / gate-up / down loops, rows per unit of the down projections, the most router values held whole
CONFIG = {
    "num_warps": 8,
    "per_sm": 1,
    "stages": 3,
    "bk1": 256,
    "bk2": 128,
    "rb": 16,
    "whole1_max_elems": 32 * 2304,
}
_GRIDS: dict[tuple, int] = {}  # (launch constants, device) -> programs per SM that were found resident


if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait, tanh_f32
    from openk3.fast._triton import round_to as _round
    from openk3.fast.moe_small import _mix_weights, _pick, _shared_act, _store_route

    @triton.jit
    def _grid_sync(ctr_ptr, target, SPIN: tl.constexpr):
        """Arrive at the grid-wide barrier and wait until ``target`` arrivals are counted (the program's earlier
        stores visible to every program that passes). After ``SPIN`` polls without them the program marks the
        launch as failed (``ctr[1] = 1``, :func:`check_counter`) and goes on: a grid that cannot be resident at
        once gives a reported error instead of a hung GPU."""
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        n = 0
        while (seen < target) & (n < SPIN):
            seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
            n += 1
        if seen < target:
            tl.atomic_xchg(ctr_ptr + 1, 1, sem="relaxed", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _stamp(ts_ptr, k: tl.constexpr, TS: tl.constexpr):
        """``TS``: the GPU's global nanosecond timer stored at ``ts[program, k]`` (a phase timeline, benchmarks)."""
        if TS:
            t = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
            tl.store(ts_ptr + tl.program_id(0) * 8 + k, t)

    @triton.jit
    def _pick_of(vals, ks, j):
        """``vals[j]`` of a ``[KP]`` vector (a sum with one nonzero term: exact)."""
        return tl.sum(tl.where(ks == j, vals, tl.zeros_like(vals)), 0)

    @triton.jit
    def _moe_token_kernel(
        r_ptr, nw_ptr, eps, wr_ptr, s_wr, bias_ptr, lg_ptr, xn_ptr, idx_ptr, wt_ptr, score_ptr, scaling,
        w1_ptr, w3_ptr, s1_e, s1_i, s3_e, s3_i, a_ptr, w2_ptr, s2_e, s2_w, w2s_ptr, s2s_w, yb_ptr, y_ptr, ctr_ptr,
        b1, ib1, b2, ib2, sb1, isb1, sb2, isb2,
        G: tl.constexpr, D: tl.constexpr, E: tl.constexpr, I: tl.constexpr, K: tl.constexpr, SH: tl.constexpr,
        KP: tl.constexpr, EP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
        RENORM: tl.constexpr, SITU: tl.constexpr, GU: tl.constexpr, P1: tl.constexpr, D1: tl.constexpr,
        DT: tl.constexpr, BK1: tl.constexpr, P2: tl.constexpr, BK2: tl.constexpr, RB: tl.constexpr,
        IP: tl.constexpr, P4: tl.constexpr, STAGES: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr,
        ts_ptr=None, TS: tl.constexpr = False, SPIN: tl.constexpr = 1 << 22, TOPK: tl.constexpr = False,
    ):  # fmt: skip
        """One token's MoE layer (module docstring); ``PHASE`` 0 all four phases with barriers between them,
        1-4 that phase alone (one launch each). ``SH``: the shared experts' width (0: none; their gate / up rows
        follow the router's ``E`` rows of ``wr``, their activation ``GU`` 1 SwiGLU, 2 SiTU). ``BK1`` 0: phase 1
        holds its rows whole (a power-of-two head ``D1`` and tail ``DT`` of the columns), requested before the
        PDL wait; otherwise it streams them in ``BK1``-column steps."""
        _stamp(ts_ptr, 0, TS)
        pid = tl.program_id(0)  # of G programs
        dt = y_ptr.dtype.element_ty
        R1: tl.constexpr = E + 2 * SH
        lo1 = pid * R1 // G
        hi1 = (pid + 1) * R1 // G
        rows1 = lo1 + tl.arange(0, P1)
        m1 = rows1 < hi1
        wrow = wr_ptr + rows1[:, None].to(tl.int64) * s_wr
        if BK1 == 0 and PHASE <= 1:  # weights: requested before the wait
            ch = tl.arange(0, D1)
            wh = tl.load(wrow + ch[None, :], mask=m1[:, None] & (ch < D)[None, :], other=0.0)
            if DT > 0:
                ct = D1 + tl.arange(0, DT)
                wt1 = tl.load(wrow + ct[None, :], mask=m1[:, None] & (ct < D)[None, :], other=0.0)
        pdl_wait(PDL)
        _stamp(ts_ptr, 1, TS)
        if PHASE != 0:
            pdl_trigger(PDL)
        ks = tl.arange(0, KP)
        # ---- phase 1: the norm and the router (+ shared gate / up) rows
        if PHASE <= 1:
            if BK1 == 0:
                xh = tl.load(r_ptr + ch, mask=ch < D, other=0.0).to(tl.float32)
                ss = tl.sum(xh * xh, 0)
                if DT > 0:
                    xt = tl.load(r_ptr + ct, mask=ct < D, other=0.0).to(tl.float32)
                    ss += tl.sum(xt * xt, 0)
                rinv = tl.rsqrt(ss / D + eps)
                gh = _round(tl.load(nw_ptr + ch, mask=ch < D, other=0.0).to(tl.float32), dt)
                xh = _round(gh * _round(xh * rinv, dt), dt)
                tl.store(xn_ptr + ch, xh.to(dt), mask=(ch < D) & (pid == 0))
                acc1 = tl.sum(wh.to(tl.float32) * xh[None, :], 1)
                if DT > 0:
                    gt = _round(tl.load(nw_ptr + ct, mask=ct < D, other=0.0).to(tl.float32), dt)
                    xt = _round(gt * _round(xt * rinv, dt), dt)
                    tl.store(xn_ptr + ct, xt.to(dt), mask=(ct < D) & (pid == 0))
                    acc1 += tl.sum(wt1.to(tl.float32) * xt[None, :], 1)
            else:
                dd = tl.arange(0, D1)
                xr = tl.load(r_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
                rinv = tl.rsqrt(tl.sum(xr * xr, 0) / D + eps)
                accs = tl.zeros([P1, BK1], dtype=tl.float32)
                for t in tl.range(0, (D + BK1 - 1) // BK1, num_stages=STAGES):
                    c1 = t * BK1 + tl.arange(0, BK1)
                    n1 = c1 < D
                    x1 = tl.load(r_ptr + c1, mask=n1, other=0.0).to(tl.float32)
                    g1 = _round(tl.load(nw_ptr + c1, mask=n1, other=0.0).to(tl.float32), dt)
                    x1 = _round(g1 * _round(x1 * rinv, dt), dt)
                    tl.store(xn_ptr + c1, x1.to(dt), mask=n1 & (pid == 0))
                    w1t = tl.load(wrow + c1[None, :], mask=m1[:, None] & n1[None, :], other=0.0)
                    accs += w1t.to(tl.float32) * x1[None, :]
                acc1 = tl.sum(accs, 1)
            tl.store(lg_ptr + rows1, acc1, mask=m1)
            _stamp(ts_ptr, 2, TS)
        if PHASE == 0:
            _grid_sync(ctr_ptr, G, SPIN)
            _stamp(ts_ptr, 3, TS)
        # ---- the routing (every program its own copy; program 0 stores it)
        if PHASE == 0 or PHASE == 2 or PHASE == 3 or PHASE == 4:
            s, sel_i, _ = _pick(lg_ptr, bias_ptr, 0, E, 0, K, KP, EP, SOFTMAX, HAS_BIAS, TOPK)
        if PHASE == 0 or PHASE == 2:
            if pid == 0:
                _store_route(
                    idx_ptr, wt_ptr, score_ptr, 0, E, s, sel_i, _mix_weights(s, sel_i, scaling, K, KP, EP, RENORM),
                    K, KP, EP,
                )  # fmt: skip
            _stamp(ts_ptr, 4, TS)
            # ---- phase 2: this program's range of the activations: the K x I routed ones (gate / up rows), then
            # the SH shared ones (from their gate / up sums of phase 1)
            KI: tl.constexpr = K * I
            A2: tl.constexpr = KI + SH
            lo2 = pid * A2 // G
            hi2 = (pid + 1) * A2 // G
            f = lo2 + tl.arange(0, P2)
            m2 = f < hi2
            routed = f < KI
            slot = f // I
            ii = (f - slot * I).to(tl.int64)
            e2 = tl.sum(tl.where(ks[None, :] == slot[:, None], sel_i[None, :], 0), 1).to(tl.int64)
            g_row = w1_ptr + e2 * s1_e + ii * s1_i
            u_row = w3_ptr + e2 * s3_e + ii * s3_i
            mw = m2 & routed
            g_acc = tl.zeros([P2, BK2], dtype=tl.float32)
            u_acc = tl.zeros([P2, BK2], dtype=tl.float32)
            for t in tl.range(0, (D + BK2 - 1) // BK2, num_stages=STAGES):
                kk = t * BK2 + tl.arange(0, BK2)
                km = kk < D
                xv = tl.load(xn_ptr + kk, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
                mk = mw[:, None] & km[None, :]
                wg = tl.load(g_row[:, None] + kk[None, :], mask=mk, other=0.0)
                wu = tl.load(u_row[:, None] + kk[None, :], mask=mk, other=0.0)
                g_acc += wg.to(tl.float32) * xv[None, :]
                u_acc += wu.to(tl.float32) * xv[None, :]
            g = _round(tl.sum(g_acc, 1), dt)
            u = _round(tl.sum(u_acc, 1), dt)
            sg = tl.sigmoid(g)
            if SITU:
                a = (b1 * tanh_f32(g * ib1)) * sg * (b2 * tanh_f32(u * ib2))
            else:
                a = g * sg * u
            a = _round(a, dt)
            if SH > 0:
                fs = f - KI
                ms = m2 & (f >= KI)
                gs = _round(tl.load(lg_ptr + E + fs, mask=ms, other=0.0, cache_modifier=".cg"), dt)
                us = _round(tl.load(lg_ptr + E + SH + fs, mask=ms, other=0.0, cache_modifier=".cg"), dt)
                a = tl.where(routed, a, _round(_shared_act(gs, us, dt, GU, sb1, isb1, sb2, isb2), dt))
            tl.store(a_ptr + f, a.to(dt), mask=m2)
            _stamp(ts_ptr, 5, TS)
        if PHASE == 0:
            _grid_sync(ctr_ptr, 2 * G, SPIN)
        # ---- phase 3: units of RB output rows of one picked expert's down projection, spread over the programs in
        # turn, then the shared experts' units: each slot's output, rounded
        if PHASE == 0 or PHASE == 3:
            NB: tl.constexpr = (D + RB - 1) // RB
            cc = tl.arange(0, IP)
            cm3 = cc < I
            for t in tl.range(0, (K * NB + G - 1) // G, num_stages=STAGES):
                u3 = pid + t * G
                j3 = tl.minimum(u3 // NB, K - 1)
                o3 = (u3 - j3 * NB) * RB + tl.arange(0, RB)
                om3 = (o3 < D) & (u3 < K * NB)
                e3 = _pick_of(sel_i, ks, j3).to(tl.int64)
                a3 = tl.load(a_ptr + j3 * I + cc, mask=cm3, other=0.0, cache_modifier=".cg").to(tl.float32)
                w3t = tl.load(
                    w2_ptr + e3 * s2_e + o3[:, None] * s2_w + cc[None, :],
                    mask=om3[:, None] & cm3[None, :],
                    other=0.0,
                )
                tl.store(
                    yb_ptr + j3 * D + o3, _round(tl.sum(w3t.to(tl.float32) * a3[None, :], 1), dt), mask=om3
                )
            if SH > 0:  # the shared units continue the turn where the routed ones ended
                b0 = (pid - (K * NB) % G + G) % G
                cs = cc < SH
                a4 = tl.load(a_ptr + K * I + cc, mask=cs, other=0.0, cache_modifier=".cg").to(tl.float32)
                for t in tl.range(0, (NB + G - 1) // G, num_stages=STAGES):
                    o4 = (b0 + t * G) * RB + tl.arange(0, RB)
                    om4 = o4 < D  # (units past the last: rows past D)
                    w4 = tl.load(
                        w2s_ptr + o4[:, None] * s2s_w + cc[None, :],
                        mask=om4[:, None] & cs[None, :],
                        other=0.0,
                    )
                    tl.store(
                        yb_ptr + K * D + o4, _round(tl.sum(w4.to(tl.float32) * a4[None, :], 1), dt), mask=om4
                    )
            _stamp(ts_ptr, 6, TS)
        if PHASE == 0:
            _grid_sync(ctr_ptr, 3 * G, SPIN)
            pdl_trigger(PDL)
        # ---- phase 4: this program's output columns: the mixture in slot order, the shared output, the residual
        if PHASE == 0 or PHASE == 4:
            sel_w = _mix_weights(s, sel_i, scaling, K, KP, EP, RENORM)
            lo4 = pid * D // G
            oo = lo4 + tl.arange(0, P4)
            om = oo < (pid + 1) * D // G
            acc = tl.zeros([P4], dtype=tl.float32)
            for jm in tl.static_range(K):
                yj = tl.load(yb_ptr + jm * D + oo, mask=om, other=0.0, cache_modifier=".cg")
                acc += yj * _pick_of(sel_w, ks, jm)
            y = _round(acc, dt)
            if SH > 0:
                y = _round(y + tl.load(yb_ptr + K * D + oo, mask=om, other=0.0, cache_modifier=".cg"), dt)
            res = tl.load(r_ptr + oo, mask=om, other=0.0).to(tl.float32)
            tl.store(y_ptr + oo, _round(res + y, dt).to(dt), mask=om)
            _stamp(ts_ptr, 7, TS)
        if PHASE == 0:  # the last program out resets the counter for the next launch
            tl.debug_barrier()
            old = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
            if old == 4 * G - 1:
                tl.atomic_xchg(ctr_ptr, 0, sem="relaxed", scope="gpu")


class MoEToken:
    """Outputs of :func:`moe_token` besides the layer output: the normed row ``xn [1, D]``, the router logits
    ``logits [1, E]`` (and the shared experts' gate / up sums ``extra [1, 2 * SH]``), the routing ``idx``,
    ``weights`` ``[1, k]`` and ``scores`` ``[1, E]``."""

    def __init__(self, xn, lg, E, idx, weights, scores, grid):
        self.xn, self.logits, self.extra = xn, lg[:, :E], lg[:, E:]
        self.idx, self.weights, self.scores = idx, weights, scores
        self.grid = grid  # the launch's program count


def moe_token_reference(
    r, norm_weight, eps, router_w, bias, w1, w2, w3, *, top_k, activation="sigmoid", renormalize=True,
    scaling=1.0, act="situ", beta1=4.0, beta2=25.0, shared=None,
) -> torch.Tensor:  # fmt: skip
    """:func:`moe_token`'s output by PyTorch ops: ``openk3.ops`` RMSNorm, router (``route``), routed experts
    (``experts_reference``), the shared experts' activation of their rounded fp32 gate / up sums and their down
    projection, ``r + (routed + shared)``."""
    import torch.nn.functional as F

    from openk3.ops.activations import glu_act
    from openk3.ops.moe import experts_reference, route
    from openk3.ops.norm import rms_norm

    E = w1.shape[0]
    xn = rms_norm(r, norm_weight, eps)
    idx, w, _ = route(
        xn, router_w[:E], bias, top_k=top_k, activation=activation, renormalize=renormalize, scaling=scaling
    )
    out = experts_reference(xn, idx, w, w1, w2, w3, act=act, beta1=beta1, beta2=beta2)
    if shared is not None:
        SH = shared.w2.shape[1]
        gu = F.linear(xn.float(), router_w[E:].float())
        a = glu_act(gu[:, :SH].to(r.dtype), gu[:, SH:].to(r.dtype), shared.act, shared.beta1, shared.beta2)
        out = out + F.linear(a, shared.w2)
    return r + out


def moe_token_ok(r: torch.Tensor) -> bool:
    """Whether :func:`moe_token` can run on the residual row ``r`` (Triton on CUDA, or the interpreter)."""
    return HAS_TRITON and (INTERPRET or r.is_cuda) and r.dim() == 2 and r.shape[0] == 1


def new_counter(device) -> torch.Tensor:
    """A zeroed barrier counter for :func:`moe_token` (one 128-byte line; each launch leaves its count, element 0, at
    zero; element 1 is set where a barrier gave up waiting, :func:`check_counter`)."""
    return torch.zeros(32, dtype=torch.int32, device=device)


def check_counter(counter: torch.Tensor) -> None:
    """Raise ``RuntimeError`` where a launch on ``counter`` found its grid not resident at once (a barrier gave up
    waiting, so its output is wrong), clearing the mark. Reads the device: call it outside the step."""
    if int(counter[1].item()) != 0:
        counter[1] = 0
        raise RuntimeError(
            "moe_token: a grid-wide barrier timed out (the launch's programs were not all resident at once); its "
            "output is wrong. Lower openk3.fast.moe_fused.CONFIG['per_sm'] or turn moe_one_launch off"
        )


def _resident_grid(args: tuple, consts_for, dev) -> int:
    """The programs of the one-launch grid: ``CONFIG["per_sm"]`` per SM, or as many fewer as the compiled kernel's
    registers / shared memory let be resident at once (each count compiled, not launched; cached)."""
    sms = sm_count(dev)
    want = max(1, int(CONFIG["per_sm"]))
    key = (tuple(sorted(consts_for(sms * want).items())), str(args[0].dtype), dev.index)
    if key not in _GRIDS:
        n = want
        while n > 1:
            consts = consts_for(sms * n)
            ck = _moe_token_kernel.warmup(
                *args, PHASE=0, **consts, **pdl_launch(consts["PDL"]), grid=(consts["G"],)
            )
            if resident_per_sm(ck, consts["num_warps"], dev) >= n:
                break
            n -= 1
        _GRIDS[key] = n
    return sms * _GRIDS[key]


def moe_token(
    r: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_w: torch.Tensor,
    bias: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    counter: torch.Tensor,
    *,
    top_k: int,
    activation: str = "sigmoid",
    renormalize: bool = True,
    scaling: float = 1.0,
    act: str = "situ",
    beta1: float = 4.0,
    beta2: float = 25.0,
    shared=None,
    split: bool | None = None,
    grid: int | None = None,
    timeline: torch.Tensor | None = None,
    spin: int | None = None,
) -> tuple[torch.Tensor, MoEToken]:
    """``r + MoE(rms_norm(r, norm_weight, eps))`` for one token ``r [1, D]`` (a plain MoE layer: router with
    ``openk3.ops.moe.route``'s options, routed experts ``w1``, ``w3`` ``[E, I, D]``, ``w2`` ``[E, D, I]``, and
    ``shared`` experts as ``moe_small.SharedExperts`` of the same width, whose gate and up rows are rows ``E:E+I``
    and ``E+I:E+2I`` of ``router_w``; their ``w1`` / ``w3`` / ``gu`` are not read) in one launch (module
    docstring). ``counter``: :func:`new_counter`'s buffer, not shared with a launch that may run at the same time.
    ``split``: the phases as separate launches (default: off CUDA). ``timeline`` (benchmarks; compiled kernels): an
    int64 ``[grid, 8]`` tensor that gets each program's global-timer readings in ns (start, after the PDL wait, after
    phase 1, after the first barrier, before phase 2's loop, after phase 2, after phase 3, end). ``grid``: the
    program count (default: ``CONFIG["per_sm"]`` per SM where that many are resident at once); ``spin``: polls a
    barrier waits before it gives up and marks the counter (tests; default ``1 << 22``).
    Returns (the output ``[1, D]``,
    :class:`MoEToken`)."""
    if not moe_token_ok(r):
        raise ValueError(
            f"moe_token: expected one row [1, D] on CUDA (or the interpreter), got {tuple(r.shape)}"
        )
    if act not in ("situ", "silu", "swiglu") or activation not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_token: unknown activation {act!r} / router activation {activation!r}")
    E, I, D = w1.shape
    SH = 0 if shared is None else shared.w2.shape[1]
    if r.shape[1] != D or norm_weight.shape != (D,) or router_w.shape != (E + 2 * SH, D):
        raise ValueError(
            f"moe_token: r {tuple(r.shape)}, norm {tuple(norm_weight.shape)}, router {tuple(router_w.shape)} do "
            f"not match D={D}, E={E} and {SH} shared columns"
        )
    if w3.shape != w1.shape or w2.shape != (E, D, I):
        raise ValueError(
            f"moe_token: expert weights w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}"
        )
    if shared is not None and (shared.w2.shape != (D, SH) or shared.act not in ("situ", "silu", "swiglu")):
        raise ValueError(
            f"moe_token: shared experts' down projection {tuple(shared.w2.shape)} is not [{D}, {SH}]"
        )
    if not 0 < top_k <= E:
        raise ValueError(f"moe_token: top_k must be in [1, {E}], got {top_k}")
    if bias is not None and bias.shape != (E,):
        raise ValueError(f"moe_token: correction bias of shape {tuple(bias.shape)}, expected ({E},)")
    ws = [router_w, w1, w2, w3] + ([shared.w2] if shared is not None else [])
    if any(t.stride(-1) != 1 for t in ws) or r.stride(-1) != 1:
        raise ValueError("moe_token: weights and r need unit stride along their last dimension")
    if counter.dtype != torch.int32 or counter.device != r.device or counter.numel() < 1:
        raise ValueError("moe_token: counter must be new_counter()'s int32 buffer on r's device")
    dev = r.device
    if split is None:
        split = not r.is_cuda
    NS = top_k + (SH > 0)
    lg = torch.empty(1, E + 2 * SH, dtype=torch.float32, device=dev)
    xn = torch.empty(1, D, dtype=r.dtype, device=dev)
    a = torch.empty(top_k * I + SH, dtype=r.dtype, device=dev)
    yb = torch.empty(NS * D, dtype=torch.float32, device=dev)
    y = torch.empty(1, D, dtype=r.dtype, device=dev)
    idx = torch.empty(1, top_k, dtype=torch.long, device=dev)
    wts = torch.empty(1, top_k, dtype=torch.float32, device=dev)
    scores = torch.empty(1, E, dtype=torch.float32, device=dev)
    c = CONFIG
    b1, b2 = float(beta1), float(beta2)
    if shared is not None:
        sb1, sb2 = float(shared.beta1), float(shared.beta2)
        gu = 2 if shared.act == "situ" else 1
    else:
        sb1 = sb2 = 1.0
        gu = 0
    pdl = pdl_on(r)
    cdiv, np2 = triton.cdiv, triton.next_power_of_2
    args = (
        r, norm_weight, float(eps), router_w, router_w.stride(0), bias if bias is not None else lg, lg, xn, idx,
        wts, scores, float(scaling), w1, w3, w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), a, w2,
        w2.stride(0), w2.stride(1), w2 if shared is None else shared.w2, 0 if shared is None else shared.w2.stride(0),
        yb, y, counter, b1, 1.0 / b1, b2, 1.0 / b2, sb1, 1.0 / sb1, sb2, 1.0 / sb2,
    )  # fmt: skip

    def consts_for(G, cap=True):
        G = max(1, min(G, D, E + 2 * SH, top_k * I) if cap else G)
        P1 = np2(cdiv(E + 2 * SH, G))
        whole = P1 * D <= c["whole1_max_elems"]
        d1, dtail = head_tail(D) if whole else (np2(D), 0)
        return dict(
            G=G, D=D, E=E, I=I, K=top_k, SH=SH, KP=np2(top_k), EP=np2(E), SOFTMAX=activation == "softmax",
            HAS_BIAS=bias is not None, RENORM=bool(renormalize), SITU=act == "situ", GU=gu, P1=P1, D1=d1, DT=dtail,
            BK1=0 if whole else min(c["bk1"], np2(D)), P2=np2(cdiv(top_k * I + SH, G)), BK2=min(c["bk2"], np2(D)),
            RB=min(c["rb"], np2(D)), IP=np2(max(I, SH)), P4=np2(cdiv(D, G)), STAGES=c["stages"], PDL=pdl,
            TOPK=bool(SELECT_TOPK["on"]), num_warps=c["num_warps"],
        )  # fmt: skip

    if grid is not None:
        if grid < 1:
            raise ValueError(f"moe_token: grid must be >= 1 programs, got {grid}")
        consts = consts_for(int(grid), cap=False)
    elif split:
        consts = consts_for(sm_count(dev))
    else:
        consts = consts_for(_resident_grid(args, consts_for, dev))
    G = consts["G"]
    if timeline is not None:
        if INTERPRET or timeline.dtype != torch.int64 or timeline.dim() != 2 or timeline.shape[0] < G:
            raise ValueError(
                f"moe_token: timeline must be a compiled run's int64 [>= {G}, 8] tensor on {dev}"
            )
        if timeline.shape[1] != 8 or timeline.device != dev or not timeline.is_contiguous():
            raise ValueError(f"moe_token: timeline must be a contiguous int64 [>= {G}, 8] tensor on {dev}")
        consts.update(ts_ptr=timeline, TS=True)
    if spin is not None:
        if spin < 1:
            raise ValueError(f"moe_token: spin must be >= 1 polls, got {spin}")
        consts.update(SPIN=int(spin))
    for phase in (1, 2, 3, 4) if split else (0,):
        _moe_token_kernel[(G,)](*args, PHASE=phase, **consts, **pdl_launch(pdl))
    return y, MoEToken(xn, lg, E, idx, wts, scores, G)
