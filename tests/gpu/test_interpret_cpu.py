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
        p0, p1 = moe.Plan(idx, E, sparse=sparse), moe.RowPlan(idx, E, w, sparse=sparse)
        assert p0.P == p1.P
        assert torch.equal(p0.rows, p1.rows.long()) and torch.equal(p0.tok_of_row, p1.tok_of_row.long())
        assert torch.equal(p0.offs, p1.offs) and torch.equal(p0.row_scale(w), p1.scale)

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

    D, N, S, Q = 200, 37, 4, 5
    srcs = [torch.randn(1, N, D) * (1 + i % 3) for i in range(S + 1)]
    qs = [torch.randn(1, D) * 0.2 for _ in range(Q)]
    nws = [1 + 0.1 * torch.randn(D) for _ in range(Q)]
    res = []
    for cls in (TritonAttnResReader, AttnResReader):
        L = [t.clone().requires_grad_() for t in srcs + qs + nws]
        src, qq, nw = L[: S + 1], L[S + 1 : S + 1 + Q], L[S + 1 + Q :]
        rd = cls(1e-5)
        for s in src[: S - 1]:
            rd.seal(s, None)
        rd.seal(src[S - 1], [(j, qq[j], nw[j]) for j in range(Q)])
        outs = [rd.read(j, qq[j], nw[j], src[S] * (1 + 0.1 * j)) for j in range(Q)]
        gen = torch.Generator().manual_seed(1)
        sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs).backward()
        res.append(outs + [t.grad for t in L])
    worst = max([worst] + [rel(a, b) for a, b in zip(res[0], res[1])])
    print("WORST", worst)
    """
)


def test_triton_kernels_interpreted_on_cpu(run_interpreted):
    worst = run_interpreted(SCRIPT)
    assert worst < 1e-5, worst
