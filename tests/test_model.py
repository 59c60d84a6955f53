"""Model-level invariants of the reference K3ForCausalLM on the tiny preset (CPU, fp32)."""

import json
import os

import pytest
import torch

from openk3 import K3Config, K3ForCausalLM, get_preset
from openk3.checkpoint import CheckpointError


def _model(**over):
    cfg = get_preset("tiny", **over)
    m = K3ForCausalLM(cfg).eval()
    with torch.no_grad():  # make every constant-initialised parameter non-trivial
        for n, p in m.named_parameters():
            if "norm" in n or "_res_proj" in n:
                p.add_(0.1 * torch.randn_like(p))
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.05)
    return m


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return _model()


@pytest.mark.parametrize("decode_form", ["absorbed", "mha"])
def test_prefill_equals_prefill_plus_decode(tiny, rel, decode_form):
    for m in tiny.modules():
        if hasattr(m, "decode_form"):
            m.decode_form = decode_form
    B, T, k = 2, 40, 6
    ids = torch.randint(0, tiny.config.vocab_size, (B, T))
    with torch.no_grad():
        full = tiny(ids).logits
        cache = tiny.new_cache()
        parts = [tiny(ids[:, : T - k], cache=cache).logits]
        for t in range(T - k, T):
            parts.append(tiny(ids[:, t : t + 1], cache=cache).logits)
    inc = torch.cat(parts, 1)
    assert cache.seq_len == T
    assert rel(inc, full) < 2e-5
    assert rel(inc[:, -k:], full[:, -k:]) < 2e-5


def test_packed_equals_separate(tiny, rel):
    lens = [7, 1, 30, 12]
    docs = [torch.randint(0, tiny.config.vocab_size, (1, n)) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    with torch.no_grad():
        packed = tiny(torch.cat(docs, 1), cu_seqlens=cu).logits
        sep = torch.cat([tiny(d).logits for d in docs], 1)
    assert rel(packed, sep) < 1e-5


def test_packed_loss_ignores_boundaries(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (1, 20))
    cu = torch.tensor([0, 8, 20])
    out = tiny(ids, cu_seqlens=cu, labels=ids)
    a = tiny(ids[:, :8], labels=ids[:, :8])
    b = tiny(ids[:, 8:], labels=ids[:, 8:])
    expect = (a.loss * 7 + b.loss * 11) / 18
    assert torch.allclose(out.loss, expect, rtol=1e-5)


@pytest.mark.parametrize("shard", [None, 200_000])
@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_save_load_identical(tiny, tmp_path, shard, prefix):
    tiny.save_pretrained(tmp_path, max_shard_size=shard, prefix=prefix)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    back = K3ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, tiny.config.vocab_size, (2, 17))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, tiny(ids).logits)
    assert back.config.to_dict() == tiny.config.to_dict()


@pytest.mark.parametrize(
    "full_rank, bound",
    [(True, -5.0), (False, None), (False, -5.0), (True, None)],
)
def test_a_log_layout_follows_the_gate_projection(tmp_path, full_rank, bound):
    """A_log is written in the layout of the KDA class the engines build from use_full_rank_gate (K3's zero-padded
    1-D vector, Kimi Linear's [1, 1, H, 1]), and loads back to the same model; gate combinations outside the two
    releases get a note from engine_notes."""
    from safetensors import safe_open

    from openk3.checkpoint import engine_notes

    m = _model(use_full_rank_gate=full_rank, gate_lower_bound=bound)
    cfg = m.config
    m.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        a = f.get_tensor("model.layers.0.self_attn.A_log")
    H = cfg.kda_num_heads
    if full_rank:
        assert a.shape == (max(H, cfg.kda_head_dim),) and torch.all(a[H:] == 0)
    else:
        assert a.shape == (1, 1, H, 1)
    back = K3ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 11))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)
    gate_notes = [n for n in engine_notes(cfg) if n.startswith("KDA gate")]
    assert bool(gate_notes) == ((bound is None) == full_rank), gate_notes
    if gate_notes and not full_rank:
        assert "softplus" in gate_notes[0]


def test_engine_notes_of_the_releases():
    """No note for the two released layouts' gates; K3's features are named for SGLang, none for Kimi Linear."""
    from openk3.checkpoint import engine_notes

    assert engine_notes(get_preset("kimi-linear-48b")) == []
    notes = engine_notes(get_preset("k3"))
    assert len(notes) == 1 and notes[0].startswith("K3 features (SiTU, AttnRes, latent MoE, MLA output gate")
    plain = get_preset(
        "tiny",
        hidden_act="silu",
        attn_res_block_size=None,
        routed_expert_hidden_size=None,
        mla_use_output_gate=False,
        q_lora_rank=None,
        use_full_rank_gate=False,
        gate_lower_bound=None,
    )
    assert engine_notes(plain) == []
    notes = engine_notes(plain.replace(attn_res_block_size=2))
    assert len(notes) == 1 and notes[0].startswith("K3 features (AttnRes):"), notes


def test_bf16_load_keeps_fp32_params(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    back = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    kda = back.model.layers[0].self_attn
    assert kda.A_log.dtype == torch.float32 and kda.q_conv1d.weight.dtype == torch.float32
    assert kda.q_proj.weight.dtype == torch.bfloat16
    back.save_pretrained(tmp_path / "bf16")  # the matmul weights' dtype, not that of the fp32 islands
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert K3ForCausalLM.from_pretrained(tmp_path / "bf16").config.to_dict() == tiny.config.to_dict()
    ids = torch.randint(0, tiny.config.vocab_size, (1, 9))
    assert torch.isfinite(back(ids).logits).all()


def test_gradients_reach_every_parameter():
    m = _model(attn_res_init="normal").train()
    ids = torch.randint(0, m.config.vocab_size, (2, 24))
    m(ids, labels=ids).loss.backward()
    # layer 0's pre-attention read has no sealed block yet (it reads the embedding alone): unused by design
    unused = {
        "model.layers.0.self_attention_res_norm.weight",
        "model.layers.0.self_attention_res_proj.weight",
    }
    dead = [
        n for n, p in m.named_parameters() if n not in unused and (p.grad is None or p.grad.abs().sum() == 0)
    ]
    assert not dead, dead


def test_param_counts_of_releases():
    with torch.device("meta"):
        k3 = K3ForCausalLM(get_preset("k3"))
        kl = K3ForCausalLM(get_preset("kimi-linear-48b"))
    assert round(k3.num_parameters() / 1e12, 4) == 2.7795
    assert round(k3.num_active_parameters() / 1e9, 2) == 104.19
    assert 47e9 < kl.num_parameters() < 50e9 and 2.8e9 < kl.num_active_parameters() < 3.2e9
    assert k3.config.layer_types.count("mla") == 24 and k3.config.layer_types[91:] == ["mla", "mla"]


def test_tiny_preset_covers_everything():
    c = get_preset("tiny")
    with torch.device("meta"):
        m = K3ForCausalLM(c)
    assert m.num_parameters() < 2_000_000
    assert {"kda", "mla"} <= set(c.layer_types)
    assert c.num_hidden_layers // c.attn_res_block_size >= 2
    assert c.first_k_dense_replace == 1 and c.use_latent_moe and c.num_shared_experts >= 1


@pytest.mark.parametrize(
    "bad, msg",
    [
        (lambda m: m(torch.randint(0, 10, (5,))), "batch, seq_len"),
        (lambda m: m(torch.full((1, 4), m.config.vocab_size)), "vocab_size"),
        (lambda m: m(torch.full((1, 4), -1)), "vocab_size"),
        (lambda m: m(torch.rand(1, 4)), "integer"),
        (lambda m: m(torch.zeros(1, 6, dtype=torch.long) + 1, cu_seqlens=torch.tensor([1, 6])), "start at 0"),
        (
            lambda m: m(torch.zeros(1, 6, dtype=torch.long) + 1, cu_seqlens=torch.tensor([0, 4, 3, 6])),
            "increasing",
        ),
        (lambda m: m(torch.zeros(1, 6, dtype=torch.long) + 1, cu_seqlens=torch.tensor([0, 5])), "end at"),
        (
            lambda m: m(torch.zeros(2, 6, dtype=torch.long) + 1, cu_seqlens=torch.tensor([0, 6])),
            "batch size 1",
        ),
        (lambda m: m(torch.zeros(1, 6, dtype=torch.long) + 1, cu_seqlens=torch.tensor([[0, 6]])), "1-D"),
        # loss targets out of range: on CUDA a device-side assert inside cross-entropy, so refused up front
        (
            lambda m: m(torch.ones(1, 6, dtype=torch.long), labels=torch.full((1, 6), m.config.vocab_size)),
            "labels",
        ),
        (lambda m: m(torch.ones(1, 6, dtype=torch.long), labels=torch.full((1, 6), -2)), r"or be -100"),
        (lambda m: m(torch.ones(1, 6, dtype=torch.long), targets=torch.full((1, 6), 1e9).long()), "targets"),
        (lambda m: m(torch.ones(1, 6, dtype=torch.long), targets=torch.ones(1, 6)), "integer tensor"),
    ],
)
def test_bad_inputs(tiny, bad, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        bad(tiny)


def test_checkpoint_errors(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    # config that does not match the weights
    cfg = K3Config.from_pretrained(tmp_path)
    cfg.replace(hidden_size=64).save_pretrained(tmp_path / "other")
    os.link(tmp_path / "model.safetensors", tmp_path / "other" / "model.safetensors")
    with pytest.raises(CheckpointError, match="wrong shapes"):
        K3ForCausalLM.from_pretrained(tmp_path / "other")
    # missing / unexpected keys
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.norm.weight")
    sd["model.bogus.weight"] = torch.zeros(3)
    (tmp_path / "mk").mkdir()
    save_file(sd, tmp_path / "mk" / "model.safetensors")
    cfg.save_pretrained(tmp_path / "mk")
    with pytest.raises(CheckpointError, match=r"missing keys.*model\.norm\.weight.*unexpected keys.*bogus"):
        K3ForCausalLM.from_pretrained(tmp_path / "mk")
    # an integer tensor for a floating-point weight: refused, not cast
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int64)
    (tmp_path / "it").mkdir()
    save_file(sd, tmp_path / "it" / "model.safetensors")
    cfg.save_pretrained(tmp_path / "it")
    with pytest.raises(
        CheckpointError, match=r"non-floating-point.*model\.norm\.weight: checkpoint torch\.int64"
    ):
        K3ForCausalLM.from_pretrained(tmp_path / "it")
    # truncated file
    (tmp_path / "tr").mkdir()
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "tr" / "model.safetensors").write_bytes(data[: len(data) // 2])
    cfg.save_pretrained(tmp_path / "tr")
    with pytest.raises(CheckpointError, match="cannot read"):
        K3ForCausalLM.from_pretrained(tmp_path / "tr")
    # pickles are refused, never loaded
    (tmp_path / "pk").mkdir()
    (tmp_path / "pk" / "pytorch_model.bin").write_bytes(b"not loaded")
    cfg.save_pretrained(tmp_path / "pk")
    with pytest.raises(CheckpointError, match="never unpickles|pickled"):
        K3ForCausalLM.from_pretrained(tmp_path / "pk")
    with pytest.raises(FileNotFoundError):
        K3ForCausalLM.from_pretrained(tmp_path / "nope")


def test_generate_greedy_matches_argmax(tiny):
    # fixed inputs: the cached decode and the full forward agree to fp32 rounding, so unseeded random weights and
    # ids could (rarely) put two logits within that noise and flip the argmax
    ids = torch.randint(0, tiny.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    out = tiny.generate(ids, max_new_tokens=6)
    assert out.shape == (2, 11)
    with torch.no_grad():
        logits = tiny(out[:, :-1]).logits
    assert torch.equal(logits[:, 4:].argmax(-1), out[:, 5:])


def _quantize_mxfp4(w: torch.Tensor):
    """Independent MXFP4 encoder for the test: per 32 inputs a power-of-two scale, values rounded to E2M1."""
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    out, n = w.shape
    blocks = w.view(out, n // 32, 32)
    amax = blocks.abs().amax(-1).clamp_min(1e-30)
    e = torch.floor(torch.log2(amax)) - 2  # 6 * 2^e covers amax
    x = blocks / torch.exp2(e).unsqueeze(-1)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    code = (idx | ((x < 0).long() << 3)).view(out, n).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    deq = (mags[idx] * torch.where(x < 0, -1.0, 1.0) * torch.exp2(e).unsqueeze(-1)).view(out, n)
    return packed, (e + 127).to(torch.uint8), deq


def test_mxfp4_expert_weights_dequantised_on_load(tmp_path, rel):
    from safetensors.torch import load_file, save_file

    tiny = _model(moe_intermediate_size=64, routed_expert_hidden_size=64)  # group-32 friendly widths
    tiny.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    expect = {}
    for k in [k for k in sd if ".experts." in k]:
        packed, scale, deq = _quantize_mxfp4(sd.pop(k).float())
        base = k[: -len(".weight")]
        sd[base + ".weight_packed"], sd[base + ".weight_scale"] = packed, scale
        expect[k] = deq
    save_file(sd, tmp_path / "model.safetensors")
    m = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    w1 = m.model.layers[1].block_sparse_moe.experts.w1
    assert torch.equal(w1[3], expect["model.layers.1.block_sparse_moe.experts.3.w1.weight"])
    assert rel(w1[3], tiny.model.layers[1].block_sparse_moe.experts.w1[3]) < 0.2  # 4-bit rounding only
    ids = torch.randint(0, tiny.config.vocab_size, (1, 8))
    assert torch.isfinite(m(ids).logits).all()
    # a packed tensor without its scale is reported
    sd.pop("model.layers.2.block_sparse_moe.experts.0.w2.weight_scale")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="without their pair"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_latent_moe_at_the_hidden_size_keeps_its_projections():
    """routed_expert_hidden_size equal to hidden_size is still the latent path (down / up projections and the norm),
    as the release's code builds it; only None is the plain MoE."""
    cfg = get_preset("tiny", routed_expert_hidden_size=96)
    assert cfg.hidden_size == 96 and cfg.use_latent_moe
    moe = K3ForCausalLM(cfg).model.layers[1].block_sparse_moe
    assert moe.routed_expert_down_proj.weight.shape == (96, 96) and moe.routed_expert_norm is not None
    plain = K3ForCausalLM(get_preset("tiny", routed_expert_hidden_size=None)).model.layers[1].block_sparse_moe
    assert not hasattr(plain, "routed_expert_down_proj")
