"""The decode step's Triton GEMV (``openk3.infer.gemv``) against ``F.linear`` in fp64, under TRITON_INTERPRET=1 on
CPU (a subprocess: the interpreter must be chosen before Triton kernels are defined) and, compiled, on a GPU at the
projection shapes of the ``medium`` and 48B presets; and the engine's decode with ``triton_gemv`` on against off
under the interpreter."""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = """
def cases(dev, shapes, configs, rows=None):
    import torch
    import torch.nn.functional as F
    from openk3.infer.gemv import GEMV_MAX_ROWS, gemv, gemv_config, triton_gemv_ok
    from openk3.infer.gemv import _dense as _dense_ref

    def rel(a, b):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        assert torch.isfinite(a).all()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    worst = 0.0
    g = torch.Generator().manual_seed(5)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 6e-3)):
        for M in rows or range(1, GEMV_MAX_ROWS + 1):
            for N, K in shapes:
                for cfg in configs:
                    # x as a row slice of a wider buffer: a row stride that is not K
                    xb = torch.randn(M, K + 8, generator=g).to(dev, dtype)
                    x = xb[:, 3 : 3 + K]
                    w = (torch.randn(N, K, generator=g) / K**0.5).to(dev, dtype)
                    assert triton_gemv_ok(x, w)
                    want = F.linear(x.double(), w.double())
                    for od in (None, torch.float32):
                        y = gemv(x, w, od, cfg)
                        assert y.shape == (M, N) and y.dtype == (od or dtype), (y.shape, y.dtype)
                        if od is None:
                            y_own = y
                        else:  # the fp32 output holds the values rounded to the operands' dtype
                            assert torch.equal(y, y_own.float())
                            # ... unless rounded=False: the fp32 sums (a router's logits), closer than a rounding
                            yf = gemv(x, w, od, cfg, rounded=False)
                            assert yf.dtype == torch.float32 and rel(yf, want) <= 2e-6, (dtype, rel(yf, want))
                        e = rel(y, want)
                        assert e <= tol, (dtype, M, N, K, cfg, od, e, gemv_config(M, N, K))
                        worst = max(worst, e if dtype == torch.float32 else 0.0)
    # a row given as two segments (no concatenated copy) and as a gated activation formed in the load
    from openk3.infer.gemv import GLU
    from openk3.ops.activations import glu_act

    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 6e-3)):
        for M in rows or (1, 3):
            for KA, KB in ((24, 40), (0, 72), (shapes[0][1] // 2, shapes[0][1] - shapes[0][1] // 2)):
                for kind in ("plain", "silu", "situ"):
                    if KA == 0 and kind == "plain":
                        continue
                    a = torch.randn(M, KA, generator=g).to(dev, dtype)
                    gt = (2 * torch.randn(M, KB, generator=g)).to(dev, dtype)
                    up = (2 * torch.randn(M, KB, generator=g)).to(dev, dtype)
                    w = (torch.randn(33, KA + KB, generator=g) / (KA + KB) ** 0.5).to(dev, dtype)
                    seg = gt if kind == "plain" else GLU(gt, up, kind, 4.0, 25.0)
                    x = seg if KA == 0 else (a, seg)
                    bv = gt if kind == "plain" else glu_act(gt, up, kind, 4.0, 25.0)
                    full = bv if KA == 0 else torch.cat([a, bv], -1)
                    e = rel(gemv(x, w), F.linear(full.double(), w.double()))
                    assert e <= tol, (dtype, M, KA, KB, kind, e)
                    if kind != "plain":  # the activation values themselves: an identity weight returns them
                        eye = torch.eye(KB, device=dev, dtype=dtype)
                        got = gemv(GLU(gt, up, kind, 4.0, 25.0), eye)
                        # bf16: fp32 tanh / sigmoid of another library may put a rare value one rounding away
                        assert rel(got, bv) <= (1e-6 if dtype == torch.float32 else 4e-3), (kind, rel(got, bv))
    # an RMS-normed first segment (alone, before a plain segment, before a GLU), formed in the load
    from openk3.infer.gemv import Normed
    from openk3.ops.norm import rms_norm

    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 6e-3)):
        for M in rows or (1, 2):
            for KA, KB, second in ((40, 0, None), (24, 40, "plain"), (48, 24, "situ"), (shapes[0][1], 8, "plain")):
                a = (3 * torch.randn(M, KA, generator=g)).to(dev, dtype)
                gain = (1 + 0.3 * torch.randn(KA, generator=g)).to(dev, dtype)
                gt = torch.randn(M, KB, generator=g).to(dev, dtype)
                up = torch.randn(M, KB, generator=g).to(dev, dtype)
                w = (torch.randn(17, KA + KB, generator=g) / (KA + KB) ** 0.5).to(dev, dtype)
                nx = Normed(a, gain, 1e-6)
                if second is None:
                    x, full = nx, rms_norm(a, gain, 1e-6)
                elif second == "plain":
                    x, full = (nx, gt), torch.cat([rms_norm(a, gain, 1e-6), gt], -1)
                else:
                    x = (nx, GLU(gt, up, second, 4.0, 25.0))
                    full = torch.cat([rms_norm(a, gain, 1e-6), glu_act(gt, up, second, 4.0, 25.0)], -1)
                e = rel(gemv(x, w), F.linear(full.double(), w.double()))
                assert e <= tol, (dtype, M, KA, KB, second, e)
        # the normed values themselves: an identity weight returns them
        a = (3 * torch.randn(2, 40, generator=g)).to(dev, dtype)
        gain = (1 + 0.3 * torch.randn(40, generator=g)).to(dev, dtype)
        got = gemv(Normed(a, gain, 1e-5), torch.eye(40, device=dev, dtype=dtype))
        assert rel(got, rms_norm(a, gain, 1e-5)) <= (1e-6 if dtype == torch.float32 else 4e-3)
    # a Normed segment with an output: the normed rows written beside the product (every launch form), the product
    # unchanged
    for dt, tol_n in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):
        for M in rows or (1, 2):
            N, K = shapes[-1]
            a = (3 * torch.randn(M, K, generator=g)).to(dev, dt)
            gain = (1 + 0.3 * torch.randn(K, generator=g)).to(dev, dt)
            w = (torch.randn(N, K, generator=g) / K**0.5).to(dev, dt)
            for cfg in configs:
                o = torch.full((M, K), float("nan"), device=dev, dtype=dt)
                y = gemv(Normed(a, gain, 1e-6, out=o), w, None, cfg)
                assert rel(o, rms_norm(a, gain, 1e-6)) <= tol_n, (dt, M, cfg, rel(o, rms_norm(a, gain, 1e-6)))
                assert torch.equal(y, gemv(Normed(a, gain, 1e-6), w, None, cfg)), (dt, M, cfg)
            # the reference path (more rows than a launch takes) fills it too
            big = (3 * torch.randn(GEMV_MAX_ROWS + 1, K, generator=g)).to(dev, dt)
            o = torch.full_like(big, float("nan"))
            gemv(Normed(big, gain, 1e-6, out=o), w)
            assert torch.equal(o, rms_norm(big, gain, 1e-6))
    for bad_out in (torch.empty(1, 40), torch.empty(2, 40, dtype=torch.float64), torch.empty(40, 2).t(), "x"):
        try:
            gemv(Normed(torch.randn(2, 40).to(dev), torch.ones(40).to(dev), 1e-6,
                        out=bad_out.to(dev) if isinstance(bad_out, torch.Tensor) else bad_out),
                 torch.randn(4, 40).to(dev))  # fmt: skip
            raise AssertionError("a malformed Normed out was accepted")
        except ValueError:
            pass
    # a residual added in the store: bit for bit the separate add of the rounded product (any segment kind)
    for dt in (torch.float32, torch.bfloat16):
        for M in rows or (1, 3):
            N, K = shapes[-1]
            x = torch.randn(M, K, generator=g).to(dev, dt)
            w = (torch.randn(N, K, generator=g) / K**0.5).to(dev, dt)
            rb = (4 * torch.randn(M, N + 5, generator=g)).to(dev, dt)
            res = rb[:, 2 : 2 + N]  # a row stride that is not N
            gn = (1 + 0.3 * torch.randn(K, generator=g)).to(dev, dt)
            for xin in (x, Normed(x, gn, 1e-6), (x[:, : K // 2], x[:, K // 2 :])):
                for cfg in configs:
                    y = gemv(xin, w, None, cfg, residual=res)
                    assert y.dtype == dt and y.shape == (M, N)
                    assert torch.equal(y, res + gemv(xin, w, None, cfg)), (dt, M, cfg)
                    e = rel(y, res.double() + F.linear(_dense_ref(xin).double(), w.double()))
                    assert e <= (2e-6 if dt == torch.float32 else 6e-3), (dt, M, e)
            # -0.0 + 0.0 and large cancellations round as the add does
            z = torch.zeros(M, K, device=dev, dtype=dt)
            assert torch.equal(gemv(z, w, residual=-torch.zeros_like(res)), -torch.zeros_like(res) + gemv(z, w))
    x1, w1 = torch.randn(2, 8).to(dev), torch.randn(4, 8).to(dev)
    for bad_res, kw in (
        (torch.randn(2, 5), {}),
        (torch.randn(1, 4), {}),
        (torch.randn(2, 4).double(), {}),
        (torch.randn(2, 4), dict(out_dtype=torch.float32, rounded=False)),
        ("not a tensor", {}),
    ):
        try:
            gemv(x1, w1, residual=bad_res.to(dev) if isinstance(bad_res, torch.Tensor) else bad_res, **kw)
            raise AssertionError("a malformed residual was accepted")
        except ValueError:
            pass
    assert torch.equal(gemv(x1[:, :0], w1[:, :0], residual=x1[:, :4]), x1[:, :4] + 0.0)
    for bad in (
        lambda: gemv((a, Normed(a, gain, 1e-6)), torch.randn(4, 80).to(dev, dtype)),
        lambda: gemv(Normed(a, gain[:-1], 1e-6), torch.randn(4, 40).to(dev, dtype)),
        lambda: gemv(Normed(a, gain, -1.0), torch.randn(4, 40).to(dev, dtype)),
    ):
        try:
            bad()
            raise AssertionError("a misplaced or malformed Normed segment was accepted")
        except ValueError:
            pass
    try:
        gemv((GLU(gt, up, "situ"), a), torch.randn(4, KA + KB).to(dev, dtype))
        raise AssertionError("a GLU before a plain segment was accepted")
    except ValueError:
        pass
    try:
        gemv(GLU(gt, up, "gelu"), torch.randn(4, KB).to(dev, dtype))
        raise AssertionError("an unknown activation was accepted")
    except ValueError:
        pass
    try:
        gemv((a, gt), torch.randn(4, KA + KB + 1).to(dev, dtype))
        raise AssertionError("segments narrower than the weight were accepted")
    except ValueError:
        pass
    # bad input: a clear error, not a kernel crash
    x, w = torch.randn(1, 8).to(dev), torch.randn(4, 8).to(dev)
    for bad in ((x, torch.randn(4, 9).to(dev)), (x[0], w), (x, w[None])):
        try:
            gemv(*bad)
            raise AssertionError("mismatched shapes were accepted")
        except ValueError:
            pass
    try:
        gemv(x, w, torch.float16)
        raise AssertionError("an output dtype other than x's or fp32 was accepted")
    except ValueError:
        pass
    try:
        gemv(x, w, rounded=False)
        raise AssertionError("unrounded sums asked for in the operands' dtype")
    except ValueError:
        pass
    # more rows than one launch takes, or a column-major weight: the reference runs
    assert not triton_gemv_ok(torch.randn(GEMV_MAX_ROWS + 1, 8).to(dev), w)
    assert not triton_gemv_ok(x, torch.randn(8, 4).to(dev).t())
    big = torch.randn(GEMV_MAX_ROWS + 1, 8).to(dev)
    assert torch.allclose(gemv(big, w), F.linear(big, w))
    return worst
"""


def test_gemv_interpreted(run_interpreted):
    script = textwrap.dedent(CASES) + textwrap.dedent(
        """
        configs = (
            None, dict(BN=8, BK=32), dict(BN=4, BK=64, num_warps=8, wide=True),
            dict(BN=2, BK=0, num_warps=4, num_stages=1, persist=1),  # persistent: several tiles per program
        )
        # the engine's rule (GEMV_DECODE): one row, weights of at most max_bytes
        import torch
        from openk3.infer.gemv import GEMV_CONFIG, GEMV_DECODE, GLU, decode_gemv_ok

        # the default launch with one program per (interpreter) SM's worth of rows: wider row tiles, fewer programs
        GEMV_CONFIG["programs_per_sm"] = 1
        x1, x2, w = torch.randn(1, 64), torch.randn(2, 64), torch.randn(16, 64)
        assert decode_gemv_ok(x1, w) and decode_gemv_ok(GLU(x1, x1, "silu"), w)
        assert decode_gemv_ok((x1, x1), torch.randn(16, 128))
        assert not decode_gemv_ok(x2, w) and not decode_gemv_ok(x1.double(), w)
        GEMV_DECODE["max_bytes"] = w.numel() * w.element_size() - 1
        assert not decode_gemv_ok(x1, w)
        print("WORST", cases("cpu", ((5, 7), (33, 96), (64, 200)), configs, rows=(1, 3)))
        """
    )
    assert run_interpreted(script, hide_cuda=True) < 2e-6


@pytest.mark.parametrize("layout", ["tiny", "plain-moe"])
def test_engine_triton_gemv_interpreted(run_interpreted, layout):
    """A tiny model's greedy decode (three ragged prompts) with EngineConfig.triton_gemv on and off under the
    interpreter (GEMV_DECODE widened to every row count and weight size), and with fuse_glu_gemv too: every
    projection of the decode step goes through the GEMV (the LM head as fp32), the shared experts' activation into
    the GEMV that reads it with fuse_glu_gemv, the same tokens,
    and decode logits within fp32 sum-order noise of each other; for the `tiny` preset and for it without AttnRes and
    with a plain MoE (the Kimi Linear layout: the shared experts' down projection a separate GEMV)."""
    over = "{}" if layout == "tiny" else "dict(attn_res_block_size=None, routed_expert_hidden_size=None)"
    script = (
        textwrap.dedent(
            """
        import torch
        from openk3.config import get_preset
        from openk3.infer import gemv as G
        from openk3.infer.engine import Engine
        from openk3.infer.sampling import SamplingParams
        from openk3.model import K3ForCausalLM

        G.GEMV_DECODE.update(max_rows=G.GEMV_MAX_ROWS, max_bytes=1 << 40)  # every projection of the test
        G.GEMV_CONFIG["programs_per_sm"] = 1  # fewer, wider programs: the interpreter runs them one by one
        torch.manual_seed(0)
        # (a 512-token vocabulary: the LM head's GEMV dominated the interpreter's time at 4,096)
        # (four layers: the dense first one, KDA + MoE and MLA + MoE; half of tiny's launches under the interpreter)
        cfg = get_preset("tiny").replace(
            vocab_size=512, num_hidden_layers=4, kda_layers=[1, 2, 3], full_attn_layers=[4], **OVER
        )
        model = K3ForCausalLM(cfg).eval().requires_grad_(False)
        calls = []
        inner = G.gemv
        kind = lambda x: "+".join(type(t).__name__ for t in (x if isinstance(x, tuple) else (x,)))
        od_of = lambda a, k: k.get("out_dtype", a[0] if a else None)
        # the engine's projections (the few-token router's unrounded logits also take the GEMV: not counted)
        res = lambda k: "+res" if k.get("residual") is not None else ""
        G.gemv = lambda x, w, *a, **k: (
            k.get("rounded", True) and calls.append((kind(x) + res(k), od_of(a, k)))
        ) or inner(x, w, *a, **k)
        runs = {}
        for on in (False, True, "glu", "norm", "glu+norm", "nores"):
            calls.clear()
            eng = Engine(model, None, max_seqs=4, max_tokens=2048, prefix_cache=False, triton_gemv=bool(on),
                         fuse_glu_gemv="glu" in str(on), fuse_norm_gemv="norm" in str(on),
                         gemv_residual=on != "nores", fold_norms=False, record_logits=True)
            ps = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 3, 5)]
            reqs = eng.generate([list(range(1, 6 + 7 * i)) for i in range(3)], ps)
            runs[on] = ([r.output_ids for r in reqs], [torch.stack(r.logits_log) for r in reqs], list(calls))
        assert not runs[False][2], "GEMV called with triton_gemv off"
        n_lin = len(runs[True][2])
        assert n_lin > 0 and any(od is torch.float32 for _, od in runs[True][2]), runs[True][2][:4]
        # fuse_glu_gemv: the shared experts' activation goes into the GEMV (latent MoE: with the routed output as
        # a pair of segments; plain MoE: the down projection's GLU input); never without it. fuse_norm_gemv (latent
        # MoE with its norm): the routed mixture's RMSNorm goes into the output GEMV, beside the shared experts'
        # output or their GLU
        # gemv_residual (AttnRes walk): the residual adds go into the output GEMVs' stores (bit for bit the separate
        # add: test_gemv_interpreted); the walk without AttnRes adds them in its add + norm kernels
        with_res = {on: {t for t, _ in runs[on][2] if t.endswith("+res")} for on in runs}
        latent = "attn_res_block_size" not in OVER_TEXT
        if latent:
            assert with_res[True] and "Normed+Tensor+res" in with_res["norm"], with_res
            assert not with_res["nores"], with_res
            # (a dense layer's down projection also moves from its module to the GEMV)
            assert len(runs["nores"][2]) <= len(runs[True][2]), (len(runs["nores"][2]), len(runs[True][2]))
        else:
            assert not any(with_res.values()), with_res
        kinds = {on: {t.removesuffix("+res") for t, _ in runs[on][2]} for on in runs}
        want = "Tensor+GLU" if latent else "GLU"
        assert want in kinds["glu"] and want not in kinds[True], kinds
        if latent:
            assert "Normed+Tensor" in kinds["norm"] and "Normed+GLU" in kinds["glu+norm"], kinds
        assert not any("Normed" in k for on in (True, "glu") for k in kinds[on]), kinds
        if not latent:
            assert kinds["norm"] == kinds[True], kinds
        assert all(runs[on][0] == runs[False][0] for on in runs), {on: runs[on][0] for on in runs}
        worst = max(
            float((a - b).norm() / b.norm())
            for on in runs if on is not False for a, b in zip(runs[on][1], runs[False][1])
        )
        print("WORST", worst)
        """
        )
        .replace("OVER_TEXT", repr(over))
        .replace("OVER", over)
    )
    assert run_interpreted(script, hide_cuda=True) < 1e-5


@pytest.mark.gpu
def test_gemv_gpu():
    ns: dict = {}
    exec(textwrap.dedent(CASES), ns)
    # decode projection shapes (K a power of two; a head + tail of 2048 + 256 as the 48B shape's; 1024 + 256):
    # each (dtype, rows, K, launch form, output kind) is its own compile, so the set is kept small enough to
    # compile within a few minutes
    shapes = ((8736, 2048), (2048, 2304), (1536, 1280))
    configs = (None, dict(BN=16, BK=256), dict(BN=4, BK=0, num_warps=4, num_stages=1, persist=2))
    assert ns["cases"]("cuda", shapes, configs, rows=(1, 3)) < 2e-6


def test_engine_fold_norms_interpreted(run_interpreted):
    """EngineConfig.fold_norms under the interpreter on a tiny model without AttnRes and with a plain MoE (the Kimi
    Linear layout), the "moe" op resolved to the few-token kernels as on CUDA: one-row decode steps run the folded
    layer halves (the router GEMV forming the post-attention norm and writing the normed row, the shared experts on
    the side stream, as one more slot of the routed experts' kernels, or with their gate / up rows in the router's
    GEMV, the down + combine adding them and the residual, the attention inputs' norm inside their GEMV), with fewer
    add + norm launches, the same tokens, and decode logits within fp32 sum-order noise of the unfolded engine;
    batched steps keep the unfolded walk. Shared experts of another width
    than the routed ones run on the side stream instead, their output added in the down + combine store."""
    script = textwrap.dedent(
        """
        import torch
        from openk3.config import get_preset
        from openk3.fast import moe_small
        from openk3.infer import engine as E
        from openk3.infer import gemv as G
        from openk3.infer.engine import Engine
        from openk3.infer.sampling import SamplingParams
        from openk3.model import K3ForCausalLM
        from openk3.ops import backend

        G.GEMV_DECODE.update(max_rows=G.GEMV_MAX_ROWS, max_bytes=1 << 40, normed_max_bytes=1 << 40)
        G.GEMV_CONFIG["programs_per_sm"] = 1
        resolve = backend.resolve
        backend.resolve = lambda op, cuda, req=None: "grouped_mm" if op == "moe" else resolve(op, cuda, req)
        torch.manual_seed(0)
        # (four layers, the dense first one, KDA + MoE and MLA + MoE: half of tiny's launches under the interpreter)
        cfg = get_preset("tiny").replace(
            attn_res_block_size=None, routed_expert_hidden_size=None, num_shared_experts=1, vocab_size=512,
            num_hidden_layers=4, kda_layers=[1, 2, 3], full_attn_layers=[4],
        )
        model = K3ForCausalLM(cfg).eval().requires_grad_(False)
        n_moe = sum(layer.is_moe for layer in model.model.layers)
        n_layers = len(model.model.layers)
        assert n_moe > 0 and not any(l.block_sparse_moe.latent for l in model.model.layers if l.is_moe)
        log = []
        norms, experts0, add_norm0 = G.Normed, moe_small.experts_small, E.add_rms_norm
        route0 = moe_small.route_logits_small
        moe_small.experts_small = lambda *a, **k: log.append(
            ("experts", k.get("shared") is not None, k.get("residual") is not None)
        ) or experts0(*a, **k)
        moe_small.route_logits_small = lambda *a, **k: log.append(("route", k.get("extra", 0))) or route0(*a, **k)
        E.add_rms_norm = lambda *a, **k: log.append(("add_norm", a[0].shape[0])) or add_norm0(*a, **k)

        class Spy(norms):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                log.append(("normed", self.out is not None))

        G.Normed = Spy
        runs = {}
        for fold in (False, "side", "slot", "router"):
            E.FOLD_SHARED = fold or "side"
            log.clear()
            eng = Engine(model, None, max_seqs=4, max_tokens=2048, prefix_cache=False, triton_gemv=True,
                         fold_norms=bool(fold), record_logits=True)
            ps = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            r1 = eng.generate([list(range(1, 9))], [ps])  # one row: the folded walk
            one = list(log)
            log.clear()
            if fold in (False, "router"):  # three rows, then fewer (batched steps: the unfolded walk in any mode)
                r1 += eng.generate([list(range(1, 6 + 7 * i)) for i in range(3)], [ps] * 3)
            runs[fold] = ([r.output_ids for r in r1], [torch.stack(r.logits_log) for r in r1], one)
        off = runs[False][2]
        assert not any(e[0] == "normed" for e in off), off[:8]
        # unfolded: two add + norm launches per layer and one final per one-row decode step
        steps, rest = divmod(sum(e[0] == "add_norm" and e[1] == 1 for e in off), 2 * n_layers + 1)
        assert steps >= 4 and rest == 0, (steps, rest, off)
        assert off.count(("experts", False, False)) == (steps + 1) * n_moe, off  # (the prefill's too)
        for fold in ("side", "slot", "router"):
            on = runs[fold][2]
            # folded: the MoE layers' post-attention add + norm go (the router forms that norm and writes the row),
            # and so do the attention inputs' norms after them (formed in the fused input GEMV)
            assert on.count(("normed", True)) == steps * n_moe, on
            n_add = sum(e[0] == "add_norm" and e[1] == 1 for e in on)
            assert n_add <= steps * (2 * n_layers + 1 - 2 * n_moe), (n_add, n_layers, n_moe)
            # the attention inputs' norms, and ("side") the shared experts' input GEMV's
            extra = steps * n_moe if fold == "side" else 0
            assert on.count(("normed", False)) >= steps * n_moe - steps + extra, (fold, on)
            # the shared experts as one more slot of the routed experts' kernels, or beside them; "router": their
            # gate / up rows (2 I) behind the router's, the router GEMV forming their projections
            assert on.count(("experts", fold != "side", True)) == steps * n_moe, (fold, on)
            extra = [e[1] for e in on if e[0] == "route"]  # (the prefill's routes too: extra 0)
            n_formed = extra.count(2 * cfg.moe_intermediate_size)
            assert n_formed == (steps * n_moe if fold == "router" else 0) and n_formed + extra.count(0) == len(extra)
            n = len(runs[fold][0])
            assert n in (1, 4) and runs[fold][0] == runs[False][0][:n], (fold, runs[fold][0], runs[False][0])
        worst = max(
            float((a - b).norm() / b.norm())
            for fold in ("side", "slot", "router") for a, b in zip(runs[fold][1], runs[False][1])
        )
        # shared experts twice the routed width under "slot": the side-stream form instead
        torch.manual_seed(1)
        m2 = K3ForCausalLM(cfg.replace(num_shared_experts=2)).eval().requires_grad_(False)
        outs = {}
        for fold in (False, "slot", "router"):
            E.FOLD_SHARED = fold or "side"
            log.clear()
            eng = Engine(m2, None, max_seqs=2, max_tokens=1024, prefix_cache=False, triton_gemv=True,
                         fold_norms=bool(fold), record_logits=True)
            ps = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            r = eng.generate([list(range(3, 12))], [ps])[0]
            outs[fold] = (r.output_ids, torch.stack(r.logits_log), list(log))
        for fold in ("slot", "router"):
            on = outs[fold][2]
            assert ("experts", False, True) in on and ("experts", True, True) not in on, (fold, on)
            assert all(e[1] == 0 for e in on if e[0] == "route"), (fold, on)
            assert outs[fold][0] == outs[False][0]
            worst = max(worst, float((outs[fold][1] - outs[False][1]).norm() / outs[False][1].norm()))
        print("WORST", worst)
        """
    )
    assert run_interpreted(script, hide_cuda=True) < 1e-5
