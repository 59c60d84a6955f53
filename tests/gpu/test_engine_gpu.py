"""The inference engine on CUDA: Triton decode steps and CUDA-graph decode against a full re-forward, the sparse
(inference) grouped MoE layout against the reference experts, and the fallback when a kernel does not fit the model.
"""

import pytest
import torch

import engine_chaos
from openk3.config import get_preset
from openk3.infer.engine import Engine
from openk3.infer.sampling import SamplingParams
from openk3.model import K3ForCausalLM

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _model(preset, dtype=torch.bfloat16, pin_routing=False, **over):
    """Random ``preset`` model on CUDA (config fields ``over`` replaced). ``pin_routing``: a large correction bias on
    a fixed expert set per layer, so that bf16 rounding cannot flip a token between near-tied experts (at random init
    many tokens sit on such ties, and a flip changes that token's output wholesale)."""
    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset(preset).replace(attn_res_init="normal", **over))
    with torch.no_grad():  # slow decay, so a wrong or stale KDA state would show in the logits
        for layer in m.model.layers:
            if layer.attn_type == "kda":
                layer.self_attn.dt_bias.uniform_(-6.0, -1.0)
            if pin_routing and layer.is_moe:
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


def _full_logits(model, reqs):
    out = []
    with torch.no_grad():
        for r in reqs:
            seq = torch.tensor([r.all_ids[:-1]], device=DEV)
            out.append(model(seq).logits[0, r.num_prompt - 1 :].float().cpu())
    return out


def _err(got_list, ref_list) -> float:
    return max(_rel(g, r) for g, r in zip(got_list, ref_list))


def _full_forward_err(model, reqs) -> float:
    """Worst relative error of the recorded decode logits against a teacher-forced full forward of the same model."""
    return _err([torch.stack(r.logits_log) for r in reqs], _full_logits(model, reqs))


def _truth(reqs):
    """fp32 logits of the engine's sequences from the reference ops (same seed and weights)."""
    m32 = _model("small", torch.float32, pin_routing=True)
    for op in ("kda", "mla", "moe", "attnres"):
        m32.set_backend(op, "reference")
    return _full_logits(m32, reqs)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_fast_decode_bf16(graphs):
    """bf16: the engine's decode logits (Triton steps, CUDA graphs or not) are no further from the fp32 reference
    than a bf16 full forward with the fast prefill backends is."""
    model = _model("small", pin_routing=True)
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
    if graphs:  # every bucket up front, as `openk3 serve` does at start-up
        assert eng.capture_graphs() == len(eng._buckets) and eng.graphs_enabled
    # ragged prompts and lengths: the batch shrinks as requests finish (several graph buckets)
    lengths = [5, 130, 17, 64, 1, 200]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 24, 33, 8, 40, 16)]
    reqs = eng.generate(_prompts(1, lengths, model.config.vocab_size), params)
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.graphs_enabled == graphs  # no fallback to eager happened
    if graphs:
        assert len(eng._graphs) >= 2
    truth = _truth(reqs)
    e_full = _err(_full_logits(model, reqs), truth)
    e_eng = _err([torch.stack(r.logits_log) for r in reqs], truth)
    assert e_eng < max(1.5 * e_full, 1e-2), (e_eng, e_full)


def _prefill_ab(flag: str, lengths, max_prefill_tokens: int, prefix_interval: int | None, check=None):
    """Greedy decode of the small bf16 model (routing pinned) with the engine setting ``flag`` off, then on: ragged
    prompts of ``lengths`` and, last, one that begins with the first 200 tokens of a 300-token prompt which each
    engine prefills first beside a short one (with prefix caching every ``prefix_interval`` tokens, it restores a
    snapshot of them; ``None``: no prefix cache). ``check(engine, on)`` sees each engine after its run. Returns
    (model, number of prompts, requests with ``flag`` off, requests with it on)."""
    model = _model("small", pin_routing=True)
    vocab = model.config.vocab_size
    base = _prompts(2, [300], vocab)[0]
    prompts = _prompts(3, lengths, vocab) + [base[:200] + _prompts(4, [40], vocab)[0]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(
        page_size=16, max_seqs=8, max_tokens=8192, record_logits=True, max_prefill_tokens=max_prefill_tokens
    )
    kw |= dict(prefix_interval=prefix_interval) if prefix_interval else dict(prefix_cache=False)
    runs = []
    for on in (False, True):
        eng = Engine(model, None, **{flag: on}, **kw)
        # packed (batch_prefill), base's pieces go beside the short prompt's: its snapshots are taken inside
        eng.generate([_prompts(5, [20], vocab)[0], base], params)
        runs.append(eng.generate(prompts, params))
        if check is not None:
            check(eng, on)
    return model, len(prompts), *runs


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix"])
def test_engine_batch_prefill_bf16(prefix):
    """EngineConfig.batch_prefill on CUDA (fla's varlen conv and KDA from per-sequence states, MLA per sequence over
    its cached prefix): ragged prompts longer than a step's budget, a one-token prompt, and with prefix caching a
    prompt that restores a snapshot; the decode logits stay as close to the fp32 reference as a bf16 full forward
    is, and as the one-sequence-per-forward engine's."""
    model, _, one, packed = _prefill_ab("batch_prefill", [5, 130, 17, 1, 200], 256, 64 if prefix else None)
    if prefix:
        assert packed[-1].prefix_hit == one[-1].prefix_hit == 192
    truth = _truth(packed)
    e_full = _err(_full_logits(model, packed), truth)
    e_packed = _err([torch.stack(r.logits_log) for r in packed], truth)
    e_one = _err([torch.stack(r.logits_log) for r in one], _truth(one))  # (bf16 may pick other greedy tokens)
    assert e_packed < max(1.5 * e_full, 1.5 * e_one, 1e-2), (e_packed, e_one, e_full)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_engine_prefix_cache_outputs_bf16(overlap):
    """EngineConfig.prefix_cache_outputs on CUDA with CUDA-graph decode (and overlap): the snapshots that decode
    takes past the prompt restore a follow-up prompt (prompt + reply + new tokens), whose decode logits stay as close
    to the fp32 reference as a bf16 full forward is."""
    model = _model("small", pin_routing=True)
    vocab = model.config.vocab_size
    kw = dict(page_size=16, max_seqs=4, max_tokens=8192, record_logits=True, overlap=overlap)
    eng = Engine(model, None, prefix_interval=32, prefix_cache_outputs=True, **kw)
    prompt = _prompts(6, [40], vocab)[0]
    (first,) = eng.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    follow = prompt + first.output_ids[:50] + _prompts(7, [5], vocab)[0]
    (again,) = eng.generate([follow], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert again.prefix_hit == 64  # 32 from the prompt, 64 from decode
    truth = _truth([again])
    e_full = _err(_full_logits(model, [again]), truth)
    e_eng = _err([torch.stack(again.logits_log)], truth)
    assert e_eng < max(1.5 * e_full, 1e-2), (e_eng, e_full)


@pytest.mark.parametrize(
    "fuse,fuse_ffn,fuse_res",
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
    ids=["plain", "fused-proj", "fused-ffn", "fused-all"],
)
def test_engine_fast_decode_fp32(fuse, fuse_ffn, fuse_res):
    """fp32: Triton decode steps against a full forward of the same model, tightly (also with the input projections
    fused into one GEMM per attention layer, and per FFN)."""
    model = _model("small", torch.float32)
    eng = Engine(
        model, None, page_size=16, max_seqs=8, max_tokens=8192, record_logits=True, prefix_cache=False,
        fuse_projections=fuse, fuse_ffn_projections=fuse_ffn, fuse_residual=fuse_res,
    )  # fmt: skip
    assert bool(eng.memory_report()["fused_ffn_layers"]) == fuse_ffn
    from openk3.infer import kernels as KN

    assert eng._kda_step is KN.kda_decode_triton and eng._mla_step is KN.mla_decode_triton
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 12, 16)]
    reqs = eng.generate(_prompts(4, [9, 77, 150], model.config.vocab_size), params)
    err = _full_forward_err(model, reqs)
    assert err < 1e-3, err


def test_fla_kda_core_fp32_matches_reference():
    """fla's KDA core in fp32 at K=128 (prefill lengths around the recurrent / chunk switch) equals the reference
    core and leaves its inputs untouched."""
    import openk3.fast  # noqa: F401
    from openk3.fast.kda import kda_core_fla
    from openk3.modules.kda import _kda_core_reference

    model = _model("small", torch.float32)
    layer = next(lay.self_attn for lay in model.model.layers if lay.attn_type == "kda")
    H, K = layer.num_heads, layer.head_dim
    g = torch.Generator(device=DEV).manual_seed(5)
    for T in (9, 64, 65, 77, 200):
        q, k, v, z = (torch.randn(1, T, H, K, device=DEV, generator=g) for _ in range(4))
        beta = torch.randn(1, T, H, device=DEV, generator=g)
        h0 = 0.1 * torch.randn(1, H, K, K, device=DEV, generator=g)
        ins = [t.clone() for t in (q, k, v, z, beta, h0)]
        with torch.no_grad():
            o, s = kda_core_fla(
                layer, q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=None
            )
            o2, s2 = _kda_core_reference(
                layer, *ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=None
            )
        for a, b in zip((q, k, v, z, beta, h0), ins):
            assert torch.equal(a, b)
        assert _rel(o, o2) < 1e-4 and _rel(s, s2) < 1e-4, (T, _rel(o, o2), _rel(s, s2))


def test_engine_reference_decode_on_cuda_matches():
    """The reference decode steps on CUDA (forced), fp32, as a control for the Triton steps."""
    model = _model("small", torch.float32)
    eng = Engine(
        model, None, page_size=16, max_seqs=4, max_tokens=4096, record_logits=True, decode_backend="reference"
    )
    reqs = eng.generate(
        _prompts(2, [9, 70], model.config.vocab_size),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    assert _full_forward_err(model, reqs) < 1e-4


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


def _greedy_fp32_decode_err(graphs: bool, seed: int, max_tokens, model_over=None, **engine_kw) -> float:
    """Greedy decode of three ragged prompts by the engine on the fp32 ``small`` model (config fields
    ``model_over`` replaced): the worst relative error of its decode logits against a full forward of the same
    model."""
    model = _model("small", torch.float32, **(model_over or {}))
    eng = Engine(
        model, None, page_size=16, max_seqs=8, max_tokens=8192, record_logits=True, prefix_cache=False,
        use_cuda_graphs=graphs, **engine_kw,
    )  # fmt: skip
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    reqs = eng.generate(_prompts(seed, [9, 77, 150], model.config.vocab_size), params)
    return _full_forward_err(model, reqs)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_fuse_read_norm(graphs, fuse, monkeypatch):
    """EngineConfig.fuse_read_norm on CUDA (on by default): every AttnRes read after the first sealed set goes
    through the Triton reader's fused read + RMSNorm launch, and with it off none does; fp32 decode logits against a
    full forward of the same model, tightly."""
    from openk3.fast import attnres

    normed = []
    p2 = attnres._p2_fwd

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **k: normed.append(k["NORM"]) or p2[grid](*a, **k)

    monkeypatch.setattr(attnres, "_p2_fwd", Spy())
    # the model's own forward (prefill, and the full forward the logits are checked against) reads unfused here, so
    # that the launches counted are the decode step's
    import openk3.model

    monkeypatch.setattr(openk3.model, "fuse_read_norm_default", lambda: False)
    err = _greedy_fp32_decode_err(graphs, seed=7, max_tokens=(18, 9, 14), fuse_read_norm=fuse)
    assert any(normed) == fuse, f"fused read + norm launches: {sum(normed)} with fuse_read_norm={fuse}"
    assert err < 1e-3, err


@pytest.mark.parametrize("variant", ["small", "plain-q-nogate"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_fuse_mla_glue(graphs, fuse, variant, monkeypatch):
    """EngineConfig.fuse_mla_glue on CUDA (on by default): every MLA layer's norm, cache write and absorbed query go
    through the Triton prep kernel and W_UV (with the output gate) through the reduce (or the post kernel after a
    one-split walk), and with it off neither launches; fp32 decode logits against a full forward of the same model,
    tightly (``small``: q LoRA and output gate; the variant without either)."""
    from openk3.infer import kernels as KN

    launches = {"prep": 0, "post": 0}

    class Spy:
        def __init__(self, kernel, kind):
            self.kernel, self.kind = kernel, kind

        def __getitem__(self, grid):
            def launch(*a, **k):
                launches[self.kind] += 1
                return self.kernel[grid](*a, **k)

            return launch

    monkeypatch.setattr(KN, "_mla_prep_kernel", Spy(KN._mla_prep_kernel, "prep"))
    monkeypatch.setattr(KN, "_mla_reduce_post_kernel", Spy(KN._mla_reduce_post_kernel, "post"))
    monkeypatch.setattr(KN, "_mla_post_kernel", Spy(KN._mla_post_kernel, "post"))
    over = {} if variant == "small" else dict(q_lora_rank=None, mla_use_output_gate=False)
    err = _greedy_fp32_decode_err(
        graphs, seed=12, max_tokens=(18, 9, 14), model_over=over, fuse_mla_glue=fuse
    )
    assert (launches["prep"] > 0) == fuse and (launches["post"] > 0) == fuse, launches
    if fuse:
        assert KN.MLA_GLUE_LAST_LAUNCH["post"]["gate"] == (variant == "small")
    assert err < 1e-3, err


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_fuse_kda_lowrank(graphs, fuse):
    """EngineConfig.fuse_kda_lowrank on CUDA (on by default): the KDA step kernel applies f_b_proj itself (at most
    16 rows), and with it off the GEMV does; fp32 decode logits against a full forward of the same model, tightly."""
    from openk3.infer import kernels as KN

    err = _greedy_fp32_decode_err(graphs, seed=8, max_tokens=(18, 9, 14), fuse_kda_lowrank=fuse)
    assert (KN.KDA_LAST_LAUNCH["lowrank"] > 0) == fuse, f"{KN.KDA_LAST_LAUNCH} with fuse_kda_lowrank={fuse}"
    assert err < 1e-3, err


@pytest.mark.parametrize("attnres", [True, False], ids=["attnres-latent", "plain-moe"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_parallel_ffn_add_norm(graphs, attnres, monkeypatch):
    """parallel_ffn (MoE branches on a second stream captured into the same graph) and fuse_add_norm (the residual
    add and the next RMSNorm in one Triton launch; models without AttnRes) on CUDA: fp32 decode logits against a full forward, tightly, for the `small` preset (AttnRes,
    latent MoE with shared experts) and the same without AttnRes and with a plain MoE (the Kimi Linear layout)."""
    import openk3.infer.engine as E

    calls = []
    real = E.add_rms_norm
    monkeypatch.setattr(E, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    over = {} if attnres else dict(attn_res_block_size=None, routed_expert_hidden_size=None)
    model = K3ForCausalLM(get_preset("small").replace(attn_res_init="normal", **over))
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.attn_type == "kda":
                layer.self_attn.dt_bias.uniform_(-6.0, -1.0)
    model = model.to(DEV).eval()
    eng = Engine(
        model, None, page_size=16, max_seqs=8, max_tokens=8192, record_logits=True, prefix_cache=False,
        use_cuda_graphs=graphs, parallel_ffn=True, fuse_add_norm=True,
    )  # fmt: skip
    assert eng._side is not None
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (18, 9, 14)]
    reqs = eng.generate(_prompts(9, [9, 77, 150], model.config.vocab_size), params)
    assert bool(calls) == (not attnres)
    err = _full_forward_err(model, reqs)
    assert err < 1e-3, err


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_kda_launch_above_few_rows(graphs, monkeypatch):
    """The KDA step's launch above the few-row regime (state requested into L2, heads-fastest grid) in the engine, at
    every batch size here (few_max_batch 0): fp32 decode logits against a full forward of the same model, tightly."""
    from openk3.infer import kernels as KN

    monkeypatch.setitem(KN.KDA_CONFIG, "few_max_batch", 0)
    err = _greedy_fp32_decode_err(graphs, seed=6, max_tokens=(20, 12, 16))
    assert KN.KDA_LAST_LAUNCH["l2_prefetch"] == KN.KDA_CONFIG["l2_prefetch"]
    assert KN.KDA_LAST_LAUNCH["heads_fast"] == KN.KDA_CONFIG["heads_fast"]
    assert err < 1e-3, err


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_kda_split_few_rows(graphs, monkeypatch):
    """The split KDA form (KDA_CONFIG["few"]["split_v"], no limit on programs per SM) for every few-row step of
    the engine, CUDA graphs captured with it included: fp32 decode logits against a full forward, tightly."""
    from openk3.infer import kernels as KN

    monkeypatch.setitem(KN.KDA_CONFIG, "few", {**KN.KDA_CONFIG["few"], "split_v": 4})
    monkeypatch.setitem(KN.KDA_CONFIG, "split_programs_per_sm", 0)
    err = _greedy_fp32_decode_err(graphs, seed=4, max_tokens=(20, 12, 16))
    assert KN.KDA_LAST_LAUNCH["split_v"] == 4, KN.KDA_LAST_LAUNCH
    assert all(int(c.abs().sum()) == 0 for c in KN._KDA_COUNTERS.values())
    assert err < 1e-3, err


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_moe_small_decode(graphs, monkeypatch):
    """The few-token MoE path (OPENK3_MOE_SMALL_N) in the engine: fp32 decode logits against a full forward of the
    same model, tightly, with batches above and below the threshold (both paths run)."""
    from openk3.fast import moe_small

    monkeypatch.setattr(moe_small, "SMALL_N", 2)
    calls = []
    experts = moe_small.experts_small
    monkeypatch.setattr(moe_small, "experts_small", lambda *a, **k: calls.append(1) or experts(*a, **k))
    err = _greedy_fp32_decode_err(graphs, seed=5, max_tokens=(24, 6, 12))
    assert calls, "the few-token path did not run"
    assert err < 1e-3, err


@pytest.mark.parametrize("tiled", [0, 16], ids=["grouped", "tiled"])
@pytest.mark.parametrize("N", [1, 3, 64])
def test_grouped_moe_inference_layout(N, tiled, monkeypatch):
    """Without autograd the grouped path gives unused experts no rows: same result as the reference experts; the
    same with the expert-tiled kernels taking these batches (``tiled``: their bound, pairs per expert)."""
    import openk3.fast  # noqa: F401
    from openk3.fast import moe_tiled
    from openk3.fast.moe import experts_grouped
    from openk3.ops.moe import experts_reference

    monkeypatch.setitem(moe_tiled.TILED, "max_pairs_per_expert", tiled)

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


@pytest.mark.parametrize("seed,overlap", [(3, False), (4, True)], ids=["sequential", "overlap"])
def test_engine_random_serving_scenario_on_cuda(seed, overlap):
    """The CPU test's random serving mix (arrivals, shared prefixes, mixed sampling options, aborts, a small pool,
    short prefix intervals and prefill pieces) through the CUDA engine (Triton steps, CUDA graphs of every batch
    size on the way): each request's decode logits are no further from the fp32 reference than a bf16 full forward
    of its sequence is, and the pool is whole at the end."""
    model = _model("small", pin_routing=True)
    sc = engine_chaos.scenario(seed, model.config.vocab_size, overlap=overlap)
    eng = Engine(model, None, record_logits=True, **sc.engine_kw)
    got = engine_chaos.drive(eng, sc)
    s = eng.stats()
    assert s["preemptions_total"] > 0 and s["prefix_cache_hits"] > 0
    assert any(r.finish_reason == "abort" for r in got)
    assert eng.graphs_enabled
    reqs = [r for r in got if r.output_ids]
    truth = _truth(reqs)
    for r, full, ref in zip(reqs, _full_logits(model, reqs), truth):
        e_full, e_eng = _rel(full, ref), _rel(torch.stack(r.logits_log), ref)
        assert e_eng < max(1.5 * e_full, 1e-2), (r.id, e_eng, e_full)
    assert s["pages_free"] + s["pages_held_by_prefix_cache_only"] == s["pages_total"]
    assert s["slots_free"] == sc.engine_kw["max_seqs"] and s["pages_used_by_sequences"] == 0


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_seeded_sampling_on_cuda(graphs):
    """Sampled decoding on CUDA (the one-kernel counter-based draw): a seeded request gets the same tokens alone and
    next to other requests, in graph and eager mode; another seed gives other tokens."""
    model = _model("small", torch.float32)
    eng = Engine(
        model, None, page_size=16, max_seqs=4, max_tokens=4096, use_cuda_graphs=graphs, prefix_cache=False
    )
    V = model.config.vocab_size
    p = _prompts(11, [12], V)[0]
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    (alone,) = eng.generate([p], sp)
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    mixed = eng.generate([_prompts(12, [7], V)[0], p, _prompts(13, [3], V)[0]], [others, sp, others])
    assert alone.output_ids == mixed[1].output_ids
    (other,) = eng.generate([p], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert other.output_ids != alone.output_ids


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
def test_engine_logprobs_on_cuda(overlap):
    """SamplingParams.logprobs / prompt_logprobs with CUDA graphs (fp32 model): each value against log_softmax of
    a full re-forward of the final sequence on the GPU, the top ids where clearly ordered."""
    model = _model("small", torch.float32)
    eng = Engine(
        model, None, page_size=16, max_seqs=4, max_tokens=4096, use_cuda_graphs=True, overlap=overlap
    )
    V = model.config.vocab_size
    sp = [
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=4, logprobs=4, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, prompt_logprobs=3, ignore_eos=True),
    ]
    reqs = eng.generate(_prompts(51, [13, 300], V), sp)
    for r in reqs:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([r.all_ids[:-1]], device=DEV)).logits[0].float(), -1)
        rows = [(r.num_prompt - 1 + j, e, r.params.logprobs) for j, e in enumerate(r.logprobs)]
        if r.params.prompt_logprobs is not None:
            rows += [(p, e, r.params.prompt_logprobs) for p, e in enumerate(r.prompt_logprobs[1:])]
            assert len(r.prompt_logprobs) == r.num_prompt
        assert len(rows) >= 10 and [e.id for e in r.logprobs] == r.output_ids
        for p, e, k in rows:
            assert abs(e.logprob - float(lp[p, e.id])) < 2e-3, (p, e.logprob, float(lp[p, e.id]))
            ref = lp[p].topk(k + 1)
            assert len(e.top) == k
            for j, (i, v) in enumerate(e.top):
                assert abs(v - float(ref.values[j])) < 2e-3
                if float(ref.values[j] - ref.values[j + 1]) > 1e-2:
                    assert i == int(ref.indices[j])


def test_engine_draw_kernels_match_torch_path(monkeypatch):
    """The engine's token draw through the Triton kernels (sampling.FAST_DRAW on, the default) and through the
    PyTorch path (sort-based top-p): the same tokens for seeded requests with top-p, top-k, min-p, a repetition
    penalty and a greedy row in one batch (a difference would need a token within fp32 rounding of a filter's
    boundary)."""
    from openk3.infer import sampling

    model = _model("small", torch.bfloat16)
    V = model.config.vocab_size
    prompts = _prompts(31, [9, 30, 17, 5, 12], V)
    sp = [
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, top_p=0.3, top_k=20, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(
            max_tokens=24, temperature=1.2, repetition_penalty=1.2, top_k=5, seed=3, ignore_eos=True
        ),
        SamplingParams(max_tokens=24, temperature=1.5, min_p=0.05, top_p=0.9, seed=4, ignore_eos=True),
    ]
    outs = {}
    for on in (True, False):
        monkeypatch.setitem(sampling.FAST_DRAW, "on", on)
        eng = Engine(
            model, None, page_size=16, max_seqs=5, max_tokens=4096, use_cuda_graphs=True, prefix_cache=False
        )
        outs[on] = [r.output_ids for r in eng.generate(prompts, sp)]
    assert outs[True] == outs[False]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.95),
        dict(temperature=0.8, top_k=40, seed=7),
        dict(temperature=0.0, repetition_penalty=1.3),
        dict(temperature=0.8, top_p=0.95, logprobs=2),
        dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.8, top_p=0.95, logit_bias={5: 2.0, 9: -100.0}),
        # min_tokens' ban (id 7, never drawn later either: the rows must run to max_tokens) inside the checked steps
        dict(temperature=0.8, min_p=0.1, min_tokens=10, stop_token_ids=[7], logit_bias={7: -100.0}),
        dict(temperature=0.8, top_p=0.9, allowed_token_ids=list(range(5, 900, 3))),
    ],
    ids=[
        "greedy",
        "top-p",
        "top-k-seeded",
        "penalty",
        "logprobs",
        "count-penalties",
        "logit-bias",
        "min-p",
        "allowed",
    ],
)
def test_engine_decode_steps_do_not_synchronise(kw):
    """Decode steps with CUDA graphs and overlap issue no synchronising CUDA call beyond the step's wait for the
    previous step's tokens (a CUDA event): no blocking host-to-device copy (each synchronises the stream first, so
    the next step could not be queued while the GPU runs this one), no ``.item()``; greedy and sampled rows, a
    finished row mid-run (its batch shrinks). ``torch.cuda.set_sync_debug_mode("error")`` makes each one raise."""
    model = _model("small", torch.bfloat16)
    eng = Engine(
        model, None, page_size=16, max_seqs=4, max_tokens=4096, use_cuda_graphs=True, prefix_cache=False
    )
    V = model.config.vocab_size
    sp = [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n in (40, 12, 40)]
    reqs = [eng.submit(p, s) for p, s in zip(_prompts(21, [9, 30, 17], V), sp)]
    while not all(len(r.output_ids) >= 4 for r in reqs):  # prefill, first steps
        eng.step()
    assert eng.capture_graphs() > 0  # every batch bucket (a capture synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises, with its traceback
    try:
        for _ in range(16):  # the 12-token request finishes in here
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert reqs[1].finished
    while eng.has_work():
        eng.step()
    assert all(len(r.output_ids) == s.max_tokens for r, s in zip(reqs, sp))
    allowed = set(kw.get("allowed_token_ids") or range(V))
    assert all(t in allowed for r in reqs for t in r.output_ids)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_pdl(graphs, monkeypatch):
    """EngineConfig.pdl (our decode kernels with programmatic dependent launch, in CUDA graphs and eagerly; here at
    every row count, not only at PDL_MAX_ROWS): fp32 decode logits against a full forward of the same model,
    tightly; the launches say so, and the process default is back in place after the engine's steps."""
    import openk3.infer.engine as E
    from openk3.fast import _triton as TR
    from openk3.infer import kernels as KN

    monkeypatch.setattr(E, "PDL_MAX_ROWS", 64)
    before = TR.PDL["on"]
    for pdl in (True, False):
        err = _greedy_fp32_decode_err(graphs, seed=9, max_tokens=(18, 9, 14), pdl=pdl)
        assert err < 1e-3, (pdl, err)
        assert KN.KDA_LAST_LAUNCH["pdl"] == pdl
        assert TR.PDL["on"] == before


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_overlap(graphs):
    """EngineConfig.overlap on CUDA (step t+1's token ids copied on the device into the graph's input buffer, step
    t's tokens brought to the host through a pinned buffer and an event): fp32 decode logits against a full forward,
    tightly, and the same tokens as the sequential engine."""
    err = _greedy_fp32_decode_err(graphs, seed=10, max_tokens=(18, 9, 14), overlap=True)
    assert err < 1e-3, err
    model = _model("small", torch.float32)
    prompts = _prompts(11, [9, 77, 150], model.config.vocab_size)
    params = [
        SamplingParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True)
        for n, t, s in ((12, 0.0, None), (7, 0.8, 3), (15, 1.0, 4))
    ]
    outs = []
    for ov in (False, True):
        eng = Engine(
            model, None, page_size=16, max_seqs=8, max_tokens=8192, use_cuda_graphs=graphs, overlap=ov
        )
        outs.append([r.output_ids for r in eng.generate(prompts, params)])
        assert eng._pending is None
    assert outs[0] == outs[1]


@pytest.mark.parametrize("layout", ["small", "plain-moe"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_triton_gemv(graphs, layout, monkeypatch):
    """EngineConfig.triton_gemv on CUDA (on by default): the decode step's projections of at most GEMV_MAX_ROWS
    rows go through the Triton GEMV (the LM head as fp32), with it off none do; fp32 decode logits against a full
    forward of the same model, tightly, for the `small` preset (AttnRes, latent MoE, q LoRA, output gate) and the
    Kimi Linear layout (no AttnRes, plain MoE: the shared experts' down projection through it too), with and
    without programmatic dependent launch. GEMV_DECODE is widened to every weight size of the test, so that each
    projection of a one-row step takes it (the three requests end at different steps: the last steps have one
    row)."""
    from openk3.infer import gemv as G

    monkeypatch.setitem(G.GEMV_DECODE, "max_bytes", 1 << 40)
    over = {} if layout == "small" else dict(attn_res_block_size=None, routed_expert_hidden_size=None)
    for on in (True, False):
        calls = []
        real = G.gemv
        spy = lambda x, w, *a, calls=calls, real=real, **k: (
            (  # the router's unrounded logits: not counted
                k.get("rounded", True) and calls.append(k.get("out_dtype", a[0] if a else None))
            )
            or real(x, w, *a, **k)
        )  # noqa: E731
        monkeypatch.setattr(G, "gemv", spy)
        err = _greedy_fp32_decode_err(
            graphs, seed=10, max_tokens=(18, 9, 14), model_over=over, triton_gemv=on, pdl=on
        )
        monkeypatch.setattr(G, "gemv", real)
        assert bool(calls) == on and (not on or torch.float32 in calls), (on, calls[:4])
        assert err < 1e-3, (on, err)


@pytest.mark.parametrize("layout", ["small", "plain-moe"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_fuse_glu_gemv(graphs, layout, monkeypatch):
    """EngineConfig.fuse_glu_gemv on CUDA (off by default): the shared experts' activation formed inside the GEMV
    that reads it (latent MoE: the output GEMM's two inputs read in place; plain MoE: the down projection), at one
    row; fp32 decode logits against a full forward of the same model, tightly."""
    from openk3.infer import gemv as G

    monkeypatch.setitem(G.GEMV_DECODE, "max_bytes", 1 << 40)
    over = {} if layout == "small" else dict(attn_res_block_size=None, routed_expert_hidden_size=None)
    kinds = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda x, w, *a, **k: kinds.append(type(x)) or real(x, w, *a, **k))
    err = _greedy_fp32_decode_err(
        graphs, seed=11, max_tokens=(18, 9, 14), model_over=over, fuse_glu_gemv=True
    )
    assert (tuple if layout == "small" else G.GLU) in kinds, set(kinds)
    assert err < 1e-3, err


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_fuse_norm_gemv(graphs, monkeypatch):
    """EngineConfig.fuse_norm_gemv on CUDA: a latent MoE's RMSNorm of the routed mixture formed inside the output
    GEMV that reads it (`small`: latent MoE with its norm), alone and with fuse_glu_gemv, at one row; fp32 decode
    logits against a full forward of the same model, tightly."""
    from openk3.infer import gemv as G

    monkeypatch.setitem(G.GEMV_DECODE, "max_bytes", 1 << 40)
    real = G.gemv
    for glu in (False, True):
        firsts = []
        monkeypatch.setattr(
            G,
            "gemv",
            lambda x, w, *a, firsts=firsts, **k: (
                firsts.append(type(x[0]) if isinstance(x, tuple) else None) or real(x, w, *a, **k)
            ),
        )
        err = _greedy_fp32_decode_err(
            graphs, seed=12, max_tokens=(18, 9, 14), fuse_norm_gemv=True, fuse_glu_gemv=glu
        )
        assert G.Normed in firsts, set(firsts)
        assert err < 1e-3, (glu, err)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_gemv_residual(graphs, monkeypatch):
    """EngineConfig.gemv_residual on CUDA (`small`: AttnRes, latent MoE): the residual adds after the output GEMVs
    done in their stores, with and without fuse_norm_gemv, at one row; fp32 decode logits against a full forward of
    the same model, tightly; off, no GEMV gets a residual."""
    from openk3.infer import gemv as G

    monkeypatch.setitem(G.GEMV_DECODE, "max_bytes", 1 << 40)
    real = G.gemv
    for on, norm in ((True, True), (True, False), (False, True)):
        seen = []
        monkeypatch.setattr(
            G,
            "gemv",
            lambda x, w, *a, seen=seen, **k: (
                seen.append(k.get("residual") is not None) or real(x, w, *a, **k)
            ),
        )
        err = _greedy_fp32_decode_err(
            graphs, seed=13, max_tokens=(18, 9, 14), gemv_residual=on, fuse_norm_gemv=norm
        )
        assert any(seen) == on, (on, norm, sum(seen))
        assert err < 1e-3, (on, norm, err)


@pytest.mark.parametrize("shared", ["side", "router"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_fold_norms(graphs, shared, monkeypatch):
    """EngineConfig.fold_norms on CUDA (`small` without AttnRes and with a plain MoE: the Kimi Linear layout): at
    one row the router GEMV forms the post-attention norm and writes the normed row, the experts' down + combine
    kernel adds the shared experts' output and the residual, the attention inputs' norms go into their GEMVs; fp32
    decode logits against a full forward of the same model, tightly; off, no experts call gets a residual. The
    shared experts on the side stream, or (FOLD_SHARED "router") formed by the router's GEMV and the down + combine
    kernel."""
    from openk3.fast import moe_small
    from openk3.infer import engine as E
    from openk3.infer import gemv as G

    monkeypatch.setattr(E, "FOLD_SHARED", shared)
    monkeypatch.setitem(G.GEMV_DECODE, "normed_max_bytes", 1 << 40)
    real, route = moe_small.experts_small, moe_small.route_logits_small
    for on in (True, False):
        seen, extra = [], []
        monkeypatch.setattr(
            moe_small,
            "experts_small",
            lambda *a, seen=seen, **k: seen.append(k.get("residual") is not None) or real(*a, **k),
        )
        monkeypatch.setattr(
            moe_small,
            "route_logits_small",
            lambda *a, ex=extra, **k: ex.append(k.get("extra", 0)) or route(*a, **k),
        )
        err = _greedy_fp32_decode_err(
            graphs,
            seed=17,
            max_tokens=(18, 9, 14),
            # (one shared expert for "router": the form takes shared experts of the routed experts' width)
            model_over=dict(
                attn_res_block_size=None,
                routed_expert_hidden_size=None,
                num_shared_experts=1 + (shared == "side"),
            ),
            fold_norms=on,
        )
        assert any(seen) == on, (on, sum(seen))
        assert any(e > 0 for e in extra) == (on and shared == "router"), (on, shared, extra[:4])
        assert err < 1e-3, (on, err)


def test_engine_graph_priority():
    """EngineConfig.graph_priority (off by default): the decode graph captured on a high-priority stream, the side
    stream's branches at the lowest priority; the same fp32 decode logits as a full forward, tightly (plain MoE, so
    that the shared experts run on the side stream)."""
    from openk3.infer import engine as E

    err = _greedy_fp32_decode_err(
        True,
        seed=19,
        max_tokens=(12, 7, 9),
        model_over=dict(attn_res_block_size=None, routed_expert_hidden_size=None),
        graph_priority=True,
    )
    assert E.GRAPH_PRIORITY < 0 and err < 1e-3, err


GLUON_ENGINE_CASES = [
    pytest.param(g, f, w, 32, id=f"{'graphs' if g else 'eager'}-{'glue' if f else 'noglue'}-{w}")
    for g in (True, False)
    for f in (True, False)
    for w in ("split", "persistent")
] + [
    pytest.param(True, True, "persistent", 16, id="graphs-glue-persistent-16heads"),
    pytest.param(False, False, "split", 16, id="eager-noglue-split-16heads"),
]


@pytest.mark.parametrize("graphs,fuse_glue,walk,heads", GLUON_ENGINE_CASES)
def test_engine_gluon_mla_decode(graphs, fuse_glue, walk, heads, monkeypatch):
    """bf16 engine whose MLA layers have K3's latent (512 + 64 values) and 32 (or 16) heads, with the warp-specialised Gluon
    kernel (``MLA_CONFIG["gluon"]``, from two rows up; the batch shrinks through the graph buckets down to one row,
    which takes the Triton kernel), its split walk or its persistent walk (here from two rows up): decode logits no
    further from the fp32 reference than a bf16 full forward is, as for the default step."""
    from openk3.infer import kernels as KN
    from openk3.infer import mla_gluon as MG
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams

    if not (MG.HAS_GLUON and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("needs Triton's Gluon and a Hopper GPU")
    monkeypatch.setitem(KN.MLA_CONFIG, "gluon", True)
    monkeypatch.setitem(KN.MLA_CONFIG, "gluon_min_heads", 16)
    monkeypatch.setitem(KN.MLA_CONFIG, "gluon_min_rows", 2)
    # rows per call of the walk under test (the persistent walk's query rows are [rows * head blocks * 64, 576])
    monkeypatch.setitem(MG.MLA_GLUON_CONFIG, "persist_min_rows", 2 if walk == "persistent" else 1 << 30)
    calls = []
    name = "mla_persist_gluon" if walk == "persistent" else "mla_split_gluon"
    real = getattr(MG, name)
    rows = (lambda q, *a: q.shape[0] // 64) if walk == "persistent" else (lambda q, *a: q.shape[0])
    monkeypatch.setattr(MG, name, lambda q, *a, **k: (calls.append(rows(q, *a)), real(q, *a, **k)))
    over = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=heads, num_key_value_heads=heads)
    model = _model("small", pin_routing=True, **over)
    eng = Engine(
        model, None, page_size=16, max_seqs=8, max_tokens=8192, record_logits=True, use_cuda_graphs=graphs,
        prefix_cache=False, fuse_mla_glue=fuse_glue,
    )  # fmt: skip
    lengths = [5, 130, 17, 64, 1, 200]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 24, 33, 8, 40, 16)]
    reqs = eng.generate(_prompts(1, lengths, model.config.vocab_size), params)
    assert all(r.finish_reason == "length" for r in reqs)
    assert calls and min(calls) >= 2, calls  # the Gluon walk ran, and only from two rows up
    truth = _truth(reqs)
    e_full = _err(_full_logits(model, reqs), truth)
    e_eng = _err([torch.stack(r.logits_log) for r in reqs], truth)
    assert e_eng < max(1.5 * e_full, 1e-2), (e_eng, e_full)


def _chunk_kw(layer, h0):
    from openk3.fast.kda import gate_kwargs

    kw = gate_kwargs(layer)
    kw.update(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True)  # fmt: skip
    return kw


def test_chunk_graphs_replay_matches_eager_fla(monkeypatch):
    """openk3.fast.kda.ChunkGraphs on fla's chunk_kda: graph replays of packed bf16 calls of several layouts in one
    bucket (and a second bucket), with the buffers' padding poisoned with NaN between calls, equal the eager
    varlen call (outputs and final states); a bucket whose capture fails is left eager and not retried."""
    import openk3.fast.kda as FK

    model = _model("small")
    layers = [lay.self_attn for lay in model.model.layers if lay.attn_type == "kda"]
    H, K = layers[0].num_heads, layers[0].head_dim
    graphs = FK.ChunkGraphs(max_tokens=1024, max_seqs=8)
    g = torch.Generator(device=DEV).manual_seed(7)
    layouts = ([300, 20, 77], [5, 200, 1], [64, 64, 64, 64], [397], [1000, 24])
    worst = 0.0
    for n, lens in enumerate(layouts):
        layer = layers[n % len(layers)]  # per-layer A_log / dt_bias go through the same graph
        T, N = sum(lens), len(lens)
        q, k, v, z = (torch.randn(1, T, H, K, device=DEV, generator=g).bfloat16() for _ in range(4))
        beta = torch.randn(1, T, H, device=DEV, generator=g).bfloat16()
        h0 = 0.1 * torch.randn(N, H, K, K, device=DEV, generator=g)
        cu_cpu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
        kw = _chunk_kw(layer, h0)
        with torch.no_grad():
            got = graphs.run(q, k, v, z, beta, {**kw, "cu_seqlens": cu_cpu.to(DEV)}, cu_cpu)
            want = FK._chunk_kda(q, k, v, z, beta, **kw, cu_seqlens=cu_cpu.to(DEV), cu_seqlens_cpu=cu_cpu)
        assert got is not None, graphs.failed
        errs = (_rel(got[0].float(), want[0].float()), _rel(got[1], want[1]))
        worst = max(worst, *errs)
        assert errs[0] < 2e-3 and errs[1] < 1e-4, (lens, errs)
        for e in graphs.entries.values():
            for name in ("q", "k", "v", "g", "beta"):
                e.bufs[name][0, T:] = float("nan")
            e.bufs["h0"][N:] = float("nan")
    print("worst relative difference, graph replay vs eager:", worst)
    assert graphs.stats["captures"] == 4 and graphs.stats["replays"] == len(
        layouts
    )  # (512,4) (256,4) (512,1) (1024,2)
    calls = []

    def fail(*a):
        calls.append(1)
        raise RuntimeError("no capture")

    monkeypatch.setattr(FK.ChunkGraphs, "_capture", fail)
    q = torch.randn(1, 40, H, K, device=DEV).bfloat16()
    kw = _chunk_kw(layers[0], torch.zeros(5, H, K, K, device=DEV))
    cu = torch.tensor([0, 8, 16, 24, 32, 40])  # a bucket not captured yet: (256, 8)
    with pytest.warns(RuntimeWarning, match="not captured"):
        assert graphs.run(q, q, q, q, q[..., 0], {**kw, "cu_seqlens": cu.to(DEV)}, cu) is None
    assert graphs.run(q, q, q, q, q[..., 0], {**kw, "cu_seqlens": cu.to(DEV)}, cu) is None
    assert len(calls) == 1 and len(graphs.failed) == 1


def test_row_graphs_replay_matches_eager(monkeypatch):
    """openk3.infer.row_graphs.RowGraphs on the small bf16 model's MoE and dense FFN layers: replays of ragged row
    counts (several in one bucket, with the static buffers' padding rows poisoned with NaN between calls) equal the
    eager layer on the real rows alone and the eager layer on the same padded rows; with the residual add; a
    (layer, bucket) whose capture fails is left eager and not retried."""
    from openk3.infer.row_graphs import RowGraphs

    model = _model("small", pin_routing=True)
    layers = model.model.layers
    fns = {i: layers[i].ffn for i in (0, next(i for i, lay in enumerate(layers) if lay.is_moe))}
    assert not layers[0].is_moe  # a dense layer and a MoE layer
    D = model.config.hidden_size
    rg = RowGraphs(1024, step=256)
    g = torch.Generator(device=DEV).manual_seed(11)
    worst = {"unpadded": 0.0, "padded": 0.0}
    for T in (1, 100, 256, 300, 700, 1024):
        for i, fn in fns.items():
            x = torch.randn(1, T, D, device=DEV, generator=g).bfloat16()
            res = torch.randn(1, T, D, device=DEV, generator=g).bfloat16()
            with torch.no_grad():
                got = rg.run(i, fn, x)
                got_add = rg.run(i, fn, x, add=res)
                want = fn(x)
                Tb = rg.bucket(T)
                xp = torch.zeros(1, Tb, D, device=DEV, dtype=x.dtype)
                xp[:, :T] = x
                want_padded = fn(xp)[:, :T]
            assert got is not None and got_add is not None, rg.failed
            e = (_rel(got.float(), want.float()), _rel(got.float(), want_padded.float()))
            worst["unpadded"], worst["padded"] = max(worst["unpadded"], e[0]), max(worst["padded"], e[1])
            assert e[0] < 5e-3 and e[1] < 1e-3, (T, i, e)
            assert torch.equal(got_add, res + got)
            for b in rg._bufs.values():  # the next call must not read what this one left
                b[T:] = float("nan")
    print("worst relative difference, replay vs eager:", worst)
    assert rg.stats["captures"] == 2 * 4 and rg.stats["replays"] == 2 * 2 * 6  # buckets 256, 512, 768, 1024
    calls = []

    def fail(*a):
        calls.append(1)
        raise RuntimeError("no capture")

    monkeypatch.setattr(RowGraphs, "_capture", fail)
    x = torch.randn(1, 20, D, device=DEV).bfloat16()
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="not captured"):
            assert rg.run("another", fns[0], x) is None
        assert rg.run("another", fns[0], x) is None
    assert len(calls) == 1 and len(rg.failed) == 1


def _graphs_ab(flag: str, stat: str, prefix_interval: int | None):
    """:func:`_prefill_ab` of a prefill graph setting ``flag`` (packed ragged prompts, 128 tokens per step): its
    counters (``{stat}_replays`` / ``_captures``) show use with it on and are absent with it off, and the decode
    logits with it stay as close to the fp32 reference as the eager prefill's (bf16 may pick other greedy tokens).
    Returns (requests with ``flag`` off, with it on)."""

    def check(eng, on):
        st = eng.stats()
        if on:
            assert st[f"{stat}_replays"] > 0 and st[f"{stat}_captures"] > 0, st
        else:
            assert f"{stat}_replays" not in st

    _, n, eager, graphed = _prefill_ab(flag, [5, 130, 17, 1, 200, 90], 128, prefix_interval, check)
    e_graph = _err([torch.stack(r.logits_log) for r in graphed], _truth(graphed))
    e_eager = _err([torch.stack(r.logits_log) for r in eager], _truth(eager))
    same = sum(a.output_ids == b.output_ids for a, b in zip(eager, graphed))
    print(f"{flag}: on {e_graph:.3e}, off {e_eager:.3e}, same greedy tokens {same}/{n}")
    assert e_graph < max(1.5 * e_eager, 1e-2), (e_graph, e_eager)
    return eager, graphed


def test_engine_prefill_ffn_graphs():
    """EngineConfig.prefill_ffn_graphs: packed prefill of ragged prompts (and a restored prefix) with the FFN layers
    replayed from graphs gives decode logits as close to the fp32 reference as the eager prefill's, and the graphs
    were used."""
    eager, graphed = _graphs_ab("prefill_ffn_graphs", "prefill_ffn_graph", 64)
    assert graphed[-1].prefix_hit == eager[-1].prefix_hit == 192


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix"])
def test_engine_prefill_graphs(prefix):
    """EngineConfig.prefill_graphs: packed prefill of ragged prompts (and with prefix caching, snapshots inside the
    pieces and a restored prefix) with the KDA chunk calls replayed from graphs gives decode logits as close to the
    fp32 reference as the eager prefill's, and the graphs were used."""
    # (pieces with a snapshot inside run their KDA recurrence over the snapshots' prefixes too, past the buckets:
    # eager; at an interval of one step's budget most pieces have none inside)
    eager, graphed = _graphs_ab("prefill_graphs", "prefill_graph", 128 if prefix else None)
    if prefix:
        assert graphed[-1].prefix_hit == eager[-1].prefix_hit == 128


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_memory_given_back_on_cuda(graphs):
    """Engines built, run and deleted one after another on one model: from the second on, each gives back all the
    GPU memory it allocated (the fused buffers of the first are reused; the side, warm-up and capture streams are
    the process's shared ones, so no new cuBLAS workspace is kept per engine), and every engine gives the same
    tokens."""
    import gc

    from openk3.fast.graphs import shared_stream

    model = _model("small", pin_routing=True)
    prompts = _prompts(11, [37, 90], model.config.vocab_size)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2
    after, outs = [], []
    for _ in range(3):
        eng = Engine(
            model, None, page_size=16, max_seqs=2, max_tokens=512, prefix_cache=False, use_cuda_graphs=graphs,
            cuda_graph_max_batch=2,
        )  # fmt: skip
        if eng._side is not None:
            assert eng._side is shared_stream(DEV, "side")
        outs.append([r.output_ids for r in eng.generate(prompts, params)])
        del eng
        gc.collect()
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert outs[0] == outs[1] == outs[2]
    assert after[2] - after[1] <= 1 << 20, [(a - after[0]) / 2**20 for a in after]


def test_engine_guided_on_cuda():
    """Structured output on the GPU engine (CUDA graphs, overlap, the Triton draw): each guided row's masks reach
    the draw on the device, replies match their regex / choice / schema and end with "stop", and an unguided row
    keeps the tokens it gets alone."""
    import json
    import re

    pytest.importorskip("llguidance")
    from openk3.train.data import default_corpus
    from openk3.train.tokenizer import Tokenizer

    tok = Tokenizer.train_bpe(default_corpus(max_bytes=200_000), vocab_size=600)
    model = _model("small", torch.bfloat16)
    eng = Engine(
        model, tok, page_size=16, max_seqs=4, max_tokens=4096, use_cuda_graphs=True, prefix_cache=False
    )
    schema = {
        "type": "object",
        "properties": {"v": {"enum": ["p", "q"]}},
        "required": ["v"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    plain = SamplingParams(max_tokens=16, temperature=0.9, seed=2, ignore_eos=True)
    alone = eng.generate(["y = 2"], plain)[0].output_ids
    specs = [{"regex": "[0-9]{2}-[a-c]{3}"}, {"choice": ["left", "right"]}, {"json": schema}]
    ps = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, guided=g) for s, g in enumerate(specs)]
    rs = eng.generate(["a", "bb", "ccc", "y = 2"], ps + [plain])
    assert re.fullmatch("[0-9]{2}-[a-c]{3}", rs[0].text) and rs[1].text in ("left", "right")
    assert json.loads(rs[2].text)["v"] in ("p", "q")
    assert [r.finish_reason for r in rs[:3]] == ["stop"] * 3
    assert rs[3].output_ids == alone
