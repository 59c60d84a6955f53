"""MLA forms, AttnRes reads and block sizes, MoE routing, SiTU -- reference ops against independent formulas."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from openk3 import K3ForCausalLM, get_preset
from openk3.ops.activations import situ_glu
from openk3.ops.attnres import attnres_read
from openk3.ops.conv import causal_conv1d
from openk3.ops.mla import mla_absorbed_attention, mla_mha_attention
from openk3.ops.moe import experts_reference, route


def test_mla_absorbed_equals_mha(rel):
    B, T, S, H, dn, dr, dv, dc = 2, 3, 37, 5, 12, 6, 10, 20
    c = torch.randn(B, S, dc, dtype=torch.float64)
    kr = torch.randn(B, S, dr, dtype=torch.float64)
    w_uk = torch.randn(H, dn, dc, dtype=torch.float64) / 4
    w_uv = torch.randn(H, dv, dc, dtype=torch.float64) / 4
    q = torch.randn(B, T, H, dn + dr, dtype=torch.float64)
    scale = (dn + dr) ** -0.5
    k = torch.cat([torch.einsum("hnc,bsc->bshn", w_uk, c), kr[:, :, None].expand(B, S, H, dr)], -1)
    v = torch.einsum("hvc,bsc->bshv", w_uv, c)
    ref = mla_mha_attention(q, k, v, scale=scale)
    got = mla_absorbed_attention(q[..., :dn], q[..., dn:], c, kr, w_uk, w_uv, scale=scale)
    assert rel(got, ref) < 1e-6  # fp32 internal math
    # per-row valid lengths: row 0 uses only its first 20 cache entries
    lengths = torch.tensor([20, S])
    got2 = mla_absorbed_attention(q[..., :dn], q[..., dn:], c, kr, w_uk, w_uv, scale=scale, lengths=lengths)
    ref0 = mla_mha_attention(q[:1], k[:1, :20], v[:1, :20], scale=scale)
    assert rel(got2[:1], ref0) < 1e-6 and rel(got2[1:], ref[1:]) < 1e-6


def test_mla_mha_matches_naive_softmax(rel):
    B, T, H, D, Dv = 1, 9, 2, 7, 5
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D), torch.randn(B, T, H, Dv)
    out = mla_mha_attention(q, k, v, scale=0.3, cu_seqlens=torch.tensor([0, 4, 9]))
    for s, e in ((0, 4), (4, 9)):
        for t in range(s, e):
            w = torch.softmax(torch.einsum("hd,shd->hs", q[0, t], k[0, s : t + 1]) * 0.3, -1)
            assert rel(out[0, t], torch.einsum("hs,shd->hd", w, v[0, s : t + 1])) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_mha_takes_flash_varlen_only_in_half_precision(dtype, monkeypatch, rel):
    """``fast.mla.mha_sdpa`` with ``cu_seqlens`` (packed documents; the engine's fresh packed prefill): the flash
    varlen kernel, which takes only fp16 / bf16, for half precision; a loop of causal SDPA per document otherwise
    (fp32 used to reach the flash kernel and fail on CUDA). A stand-in varlen kernel records its calls."""
    from openk3.fast import mla as FM

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal):
        assert is_causal
        calls.append(q.dtype)
        b = cu_q.tolist()
        outs = []
        for a, e in zip(b, b[1:]):
            qt, kt, vt = (x[a:e].transpose(0, 1).float() for x in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
            outs.append(o.transpose(0, 1).to(q.dtype))
        return torch.cat(outs)

    monkeypatch.setattr(FM, "_varlen_attn", fake_varlen)
    monkeypatch.setattr(FM, "_VARLEN_PARAMS", {"scale", "is_causal"})
    monkeypatch.setattr(FM, "VARLEN_MODE", "varlen")
    q, k = torch.randn(1, 11, 2, 8).to(dtype), torch.randn(1, 11, 2, 8).to(dtype)
    v = torch.randn(1, 11, 2, 6).to(dtype)
    cu = torch.tensor([0, 4, 5, 11])
    out = FM.mha_sdpa(q, k, v, scale=0.3, cu_seqlens=cu)
    ref = mla_mha_attention(q.float(), k.float(), v.float(), scale=0.3, cu_seqlens=cu)
    assert out.dtype == dtype and calls == ([] if dtype == torch.float32 else [dtype])
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_attnres_read_formula(rel):
    S, N, D = 4, 6, 16
    vals = [torch.randn(N, D) * (i + 1) for i in range(S)]
    q, g = torch.randn(1, D), torch.rand(D) + 0.5
    out = attnres_read(vals, q, g, 1e-5)
    for n in range(N):
        sc = torch.stack([(g * q[0] * v[n] / v[n].pow(2).mean().add(1e-5).sqrt()).sum() for v in vals])
        p = torch.softmax(sc, 0)
        assert rel(out[n], sum(p[i] * vals[i][n] for i in range(S))) < 1e-5
    zero = attnres_read(vals, torch.zeros(1, D), g, 1e-5)  # zero query = uniform average
    assert rel(zero, sum(vals) / S) < 1e-6


def _walk_reference(model, ids):
    """Independent re-statement of SPEC.md §3.3 (seal after the pre-read; two reads per layer; final read)."""
    cfg = model.config
    r = model.model.embed_tokens(ids)
    sealed = []
    for i, layer in enumerate(model.model.layers):
        h = (
            attnres_read(
                sealed + [r],
                layer.self_attention_res_proj.weight,
                layer.self_attention_res_norm.weight,
                cfg.rms_norm_eps,
            )
            if sealed
            else r
        )
        if i % cfg.attn_res_block_size == 0:
            sealed.append(r)
            r = layer.self_attn(layer.input_layernorm(h))
        else:
            r = r + layer.self_attn(layer.input_layernorm(h))
        m = attnres_read(sealed + [r], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, cfg.rms_norm_eps)
        r = r + layer.ffn(layer.post_attention_layernorm(m))
    r = attnres_read(
        sealed + [r],
        model.model.output_attn_res_proj.weight,
        model.model.output_attn_res_norm.weight,
        cfg.rms_norm_eps,
    )
    return torch.nn.functional.linear(model.model.norm(r), model.lm_head.weight), len(sealed)


@pytest.mark.parametrize("block", [1, 2, 8, 100])
def test_attnres_block_sizes(block, rel):
    m = K3ForCausalLM(get_preset("tiny", attn_res_block_size=block, attn_res_init="normal")).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 11))
    with torch.no_grad():
        ref, nsealed = _walk_reference(m, ids)
        got = m(ids).logits
    assert nsealed == math.ceil(m.config.num_hidden_layers / block)
    assert rel(got, ref) < 1e-6


def test_no_attnres_is_plain_residual(rel):
    m = K3ForCausalLM(get_preset("tiny", attn_res_block_size=None)).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 7))
    with torch.no_grad():
        r = m.model.embed_tokens(ids)
        for layer in m.model.layers:
            r = r + layer.self_attn(layer.input_layernorm(r))
            r = r + layer.ffn(layer.post_attention_layernorm(r))
        ref = m.lm_head(m.model.norm(r))
        assert rel(m(ids).logits, ref) < 1e-6


def test_router_bias_selects_but_does_not_weight():
    N, D, E, k = 64, 16, 12, 3
    x, w = torch.randn(N, D), torch.randn(E, D)
    idx0, wt0, s = route(x, w, None, top_k=k)
    bias = torch.zeros(E)
    bias[5] = 10.0  # forces expert 5 into every token's top-k
    idx1, wt1, s1 = route(x, w, bias, top_k=k)
    assert torch.equal(s, s1) and (idx1 == 5).any(1).all() and not (idx0 == 5).all()
    # weights are the unbiased sigmoid scores of the chosen experts, renormalised
    expect = s.gather(1, idx1)
    assert torch.allclose(wt1, expect / expect.sum(1, keepdim=True), atol=1e-6)
    _, wt2, _ = route(x, w, bias, top_k=k, scaling=2.5, renormalize=False)
    assert torch.allclose(wt2, 2.5 * expect, atol=1e-6)


def test_group_limited_routing():
    x, w = torch.randn(32, 8), torch.randn(16, 8)
    idx, _, s = route(x, w, None, top_k=2, n_group=4, topk_group=1)
    assert ((idx // 4)[:, 0] == (idx // 4)[:, 1]).all()  # both picks from the one kept group


def test_experts_reference_matches_dense_loop(rel):
    N, W, I, E, k = 20, 8, 6, 5, 2
    x = torch.randn(N, W)
    w1, w3, w2 = torch.randn(E, I, W), torch.randn(E, I, W), torch.randn(E, W, I)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    wt = torch.rand(N, k)
    got = experts_reference(x, idx, wt, w1, w2, w3, act="situ")
    ref = torch.zeros(N, W)
    for n in range(N):
        for j in range(k):
            e = idx[n, j]
            ref[n] += wt[n, j] * (situ_glu(x[n] @ w1[e].T, x[n] @ w3[e].T) @ w2[e].T)
    assert rel(got, ref) < 1e-5
    for bad in (-1, E):  # an expert id out of range is a clear error, not an index error deep in torch
        wrong = idx.clone()
        wrong[3, 1] = bad
        with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 5\)"):
            experts_reference(x, wrong, wt, w1, w2, w3)


def test_situ_bounded_and_swiglu_near_origin():
    g = torch.randn(10000) * 50
    u = torch.randn(10000) * 50
    y = situ_glu(g, u, 4.0, 25.0)
    assert y.abs().max() <= 100.0 + 1e-4 and torch.isfinite(y).all()
    g, u = torch.randn(1000) * 1e-2, torch.randn(1000) * 1e-2
    assert torch.allclose(situ_glu(g, u), torch.nn.functional.silu(g) * u, rtol=1e-3, atol=1e-9)


def test_latent_moe_structure(rel):
    """y = shared(x) + up(RMSNorm(sum_i p_i E_i(down x))) (norm on the weighted sum, not per expert)."""
    m = K3ForCausalLM(get_preset("tiny")).eval()
    moe = m.model.layers[1].block_sparse_moe
    x = torch.randn(1, 10, m.config.hidden_size)
    with torch.no_grad():
        idx, w, _ = moe.gate(x[0])
        u = experts_reference(
            moe.routed_expert_down_proj(x[0]), idx, w, moe.experts.w1, moe.experts.w2, moe.experts.w3
        )
        u = (
            u
            * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + m.config.rms_norm_eps)
            * moe.routed_expert_norm.weight
        )
        ref = moe.routed_expert_up_proj(u) + moe.shared_experts(x[0])
        assert rel(moe(x)[0], ref) < 1e-5


def test_conv_state_and_varlen(rel):
    C, W = 6, 4
    w = torch.randn(C, W)
    x = torch.randn(1, 13, C)
    full, fin = causal_conv1d(x, w, output_final_state=True)
    a, st = causal_conv1d(x[:, :5], w, output_final_state=True)
    b, fin2 = causal_conv1d(x[:, 5:], w, initial_state=st, output_final_state=True)
    assert rel(torch.cat([a, b], 1), full) < 1e-6 and torch.equal(fin, fin2)
    packed, _ = causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 1, 9, 13]))
    sep = torch.cat([causal_conv1d(x[:, s:e], w)[0] for s, e in ((0, 1), (1, 9), (9, 13))], 1)
    assert rel(packed, sep) < 1e-6


def test_backend_resolution_and_notice(capsys, monkeypatch):
    from openk3.ops import backend

    assert backend.resolve("kda", is_cuda=False) == "reference"
    backend.register("kda", backend.Backend("fake", lambda: (False, "fake-lib not installed")))
    try:
        monkeypatch.setattr(backend, "_NOTICED", set())
        assert backend.resolve("kda", is_cuda=True) == "reference"
        assert backend.resolve("kda", is_cuda=True) == "reference"
        err = capsys.readouterr().err
        assert err.count("fake-lib not installed") == 1 and len(err.strip().splitlines()) == 1
        with pytest.raises(RuntimeError, match="not available"):
            backend.resolve("kda", is_cuda=True, requested="fake")
        with pytest.raises(ValueError, match="unknown backend"):
            backend.resolve("kda", is_cuda=False, requested="nope")
        monkeypatch.setenv("OPENK3_BACKEND_KDA", "reference")
        assert backend.resolve("kda", is_cuda=True) == "reference"
    finally:
        backend._REGISTRY["kda"] = [b for b in backend._REGISTRY["kda"] if b.name != "fake"]


@pytest.mark.parametrize("cu", [None, [0, 5, 6, 40]])
def test_blockwise_max_logit_matches_reference(cu, rel):
    from openk3.ops.mla import mla_max_logit

    B, T, S, H, D = (1 if cu else 2), 40, 40 if cu else 57, 3, 10
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, S, H, D), torch.randn(B, S, H, 4)
    cu_t = torch.tensor(cu) if cu else None
    _, ref = mla_mha_attention(q, k, v, scale=0.4, cu_seqlens=cu_t, return_max_logit=True)
    got = mla_max_logit(q, k, scale=0.4, cu_seqlens=cu_t, block=7)
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_qk_clip_statistic_with_a_fused_attention_backend(rel):
    """With a non-reference MLA kernel the module still records the exact per-head max logit."""
    from openk3.modules import mla as mla_mod
    from openk3.ops import backend

    def fused(q, k, v, *, scale, cu_seqlens):
        return mla_mha_attention(q, k, v, scale=scale, cu_seqlens=cu_seqlens)

    mla_mod.FAST_MHA["test_fused"] = fused
    backend.register("mla", backend.Backend("test_fused", lambda: (True, "test"), cuda_only=False))
    try:
        m = K3ForCausalLM(get_preset("tiny")).eval()
        attn = m.model.layers[3].self_attn
        x = torch.randn(1, 12, m.config.hidden_size)
        attn.record_max_logit = True
        ref_out = attn(x)
        ref_max = attn.max_logit.clone()
        attn.backend = "test_fused"
        out = attn(x, cu_seqlens=None)
        assert rel(out, ref_out) < 1e-6 and torch.allclose(attn.max_logit, ref_max, rtol=1e-6)
    finally:
        mla_mod.FAST_MHA.pop("test_fused")
        backend._REGISTRY["mla"] = [b for b in backend._REGISTRY["mla"] if b.name != "test_fused"]


@pytest.mark.parametrize("sparse", [False, True], ids=["train", "infer"])
@pytest.mark.parametrize("N,E,k", [(1, 256, 8), (37, 16, 4), (300, 8, 2)])
def test_grouped_moe_plan(sparse, N, E, k):
    """The expert-sorted padded layout of the grouped-GEMM MoE path (pure torch, no GPU needed): every (token,
    slot) pair gets its own row inside its expert's group, groups are multiples of 16 rows (never empty in
    training, empty for unused experts without autograd) and fit the static bound P."""
    from openk3.fast.moe import ALIGN, Plan

    g = torch.Generator().manual_seed(N * 1000 + E)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    plan = Plan(idx, E, sparse=sparse)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    ends = plan.offs.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    want = (counts + ALIGN - 1) // ALIGN * ALIGN
    if not sparse:
        want = want.clamp(min=ALIGN)
    assert torch.equal(sizes, want)
    assert int(ends[-1]) <= plan.P
    if sparse:
        assert plan.P == N * k + (ALIGN - 1) * min(E, N * k)
    rows = plan.rows
    assert rows.unique().numel() == N * k  # distinct rows
    start = ends - sizes
    e = idx
    assert bool(((rows >= start[e]) & (rows < start[e] + counts[e])).all())  # inside the expert's real rows
    tok = plan.tok_of_row
    assert torch.equal(tok[rows], torch.arange(N)[:, None].expand(N, k))
    pad = torch.ones(plan.P, dtype=torch.bool)
    pad[rows.reshape(-1)] = False
    assert bool((tok[pad] == N).all())  # padding rows point at the zero row


def test_env_command_reports_every_op_and_decode_step(capsys):
    """`openk3 env --json`: versions, the backend chosen per op with the alternatives and why, and the decode steps
    the inference engine would take (the reference everywhere on a CPU-only machine)."""
    import json

    from openk3.cli import main
    from openk3.ops import backend

    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cuda"] is torch.cuda.is_available()
    assert set(info["backends"]) == set(backend.OPS)
    for op, d in info["backends"].items():
        assert d["chosen"] in d["backends"] and "reference" in d["backends"], op
        if not info["cuda"]:
            assert d["chosen"] == "reference", op
    assert set(info["decode_steps"]) == {"kda", "mla", "mla_walk", "moe", "launch"}
    assert info["decode_steps"]["mla_walk"]["chosen"] in ("reference", "triton", "gluon")
    if not info["cuda"]:
        assert all(info["decode_steps"][op]["chosen"] == "reference" for op in ("kda", "mla", "mla_walk"))
        assert info["decode_steps"]["moe"]["chosen"] == "layer"
        assert info["decode_steps"]["launch"]["chosen"] == "plain"
    assert info["decode_steps"]["launch"]["chosen"] in ("plain", "pdl")
    from openk3.fast import moe_small

    want = (
        "OPENK3_MOE_SMALL_N=0" if moe_small.SMALL_N <= 0 else "OPENK3_MOE_SMALL_N" if info["cuda"] else "CUDA"
    )
    assert want in info["decode_steps"]["moe"]["why"]
    rn = info["fusions"]["readnorm"]
    assert rn["chosen"] == ("fused" if info["backends"]["attnres"]["chosen"] == "triton" else "separate")
    ak = info["attnres_kernels"]
    if ak is not None:
        from openk3.fast import attnres

        assert (ak["direct_max"], ak["dot"], ak["dv_stages"], ak["p2_rows"]) == (
            attnres.DIRECT_MAX,
            attnres.DV_DOT,
            attnres.DV_STAGES,
            attnres.P2_NORM_ROWS,
        )
        assert ak["maxnreg"] == attnres.MAXNREG and set(ak["tiles"]) == set(attnres.TILES)
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "inference decode steps" in text and "op backends" in text
    assert ak is None or f"direct_max {ak['direct_max']}" in text


def test_expert_gate_up_halves_stay_adjacent():
    """w1 / w3 are separate parameters stored as the halves of one [E, 2I, W] buffer (so the grouped-GEMM path
    needs no per-call copy); dtype moves and state-dict loads keep that layout and the values."""
    from openk3.modules.moe import Experts, gate_up_view

    torch.manual_seed(0)
    e = Experts(5, 12, 7)
    assert e.w1.shape == e.w3.shape == (5, 7, 12) and e.w2.shape == (5, 12, 7)
    assert gate_up_view(e.w1, e.w3) is not None
    torch.nn.init.normal_(e.w1)
    torch.nn.init.normal_(e.w3)
    w1, w3 = e.w1.detach().clone(), e.w3.detach().clone()
    assert not torch.equal(w1, w3)
    e.to(torch.bfloat16)
    assert gate_up_view(e.w1, e.w3) is not None
    assert torch.equal(e.w1.float(), w1.bfloat16().float()) and torch.equal(
        e.w3.float(), w3.bfloat16().float()
    )
    e2 = Experts(5, 12, 7).to(torch.bfloat16)
    e2.load_state_dict(e.state_dict())
    assert gate_up_view(e2.w1, e2.w3) is not None and torch.equal(e2.w1, e.w1) and torch.equal(e2.w3, e.w3)
    # gradients land on the right halves
    (e2.w1.float().sum() * 2 + e2.w3.float().sum() * 3).backward()
    assert bool((e2.w1.grad == 2).all()) and bool((e2.w3.grad == 3).all())


def test_pdl_switch():
    """openk3.fast._triton's programmatic-dependent-launch switch: pdl_scope sets it inside the block only (also
    when the block raises); CPU tensors never launch with it; the launch keyword follows the decision."""
    from openk3.fast import _triton as TR

    before = TR.PDL["on"]
    with TR.pdl_scope(True):
        assert TR.PDL["on"] is True
        assert TR.pdl_on(torch.zeros(1)) is False  # CPU: never
    assert TR.PDL["on"] == before
    try:
        with TR.pdl_scope(not before):
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert TR.PDL["on"] == before
    assert TR.pdl_launch(True) == {"launch_pdl": True} and TR.pdl_launch(False) == {}


def test_occupancy_follows_the_sm90_limits():
    """openk3.fast._triton.occupancy against the sm_90 limits (64 K registers allocated per warp in units of 256,
    2,048 threads, 32 blocks, 227 KB of shared memory per block plus 1 KB reserved per block), worked out by hand."""
    from openk3.fast._triton import occupancy

    smem = 232448  # the H100 / H200 per-block limit, 227 KB
    assert occupancy(128, 0, 4, smem) == 4  # 65536 / (128 * 128)
    assert occupancy(79, 0, 4, smem) == 6  # 79 registers take 80: 65536 / (80 * 128) = 6.4
    assert occupancy(80, 0, 4, smem) == 6
    assert occupancy(64, 0, 4, smem) == 8
    assert occupancy(255, 0, 8, smem) == 1  # 256 * 256 = all of the registers
    assert occupancy(32, 0, 32, smem) == 2  # 2,048 threads / 1,024
    assert occupancy(16, 0, 1, smem) == 32  # the block limit, not the 64 the threads would allow
    assert occupancy(32, 100 * 1024, 4, smem) == 2  # (227 + 1) KB / (100 + 1) KB
    assert occupancy(32, smem, 4, smem) == 1
    assert occupancy(255, 0, 16, smem) == 0  # does not fit at all


def test_cuda_index_reads_the_ordinal():
    """openk3.fast._triton.cuda_index: the ordinal of a CUDA device given as a string or a torch.device (no device
    needed for one that names it)."""
    from openk3.fast._triton import cuda_index

    assert cuda_index("cuda:3") == 3 and cuda_index(torch.device("cuda", 1)) == 1


def test_attnres_kernel_knobs_reject_bad_values(monkeypatch):
    """The AttnRes kernels' environment knobs: bad names or values raise a ValueError naming the variable at import
    (never a crash inside a launch); good ones land in the tables; register caps by source count fall back to the
    kernel's entry; no cap under the interpreter."""

    pytest.importorskip("triton")
    from openk3.fast import attnres as A

    for spec in ("nope=1x2x3", "p2_bwd=1x2048", "p2_bwd=0x64x4", "p2_bwd=axbxc"):
        with pytest.raises(ValueError, match="OPENK3_ATTNRES_TILES"):
            A._parse_tiles(spec)
    for spec in ("nope=64", "p2_bwd_norm.Sx=64", "p2_bwd_norm=-1", "p2_bwd_norm=many"):
        with pytest.raises(ValueError, match="OPENK3_ATTNRES_MAXNREG"):
            A._parse_maxnreg(spec)
    monkeypatch.setattr(A, "TILES", dict(A.TILES))
    monkeypatch.setattr(A, "MAXNREG", {})
    monkeypatch.setattr(A, "INTERPRET", False)
    A._parse_tiles(" p2_bwd=4x512x4 ,")
    assert A.TILES["p2_bwd"] == (4, 512, 4)
    A._parse_maxnreg("p2_bwd_norm=64,p2_bwd_norm.S3=0")
    assert A._regs("p2_bwd_norm", 2) == {"maxnreg": 64} and A._regs("p2_bwd_norm", 3) == {}
    assert A._regs("p2_fwd", 2) == {}
    monkeypatch.setattr(A, "INTERPRET", True)
    assert A._regs("p2_bwd_norm", 2) == {}
    bad = [
        ("OPENK3_ATTNRES_DOT", "fp64"),
        ("OPENK3_ATTNRES_DV_STAGES", "-1"),
        ("OPENK3_ATTNRES_P2_ROWS", "0"),
        ("OPENK3_ATTNRES_DIRECT_MAX", "three"),
        ("OPENK3_ATTNRES_MAXNREG", "p2_bwd_norm=lots"),
    ]
    _assert_imports_refuse("openk3.fast.attnres", bad)


# Runs in one fresh process: for each case, every openk3 module is dropped from sys.modules and the module imported
# again with one environment variable set (torch and triton stay loaded, so a case costs the import of openk3 alone,
# not a new interpreter). Prints one JSON line: per case, ["ok", repr of the shown expression] or [error type, message].
_IMPORT_CASES = r"""
import importlib, json, os, sys
mod, cases = sys.argv[1], json.loads(sys.argv[2])
out = []
for var, val, show in cases:
    for name in [n for n in sys.modules if n == "openk3" or n.startswith("openk3.")]:
        del sys.modules[name]
    old = os.environ.get(var)
    os.environ[var] = val
    try:
        m = importlib.import_module(mod)
        out.append(["ok", repr(eval(show, {"m": m}))])
    except Exception as e:
        out.append([type(e).__name__, str(e)])
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old
print("CASES" + json.dumps(out))
"""


def _import_cases(mod: str, cases: list[tuple[str, str, str]]) -> list[list[str]]:
    """Imports ``mod`` afresh once per (variable, value, expression) case, in one new process; the results in order."""
    env = {k: v for k, v in os.environ.items() if k not in {c[0] for c in cases}}
    res = subprocess.run(
        [sys.executable, "-c", _IMPORT_CASES, mod, json.dumps(cases)], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.split("CASES")[-1])
    assert len(out) == len(cases)
    return out


def _assert_imports_refuse(mod: str, bad: list[tuple[str, str]]) -> None:
    """Importing ``mod`` with each (variable, value) set fails with a ValueError naming the variable."""
    for (var, val), (kind, msg) in zip(bad, _import_cases(mod, [(v, x, "0") for v, x in bad])):
        assert kind == "ValueError" and var in msg, (var, val, kind, msg[-300:])


def test_moe_small_knobs_reject_bad_values():
    """The few-token MoE path's environment knobs: a bad value raises a ValueError naming the variable at import;
    0 / 1 land in the switches."""
    pytest.importorskip("triton")

    bad = [
        ("OPENK3_MOE_FUSE_SELECT", "yes"),
        ("OPENK3_MOE_SELECT_TOPK", "2"),
        ("OPENK3_MOE_SELECT_TOPK", "true"),
        ("OPENK3_MOE_SMALL_N", "-4"),
        ("OPENK3_MOE_UP_TILE", "3,0,1"),
        ("OPENK3_MOE_DOWN_COMBINE", "one"),
    ]
    _assert_imports_refuse("openk3.fast.moe_small", bad)
    show = "(int(m.FUSE_SELECT), int(m.SELECT_TOPK['on']), {})"
    good = [
        ("OPENK3_MOE_SELECT_TOPK", "0", show.format(0)),
        ("OPENK3_MOE_FUSE_SELECT", " 0 ", show.format(0)),
        ("OPENK3_MOE_UP_TILE", "4,0,1", show.format("m.UP_TILE[0]")),
        ("OPENK3_MOE_UP_TILE", "", show.format("m.UP_TILE[0]")),
    ]
    got = _import_cases("openk3.fast.moe_small", good)
    assert [g[0] for g in got] == ["ok"] * 4, got
    assert [g[1] for g in got[:3]] == ["(1, 0, 0)", "(0, 1, 0)", "(1, 1, 4)"]
    assert got[3][1] != got[2][1]  # the module was imported afresh: the previous case's tile did not stay
