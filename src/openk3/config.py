"""K3Config: one configuration class for Kimi K3 and Kimi Linear.

The field names follow the released Kimi K3 text config (``config.json`` -> ``text_config``), which is a superset
of Kimi Linear's. Kimi Linear is the same family with switches off:

=====================  =========================  ============================
switch                 Kimi K3                    Kimi Linear
=====================  =========================  ============================
KDA decay gate         ``gate_lower_bound=-5``    ``gate_lower_bound=None``
                       (bounded sigmoid)          (negative softplus)
KDA output gate        ``use_full_rank_gate``     low rank (``g_a_proj/g_b_proj``)
MLA output gate        ``mla_use_output_gate``    off
FFN activation         ``hidden_act="situ"``      ``"silu"`` (SwiGLU)
AttnRes                ``attn_res_block_size=12`` ``None`` (plain residual)
LatentMoE              ``routed_expert_hidden_``  ``None`` (experts at full width)
                       ``size=3584``
=====================  =========================  ============================

``K3Config.from_pretrained`` reads the released K3 multimodal ``config.json`` (``text_config``), a flat text
config (K3 or Kimi Linear, with ``linear_attn_config``), and the format written by ``transformers``'
``KimiLinearConfig.save_pretrained`` (``layer_types`` / ``mlp_layer_types``). ``save_pretrained`` writes the
released flat text format.

Options marked *Assumed* in SPEC.md are fields with the assumed default (``attn_res_init``, ``kda_init``,
``mla_latent_norm_eps``).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["K3Config", "ConfigError", "PRESETS", "get_preset"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message says what to change."""


_ACTS = ("situ", "silu", "swiglu")
_KDA_INITS = ("fla",)
_TOPK_METHODS = ("noaux_tc",)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND_OK = {
    "bool": lambda v: isinstance(v, bool),
    "int": _is_int,
    "float": lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v),
    "str": lambda v: isinstance(v, str),
}


def mistyped_field(obj: Any, kinds: tuple[str, ...] = tuple(_KIND_OK)) -> tuple[str, str, Any] | None:
    """The first field of the dataclass ``obj`` whose value lacks its annotated type, as (name, kind, value), or
    None. Only fields annotated with one of ``kinds`` ("bool", "int", "float": a finite int or float, "str"),
    optionally "| None", are checked; the caller words the error. Used by the configs (K3Config, the engine's and
    the trainer's options) so that a string "false" or a float size is refused, not read as something else."""
    for f in fields(obj):
        kind, optional = (f.type[: -len(" | None")], True) if f.type.endswith(" | None") else (f.type, False)
        v = getattr(obj, f.name)
        if kind in kinds and not (optional and v is None) and not _KIND_OK[kind](v):
            return f.name, kind, v
    return None


def _layer_list(name: str, v: Any) -> list[int]:
    """A 1-based layer list as given (JSON list of integers) -> sorted ints, or a ConfigError naming the field."""
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not all(_is_int(i) for i in v):
        raise ConfigError(f"{name} must be a list of 1-based layer numbers (integers), got {v!r}")
    return sorted(v)


@dataclass
class K3Config:
    # --- vocabulary / trunk -------------------------------------------------------------------------------
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792  # dense FFN width (layers < first_k_dense_replace)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    pad_token_id: int | None = 163839
    # --- KDA (linear attention) ----------------------------------------------------------------------------
    # 1-based layer lists, exactly as in the released config.
    kda_layers: list[int] = field(default_factory=list)
    full_attn_layers: list[int] = field(default_factory=list)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None -> Kimi Linear's negative-softplus gate
    use_full_rank_gate: bool = True  # False -> Kimi Linear low-rank g_a_proj/g_b_proj output gate
    # --- MLA -------------------------------------------------------------------------------------------------
    num_attention_heads: int = 96
    num_key_value_heads: int = 96  # inert for MLA, kept for checkpoint compatibility
    q_lora_rank: int | None = 1536  # None -> direct q_proj (Kimi Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # "rope" dims: never rotated in K3 / Kimi Linear (NoPE)
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_latent_norm_eps: float = (
        1e-6  # q_a_layernorm / kv_a_layernorm eps (upstream default, not rms_norm_eps)
    )
    # --- MoE ---------------------------------------------------------------------------------------------------
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # latent width (<= hidden); None -> plain (full-width) MoE
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    # --- activations -----------------------------------------------------------------------------------------
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # --- Attention Residuals --------------------------------------------------------------------------------
    attn_res_block_size: int | None = 12  # decoder layers per block; None -> plain residual stream
    attn_res_init: str = "zero"  # Assumed (paper): zero pseudo-queries; "normal" = N(0, initializer_range)
    # --- misc ---------------------------------------------------------------------------------------------
    num_nextn_predict_layers: int = 0
    kda_init: str = "fla"  # Assumed: A_log = log U(1,16), dt_bias = 0
    model_type: str = "kimi_linear"
    name: str = ""  # preset name (informational, not written to config.json)

    # ------------------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if not self.kda_layers and not self.full_attn_layers:
            # default hybrid schedule: every 4th layer (1-based) is MLA, the last layer too
            n = self.num_hidden_layers
            self.full_attn_layers = [i for i in range(1, n + 1) if i % 4 == 0 or i == n]
            self.kda_layers = [i for i in range(1, n + 1) if i not in set(self.full_attn_layers)]
        self.kda_layers = _layer_list("kda_layers", self.kda_layers)
        self.full_attn_layers = _layer_list("full_attn_layers", self.full_attn_layers)
        self.validate()

    # ------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def pos(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        def real(name: str, *, zero_ok: bool = False) -> None:  # a finite number > 0 (>= 0 with zero_ok)
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
            if v < 0 or (v == 0 and not zero_ok):
                raise ConfigError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {v!r}")

        bad = mistyped_field(self, ("bool",))
        if bad:
            raise ConfigError(f"{bad[0]} must be true or false, got {bad[2]!r}")
        for n in ("rms_norm_eps", "mla_latent_norm_eps", "routed_scaling_factor"):
            real(n)
        real("initializer_range", zero_ok=True)
        if self.hidden_act == "situ":
            real("activation_situ_beta")
            real("activation_situ_linear_beta")

        for n in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "kda_num_heads",
            "kda_head_dim",
            "short_conv_kernel_size",
            "num_attention_heads",
            "num_key_value_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_experts",
            "num_experts_per_token",
            "moe_intermediate_size",
            "moe_layer_freq",
            "num_expert_group",
            "topk_group",
        ):
            pos(n)
        pos("max_position_embeddings")
        pos("q_lora_rank", allow_none=True)
        pos("routed_expert_hidden_size", allow_none=True)
        pos("attn_res_block_size", allow_none=True)
        if not _is_int(self.num_nextn_predict_layers) or self.num_nextn_predict_layers < 0:
            raise ConfigError(
                f"num_nextn_predict_layers must be an integer >= 0, got {self.num_nextn_predict_layers!r}"
            )
        if not _is_int(self.qk_rope_head_dim) or self.qk_rope_head_dim < 0:
            raise ConfigError(f"qk_rope_head_dim must be an integer >= 0, got {self.qk_rope_head_dim!r}")
        if not _is_int(self.num_shared_experts) or self.num_shared_experts < 0:
            raise ConfigError(f"num_shared_experts must be an integer >= 0, got {self.num_shared_experts!r}")
        if not _is_int(self.first_k_dense_replace) or not (
            0 <= self.first_k_dense_replace <= self.num_hidden_layers
        ):
            raise ConfigError(
                f"first_k_dense_replace must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace!r}"
            )
        n = self.num_hidden_layers
        both = self.kda_layers + self.full_attn_layers
        bad = [i for i in both if not (1 <= i <= n)]
        if bad:
            raise ConfigError(
                f"layer ids {bad} are out of range: kda_layers/full_attn_layers are 1-based and must lie in [1, {n}]"
            )
        dup = sorted({i for i in both if both.count(i) > 1})
        missing = sorted(set(range(1, n + 1)) - set(both))
        if dup or missing:
            raise ConfigError(
                "kda_layers and full_attn_layers must together list every layer 1..num_hidden_layers exactly once; "
                f"listed twice: {dup}, missing: {missing}"
            )
        glb = self.gate_lower_bound
        if glb is not None and (
            isinstance(glb, bool) or not isinstance(glb, (int, float)) or not (-10.0 <= glb < 0.0)
        ):
            raise ConfigError(
                f"gate_lower_bound must be in [-10, 0) (K3 uses -5.0) or None for the softplus gate, "
                f"got {self.gate_lower_bound!r}"
            )
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token ({self.num_experts_per_token}) must not exceed num_experts ({self.num_experts})"
            )
        if self.num_experts % self.num_expert_group:
            raise ConfigError(
                f"num_expert_group ({self.num_expert_group}) must divide num_experts ({self.num_experts})"
            )
        if self.num_expert_group > 1 and not self.use_grouped_topk:
            raise ConfigError(
                f"use_grouped_topk is false but num_expert_group is {self.num_expert_group}: transformers' Kimi "
                "router applies the group limit regardless of the flag and vLLM's does not, so the routing is "
                "ambiguous; set use_grouped_topk true (group-limited) or num_expert_group = topk_group = 1"
            )
        if self.topk_group > self.num_expert_group:
            raise ConfigError(
                f"topk_group ({self.topk_group}) must be <= num_expert_group ({self.num_expert_group})"
            )
        if self.num_expert_group > 1:
            per_group = self.num_experts // self.num_expert_group
            if self.topk_group * per_group < self.num_experts_per_token:
                raise ConfigError(
                    "topk_group * (num_experts / num_expert_group) must be >= num_experts_per_token so enough "
                    "experts remain selectable"
                )
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size > self.hidden_size:
            raise ConfigError(
                f"routed_expert_hidden_size (latent width {self.routed_expert_hidden_size}) must not exceed "
                f"hidden_size ({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.hidden_act not in _ACTS:
            raise ConfigError(f"hidden_act must be one of {_ACTS}, got {self.hidden_act!r}")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ConfigError(
                f"moe_router_activation_func must be 'sigmoid' or 'softmax', got {self.moe_router_activation_func!r}"
            )
        if self.attn_res_init not in ("zero", "normal"):
            raise ConfigError(f"attn_res_init must be 'zero' or 'normal', got {self.attn_res_init!r}")
        if self.kda_init not in _KDA_INITS:
            raise ConfigError(f"kda_init must be one of {_KDA_INITS}, got {self.kda_init!r}")
        if self.topk_method not in _TOPK_METHODS:
            raise ConfigError(
                f"topk_method {self.topk_method!r} is not supported: openk3 routes as K3 / Kimi Linear do, "
                f"{_TOPK_METHODS[0]!r} (sigmoid scores plus e_score_correction_bias for the choice)"
            )
        for n in ("model_type", "name"):
            if not isinstance(getattr(self, n), str):
                raise ConfigError(f"{n} must be a string, got {getattr(self, n)!r}")
        for tok in ("bos_token_id", "pad_token_id"):
            v = getattr(self, tok)
            if v is not None and not _is_int(v):
                raise ConfigError(f"{tok} must be an integer token id or null, got {v!r}")
            if v is not None and not (0 <= v < self.vocab_size):
                setattr(self, tok, None)  # out-of-vocab special ids (e.g. tiny vocab) are dropped
        if self.eos_token_id is not None:
            ids = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
            if not ids or not all(_is_int(i) for i in ids):
                raise ConfigError(
                    f"eos_token_id must be an integer token id, a non-empty list of them, or null; "
                    f"got {self.eos_token_id!r}"
                )
            ids = [i for i in ids if 0 <= i < self.vocab_size]
            self.eos_token_id = (ids[0] if len(ids) == 1 else ids) if ids else None

    # ------------------------------------------------------------------------------------------------------
    # derived structure
    @property
    def layer_types(self) -> list[str]:
        """0-based list of ``"kda"`` / ``"mla"`` per decoder layer."""
        full = set(self.full_attn_layers)
        return ["mla" if (i + 1) in full else "kda" for i in range(self.num_hidden_layers)]

    def first_layers(self, n: int) -> dict[str, Any]:
        """The fields that cut this config to its first ``n`` decoder layers, each keeping its type (KDA / MLA) and
        the dense prefix (``first_k_dense_replace``, at most ``n``): pass them to :meth:`replace` or as a preset's
        overrides. For measuring a large model's per-layer costs on a card that cannot hold all of its layers."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(
                f"first_layers: n must be an integer in [1, {self.num_hidden_layers}], got {n!r}"
            )
        return {
            "num_hidden_layers": n,
            "kda_layers": [i for i in self.kda_layers if i <= n],
            "full_attn_layers": [i for i in self.full_attn_layers if i <= n],
            "first_k_dense_replace": min(self.first_k_dense_replace, n),
        }

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and (i % self.moe_layer_freq == 0)

    @property
    def kda_gate_kind(self) -> str:
        return "softplus" if self.gate_lower_bound is None else "lowerbound"

    @property
    def use_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def use_latent_moe(self) -> bool:
        # set means latent, even at the hidden size: the release's code (and vLLM's and SGLang's K3 models) then
        # still build the down / up projections and the norm
        return self.routed_expert_hidden_size is not None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_width(self) -> int:
        """Width the routed experts run at (latent width for LatentMoE)."""
        return self.routed_expert_hidden_size if self.use_latent_moe else self.hidden_size

    # ------------------------------------------------------------------------------------------------------
    # JSON in / out
    def to_dict(self) -> dict[str, Any]:
        """The released flat text-config format (``linear_attn_config`` nested, 1-based layer lists)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        lac = {
            "kda_layers": d.pop("kda_layers"),
            "full_attn_layers": d.pop("full_attn_layers"),
            "num_heads": d.pop("kda_num_heads"),
            "head_dim": d.pop("kda_head_dim"),
            "short_conv_kernel_size": d.pop("short_conv_kernel_size"),
            "use_full_rank_gate": d.pop("use_full_rank_gate"),
        }
        glb = d.pop("gate_lower_bound")
        if glb is not None:
            lac["gate_lower_bound"] = glb
        d["linear_attn_config"] = lac
        d.pop("name")
        # K3-only fields whose feature is off are left out, as in Kimi Linear's released config: readers that take
        # a present value as the switch (SGLang's Kimi Linear MoE turns SiTU betas into a clamped gpt-oss GLU,
        # transformers' strict config refuses a null attn_res_block_size) then see the plain model; from_dict reads
        # them back as off
        if d["attn_res_block_size"] is None:
            del d["attn_res_block_size"]
        if not self.use_latent_moe:
            del d["routed_expert_hidden_size"], d["latent_moe_use_norm"]
        if self.hidden_act != "situ":
            del d["activation_situ_beta"], d["activation_situ_linear_beta"]
        d["architectures"] = ["KimiLinearForCausalLM"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> K3Config:
        d = dict(d)
        if "text_config" in d and isinstance(d["text_config"], dict):  # released multimodal wrapper
            d = dict(d["text_config"])
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        lac = d.pop("linear_attn_config", None) or {}
        if not isinstance(lac, dict):
            raise ConfigError(f"linear_attn_config must be a JSON object, got {type(lac).__name__}")
        if lac:
            kw["kda_layers"] = lac.get("kda_layers", [])
            kw["full_attn_layers"] = lac.get("full_attn_layers", [])
            if "num_heads" in lac:
                kw["kda_num_heads"] = lac["num_heads"]
            if "head_dim" in lac:
                kw["kda_head_dim"] = lac["head_dim"]
            if "short_conv_kernel_size" in lac:
                kw["short_conv_kernel_size"] = lac["short_conv_kernel_size"]
            kw["gate_lower_bound"] = lac.get("gate_lower_bound", None)
            kw["use_full_rank_gate"] = lac.get("use_full_rank_gate", False)
        else:
            # transformers' KimiLinearConfig.save_pretrained format, or a config with neither: Kimi Linear defaults
            kw["gate_lower_bound"] = d.pop("gate_lower_bound", None)
            kw["use_full_rank_gate"] = d.pop("use_full_rank_gate", False)
            for src, dst in (
                ("linear_num_heads", "kda_num_heads"),
                ("linear_head_dim", "kda_head_dim"),
                ("linear_conv_kernel_dim", "short_conv_kernel_size"),
            ):
                if src in d:
                    kw[dst] = d.pop(src)
            lt = d.pop("layer_types", None)
            n = d.get("num_hidden_layers", 27)
            if not _is_int(n) or n <= 0:
                raise ConfigError(f"num_hidden_layers must be a positive integer, got {n!r}")
            if lt is None:  # transformers' default schedule
                lt = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
            if not isinstance(lt, list) or not all(isinstance(t, str) for t in lt):
                raise ConfigError(f"layer_types must be a list of strings, got {lt!r}")
            unknown = sorted({t for t in lt if t not in ("full_attention", "linear_attention")})
            if unknown:
                raise ConfigError(
                    f"layer_types: unknown entries {unknown} (full_attention / linear_attention)"
                )
            if len(lt) != n:
                raise ConfigError(f"layer_types has {len(lt)} entries but num_hidden_layers is {n}")
            kw["full_attn_layers"] = [i + 1 for i, t in enumerate(lt) if t == "full_attention"]
            kw["kda_layers"] = [i + 1 for i, t in enumerate(lt) if t != "full_attention"]
            mlt = d.pop("mlp_layer_types", None)
            if mlt is not None and (not isinstance(mlt, list) or not all(isinstance(t, str) for t in mlt)):
                raise ConfigError(f"mlp_layer_types must be a list of strings, got {mlt!r}")
            if mlt is not None:
                unknown = sorted({t for t in mlt if t not in ("dense", "sparse")})
                if unknown:
                    raise ConfigError(f"mlp_layer_types: unknown entries {unknown} (dense / sparse)")
                dense = [i for i, t in enumerate(mlt) if t == "dense"]
                if dense != list(range(len(dense))):
                    raise ConfigError("mlp_layer_types: only a leading run of dense layers is supported")
                kw["first_k_dense_replace"] = len(dense)
            # Kimi Linear (no K3 switches) unless given
            kw.setdefault("mla_use_output_gate", d.pop("mla_use_output_gate", False))
            kw["routed_expert_hidden_size"] = d.pop("routed_expert_hidden_size", None)
            kw["attn_res_block_size"] = d.pop("attn_res_block_size", None)
        # newer transformers' KimiLinearConfig: the dense layers' width, intermediate_size where unset
        dense = d.pop("dense_ffn_hidden", None)
        if dense is not None:
            if not _is_int(dense) or dense <= 0:
                raise ConfigError(f"dense_ffn_hidden must be a positive integer or null, got {dense!r}")
            kw["intermediate_size"] = dense
        # aliases used by transformers / older configs
        aliases = {
            "model_max_length": "max_position_embeddings",
            "num_local_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_token",
            "n_shared_experts": "num_shared_experts",
            "n_group": "num_expert_group",
            "norm_topk_prob": "moe_renormalize",
        }
        for src, dst in aliases.items():
            if src in d and dst not in d:
                d[dst] = d[src]
        for k, v in d.items():
            if k in known and k not in kw:
                kw[k] = v
        # a Kimi-Linear config without the K3 fields: keep the family's defaults off
        kw.setdefault("routed_expert_hidden_size", None)
        kw.setdefault("attn_res_block_size", None)
        if kw["attn_res_block_size"] == 0 and not isinstance(kw["attn_res_block_size"], bool):
            kw["attn_res_block_size"] = None  # transformers' KimiLinearConfig writes 0 for "off"
        kw.setdefault("mla_use_output_gate", False)
        if "hidden_act" not in kw:
            kw["hidden_act"] = "silu"
        kw.setdefault("q_lora_rank", None)
        kw.setdefault("routed_scaling_factor", 1.0)
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> K3Config:
        """Read a ``config.json`` (file or directory holding one)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.exists(p):
            raise FileNotFoundError(f"no config.json at {p!r}: pass a checkpoint directory or a config file")
        try:
            with open(p, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p} must hold a JSON object")
        return cls.from_dict(d)

    def save_pretrained(self, directory: str | os.PathLike, *, dtype: str | None = None) -> str:
        """Write ``config.json``; ``dtype`` (e.g. "bfloat16"): the weights' dtype, recorded as the release records
        it (engines choose their compute dtype from it)."""
        os.makedirs(directory, exist_ok=True)
        p = os.path.join(os.fspath(directory), "config.json")
        tmp = p + ".tmp"
        d = self.to_dict()
        if dtype is not None:
            d["dtype"] = dtype
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, p)
        return p

    def replace(self, **changes: Any) -> K3Config:
        d = asdict(self)
        d.update(changes)
        if (
            "num_hidden_layers" in changes
            and "kda_layers" not in changes
            and "full_attn_layers" not in changes
        ):
            d["kda_layers"], d["full_attn_layers"] = [], []
        return K3Config(**d)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> K3Config:
        return get_preset(name, **overrides)


# ---------------------------------------------------------------------------------------------------------------
# presets


def _k3() -> K3Config:
    full = [4 * i for i in range(1, 24)] + [93]
    return K3Config(
        name="k3",
        kda_layers=[i for i in range(1, 94) if i not in set(full)],
        full_attn_layers=full,
    )


def _kimi_linear_48b() -> K3Config:
    full = [4, 8, 12, 16, 20, 24, 27]
    return K3Config(
        name="kimi-linear-48b",
        vocab_size=163840,
        hidden_size=2304,
        num_hidden_layers=27,
        intermediate_size=9216,
        kda_layers=[i for i in range(1, 28) if i not in set(full)],
        full_attn_layers=full,
        kda_num_heads=32,
        kda_head_dim=128,
        gate_lower_bound=None,
        use_full_rank_gate=False,
        num_attention_heads=32,
        num_key_value_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        mla_use_output_gate=False,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=1024,
        routed_expert_hidden_size=None,
        routed_scaling_factor=2.446,
        hidden_act="silu",
        attn_res_block_size=None,
    )


def _k2_like() -> K3Config:
    # K2-shaped (all full attention, 384 experts top-8, one shared expert); openk3 runs its MLA without RoPE.
    return K3Config(
        name="k2-like",
        hidden_size=7168,
        num_hidden_layers=61,
        intermediate_size=18432,
        kda_layers=[],
        full_attn_layers=list(range(1, 62)),
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=1536,
        mla_use_output_gate=False,
        num_experts=384,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=2048,
        routed_expert_hidden_size=None,
        routed_scaling_factor=2.827,
        hidden_act="silu",
        attn_res_block_size=None,
    )


def _tiny() -> K3Config:
    n = 8
    full = [4, 7, 8]  # like K3: every 4th layer plus MLA closing the stack
    return K3Config(
        name="tiny",
        vocab_size=4096,
        hidden_size=96,
        num_hidden_layers=n,
        intermediate_size=192,
        kda_layers=[i for i in range(1, n + 1) if i not in full],
        full_attn_layers=full,
        kda_num_heads=3,
        kda_head_dim=32,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=24,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=48,
        routed_expert_hidden_size=48,
        attn_res_block_size=3,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _small() -> K3Config:
    n = 12
    return K3Config(
        name="small",
        vocab_size=32768,
        hidden_size=768,
        num_hidden_layers=n,
        intermediate_size=2048,
        kda_num_heads=6,
        kda_head_dim=128,
        num_attention_heads=6,
        num_key_value_heads=6,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=2,
        moe_intermediate_size=384,
        routed_expert_hidden_size=384,
        attn_res_block_size=4,
        max_position_embeddings=65536,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _medium() -> K3Config:
    n = 16
    return K3Config(
        name="medium",
        vocab_size=65536,
        hidden_size=2048,
        num_hidden_layers=n,
        intermediate_size=5632,
        kda_num_heads=16,
        kda_head_dim=128,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=64,
        num_experts_per_token=8,
        num_shared_experts=2,
        moe_intermediate_size=640,
        routed_expert_hidden_size=1024,
        attn_res_block_size=4,
        max_position_embeddings=131072,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


PRESETS = {
    "k3": _k3,
    "kimi-linear-48b": _kimi_linear_48b,
    "k2-like": _k2_like,
    "tiny": _tiny,
    "small": _small,
    "medium": _medium,
}


def get_preset(name: str, **overrides: Any) -> K3Config:
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    cfg = PRESETS[key]()
    return cfg.replace(**overrides) if overrides else cfg
