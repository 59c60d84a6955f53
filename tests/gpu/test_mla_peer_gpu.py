"""FlashInfer as the engine's MLA decode step on CUDA (``EngineConfig.mla_backend="flashinfer"``): the step against
the reference, captured in a CUDA graph and re-planned for other lengths and pages between replays; the engine's
bf16 decode with it against the fp32 reference model. Skipped where flashinfer-python is not installed."""

import pytest
import torch

from openk3.infer.decode import mla_decode_reference

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _case(B, H, ps, max_len, width, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    P = B * width + 1
    kv = torch.randn(P + 1, ps, 576, device="cuda", generator=g).bfloat16()
    table = torch.randperm(P, device="cuda", generator=g)[: B * width].view(B, width).int()
    lengths = torch.randint(1, max_len + 1, (B,), device="cuda", generator=g).int()
    q = torch.randn(B, H, 576, device="cuda", generator=g)
    return q, kv, table, lengths


@pytest.mark.parametrize("H", [16, 96])
@pytest.mark.parametrize("ps", [16, 64])
def test_flashinfer_step_graph_replans(H, ps):
    """One CUDA graph holding the step, replayed after plans for new lengths / tables / cache contents (the graph
    reads the wrapper's buffers): each replay equals the reference for its inputs; eager calls too."""
    from openk3.infer.mla_peer import FlashInferDecodeStep

    B, L, scale = 8, 700, 192**-0.5
    width = -(-L // ps)
    step = FlashInferDecodeStep(
        torch.device("cuda"), num_heads=H, page_size=ps, scale=scale, kv_lora_rank=512, rope_dim=64,
        dtype=torch.bfloat16, max_pages_per_seq=width,
    )  # fmt: skip
    q, kv, table, lengths = _case(B, H, ps, L, width, 0)
    step.plan(table.cpu(), lengths.cpu(), graph=True)
    out = torch.full((B, H, 512), float("nan"), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(step(q, kv, table, lengths, scale=scale, kv_lora_rank=512))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(step(q, kv, table, lengths, scale=scale, kv_lora_rank=512))
    for seed in range(1, 4):
        q2, kv2, table2, lengths2 = _case(B, H, ps, L, width, seed)
        if seed == 3:
            lengths2[:] = 1  # every row one token
        q.copy_(q2), kv.copy_(kv2), table.copy_(table2), lengths.copy_(lengths2)
        step.plan(table.cpu(), lengths.cpu(), graph=True)
        out.fill_(float("nan"))
        g.replay()
        ref = mla_decode_reference(q, kv, table, lengths, scale=scale, kv_lora_rank=512)
        assert _rel(out, ref) < 1e-2, seed
        # the eager wrapper, a smaller batch
        step.plan(table[:3].cpu(), lengths[:3].cpu(), graph=False)
        got = step(q[:3], kv, table[:3], lengths[:3], scale=scale, kv_lora_rank=512)
        assert _rel(got, ref[:3]) < 1e-2, seed


@pytest.mark.parametrize("fuse_glue", [True, False], ids=["glue", "noglue"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_flashinfer_mla_decode(graphs, fuse_glue):
    """bf16 engine with the FlashInfer MLA step (Triton prep / post glue or the unfused path; graphs or eager, the
    batch shrinking through several buckets): decode logits no further from the fp32 reference than a bf16 full
    forward is, as for the default step (tests/gpu/test_engine_gpu.py)."""
    from test_engine_gpu import _err, _full_logits, _model, _prompts, _truth

    from openk3.infer.engine import Engine
    from openk3.infer.mla_peer import FlashInferDecodeStep
    from openk3.infer.sampling import SamplingParams

    model = _model("small", pin_routing=True)
    eng = Engine(
        model, None, page_size=16, max_seqs=8, max_tokens=8192, record_logits=True, use_cuda_graphs=graphs,
        prefix_cache=False, mla_backend="flashinfer", fuse_mla_glue=fuse_glue,
    )  # fmt: skip
    assert isinstance(eng._mla_step, FlashInferDecodeStep)
    plans = []
    real_plan = eng._mla_step.plan
    eng._mla_step.plan = lambda t, n, graph=False: (plans.append((t.shape[0], graph)), real_plan(t, n, graph))
    lengths = [5, 130, 17, 64, 1, 200]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 24, 33, 8, 40, 16)]
    reqs = eng.generate(_prompts(1, lengths, model.config.vocab_size), params)
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.graphs_enabled == graphs
    assert plans and all(g == graphs for _, g in plans[-10:])
    truth = _truth(reqs)
    e_full = _err(_full_logits(model, reqs), truth)
    e_eng = _err([torch.stack(r.logits_log) for r in reqs], truth)
    assert e_eng < max(1.5 * e_full, 1e-2), (e_eng, e_full)
