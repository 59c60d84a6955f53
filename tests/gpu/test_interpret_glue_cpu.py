"""The decode step's residual add + RMSNorm kernel (``openk3.infer.glue``) under TRITON_INTERPRET=1 on CPU (a
subprocess: the interpreter must be chosen before Triton kernels are defined) and, compiled, on a GPU."""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

REL = """
def rel(a, b):
    import torch

    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
"""

CASES = (
    REL
    + """
def cases(dev, widths):
    import torch
    from openk3.infer.glue import add_rms_norm, add_rms_norm_reference

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
)


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


GATED_CASES = (
    REL
    + """
def gated_cases(dev, shapes):
    import torch
    from openk3.infer.glue import gated_rms_norm_rows
    from openk3.ops.norm import gated_rms_norm

    worst = 0.0
    g = torch.Generator().manual_seed(12)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3)):
        for N, D in shapes:
            x = (torch.randn(N, D, generator=g) * 3).to(dev, dtype)
            gate = (torch.randn(N, D, generator=g) * 2).to(dev, dtype)
            w = 1 + 0.2 * torch.randn(D, generator=g).to(dev)  # the KDA gain: an fp32 parameter
            y = gated_rms_norm_rows(x, gate, w, 1e-5)
            assert y.dtype == dtype and y.shape == x.shape
            e = rel(y, gated_rms_norm(x, w, gate, 1e-5))  # same dtype: one rounding each, fp32 sum order apart
            e64 = rel(y, gated_rms_norm(x.double(), w.double(), gate.double(), 1e-5))
            assert e <= tol and e64 <= tol, (dtype, N, D, e, e64)
            worst = max(worst, e if dtype == torch.float32 else 0.0)
    for bad in ((torch.randn(4, 8), torch.randn(4, 9), torch.ones(8)), (torch.randn(4, 8), torch.randn(4, 8), torch.ones(9))):
        try:
            gated_rms_norm_rows(*(t.to(dev) for t in bad), 1e-5)
            raise AssertionError("mismatched shapes were accepted")
        except ValueError:
            pass
    return worst
"""
)


def test_gated_rms_norm_rows_interpreted(run_interpreted):
    """openk3.infer.glue.gated_rms_norm_rows (the KDA output norm without autograd) against the reference in fp32 and
    bf16, rows counts that leave a program's rows partly past the end, widths below and at a power of two."""
    script = textwrap.dedent(GATED_CASES) + textwrap.dedent(
        """
        print("WORST", gated_cases("cpu", ((1, 16), (7, 16), (33, 24), (5, 128))))
        """
    )
    assert run_interpreted(script, hide_cuda=True) < 2e-6


@pytest.mark.gpu
def test_gated_rms_norm_rows_gpu():
    ns: dict = {}
    exec(textwrap.dedent(GATED_CASES), ns)
    assert ns["gated_cases"]("cuda", ((1, 128), (4097 * 16, 128), (333, 200), (65 * 4, 1024))) < 2e-6
