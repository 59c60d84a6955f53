"""Our own Triton kernels (MoE planner/permutation/SiTU/combine in every MoE variant, two-phase AttnRes) under
TRITON_INTERPRET=1 on CPU, at small sizes, against the references. Runs in a subprocess (the interpreter must be
chosen before triton kernels are defined); skipped when triton is not installed. Not marked ``gpu``: it runs on
CPU-only machines too.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import torch
    from openk3.fast import attnres, moe
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

    # AttnRes: seal S sources (announcing Q sites at the last seal), read every site (site 0 twice if `twice`: the
    # accumulating backward path), backprop a random projection. Per-tensor relative errors against the reference
    # reader run in float64: outputs, every sealed source and the live sum must match to fp32 rounding (measured
    # <= 1e-6); the query and norm-weight gradients sum over tokens with cancellation and are ill-conditioned at one
    # token (measured up to 1.5e-5 at N=1), hence their own tolerance.
    def attnres_case(N, D, S, Q, twice=False, scale=0.2):
        srcs = [torch.randn(1, N, D) * (1 + i % 3) for i in range(S + 1)]
        qs = [torch.randn(1, D) * scale for _ in range(Q)]
        nws = [1 + 0.1 * torch.randn(D) for _ in range(Q)]
        res = []
        for cls, dt in ((TritonAttnResReader, torch.float32), (AttnResReader, torch.float64)):
            L = [t.to(dt).clone().requires_grad_() for t in srcs + qs + nws]
            src, qq, nw = L[: S + 1], L[S + 1 : S + 1 + Q], L[S + 1 + Q :]
            rd = cls(1e-5)
            for s in src[: S - 1]:
                rd.seal(s, None)
            rd.seal(src[S - 1], [(j, qq[j], nw[j]) for j in range(Q)])
            outs = [rd.read(j, qq[j], nw[j], src[S] * (1 + 0.1 * j)) for j in range(Q)]
            if twice:
                outs.append(rd.read(0, qq[0], nw[0], src[S] * 0.7))
            gen = torch.Generator().manual_seed(1)
            sum((o * torch.randn(o.shape, generator=gen).to(dt)).sum() for o in outs).backward()
            res.append(outs + [t.grad for t in L])
        errs = [rel(a, b) for a, b in zip(res[0], res[1])]
        nv = len(errs) - 2 * Q
        assert max(errs[:nv]) < 1e-5 and max(errs[nv:]) < 1e-4, (N, D, S, Q, errs)
        return max(errs[:nv])

    worst = max(worst, attnres_case(37, 200, 4, 5))
    # tile choices: decode sizes (whole rows, one program), N not a multiple of any tile, D a power of two, 1000,
    # 192; S in {1, 2, 5}; Q in {1, 3}; a site read twice
    cases = [
        (1, 256, 2, 3, False), (3, 192, 5, 1, True), (1, 1000, 1, 1, False), (37, 1000, 5, 3, True),
        (70, 192, 2, 3, False), (70, 256, 1, 3, True), (3, 1000, 2, 3, False),
    ]  # fmt: skip
    for N, D, S, Q, twice in cases:
        worst = max(worst, attnres_case(N, D, S, Q, twice, scale=3 / D**0.5))
    # shrunken budgets: chunked wide rows (two passes over D, a partial last chunk), several token tiles per program
    # (query-gradient partials accumulated over tiles), narrow phase-1 tiles
    attnres.ROW_MAX, attnres.ROW_CHUNK, attnres.ROW, attnres.WAVE, attnres.E3 = 256, 128, 512, 2, 1024
    small = [(1, 1000, 1, 1, False), (3, 192, 5, 1, True), (37, 300, 2, 3, True), (20, 256, 2, 3, False)]
    for N, D, S, Q, twice in small:
        worst = max(worst, attnres_case(N, D, S, Q, twice, scale=3 / D**0.5))
    print("WORST", worst)
    """
)


def test_triton_kernels_interpreted_on_cpu():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.join(root, "src"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    worst = float(out.stdout.split("WORST")[-1])
    assert worst < 1e-5, worst
