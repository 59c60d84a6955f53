"""fla-core's norm / gated norm / short-conv kernels through our wrappers (openk3.fast.norm, openk3.fast.conv) under
TRITON_INTERPRET=1 on CPU, in fp32 at small sizes, against the references: checks the conv-state layout conversion
(initial state in, final state out, its gradient), packed sequences with a 1-token document, and the norm forwards.
fla's norm *backward* kernels loop over program-id-dependent ranges, which the interpreter cannot run: those are
covered by test_fast_norm_conv.py on a GPU only. The interpreter cannot benchmark, so the script keeps one config
per autotuned kernel. Runs in a subprocess; skipped without triton / fla-core / einops. Not marked ``gpu``.
"""

import importlib.util
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("triton", "fla", "einops")),
    reason="needs triton, fla-core and einops",
)

SCRIPT = textwrap.dedent(
    """
    from triton.runtime.autotuner import Autotuner

    _init = Autotuner.__init__

    def _one_config(self, fn, arg_names, configs, *a, **k):
        _init(self, fn, arg_names, configs[:1], *a, **k)

    Autotuner.__init__ = _one_config

    import torch
    from openk3.fast.conv import causal_conv1d_fla
    from openk3.fast.norm import gated_rms_norm_fla, rms_norm_fla
    from openk3.ops.conv import causal_conv1d
    from openk3.ops.norm import gated_rms_norm, rms_norm

    torch.manual_seed(0)

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm())

    worst = 0.0
    cases = [  # B, T, C, W, cu_seqlens, initial state
        (2, 70, 20, 4, None, True),
        (3, 1, 20, 4, None, True),
        (2, 2, 20, 4, None, True),
        (1, 80, 20, 4, [0, 1, 3, 66, 80], True),
        (1, 80, 20, 3, [0, 1, 3, 66, 80], False),
    ]
    for B, T, C, W, cu, h0 in cases:
        N = len(cu) - 1 if cu else B
        ins = [torch.randn(B, T, C), torch.randn(C, 1, W) * 0.5] + ([torch.randn(N, C, W - 1)] if h0 else [])
        cu_t = torch.tensor(cu) if cu else None
        res = []
        for fn in (causal_conv1d_fla, causal_conv1d):
            lv = [t.clone().requires_grad_() for t in ins]
            y, fin = fn(lv[0], lv[1], initial_state=lv[2] if h0 else None, cu_seqlens=cu_t, output_final_state=True)
            g = torch.Generator().manual_seed(1)
            loss = (y * torch.randn(y.shape, generator=g)).sum() + (fin * torch.randn(fin.shape, generator=g)).sum()
            loss.backward()
            res.append([y, fin] + [t.grad for t in lv])
        assert torch.equal(res[0][1], res[1][1]), "final state"
        worst = max([worst] + [rel(a, b) for a, b in zip(res[0], res[1])])

    import openk3.fast.norm as FN
    from openk3.infer import glue

    row_calls = []
    row_kernel = glue.add_rms_norm
    glue.add_rms_norm = lambda *a: row_calls.append(1) or row_kernel(*a)
    for D in (200, 640):
        x, w = torch.randn(3, 7, D) * 3, 1 + 0.2 * torch.randn(D)
        # with a gradient wanted: fla's kernel; without: openk3's row kernel (the reference's roundings)
        xg = x.clone().requires_grad_()
        worst = max(worst, rel(rms_norm_fla(xg, w, 1e-5), rms_norm(x, w, 1e-5)))
        assert not row_calls
        with torch.no_grad():
            worst = max(worst, rel(rms_norm_fla(x, w, 1e-5), rms_norm(x, w, 1e-5)))
            assert len(row_calls) == 1
            # rows that are no [-1, D] view, or the switch off: fla's kernel
            xt = torch.randn(D, 3, 7).permute(1, 2, 0)
            worst = max(worst, rel(rms_norm_fla(xt, w, 1e-5), rms_norm(xt, w, 1e-5)))
            FN.NO_GRAD_KERNEL = False
            worst = max(worst, rel(rms_norm_fla(x, w, 1e-5), rms_norm(x, w, 1e-5)))
            FN.NO_GRAD_KERNEL = True
            assert len(row_calls) == 1
        row_calls.clear()
    for D in (128, 640):
        x, gate, w = torch.randn(2, 5, 3, D) * 3, torch.randn(2, 5, 3, D), 1 + 0.2 * torch.randn(D)
        worst = max(worst, rel(gated_rms_norm_fla(x, w, gate, 1e-5), gated_rms_norm(x, w, gate, 1e-5)))
    print("WORST", worst)
    """
)


def test_fla_norm_conv_interpreted_on_cpu(run_interpreted):
    worst = run_interpreted(SCRIPT, hide_cuda=True)
    assert worst < 1e-6, worst
