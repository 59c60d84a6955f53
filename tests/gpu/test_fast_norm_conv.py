"""fla-core norm / gated norm / short-conv backends (openk3.fast.norm, openk3.fast.conv) vs the plain-PyTorch
references, on fresh random inputs, awkward shapes, bf16 and fp32, fp32 parameters next to bf16 activations.

Relative errors ||fast - ref|| / ||ref|| per tensor: outputs, final conv states and every gradient. Norms are compared
with the fp64 reference (each dtype's own rounding is the error) and, in the same dtype, with the reference (fp32:
agreement to rounding; bf16: at most the documented one-rounding difference of the gain order). The conv reference
computes in fp32 whatever the input dtype, so the conv is compared with it on the same inputs.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
EPS = 1e-5


def _fresh(seed=None):
    g = torch.Generator(device=DEV)
    g.manual_seed(seed if seed is not None else torch.seed() % (2**31))
    return g


def _rand(*shape, dtype=torch.float32, scale=1.0, g=None):
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def _leaves(ts, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in ts]


# (output, gradients) vs fp64, by activation dtype; fp32 vs the fp32 reference uses NORM_SAME_FP32
NORM_TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (1e-2, 1e-2)}
NORM_SAME_FP32 = 1e-6  # "agree to ~1e-6 in fp32"
NORM_SAME_BF16 = 1e-2  # one bf16 rounding of the output (gain order), ~2e-3 expected


def _norm_case(fast_fn, ref_fn, ins, check, tag, dtype):
    """ins: [x, weight, (gate)]; runs fast, same-dtype reference and fp64 reference with one output gradient."""
    g = _fresh()
    runs = {}
    for name, fn, cast in (("fast", fast_fn, None), ("ref", ref_fn, None), ("ref64", ref_fn, torch.float64)):
        leaves = _leaves(ins, cast)
        y = fn(leaves[0], leaves[1], *leaves[2:], EPS) if len(leaves) == 3 else fn(leaves[0], leaves[1], EPS)
        if name == "fast":
            dy = torch.randn(y.shape, device=DEV, generator=g)
        y.backward(dy.to(y.dtype))
        runs[name] = (y, [t.grad for t in leaves], leaves)
    y, grads, leaves = runs["fast"]
    assert y.dtype == dtype and y.shape == ins[0].shape
    for t, gr in zip(leaves, grads):
        assert gr.dtype == t.dtype, (gr.dtype, t.dtype)  # each input's gradient in its own dtype
    tol_o, tol_g = NORM_TOL[dtype]
    names = ["dx", "dweight", "dgate"]
    check(f"{tag}.y", y, runs["ref64"][0], tol_o)
    for n, a, b in zip(names, grads, runs["ref64"][1]):
        check(f"{tag}.{n}", a, b, tol_g)
    same = NORM_SAME_FP32 if dtype == torch.float32 else NORM_SAME_BF16
    check(f"{tag}.y_vs_same_dtype_ref", y, runs["ref"][0], same)


# (activation dtype, gain dtype) of the RMSNorm tests
RMS_DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-fp32gain"),
]


@pytest.mark.parametrize("dtype,wdtype", RMS_DTYPES)
@pytest.mark.parametrize("shape", [(2, 333, 2048), (1, 1, 2048), (3, 77, 200), (1000, 512), (5, 17, 768)])
def test_rms_norm_fla(dtype, wdtype, shape, check):
    from openk3.fast.norm import rms_norm_fla
    from openk3.ops.norm import rms_norm

    g = _fresh()
    D = shape[-1]
    x = _rand(*shape, dtype=dtype, scale=3.0, g=g)
    w = (1 + 0.2 * _rand(D, g=g)).to(wdtype)
    tag = f"norm.rms.{str(dtype)[6:]}.w{str(wdtype)[6:]}.{'x'.join(map(str, shape))}"
    _norm_case(rms_norm_fla, rms_norm, [x, w], check, tag, dtype)


@pytest.mark.parametrize("dtype,wdtype", RMS_DTYPES)
@pytest.mark.parametrize("shape", [(1, 4094, 2048), (1, 1, 2048), (3, 77, 200), (1000, 512), (5, 17, 2304)])
def test_rms_norm_no_grad_row_kernel(dtype, wdtype, shape, check):
    """Without autograd ``rms_norm_fla`` runs openk3's row kernel (the reference's roundings): against the same-dtype
    reference to fp32 summation order (bf16: a rare one-ulp flip of the output), and against fp64 as the fla path."""
    from openk3.fast import norm as FN
    from openk3.infer import glue
    from openk3.ops.norm import rms_norm

    g = _fresh()
    D = shape[-1]
    x = _rand(*shape, dtype=dtype, scale=3.0, g=g)
    w = (1 + 0.2 * _rand(D, g=g)).to(wdtype)
    calls = []
    inner = glue.add_rms_norm
    glue.add_rms_norm = lambda *a: calls.append(1) or inner(*a)
    try:
        with torch.no_grad():
            y = FN.rms_norm_fla(x, w, EPS)
    finally:
        glue.add_rms_norm = inner
    assert calls == [1] and y.dtype == dtype and y.shape == x.shape
    tag = f"norm.rows.{str(dtype)[6:]}.w{str(wdtype)[6:]}.{'x'.join(map(str, shape))}"
    check(f"{tag}.y_vs_same_dtype_ref", y, rms_norm(x, w, EPS), 1e-6 if dtype == torch.float32 else 4e-3)
    check(f"{tag}.y", y, rms_norm(x.double(), w.double(), EPS), NORM_TOL[dtype][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 333, 16, 128), (1, 1, 16, 128), (1, 77, 3, 200), (2, 65, 4, 1024)])
def test_gated_rms_norm_fla(dtype, shape, check):
    """The KDA output norm: x and gate in the model dtype, the gain an fp32 parameter."""
    from openk3.fast.norm import gated_rms_norm_fla
    from openk3.ops.norm import gated_rms_norm

    g = _fresh()
    D = shape[-1]
    x = _rand(*shape, dtype=dtype, scale=3.0, g=g)
    gate = _rand(*shape, dtype=dtype, scale=2.0, g=g)
    w = 1 + 0.2 * _rand(D, g=g)
    tag = f"norm.gated.{str(dtype)[6:]}.{'x'.join(map(str, shape))}"
    _norm_case(gated_rms_norm_fla, gated_rms_norm, [x, w, gate], check, tag, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4094, 16, 128), (1, 1, 16, 128), (1, 77, 3, 200), (2, 65, 4, 1024)])
def test_gated_rms_norm_no_grad_row_kernel(dtype, shape, check):
    """Without autograd ``gated_rms_norm_fla`` runs openk3's row kernel: against the same-dtype reference to fp32
    summation order and against fp64 as the fla path."""
    from openk3.fast import norm as FN
    from openk3.infer import glue
    from openk3.ops.norm import gated_rms_norm

    g = _fresh()
    D = shape[-1]
    x = _rand(*shape, dtype=dtype, scale=3.0, g=g)
    gate = _rand(*shape, dtype=dtype, scale=2.0, g=g)
    w = 1 + 0.2 * _rand(D, g=g)
    calls = []
    inner = glue.gated_rms_norm_rows
    glue.gated_rms_norm_rows = lambda *a: calls.append(1) or inner(*a)
    try:
        with torch.no_grad():
            y = FN.gated_rms_norm_fla(x, w, gate, EPS)
    finally:
        glue.gated_rms_norm_rows = inner
    assert calls == [1] and y.dtype == dtype and y.shape == x.shape
    tag = f"norm.gated_rows.{str(dtype)[6:]}.{'x'.join(map(str, shape))}"
    check(
        f"{tag}.y_vs_same_dtype_ref",
        y,
        gated_rms_norm(x, w, gate, EPS),
        1e-6 if dtype == torch.float32 else 4e-3,
    )
    check(f"{tag}.y", y, gated_rms_norm(x.double(), w.double(), gate.double(), EPS), NORM_TOL[dtype][0])


# --------------------------------------------------------------------------------------------------------------
# short conv

CONV_TOL = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
}  # fp32 ~1e-7 expected; bf16 one rounding (+ bf16 recompute)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B,T,C,W,cu,h0",
    [
        pytest.param(2, 200, 2048, 4, None, False, id="dense-T200"),
        pytest.param(2, 130, 200, 4, None, True, id="dense-h0-C200"),
        pytest.param(3, 1, 256, 4, None, True, id="decode-step"),
        pytest.param(2, 2, 256, 4, None, True, id="shorter-than-state"),
        pytest.param(1, 333, 256, 4, [0, 1, 77, 79, 333], True, id="varlen-h0"),
        pytest.param(1, 333, 200, 3, [0, 1, 77, 200, 333], False, id="varlen-W3"),
    ],
)
def test_causal_conv1d_fla(dtype, B, T, C, W, cu, h0, check):
    from openk3.fast.conv import causal_conv1d_fla
    from openk3.ops.conv import causal_conv1d

    g = _fresh()
    N = len(cu) - 1 if cu else B
    x = _rand(B, T, C, dtype=dtype, g=g)
    w = _rand(C, 1, W, scale=W**-0.5, g=g)  # fp32 parameter, [C, 1, W] as nn.Conv1d stores it
    # the carried state holds earlier inputs: values of the activation dtype, stored in fp32 (as the caches do)
    s0 = _rand(N, C, W - 1, dtype=dtype, g=g).float() if h0 else None
    cu_t = torch.tensor(cu, device=DEV) if cu else None
    ins = [x, w] + ([s0] if h0 else [])
    res = []
    for fn in (causal_conv1d_fla, causal_conv1d):
        leaves = _leaves(ins)
        y, fin = fn(
            leaves[0],
            leaves[1],
            initial_state=leaves[2] if h0 else None,
            cu_seqlens=cu_t,
            activation="silu",
            output_final_state=True,
        )
        assert y.dtype == dtype and y.shape == (B, T, C)
        assert fin.dtype == torch.float32 and fin.shape == (N, C, W - 1)
        gg = _fresh(5)
        dy = torch.randn(y.shape, device=DEV, generator=gg).to(dtype)
        dfin = torch.randn(fin.shape, device=DEV, generator=gg)
        ((y * dy).sum() + (fin * dfin).sum()).backward()
        for t in leaves:
            assert t.grad.dtype == t.dtype, (t.grad.dtype, t.dtype)
        res.append((y, fin, [t.grad for t in leaves]))
    (y, fin, grads), (y_r, fin_r, grads_r) = res
    tag = f"conv.{str(dtype)[6:]}.B{B}.T{T}.C{C}.W{W}{'.varlen' if cu else ''}{'.h0' if h0 else ''}"
    tol = CONV_TOL[dtype]
    check(f"{tag}.y", y, y_r, tol)
    assert torch.equal(fin, fin_r), "final conv state must be the exact last W-1 inputs"
    for n, a, b in zip(("dx", "dweight", "dh0"), grads, grads_r):
        check(f"{tag}.{n}", a, b, tol)


def test_conv_bad_state_shape_raises():
    from openk3.fast.conv import causal_conv1d_fla

    x = torch.randn(1, 10, 64, device=DEV)
    w = torch.randn(64, 4, device=DEV)
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_fla(x, w, initial_state=torch.zeros(2, 64, 3, device=DEV))


# --------------------------------------------------------------------------------------------------------------
# in the model: prefill + cached decode


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_prefill_and_decode_fast_norm_conv(dtype, check):
    """`small` with dense FFNs (no router top-k to flip), every op but norm/conv on the reference. Packed prefill
    logits and a 37-token prefill + 3 cached single-token steps (the conv state goes through the fast path's layout
    conversion both ways), norm/conv on fla vs on the reference. fp32: agreement to rounding. bf16: fla must be as
    close to the fp32 model as the bf16 reference is (each bf16 norm rounds differently, which through 12 layers is
    a few 1e-2 either way). And cached decode == one full forward on the fast path."""
    import openk3.fast  # noqa: F401
    from openk3 import K3ForCausalLM
    from openk3.config import get_preset
    from openk3.ops import backend

    assert backend.resolve("norm", True) == "fla" and backend.resolve("conv", True) == "fla"
    torch.manual_seed(torch.seed() % (2**31))
    cfg = get_preset("small", first_k_dense_replace=12)
    model = K3ForCausalLM(cfg).cuda().eval()
    for op in ("kda", "mla", "moe", "attnres"):
        model.set_backend(op, "reference")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.05)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), device=DEV)
    packed = torch.randint(0, cfg.vocab_size, (1, 150), device=DEV)
    cu = torch.tensor([0, 1, 70, 150], device=DEV)

    def run(be):
        model.set_backend("norm", be)
        model.set_backend("conv", be)
        with torch.no_grad():
            lp = model(packed, cu_seqlens=cu).logits.float()
            cache = model.new_cache()
            steps = [model(ids[:, :37], cache=cache).logits[:, -1].float()]
            for t in range(37, 40):
                steps.append(model(ids[:, t : t + 1], cache=cache).logits[:, -1].float())
            full = model(ids).logits[:, 36:].float()
        return lp, torch.stack(steps, 1), full

    truth = run("reference")  # fp32 model, every op on the reference
    if dtype != torch.float32:
        model.to_dtype(dtype)
    fast = run("fla")
    tag = f"model.small-dense.normconv.{str(dtype)[6:]}"
    if dtype == torch.float32:
        check(f"{tag}.packed", fast[0], truth[0], 1e-4)
        check(f"{tag}.decode", fast[1], truth[1], 1e-4)
        check(f"{tag}.decode_vs_full", fast[1], fast[2], 1e-4)
        return
    ref = run("reference")
    for i, part in enumerate(("packed", "decode")):
        bound = 1.5 * _rel(ref[i], truth[i]) + 2e-3
        check(f"{tag}.{part}_vs_fp32", fast[i], truth[i], bound)
    # cached decode vs full forward in bf16: as self-consistent as the reference path is (each rounds differently)
    check(f"{tag}.decode_vs_full", fast[1], fast[2], max(2e-2, 3.0 * _rel(ref[1], ref[2]) + 2e-3))
    print(f"relerr {tag}.reference_decode_vs_full = {_rel(ref[1], ref[2]):.3e}")
