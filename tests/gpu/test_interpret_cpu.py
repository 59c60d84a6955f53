"""Our own Triton kernels (MoE planner/permutation/SiTU/combine in every MoE variant, two-phase AttnRes) under
TRITON_INTERPRET=1 on CPU, at small sizes, against the references. Runs in a subprocess (the interpreter must be
chosen before triton kernels are defined); skipped when triton is not installed. Not marked ``gpu``: it runs on
CPU-only machines too.
"""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import torch
    from openk3.fast import moe
    from openk3.fast.attnres import TritonAttnResReader
    from openk3.fast.moe import experts_grouped
    from openk3.ops.attnres import AttnResReader
    from openk3.ops.moe import experts_reference

    torch.manual_seed(0)

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm())

    # the Triton planner reproduces the torch planner exactly (training and inference layouts)
    for N, E, K, sparse in [(37, 6, 3, False), (300, 8, 2, True), (1, 256, 8, False), (200, 16, 4, True)]:
        idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(N)])
        w = torch.rand(N, K)
        p0, p1 = moe.Plan(idx, E, sparse=sparse), moe.RowPlan(idx, E, sparse=sparse)
        assert p0.P == p1.P
        assert torch.equal(p0.rows, p1.rows.long()) and torch.equal(p0.offs, p1.offs)
        pair = p1.pair_of_row.long()  # pair n*K + j of each row, N*K on padding: token pair // K, weight w[pair]
        assert torch.equal(pair[p0.rows.reshape(-1)], torch.arange(N * K))
        assert torch.equal(pair // K, p0.tok_of_row) and bool((pair <= N * K).all())
        assert torch.equal(torch.cat([w.reshape(-1), w.new_zeros(1)])[pair], p0.row_scale(w))

    worst = 0.0
    moe.FUSE_MIN_ROWS_PER_EXPERT = 0  # exercise the stacked gate/up path at this small size
    for variant, act in [(v, a) for v in moe.VARIANTS for a in ("situ", "silu")]:
        N, W, I, E, K = 37, 24, 20, 6, 3
        x = torch.randn(N, W)
        idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(N)])
        w = torch.rand(N, K)
        ws = [torch.randn(E, I, W) * 0.3, torch.randn(E, W, I) * 0.3, torch.randn(E, I, W) * 0.3]
        a_in = [t.clone().requires_grad_() for t in (x, w, *ws)]
        b_in = [t.clone().requires_grad_() for t in (x, w, *ws)]
        ya = experts_grouped(a_in[0], idx, a_in[1], *a_in[2:], act=act, variant=variant)
        yb = experts_reference(b_in[0], idx, b_in[1], *b_in[2:], act=act)
        g = torch.randn_like(ya)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        worst = max([worst, rel(ya, yb)] + [rel(p.grad, q.grad) for p, q in zip(a_in, b_in)])
        assert all(bool((p.grad[E - 1] == 0).all()) for p in a_in[2:])

    # a walk over three sealed sets (a model's blocks), the source buffer growing past its capacity (2), each
    # block's sites announced at its seal; every second site read, one read twice (second read: reference path),
    # one site not announced; backward through everything at once. Run with partials stored for every set
    # (DIRECT_MAX 0), with none stored (3), and mixed (2: the third set stores them).
    # 37 tokens: the training tiles; 5 and 1 (a decode step): phase 1's few-token tile. With one token some
    # gradients are sums of few, cancelling terms, where two fp32 evaluations differ by more than elsewhere, so the
    # few-token cases are held against an fp64 evaluation of the same formula (both fp32 readers within 1e-4 of it;
    # measured: up to 5e-5 for this reader, 1e-5 for the reference).
    from openk3.fast import attnres

    class Ref64(AttnResReader):
        def read(self, site_id, query, norm_weight, r):
            vals = torch.stack([t.double() for t in [*self.sealed, r]])
            w = norm_weight.double() * query.double().reshape(-1)
            inv = torch.rsqrt(vals.pow(2).mean(-1, keepdim=True) + self.eps)
            p = torch.softmax(((vals * inv) * w).sum(-1), dim=0)
            return (p.unsqueeze(-1) * vals).sum(0)

    D, Q = 200, 5
    for N, direct_max in [(37, 0), (37, 3), (37, 2), (5, 2), (1, 0), (1, 3)]:
        blocks = [torch.randn(1, N, D) * (1 + i % 3) for i in range(3)]
        lives = [torch.randn(1, N, D) * 2 for _ in range(3)]
        qs = [torch.randn(1, D) * 0.2 for _ in range(3 * Q)]
        nws = [1 + 0.1 * torch.randn(D) for _ in range(3 * Q)]
        attnres.DIRECT_MAX = direct_max
        res = []
        for cls in (TritonAttnResReader, AttnResReader, Ref64):
            L = [(t.double() if cls is Ref64 else t.clone()).requires_grad_() for t in blocks + lives + qs + nws]
            src, lv, qq, nw = L[:3], L[3:6], L[6 : 6 + 3 * Q], L[6 + 3 * Q :]
            rd = cls(1e-5, max_sources=2)
            outs = []
            for b in range(3):
                ids = range(b * Q, (b + 1) * Q)
                rd.seal(src[b], [(j, qq[j], nw[j]) for j in ids])
                if cls is TritonAttnResReader:
                    assert rd._block.direct == (b + 1 <= direct_max)
                outs += [rd.read(j, qq[j], nw[j], lv[b] * (1 + 0.1 * j)) for j in ids if j % 2 == 0]
                outs.append(rd.read(b * Q, qq[b * Q], nw[b * Q], lv[b] * 0.5))  # read twice
                outs.append(rd.read(999, qq[b * Q + 1], nw[b * Q + 1], lv[b]))  # not announced
            gen = torch.Generator().manual_seed(1)
            sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs).backward()
            res.append(outs + [t.grad if t.grad is not None else torch.zeros_like(t) for t in L])
        assert len(res[0]) == len(res[1]) == len(res[2])
        assert all(bool((a == 0).all()) for a, b in zip(res[0], res[1]) if b.abs().sum() == 0)
        for a, b, c in zip(*res):
            if b.abs().sum() == 0:
                continue
            if N >= 32:
                worst = max(worst, rel(a, b))
            else:
                assert rel(a, c) <= 1e-4 and rel(b, c) <= 1e-4, (N, direct_max, rel(a, c), rel(b, c))

    # read_normed (decode, gradients off): the read and the RMSNorm after it in one launch, against the RMSNorm of
    # the reference read; a second read of the same site takes the reference path
    from openk3.modules.norm import RMSNorm
    from openk3.ops.norm import rms_norm

    norm = RMSNorm(D, eps=1e-6)
    launches = []
    p2 = attnres._p2_fwd

    ones = []  # whether each launch took the one-tile form (decode-sized token counts)

    class Spy:  # records whether each phase-2 launch normed its output
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(k["NORM"]) or ones.append(k["ONE"]) or p2[grid](*a, **k)

    attnres._p2_fwd = Spy()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(D))
        for N, direct_max in [(1, 3), (7, 0), (40, 2)]:
            attnres.DIRECT_MAX = direct_max
            srcs = [torch.randn(1, N, D) * (1 + i) for i in range(3)]
            live = torch.randn(1, N, D) * 2
            sites = [(j, torch.randn(1, D) * 0.2, 1 + 0.1 * torch.randn(D)) for j in range(3)]
            fast, ref = TritonAttnResReader(1e-5, max_sources=2), AttnResReader(1e-5)
            for rd in (fast, ref):
                for t in srcs:
                    rd.seal(t, sites)
            for j, q, nw in sites:
                want = rms_norm(ref.read(j, q, nw, live), norm.weight, norm.eps)
                got = fast.read_normed(j, q, nw, live, norm)
                worst = max(worst, rel(got, want))
                assert got.shape == live.shape and got.dtype == live.dtype
            assert launches == [True] * len(sites), launches
            assert ones == [N <= attnres.P2_ONE_TILE_TOKENS] * len(sites), (N, ones)
            launches.clear()
            ones.clear()
            again = fast.read_normed(0, sites[0][1], sites[0][2], live, norm)  # second read: reference path
            worst = max(worst, rel(again, rms_norm(ref.read(0, sites[0][1], sites[0][2], live), norm.weight, 1e-6)))
            assert launches == [], launches
    attnres._p2_fwd = p2
    print("WORST", worst)
    """
)


def test_triton_kernels_interpreted_on_cpu(run_interpreted):
    worst = run_interpreted(SCRIPT)
    assert worst < 1e-5, worst


READ_NORMED_SCRIPT = textwrap.dedent(
    """
    import copy
    import torch
    import openk3.model as M
    from openk3.config import get_preset
    from openk3.fast import attnres
    from openk3.model import K3ForCausalLM
    from openk3.modules.norm import RMSNorm
    from openk3.ops.attnres import AttnResReader

    torch.manual_seed(0)

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm())

    # read_normed with gradients: the fused read + RMSNorm (forward without the read's output, the norm's backward
    # inside phase 2's) against the reference read, then the reference norm; partials for every set, for none, mixed;
    # 21 tokens (training tiles; phase 2 runs one program per token, so the interpreter's time follows the count) and
    # 3 (phase 1's few-token tile); whole-row backward (one and two rows per block,
    # several blocks per program) and column-tiled (9 tokens: its column loop is the point, and it is the slowest
    # case); a second read of a site (unfused path)
    worst = 0.0
    D, Q = 200, 4
    fused = []
    p2n = attnres._Phase2Normed.apply
    attnres._Phase2Normed.apply = lambda *a: fused.append(a[1]) or p2n(*a)
    row_tiles = dict(attnres.TILES)
    looped = dict(p2_bwd_norm=(2, 64, 4), p2_bwd_norm_direct=(1, 64, 4))  # rows wider than the column tile
    rows2 = dict(p2_bwd_norm=(2, 256, 4), p2_bwd_norm_direct=(2, 256, 4))  # one pass, two rows per block
    dv = dict(DV_DOT=attnres.DV_DOT, DV_STAGES=attnres.DV_STAGES)
    fma, dot = dict(DV_DOT="fma", DV_STAGES=2), dict(DV_DOT="ieee", DV_STAGES=0)
    cases = [(21, 0, {}, 16, dv), (21, 3, {}, 16, dv), (21, 2, {}, 16, dv), (3, 3, {}, 16, dv),
             (9, 2, looped, 16, dv), (21, 2, rows2, 16, dv), (21, 0, {}, 5, dv), (21, 3, {}, 5, dv),
             (17, 0, {}, 16, fma), (17, 3, {}, 16, dot)]  # fmt: skip
    for N, direct_max, tiles, rows, dv_opts in cases:  # rows: tokens per program of the one-pass backward
        attnres.DIRECT_MAX = direct_max
        attnres.P2_NORM_ROWS = rows
        for k, val in dv_opts.items():  # the source-gradient kernel: W-term as a dot or outer products; site loop
            setattr(attnres, k, val)
        attnres.TILES.update(row_tiles)
        attnres.TILES.update(tiles)
        blocks = [torch.randn(1, N, D) * (1 + i % 3) for i in range(3)]
        live = torch.randn(1, N, D) * 2
        qs = [torch.randn(1, D) * 0.3 for _ in range(3 * Q)]
        nws = [1 + 0.1 * torch.randn(D) for _ in range(3 * Q)]
        gains = [1 + 0.2 * torch.randn(D) for _ in range(3 * Q)]
        res = []
        for cls in (attnres.TritonAttnResReader, AttnResReader):
            L = [t.clone().requires_grad_() for t in blocks + [live] + qs + nws + gains]
            src, lv = L[:3], L[3]
            qq, nw, gn = L[4 : 4 + 3 * Q], L[4 + 3 * Q : 4 + 6 * Q], L[4 + 6 * Q :]
            rd = cls(1e-5, max_sources=2)
            outs = []
            for b in range(3):
                ids = range(b * Q, (b + 1) * Q)
                rd.seal(src[b], [(j, qq[j], nw[j]) for j in ids])
                for j in list(ids) + [b * Q]:  # the last: a second read of the set's first site
                    norm = RMSNorm(D, eps=1e-6)
                    del norm.weight
                    norm.weight = gn[j]
                    # set 1 reads with a query equal to but not the announced tensor (folded again for the read)
                    q_read = qq[j] * 1 if b == 1 else qq[j]
                    outs.append(rd.read_normed(j, q_read, nw[j], lv * (1 + 0.1 * j), norm))
            gen = torch.Generator().manual_seed(1)
            sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs).backward()
            res.append(outs + [t.grad for t in L])
        assert len(fused) == 3 * Q, fused  # every first read fused, the second reads not
        fused.clear()
        worst = max([worst] + [rel(a, b) for a, b in zip(*res)])
    attnres._Phase2Normed.apply = p2n
    attnres.TILES.update(row_tiles)
    attnres.P2_NORM_ROWS = 16
    for k, val in dv.items():
        setattr(attnres, k, val)

    # the tiny model cut to 5 layers (AttnRes blocks of 3: a sealed block and a partial one, KDA and MLA layers):
    # loss and every parameter gradient with the Triton reader, read and norm fused (the default) and not, against
    # the reference reader; with gradient checkpointing too
    M.make_reader = lambda eps, is_cuda, be, max_sources=None: (
        attnres.TritonAttnResReader if be == "triton" else AttnResReader
    )(eps, max_sources=max_sources)
    cfg = get_preset("tiny").replace(num_hidden_layers=5, kda_layers=[1, 2, 3, 5], full_attn_layers=[4])
    base = K3ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 21))

    def step(backend, fuse, ckpt):
        m = copy.deepcopy(base)
        m.set_backend("attnres", backend)
        m.model.fuse_read_norm = fuse
        m.model.gradient_checkpointing = ckpt
        loss = m(ids, targets=ids).loss
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}

    calls = []
    attnres._Phase2Normed.apply = lambda *a: calls.append(1) or p2n(*a)
    for ckpt in (False, True):
        ref_loss, ref_g = step("reference", True, ckpt)
        for fuse in (False, True) if not ckpt else (True,):
            calls.clear()
            loss, g = step("triton", fuse, ckpt)
            assert len(calls) == (2 * cfg.num_hidden_layers if fuse else 0), len(calls)  # all reads but layer 0's first
            assert set(g) == set(ref_g)
            worst = max([worst, rel(loss, ref_loss)] + [rel(g[k], ref_g[k]) for k in ref_g if ref_g[k].abs().sum() > 0])
    print("WORST", worst)
    """
)


def test_attnres_read_normed_training_interpreted_on_cpu(run_interpreted):
    """The fused AttnRes read + RMSNorm with gradients, reader-level and in a whole tiny model step."""
    worst = run_interpreted(READ_NORMED_SCRIPT, hide_cuda=True)
    assert worst < 2e-5, worst


MOE_V2_SCRIPT = textwrap.dedent(
    """
    import torch
    from openk3.fast import moe, moe_tiled
    from openk3.ops.moe import experts_reference

    torch.manual_seed(0)
    moe_tiled.TILED["max_pairs_per_expert"] = 0  # the grouped variants themselves, also without autograd
    # bf16: the interpreter's bf16 casts round toward zero, about doubling the GPU's error (<= 4.8e-3 there)
    TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # measured here: fp32 <= 6.3e-7, bf16 <= 9.8e-3
    worst = 0.0  # largest error / tolerance

    def check(name, got, want, tol):
        global worst
        a, b = got.detach().double(), want.detach().double()
        assert got.shape == want.shape and bool(torch.isfinite(a).all()), name
        err = float((a - b).norm() / b.norm())
        assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.1e}"
        worst = max(worst, err / tol)

    # the combine-backward kernel alone against plain torch: dy (written into a NaN-filled buffer: zero on the
    # padding rows) and dweights, y with a padded row stride, one and several chunks of W per row
    for dtype in (torch.float32, torch.bfloat16):
        for N, K, E, W, cap, need_dw in [
            (37, 3, 6, 96, 1024, True),
            (37, 3, 6, 96, 32, True),
            (21, 2, 5, 1000, 256, True),
            (21, 2, 5, 1000, 256, False),
        ]:
            moe._DYDW_MAX_BW = cap
            plan = moe.RowPlan(torch.stack([torch.randperm(E - 1)[:K] for _ in range(N)]), E)
            w = torch.rand(N, K)
            dout = torch.randn(N, W).to(dtype)
            y = torch.randn(plan.P, W + 8).to(dtype)[:, :W]
            buf = torch.full((plan.P, W), float("nan"), dtype=dtype)
            dy, dw = moe.dy_dweights(dout, y, plan.pair_of_row, w, need_dw=need_dw, out=buf)
            pair = plan.pair_of_row.long()
            real = pair < N * K
            assert dy.data_ptr() == buf.data_ptr() and bool((~real).any())
            want = torch.zeros(plan.P, W)
            want[real] = dout.float()[pair[real] // K] * w.reshape(-1)[pair[real], None]
            # one rounding of the same fp32 product (to nearest on GPUs, toward zero in the interpreter's bf16
            # cast: within one bf16 ulp either way), exact zeros on the padding rows
            assert bool(((dy.float() - want).abs() <= want.abs() * (0 if dtype == torch.float32 else 2**-7)).all())
            if need_dw:
                want_dw = (dout.float()[:, None, :] * y.float()[plan.rows.long()]).sum(-1)
                check(f"dweights.{dtype}.W{W}.bw{cap}", dw, want_dw, 1e-5)
            else:
                assert dw is None

    # every variant of the row-plan path, outputs and all gradients against the reference: expert E-1 gets no token,
    # N not a multiple of 16, W not a power of 2 (several chunks of W per row with a small cap), and weights without
    # gradient
    moe.FUSE_MIN_ROWS_PER_EXPERT = 0  # exercise the stacked gate/up path at these small sizes
    cases = [(37, 96, 40, 6, 3, 64, True), (21, 1000, 24, 5, 2, 256, True), (19, 96, 40, 4, 2, 1024, False)]
    for variant in [v for v in moe.VARIANTS if v != "base"]:
        for dtype in (torch.float32, torch.bfloat16):
            for N, W, I, E, K, cap, wgrad in cases:
                moe._DYDW_MAX_BW = cap
                idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(N)])
                ws = [torch.randn(E, I, W) * W**-0.5, torch.randn(E, W, I) * I**-0.5, torch.randn(E, I, W) * W**-0.5]
                ins = [torch.randn(N, W).to(dtype), torch.rand(N, K), *(t.to(dtype) for t in ws)]
                fast = [t.clone().requires_grad_(i != 1 or wgrad) for i, t in enumerate(ins)]
                ref = [t.clone().float().requires_grad_(i != 1 or wgrad) for i, t in enumerate(ins)]
                y = moe.experts_grouped(fast[0], idx, fast[1], *fast[2:], variant=variant)
                y_r = experts_reference(ref[0], idx, ref[1], *ref[2:])
                gy = torch.randn_like(y_r)
                (y.float() * gy).sum().backward()
                (y_r * gy).sum().backward()
                tag = f"{variant}.{dtype}.N{N}.W{W}.bw{cap}{'' if wgrad else '.no_dweights'}"
                check(f"{tag}.y", y, y_r, TOL[dtype])
                for name, a, b in zip(("dx", "dweights", "dw1", "dw2", "dw3"), fast, ref):
                    if name == "dweights" and not wgrad:
                        assert a.grad is None and b.grad is None
                        continue
                    check(f"{tag}.{name}", a.grad, b.grad, 2 * TOL[dtype])
                assert all(bool((t.grad[E - 1] == 0).all()) for t in fast[2:]), tag

    # an expert id outside [0, E) (-1 on token 3, E on token 8) in every variant: no out-of-bounds access, those
    # tokens' outputs NaN, the others as the reference over the good tokens alone. With autograd (a loss over the
    # good tokens) on the row-plan variants: the bad pairs' weight gradients and the bad tokens' input gradients are
    # NaN, everything else matches the reference's gradients
    N, W, I, E, K = 21, 40, 24, 5, 2
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    idx[3, 1], idx[8, 0] = -1, E
    good = torch.tensor([n not in (3, 8) for n in range(N)])
    ws = [torch.randn(E, I, W) * W**-0.5, torch.randn(E, W, I) * I**-0.5, torch.randn(E, I, W) * W**-0.5]
    ins = [torch.randn(N, W), torch.rand(N, K), *ws]
    ref = [t[good].clone() if i < 2 else t.clone() for i, t in enumerate(ins)]
    ref = [t.requires_grad_() for t in ref]
    y_r = experts_reference(ref[0], idx[good], ref[1], *ref[2:])
    gy = torch.randn_like(y_r)
    (y_r * gy).sum().backward()
    for variant in moe.VARIANTS:
        with torch.no_grad():
            y = moe.experts_grouped(ins[0], idx, ins[1], *ins[2:], variant=variant)
        assert bool(y[~good].isnan().all()) and bool(y[good].isfinite().all()), variant
        check(f"bad_ids.{variant}.y", y[good], y_r, TOL[torch.float32])
        if variant == "base":
            continue
        fast = [t.clone().requires_grad_() for t in ins]
        y = moe.experts_grouped(fast[0], idx, fast[1], *fast[2:], variant=variant)
        (y[good] * gy).sum().backward()
        dx, dwt = fast[0].grad, fast[1].grad
        bad_pair = (idx < 0) | (idx >= E)
        assert bool(dx[~good].isnan().all()) and bool(dwt[bad_pair].isnan().all()), variant
        check(f"bad_ids.{variant}.dx", dx[good], ref[0].grad, 2e-5)
        check(f"bad_ids.{variant}.dweights", dwt[good], ref[1].grad, 2e-5)
        for name, a, b in zip(("dw1", "dw2", "dw3"), fast[2:], ref[2:]):
            check(f"bad_ids.{variant}.{name}", a.grad, b.grad, 2e-5)
    print("WORST", worst)
    """
)


def test_moe_row_plan_backward_interpreted_on_cpu(run_interpreted):
    """The lean / fused / fused_keepx expert path (pair-indexed rows, one-pass combine backward) under the
    interpreter, fp32 and bf16: per-tensor relative errors within tolerance (checked in the script)."""
    assert run_interpreted(MOE_V2_SCRIPT) <= 1.0
