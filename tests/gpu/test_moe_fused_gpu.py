"""The one-launch MoE decode step (``openk3.fast.moe_fused.moe_token``) compiled on the GPU: one program per SM with
its grid-wide barriers, against the PyTorch reference and against the three-launch path it replaces, at the
Kimi-Linear-48B shape and at uneven small shapes; replayed from a CUDA graph with programmatic dependent launch
(the counter left at zero, the same output every replay)."""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _layer(E, K, D, I, SH, dtype=torch.bfloat16, seed=0):
    from openk3.fast import moe_small

    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

    r = rnd(1, D, scale=2.0)
    nw = (1 + 0.2 * torch.randn(D, generator=g, device=DEV)).to(dtype)
    wr = rnd(E + 2 * SH, D, scale=D**-0.5)
    bias = torch.randn(E, generator=g, device=DEV) * 0.05
    w1, w3 = rnd(E, I, D, scale=D**-0.5), rnd(E, I, D, scale=D**-0.5)
    w2 = rnd(E, D, I, scale=I**-0.5)
    shared = None
    if SH:
        shared = moe_small.SharedExperts(wr[E : E + SH], wr[E + SH :], rnd(D, SH, scale=SH**-0.5), act="silu")
    return r, nw, wr, bias, w1, w2, w3, shared


def _rel(y, want, r):
    return float((y.double() - want.double()).norm() / (want.double() - r.double()).norm())


@pytest.mark.parametrize(
    "E,K,D,I,SH,act",
    [(256, 8, 2304, 1024, 1024, "silu"), (20, 3, 200, 72, 72, "situ"), (64, 6, 512, 96, 0, "situ")],
)
def test_moe_token_matches_reference(E, K, D, I, SH, act, check):
    from openk3.fast import moe_fused, moe_small
    from openk3.infer.gemv import Normed
    from openk3.ops.moe import route
    from openk3.ops.norm import rms_norm

    r, nw, wr, bias, w1, w2, w3, shared = _layer(E, K, D, I, SH)
    kw = dict(top_k=K, activation="sigmoid", renormalize=True, scaling=2.5)
    ctr = moe_fused.new_counter(r.device)
    y, info = moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, act=act, shared=shared, **kw)
    torch.cuda.synchronize()
    assert int(ctr.abs().sum()) == 0
    want = moe_fused.moe_token_reference(r, nw, 1e-6, wr, bias, w1, w2, w3, act=act, shared=shared, **kw)
    xn = rms_norm(r, nw, 1e-6)
    idx, w, s = route(xn, wr[:E], bias, **kw)
    assert torch.equal(info.idx, idx)
    check(f"moe_token weights E{E}", info.weights, w, 1e-5)
    check(f"moe_token normed row E{E}", info.xn, xn, 1e-2)
    err = _rel(y, want, r)
    print(f"\n  relerr moe_token E{E} D{D} (of the MoE output) = {err:.3e}")
    assert err < 1e-2, err
    # the three-launch path (router GEMV forming the norm and the shared rows, gate/up, down + combine)
    xo = torch.empty_like(r)
    pr = moe_small.route_logits_small(Normed(r, nw, 1e-6, out=xo), wr, bias, extra=2 * SH, **kw)
    slot = dataclasses.replace(shared, gu=pr.extra) if SH else None
    y3 = moe_small.experts_small(xo, pr, None, w1, w2, w3, act=act, residual=r, shared=slot)
    assert torch.equal(pr.idx, info.idx)
    err3 = _rel(y, y3, r)
    print(f"  relerr moe_token vs three launches = {err3:.3e}")
    assert err3 < 1e-2, err3
    # split into three launches: the same phases
    ys, _ = moe_fused.moe_token(
        r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, act=act, shared=shared, split=True, **kw
    )
    assert _rel(ys, y, r) < 1e-2


def test_moe_token_graph_replays_with_pdl():
    """Captured in a CUDA graph with programmatic dependent launch, after a kernel that writes its input: every
    replay gives the eager output for the current input, and leaves the counter at zero."""
    from openk3.fast import moe_fused
    from openk3.fast._triton import pdl_scope

    E, K, D, I, SH = 256, 8, 2304, 1024, 1024
    r, nw, wr, bias, w1, w2, w3, shared = _layer(E, K, D, I, SH, seed=3)
    kw = dict(top_k=K, activation="sigmoid", renormalize=True, scaling=2.5, act="silu", shared=shared)
    ctr = moe_fused.new_counter(r.device)
    src = torch.empty_like(r)
    buf = torch.empty_like(r)

    def step():
        buf.copy_(src)
        return moe_fused.moe_token(buf, nw, 1e-6, wr, bias, w1, w2, w3, ctr, **kw)[0]

    with pdl_scope(True):
        src.copy_(r)
        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
    for seed in range(4):
        src.copy_(torch.randn(1, D, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV))
        g.replay()
        torch.cuda.synchronize()
        assert int(ctr.abs().sum()) == 0
        want = moe_fused.moe_token_reference(src.clone(), nw, 1e-6, wr, bias, w1, w2, w3, **kw)
        assert _rel(out, want, src) < 1e-2, seed


@pytest.mark.parametrize("warps,per_sm", [(8, 2), (4, 2), (4, 4)])
def test_moe_token_several_programs_per_sm(warps, per_sm):
    """More than one program per SM (as many as are resident at once): the same output as one per SM, the counter
    back at zero and no barrier timed out."""
    from openk3.fast import moe_fused

    E, K, D, I, SH = 256, 8, 2304, 1024, 1024
    r, nw, wr, bias, w1, w2, w3, shared = _layer(E, K, D, I, SH, seed=5)
    kw = dict(top_k=K, activation="sigmoid", renormalize=True, scaling=2.5, act="silu", shared=shared)
    ctr = moe_fused.new_counter(r.device)
    y1, info1 = moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, **kw)
    old = dict(moe_fused.CONFIG)
    try:
        moe_fused.CONFIG.update(num_warps=warps, per_sm=per_sm)
        y, info = moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, **kw)
    finally:
        moe_fused.CONFIG.clear()
        moe_fused.CONFIG.update(old)
    torch.cuda.synchronize()
    moe_fused.check_counter(ctr)
    assert int(ctr.abs().sum()) == 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert info1.grid == sms and sms < info.grid <= per_sm * sms
    assert torch.equal(info.idx, info1.idx)
    want = moe_fused.moe_token_reference(r, nw, 1e-6, wr, bias, w1, w2, w3, **kw)
    assert _rel(y, want, r) < 1e-2
    assert _rel(y, y1, r) < 1e-3


def test_moe_token_grid_not_resident_is_reported():
    """A grid larger than the GPU holds at once: the barriers give up after their polls and the counter says so
    (check_counter raises) instead of the GPU hanging; a later launch that fits is right again."""
    from openk3.fast import moe_fused

    E, K, D, I, SH = 20, 3, 200, 72, 72
    r, nw, wr, bias, w1, w2, w3, shared = _layer(E, K, D, I, SH, seed=7)
    kw = dict(top_k=K, activation="sigmoid", renormalize=True, scaling=2.5, act="situ", shared=shared)
    ctr = moe_fused.new_counter(r.device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, grid=64 * sms, spin=256, **kw)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="not all resident"):
        moe_fused.check_counter(ctr)
    assert int(ctr[0]) == 0  # the count was reset by the last program out all the same
    y, _ = moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, **kw)
    torch.cuda.synchronize()
    moe_fused.check_counter(ctr)
    want = moe_fused.moe_token_reference(r, nw, 1e-6, wr, bias, w1, w2, w3, **kw)
    assert _rel(y, want, r) < 1e-2
