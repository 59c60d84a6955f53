"""The one-launch MoE decode step (``openk3.fast.moe_fused.moe_token``) under TRITON_INTERPRET=1 on CPU against the
PyTorch reference (``openk3.ops`` norm, router, experts): its three phases as three launches on several grid sizes
(each program a range of rows that the sizes leave uneven) and as one launch with its barriers (one program: the
interpreter runs programs one after another), bf16 and fp32, both router activations, with and without the
correction bias, renormalisation and shared experts, SiTU and SwiGLU; the routing it leaves, the counter left at
zero, bad input; and the engine's decode with EngineConfig.moe_one_launch. Runs in a subprocess; skipped without
triton."""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def test_moe_token_interpreted_on_cpu(run_interpreted):
    script = textwrap.dedent(
        """
        import itertools

        import torch
        from openk3.fast import moe_fused, moe_small
        from openk3.ops.moe import route
        from openk3.ops.norm import rms_norm

        def rel(a, b, base):
            return float((a.double() - b.double()).norm() / (b.double() - base.double()).norm())

        worst = 0.0
        cases = itertools.product(
            [(64, 8, 96, 48, 48), (20, 3, 50, 24, 0), (9, 9, 33, 16, 16), (6, 1, 8, 5, 0), (12, 4, 40, 12, 12)],
            [torch.float32, torch.bfloat16],
        )
        for n, ((E, K, D, I, SH), dtype) in enumerate(cases):
            ract, flag = ("sigmoid", "softmax")[n % 2], n % 3 != 1
            torch.manual_seed(n)
            r = (2 * torch.randn(1, D)).to(dtype)
            nw = (1 + 0.2 * torch.randn(D)).to(dtype)
            wr = (torch.randn(E + 2 * SH, D) / D**0.5).to(dtype)
            bias = torch.randn(E) * 0.1 if flag else None
            w1, w3 = ((torch.randn(E, I, D) / D**0.5).to(dtype) for _ in range(2))
            w2 = (torch.randn(E, D, I) / I**0.5).to(dtype)
            act = "situ" if n % 3 else "silu"
            shared = None
            if SH:
                sw2 = (torch.randn(D, SH) / SH**0.5).to(dtype)
                shared = moe_small.SharedExperts(wr[E : E + SH], wr[E + SH :], sw2, act="silu" if flag else "situ")
            kw = dict(top_k=K, activation=ract, renormalize=flag, scaling=2.5 if flag else 1.0, act=act, shared=shared)
            want = moe_fused.moe_token_reference(r, nw, 1e-6, wr, bias, w1, w2, w3, **kw)
            xn = rms_norm(r, nw, 1e-6)
            idx0, w0, s0 = route(xn, wr[:E], bias, **{k: kw[k] for k in ("top_k", "activation", "renormalize", "scaling")})
            for split, grid in [(True, None), (True, 3), (True, 7), (False, 1)]:
                ctr = moe_fused.new_counter(r.device)
                y, info = moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, split=split, grid=grid, **kw)
                assert y.shape == (1, D) and y.dtype == dtype
                assert int(ctr.abs().sum()) == 0, ctr
                # the norm: its fp32 sum of squares in another order (bf16: a rounding may flip)
                assert float((info.xn - xn).abs().max()) <= (1e-6 if dtype == torch.float32 else 2e-2), (n, grid)
                assert torch.equal(info.idx, idx0), (info.idx, idx0)
                assert torch.allclose(info.weights, w0, rtol=1e-5, atol=1e-7)
                assert torch.allclose(info.scores, s0, rtol=1e-5, atol=1e-7)
                err = rel(y, want, r)
                # bf16: the same roundings, fp32 sums in another order (a rounding may flip)
                worst = max(worst, err / (1e-5 if dtype == torch.float32 else 2e-2))
        # bad input: clear errors
        E, K, D, I = 8, 2, 16, 8
        r = torch.randn(1, D)
        args = [torch.ones(D), 1e-6, torch.randn(E, D), None, torch.randn(E, I, D), torch.randn(E, D, I),
                torch.randn(E, I, D), moe_fused.new_counter(r.device)]
        for bad, what in [
            (dict(r=torch.randn(2, D)), "one row"),
            (dict(r=torch.randn(1, D + 1)), "do not match"),
            (dict(top_k=9), "top_k"),
            (dict(top_k=0), "top_k"),
            (dict(act="relu"), "activation"),
            (dict(activation="tanh"), "activation"),
            (dict(bias=torch.randn(E + 1)), "bias"),
            (dict(w2=torch.randn(E, I, D)), "expert weights"),
            (dict(counter=torch.zeros(4)), "counter"),
            (dict(router_w=torch.randn(E, D).t().contiguous().t()), "unit stride"),
        ]:
            a = dict(r=r, norm_weight=args[0], eps=args[1], router_w=args[2], bias=args[3], w1=args[4], w2=args[5],
                     w3=args[6], counter=args[7], top_k=K)
            a.update(bad)
            try:
                moe_fused.moe_token(**a)
            except ValueError as e:
                assert what in str(e), (what, e)
            else:
                raise AssertionError(f"accepted {what}")
        print("WORST", worst)
        """
    )
    assert run_interpreted(script, hide_cuda=True) < 1.0


def test_engine_moe_one_launch_interpreted(run_interpreted):
    """EngineConfig.moe_one_launch on a tiny plain-MoE model (the Kimi Linear layout, fold_norms, the shared
    experts' gate / up rows in the router's buffer): one-row decode steps take moe_token once per MoE layer (three
    launches each here), batched steps the usual kernels; the same tokens as the engine without it, decode logits
    within fp32 sum-order noise; a model without shared experts too."""
    script = textwrap.dedent(
        """
        import torch
        from openk3.config import get_preset
        from openk3.fast import moe_fused
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
        calls = []
        inner = moe_fused.moe_token
        moe_fused.moe_token = lambda *a, **k: calls.append(k.get("shared") is not None) or inner(*a, **k)
        worst = 0.0
        for shared in (1, 0):
            torch.manual_seed(0)
            cfg = get_preset("tiny").replace(
                attn_res_block_size=None, routed_expert_hidden_size=None, num_shared_experts=shared
            )
            model = K3ForCausalLM(cfg).eval().requires_grad_(False)
            n_moe = sum(layer.is_moe for layer in model.model.layers)
            runs = {}
            for on in (False, True):
                calls.clear()
                eng = Engine(model, None, max_seqs=4, max_tokens=2048, prefix_cache=False, triton_gemv=True,
                             fold_norms=True, moe_one_launch=on, record_logits=True)
                ps = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
                r1 = eng.generate([list(range(1, 9))], [ps])
                one = list(calls)
                # batched steps (three rows, then fewer) with the usual kernels
                r3 = eng.generate([list(range(1, 6 + 7 * i)) for i in range(3)], [ps] * 3) if shared else []
                runs[on] = ([r.output_ids for r in r1 + r3], [torch.stack(r.logits_log) for r in r1 + r3], one)
            assert not runs[False][2]
            # one-row decode steps (4 after the prefill's token, and one the overlap discards) x MoE layers
            got = runs[True][2]
            assert len(got) in (4 * n_moe, 5 * n_moe) and set(got) == {bool(shared)}, (got, n_moe)
            assert runs[True][0] == runs[False][0], (runs[True][0], runs[False][0])
            worst = max(worst, max(float((a - b).norm() / b.norm()) for a, b in zip(runs[True][1], runs[False][1])))
        print("WORST", worst)
        """
    )
    assert run_interpreted(script, hide_cuda=True) < 1e-5
