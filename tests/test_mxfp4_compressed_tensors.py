"""MXFP4 weights against compressed-tensors, the library whose ``mxfp4-pack-quantized`` format the K3 release
stores its routed experts in: its compressor writes the tensors, its decompressor is the oracle for ours."""

import json

import pytest
import torch

from openk3 import K3ForCausalLM, get_preset
from openk3.checkpoint import CheckpointError, check_quantization_config, dequantize_mxfp4

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales  # noqa: E402

ARGS = QuantizationArgs(
    num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype=torch.uint8
)
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)


def _ct_decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    st = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, SCHEME)
    return st["weight"]


def _ct_compress(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own path: E8M0 scales from each group's absolute max, then quantise and pack."""
    out, n = w.shape
    amax = w.view(out, n // 32, 32).abs().amax(-1).to(torch.bfloat16)
    e = generate_mx_scales(amax, num_bits=4).clamp(0, 254)
    scale = torch.exp2(e.float() - 127.0).to(torch.bfloat16)
    st = MXFP4PackedCompressor.compress({"weight": w.to(torch.bfloat16), "weight_scale": scale}, SCHEME)
    return st["weight_packed"], st["weight_scale"]


@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_equals_compressed_tensors_every_code_and_scale(seed):
    g = torch.Generator().manual_seed(seed)
    rows, n_in = 255, 256  # row r uses the E8M0 scale r somewhere, every nibble pair appears
    packed = torch.randint(0, 256, (rows, n_in // 2), dtype=torch.uint8, generator=g)
    packed[:, 0] = torch.arange(rows, dtype=torch.uint8)
    scale = torch.randint(0, 255, (rows, n_in // 32), dtype=torch.uint8, generator=g)
    scale[:, 0] = torch.arange(rows, dtype=torch.uint8)
    want = _ct_decompress(packed, scale)
    got = dequantize_mxfp4(packed, scale)  # bf16, as the loader's default
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)  # the inf rows (scales near 254 times 6) included
    assert torch.equal(got.signbit(), want.signbit())  # -0 codes stay -0
    finite = want.isfinite()
    got32 = dequantize_mxfp4(packed, scale, torch.float32)
    assert torch.equal(got32[finite], want.float()[finite])  # every finite product is exact in bf16


def test_dequantize_roundtrip_of_compressed_tensors_encoder():
    w = torch.randn(96, 320, generator=torch.Generator().manual_seed(2))
    w = w * torch.logspace(-3, 1, 96).unsqueeze(1)  # groups of very different sizes
    packed, scale = _ct_compress(w)
    assert packed.dtype == torch.uint8 and packed.shape == (96, 160) and scale.shape == (96, 10)
    want = _ct_decompress(packed, scale)
    assert torch.equal(dequantize_mxfp4(packed, scale), want)
    err = (want.float() - w).norm() / w.norm()
    assert err < 0.2, err  # 4-bit rounding only: the two agree on what the codes mean, not on noise


def test_nan_scale_is_refused():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scale = torch.full((2, 1), 127, dtype=torch.uint8)
    scale[1, 0] = 255
    with pytest.raises(CheckpointError, match="0xFF"):
        dequantize_mxfp4(packed, scale)


def _release_quant_config() -> dict:
    """A quantization_config block laid out as the release's: one group of MXFP4 Linear weights, with the
    release's ignore list."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "mxfp4-pack-quantized",
                "weights": json.loads(ARGS.model_dump_json()),
                "input_activations": None,
            }
        },
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj", "lm_head"],
    }


def test_checkpoint_written_by_compressed_tensors_loads_exactly(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny = K3ForCausalLM(get_preset("tiny", moe_intermediate_size=64, routed_expert_hidden_size=64)).eval()
    qdir, ddir = tmp_path / "mxfp4", tmp_path / "dense"
    tiny.save_pretrained(qdir)
    tiny.save_pretrained(ddir)
    sd = load_file(qdir / "model.safetensors")
    dense = load_file(ddir / "model.safetensors")
    quantised = [k for k in sd if ".experts." in k or ".routed_expert_" in k and k.endswith("_proj.weight")]
    assert any(".experts." in k for k in quantised) and any("routed_expert_up_proj" in k for k in quantised)
    for k in quantised:
        packed, scale = _ct_compress(sd.pop(k).float())
        base = k[: -len(".weight")]
        sd[base + ".weight_packed"], sd[base + ".weight_scale"] = packed, scale
        sd[base + ".weight_shape"] = torch.tensor(list(dense[k].shape))
        dense[k] = _ct_decompress(packed, scale).float()  # what compressed-tensors says the file holds
    save_file(sd, qdir / "model.safetensors")
    save_file(dense, ddir / "model.safetensors")
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = _release_quant_config()
    (qdir / "config.json").write_text(json.dumps(cfg))

    m = K3ForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    ref = K3ForCausalLM.from_pretrained(ddir, dtype=torch.float32)
    got, want = m.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ids = torch.randint(0, tiny.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref(ids).logits)


@pytest.mark.parametrize(
    "block, match",
    [
        ({"format": "nvfp4-pack-quantized"}, "nvfp4"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method"),
        ({"config_groups": {"group_0": {"format": "pack-quantized"}}}, "group_0.format"),
        ({"config_groups": {"g": {"weights": {"num_bits": 8}}}}, "num_bits"),
        ({"config_groups": {"g": {"weights": {"group_size": 16}}}}, "group_size"),
        ({"config_groups": {"g": {"weights": {"type": "int"}}}}, "type"),
        ({"config_groups": {"g": {"weights": {"symmetric": False}}}}, "symmetric"),
        ("mxfp4", "JSON object"),
    ],
)
def test_unsupported_quantization_config_is_refused(tmp_path, block, match):
    with pytest.raises(CheckpointError, match=match):
        check_quantization_config({"quantization_config": block})
    # the release's multimodal wrapper keeps it in text_config
    with pytest.raises(CheckpointError, match=match):
        check_quantization_config({"text_config": {"quantization_config": block}})
    # and through from_pretrained, before any weight is read
    tiny = K3ForCausalLM(get_preset("tiny"))
    tiny.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = block
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_release_quantization_config_is_accepted():
    check_quantization_config({"quantization_config": _release_quant_config()})
    check_quantization_config({"text_config": {"quantization_config": _release_quant_config()}})
    check_quantization_config({"quantization_config": {"config_groups": {"g": {"format": "dense"}}}})
