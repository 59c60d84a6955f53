"""The "glu" op's Triton backend (openk3.fast.moe.glu_act_triton) vs the reference activation on the GPU: fresh
random inputs, odd shapes, bf16 and fp32, output and both gradients; and a whole GLUMLP on the fast path."""

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
# (output, gradients): fp32 agrees to the fast-math tanh / sigmoid (~1e-7); bf16 vs the same-dtype reference differs by
# at most one rounding of the output / gradients
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 640), (4, 77, 1000), (3, 4096, 192)])
@pytest.mark.parametrize("kind", ["situ", "silu"])
def test_glu_triton_matches_reference(dtype, shape, kind, check):
    from openk3.fast.moe import glu_act_triton
    from openk3.ops.activations import glu_act

    torch.manual_seed(torch.seed() % (2**31))
    g0 = (torch.randn(*shape, device=DEV) * 4).to(dtype)
    u0 = (torch.randn(*shape, device=DEV) * 30).to(dtype)
    a = [g0.clone().requires_grad_(), u0.clone().requires_grad_()]
    b = [g0.clone().requires_grad_(), u0.clone().requires_grad_()]
    ya = glu_act_triton(*a, kind, 4.0, 25.0)
    yb = glu_act(*b, kind, 4.0, 25.0)
    d = torch.randn_like(ya)
    ya.backward(d)
    yb.backward(d)
    to, tg = TOL[dtype]
    tag = f"glu.{kind}.{str(dtype)[6:]}.{'x'.join(map(str, shape))}"
    check(tag + ".out", ya, yb, to)
    check(tag + ".dgate", a[0].grad, b[0].grad, tg)
    check(tag + ".dup", a[1].grad, b[1].grad, tg)


def test_glumlp_fast_step(check):
    """GLUMLP (bf16 weights) on the triton "glu" backend vs the reference backend: output and every gradient."""
    import openk3.fast  # noqa: F401
    from openk3.modules.ffn import GLUMLP

    torch.manual_seed(torch.seed() % (2**31))
    m = GLUMLP(512, 1408, "situ").to(DEV, torch.bfloat16)
    x = torch.randn(2, 333, 512, device=DEV, dtype=torch.bfloat16)
    d = torch.randn_like(x)
    res = {}
    for be in ("reference", "triton"):
        m.backend = be
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(d)
        res[be] = [y, xi.grad] + [p.grad.clone() for p in m.parameters()]
    for i, (f, r) in enumerate(zip(res["triton"], res["reference"])):
        check(f"glumlp.t{i}", f, r, 1e-2)
