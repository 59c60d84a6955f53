"""The few-token MoE path (``openk3.fast.moe_small``: router and routed experts for decode) under TRITON_INTERPRET=1
on CPU against ``openk3.ops.moe.route`` / ``experts_reference``: sigmoid and softmax routers, with and without the
correction bias and renormalisation, expert counts that are not powers of two, widths that are not multiples of
the tiles, packed and separate gate/up weights, SiTU and SwiGLU, bf16 and fp32, and bad input. (bf16 against the
fp32 computation, loosely: the interpreter truncates fp32 -> bf16 casts; tests/gpu/test_fast_ops.py checks the
compiled kernels against the bf16 reference.)
Runs in a subprocess (the interpreter must be chosen before triton kernels are defined); skipped without triton.
"""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import dataclasses
    import itertools

    import torch
    import torch.nn.functional as F
    from openk3.fast import moe_small
    from openk3.infer.gemv import Normed
    from openk3.ops.norm import rms_norm
    from openk3.ops.moe import experts_reference, route

    torch.manual_seed(0)
    # fewer, wider programs for the down + combine kernel and the GEMVs (the interpreter runs programs one by one)
    moe_small.DOWN_COMBINE["programs_per_sm"] = 1
    from openk3.infer.gemv import GEMV_CONFIG
    GEMV_CONFIG["programs_per_sm"] = 1

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    worst = 0.0  # largest relative error / its tolerance
    # router: every option, bf16 and fp32 inputs
    for E, K, D, N in [(64, 8, 96, 1), (20, 3, 50, 3), (9, 9, 17, 2), (5, 1, 8, 2)]:
        for act in ("sigmoid", "softmax"):
            for renorm, scale in [(True, 2.5), (False, 1.0)]:
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(N, D).to(dtype)
                    w = (torch.randn(E, D) / D**0.5).to(dtype)
                    for bias in (None, torch.randn(E) * 0.1):
                        kw = dict(top_k=K, activation=act, renormalize=renorm, scaling=scale)
                        i1, w1, s1 = moe_small.route_small(x, w, bias, **kw)
                        i0, w0, s0 = route(x, w, bias, **kw)
                        assert i1.dtype == torch.long and w1.dtype == torch.float32 and s1.dtype == torch.float32
                        assert torch.equal(i1, i0), (E, K, act, i1, i0)
                        worst = max(worst, rel(w1, w0) / 1e-5, rel(s1, s0) / 1e-5)  # fp32 sums
    # a NaN logit is chosen first, as torch.topk does; an expert is never chosen twice
    x = torch.randn(1, 8)
    w = torch.randn(6, 8)
    w[4] = float("nan")
    i1, _, _ = moe_small.route_small(x, w, None, top_k=3)
    i0, _, _ = route(x, w, None, top_k=3)
    assert int(i1[0, 0]) == 4 == int(i0[0, 0]) and len(set(i1[0].tolist())) == 3, (i1, i0)
    # ties (equal router rows, a zero row, equal and opposite biases): the lower index first, by the choice's
    # value, against a plain sort; both the separate and the fused selection
    for E, K in [(12, 7), (64, 8), (130, 9)]:
        w = torch.randn(E, 8)
        w[5] = w[2]
        w[E - 1] = w[2]
        w[7] = 0.0
        w[9] = 0.0
        bias = torch.randn(E) * 0.1
        bias[[2, 5, E - 1]] = 0.25
        bias[7], bias[9] = -0.0, 0.0
        x = torch.randn(1, 8)
        choice = (torch.sigmoid(x @ w.t()) + bias)[0].tolist()
        want = sorted(range(E), key=lambda e: (-choice[e], e))[:K]
        i1, _, _ = moe_small.route_small(x, w, bias, top_k=K)
        pr = moe_small.route_logits_small(x, w, bias, top_k=K)
        moe_small.experts_small(x, pr, None, torch.randn(E, 4, 8), torch.randn(E, 8, 4), torch.randn(E, 4, 8))
        assert i1[0].tolist() == want == pr.idx[0].tolist(), (E, i1, pr.idx, want)
    # the selection formed inside the experts' gate/up kernel (a PendingRoute): the same routing, bit for bit, and
    # the same output as the separate selection kernel
    for E, K, D, I, N in [(20, 3, 40, 24, 3), (64, 8, 32, 16, 1), (9, 9, 16, 8, 2)]:
        for act in ("sigmoid", "softmax"):
            for bias in (None, torch.randn(E) * 0.1):
                x = torch.randn(N, D)
                wr = torch.randn(E, D) / D**0.5
                if E == 9:
                    wr[4] = float("nan")  # a NaN logit is chosen first here too
                w1, w3 = torch.randn(E, I, D) / D**0.5, torch.randn(E, I, D) / D**0.5
                w2 = torch.randn(E, D, I) / I**0.5
                kw = dict(top_k=K, activation=act, renormalize=True, scaling=2.0)
                i0, w0, s0 = moe_small.route_small(x, wr, bias, **kw)
                y0 = moe_small.experts_small(x, i0, w0, w1, w2, w3)
                pr = moe_small.route_logits_small(x, wr, bias, **kw)
                y1 = moe_small.experts_small(x, pr, None, w1, w2, w3)
                same = lambda a, b: torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
                assert torch.equal(pr.idx, i0), (E, K, act, pr.idx, i0)
                assert same(pr.weights, w0) and same(pr.scores, s0) and same(y1, y0), (E, K, act)
    try:
        moe_small.experts_small(torch.randn(2, 8), moe_small.route_logits_small(torch.randn(3, 8), torch.randn(4, 8), None, top_k=2), None, torch.randn(4, 6, 8), torch.randn(4, 8, 6), torch.randn(4, 6, 8))
        raise AssertionError("router logits of another token count accepted")
    except ValueError:
        pass
    # experts: packed (two halves of one buffer, as openk3.modules.moe.Experts stores them) and separate gate/up
    # (the streamed gate/up tiles, and whole rows: W = 200 as a 128 head + 128 tail, 33 as 32 + 1, 256 and 16 whole)
    up_default = moe_small.UP_TILE
    for (E, I, W, N, K), up in itertools.product(
        [(10, 40, 200, 1, 3), (6, 17, 33, 4, 2), (4, 64, 256, 2, 4), (3, 8, 16, 2, 1)], (up_default, (4, 0, 1))
    ):
        moe_small.UP_TILE = up
        for act in ("situ", "silu") if up == up_default else ("situ",):  # (the activation: one code path per tile)
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
                for packed in (True, False):
                    if packed:
                        w13 = torch.randn(E, 2 * I, W) / W**0.5
                        w1, w3 = w13[:, :I].to(dtype), w13[:, I:].to(dtype)
                        if dtype == torch.float32:
                            w1, w3 = w13[:, :I], w13[:, I:]
                    else:
                        w1, w3 = (torch.randn(E, I, W) / W**0.5).to(dtype), (torch.randn(E, I, W) / W**0.5).to(dtype)
                    w2 = (torch.randn(E, W, I) / I**0.5).to(dtype)
                    x = (torch.randn(N, W) * 2).to(dtype)
                    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
                    wt = torch.rand(N, K)
                    got = moe_small.experts_small(x, idx, wt, w1, w2, w3, act=act, beta1=4.0, beta2=25.0)
                    want = experts_reference(x, idx, wt, w1, w2, w3, act=act, beta1=4.0, beta2=25.0)
                    assert got.shape == want.shape and got.dtype == want.dtype
                    if dtype == torch.bfloat16:
                        # the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest), which
                        # triples the rounding error: compare with the fp32 computation on the same bf16 values
                        f = [t.float() for t in (x, w1, w2, w3)]
                        want = experts_reference(f[0], idx, wt, f[1], f[2], f[3], act=act, beta1=4.0, beta2=25.0)
                    e = rel(got, want)
                    assert e <= tol, (E, I, W, act, dtype, packed, up, e)
                    worst = max(worst, e / tol)
    moe_small.UP_TILE = up_default
    # an expert id out of range: NaN on that token only (no out-of-bounds read), the other tokens exact
    w1, w3 = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    w2 = torch.randn(4, 8, 6)
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [2, 7], [3, -1]])
    wt = torch.rand(3, 2)
    for up in (up_default, (2, 0, 1)):
        moe_small.UP_TILE = up
        got = moe_small.experts_small(x, idx, wt, w1, w2, w3)
        assert torch.isnan(got[1:]).all() and torch.isfinite(got[0]).all()
        assert rel(got[0], experts_reference(x[:1], idx[:1], wt[:1], w1, w2, w3)[0]) < 1e-5
    moe_small.UP_TILE = up_default
    # one token: the down projection and the combine in one kernel (DOWN_COMBINE_MAX_TOKENS) against the per-pair
    # kernel + combine2, several launch widths, I not a power of two; a bad id gives NaN there too
    assert moe_small.DOWN_COMBINE_MAX_TOKENS >= 1
    for E, I, W, K in [(10, 40, 200, 3), (6, 17, 33, 6), (4, 64, 256, 1)]:
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            w1, w3 = (torch.randn(E, I, W) / W**0.5).to(dtype), (torch.randn(E, I, W) / W**0.5).to(dtype)
            w2 = (torch.randn(E, W, I) / I**0.5).to(dtype)
            x = torch.randn(1, W).to(dtype)
            idx = torch.randperm(E)[:K][None]
            wt = torch.rand(1, K)
            for ppsm in (1, 4, 64):  # launch widths
                moe_small.DOWN_COMBINE["programs_per_sm"] = ppsm
                got = moe_small.experts_small(x, idx, wt, w1, w2, w3)
                saved, moe_small.DOWN_COMBINE_MAX_TOKENS = moe_small.DOWN_COMBINE_MAX_TOKENS, 0
                want = moe_small.experts_small(x, idx, wt, w1, w2, w3)
                moe_small.DOWN_COMBINE_MAX_TOKENS = saved
                assert got.dtype == dtype and rel(got, want) <= tol, (E, I, W, K, dtype, ppsm, rel(got, want))
                bad = idx.clone()
                bad[0, -1] = E + 3
                assert torch.isnan(moe_small.experts_small(x, bad, wt, w1, w2, w3)).all(), ppsm
            moe_small.DOWN_COMBINE["programs_per_sm"] = 1
    # the shared experts' output and the residual added in the store (one token: the down + combine kernel; three:
    # the per-pair kernel + combine2 + adds): bit for bit the separate adds in the model's order, r + (u + s);
    # before_down called once, between the launches
    for N, dtype in ((1, torch.float32), (1, torch.bfloat16), (3, torch.bfloat16)):
        E, I, W, K = 6, 24, 40, 2
        w1, w3 = (torch.randn(E, I, W) / W**0.5).to(dtype), (torch.randn(E, I, W) / W**0.5).to(dtype)
        w2 = (torch.randn(E, W, I) / I**0.5).to(dtype)
        x = torch.randn(N, W).to(dtype)
        idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
        wt = torch.rand(N, K)
        sh = (2 * torch.randn(N, W + 3))[:, 1 : 1 + W].to(dtype)  # a row stride that is not W
        res = (4 * torch.randn(N, W)).to(dtype)
        hook = []
        got = moe_small.experts_small(x, idx, wt, w1, w2, w3, add=sh, residual=res, before_down=lambda: hook.append(1))
        u = moe_small.experts_small(x, idx, wt, w1, w2, w3)
        assert hook == [1] and torch.equal(got, res + (u + sh)), (N, dtype)
        assert torch.equal(moe_small.experts_small(x, idx, wt, w1, w2, w3, add=sh), u + sh)
        assert torch.equal(moe_small.experts_small(x, idx, wt, w1, w2, w3, residual=res), res + u)
        for kw in (dict(add=sh[:, :-1]), dict(residual=res.double()), dict(add="x")):
            try:
                moe_small.experts_small(x, idx, wt, w1, w2, w3, **kw)
                raise AssertionError("a malformed addend was accepted")
            except ValueError:
                pass
    # the shared experts as one more slot (one token; silu as their module forms it, and situ), against their
    # PyTorch output added first: r + ((u + s) + add); three tokens add them by PyTorch ops, bit for bit
    for N, dtype, act in ((1, torch.float32, "silu"), (1, torch.float32, "situ"), (1, torch.bfloat16, "silu"),
                          (3, torch.bfloat16, "situ")):  # fmt: skip
        E, I, W, K = 6, 24, 40, 2
        w1, w3 = (torch.randn(E, I, W) / W**0.5).to(dtype), (torch.randn(E, I, W) / W**0.5).to(dtype)
        w2 = (torch.randn(E, W, I) / I**0.5).to(dtype)
        sx = moe_small.SharedExperts(
            (torch.randn(I, W) / W**0.5).to(dtype), (torch.randn(I, W) / W**0.5).to(dtype),
            (torch.randn(W, I) / I**0.5).to(dtype), act, 3.0, 20.0,
        )  # fmt: skip
        x = (2 * torch.randn(N, W)).to(dtype)
        idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
        wt = torch.rand(N, K)
        res = (4 * torch.randn(N, W)).to(dtype)
        ad = torch.randn(N, W).to(dtype)
        got = moe_small.experts_small(x, idx, wt, w1, w2, w3, act=act, shared=sx, add=ad, residual=res)
        want = res + ((moe_small.experts_small(x, idx, wt, w1, w2, w3, act=act) + sx.reference(x)) + ad)
        if N == 1:
            e = rel(got, want)
            assert e <= (1e-6 if dtype == torch.float32 else 1e-2), (N, dtype, act, e)
        else:
            assert torch.equal(got, want)
    # the shared experts' gate / up sums formed by the router's GEMV (the router's rows, then theirs, in one weight:
    # route_logits_small extra), their activation and down projection in the down + combine kernel (one token;
    # three tokens: PyTorch ops on the same sums); against the slot form fed the same normed input
    for N, dtype, act in ((1, torch.float32, "silu"), (1, torch.float32, "situ"), (1, torch.bfloat16, "silu"),
                          (1, torch.bfloat16, "situ"), (3, torch.bfloat16, "silu")):  # fmt: skip
        E, I, W, K = 6, 24, 40, 2
        w1, w3 = (torch.randn(E, I, W) / W**0.5).to(dtype), (torch.randn(E, I, W) / W**0.5).to(dtype)
        w2 = (torch.randn(E, W, I) / I**0.5).to(dtype)
        wr = (torch.randn(E + 2 * I, W) / W**0.5).to(dtype)  # router rows, then the shared gate and up rows
        sx = moe_small.SharedExperts(wr[E : E + I], wr[E + I :], (torch.randn(W, I) / I**0.5).to(dtype), act, 3.0, 20.0)
        r = (3 * torch.randn(N, W)).to(dtype)
        gain = (1 + 0.2 * torch.randn(W)).to(dtype)
        xn = torch.full_like(r, float("nan"))
        pr = moe_small.route_logits_small(Normed(r, gain, 1e-6, out=xn), wr, None, top_k=K, extra=2 * I)
        want_lg = moe_small.route_logits_small(rms_norm(r, gain, 1e-6), wr[:E], None, top_k=K).logits
        assert pr.logits.shape == (N, E) and pr.extra.shape == (N, 2 * I), (pr.logits.shape, pr.extra.shape)
        assert rel(pr.logits, want_lg) <= (2e-6 if dtype == torch.float32 else 8e-3), (N, dtype)
        assert rel(pr.extra, F.linear(xn.float(), wr[E:].float())) <= 2e-6, (N, dtype)
        res = (4 * torch.randn(N, W)).to(dtype)
        formed = dataclasses.replace(sx, gu=pr.extra)
        got = moe_small.experts_small(xn, pr, None, w1, w2, w3, act=act, shared=formed, residual=res)
        idx, wt = pr.idx.clone(), pr.weights.clone()
        want = moe_small.experts_small(xn, idx, wt, w1, w2, w3, act=act, shared=sx, residual=res)
        assert rel(formed.reference(xn), sx.reference(xn)) <= (1e-6 if dtype == torch.float32 else 1e-2)
        if N == 1:
            e = rel(got, want)
            assert e <= (1e-6 if dtype == torch.float32 else 1e-2), (N, dtype, act, e)
        else:
            u = moe_small.experts_small(xn, idx, wt, w1, w2, w3, act=act)
            assert torch.equal(got, res + (u + formed.reference(xn)))
        # a perturbed sum shows: the kernel reads gu, not the gate / up weights
        bumped = dataclasses.replace(sx, gu=pr.extra + torch.nn.functional.pad(torch.ones(N, 1), (0, 2 * I - 1)))
        if N == 1:
            assert rel(moe_small.experts_small(xn, idx, wt, w1, w2, w3, act=act, shared=bumped, residual=res), got) > 0
    for bad_gu in (torch.zeros(1, 11), torch.zeros(1, 12, dtype=torch.float64), torch.zeros(2, 12), torch.zeros(1, 24)[:, ::2]):
        try:
            moe_small.experts_small(torch.randn(1, 8), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2),
                                    torch.randn(4, 6, 8), torch.randn(4, 8, 6), torch.randn(4, 6, 8),
                                    shared=moe_small.SharedExperts(torch.randn(6, 8), torch.randn(6, 8),
                                                                   torch.randn(8, 6), gu=bad_gu))  # fmt: skip
            raise AssertionError(f"malformed formed gate / up sums were accepted: {tuple(bad_gu.shape)}")
        except ValueError:
            pass
    for bad_extra in (-1, 4, 5):
        try:
            moe_small.route_logits_small(torch.randn(1, 8), torch.randn(4, 8), None, top_k=1, extra=bad_extra)
            raise AssertionError(f"a bad extra={bad_extra} was accepted")
        except ValueError:
            pass
    for bad_sx in (
        moe_small.SharedExperts(torch.randn(5, 8), torch.randn(5, 8), torch.randn(8, 5)),  # another width
        moe_small.SharedExperts(torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6), act="gelu"),
    ):
        try:
            moe_small.experts_small(torch.randn(1, 8), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2),
                                    torch.randn(4, 6, 8), torch.randn(4, 8, 6), torch.randn(4, 6, 8), shared=bad_sx)
            raise AssertionError("malformed shared experts were accepted")
        except ValueError:
            pass
    # the router's input as a Normed (its RMSNorm formed in the router GEMV, the normed rows written to its out):
    # the logits and the rows of the norm applied first; the logits kernel's path (more tokens) applies it first
    from openk3.infer.gemv import Normed
    from openk3.ops.norm import rms_norm

    for N in (1, 3):
        for dtype in (torch.float32, torch.bfloat16):
            E, D = 20, 48
            r = (3 * torch.randn(N, D)).to(dtype)
            gain = (1 + 0.2 * torch.randn(D)).to(dtype)
            w = (torch.randn(E, D) / D**0.5).to(dtype)
            out = torch.full_like(r, float("nan"))
            pr = moe_small.route_logits_small(Normed(r, gain, 1e-6, out=out), w, None, top_k=4)
            xn = rms_norm(r, gain, 1e-6)
            want = moe_small.route_logits_small(xn, w, None, top_k=4).logits
            assert rel(out, xn) <= (1e-6 if dtype == torch.float32 else 4e-3), (N, dtype, rel(out, xn))
            assert rel(pr.logits, want) <= (2e-6 if dtype == torch.float32 else 8e-3), (N, dtype)
    try:
        moe_small.route_logits_small(Normed(torch.randn(1, 8), torch.ones(7), 1e-6), torch.randn(4, 8), None, top_k=2)
        raise AssertionError("a malformed Normed router input was accepted")
    except ValueError:
        pass
    # when the path applies
    x = torch.randn(3, 8)
    with torch.no_grad():
        moe_small.SMALL_N = 0
        assert not moe_small.enabled(x)
        moe_small.SMALL_N = 4
        assert moe_small.enabled(x) and not moe_small.enabled(torch.randn(5, 8))
        assert not moe_small.enabled(torch.randn(8)) and not moe_small.enabled(torch.randn(0, 8))
        # the layer's routing: at most PAIRS_PER_EXPERT (token, slot) pairs per expert
        p = moe_small.PAIRS_PER_EXPERT
        assert moe_small.enabled(x, top_k=2, num_experts=-(-6 // p))  # 6 pairs, at most p per expert
        assert not moe_small.enabled(x, top_k=2, num_experts=(6 - 1) // p)  # more than p per expert
        assert moe_small.enabled(x, top_k=2)  # no layer given: tokens only
    with torch.inference_mode():
        assert moe_small.enabled(x)
    # gradients on: never (the weights may need gradients even when x does not)
    assert not moe_small.enabled(x) and not moe_small.enabled(x.clone().requires_grad_())
    # bad input: a clear ValueError
    w1 = torch.randn(4, 6, 8)
    w2 = torch.randn(4, 8, 6)
    bad = [
        lambda: moe_small.route_small(torch.randn(2, 7), torch.randn(4, 8), None, top_k=2),
        lambda: moe_small.route_small(torch.randn(2, 8), torch.randn(4, 8), None, top_k=5),
        lambda: moe_small.route_small(torch.randn(2, 8), torch.randn(4, 8), torch.zeros(3), top_k=2),
        lambda: moe_small.route_small(torch.randn(2, 8), torch.randn(4, 8), None, top_k=2, activation="relu"),
        lambda: moe_small.experts_small(torch.randn(2, 7), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2), w1, w2, w1),
        lambda: moe_small.experts_small(torch.randn(2, 8), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 2), w1, w2, w1),
        lambda: moe_small.experts_small(torch.randn(2, 8), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2), w1, w1, w1),
        lambda: moe_small.experts_small(torch.randn(2, 8), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2), w1, w2, w1, act="gelu"),
    ]
    for f in bad:
        try:
            f()
        except ValueError:
            pass
        else:
            raise AssertionError("bad input accepted")
    # registered as the few-token variant of the "moe" op's grouped_mm backend
    import openk3.fast  # noqa: F401
    from openk3.modules.moe import FAST_SMALL
    assert FAST_SMALL["grouped_mm"] is moe_small
    # whole model (tiny preset: latent MoE with its norm, shared experts), the "moe" op resolved to grouped_mm as on
    # CUDA: 3 tokens take the few-token path (router and experts), and the logits match the reference backend
    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM
    from openk3.ops import backend

    resolve = backend.resolve
    calls = []
    route0, experts0 = moe_small.route_small, moe_small.experts_small
    moe_small.route_small = lambda *a, **k: calls.append("route") or route0(*a, **k)  # 3 tokens: not fused
    moe_small.experts_small = lambda *a, **k: calls.append("experts") or experts0(*a, **k)
    for groups in (1, 2):
        cfg = get_preset("tiny").replace(num_expert_group=groups, topk_group=1)
        model = K3ForCausalLM(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 3))
        with torch.no_grad():
            want = model(ids).logits
            backend.resolve = lambda op, cuda, req=None: "grouped_mm" if op == "moe" else resolve(op, cuda, req)
            try:
                calls.clear()
                got = model(ids).logits
            finally:
                backend.resolve = resolve
        n_moe = sum(layer.is_moe for layer in model.model.layers)
        if groups == 1:
            assert calls.count("route") == n_moe == calls.count("experts") > 0, calls
        else:  # group-limited routing: the torch router, then experts_grouped (at 3 tokens the expert-tiled kernels)
            assert calls == [], calls
        e = rel(got, want)
        assert e < 1e-5, (groups, e)
        worst = max(worst, e / 1e-5)
    # the selection by tl.topk (SELECT_TOPK): the picks of route() (NaN first), ties by the lowest index, in the
    # separate selection kernel and inside the gate/up kernel
    default_topk = moe_small.SELECT_TOPK["on"]
    for E, K, D, N in [(64, 8, 96, 1), (20, 3, 50, 3), (9, 9, 17, 2), (5, 1, 8, 2), (130, 9, 8, 1)]:
        for act in ("sigmoid", "softmax"):
            for bias in (None, torch.randn(E) * 0.1):
                x = torch.randn(N, D)
                w = torch.randn(E, D) / D**0.5
                if E == 9:
                    w[4] = float("nan")
                kw = dict(top_k=K, activation=act, renormalize=True, scaling=2.0)
                if E == 130:  # equal rows and biases: ties
                    w[5] = w[2]
                    w[E - 1] = w[2]
                    bias = torch.randn(E) * 0.1
                    bias[[2, 5, E - 1]] = 0.25
                    sc = torch.sigmoid(x @ w.t()) if act == "sigmoid" else torch.softmax(x @ w.t(), -1)
                    want = [sorted(range(E), key=lambda e: (-float(c[e]), e))[:K] for c in (sc + bias)]
                else:
                    want = route(x, w, bias, **kw)[0].tolist()
                ex = (torch.randn(E, 4, D), torch.randn(E, D, 4), torch.randn(E, 4, D))
                got = {}
                for topk in (False, True):
                    moe_small.SELECT_TOPK["on"] = topk
                    i1, w1_, s1 = moe_small.route_small(x, w, bias, **kw)
                    pr = moe_small.route_logits_small(x, w, bias, **kw)
                    moe_small.experts_small(x, pr, None, *ex)
                    assert torch.equal(i1, pr.idx) and torch.equal(w1_.nan_to_num(), pr.weights.nan_to_num())
                    got[topk] = (i1, w1_)
                # the same picks and weights in both forms (here: all-NaN softmax scores too, where torch.topk
                # orders differently); against route / the tie order where the scores are finite
                assert torch.equal(got[True][0], got[False][0]), (E, K, act, got)
                assert torch.equal(got[True][1].nan_to_num(), got[False][1].nan_to_num())
                if not (E == 9 and act == "softmax"):
                    assert got[True][0].tolist() == want, (E, K, act, got[True][0], want)
    moe_small.SELECT_TOPK["on"] = default_topk
    print("WORST", worst)
    """
)


def test_moe_small_interpreted_on_cpu(run_interpreted):
    worst = run_interpreted(SCRIPT)
    assert worst <= 1.0, worst
