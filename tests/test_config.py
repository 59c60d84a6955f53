"""K3Config: presets, JSON formats in and out, validation messages."""

import json

import pytest

from openk3 import ConfigError, K3Config, get_preset


def _released_k3_json():
    """The structure of the released Kimi K3 config.json (multimodal wrapper; text tower fields as in SPEC.md §7.1)."""
    full = [4 * i for i in range(1, 24)] + [93]
    text = {
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": 12,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "first_k_dense_replace": 1,
        "hidden_act": "situ",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 33792,
        "kv_lora_rank": 512,
        "latent_moe_use_norm": True,
        "linear_attn_config": {
            "full_attn_layers": full,
            "gate_lower_bound": -5.0,
            "head_dim": 128,
            "kda_layers": [i for i in range(1, 94) if i not in full],
            "num_heads": 96,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
        "max_position_embeddings": 1048576,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "model_type": "kimi_linear",
        "moe_intermediate_size": 3072,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 96,
        "num_expert_group": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_hidden_layers": 93,
        "num_key_value_heads": 96,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": 2,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05,
        "routed_expert_hidden_size": 3584,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "v_head_dim": 128,
        "vocab_size": 163840,
        "quantization_config": {"format": "mxfp4-pack-quantized"},
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {"vt_hidden_size": 1024},
    }


def test_release_config_equals_k3_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_released_k3_json()))
    cfg = K3Config.from_pretrained(tmp_path)
    preset = get_preset("k3")
    assert cfg.to_dict() == preset.to_dict()
    # flat text config works too, and save -> load round-trips
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "config.json").write_text(json.dumps(_released_k3_json()["text_config"]))
    assert K3Config.from_pretrained(tmp_path / "flat").to_dict() == preset.to_dict()
    cfg.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        saved["linear_attn_config"]["full_attn_layers"]
        == _released_k3_json()["text_config"]["linear_attn_config"]["full_attn_layers"]
    )
    assert K3Config.from_pretrained(tmp_path / "out").to_dict() == preset.to_dict()


def test_kimi_linear_release_config(tmp_path):
    d = {
        "model_type": "kimi_linear",
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "intermediate_size": 9216,
        "vocab_size": 163840,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 1024,
        "routed_scaling_factor": 2.446,
        "hidden_act": "silu",
        "first_k_dense_replace": 1,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = K3Config.from_pretrained(tmp_path)
    assert cfg.kda_gate_kind == "softplus" and not cfg.use_full_rank_gate and not cfg.use_attn_res
    assert not cfg.use_latent_moe and not cfg.mla_use_output_gate and cfg.q_lora_rank is None
    assert cfg.to_dict() == get_preset("kimi-linear-48b").to_dict()


@pytest.mark.parametrize(
    "over, msg",
    [
        (dict(kda_layers=[1, 2, 3], full_attn_layers=[4, 5, 6, 7]), "missing"),
        (dict(kda_layers=[1, 2, 3, 4, 5, 6], full_attn_layers=[4, 7, 8]), "listed twice"),
        (dict(kda_layers=[0, 1, 2, 3, 5, 6], full_attn_layers=[4, 7, 8]), "1-based"),
        (dict(routed_expert_hidden_size=200), "must not exceed hidden_size"),
        (dict(num_experts_per_token=9), "must not exceed num_experts"),
        (dict(gate_lower_bound=-12.0), r"\[-10, 0\)"),
        (dict(gate_lower_bound=0.0), r"\[-10, 0\)"),
        (dict(num_key_value_heads=2), "must divide num_attention_heads"),
        (dict(num_expert_group=3), "must divide num_experts"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(hidden_size=0), "positive integer"),
        (dict(attn_res_block_size=0), "positive integer"),
        (dict(first_k_dense_replace=99), "first_k_dense_replace"),
        # types and non-finite values: each a ConfigError naming the field, never a TypeError or a silent NaN model
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a finite number"),
        (dict(mla_latent_norm_eps=float("inf")), "mla_latent_norm_eps must be a finite number"),
        (dict(mla_latent_norm_eps=0.0), r"mla_latent_norm_eps must be > 0"),
        (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor must be a finite number"),
        (dict(activation_situ_beta=float("nan")), "activation_situ_beta must be a finite number"),
        (dict(initializer_range=-0.02), r"initializer_range must be >= 0"),
        (dict(gate_lower_bound=float("nan")), r"\[-10, 0\)"),
        (dict(gate_lower_bound="-5"), r"\[-10, 0\)"),
        (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
        (dict(mla_use_output_gate=1), "mla_use_output_gate must be true or false"),
        (dict(max_position_embeddings=-1), "max_position_embeddings must be a positive integer"),
        (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers must be an integer >= 0"),
        (
            dict(kda_layers="1,2,3", full_attn_layers=[4]),
            "kda_layers must be a list of 1-based layer numbers",
        ),
        (dict(kda_layers=[1, 2, 3], full_attn_layers=[4.0]), "full_attn_layers must be a list"),
        (dict(bos_token_id="1"), "bos_token_id must be an integer token id"),
        (dict(eos_token_id=[1, "2"]), "eos_token_id must be an integer token id"),
        (dict(eos_token_id=[]), "eos_token_id must be an integer token id"),
        (dict(kda_init="xavier"), "kda_init must be one of"),
        (dict(topk_method="greedy"), "topk_method 'greedy' is not supported"),
        (dict(num_experts=8, num_expert_group=2, topk_group=2, use_grouped_topk=False), "ambiguous"),
        (dict(model_type=3), "model_type must be a string"),
    ],
)
def test_validation_messages(over, msg):
    with pytest.raises(ConfigError, match=msg):
        get_preset("tiny", **over)


def test_unknown_preset_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("k9")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        K3Config.from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize(
    "d, msg",
    [
        ({"linear_attn_config": [1, 2]}, "linear_attn_config must be a JSON object"),
        ({"linear_attn_config": {"kda_layers": "1,2", "full_attn_layers": [3]}}, "kda_layers must be a list"),
        (
            {
                "linear_attn_config": {
                    "kda_layers": [1, 2],
                    "full_attn_layers": [3],
                    "use_full_rank_gate": "no",
                }
            },
            "use_full_rank_gate must be true or false",
        ),
        ({"num_hidden_layers": "27"}, "num_hidden_layers must be a positive integer"),
        (
            {"num_hidden_layers": 2, "layer_types": "linear_attention"},
            "layer_types must be a list of strings",
        ),
        (
            {"num_hidden_layers": 2, "layer_types": ["full_attention", "mamba"]},
            r"unknown entries \['mamba'\]",
        ),
        ({"num_hidden_layers": 2, "mlp_layer_types": ["dense", "moe"]}, r"unknown entries \['moe'\]"),
    ],
)
def test_bad_config_json_values(tmp_path, d, msg):
    """A config.json whose values have the wrong type gets a ConfigError that names the field (a released config
    writes true / false and integer lists; a string such as "false" must not be read as true)."""
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=msg):
        K3Config.from_pretrained(tmp_path)


def test_transformers_format_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    c = transformers.KimiLinearConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=9,
        num_attention_heads=2,
        num_key_value_heads=2,
        linear_num_heads=2,
        linear_head_dim=16,
        moe_intermediate_size=16,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    c.save_pretrained(tmp_path)
    cfg = K3Config.from_pretrained(tmp_path)
    assert cfg.full_attn_layers == [i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention"]
    assert cfg.num_experts == 4 and cfg.num_experts_per_token == 2 and cfg.hidden_act == "silu"


def test_first_layers():
    """first_layers(n): the first n decoder layers of a config, each of its own type, the dense prefix kept; the
    cut config is valid and its parameter count falls with n. Bad n is refused with a clear message."""
    from openk3.config import ConfigError, get_preset

    full = get_preset("kimi-linear-48b")
    for n in (1, 4, 13, 16, 27):
        cut = full.replace(**full.first_layers(n))
        assert cut.num_hidden_layers == n and cut.layer_types == full.layer_types[:n]
        assert cut.first_k_dense_replace == min(full.first_k_dense_replace, n)
        assert [cut.is_moe_layer(i) for i in range(n)] == [full.is_moe_layer(i) for i in range(n)]
    k3 = get_preset("k3")
    assert k3.replace(**k3.first_layers(93)) == k3
    for bad in (0, 28, -1, 2.0, True, "4"):
        with pytest.raises(ConfigError, match=r"first_layers: n must be an integer in \[1, 27\]"):
            full.first_layers(bad)


_K3_ONLY = (
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "activation_situ_beta",
    "activation_situ_linear_beta",
)


def test_export_matches_released_text_configs(tmp_path):
    """save_pretrained writes the released text config: every field of the released K3 text config with its value,
    and for a Kimi Linear model every field of that release without the K3-only fields whose feature is off (a
    reader that takes a present SiTU beta or latent width as the switch then sees the plain model)."""
    released = _released_k3_json()["text_config"]
    get_preset("k3").save_pretrained(tmp_path / "k3")
    saved = json.loads((tmp_path / "k3" / "config.json").read_text())
    for k, v in released.items():
        if k != "quantization_config":
            assert saved.get(k) == v, (k, saved.get(k), v)
    kl = get_preset("kimi-linear-48b")
    kl.save_pretrained(tmp_path / "kl")
    saved = json.loads((tmp_path / "kl" / "config.json").read_text())
    assert not set(_K3_ONLY) & set(saved), sorted(set(_K3_ONLY) & set(saved))
    assert saved["hidden_act"] == "silu" and saved["mla_use_output_gate"] is False
    assert "gate_lower_bound" not in saved["linear_attn_config"]
    assert K3Config.from_pretrained(tmp_path / "kl").to_dict() == kl.to_dict()


@pytest.mark.parametrize(
    "over",
    [
        {"hidden_act": "silu"},
        {"attn_res_block_size": None},
        {"routed_expert_hidden_size": None},
        {"routed_expert_hidden_size": 96},  # the hidden size: still latent (projections and norm)
        {"hidden_act": "silu", "attn_res_block_size": None, "routed_expert_hidden_size": None},
        {"latent_moe_use_norm": False},
        {"activation_situ_beta": 2.0, "activation_situ_linear_beta": 7.0},
    ],
)
def test_config_round_trip_with_features_off(tmp_path, over):
    """Each K3 switch turned off (or changed) survives save -> load: an omitted field is read back as off, a
    present one as written."""
    cfg = get_preset("tiny", **over)
    assert cfg.hidden_size == 96
    cfg.save_pretrained(tmp_path)
    back = K3Config.from_pretrained(tmp_path)
    assert back.to_dict() == cfg.to_dict()
    assert (back.hidden_act, back.use_attn_res, back.use_latent_moe) == (
        cfg.hidden_act,
        cfg.use_attn_res,
        cfg.use_latent_moe,
    )
    if cfg.hidden_act == "situ":
        assert (back.activation_situ_beta, back.activation_situ_linear_beta) == (
            cfg.activation_situ_beta,
            cfg.activation_situ_linear_beta,
        )


def test_newer_transformers_fields(tmp_path):
    """transformers' newer KimiLinearConfig writes attn_res_block_size 0 for "off" and may name the dense layers'
    width dense_ffn_hidden (intermediate_size where it is unset)."""
    d = get_preset("kimi-linear-48b").to_dict()
    d["attn_res_block_size"] = 0
    d["dense_ffn_hidden"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = K3Config.from_pretrained(tmp_path)
    assert cfg.attn_res_block_size is None and not cfg.use_attn_res
    assert cfg.intermediate_size == 4096
    d["dense_ffn_hidden"] = None
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert (
        K3Config.from_pretrained(tmp_path).intermediate_size
        == get_preset("kimi-linear-48b").intermediate_size
    )
    for bad in ("4096", 0, 2.5):
        d["dense_ffn_hidden"] = bad
        (tmp_path / "config.json").write_text(json.dumps(d))
        with pytest.raises(ConfigError, match="dense_ffn_hidden"):
            K3Config.from_pretrained(tmp_path)
    d["dense_ffn_hidden"] = None
    d["attn_res_block_size"] = -1
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="attn_res_block_size"):
        K3Config.from_pretrained(tmp_path)
