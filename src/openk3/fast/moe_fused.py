"""A plain MoE layer's decode step for one token in one persistent Triton launch.

At batch 1 the MoE half of a layer is three weight streams that depend on each other: the router (with, in the
engine's ``FOLD_SHARED`` "router" layout, the shared experts' gate and up rows behind the router's), the routed
experts' gate / up rows (the experts known only once the router is done), and the down projections with the
weighted combine. As three launches (``openk3.fast.moe_small``) each boundary costs the drain of one kernel and the
ramp of the next: on an H200 the 48B shape's MoE half took ~45 us for ~31 us of bytes (bench/NOTES.md v18-v20).

:func:`moe_token` runs the three as phases of one launch of one program per SM, separated by grid-wide barriers
(an arrival counter in global memory, released and acquired at GPU scope; every program must be resident at once,
so the grid is the SM count and the programs wait on nothing but each other):

1. ``RMSNorm(r)`` and the router rows (plus the shared experts' gate / up rows): fp32 sums, each program a
   contiguous range of rows; before its PDL wait each program asks for its rows (and its share of the shared
   experts' down projection) to be brought into L2;
2. every program forms the top-k from the logits (the same selection as :func:`moe_small._select`), then the gate /
   up rows of its contiguous range of the ``k x I`` activations, streamed through shared memory, and stores the
   activations; with ``prefetch`` it first asks for its share of the picked experts' down projections into L2;
3. each program its range of output columns: the picked experts' down projections, each rounded, mixed in fp32 in
   slot order, the shared experts' down projection of their activation, and the residual.

Values and roundings are those of ``moe_small``'s router GEMV + ``experts_small`` with formed shared gate / up sums
(``openk3.ops.moe``'s reference up to fp32 summation order). Off CUDA (the interpreter runs programs one after
another, so a barrier between programs would never open) the same phases run as three launches (``split``).
"""

from __future__ import annotations

import torch

from openk3.fast._triton import HAS_TRITON, INTERPRET, pdl_launch, pdl_on, sm_count, tl, triton

# launch settings: warps per program, pipeline stages of the gate/up and down loops, columns per step of the
# router / gate-up / down loops
CONFIG = {"num_warps": 8, "stages": 3, "bk1": 256, "bk2": 128, "bk3": 256, "prefetch": True}


if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait, prefetch_l2, tanh_f32
    from openk3.fast._triton import round_to as _round
    from openk3.fast.moe_small import _mix_weights, _pick, _shared_act, _store_route

    @triton.jit
    def _grid_sync(ctr_ptr, target):
        """Arrive at the grid-wide barrier and wait until ``target`` arrivals are counted (the program's earlier
        stores visible to every program that passes)."""
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _rows_l2(base, rows, s_row, ncols, CP: tl.constexpr):
        """Ask for the lines of ``rows`` (``ncols`` columns of 2-byte values, row stride ``s_row``) into L2."""
        cols = tl.minimum(tl.arange(0, CP) * 64, ncols - 1)
        prefetch_l2(base + rows[:, None].to(tl.int64) * s_row + cols[None, :])

    @triton.jit
    def _pick_of(vals, ks, j):
        """``vals[j]`` of a ``[KP]`` vector (a sum with one nonzero term: exact)."""
        return tl.sum(tl.where(ks == j, vals, tl.zeros_like(vals)), 0)

    @triton.jit
    def _moe_token_kernel(
        r_ptr, nw_ptr, eps, wr_ptr, s_wr, bias_ptr, lg_ptr, xn_ptr, idx_ptr, wt_ptr, score_ptr, scaling,
        w1_ptr, w3_ptr, s1_e, s1_i, s3_e, s3_i, a_ptr, w2_ptr, s2_e, s2_w, w2s_ptr, s2s_w, y_ptr, ctr_ptr,
        b1, ib1, b2, ib2, sb1, isb1, sb2, isb2,
        D: tl.constexpr, E: tl.constexpr, I: tl.constexpr, K: tl.constexpr, SH: tl.constexpr,
        KP: tl.constexpr, EP: tl.constexpr, DP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
        RENORM: tl.constexpr, SITU: tl.constexpr, GU: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
        P3: tl.constexpr, BK1: tl.constexpr, BK2: tl.constexpr, BK3: tl.constexpr, STAGES: tl.constexpr,
        PHASE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, CPD: tl.constexpr = 1,
        CPI: tl.constexpr = 1, CPS: tl.constexpr = 1,
    ):  # fmt: skip
        """One token's MoE layer (module docstring); ``PHASE`` 0 all three phases with barriers, 1 / 2 / 3 that
        phase alone (one launch each). ``SH``: the shared experts' width (0: none; their gate / up rows follow the
        router's ``E`` rows of ``wr``, their activation ``GU`` 1 SwiGLU, 2 SiTU)."""
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        dt = y_ptr.dtype.element_ty
        R1: tl.constexpr = E + 2 * SH
        lo1 = pid * R1 // G
        hi1 = (pid + 1) * R1 // G
        rows1 = lo1 + tl.arange(0, P1)
        m1 = rows1 < hi1
        lo3 = pid * D // G
        hi3 = (pid + 1) * D // G
        oo = lo3 + tl.arange(0, P3)
        om = oo < hi3
        if PREFETCH:  # weights only: before the wait
            if PHASE <= 1:
                _rows_l2(wr_ptr, tl.where(m1, rows1, lo1), s_wr, D, CPD)
            if SH > 0 and (PHASE == 0 or PHASE == 3):
                _rows_l2(w2s_ptr, tl.where(om, oo, lo3), s2s_w, SH, CPS)
        pdl_wait(PDL)
        if PHASE != 0:
            pdl_trigger(PDL)
        ks = tl.arange(0, KP)
        # ---- phase 1: the norm and the router (+ shared gate / up) rows
        if PHASE <= 1:
            dd = tl.arange(0, DP)
            xr = tl.load(r_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
            rinv = tl.rsqrt(tl.sum(xr * xr, 0) / D + eps)
            acc1 = tl.zeros([P1, BK1], dtype=tl.float32)
            for t in tl.range(0, (D + BK1 - 1) // BK1):
                c1 = t * BK1 + tl.arange(0, BK1)
                n1 = c1 < D
                x1 = tl.load(r_ptr + c1, mask=n1, other=0.0).to(tl.float32)
                gain = _round(tl.load(nw_ptr + c1, mask=n1, other=0.0).to(tl.float32), dt)
                xn = _round(gain * _round(x1 * rinv, dt), dt)
                tl.store(xn_ptr + c1, xn.to(dt), mask=n1 & (pid == 0))
                w1t = tl.load(
                    wr_ptr + rows1[:, None].to(tl.int64) * s_wr + c1[None, :], mask=m1[:, None] & n1[None, :]
                )
                acc1 += w1t.to(tl.float32) * xn[None, :]
            tl.store(lg_ptr + rows1, tl.sum(acc1, 1), mask=m1)
        if PHASE == 0:
            _grid_sync(ctr_ptr, G)
        # ---- the routing (every program its own copy; program 0 stores it)
        if PHASE != 1:
            s, sel_i, _ = _pick(lg_ptr, bias_ptr, 0, E, 0, K, KP, EP, SOFTMAX, HAS_BIAS)
            sel_w = _mix_weights(s, sel_i, scaling, K, KP, EP, RENORM)
        if PHASE == 0 or PHASE == 2:
            if pid == 0:
                _store_route(idx_ptr, wt_ptr, score_ptr, 0, E, s, sel_i, sel_w, K, KP, EP)
            if PREFETCH:  # the picked experts' down-projection rows of this program's output columns
                for jp in tl.static_range(K):
                    ep = _pick_of(sel_i, ks, jp).to(tl.int64)
                    _rows_l2(
                        w2_ptr + ep * s2_e,
                        tl.where(om, oo, lo3),
                        s2_w,
                        I,
                        CPI,
                    )
            # ---- phase 2: gate / up rows of this program's range of the K x I activations
            KI: tl.constexpr = K * I
            lo2 = pid * KI // G
            hi2 = (pid + 1) * KI // G
            f = lo2 + tl.arange(0, P2)
            m2 = f < hi2
            slot = f // I
            ii = (f - slot * I).to(tl.int64)
            e2 = tl.sum(tl.where(ks[None, :] == slot[:, None], sel_i[None, :], 0), 1).to(tl.int64)
            g_row = w1_ptr + e2 * s1_e + ii * s1_i
            u_row = w3_ptr + e2 * s3_e + ii * s3_i
            g_acc = tl.zeros([P2, BK2], dtype=tl.float32)
            u_acc = tl.zeros([P2, BK2], dtype=tl.float32)
            for t in tl.range(0, (D + BK2 - 1) // BK2, num_stages=STAGES):
                kk = t * BK2 + tl.arange(0, BK2)
                km = kk < D
                xv = tl.load(xn_ptr + kk, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
                mk = m2[:, None] & km[None, :]
                wg = tl.load(g_row[:, None] + kk[None, :], mask=mk, other=0.0, eviction_policy="evict_first")
                wu = tl.load(u_row[:, None] + kk[None, :], mask=mk, other=0.0, eviction_policy="evict_first")
                g_acc += wg.to(tl.float32) * xv[None, :]
                u_acc += wu.to(tl.float32) * xv[None, :]
            g = _round(tl.sum(g_acc, 1), dt)
            u = _round(tl.sum(u_acc, 1), dt)
            sg = tl.sigmoid(g)
            if SITU:
                a = (b1 * tanh_f32(g * ib1)) * sg * (b2 * tanh_f32(u * ib2))
            else:
                a = g * sg * u
            tl.store(a_ptr + f, _round(a, dt).to(dt), mask=m2)
        if PHASE == 0:
            _grid_sync(ctr_ptr, 2 * G)
            pdl_trigger(PDL)
        # ---- phase 3: this program's output columns
        if PHASE == 0 or PHASE == 3:
            NC: tl.constexpr = (I + BK3 - 1) // BK3
            yk = tl.zeros([KP, P3], dtype=tl.float32)  # each slot's down-projection sums
            for t in tl.range(0, K * NC, num_stages=STAGES):
                j = t // NC
                ic = (t - j * NC) * BK3 + tl.arange(0, BK3)
                im = ic < I
                e = _pick_of(sel_i, ks, j).to(tl.int64)
                av = tl.load(a_ptr + j * I + ic, mask=im, other=0.0, cache_modifier=".cg").to(tl.float32)
                w = tl.load(
                    w2_ptr + e * s2_e + oo[:, None] * s2_w + ic[None, :], mask=om[:, None] & im[None, :]
                )
                part = tl.sum(w.to(tl.float32) * av[None, :], 1)
                yk = tl.where(ks[:, None] == j, yk + part[None, :], yk)
            yk = _round(yk, dt)
            acc = tl.zeros([P3], dtype=tl.float32)
            for jm in tl.static_range(K):  # the mixture in slot order
                acc += tl.sum(tl.where(ks[:, None] == jm, yk, 0.0), 0) * _pick_of(sel_w, ks, jm)
            y = _round(acc, dt)
            if SH > 0:
                ys = tl.zeros([P3], dtype=tl.float32)
                for cs in tl.range(0, (SH + BK3 - 1) // BK3):
                    c4 = cs * BK3 + tl.arange(0, BK3)
                    m4 = c4 < SH
                    gs = _round(tl.load(lg_ptr + E + c4, mask=m4, other=0.0, cache_modifier=".cg"), dt)
                    us = _round(tl.load(lg_ptr + E + SH + c4, mask=m4, other=0.0, cache_modifier=".cg"), dt)
                    a4 = _round(_shared_act(gs, us, dt, GU, sb1, isb1, sb2, isb2), dt)
                    w4 = tl.load(w2s_ptr + oo[:, None] * s2s_w + c4[None, :], mask=om[:, None] & m4[None, :])
                    ys += tl.sum(w4.to(tl.float32) * a4[None, :], 1)
                y = _round(y + _round(ys, dt), dt)
            res = tl.load(r_ptr + oo, mask=om, other=0.0).to(tl.float32)
            tl.store(y_ptr + oo, _round(res + y, dt).to(dt), mask=om)
        if PHASE == 0:  # the last program out resets the counter for the next launch
            tl.debug_barrier()
            old = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
            if old == 3 * G - 1:
                tl.atomic_xchg(ctr_ptr, 0, sem="relaxed", scope="gpu")


class MoEToken:
    """Outputs of :func:`moe_token` besides the layer output: the normed row ``xn [1, D]``, the router logits
    ``logits [1, E]`` (and the shared experts' gate / up sums ``extra [1, 2 * SH]``), the routing ``idx``,
    ``weights`` ``[1, k]`` and ``scores`` ``[1, E]``."""

    def __init__(self, xn, lg, E, idx, weights, scores):
        self.xn, self.logits, self.extra = xn, lg[:, :E], lg[:, E:]
        self.idx, self.weights, self.scores = idx, weights, scores


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
    """A zeroed barrier counter for :func:`moe_token` (one 128-byte line; each launch leaves it at zero)."""
    return torch.zeros(32, dtype=torch.int32, device=device)


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
) -> tuple[torch.Tensor, MoEToken]:
    """``r + MoE(rms_norm(r, norm_weight, eps))`` for one token ``r [1, D]`` (a plain MoE layer: router with
    ``openk3.ops.moe.route``'s options, routed experts ``w1``, ``w3`` ``[E, I, D]``, ``w2`` ``[E, D, I]``, and
    ``shared`` experts as ``moe_small.SharedExperts`` of the same width, whose gate and up rows are rows ``E:E+I``
    and ``E+I:E+2I`` of ``router_w``; their ``w1`` / ``w3`` / ``gu`` are not read) in one launch (module
    docstring). ``counter``: :func:`new_counter`'s buffer, not shared with a launch that may run at the same time.
    ``split``: the three phases as three launches (default: off CUDA). Returns (the output ``[1, D]``,
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
    G = grid or (sm_count(dev) if r.is_cuda else 4)
    G = max(1, min(G, D, E + 2 * SH, top_k * I))
    lg = torch.empty(1, E + 2 * SH, dtype=torch.float32, device=dev)
    xn = torch.empty(1, D, dtype=r.dtype, device=dev)
    a = torch.empty(top_k * I, dtype=r.dtype, device=dev)
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
    cdiv = triton.cdiv
    args = (
        r, norm_weight, float(eps), router_w, router_w.stride(0), bias if bias is not None else lg, lg, xn, idx,
        wts, scores, float(scaling), w1, w3, w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), a, w2,
        w2.stride(0), w2.stride(1), w2 if shared is None else shared.w2, 0 if shared is None else shared.w2.stride(0),
        y, counter, b1, 1.0 / b1, b2, 1.0 / b2, sb1, 1.0 / sb1, sb2, 1.0 / sb2,
    )  # fmt: skip
    consts = dict(
        D=D, E=E, I=I, K=top_k, SH=SH, KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(E),
        DP=triton.next_power_of_2(D), SOFTMAX=activation == "softmax", HAS_BIAS=bias is not None,
        RENORM=bool(renormalize), SITU=act == "situ", GU=gu,
        P1=triton.next_power_of_2(cdiv(E + 2 * SH, G)), P2=triton.next_power_of_2(cdiv(top_k * I, G)),
        P3=triton.next_power_of_2(cdiv(D, G)), BK1=min(c["bk1"], triton.next_power_of_2(D)),
        BK2=min(c["bk2"], triton.next_power_of_2(D)), BK3=min(c["bk3"], triton.next_power_of_2(max(I, SH, 1))),
        STAGES=c["stages"], PREFETCH=bool(c["prefetch"]) and not INTERPRET, PDL=pdl, num_warps=c["num_warps"],
        CPD=triton.next_power_of_2(cdiv(D, 64)), CPI=triton.next_power_of_2(cdiv(I, 64)),
        CPS=triton.next_power_of_2(cdiv(max(SH, 1), 64)),
    )  # fmt: skip
    for phase in (1, 2, 3) if split else (0,):
        _moe_token_kernel[(G,)](*args, PHASE=phase, **consts, **pdl_launch(pdl))
    return y, MoEToken(xn, lg, E, idx, wts, scores)
