# ruff: noqa: B023
"""Diagnostic: MLA SDPA modes on the `small` preset's head dims (96/64) and on strided V (as the model passes it),
and the `small` model's gradients with every fast backend vs with all but one. Prints relative errors."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def mla_matrix():
    from openk3.fast import mla
    from openk3.ops.mla import mla_mha_attention

    for dqk, dv in ((96, 64), (192, 128)):
        for strided in (False, True):
            for mode in ("cudnn", "pad", "efficient"):
                B, T, H = 2, 256, 6
                q = torch.randn(B, T, H, dqk, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, T, H, dqk, device="cuda", dtype=torch.bfloat16)
                kv = torch.randn(B, T, H, 64 + dv, device="cuda", dtype=torch.bfloat16)
                v0 = kv[..., 64:] if strided else kv[..., 64:].contiguous()
                outs = []
                for fn in (
                    lambda *a: mla.mha_sdpa(*a, scale=dqk**-0.5, mode=mode),
                    lambda *a: mla_mha_attention(*a, scale=dqk**-0.5),
                ):
                    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v0))
                    if strided:  # like the model: v is a slice of the kv_b_proj output
                        vv = torch.cat([torch.zeros_like(kv[..., :64]), vv], dim=-1)[..., 64:]
                    o = fn(qq, kk, vv)
                    go = torch.randn(o.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
                    (o.float() * go).sum().backward()
                    outs.append((o, qq.grad, kk.grad))
                print(
                    f"mla dqk{dqk} dv{dv} strided={strided} {mode}: o {rel(outs[0][0], outs[1][0]):.2e} "
                    f"dq {rel(outs[0][1], outs[1][1]):.2e} dk {rel(outs[0][2], outs[1][2]):.2e}",
                    flush=True,
                )


def model_grads():
    import openk3.fast  # noqa: F401
    from openk3 import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    cfg = K3Config.from_preset("small")
    model = K3ForCausalLM(cfg).cuda()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.05)
    dt = getattr(torch, os.environ.get("DIAG_DTYPE", "bfloat16"))
    if dt != torch.float32:
        model.to_dtype(dt)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    tg = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    ops = ("kda", "mla", "moe", "attnres")

    def step(choice):
        for op in ops:
            model.set_backend(op, choice.get(op))
        model.zero_grad(set_to_none=True)
        out = model(ids, targets=tg)
        out.loss.backward()
        return float(out.loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    l_ref, g_ref = step({op: "reference" for op in ops})
    l_ref2, g_ref2 = step({op: "reference" for op in ops})
    med = sorted(rel(g_ref2[n], g_ref[n]) for n in g_ref)
    print(f"ref vs ref: loss {l_ref2 - l_ref:.2e} median grad err {med[len(med) // 2]:.2e}", flush=True)
    for fast_ops in (ops, ("kda",), ("mla",), ("moe",), ("attnres",))[: int(os.environ.get("DIAG_N", "5"))]:
        choice = {op: (None if op in fast_ops else "reference") for op in ops}
        loss, g = step(choice)
        errs = sorted((rel(g[n], g_ref[n]), n) for n in g_ref)
        print(
            f"fast {fast_ops}: loss {loss:.6f} vs {l_ref:.6f}; grad err median {errs[len(errs) // 2][0]:.2e} "
            f"worst {errs[-3:]}",
            flush=True,
        )


if __name__ == "__main__":
    if os.environ.get("DIAG_MLA", "1") == "1":
        mla_matrix()
    model_grads()
