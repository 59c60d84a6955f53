"""Analytic cost model (openk3.cost) and the ``openk3 cost`` command."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from openk3 import cost
from openk3.config import PRESETS, ConfigError, get_preset
from openk3.cost_cli import main as cost_main
from openk3.model import K3ForCausalLM

# ---------------------------------------------------------------------------------------------------------------
# parameters


def test_k3_param_counts_match_release():
    cfg = get_preset("k3")
    pc = cost.param_counts(cfg)
    assert round(pc.total_params / 1e12, 4) == 2.7795
    assert round(pc.active_params / 1e9, 2) == 104.19
    per = pc.per_layer
    assert round(per["kda_layer"] / 1e6, 1) == 443.7
    assert round(per["mla_layer"] / 1e6, 1) == 232.2
    assert round(per["routed_expert"] / 1e6, 2) == 33.03
    assert round(per["moe_layer"] / 1e9, 2) == 29.78
    assert round(per["moe_router"] / 1e6, 1) == 6.4
    assert round(per["moe_latent"] / 1e6, 1) == 51.4
    assert round(per["moe_shared"] / 1e6, 1) == 132.1
    assert round(per["dense_ffn_layer"] / 1e6, 1) == 726.7
    assert round(pc.total["embedding"] / 1e9, 3) == 1.174
    assert round(pc.total["lm_head"] / 1e9, 3) == 1.174
    assert round(pc.total["attn_res"] / 1e6, 1) == 2.7
    assert pc.layers == {"kda": 69, "mla": 24, "moe": 92, "dense": 1}


def _component(name: str, cfg) -> str:
    """Map a parameter name of the real model onto a cost-model component."""
    if name.startswith("lm_head"):
        return "lm_head"
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if "attn_res" in name or "_res_norm" in name or "_res_proj" in name:
        return "attn_res"
    if name == "model.norm.weight" or "input_layernorm" in name or "post_attention_layernorm" in name:
        return "norms"
    layer = int(name.split(".")[2])
    if ".self_attn." in name:
        return cfg.layer_types[layer]
    if ".mlp." in name:
        return "dense_ffn"
    if ".experts." in name:
        return "moe_routed"
    if ".shared_experts." in name:
        return "moe_shared"
    if ".routed_expert_" in name:
        return "moe_latent"
    if ".gate." in name:
        return "router"
    raise AssertionError(f"unclassified parameter {name}")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_param_counts_equal_real_modules(preset):
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    pc = cost.param_counts(cfg)
    assert pc.total_params == model.num_parameters()
    assert pc.active_params == model.num_active_parameters()
    by_comp: dict[str, int] = dict.fromkeys(pc.total, 0)
    for name, p in model.named_parameters():
        by_comp[_component(name, cfg)] += p.numel()
    assert by_comp == pc.total


# ---------------------------------------------------------------------------------------------------------------
# FLOPs against torch's FLOP counter


@pytest.mark.parametrize(
    "preset,batch,seq_len",
    [
        ("tiny", 2, 8),  # KDA token recurrence (T <= 16)
        ("tiny", 2, 64),  # KDA chunked form, one full chunk
        ("tiny", 1, 100),  # two chunks, the last one padded
        ("small", 1, 64),
    ],
)
def test_flops_match_flop_counter(preset, batch, seq_len):
    """The analytic count of what the counter can see equals FlopCounterMode on the reference model.
    Invisible to the counter (documented in reference_counted_flops): elementwise work, the KDA token
    recurrence and the chunk form's triangular solve, the AttnRes reads (broadcast multiply + sum), the embedding
    gather."""
    cfg = get_preset(preset)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(ids)
    measured = fc.get_total_flops()
    predicted = cost.reference_counted_flops(cfg, batch, seq_len).total
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)


@pytest.mark.parametrize("preset", ["tiny", "small", "k3"])
def test_per_token_weight_flops_agree_with_reference_count(preset):
    """flops_per_token and the counter-level count share every weight term (2 x active matmul weights)."""
    cfg = get_preset(preset)
    ref = cost.reference_counted_flops(cfg, 1, 32)
    pt = cost.flops_per_token(cfg, 32, "prefill")
    for k in (
        "kda_proj",
        "kda_conv",
        "mla_proj",
        "dense_ffn",
        "moe_routed",
        "moe_shared",
        "moe_latent",
        "router",
    ):
        assert pt[k] * 32 == pytest.approx(ref[k], rel=1e-12), k
    # non-embedding active params x 2 = the weight FLOPs (what the "2N" rule counts)
    pc = cost.param_counts(cfg)
    weight = sum(pt[k] for k in pt.parts if k not in ("kda_conv", "kda_state", "mla_attn", "attn_res"))
    HK = cfg.kda_num_heads * cfg.kda_head_dim
    kda_vectors = 3 * HK * cfg.short_conv_kernel_size + HK + cfg.kda_num_heads + cfg.kda_head_dim
    non_matmul = pc.active["attn_res"] + pc.active["norms"] + pc.layers["kda"] * kda_vectors
    non_matmul += pc.layers["mla"] * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank)
    if cfg.use_latent_moe and cfg.latent_moe_use_norm:
        non_matmul += pc.layers["moe"] * cfg.moe_width  # routed_expert_norm
    assert weight == 2 * (pc.active_params - non_matmul)


def test_flops_context_scaling():
    cfg = get_preset("k3")
    a, b = cost.flops_per_token(cfg, 4095, "decode"), cost.flops_per_token(cfg, 8191, "decode")
    assert b["mla_attn"] == pytest.approx(2 * a["mla_attn"])  # linear in context (c + 1 keys)
    assert b["kda_state"] == a["kda_state"]  # constant
    p = cost.flops_per_token(cfg, 4096, "prefill")
    t = cost.flops_per_token(cfg, 4096, "train")
    assert t.total == pytest.approx(3 * p.total)
    assert cost.train_flops_per_token(cfg, 4096) == t.total
    assert t.total > 6 * (cost.param_counts(cfg).active_params - cfg.vocab_size * cfg.hidden_size)
    with pytest.raises(ConfigError):
        cost.flops_per_token(cfg, 10, "generate")


def test_attn_res_sources():
    src = cost.attn_res_read_sources(get_preset("k3"))
    assert len(src) == 2 * 93 + 1
    assert max(src) == 9 and src[-1] == 9
    assert src[:3] == [1, 2, 2]  # layer 0 has no pre-read
    assert cost.attn_res_read_sources(get_preset("kimi-linear-48b")) == []


# ---------------------------------------------------------------------------------------------------------------
# HBM bytes, cache, network


def test_expected_experts_touched():
    assert cost.expected_experts_touched(896, 16, 1) == pytest.approx(16)
    assert cost.expected_experts_touched(896, 16, 10**6) == pytest.approx(896)
    assert cost.expected_experts_touched(896, 16, 0) == 0
    torch.manual_seed(0)
    b, N, K = 64, 64, 8
    hits = [len(torch.cat([torch.randperm(N)[:K] for _ in range(b)]).unique()) for _ in range(200)]
    assert sum(hits) / len(hits) == pytest.approx(cost.expected_experts_touched(N, K, b), rel=0.02)


def test_decode_step_bytes_k3():
    cfg = get_preset("k3")
    one = cost.decode_step_bytes(cfg, 1, 4096, expert_dtype="mxfp4")
    assert one.experts_touched_per_layer == pytest.approx(16)
    assert one.parts["expert_weights"] == pytest.approx(92 * 16 * 3 * 3072 * 3584 * 0.53125)
    assert one.parts["mla_cache_read"] == 4096 * 24 * 576 * 2
    assert one.parts["kda_state"] == 2 * 69 * 96 * 128 * 128 * 4
    big = cost.decode_step_bytes(cfg, 256, 4096, expert_dtype="mxfp4")
    assert big.parts["dense_weights"] == one.parts["dense_weights"]  # read once per step
    assert big.parts["kda_state"] == 256 * one.parts["kda_state"]
    assert big.experts_touched_per_layer == pytest.approx(896 * (1 - (1 - 16 / 896) ** 256))
    longer = cost.decode_step_bytes(cfg, 1, 8192)
    assert longer.parts["mla_cache_read"] == 2 * one.parts["mla_cache_read"]
    assert longer.parts["kda_state"] == one.parts["kda_state"]


def test_cache_crossover():
    cfg = get_preset("k3")
    cb = cost.cache_bytes(cfg, 1 << 20)
    assert cb.mla_per_token == 27648  # SPEC.md §2.5
    assert cb.kda_state == 69 * 96 * 128 * 128 * 4  # 434 MB (SPEC.md §1.5)
    assert round(cb.layer_crossover_length) == 5461  # one KDA layer ~ 5.4k tokens of one MLA layer
    x = cost.crossover_length(cfg)
    assert (
        cost.cache_bytes(cfg, math.floor(x)).mla
        < cb.kda_state + cb.kda_conv
        <= cost.cache_bytes(cfg, math.ceil(x) + 1).mla
    )
    assert cost.crossover_length(get_preset("k2-like")) == 0  # no KDA state at all
    sm = cost.serving_memory(cfg, 8, 4096, ep_ranks=64, tp=8, expert_dtype="mxfp4")
    assert sm.fits and sm.weights > 1.4e12


def test_ep_comm_identities():
    k3, k2 = get_preset("k3"), get_preset("k2-like")
    a = cost.ep_comm(k3, 4096, 64, "h200", act_dtype="bf16")
    b = cost.ep_comm(k2, 4096, 64, "h200", act_dtype="bf16")
    # K' l = K d: K3's 16 x 3584 latent dispatch equals K2's 8 x 7168 full-width dispatch
    assert a.bytes_per_token == b.bytes_per_token == 2 * 8 * 7168 * 2
    assert a.bytes_domain == 2 * 4096 * 16 * 3584 * 2
    assert a.tokens_per_expert == pytest.approx(4096 * 16 / 896)
    # compute-bound limit of comm/compute: b_act F / (3 m B_net); fp8 activations give F / (3 m B_net)
    h = cost.get_hardware("h200")
    huge = cost.ep_comm(k3, 10**7, 64, h, act_dtype="fp8")
    assert huge.bound in ("compute-bound", "network-bound")
    assert huge.ratio == pytest.approx(h.flops / (3 * 3072 * h.ib_bw), rel=1e-9)
    assert huge.ratio == pytest.approx(huge.ratio_limit)
    small = cost.ep_comm(k3, 1, 64, h)
    assert small.bound == "HBM-bound" and small.arithmetic_intensity < huge.arithmetic_intensity


def test_latent_alpha_invariances():
    k2 = get_preset("k2-like")
    pc1 = cost.param_counts(k2)
    (_, a1), (_, a2), (_, a4) = cost.sweep_configs(k2, "latent_alpha", ["1", "2", "4"], "acc")
    assert a1.num_experts == k2.num_experts and a1.routed_expert_hidden_size is None
    for c, alpha in ((a2, 2), (a4, 4)):
        assert c.moe_width == k2.hidden_size // alpha
        assert (
            c.num_experts == k2.num_experts * alpha
            and c.num_experts_per_token == k2.num_experts_per_token * alpha
        )
        assert c.num_experts * c.moe_width == k2.num_experts * k2.hidden_size  # N' l = N d
        assert cost.param_counts(c).total["moe_routed"] == pc1.total["moe_routed"]
        assert cost.ep_comm(c, 1, 8).bytes_per_token == cost.ep_comm(k2, 1, 8).bytes_per_token  # K' l = K d
    (_, e2), (_, e4) = cost.sweep_configs(k2, "latent_alpha", ["2", "4"], "eff")
    assert e2.num_experts == k2.num_experts and e2.num_experts_per_token == k2.num_experts_per_token
    assert cost.param_counts(e4).total["moe_routed"] * 4 == pc1.total["moe_routed"]
    assert cost.ep_comm(e2, 1, 8).bytes_per_token * 2 == cost.ep_comm(k2, 1, 8).bytes_per_token
    # K3 is the alpha = 2 "acc" member of the family of its alpha = 1 design (448 experts, top-8, full width)
    k3 = get_preset("k3")
    (_, k3a1), (_, k3a2) = cost.sweep_configs(k3, "latent_alpha", ["1", "2"], "acc")
    assert (k3a1.num_experts, k3a1.num_experts_per_token, k3a1.moe_width) == (448, 8, 7168)
    assert (k3a2.num_experts, k3a2.num_experts_per_token, k3a2.moe_width) == (896, 16, 3584)
    assert cost.param_counts(k3a1).total["moe_routed"] == cost.param_counts(k3).total["moe_routed"]


def test_mla_split_sweep():
    k3 = get_preset("k3")
    pairs = cost.sweep_configs(k3, "mla_split", ["512:64", "480:96", "576:0"])
    assert [(c.kv_lora_rank, c.qk_rope_head_dim) for _, c in pairs] == [(512, 64), (480, 96), (576, 0)]
    per_tok = {cost.cache_bytes(c, 1).mla_per_token for _, c in pairs}
    assert per_tok == {27648}
    assert cost.param_counts(pairs[0][1]).total_params == cost.param_counts(k3).total_params
    with pytest.raises(ConfigError):
        cost.sweep_configs(k3, "mla_split", ["512-64"])
    with pytest.raises(ConfigError):
        cost.sweep_configs(k3, "no_such_field", ["1"])


def test_step_time_and_regimes():
    med = get_preset("medium")
    st = cost.step_time(med, 1, 4096, "h200-measured")
    assert st.bound == "HBM-bound"
    assert st.t_step == pytest.approx(st.bytes_per_rank / 4.2e12)
    assert cost.predict_decode_time(med, 1, 4096) == st.t_step
    # decode stays HBM-bound at any batch for `medium` (fp32 KDA state traffic per sequence); prefill is not
    assert cost.step_time(med, 1 << 16, 16, "h200-measured").bound == "HBM-bound"
    assert cost.step_time(med, 8, 4096, "h200-measured", mode="prefill").bound == "compute-bound"
    k3 = get_preset("k3")
    ep = cost.step_time(k3, 256, 4096, "h200", ep_ranks=64, tp=8, expert_dtype="mxfp4")
    assert ep.t_net > 0 and ep.t_step >= max(ep.t_hbm, ep.t_compute, ep.t_net)
    serial = cost.step_time(k3, 256, 4096, "h200", ep_ranks=64, tp=8, overlap=False)
    assert serial.t_step == pytest.approx(max(serial.t_hbm, serial.t_compute) + serial.t_net)
    with pytest.raises(ConfigError):
        cost.step_time(k3, 1, 1, ep_ranks=6, tp=4)
    pre = cost.step_time(med, 4, 2048, mode="prefill")
    assert pre.tokens == 8192 and pre.bytes_parts["mla_cache_read"] == 0
    tab = cost.regime_table(med, [1, 64, 4096], cost.Workload(ep_ranks=8))
    assert [r[0] for r in tab.rows] == [1, 64, 4096]
    assert tab.rows[0][7] == "HBM-bound"


def test_hardware_and_dtypes():
    assert cost.DTYPE_BYTES["mxfp4"] == 0.53125
    h = cost.get_hardware("custom:flops=800T,hbm=4.2T,net=50G")
    assert (h.flops, h.hbm_bw, h.net_bw("auto", 64)) == (800e12, 4.2e12, 50e9)
    assert cost.get_hardware("b200").nvlink_bw == 900e9
    assert cost.get_hardware("h200").net_bw("auto", 8) == 450e9
    assert cost.get_hardware("h200").net_bw("auto", 16) == 50e9
    for bad in ("a100", "custom:hbm=1T", "custom:flops=x,hbm=1"):
        with pytest.raises(ConfigError):
            cost.get_hardware(bad)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _run(capsys, *argv):
    rc = cost_main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_report_formats(capsys, tmp_path):
    rc, out, _ = _run(capsys, "k3")
    assert rc == 0 and "2.7795 T" in out and "104.19 B" in out and "crossover" in out
    rc, out, _ = _run(capsys, "kimi-linear-48b", "--format", "markdown")
    assert rc == 0 and "| component |" in out
    rc, out, _ = _run(capsys, "tiny", "--format", "json", "--batch", "1,8")
    data = json.loads(out)
    assert data["tables"][0]["rows"][-1]["total"] == cost.param_counts(get_preset("tiny")).total_params
    cfg_dir = tmp_path / "ckpt"
    get_preset("small").save_pretrained(cfg_dir)
    rc, out, _ = _run(capsys, str(cfg_dir), "--format", "json", "--output", str(tmp_path / "o.json"))
    assert rc == 0 and json.loads((tmp_path / "o.json").read_text())["tables"]


def test_cli_compare_and_sweeps(capsys):
    rc, out, _ = _run(capsys, "--compare", "k2-like", "k3", "--format", "json")
    rows = {r["metric"]: r for r in json.loads(out)["tables"][0]["rows"]}
    assert rc == 0 and rows["K x W (all-to-all / token)"]["k3/k2-like"] == pytest.approx(1.0)
    rc, out, _ = _run(capsys, "k2-like", "--sweep", "latent_alpha=1,2,4", "--variant", "both")
    assert rc == 0 and "alpha=4 (acc)" in out and "alpha=4 (eff)" in out
    rc, out, _ = _run(capsys, "k3", "--sweep", "mla_split=512:64,480:96,576:0", "--format", "markdown")
    assert rc == 0 and "480:96" in out
    rc, out, _ = _run(capsys, "medium", "--sweep", "batch=1,8,64", "--sweep", "context=4k,1M", "--ep", "8")
    assert rc == 0 and "Serving regimes" in out and "1,048,576" in out
    rc, out, _ = _run(capsys, "k3", "--sweep", "num_experts_per_token=8,16")
    assert rc == 0 and "num_experts_per_token=8" in out


def test_cli_errors(capsys):
    for argv in (
        ["no-such-preset"],
        [],
        ["k3", "--hw", "tpu"],
        ["k3", "--sweep", "bogus=1"],
        ["k3", "--ep", "6", "--tp", "4"],
        ["tiny", "--set", "tie_word_embeddings=maybe"],  # not read as false
        ["tiny", "--set", "rms_norm_eps=nan"],
        ["tiny", "--set", "kda_layers=1"],
        ["tiny", "--set", "hidden_size=7.5"],
        ["k3", "--sweep", "num_experts="],
        ["k3", "--sweep", "num_experts=a,b"],
        ["k3", "--sweep", "latent_alpha=x"],
        ["k3", "--sweep", "latent_alpha=0"],  # was a ZeroDivisionError traceback
        ["k3", "--sweep", "latent_alpha=nan"],
    ):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2 and err.startswith("openk3 cost: error:") and err.count("\n") == 1, argv


def test_cli_plots(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rc, _, err = _run(capsys, "medium", "--plot", str(tmp_path), "--ep", "8")
    assert rc == 0
    rc, _, _ = _run(capsys, "k2-like", "--sweep", "latent_alpha=1,2", "--plot", str(tmp_path))
    rc, _, _ = _run(capsys, "--compare", "k2-like", "k3", "--plot", str(tmp_path))
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == 5, pngs
    assert all((tmp_path / p).stat().st_size > 10_000 for p in pngs)


@pytest.mark.parametrize("preset", ["k3", "kimi-linear-48b", "tiny"])
def test_cache_bytes_equal_the_engines_pool(preset):
    """The cost model's cache sizes are what the serving engine allocates: the MLA latent per token (bf16 cache)
    and the fp32 KDA state plus fp32 short-conv history per sequence."""
    from openk3.infer.cache import CacheLayout

    cfg = get_preset(preset)
    lay = CacheLayout.from_config(cfg)
    cb = cost.cache_bytes(cfg, 4096)
    assert cb.mla_per_token == lay.bytes_per_token(torch.bfloat16)
    assert cb.kda_state + cb.kda_conv == lay.bytes_per_sequence()
    db = cost.decode_step_bytes(cfg, 2, 4096)
    assert db.parts["kda_state"] + db.parts["kda_conv"] == 2 * 2 * lay.bytes_per_sequence()  # read + written
    assert db.dtypes["conv"] == "fp32"
