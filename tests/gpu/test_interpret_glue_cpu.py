"""The decode step's residual add + RMSNorm kernel (``openk3.infer.glue``) under TRITON_INTERPRET=1 on CPU (a
subprocess: the interpreter must be chosen before Triton kernels are defined) and, compiled, on a GPU."""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = """
def cases(dev, widths):
    import torch
    from openk3.infer.glue import add_rms_norm, add_rms_norm_reference

    def rel(a, b):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        assert torch.isfinite(a).all()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    worst = 0.0
    g = torch.Generator().manual_seed(11)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3)):
        for B in (1, 3):
            for D in widths:
                for n in (0, 1, 2):
                    r = (torch.randn(B, D, generator=g) * 3).to(dev, dtype)
                    parts = [torch.randn(B, D, generator=g).to(dev, dtype) for _ in range(n)]
                    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dev, dtype)
                    x, rr = add_rms_norm(r, parts, w, 1e-5)
                    x0, r0 = add_rms_norm_reference(r, parts, w, 1e-5)
                    assert x.dtype == dtype and rr.dtype == dtype and x.shape == (B, D)
                    if n == 0:
                        assert rr is r
                    else:  # the adds round exactly as the reference's
                        assert torch.equal(rr, r0), (dtype, B, D, n)
                    e = rel(x, x0)
                    # bf16: a few outputs may land on the other side of a rounding boundary (fp32 sum order)
                    assert e <= tol, (dtype, B, D, n, e)
                    worst = max(worst, e if dtype == torch.float32 else 0.0)
    try:
        add_rms_norm(torch.randn(2, 8).to(dev), [torch.randn(2, 9).to(dev)], torch.ones(8).to(dev), 1e-5)
        raise AssertionError("a part of another shape was accepted")
    except ValueError:
        pass
    return worst
"""


def test_add_rms_norm_interpreted(run_interpreted):
    script = textwrap.dedent(CASES) + textwrap.dedent(
        """
        import openk3.infer.glue as G
        import torch
        assert G.triton_add_norm_ok(torch.zeros(2, 8))  # the interpreter runs the kernel on CPU tensors
        print("WORST", cases("cpu", (8, 40, 96)))
        """
    )
    assert run_interpreted(script, hide_cuda=True) < 2e-6


@pytest.mark.gpu
def test_add_rms_norm_gpu():
    ns: dict = {}
    exec(textwrap.dedent(CASES), ns)
    assert ns["cases"]("cuda", (2048, 2304, 7168)) < 2e-6
