"""The "glu" op's Triton backend (fused SiTU-GLU / SwiGLU, forward and backward) under TRITON_INTERPRET=1 on CPU
against the fp32 reference activation, on odd shapes and both activations.
Runs in a subprocess (the interpreter must be chosen before triton kernels are defined); skipped without triton.
"""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import torch
    from openk3.fast.moe import glu_act_triton
    from openk3.ops.activations import glu_act

    torch.manual_seed(0)

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    worst = 0.0
    for shape in [(1, 1), (3, 7, 33), (130, 200), (2, 5, 129)]:
        for kind in ("situ", "silu"):
            # large values too: the SiTU bounds (tanh saturation) and the small-|x| series branch
            g0 = torch.randn(*shape) * 6
            u0 = torch.randn(*shape) * 40
            g0.view(-1)[:3] = torch.tensor([0.01, -0.03, 0.0])[: g0.numel()][: min(3, g0.numel())]
            ga, ua = g0.clone().requires_grad_(), u0.clone().requires_grad_()
            gb, ub = g0.clone().requires_grad_(), u0.clone().requires_grad_()
            ya = glu_act_triton(ga, ua, kind, 4.0, 25.0)
            yb = glu_act(gb, ub, kind, 4.0, 25.0)
            assert ya.shape == yb.shape and ya.dtype == yb.dtype
            d = torch.randn_like(ya)
            (ya * d).sum().backward()
            (yb * d).sum().backward()
            errs = [rel(ya, yb), rel(ga.grad, gb.grad), rel(ua.grad, ub.grad)]
            worst = max([worst] + errs)
    # non-contiguous inputs (a column slice of a wider buffer) and an empty batch
    h = torch.randn(9, 2 * 40)
    a = glu_act_triton(h[:, :40], h[:, 40:], "situ")
    assert rel(a, glu_act(h[:, :40], h[:, 40:], "situ")) < 1e-5
    assert glu_act_triton(torch.randn(0, 8), torch.randn(0, 8), "situ").shape == (0, 8)
    for bad in [lambda: glu_act_triton(torch.randn(3, 4), torch.randn(3, 5), "situ"),
                lambda: glu_act_triton(torch.randn(3, 4), torch.randn(3, 4), "gelu")]:
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("bad input accepted")
    # registered as the "glu" op's triton backend (dispatch itself: tests/test_norm_conv_backends.py)
    import openk3.fast  # noqa: F401
    from openk3.modules.ffn import FAST_GLU
    assert FAST_GLU["triton"] is glu_act_triton
    print("WORST", worst)
    """
)


def test_glu_triton_interpreted_on_cpu(run_interpreted):
    worst = run_interpreted(SCRIPT)
    assert worst < 1e-5, worst
