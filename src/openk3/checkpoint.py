"""Checkpoints in the released format: safetensors (single file or sharded with an index) under the released key
names (SPEC.md §5.5). Never unpickles anything.

Accepted on load:
* released K3 (multimodal, ``language_model.`` prefix; ``vision_tower.*`` / ``mm_projector.*`` are skipped) and flat
  text checkpoints (``model.*`` + ``lm_head.weight``);
* files written by ``transformers``' ``KimiLinearForCausalLM.save_pretrained`` (which stores layer 0's dense MLP under
  ``block_sparse_moe.``) and transformers' in-memory fused layout (``conv1d`` of q|k|v, ``forget_gate.*``,
  ``experts.gate_up_proj`` / ``experts.down_proj``);
* ``A_log`` as [H], zero-padded 1-D, or [1, 1, H, 1];
* MXFP4 weights in the ``compressed-tensors`` ``mxfp4-pack-quantized`` layout of the K3 release (routed experts):
  ``<name>.weight_packed`` uint8 [out, in/2] holding two E2M1 codes per byte (even column in the low nibble, odd
  column in the high nibble; code = sign bit 3 | magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6}) and
  ``<name>.weight_scale`` uint8 [out, in/32] E8M0 exponents (scale = 2^(e - 127)); they are dequantised on load to
  ``<name>.weight`` (bf16 unless a dtype is given). ``<name>.weight_shape`` entries are ignored. A
  ``quantization_config`` declaring any other format or other MXFP4 arguments is refused
  (``check_quantization_config``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch

from openk3.config import K3Config

SKIP_PREFIXES = (
    "vision_tower.",
    "mm_projector.",
    "language_model.vision_tower.",
    "language_model.mm_projector.",
)
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight$")
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message lists what is wrong."""


# ---------------------------------------------------------------------------------------------------------------
# reading


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (index-driven when an index exists)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint path {path!r} does not exist")
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointError(
                f"{path} is not a .safetensors file; openk3 only loads safetensors (it never unpickles .bin/.pt files)"
            )
        return [path]
    idx = os.path.join(path, INDEX_NAME)
    if os.path.exists(idx):
        try:
            with open(idx, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx} is malformed ({e!r}); it needs a 'weight_map' object") from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"shards listed in {INDEX_NAME} are missing: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = (
            f" (found {others}: pickled weights are not loaded, convert them to safetensors)"
            if others
            else ""
        )
        raise CheckpointError(f"no .safetensors files in {path}{hint}")
    return [os.path.join(path, f) for f in files]


def iter_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for fn in files:
        try:
            with safe_open(fn, framework="pt", device="cpu") as f:
                for k in f.keys():
                    yield k, f.get_tensor(k)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {fn}: {e} (truncated or not a safetensors file?)") from None


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 (E2M1 values, one E8M0 scale per 32 inputs) -> dense ``[out, in]``. See the module docstring."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 tensors must be uint8, got {packed.dtype} / {scale.dtype}")
    out, half = packed.shape
    n_in = 2 * half
    if scale.shape != (out, n_in // 32) or n_in % 32:
        raise CheckpointError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not fit packed weight {tuple(packed.shape)} "
            f"(expected [{out}, {n_in // 32}])"
        )
    if bool((scale == 255).any()):
        # OCP MX: the E8M0 code 0xFF is NaN, not 2^128; a weight block scaled by it is unusable
        r, c = (scale == 255).nonzero()[0].tolist()
        raise CheckpointError(
            f"MXFP4 scale is 0xFF (NaN in E8M0) at row {r}, input block {c}: the checkpoint's weights are corrupt"
        )
    table = torch.tensor(_E2M1, dtype=torch.float32)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, n_in)
    vals = table[codes.long()].view(out, n_in // 32, 32)
    w = vals * torch.exp2(scale.float() - 127.0).unsqueeze(-1)
    return w.view(out, n_in).to(dtype)


# compressed-tensors formats whose tensors openk3 reads ("dense": a group left unquantised)
_QUANT_FORMATS = ("mxfp4-pack-quantized", "dense")
# quant_method values under which those formats are declared; others (fp8, gptq, awq, bitsandbytes, ...) store
# other tensors
_QUANT_METHODS = ("compressed-tensors", "mxfp4")
# what a quantised group's `weights` arguments must say for the MXFP4 reader above to be right
_MXFP4_WEIGHT_ARGS = dict(num_bits=4, type="float", group_size=32, strategy="group", symmetric=True)


def check_quantization_config(d: dict) -> None:
    """Refuse a ``quantization_config`` (top level or in ``text_config``) that openk3 would misread.

    The K3 release declares compressed-tensors ``mxfp4-pack-quantized`` weights, at the top of the block or in each
    of its ``config_groups``; any other format (nvfp4, int4 ``pack-quantized``, fp8, ...) or a group whose weight
    arguments are not 4-bit float, group 32, symmetric, is an error here rather than wrong weights later. Fields
    the block does not give are not checked."""
    blocks = [d.get("quantization_config")]
    if isinstance(d.get("text_config"), dict):
        blocks.append(d["text_config"].get("quantization_config"))
    for q in blocks:
        if q is None:
            continue
        if not isinstance(q, dict):
            raise CheckpointError(f"quantization_config must be a JSON object, got {type(q).__name__}")
        method = q.get("quant_method")
        if method is not None and str(method).lower() not in _QUANT_METHODS:
            raise CheckpointError(
                f"quantization_config.quant_method is {method!r}: openk3 reads compressed-tensors "
                f"{_QUANT_FORMATS[0]!r} weights only (dequantise the checkpoint to bf16 first)"
            )
        groups = q.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise CheckpointError("quantization_config.config_groups must be a JSON object")
        for where, fmt in [("quantization_config.format", q.get("format"))] + [
            (f"config_groups.{g}.format", (v or {}).get("format") if isinstance(v, dict) else None)
            for g, v in groups.items()
        ]:
            if fmt is not None and fmt not in _QUANT_FORMATS:
                raise CheckpointError(
                    f"{where} is {fmt!r}: openk3 reads compressed-tensors {_QUANT_FORMATS[0]!r} weights only "
                    "(dequantise the checkpoint to bf16 first)"
                )
        for g, v in groups.items():
            w = v.get("weights") if isinstance(v, dict) else None
            if not isinstance(w, dict):
                continue
            for k, want in _MXFP4_WEIGHT_ARGS.items():
                got = w.get(k, want)
                if isinstance(got, str) and isinstance(want, str):
                    got = got.lower()
                if got != want:
                    raise CheckpointError(
                        f"config_groups.{g}.weights.{k} is {w.get(k)!r}; openk3's MXFP4 reader needs {want!r}"
                    )


def check_checkpoint_quantization(path: str) -> None:
    """``check_quantization_config`` on the ``config.json`` beside a checkpoint, when there is one."""
    d = path if os.path.isdir(path) else os.path.dirname(path)
    p = os.path.join(d, "config.json")
    if not os.path.exists(p):
        return
    try:
        with open(p, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return  # K3Config.from_pretrained reports an unreadable config.json
    if isinstance(raw, dict):
        check_quantization_config(raw)


def _dequantize_stream(tensors, dtype):
    """Turn ``.weight_packed`` + ``.weight_scale`` pairs into ``.weight`` tensors; pass everything else through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in tensors:
        for suf in (".weight_packed", ".weight_scale"):
            if k.endswith(suf):
                base = k[: -len(suf)]
                d = pending.setdefault(base, {})
                d[suf] = t
                if len(d) == 2:
                    del pending[base]
                    yield base + ".weight", dequantize_mxfp4(d[".weight_packed"], d[".weight_scale"], dtype)
                break
        else:
            if k.endswith(".weight_shape"):
                continue
            yield k, t
    if pending:
        raise CheckpointError(f"quantized tensors without their pair (packed/scale): {sorted(pending)[:5]}")


def _strip_prefix(k: str) -> str | None:
    if k.startswith(SKIP_PREFIXES):
        return None
    if k.startswith("language_model."):
        k = k[len("language_model.") :]
    return k


def to_internal(config: K3Config, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Map released / transformers key names and layouts to openk3's state_dict."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    H = config.kda_num_heads
    for k0, t in tensors:
        k = _strip_prefix(k0)
        if k is None:
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.(.*)$", k)
        if m:
            i = int(m.group(1))
            sub = "block_sparse_moe" if (i < config.num_hidden_layers and config.is_moe_layer(i)) else "mlp"
            k = f"model.layers.{i}.{sub}.{m.group(3)}"
        k = k.replace(".self_attn.forget_gate.", ".self_attn.")
        em = _EXPERT_RE.match(k)
        if em:
            experts.setdefault((em.group(1), em.group(3)), {})[int(em.group(2))] = t
            continue
        if k.endswith(".experts.gate_up_proj"):  # transformers fused [E, 2I, W]
            base = k[: -len(".gate_up_proj")]
            w1, w3 = t.chunk(2, dim=1)
            out[base + ".w1"], out[base + ".w3"] = w1, w3
            continue
        if k.endswith(".experts.down_proj"):
            out[k[: -len(".down_proj")] + ".w2"] = t
            continue
        cm = re.match(r"^(model\.layers\.(\d+)\.self_attn)\.conv1d\.weight$", k)
        if cm:  # fused q|k|v conv
            q, kk, v = t.chunk(3, dim=0)
            out[cm.group(1) + ".q_conv1d.weight"] = q
            out[cm.group(1) + ".k_conv1d.weight"] = kk
            out[cm.group(1) + ".v_conv1d.weight"] = v
            continue
        am = re.match(r"^model\.layers\.(\d+)\.self_attn\.A_log$", k)
        if am:
            flat = t.reshape(-1)
            if flat.numel() < H:
                raise CheckpointError(f"{k0}: A_log has {flat.numel()} values, need at least num_heads={H}")
            t = flat[:H].clone()
        if k.endswith("self_attn.dt_bias") and t.dim() == 2:
            t = t.reshape(-1)
        out[k] = t
    for (base, w), per in experts.items():
        n = config.num_experts
        missing = sorted(set(range(n)) - set(per))
        if missing:
            raise CheckpointError(
                f"{base}: missing experts {missing[:10]}{'...' if len(missing) > 10 else ''} for {w}"
            )
        out[f"{base}.{w}"] = torch.stack([per[e] for e in range(n)], dim=0)
    return out


def _check_dtypes(own: dict, sd: dict) -> None:
    """Integer / bool tensors where the model holds floating-point ones (a malformed checkpoint, not a precision
    choice): refused rather than cast to float."""
    bad = sorted(
        f"{k}: checkpoint {sd[k].dtype} vs model {own[k].dtype}"
        for k in set(own) & set(sd)
        if own[k].is_floating_point() and not (sd[k].is_floating_point() or sd[k].is_complex())
    )
    if bad:
        raise CheckpointError(
            f"checkpoint holds non-floating-point tensors for floating-point weights ({len(bad)}): "
            + ", ".join(bad[:12])
            + (f" ... (+{len(bad) - 12} more)" if len(bad) > 12 else "")
        )


def load_state_dict_into(model, sd: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy ``sd`` into ``model`` (which may live on the meta device), checking keys, shapes and dtype kinds first."""
    own = dict(model.state_dict())
    _check_dtypes(own, sd)
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    wrong = sorted(
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
        for k in set(own) & set(sd)
        if tuple(sd[k].shape) != tuple(own[k].shape)
    )
    if strict and (missing or unexpected or wrong):

        def fmt(xs):
            return ", ".join(xs[:12]) + (f" ... (+{len(xs) - 12} more)" if len(xs) > 12 else "")

        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {fmt(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {fmt(unexpected)}")
        if wrong:
            parts.append(f"wrong shapes ({len(wrong)}): {fmt(wrong)}")
        raise CheckpointError(
            "checkpoint does not match the config; "
            + "; ".join(parts)
            + " -- is config.json the one these weights belong to?"
        )
    model.load_state_dict(sd, strict=strict, assign=True)


def load_pretrained(path, *, dtype: torch.dtype | None = None, device="cpu", config: K3Config | None = None):
    from openk3.model import K3ForCausalLM

    path = os.fspath(path)
    cfg = config or K3Config.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path))
    files = checkpoint_files(path)
    check_checkpoint_quantization(path)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    sd = to_internal(cfg, _dequantize_stream(iter_tensors(files), dtype or torch.bfloat16))
    own = model.state_dict()
    _check_dtypes(own, sd)
    params = dict(model.named_parameters())
    for k, t in list(sd.items()):
        if k in own:
            keep32 = getattr(params.get(k), "_keep_fp32", False) or k.endswith("e_score_correction_bias")
            tdt = torch.float32 if keep32 else (dtype or (t.dtype if t.is_floating_point() else own[k].dtype))
            sd[k] = t.to(device=device, dtype=tdt)
    load_state_dict_into(model, sd)
    _restore_fp32_flags(model)
    model.eval()
    return model


def _restore_fp32_flags(model) -> None:
    """``load_state_dict(assign=True)`` swaps in new Parameter objects; re-mark the fp32-kept ones."""
    for m in model.modules():
        if hasattr(m, "mark_fp32_parameters"):
            m.mark_fp32_parameters()


# ---------------------------------------------------------------------------------------------------------------
# writing


def to_released(model) -> dict[str, torch.Tensor]:
    """openk3 state_dict -> released key names/layouts (per-expert tensors, release-shaped A_log)."""
    cfg: K3Config = model.config
    out = {}
    for k, t in model.state_dict().items():
        m = re.match(r"^(.*\.experts)\.(w[123])$", k)
        if m:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e]
            continue
        if k.endswith("self_attn.A_log"):
            H = cfg.kda_num_heads
            # the layout goes with the gate projection, as the engines' loaders choose their KDA class by it
            if cfg.use_full_rank_gate:  # K3 release: 1-D, zero-padded to head_dim
                n = max(H, cfg.kda_head_dim)
                t = torch.cat([t.reshape(-1), t.new_zeros(n - H)])
            else:  # Kimi Linear release
                t = t.reshape(1, 1, H, 1)
        out[k] = t
    return out


def engine_notes(cfg: K3Config) -> list[str]:
    """How the serving engines that take the released format would read a checkpoint of ``cfg``, where that is
    not as openk3 computes it or not at all (from their loaders' source: vLLM's ``kimi_linear.py`` and Kimi K3
    model, SGLang's ``kimi_linear.py`` and ``kimi_k3.py``). Empty for the released K3 and Kimi Linear layouts."""
    notes = []
    if cfg.gate_lower_bound is not None and not cfg.use_full_rank_gate:
        notes.append(
            "KDA gate: a gate_lower_bound with the low-rank gate projection is not a released combination (K3: "
            "full-rank gate with a lower bound; Kimi Linear: low-rank gate, no bound). vLLM's and SGLang's "
            "low-rank KDA has no lower bound and would compute the softplus gate"
        )
    elif cfg.gate_lower_bound is None and cfg.use_full_rank_gate:
        notes.append(
            "KDA gate: the full-rank gate projection without a gate_lower_bound is not a released combination "
            "(K3: full-rank gate with a lower bound; Kimi Linear: low-rank gate, no bound); other engines may "
            "not compute it as openk3 does"
        )
    k3 = [
        name
        for name, on in (
            ("SiTU", cfg.hidden_act == "situ"),
            ("AttnRes", cfg.use_attn_res),
            ("latent MoE", cfg.use_latent_moe),
            ("MLA output gate", cfg.mla_use_output_gate),
            ("q_lora_rank", cfg.q_lora_rank is not None),
            ("full-rank KDA gate", cfg.use_full_rank_gate),
        )
        if on
    ]
    if k3:
        notes.append(
            f"K3 features ({', '.join(k3)}): vLLM serves this text checkpoint through its Kimi K3 model; "
            "SGLang registers K3 only as the multimodal checkpoint (vision tower included) and its Kimi Linear "
            "model takes none of these features"
        )
    return notes


def save_pretrained(model, path, *, max_shard_size: int | None = None, prefix: str = "") -> None:
    """Write ``config.json`` and safetensors (sharded above ``max_shard_size`` bytes, with an index). Files are
    written aside and renamed into place."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    sd = {prefix + k: v.detach().contiguous().cpu() for k, v in to_released(model).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(sd):
        nb = sd[k].numel() * sd[k].element_size()
        if max_shard_size and size and size + nb > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += nb
    # clear older weights of another layout so the directory holds one checkpoint
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == INDEX_NAME:
            os.remove(os.path.join(path, f))
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, sh in zip(names, shards):
        tmp = os.path.join(path, name + ".tmp")
        save_file(sh, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(path, name))
    if len(shards) > 1:
        wm = {k: n for n, sh in zip(names, shards) for k in sh}
        total = sum(v.numel() * v.element_size() for v in sd.values())
        with open(os.path.join(path, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2, sort_keys=True)
    # the matmul weights' dtype (the fp32 islands of SPEC.md §5.3 aside), as the embedding holds it
    emb = model.model.embed_tokens.weight.dtype
    model.config.save_pretrained(path, dtype=str(emb).removeprefix("torch."))
