"""The expert-tiled routed experts (``openk3.fast.moe_tiled``: decode batches, each expert's weights read once for
all its pairs) under TRITON_INTERPRET=1 on CPU against ``openk3.ops.moe.experts_reference``: fp32 (IEEE products)
and fp16, SiTU and SwiGLU, widths that are not multiples of the tiles, experts with no pair, an expert with more
pairs than one 16-row tile (several row chunks), taller row steps (32 and 64 rows) and the auto rule for them, one
slot per token, gate / up as the two halves of one buffer and as separate tensors, a strided input; expert ids out
of range (NaN on their tokens); the dispatch from ``experts_grouped``; a whole model through them; bad input.
(bf16 runs on the GPU only: the interpreter's ``tl.dot`` on bf16 operands is wrong in triton 3.6, so the dispatch
leaves bf16 to the grouped path there; tests/gpu/test_fast_ops.py checks the compiled kernels in bf16.)
Runs in a subprocess (the interpreter must be chosen before triton kernels are defined); skipped without triton.
"""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import torch
    from openk3.fast import moe, moe_tiled
    from openk3.ops.moe import experts_reference

    torch.manual_seed(0)

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
    worst = 0.0
    # (N, E, K, W, I, hot): hot = one expert in every token's slots (more pairs than a 16-row tile)
    cases = [(5, 8, 3, 40, 24, False), (20, 16, 4, 64, 48, False), (40, 6, 2, 96, 72, True),
             (7, 300, 1, 33, 17, False), (33, 8, 4, 50, 20, True)]
    for N, E, K, W, I, hot in cases:
        for dtype in (torch.float32, torch.float16):
            for act in ("situ", "silu"):
                for packed in (True, False):
                    x = torch.randn(N, W + 3)[:, :W].to(dtype)  # row stride W + 3
                    if packed:
                        w13 = (torch.randn(E, 2 * I, W) * W**-0.5).to(dtype)
                        w1, w3 = w13[:, :I], w13[:, I:]
                    else:
                        w1 = (torch.randn(E, I, W) * W**-0.5).to(dtype)
                        w3 = (torch.randn(E, I, W) * W**-0.5).to(dtype)
                    w2 = (torch.randn(E, W, I) * I**-0.5).to(dtype)
                    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(N)])  # expert E-1: no pair
                    if hot:
                        idx[:, 0] = 1
                        idx[:, 1:] = torch.stack([torch.randperm(E - 2)[: K - 1] + 2 for _ in range(N)])
                    wt = torch.rand(N, K)
                    y = moe_tiled.experts_tiled(x, idx, wt, w1, w2, w3, act=act)
                    r = experts_reference(x.float(), idx, wt, w1.float(), w2.float(), w3.float(), act=act)
                    assert y.dtype == dtype and y.shape == (N, W)
                    e = rel(y, r)
                    assert e <= TOL[dtype], (N, E, K, W, I, dtype, act, packed, e)
                    worst = max(worst, e / TOL[dtype])
    # taller row steps (BM 32 / 64: the auto rule's choice past 8 pairs per expert on average): groups shorter
    # than a step, and the hot expert's longer than one
    for N, E, K, W, I, hot in cases[2:3] + cases[4:]:
        for bm in (32, 64):
            for dtype in (torch.float32, torch.float16):
                x = torch.randn(N, W).to(dtype)
                w1, w3 = ((torch.randn(E, I, W) * W**-0.5).to(dtype) for _ in range(2))
                w2 = (torch.randn(E, W, I) * I**-0.5).to(dtype)
                idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
                idx[:, 0] = 0
                idx[:, 1:] = torch.stack([torch.randperm(E - 1)[: K - 1] + 1 for _ in range(N)])
                wt = torch.rand(N, K)
                moe_tiled.TILED["bm"] = bm
                try:
                    y = moe_tiled.experts_tiled(x, idx, wt, w1, w2, w3)
                finally:
                    moe_tiled.TILED["bm"] = 0
                r = experts_reference(x.float(), idx, wt, w1.float(), w2.float(), w3.float())
                e = rel(y, r)
                assert e <= TOL[dtype], (N, E, K, W, I, bm, dtype, e)
                worst = max(worst, e / TOL[dtype])
    # the auto rule: 16 rows up to 8 pairs per expert on average, then the power of two >= twice the average, <= 64
    rps = moe_tiled.rows_per_step
    assert [rps(n * 8, 256) for n in (1, 16, 64, 256)] == [16, 16, 16, 16]
    assert [rps(n * 8, 64) for n in (64, 65, 128, 129, 256, 4096)] == [16, 32, 32, 64, 64, 64]
    for bad_bm in (8, 24, 128):
        moe_tiled.TILED["bm"] = bad_bm
        try:
            rps(64, 8)
        except ValueError:
            pass
        else:
            raise AssertionError(f"TILED['bm'] = {bad_bm} accepted")
        finally:
            moe_tiled.TILED["bm"] = 0
    # a wrong result is caught: one expert's weights changed after the fact changes the output
    N, E, K, W, I = 9, 7, 2, 32, 16
    x = torch.randn(N, W)
    w1, w3 = torch.randn(E, I, W), torch.randn(E, I, W)
    w2 = torch.randn(E, W, I)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    wt = torch.rand(N, K)
    y0 = moe_tiled.experts_tiled(x, idx, wt, w1, w2, w3)
    w2b = w2.clone()
    w2b[int(idx[0, 0])] += 1.0
    assert rel(moe_tiled.experts_tiled(x, idx, wt, w1, w2b, w3), y0) > 1e-3
    # the dispatch: experts_grouped without autograd takes the tiled kernels up to the bound, the grouped layout
    # past it (and with autograd); both agree with the reference
    calls = []
    bound0 = moe_tiled.TILED["max_pairs_per_expert"]
    moe_tiled.TILED["max_pairs_per_expert"] = bound = 16
    tiled0 = moe_tiled.experts_tiled
    moe_tiled.experts_tiled = lambda *a, **k: calls.append(1) or tiled0(*a, **k)
    try:
        ref = experts_reference(x, idx, wt, w1, w2, w3)
        with torch.no_grad():
            y1 = moe.experts_grouped(x, idx, wt, w1, w2, w3)
        assert calls == [1] and rel(y1, ref) <= 1e-5, (calls, rel(y1, ref))
        moe_tiled.TILED["max_pairs_per_expert"] = 0
        with torch.no_grad():
            y2 = moe.experts_grouped(x, idx, wt, w1, w2, w3)
        moe_tiled.TILED["max_pairs_per_expert"] = bound
        assert calls == [1] and rel(y2, ref) <= 1e-5
        xg = x.clone().requires_grad_()
        y3 = moe.experts_grouped(xg, idx, wt, w1, w2, w3)
        y3.sum().backward()
        assert calls == [1] and xg.grad is not None and rel(y3, ref) <= 1e-5
        many = torch.randint(0, E, (bound * E // K + 1, K))
        assert not moe_tiled.applies(x, many, E) and moe_tiled.applies(x, idx, E)
        assert not moe_tiled.applies(x.bfloat16(), idx, E)  # (the interpreter's bf16 products)
    finally:
        moe_tiled.experts_tiled = tiled0
        moe_tiled.TILED["max_pairs_per_expert"] = bound0
    # a whole model (tiny preset: latent MoE, shared experts), the "moe" op resolved to grouped_mm as on CUDA, the
    # tiled kernels on: every MoE layer's 48 tokens (12 pairs per expert) take them; logits match the reference
    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM
    from openk3.ops import backend

    cfg = get_preset("tiny")
    model = K3ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    calls.clear()
    moe_tiled.experts_tiled = lambda *a, **k: calls.append(a[0].shape[0]) or tiled0(*a, **k)
    moe_tiled.TILED["max_pairs_per_expert"] = 16
    resolve = backend.resolve
    try:
        with torch.no_grad():
            want = model(ids).logits
            backend.resolve = lambda op, cuda, req=None: "grouped_mm" if op == "moe" else resolve(op, cuda, req)
            got = model(ids).logits
    finally:
        backend.resolve = resolve
        moe_tiled.experts_tiled = tiled0
        moe_tiled.TILED["max_pairs_per_expert"] = bound0
    n_moe = sum(layer.is_moe for layer in model.model.layers)
    assert calls == [48] * n_moe and n_moe > 0, calls
    e = rel(got, want)
    assert e <= 1e-5, e
    worst = max(worst, e / 1e-5)
    # an expert id outside [0, E) (-1 on token 2, E on token 5): those tokens' outputs are NaN (no out-of-bounds
    # access), the others match the reference over the good tokens alone
    x, idx, wt = torch.randn(N, W), torch.stack([torch.randperm(E)[:K] for _ in range(N)]), torch.rand(N, K)
    idx[2, 1], idx[5, 0] = -1, E
    good = torch.tensor([n not in (2, 5) for n in range(N)])
    y = moe_tiled.experts_tiled(x, idx, wt, w1, w2, w3)
    assert bool(y[~good].isnan().all()) and bool(y[good].isfinite().all())
    e = rel(y[good], experts_reference(x[good], idx[good], wt[good], w1, w2, w3))
    assert e <= 1e-5, e
    worst = max(worst, e / 1e-5)
    # no tokens; bad input
    assert moe_tiled.experts_tiled(x[:0], idx[:0], wt[:0], w1, w2, w3).shape == (0, W)
    bad = [
        lambda: moe_tiled.experts_tiled(x[:, :-1], idx, wt, w1, w2, w3),
        lambda: moe_tiled.experts_tiled(x, idx[:, :1], wt, w1, w2, w3),
        lambda: moe_tiled.experts_tiled(x, idx, wt, w1, w2[:, :-1], w3),
        lambda: moe_tiled.experts_tiled(x, idx, wt, w1, w2, w3[:-1]),
        lambda: moe_tiled.experts_tiled(x, idx, wt, w1, w2, w3, act="gelu"),
        lambda: moe_tiled.experts_tiled(x.half(), idx, wt, w1, w2, w3),  # weights of another dtype
        lambda: moe_tiled.experts_tiled(x, idx, wt, w1, w2.double(), w3),
    ]
    for f in bad:
        try:
            f()
        except ValueError:
            pass
        else:
            raise AssertionError("bad input accepted")
    print("WORST", worst)
    """
)


def test_moe_tiled_interpreted_on_cpu(run_interpreted):
    worst = run_interpreted(SCRIPT)
    assert worst <= 1.0, worst
