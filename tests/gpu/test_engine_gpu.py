"""The inference engine on CUDA: Triton decode steps and CUDA-graph decode against a full re-forward, the sparse
(inference) grouped MoE layout against the reference experts, and the fallback when a kernel does not fit the model.
"""

import pytest
import torch

from openk3.config import get_preset
from openk3.infer.engine import Engine
from openk3.infer.sampling import SamplingParams
from openk3.model import K3ForCausalLM

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _model(preset, dtype=torch.bfloat16):
    """Random ``preset`` model. In bf16 the routing is pinned (a large correction bias on a fixed expert set per
    layer): at random init many tokens sit on near-ties between experts, and bf16 rounding differences between a
    full forward and cached decode flip them, which changes those tokens' outputs wholesale."""
    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset(preset).replace(attn_res_init="normal"))
    with torch.no_grad():  # slow decay, so a wrong or stale KDA state would show in the logits
        for layer in m.model.layers:
            if layer.attn_type == "kda":
                layer.self_attn.dt_bias.uniform_(-6.0, -1.0)
            if dtype != torch.float32 and layer.is_moe:
                gate = layer.block_sparse_moe.gate
                pick = torch.randperm(gate.weight.shape[0])[: gate.top_k]
                gate.e_score_correction_bias[pick] = 10.0
    m = m.to(DEV)
    if dtype != torch.float32:
        m.to_dtype(dtype)
    return m.eval()


def _prompts(seed, lengths, vocab):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def _full_forward_err(model, reqs) -> float:
    """Worst relative error of the recorded decode logits against a teacher-forced full forward."""
    worst = 0.0
    for r in reqs:
        seq = torch.tensor([r.all_ids[:-1]], device=DEV)
        with torch.no_grad():
            ref = model(seq).logits[0, r.num_prompt - 1 :].float().cpu()
        got = torch.stack(r.logits_log)
        assert got.shape == ref.shape
        worst = max(worst, _rel(got, ref))
    return worst


@pytest.mark.parametrize(
    "dtype,graphs,tol",
    [(torch.bfloat16, True, 3e-2), (torch.bfloat16, False, 3e-2), (torch.float32, False, 1e-3)],
    ids=["bf16-graphs", "bf16-eager", "fp32-eager"],
)
def test_engine_fast_decode_matches_full_forward(dtype, graphs, tol):
    model = _model("small", dtype)
    eng = Engine(
        model,
        None,
        page_size=16,
        max_seqs=8,
        max_tokens=8192,
        record_logits=True,
        use_cuda_graphs=graphs,
        prefix_cache=False,
    )
    from openk3.infer import kernels as KN

    assert eng._kda_step is KN.kda_decode_triton and eng._mla_step is KN.mla_decode_triton
    # ragged prompts and lengths: the batch shrinks as requests finish (several graph buckets)
    lengths = [5, 130, 17, 64, 1, 200]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 24, 33, 8, 40, 16)]
    reqs = eng.generate(_prompts(1, lengths, model.config.vocab_size), params)
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.graphs_enabled == graphs  # no fallback to eager happened
    if graphs:
        assert len(eng._graphs) >= 2
    err = _full_forward_err(model, reqs)
    assert err < tol, err


def test_engine_reference_decode_on_cuda_matches():
    """The reference decode steps on CUDA (forced), as a control for the test above."""
    model = _model("small")
    eng = Engine(
        model, None, page_size=16, max_seqs=4, max_tokens=4096, record_logits=True, decode_backend="reference"
    )
    reqs = eng.generate(
        _prompts(2, [9, 70], model.config.vocab_size),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    assert _full_forward_err(model, reqs) < 3e-2


def test_engine_unsupported_kernel_falls_back():
    """tiny's 8-value shared key does not fit the Triton MLA kernel: the engine takes the reference step and works."""
    model = _model("tiny", torch.float32)
    eng = Engine(
        model, None, page_size=8, max_seqs=4, max_tokens=2048, record_logits=True, use_cuda_graphs=True
    )
    from openk3.infer.decode import mla_decode_reference

    assert eng._mla_step is mla_decode_reference
    reqs = eng.generate(
        _prompts(3, [3, 33], model.config.vocab_size),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    )
    assert _full_forward_err(model, reqs) < 1e-4
    with pytest.raises(ValueError, match="shared key"):
        Engine(model, None, max_tokens=2048, decode_backend="triton")


@pytest.mark.parametrize("N", [1, 3, 64])
def test_grouped_moe_inference_layout(N):
    """Without autograd the grouped path gives unused experts no rows: same result as the reference experts."""
    import openk3.fast  # noqa: F401
    from openk3.fast.moe import experts_grouped
    from openk3.ops.moe import experts_reference

    g = torch.Generator(device=DEV).manual_seed(N)
    E, k, W, I = 64, 8, 256, 128
    x = torch.randn(N, W, device=DEV, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, device=DEV, generator=g)[:k] for _ in range(N)])
    wts = torch.rand(N, k, device=DEV, generator=g)
    w1, w3 = (0.05 * torch.randn(E, I, W, device=DEV, generator=g)).bfloat16(), None
    w3 = (0.05 * torch.randn(E, I, W, device=DEV, generator=g)).bfloat16()
    w2 = (0.05 * torch.randn(E, W, I, device=DEV, generator=g)).bfloat16()
    with torch.no_grad():
        out = experts_grouped(x, idx, wts, w1, w2, w3, act="situ", beta1=4.0, beta2=25.0)
        ref = experts_reference(x, idx, wts, w1, w2, w3, act="situ", beta1=4.0, beta2=25.0)
    assert _rel(out, ref) < 1e-2
