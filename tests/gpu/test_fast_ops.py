"""Fast backends (openk3.fast) vs the plain-PyTorch references, on fresh random inputs, awkward shapes, bf16/fp32.

Tolerances are relative errors ||fast - ref|| / ||ref|| per tensor, set from measurements on an H200 (bench/NOTES.md).
fla's chunk kernel computes its intra-chunk products in reduced precision, so its fp32 tolerances are wide; the
token-recurrent kernel and our own kernels are held to fp32 rounding.
"""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _fresh(seed=None):
    g = torch.Generator(device=DEV)
    g.manual_seed(seed if seed is not None else torch.seed() % (2**31))
    return g


def _rand(*shape, dtype=torch.float32, scale=1.0, g=None):
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# KDA


class _KDALayer(torch.nn.Module):
    def __init__(self, H, K, gate_kind, g):
        super().__init__()
        self.num_heads, self.head_dim = H, K
        self.gate_kind = gate_kind
        self.lower_bound = -5.0
        self.recurrent_max_len, self.chunk_size = 16, 64
        self.A_log = torch.nn.Parameter(torch.empty(H, device=DEV).uniform_(1.0, 16.0, generator=g).log())
        self.dt_bias = torch.nn.Parameter(torch.randn(H * K, device=DEV, generator=g) * 0.5)

    def as_fp64(self):
        other = _KDALayer.__new__(_KDALayer)
        torch.nn.Module.__init__(other)
        for k in ("num_heads", "head_dim", "gate_kind", "lower_bound", "recurrent_max_len", "chunk_size"):
            setattr(other, k, getattr(self, k))
        other.A_log = torch.nn.Parameter(self.A_log.detach().double().clone())
        other.dt_bias = torch.nn.Parameter(self.dt_bias.detach().double().clone())
        return other


def _kda_inputs(B, T, H, K, dtype, g, N=None):
    q = _rand(B, T, H, K, dtype=dtype, g=g)
    k = _rand(B, T, H, K, dtype=dtype, g=g)
    v = _rand(B, T, H, K, dtype=dtype, g=g)
    z = _rand(B, T, H, K, dtype=dtype, g=g)
    beta = _rand(B, T, H, dtype=dtype, g=g)
    h0 = _rand(N or B, H, K, K, scale=0.1, g=g)
    return [q, k, v, z, beta, h0]


def _run_kda(core, layer, ins, cu, grad, dtype_ref=None, cu_cpu=None):
    ins = [t.detach().to(dtype_ref or t.dtype).requires_grad_(grad) for t in ins]
    q, k, v, z, beta, h0 = ins
    kw = {} if cu_cpu is None else {"cu_seqlens_cpu": cu_cpu}
    o, st = core(layer, q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    if not grad:
        return o, st, None
    # by shape, not randn_like: the two implementations return different strides
    go = torch.randn(o.shape, device=DEV, generator=_fresh(7)).to(o.dtype)
    gs = torch.randn(st.shape, device=DEV, generator=_fresh(8))
    ((o * go).sum() + (st * gs).sum()).backward()
    grads = [t.grad for t in ins] + [layer.A_log.grad, layer.dt_bias.grad]
    return o, st, grads


# Measured on an H200 (bench/NOTES.md): chunk bf16 vs fp64 o/state 4.2e-3, every gradient <= 4.9e-3; recurrent
# fp32 1.4e-7, bf16 1.7e-3 (the bf16 output rounding). fp32 chunk: fla 0.6.0 ran out of shared memory at K = 128
# (the backend then falls back to the reference), so its tolerance is the DESIGN.md figure for fla in fp32.
KDA_TOL = {  # (out/state, grads)
    ("chunk", torch.float32): (3e-2, 5e-2),
    ("chunk", torch.bfloat16): (1e-2, 1.5e-2),
    ("recurrent", torch.float32): (1e-5, None),
    ("recurrent", torch.bfloat16): (5e-3, None),
}
GRAD_NAMES = ["dq", "dk", "dv", "dz", "dbeta", "dh0", "dA_log", "ddt_bias"]


@pytest.mark.parametrize(
    "dtype,gate,T,cu",
    [
        pytest.param(torch.float32, "lowerbound", 200, None, id="fp32chunk-lb"),
        pytest.param(torch.bfloat16, "lowerbound", 200, None, id="bf16-lb"),
        pytest.param(torch.bfloat16, "softplus", 130, None, id="bf16-softplus"),
        pytest.param(torch.bfloat16, "lowerbound", 333, [0, 1, 77, 200, 333], id="bf16-lb-varlen"),
        pytest.param(torch.float32, "lowerbound", 333, [0, 1, 77, 200, 333], id="fp32chunk-lb-varlen"),
    ],
)
def test_kda_chunk_vs_fp64(dtype, gate, T, cu, check):
    from openk3.fast.kda import kda_core_fla
    from openk3.modules.kda import _kda_core_reference

    g = _fresh()
    H, K = 16, 128
    B = 1 if cu else 2
    cu_t = torch.tensor(cu, device=DEV) if cu else None
    layer = _KDALayer(H, K, gate, g)
    ins = _kda_inputs(B, T, H, K, dtype, g, N=len(cu) - 1 if cu else None)
    o, st, grads = _run_kda(kda_core_fla, layer, ins, cu_t, True)
    ref = layer.as_fp64()
    o_r, st_r, grads_r = _run_kda(_kda_core_reference, ref, ins, cu_t, True, torch.float64)
    tol_o, tol_g = KDA_TOL[("chunk", dtype)]
    tag = f"kda.chunk.{gate}.{str(dtype)[6:]}.T{T}{'.varlen' if cu else ''}"
    check(f"{tag}.o", o, o_r, tol_o)
    check(f"{tag}.state", st, st_r, tol_o)
    for name, a, b in zip(GRAD_NAMES, grads, grads_r):
        check(f"{tag}.{name}", a, b, tol_g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T,cu,host",
    [(15, None, False), (1, None, False), (40, [0, 1, 3, 40], False), (150, [0, 64, 100, 150], True)],
)
def test_kda_recurrent_inference(dtype, T, cu, host, check, monkeypatch):
    """The token-recurrent kernel up to RECURRENT_MAX_LEN tokens per sequence: packed sequences longer than that
    in all take it when the caller gives a host copy of cu_seqlens (``host``)."""
    import openk3.fast.kda as FK
    from openk3.modules.kda import _kda_core_reference

    calls = []
    inner = FK._fused_recurrent_kda
    monkeypatch.setattr(FK, "_fused_recurrent_kda", lambda *a, **k: (calls.append(1), inner(*a, **k))[1])
    g = _fresh()
    H, K = 16, 128
    B = 1 if cu else 3
    cu_t = torch.tensor(cu, device=DEV) if cu else None
    layer = _KDALayer(H, K, "lowerbound", g)
    ins = _kda_inputs(B, T, H, K, dtype, g, N=len(cu) - 1 if cu else None)
    with torch.no_grad():
        o, st, _ = _run_kda(
            FK.kda_core_fla, layer, ins, cu_t, False, cu_cpu=torch.tensor(cu) if host else None
        )
        o_r, st_r, _ = _run_kda(_kda_core_reference, layer.as_fp64(), ins, cu_t, False, torch.float64)
    assert calls == [1]
    tol = KDA_TOL[("recurrent", dtype)][0]
    tag = f"kda.recurrent.{str(dtype)[6:]}.T{T}{'.varlen' if cu else ''}"
    check(f"{tag}.o", o, o_r, tol)
    check(f"{tag}.state", st, st_r, tol)


# --------------------------------------------------------------------------------------------------------------
# MLA


MLA_TOL = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
}  # measured: fp32 9e-7, bf16 o <= 2.2e-3, grads <= 3.4e-3


def _mla_case(fn, dtype, T, S, cu, check, tag):
    from openk3.ops.mla import mla_mha_attention

    g = _fresh()
    B = 1 if cu else 2
    H = 8
    q = _rand(B, T, H, 192, dtype=dtype, g=g)
    k = _rand(B, S, H, 192, dtype=dtype, g=g)
    v = _rand(B, S, H, 128, dtype=dtype, g=g)
    cu_t = torch.tensor(cu, device=DEV) if cu else None
    scale = 192**-0.5
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fn(*ins, scale=scale, cu_seqlens=cu_t)
    go = torch.randn_like(o, generator=g)
    (o * go).sum().backward()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o_r = mla_mha_attention(*ref_in, scale=scale, cu_seqlens=cu_t)
    (o_r * go.float()).sum().backward()
    tol = MLA_TOL[dtype]
    check(f"{tag}.o", o, o_r, tol)
    for n, a, b in zip(("dq", "dk", "dv"), ins, ref_in):
        check(f"{tag}.{n}", a.grad, b.grad, 2 * tol)


@pytest.mark.parametrize("mode", ["pad", "cudnn", "efficient", "auto", "flex"])
@pytest.mark.parametrize("T,S", [(300, 300), (50, 300)])
def test_mla_dense(mode, T, S, check):
    from openk3.fast import mla

    fn = mla.mha_flex if mode == "flex" else (lambda *a, **kw: mla.mha_sdpa(*a, mode=mode, **kw))
    _mla_case(fn, torch.bfloat16, T, S, None, check, f"mla.{mode}.T{T}.S{S}")


def test_mla_fp32_default(check):
    from openk3.fast import mla

    _mla_case(mla.mha_sdpa, torch.float32, 200, 200, None, check, "mla.default.fp32")


@pytest.mark.parametrize("varlen", ["varlen", "loop", "flex"])
def test_mla_varlen(varlen, check, monkeypatch):
    from openk3.fast import mla

    monkeypatch.setattr(mla, "VARLEN_MODE", varlen)
    _mla_case(mla.mha_sdpa, torch.bfloat16, 300, 300, [0, 1, 100, 300], check, f"mla.varlen.{varlen}")


# --------------------------------------------------------------------------------------------------------------
# MoE


MOE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # measured: fp32 <= 2.8e-7, bf16 <= 4.8e-3
MOE_VARIANTS = ("base", "lean", "fused", "fused_keepx")


def _moe_case(dtype, N, W, I, E, K, act, variant, check, adjacent13=False, grad=True):
    from openk3.fast.moe import experts_grouped
    from openk3.ops.moe import experts_reference

    g = _fresh()
    x = _rand(N, W, dtype=dtype, g=g)
    # expert E-1 gets no token: its weight gradients must be exact zeros
    idx = torch.stack([torch.randperm(E - 1, device=DEV, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, device=DEV, generator=g)
    ws = [
        _rand(E, I, W, dtype=dtype, scale=W**-0.5, g=g),
        _rand(E, W, I, dtype=dtype, scale=I**-0.5, g=g),
        _rand(E, I, W, dtype=dtype, scale=W**-0.5, g=g),
    ]
    fast_in = [t.clone().requires_grad_(grad) for t in [x, w, *ws]]
    if adjacent13:  # w1 and w3 as the two halves of one [E, 2I, W] buffer (the zero-copy stacked operand)
        buf = torch.cat([ws[0], ws[2]], 1)
        fast_in[2] = buf[:, :I].detach().requires_grad_(grad)
        fast_in[4] = buf[:, I:].detach().requires_grad_(grad)
        assert fast_in[2].untyped_storage().data_ptr() == fast_in[4].untyped_storage().data_ptr()
    ref_in = [t.detach().float().requires_grad_(grad) for t in [x, w, *ws]]
    tag = f"moe.{variant}.{str(dtype)[6:]}.N{N}.E{E}.k{K}.{act}{'.adj13' if adjacent13 else ''}"
    if not grad:
        with torch.no_grad():
            y = experts_grouped(fast_in[0], idx, fast_in[1], *fast_in[2:], act=act, variant=variant)
            y_r = experts_reference(ref_in[0], idx, ref_in[1], *ref_in[2:], act=act)
        check(f"{tag}.nograd.y", y, y_r, MOE_TOL[dtype])
        return
    y = experts_grouped(fast_in[0], idx, fast_in[1], *fast_in[2:], act=act, variant=variant)
    y_r = experts_reference(ref_in[0], idx, ref_in[1], *ref_in[2:], act=act)
    gy = torch.randn_like(y_r, generator=g)
    (y.float() * gy).sum().backward()
    (y_r * gy).sum().backward()
    tol = MOE_TOL[dtype]
    check(f"{tag}.y", y, y_r, tol)
    for n, a, b in zip(("dx", "dweights", "dw1", "dw2", "dw3"), fast_in, ref_in):
        check(f"{tag}.{n}", a.grad, b.grad, 2 * tol)
    for wt in fast_in[2:]:
        assert torch.all(wt.grad[E - 1] == 0)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
@pytest.mark.parametrize(
    "dtype,N,W,I,E,K,act",
    [
        (torch.bfloat16, 300, 256, 128, 8, 3, "situ"),
        (torch.bfloat16, 1000, 1024, 640, 64, 8, "situ"),
        (torch.bfloat16, 77, 128, 64, 8, 2, "silu"),
        (torch.float32, 300, 256, 128, 8, 3, "situ"),
    ],
)
def test_moe_experts(dtype, N, W, I, E, K, act, variant, check, monkeypatch):
    from openk3.fast import moe

    # small layers would take the unfused path under the default threshold: force the stacked gate/up GEMM
    monkeypatch.setattr(moe, "FUSE_MIN_ROWS_PER_EXPERT", 0)
    _moe_case(dtype, N, W, I, E, K, act, variant, check)


@pytest.mark.parametrize("variant", ["fused", "fused_keepx"])
def test_moe_experts_fused_views(variant, check):
    """w1/w3 already the halves of one buffer: the stacked operand is a view (no copy), fused at any size."""
    _moe_case(torch.bfloat16, 333, 256, 128, 8, 4, "situ", variant, check, adjacent13=True)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_moe_experts_no_grad(variant, check, monkeypatch):
    """Inference layout (unused experts get no rows) for every variant (the expert-tiled kernels off: they would
    take these 11 pairs per expert)."""
    from openk3.fast import moe_tiled

    monkeypatch.setitem(moe_tiled.TILED, "max_pairs_per_expert", 0)
    _moe_case(torch.bfloat16, 45, 256, 128, 16, 4, "situ", variant, check, grad=False)


@pytest.mark.parametrize(
    "N,E,K,W,I,act,hot",
    [
        (
            64,
            256,
            8,
            2304,
            1024,
            "silu",
            False,
        ),  # the 48B expert shape at a serving batch (2 pairs per expert)
        (64, 64, 8, 1024, 640, "situ", False),  # medium's latent experts (8 pairs per expert)
        (17, 896, 16, 3584, 3072, "situ", False),  # K3's expert shape, 17 tokens
        (100, 20, 3, 200, 72, "situ", True),  # widths off the tiles; one hot expert (100 rows, 32-row steps)
        (5, 7, 7, 64, 32, "silu", False),  # every expert in every token
        (256, 64, 8, 1024, 640, "situ", False),  # medium at 32 pairs per expert (64-row steps)
    ],
)
def test_moe_tiled_gpu(N, E, K, W, I, act, hot, check):
    """The expert-tiled kernels (openk3.fast.moe_tiled) in bf16 against the bf16 reference experts, eager and
    replayed in a CUDA graph with new routing (the row plan is formed on the device); the grouped GEMMs beside them;
    experts without pairs; an expert over one row step; 16-, 32- and 64-row steps (``moe_tiled.rows_per_step``)."""
    from openk3.fast import moe_tiled
    from openk3.fast.moe import experts_grouped
    from openk3.ops.moe import experts_reference

    g = _fresh()
    bf = torch.bfloat16
    # K3's 896 experts (66 MB each) would not fit: there every expert shares one weight (stride 0 along experts)
    n_w = E if E <= 256 else 1
    x = _rand(N, W, dtype=bf, g=g)
    w13 = _rand(n_w, 2 * I, W, dtype=bf, scale=W**-0.5, g=g).expand(E, 2 * I, W)
    w1, w3 = w13[:, :I], w13[:, I:]
    w2 = _rand(n_w, W, I, dtype=bf, scale=I**-0.5, g=g).expand(E, W, I)

    def routing():
        idx = torch.stack(
            [torch.randperm(E - 1 if K < E else E, device=DEV, generator=g)[:K] for _ in range(N)]
        )
        if hot:
            idx[:, 0] = 1
            idx[:, 1:] = torch.stack(
                [torch.randperm(E - 2, device=DEV, generator=g)[: K - 1] + 2 for _ in range(N)]
            )
        return idx, torch.rand(N, K, device=DEV, generator=g)

    idx, wt = routing()
    tag = f"moe_tiled.N{N}.E{E}.k{K}.W{W}.I{I}.{act}"
    with torch.no_grad():
        ref = experts_reference(x, idx, wt, w1, w2, w3, act=act)
        check(f"{tag}.eager", moe_tiled.experts_tiled(x, idx, wt, w1, w2, w3, act=act), ref, 1e-2)
        if n_w == E:  # (the grouped GEMMs would copy stride-0 weights)
            bound = moe_tiled.TILED["max_pairs_per_expert"]
            moe_tiled.TILED["max_pairs_per_expert"] = 0
            try:
                check(f"{tag}.grouped", experts_grouped(x, idx, wt, w1, w2, w3, act=act), ref, 1e-2)
            finally:
                moe_tiled.TILED["max_pairs_per_expert"] = bound
        # a CUDA graph captured on one routing, replayed on another
        xs, ids, wts = x.clone(), idx.clone(), wt.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe_tiled.experts_tiled(xs, ids, wts, w1, w2, w3, act=act)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_tiled.experts_tiled(xs, ids, wts, w1, w2, w3, act=act)
        idx2, wt2 = routing()
        x2 = _rand(N, W, dtype=bf, g=g)
        xs.copy_(x2)
        ids.copy_(idx2)
        wts.copy_(wt2)
        graph.replay()
        check(f"{tag}.graph", out, experts_reference(x2, idx2, wt2, w1, w2, w3, act=act), 1e-2)


def test_moe_row_plan_matches_torch_plan():
    """The Triton planner gives the torch planner's rows, group ends and (through each row's pair index) padded
    rows and row weights exactly."""
    from openk3.fast.moe import Plan, RowPlan

    g = _fresh()
    for N, E, K, sparse in [
        (1000, 64, 8, False),
        (77, 8, 2, True),
        (4096, 896, 16, False),
        (3, 256, 8, True),
    ]:
        idx = torch.stack([torch.randperm(E, device=DEV, generator=g)[:K] for _ in range(N)])
        w = torch.rand(N, K, device=DEV, generator=g)
        p0, p1 = Plan(idx, E, sparse=sparse), RowPlan(idx, E, sparse=sparse)
        assert p0.P == p1.P
        assert torch.equal(p0.rows, p1.rows.long())
        assert torch.equal(p0.offs, p1.offs)
        pair = p1.pair_of_row.long()  # pair n*K + j of each row, N*K on padding
        assert torch.equal(pair[p0.rows.reshape(-1)], torch.arange(N * K, device=DEV))
        assert torch.equal(pair // K, p0.tok_of_row) and bool((pair <= N * K).all())
        assert torch.equal(torch.cat([w.reshape(-1), w.new_zeros(1)])[pair], p0.row_scale(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["sigmoid", "softmax"])
@pytest.mark.parametrize("N,E,K,D", [(1, 64, 8, 2048), (4, 256, 8, 2304), (3, 896, 16, 7168), (2, 20, 3, 50)])
def test_moe_small_router(dtype, act, N, E, K, D, check):
    """Few-token router (two kernels) vs ``route``: the same experts (up to fp32 near-ties of the biased scores),
    the same mixture weights and scores."""
    from openk3.fast import moe_small
    from openk3.ops.moe import route

    g = _fresh()
    x = _rand(N, D, dtype=dtype, g=g)
    w = _rand(E, D, dtype=dtype, scale=D**-0.5, g=g)
    bias = _rand(E, scale=0.05, g=g)
    kw = dict(top_k=K, activation=act, renormalize=True, scaling=2.5)
    with torch.no_grad():
        i1, w1, s1 = moe_small.route_small(x, w, bias, **kw)
        i0, w0, s0 = route(x, w, bias, **kw)
    tag = f"moe_small.router.{act}.{str(dtype)[6:]}.N{N}.E{E}"
    check(f"{tag}.scores", s1, s0, 1e-5)
    choice = s0 + bias
    # each pick is as good as the reference's pick at that rank (equal ids unless two scores tie within fp32 noise)
    gap = (choice.gather(1, i1) - choice.gather(1, i0)).abs().max()
    assert float(gap) <= 1e-5, gap
    same = (i1 == i0).all(1)
    assert bool(same.float().mean() >= 0.5), (i1, i0)
    check(f"{tag}.weights", w1[same], w0[same], 1e-5)
    assert all(len(set(r)) == K for r in i1.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "N,E,K,W,I,act",
    [
        (1, 64, 8, 1024, 640, "situ"),
        (4, 256, 8, 2304, 1024, "silu"),
        (16, 64, 16, 3584, 384, "situ"),
        (3, 10, 3, 200, 40, "situ"),
    ],
)
def test_moe_small_experts(dtype, N, E, K, W, I, act, check):
    """Few-token experts (three kernels, weights read by expert index) vs the reference experts; w1/w3 as the halves
    of one buffer (the module's layout) for the first shapes, separate tensors for the odd one."""
    from openk3.fast import moe_small
    from openk3.ops.moe import experts_reference

    g = _fresh()
    x = _rand(N, W, dtype=dtype, scale=2.0, g=g)
    idx = torch.stack([torch.randperm(E, device=DEV, generator=g)[:K] for _ in range(N)])
    wt = torch.rand(N, K, device=DEV, generator=g)
    if W % 8 == 0:
        w13 = _rand(E, 2 * I, W, dtype=dtype, scale=W**-0.5, g=g)
        w1, w3 = w13[:, :I], w13[:, I:]
    else:
        w1, w3 = (
            _rand(E, I, W, dtype=dtype, scale=W**-0.5, g=g),
            _rand(E, I, W, dtype=dtype, scale=W**-0.5, g=g),
        )
    w2 = _rand(E, W, I, dtype=dtype, scale=I**-0.5, g=g)
    with torch.no_grad():
        y = moe_small.experts_small(x, idx, wt, w1, w2, w3, act=act)
        y_r = experts_reference(x, idx, wt, w1, w2, w3, act=act)
    check(f"moe_small.experts.{str(dtype)[6:]}.N{N}.E{E}.k{K}.W{W}.{act}", y, y_r, MOE_TOL[dtype])


def _routed_layer(N, E, K, D, I):
    """Random bf16 tokens and a routed-expert layer for the few-token routing tests: (x [N, D], router weight,
    correction bias, packed gate/up [E, 2I, D], down [E, D, I], the router's options)."""
    g = _fresh()
    x = _rand(N, D, dtype=torch.bfloat16, g=g)
    wr = _rand(E, D, dtype=torch.bfloat16, scale=D**-0.5, g=g)
    bias = _rand(E, scale=0.05, g=g)
    w13 = _rand(E, 2 * I, D, dtype=torch.bfloat16, scale=D**-0.5, g=g)
    w2 = _rand(E, D, I, dtype=torch.bfloat16, scale=I**-0.5, g=g)
    return x, wr, bias, w13, w2, dict(top_k=K, activation="sigmoid", renormalize=True, scaling=2.5)


@pytest.mark.parametrize(
    "N,E,K,D,I", [(1, 256, 8, 2304, 1024), (16, 64, 8, 1024, 640), (3, 896, 16, 512, 64)]
)
def test_moe_small_fused_select(N, E, K, D, I):
    """The routing selection formed inside the experts' gate/up kernel (``route_logits_small`` + ``experts_small``
    with the pending route) against the separate selection kernel: the same ids, weights and scores bit for bit,
    and the same expert output, bf16, compiled."""
    from openk3.fast import moe_small

    x, wr, bias, w13, w2, kw = _routed_layer(N, E, K, D, I)
    with torch.no_grad():
        i0, w0, s0 = moe_small.route_small(x, wr, bias, **kw)
        y0 = moe_small.experts_small(x, i0, w0, w13[:, :I], w2, w13[:, I:], act="silu")
        pr = moe_small.route_logits_small(x, wr, bias, **kw)
        y1 = moe_small.experts_small(x, pr, None, w13[:, :I], w2, w13[:, I:], act="silu")
    assert torch.equal(pr.idx, i0) and torch.equal(pr.weights, w0) and torch.equal(pr.scores, s0)
    assert torch.equal(y1, y0)


@pytest.mark.parametrize("N,E,K", [(1, 256, 8), (3, 64, 6), (2, 896, 16), (1, 20, 1)])
def test_moe_small_select_topk(N, E, K, monkeypatch):
    """SELECT_TOPK (the selection's top-k by tl.topk) against the K max-reductions: the same ids, weights and
    scores bit for bit, in the separate selection kernel and inside the gate/up kernel, bf16, compiled."""
    from openk3.fast import moe_small

    I = 64
    x, wr, bias, w13, w2, kw = _routed_layer(N, E, K, 512, I)
    out = {}
    for on in (False, True):
        monkeypatch.setitem(moe_small.SELECT_TOPK, "on", on)
        with torch.no_grad():
            sep = moe_small.route_small(x, wr, bias, **kw)
            pr = moe_small.route_logits_small(x, wr, bias, **kw)
            moe_small.experts_small(x, pr, None, w13[:, :I], w2, w13[:, I:], act="silu")
        out[on] = (*sep, pr.idx, pr.weights, pr.scores)
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("E,K,W,I", [(64, 8, 1024, 640), (256, 8, 2304, 1024), (64, 16, 3584, 3072)])
@pytest.mark.parametrize("ppsm", [4, 8])
def test_moe_small_down_combine(E, K, W, I, ppsm, check, monkeypatch):
    """One token: the down projection + combine kernel against the per-pair down kernel + combine2 (the same
    roundings; only the fp32 order inside each dot differs), bf16, compiled, at the medium / 48B / K3 expert shapes."""
    from openk3.fast import moe_small

    g = _fresh()
    x = _rand(1, W, dtype=torch.bfloat16, scale=2.0, g=g)
    idx = torch.randperm(E, device=DEV, generator=g)[:K][None]
    wt = torch.rand(1, K, device=DEV, generator=g)
    w13 = _rand(E, 2 * I, W, dtype=torch.bfloat16, scale=W**-0.5, g=g)
    w2 = _rand(E, W, I, dtype=torch.bfloat16, scale=I**-0.5, g=g)
    monkeypatch.setitem(moe_small.DOWN_COMBINE, "programs_per_sm", ppsm)
    with torch.no_grad():
        y = moe_small.experts_small(x, idx, wt, w13[:, :I], w2, w13[:, I:], act="situ")
        monkeypatch.setattr(moe_small, "DOWN_COMBINE_MAX_TOKENS", 0)
        y0 = moe_small.experts_small(x, idx, wt, w13[:, :I], w2, w13[:, I:], act="situ")
    check(f"moe_small.down_combine.E{E}.W{W}.I{I}.p{ppsm}", y, y0, 4e-3)
    # the shared experts' output and the residual added in the store: bit for bit r + (y + s), the model's order
    sh = _rand(1, W, dtype=torch.bfloat16, scale=1.0, g=g)
    res = _rand(1, W, dtype=torch.bfloat16, scale=4.0, g=g)
    monkeypatch.setattr(moe_small, "DOWN_COMBINE_MAX_TOKENS", 1)
    with torch.no_grad():
        ya = moe_small.experts_small(x, idx, wt, w13[:, :I], w2, w13[:, I:], act="situ", add=sh, residual=res)
    assert torch.equal(ya, res + (y + sh))
    # the shared experts as one more slot of both kernels (SwiGLU as their module forms it), against their PyTorch
    # output added to the mixture first
    sx = moe_small.SharedExperts(
        _rand(I, W, dtype=torch.bfloat16, scale=W**-0.5, g=g),
        _rand(I, W, dtype=torch.bfloat16, scale=W**-0.5, g=g),
        _rand(W, I, dtype=torch.bfloat16, scale=I**-0.5, g=g),
        act="silu",
    )
    # and with their gate / up sums formed elsewhere (the router's GEMV), the activation formed in the down + combine
    # kernel
    gu = torch.cat([x.float() @ sx.w1.float().t(), x.float() @ sx.w3.float().t()], dim=-1)
    for name, s in (("shared", sx), ("shared_gu", dataclasses.replace(sx, gu=gu))):
        with torch.no_grad():
            ys = moe_small.experts_small(
                x, idx, wt, w13[:, :I], w2, w13[:, I:], act="situ", residual=res, shared=s
            )
        check(
            f"moe_small.down_combine_{name}.E{E}.W{W}.I{I}.p{ppsm}",
            ys,
            res + (y + s.reference(x)),
            4e-3,
        )


@pytest.mark.parametrize(
    "up,down",
    [
        ((16, 256, 1), (32, 128, 1)),
        ((8, 512, 4), (16, 256, 4)),
        ((32, 128, 3), (64, 64, 2)),
        ((4, 0, 1), (32, 128, 3)),
        ((1, 0, 1), (32, 128, 3)),
    ],
)
def test_moe_small_experts_tiles(up, down, check, monkeypatch):
    """Every launch-tile / pipeline-stage combination the benchmark sweeps gives the reference's result."""
    from openk3.fast import moe_small

    monkeypatch.setattr(moe_small, "UP_TILE", up)
    monkeypatch.setattr(moe_small, "DOWN_TILE", down)
    test_moe_small_experts(torch.bfloat16, 2, 64, 8, 1000, 640, "situ", check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W,cap", [(96, 1024), (1000, 256), (1024, 1024)])
def test_moe_dy_dweights(dtype, W, cap, check, monkeypatch):
    """The one-pass combine backward against plain torch: dy = dout[token] * weight (one rounding of the same
    product, exact zeros on the padding rows of a NaN-filled buffer) and the mixture-weight gradient, y with a
    padded row stride, one or several chunks of W per row."""
    from openk3.fast import moe

    monkeypatch.setattr(moe, "_DYDW_MAX_BW", cap)
    g = _fresh()
    N, K, E = 1000, 8, 64
    plan = moe.RowPlan(torch.stack([torch.randperm(E - 1, device=DEV, generator=g)[:K] for _ in range(N)]), E)
    w = torch.rand(N, K, device=DEV, generator=g)
    dout = _rand(N, W, dtype=dtype, g=g)
    y = _rand(plan.P, W + 8, dtype=dtype, g=g)[:, :W]
    pair = plan.pair_of_row.long()
    real = pair < N * K
    want = torch.zeros(plan.P, W, device=DEV)
    want[real] = dout.float()[pair[real] // K] * w.reshape(-1)[pair[real], None]
    want_dw = (dout.float()[:, None, :] * y.float()[plan.rows.long()]).sum(-1)
    for need_dw in (True, False):
        buf = torch.full((plan.P, W), float("nan"), dtype=dtype, device=DEV)
        dy, dw = moe.dy_dweights(dout, y, plan.pair_of_row, w, need_dw=need_dw, out=buf)
        assert dy.data_ptr() == buf.data_ptr()
        assert torch.equal(dy, want.to(dtype))
        if need_dw:
            check(f"moe.dy_dweights.{str(dtype)[6:]}.W{W}.bw{cap}.dweights", dw, want_dw, 1e-5)
        else:
            assert dw is None


# --------------------------------------------------------------------------------------------------------------
# AttnRes


AR_TOL = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
}  # measured: fp32 <= 4.8e-7; bf16 out 7e-5, grads <= 5.4e-3


def _attnres_walk(cls, srcs, qs, nws, live, eps=1e-5):
    """Seal srcs[:-1] one by one (announcing every site at the last seal), then read every second site."""
    rd = cls(eps)
    for s in srcs[:-1]:
        rd.seal(s, None)
    sites = [(j, qs[j], nws[j]) for j in range(len(qs))]
    rd.seal(srcs[-1], sites)
    outs = [rd.read(j, qs[j], nws[j], live * (1 + 0.1 * j)) for j in range(0, len(qs), 2)]
    outs.append(rd.read(999, qs[0], nws[0], live))  # a site that was not announced -> reference path
    return outs


@pytest.mark.parametrize(
    "dtype,S,Q,D,T",
    [
        (torch.float32, 3, 8, 2048, 100),
        (torch.bfloat16, 5, 8, 2048, 257),
        (torch.bfloat16, 9, 24, 1000, 64),
        (torch.float32, 1, 3, 512, 33),
        (torch.bfloat16, 4, 8, 2048, 1),  # decode steps: phase 1's few-token tile (2 and 16 tokens)
        (torch.float32, 3, 8, 2048, 8),
    ],
)
def test_attnres_reader(dtype, S, Q, D, T, check):
    from openk3.fast.attnres import TritonAttnResReader
    from openk3.ops.attnres import AttnResReader

    g = _fresh()
    B = 2
    srcs = [_rand(B, T, D, dtype=dtype, scale=1 + i % 3, g=g) for i in range(S)]
    live = _rand(B, T, D, dtype=dtype, scale=2, g=g)
    qs = [_rand(1, D, scale=0.05, g=g) for _ in range(Q)]
    nws = [1 + 0.1 * _rand(D, g=g) for _ in range(Q)]
    res = []
    for cls in (TritonAttnResReader, AttnResReader):
        ins = [t.clone().requires_grad_() for t in [*srcs, live, *qs, *nws]]
        outs = _attnres_walk(cls, ins[:S], ins[S + 1 : S + 1 + Q], ins[S + 1 + Q :], ins[S])
        gen = _fresh(3)
        loss = sum((o.float() * torch.randn(o.shape, device=DEV, generator=gen)).sum() for o in outs)
        loss.backward()
        res.append((outs, [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]))
    tol = AR_TOL[dtype]
    tag = f"attnres.{str(dtype)[6:]}.S{S}.Q{Q}.D{D}"
    for j, (a, b) in enumerate(zip(res[0][0], res[1][0])):
        check(f"{tag}.out{j}", a, b, tol)
    names = (
        [f"src{i}" for i in range(S)] + ["live"] + [f"q{j}" for j in range(Q)] + [f"nw{j}" for j in range(Q)]
    )
    for n, a, b in zip(names, res[0][1], res[1][1]):
        if b.abs().sum() == 0:
            assert a.abs().sum() == 0, n
            continue
        check(f"{tag}.d{n}", a, b, 3 * tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 8, 300])
def test_attnres_read_normed(dtype, T, check):
    """The fused read + RMSNorm (decode, gradients off) against the RMSNorm of the reference read."""
    from openk3.fast.attnres import TritonAttnResReader
    from openk3.modules.norm import RMSNorm
    from openk3.ops.attnres import AttnResReader
    from openk3.ops.norm import rms_norm

    g = _fresh()
    D = 2048
    norm = RMSNorm(D, eps=1e-6).to(DEV, dtype)
    srcs = [_rand(2, T, D, dtype=dtype, scale=1 + i, g=g) for i in range(3)]
    live = _rand(2, T, D, dtype=dtype, scale=2, g=g)
    sites = [(j, _rand(1, D, scale=0.05, g=g), 1 + 0.1 * _rand(D, g=g)) for j in range(4)]
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * _rand(D, g=g))
        fast, ref = TritonAttnResReader(1e-5), AttnResReader(1e-5)
        for rd in (fast, ref):
            for t in srcs:
                rd.seal(t, sites)
        for j, q, nw in sites:
            want = rms_norm(ref.read(j, q, nw, live), norm.weight, norm.eps)
            check(f"attnres_read_normed.{str(dtype)[6:]}.T{T}.site{j}", fast.read_normed(j, q, nw, live, norm), want,
                  AR_TOL[dtype])  # fmt: skip


# launch variants of the reader: the defaults (one-pass backward at 16 warps with stored partials, 8 with direct
# sources, 16 tokens per program; source gradient with outer products for the W-term, a site loop); tensor-core
# source-gradient dots with 64 tokens per program of the one-pass backward; fp32 FMA dots with the sites unrolled;
# the one-pass backward at 8 warps for both; at 16 warps for both with a 64-register cap (no cap with 3 direct sources)
READ_NORMED_VARIANTS = {
    "default": {},
    "tf32x3-rows64": {"DV_DOT": "tf32x3", "P2_NORM_ROWS": 64},
    "ieee-unrolled": {"DV_DOT": "ieee", "DV_STAGES": 0},
    "w8": {
        "TILES": {"p2_bwd_norm": (1, 2048, 8), "p2_bwd_norm_direct": (1, 2048, 8)},
        "MAXNREG": {"p2_bwd_norm": 0, "p2_bwd_norm_direct": 128},
    },
    "w16": {
        "TILES": {"p2_bwd_norm": (1, 2048, 16), "p2_bwd_norm_direct": (1, 2048, 16)},
        "MAXNREG": {"p2_bwd_norm": 64, "p2_bwd_norm_direct": 64, "p2_bwd_norm_direct.S3": 0},
    },
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("S,direct_max,T", [(3, None, 257), (3, 0, 257), (4, 4, 65), (2, None, 1)])
@pytest.mark.parametrize("variant", sorted(READ_NORMED_VARIANTS))
def test_attnres_read_normed_grad(dtype, S, direct_max, T, variant, check, rel, monkeypatch):
    """The fused read + RMSNorm with gradients (training: the read's output is recomputed in the backward, the
    norm's backward runs in phase 2's backward kernel) against the reference read followed by the reference norm:
    normed outputs and the gradients of the sources, the live sum, every query, key norm and gain; a second read of
    a site takes the unfused path. ``direct_max``: sets of up to that many sources keep no partials. ``variant``:
    launch settings of the reader (``READ_NORMED_VARIANTS``)."""
    from openk3.fast import attnres
    from openk3.modules.norm import RMSNorm
    from openk3.ops.attnres import AttnResReader

    if direct_max is not None:
        monkeypatch.setattr(attnres, "DIRECT_MAX", direct_max)
    for name, val in READ_NORMED_VARIANTS[variant].items():
        if isinstance(val, dict):  # table entries on top of the defaults
            monkeypatch.setattr(attnres, name, {**getattr(attnres, name), **val})
        else:
            monkeypatch.setattr(attnres, name, val)
    g = _fresh()
    B, D, Q = 2, 2048, 4
    srcs = [_rand(B, T, D, dtype=dtype, scale=1 + i % 3, g=g) for i in range(S)]
    live = _rand(B, T, D, dtype=dtype, scale=2, g=g)
    qs = [_rand(1, D, scale=0.05, g=g) for _ in range(Q)]
    nws = [1 + 0.1 * _rand(D, g=g) for _ in range(Q)]
    gains = [1 + 0.2 * _rand(D, g=g) for _ in range(Q)]
    res = []
    # against the reference in fp32 on the same (rounded) inputs; in bf16 a gradient may also be off by up to twice
    # the bf16 reference's own distance from it (with 2 tokens the bf16 roundings of the read, of the gradients
    # kept for phase 1, alone move dq / dnw by up to 4e-2 in either)
    runs = [(attnres.TritonAttnResReader, dtype), (AttnResReader, torch.float32)]
    if dtype != torch.float32:
        runs.append((AttnResReader, dtype))
    for cls, up in runs:
        ins = [t.detach().to(up, copy=True).requires_grad_() for t in [*srcs, live]] + [
            t.clone().requires_grad_() for t in [*qs, *nws, *gains]
        ]
        src, lv = ins[:S], ins[S]
        qq, nw, gn = ins[S + 1 : S + 1 + Q], ins[S + 1 + Q : S + 1 + 2 * Q], ins[S + 1 + 2 * Q :]
        norms = []
        for j in range(Q):
            m = RMSNorm(D, eps=1e-6)
            m.backend = "reference"
            del m.weight
            m.weight = gn[j]
            norms.append(m)
        rd = cls(1e-5)
        rd.sealed.extend(src[:-1])
        rd.seal(src[-1], [(j, qq[j], nw[j]) for j in range(Q)])
        outs = [rd.read_normed(j, qq[j], nw[j], lv * (1 + 0.1 * j), norms[j]) for j in range(Q)]
        outs.append(rd.read_normed(0, qq[0], nw[0], lv * 0.5, norms[0]))  # read twice: unfused path
        gen = _fresh(3)
        loss = sum((o.float() * torch.randn(o.shape, device=DEV, generator=gen)).sum() for o in outs)
        loss.backward()
        res.append((outs, [t.grad for t in ins]))
    tol = AR_TOL[dtype]
    tag = f"attnres_read_normed_grad.{str(dtype)[6:]}.S{S}.T{T}.dm{direct_max}.{variant}"
    for j, (a, b) in enumerate(zip(res[0][0], res[1][0])):
        assert a.dtype == dtype
        check(f"{tag}.out{j}", a, b, tol)
    names = (
        [f"src{i}" for i in range(S)] + ["live"] + [f"{k}{j}" for k in ("q", "nw", "gain") for j in range(Q)]
    )
    for j, (n, a, b) in enumerate(zip(names, res[0][1], res[1][1])):
        own = rel(res[2][1][j], b) if len(res) > 2 else 0.0
        check(f"{tag}.d{n}", a, b, max(3 * tol, 2 * own))


@pytest.mark.parametrize(
    "dtype,blocks,Q,D,T,cap,direct_max",
    [
        (torch.bfloat16, 4, 8, 2048, 257, None, None),  # the medium walk (sources buffer sized up front)
        (torch.float32, 4, 8, 2048, 100, 2, 0),  # buffer grows twice; partials stored for every set
        (torch.bfloat16, 9, 24, 1000, 64, 4, None),  # K3-like: up to 9 sealed sets, 24 sites per set
        (torch.bfloat16, 9, 24, 1000, 64, 4, 9),  # ... with no partials stored for any set
    ],
)
def test_attnres_reader_model_walk(dtype, blocks, Q, D, T, cap, direct_max, check, monkeypatch):
    """A model's walk: ``blocks`` seals, each announcing its own Q sites, the reads of each set between its seal and
    the next (one site read twice, one unannounced), one backward through all of it; fast vs reference reader.
    ``direct_max``: sets of up to that many sources keep no partials (None: the default)."""
    from openk3.fast import attnres
    from openk3.fast.attnres import TritonAttnResReader
    from openk3.ops.attnres import AttnResReader

    if direct_max is not None:
        monkeypatch.setattr(attnres, "DIRECT_MAX", direct_max)

    g = _fresh()
    B = 2
    srcs = [_rand(B, T, D, dtype=dtype, scale=1 + i % 3, g=g) for i in range(blocks)]
    lives = [_rand(B, T, D, dtype=dtype, scale=2, g=g) for _ in range(blocks)]
    qs = [_rand(1, D, scale=0.05, g=g) for _ in range(blocks * Q)]
    nws = [1 + 0.1 * _rand(D, g=g) for _ in range(blocks * Q)]
    res = []
    for cls in (TritonAttnResReader, AttnResReader):
        ins = [t.clone().requires_grad_() for t in [*srcs, *lives, *qs, *nws]]
        src, lv = ins[:blocks], ins[blocks : 2 * blocks]
        qq, nw = ins[2 * blocks : 2 * blocks + blocks * Q], ins[2 * blocks + blocks * Q :]
        rd = cls(1e-5, max_sources=cap)
        outs = []
        for b in range(blocks):
            ids = range(b * Q, (b + 1) * Q)
            rd.seal(src[b], [(j, qq[j], nw[j]) for j in ids])
            if cls is TritonAttnResReader:
                assert rd._block.direct == (b + 1 <= attnres.DIRECT_MAX)
            outs += [rd.read(j, qq[j], nw[j], lv[b] * (1 + 0.05 * (j % Q))) for j in ids if j % Q != 1]
            outs.append(rd.read(b * Q, qq[b * Q], nw[b * Q], lv[b] * 0.5))  # second read of a site
            outs.append(rd.read(10**6, qq[b * Q + 1], nw[b * Q + 1], lv[b]))  # not announced
        gen = _fresh(3)
        loss = sum((o.float() * torch.randn(o.shape, device=DEV, generator=gen)).sum() for o in outs)
        loss.backward()
        res.append((outs, [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]))
    tol = AR_TOL[dtype]
    tag = f"attnres_walk.{str(dtype)[6:]}.B{blocks}.Q{Q}.D{D}.direct{attnres.DIRECT_MAX}"
    for j, (a, b) in enumerate(zip(res[0][0], res[1][0])):
        check(f"{tag}.out{j}", a, b, tol)
    names = (
        [f"src{i}" for i in range(blocks)]
        + [f"live{i}" for i in range(blocks)]
        + [f"q{j}" for j in range(blocks * Q)]
        + [f"nw{j}" for j in range(blocks * Q)]
    )
    for n, a, b in zip(names, res[0][1], res[1][1]):
        if b.abs().sum() == 0:
            assert a.abs().sum() == 0, n
            continue
        check(f"{tag}.d{n}", a, b, 3 * tol)
