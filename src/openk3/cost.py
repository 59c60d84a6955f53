"""Analytic cost model: parameters, FLOPs, HBM bytes, network bytes, cache memory, serving regimes.

Everything here is plain arithmetic on a :class:`~openk3.config.K3Config` (no tensors are allocated), so it runs
instantly for the 2.8 T-parameter ``k3`` preset. The point is to judge an architectural change *per serving regime*
and per resource, never as one number:

* :func:`param_counts` -- total and active-per-token parameters split by component (``k3``: 2.7795 T / 104.19 B;
  active excludes the input embedding, includes the LM head).
* :func:`flops_per_token` -- forward FLOPs per token for ``prefill`` (average over a prompt of ``context`` tokens),
  ``decode`` (one token with ``context`` tokens cached) and ``train`` (forward + backward, 6N plus attention).
* :func:`decode_step_bytes` -- HBM bytes of one decode step at batch ``b``: the routed experts actually touched
  (expected distinct experts under uniform routing, ``N (1 - (1 - K/N)^b)``), the dense weights, the MLA latent
  cache read, the KDA state read + write.
* :func:`ep_comm` -- expert-parallel dispatch + combine bytes (``2 t K l`` for LatentMoE vs ``2 t K d``), comm
  time vs expert compute time, tokens per expert ``t K / N`` and the expert GEMM's arithmetic intensity, with a
  verdict (HBM-, compute- or network-bound).
* :func:`cache_bytes` / :func:`crossover_length` / :func:`serving_memory` -- constant KDA state vs linear MLA
  latent cache, and the total memory of a served batch.
* :func:`step_time` / :func:`predict_decode_time` -- roofline time of a decode (or prefill) step on a
  :class:`Hardware` profile, to hold against measurement; :func:`regime_table` sweeps the batch across the
  latency-bound and throughput regimes.
* :func:`compare`, :func:`sweep` (``latent_alpha`` with the ``eff`` / ``acc`` variants, ``mla_split``, any
  config field, ``batch``, ``context``), :func:`report` -- tables rendered by :func:`render` as text, markdown
  or JSON; ``plot_*`` write PNGs (matplotlib, optional).

Conventions: 1 multiply-add = 2 FLOPs; bytes and FLOP/s in decimal units (1 GB = 1e9 B); "weights" of a dtype
use :data:`DTYPE_BYTES` (``mxfp4`` = 0.5 B per value + one 1-byte scale per 32 values = 0.53125 B).
Multi-token-prediction layers (``num_nextn_predict_layers``) are not counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from openk3.config import ConfigError, K3Config, get_preset

__all__ = [
    "DTYPE_BYTES",
    "HARDWARE",
    "Hardware",
    "get_hardware",
    "load_config",
    "ParamCounts",
    "param_counts",
    "FlopsBreakdown",
    "flops_per_token",
    "train_flops_per_token",
    "reference_counted_flops",
    "expected_experts_touched",
    "DecodeBytes",
    "decode_step_bytes",
    "EPComm",
    "ep_comm",
    "CacheBytes",
    "cache_bytes",
    "crossover_length",
    "ServingMemory",
    "serving_memory",
    "StepTime",
    "step_time",
    "predict_decode_time",
    "attn_res_read_sources",
    "Workload",
    "Table",
    "regime_table",
    "compare",
    "sweep",
    "sweep_configs",
    "report",
    "render",
    "plot_regimes",
    "plot_memory",
    "plot_sweep",
]

# ---------------------------------------------------------------------------------------------------------------
# byte widths and hardware

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "mxfp8": 1.0 + 1.0 / 32,
    "mxfp4": 0.5 + 1.0 / 32,  # E2M1 values + one E8M0 scale per 32 (SPEC.md §5.3)
}


def _dtype_bytes(name: str | float) -> float:
    if isinstance(name, int | float):
        return float(name)
    key = str(name).lower()
    if key not in DTYPE_BYTES:
        raise ConfigError(
            f"unknown dtype {name!r}; choose one of: {', '.join(DTYPE_BYTES)} (or a number of bytes)"
        )
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense peak FLOP/s, HBM bandwidth (B/s) and capacity (B), per-GPU network bandwidth
    (B/s per direction) inside the NVLink domain and across InfiniBand."""

    name: str
    flops: float  # dense bf16 FLOP/s
    hbm_bw: float
    hbm_bytes: float
    nvlink_bw: float
    ib_bw: float = 50e9  # 400 Gb/s per GPU
    fp8_flops: float | None = None
    nvlink_domain: int = 8  # GPUs reachable over NVLink (used by net="auto")
    note: str = ""

    def peak(self, compute_dtype: str = "bf16") -> float:
        if compute_dtype in ("fp8", "mxfp8", "mxfp4") and self.fp8_flops:
            return self.fp8_flops
        return self.flops

    def net_bw(self, net: str | float, ep_ranks: int) -> float:
        """Network bandwidth used for expert-parallel traffic: ``"auto"`` = NVLink while the EP domain fits in one
        NVLink domain, InfiniBand beyond; ``"nvlink"``, ``"ib"``, or a number in B/s."""
        if isinstance(net, int | float):
            return float(net)
        if net == "auto":
            return self.nvlink_bw if ep_ranks <= self.nvlink_domain else self.ib_bw
        if net == "nvlink":
            return self.nvlink_bw
        if net == "ib":
            return self.ib_bw
        try:
            return _parse_number(net)
        except ValueError:
            raise ConfigError(f"net must be auto, nvlink, ib or a bandwidth in B/s, got {net!r}") from None


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 3.35e12, 80e9, 450e9, fp8_flops=1979e12, note="H100 SXM datasheet"),
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9, 450e9, fp8_flops=1979e12, note="H200 SXM datasheet"),
    "b200": Hardware("b200", 2250e12, 8.0e12, 192e9, 900e9, fp8_flops=4500e12, note="B200 datasheet"),
    "h200-measured": Hardware(
        "h200-measured",
        790e12,
        4.2e12,
        141e9,
        450e9,
        note="this project's measured ceilings on one H200: bf16 matmul 790 TFLOP/s, device copy 4.2 TB/s",
    ),
}

_SUFFIX = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def _parse_number(s: str) -> float:
    s = s.strip().lower()
    for unit in ("b/s", "flop/s", "flops", "b"):
        if s.endswith(unit) and len(s) > len(unit):
            s = s[: -len(unit)]
            break
    if s and s[-1] in _SUFFIX:
        return float(s[:-1]) * _SUFFIX[s[-1]]
    return float(s)


def get_hardware(spec: str | Hardware) -> Hardware:
    """A profile by name (:data:`HARDWARE`) or ``custom:flops=800T,hbm=4.2T,net=50G[,nvlink=450G,mem=141G,
    fp8=1.6P]`` (numbers with optional k/M/G/T/P suffix; ``net`` sets both NVLink and IB bandwidth)."""
    if isinstance(spec, Hardware):
        return spec
    key = spec.strip().lower()
    if key in HARDWARE:
        return HARDWARE[key]
    if key.startswith("custom"):
        vals: dict[str, float] = {}
        body = key.split(":", 1)[1] if ":" in key else ""
        for item in filter(None, body.split(",")):
            if "=" not in item:
                raise ConfigError(
                    f"custom hardware: expected key=value, got {item!r} (e.g. custom:flops=800T,hbm=4T)"
                )
            k, v = item.split("=", 1)
            try:
                vals[k.strip()] = _parse_number(v)
            except ValueError:
                raise ConfigError(
                    f"custom hardware: {k}={v!r} is not a number (use e.g. 800T, 4.2e12)"
                ) from None
        unknown = set(vals) - {"flops", "hbm", "net", "nvlink", "ib", "mem", "fp8"}
        if unknown:
            raise ConfigError(
                f"custom hardware: unknown keys {sorted(unknown)}; use flops, hbm, net, nvlink, ib, mem, fp8"
            )
        missing = {"flops", "hbm"} - set(vals)
        if missing:
            raise ConfigError(
                f"custom hardware needs {sorted(missing)} (e.g. custom:flops=800T,hbm=4.2T,net=50G)"
            )
        net = vals.get("net", 50e9)
        return Hardware(
            "custom",
            vals["flops"],
            vals["hbm"],
            vals.get("mem", 141e9),
            vals.get("nvlink", net),
            vals.get("ib", net),
            fp8_flops=vals.get("fp8"),
        )
    raise ConfigError(
        f"unknown hardware {spec!r}; choose one of {', '.join(HARDWARE)} or custom:flops=...,hbm=..."
    )


def load_config(spec: str | K3Config, **overrides: Any) -> K3Config:
    """A preset name or a ``config.json`` path (file or directory), with optional field overrides."""
    if isinstance(spec, K3Config):
        cfg = spec
    else:
        import os

        if os.path.exists(spec):
            cfg = K3Config.from_pretrained(spec)
            if not cfg.name:
                cfg.name = os.path.basename(os.path.normpath(spec))
        else:
            cfg = get_preset(spec)
    if overrides:
        name = cfg.name
        cfg = cfg.replace(**overrides)
        cfg.name = name
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# structure helpers


def _counts(cfg: K3Config) -> dict[str, int]:
    types = cfg.layer_types
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    return {
        "kda": types.count("kda"),
        "mla": types.count("mla"),
        "moe": sum(moe),
        "dense": cfg.num_hidden_layers - sum(moe),
    }


def attn_res_read_sources(cfg: K3Config) -> list[int]:
    """Number of candidates of every AttnRes read, in execution order (pre-attention, post-attention per layer,
    then the final read; SPEC.md §3.3). A read over one candidate is the identity (no work). ``[]`` without
    AttnRes. For ``k3`` the maximum is 9."""
    if not cfg.use_attn_res:
        return []
    B = cfg.attn_res_block_size
    sealed, live = 0, True  # the embedding starts as the live running sum
    out: list[int] = []
    for layer in range(cfg.num_hidden_layers):
        out.append(sealed + (1 if live else 0) if sealed else 1)
        if layer % B == 0:
            sealed, live = sealed + 1, False
        live = True  # attention output
        out.append(sealed + 1)
    out.append(sealed + 1)
    return out


def _kda_matmul_params(cfg: K3Config) -> int:
    d, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    HK = H * K
    gate = HK * d if cfg.use_full_rank_gate else K * d + HK * K
    return (
        3 * HK * d + (K * d + HK * K) + H * d + gate + HK * d
    )  # qkv, decay (f_a, f_b), beta, out-gate, o_proj


def kda_layer_params(cfg: K3Config) -> int:
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    HK = H * K
    return (
        _kda_matmul_params(cfg) + 3 * HK * cfg.short_conv_kernel_size + HK + H + K
    )  # convs, dt_bias, A_log, o_norm


def _mla_q_params(cfg: K3Config) -> int:
    d, H = cfg.hidden_size, cfg.num_attention_heads
    dq = H * cfg.qk_head_dim
    return d * dq if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * dq


def _mla_matmul_params(cfg: K3Config) -> int:
    d, H = cfg.hidden_size, cfg.num_attention_heads
    kv, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    p = _mla_q_params(cfg) + d * (kv + r) + kv * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    p += H * cfg.v_head_dim * d  # o_proj
    if cfg.mla_use_output_gate:
        p += d * H * cfg.v_head_dim
    return p


def mla_layer_params(cfg: K3Config) -> int:
    return _mla_matmul_params(cfg) + (cfg.q_lora_rank or 0) + cfg.kv_lora_rank  # + q_a / kv_a layernorms


def routed_expert_params(cfg: K3Config) -> int:
    return 3 * cfg.moe_intermediate_size * cfg.moe_width


def _latent_params(cfg: K3Config) -> int:
    if not cfg.use_latent_moe:
        return 0
    W = cfg.moe_width
    return 2 * W * cfg.hidden_size + (W if cfg.latent_moe_use_norm else 0)


def _shared_params(cfg: K3Config) -> int:
    return 3 * cfg.num_shared_experts * cfg.moe_intermediate_size * cfg.hidden_size


# ---------------------------------------------------------------------------------------------------------------
# parameters

PARAM_COMPONENTS = (
    "embedding",
    "kda",
    "mla",
    "dense_ffn",
    "moe_routed",
    "moe_shared",
    "moe_latent",
    "router",
    "attn_res",
    "norms",
    "lm_head",
)


@dataclass
class ParamCounts:
    """``total`` / ``active`` per component; ``active`` = parameters a token uses (top-K of the routed experts,
    input embedding excluded -- the release's convention). ``per_layer`` holds the per-layer sizes."""

    total: dict[str, int]
    active: dict[str, int]
    per_layer: dict[str, int]
    layers: dict[str, int]

    @property
    def total_params(self) -> int:
        return sum(self.total.values())

    @property
    def active_params(self) -> int:
        return sum(self.active.values())

    @property
    def dense_params(self) -> int:
        """Everything except the routed experts (incl. embedding)."""
        return self.total_params - self.total["moe_routed"]


def param_counts(cfg: K3Config) -> ParamCounts:
    d, V = cfg.hidden_size, cfg.vocab_size
    n = _counts(cfg)
    per = {
        "kda_layer": kda_layer_params(cfg),
        "mla_layer": mla_layer_params(cfg),
        "routed_expert": routed_expert_params(cfg),
        "moe_router": cfg.num_experts * d,
        "moe_latent": _latent_params(cfg),
        "moe_shared": _shared_params(cfg),
        "dense_ffn_layer": 3 * cfg.intermediate_size * d,
    }
    per["moe_layer"] = (
        cfg.num_experts * per["routed_expert"] + per["moe_router"] + per["moe_latent"] + per["moe_shared"]
    )
    total = {
        "embedding": V * d,
        "kda": n["kda"] * per["kda_layer"],
        "mla": n["mla"] * per["mla_layer"],
        "dense_ffn": n["dense"] * per["dense_ffn_layer"],
        "moe_routed": n["moe"] * cfg.num_experts * per["routed_expert"],
        "moe_shared": n["moe"] * per["moe_shared"],
        "moe_latent": n["moe"] * per["moe_latent"],
        "router": n["moe"] * per["moe_router"],
        "attn_res": (4 * cfg.num_hidden_layers + 2) * d if cfg.use_attn_res else 0,
        "norms": (2 * cfg.num_hidden_layers + 1) * d,
        "lm_head": 0 if cfg.tie_word_embeddings else V * d,
    }
    active = dict(total)
    active["embedding"] = 0
    active["moe_routed"] = n["moe"] * cfg.num_experts_per_token * per["routed_expert"]
    if cfg.tie_word_embeddings:
        active["lm_head"] = V * d  # the tied table is used as the head
    return ParamCounts(total=total, active=active, per_layer=per, layers=n)


# ---------------------------------------------------------------------------------------------------------------
# FLOPs

FLOP_COMPONENTS = (
    "kda_proj",
    "kda_conv",
    "kda_state",
    "mla_proj",
    "mla_attn",
    "dense_ffn",
    "moe_routed",
    "moe_shared",
    "moe_latent",
    "router",
    "attn_res",
    "lm_head",
)


@dataclass
class FlopsBreakdown:
    """FLOPs per token (or in total, for :func:`reference_counted_flops`) per component."""

    mode: str
    context: int
    parts: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def __getitem__(self, key: str) -> float:
        return self.parts[key]


def _kda_state_flops_chunk(K: int, V: int, C: int) -> float:
    """Per token per head, chunkwise form with chunk ``C``: state terms ``W S0``, ``Q S0``, ``K^T U`` (6KV),
    intra-chunk ``Q K^T`` and ``K K^T`` (2 x 2CK), ``T K`` and ``T V`` (2CK + 2CV), ``A_qk U`` (2CV) and the
    triangular inverse (~C^2/3 per token)."""
    return 6 * K * V + 2 * C * (3 * K + 2 * V) + C * C / 3 + K * V / C


def flops_per_token(
    cfg: K3Config,
    context: int = 4096,
    mode: str = "decode",
    *,
    kda_chunk: int = 64,
    causal: bool = True,
    include_lm_head: bool = True,
) -> FlopsBreakdown:
    """Forward FLOPs per token.

    ``mode="decode"``: one new token with ``context`` tokens cached (MLA in the absorbed MQA form:
    ``2 H (c+1) (2 kv_lora + rope)`` attention FLOPs per layer; KDA one recurrent step, ~7 K V per head).
    ``mode="prefill"``: average per token over a prompt of ``context`` tokens (MLA in the MHA form, causal: each
    token attends ``(c+1)/2`` keys on average, or ``c`` with ``causal=False`` as dense kernels compute; KDA
    chunkwise with chunk ``kda_chunk``, independent of context).
    ``mode="train"``: forward + backward = 3 x the prefill forward (i.e. 6N plus 3x the attention terms).
    Weight terms are 2 x the active matmul parameters. Not counted: norms, activations, softmax, gates and other
    elementwise work (well under 1 % at K3 scale), the embedding lookup.
    """
    if mode not in ("decode", "prefill", "train"):
        raise ConfigError(f"mode must be decode, prefill or train, got {mode!r}")
    if context < 0:
        raise ConfigError(f"context must be >= 0, got {context}")
    n = _counts(cfg)
    d, K, N = cfg.hidden_size, cfg.num_experts_per_token, cfg.num_experts
    H, Hk, Dk = cfg.num_attention_heads, cfg.kda_num_heads, cfg.kda_head_dim
    fwd_mode = "prefill" if mode == "train" else mode
    parts = dict.fromkeys(FLOP_COMPONENTS, 0.0)
    parts["kda_proj"] = 2.0 * n["kda"] * _kda_matmul_params(cfg)
    parts["kda_conv"] = 2.0 * n["kda"] * 3 * Hk * Dk * cfg.short_conv_kernel_size
    if fwd_mode == "decode":
        parts["kda_state"] = n["kda"] * Hk * 7.0 * Dk * Dk
    else:
        parts["kda_state"] = (
            n["kda"] * Hk * _kda_state_flops_chunk(Dk, Dk, max(1, min(kda_chunk, context or 1)))
        )
    parts["mla_proj"] = 2.0 * n["mla"] * _mla_matmul_params(cfg)
    if fwd_mode == "decode":
        parts["mla_attn"] = 2.0 * n["mla"] * H * (context + 1) * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    else:
        keys = (context + 1) / 2 if causal else float(context)
        parts["mla_attn"] = 2.0 * n["mla"] * H * keys * (cfg.qk_head_dim + cfg.v_head_dim)
    parts["dense_ffn"] = 2.0 * n["dense"] * 3 * cfg.intermediate_size * d
    parts["moe_routed"] = 2.0 * n["moe"] * K * routed_expert_params(cfg)
    parts["moe_shared"] = 2.0 * n["moe"] * _shared_params(cfg)
    parts["moe_latent"] = 2.0 * n["moe"] * (2 * cfg.moe_width * d if cfg.use_latent_moe else 0)
    parts["router"] = 2.0 * n["moe"] * N * d
    parts["attn_res"] = float(sum(4 * s * d for s in attn_res_read_sources(cfg) if s > 1))
    parts["lm_head"] = 2.0 * cfg.vocab_size * d if include_lm_head else 0.0
    notes = []
    if mode == "train":
        parts = {k: 3.0 * v for k, v in parts.items()}
        notes.append(
            "train = forward + backward = 3 x forward (6N + 3 x attention); recomputation not included"
        )
    return FlopsBreakdown(mode=mode, context=context, parts=parts, notes=notes)


def train_flops_per_token(cfg: K3Config, seq_len: int, *, causal: bool = True) -> float:
    """Model FLOPs per trained token (forward + backward) at sequence length ``seq_len`` -- the MFU numerator."""
    return flops_per_token(cfg, seq_len, "train", causal=causal).total


def reference_counted_flops(
    cfg: K3Config,
    batch: int,
    seq_len: int,
    *,
    kda_chunk_size: int = 64,
    kda_recurrent_max_len: int = 16,
    include_lm_head: bool = True,
) -> FlopsBreakdown:
    """Total forward FLOPs of one uncached forward pass ``[batch, seq_len]`` of the plain-PyTorch reference
    model, counting exactly what ``torch.utils.flop_counter.FlopCounterMode`` sees (mm / addmm / bmm / einsum /
    convolution / SDPA) -- the check that the analytic model matches the real modules.

    Counted: every Linear (2 x tokens x weights; routed experts per assigned token: 2 x tokens x K x 3 I W), the
    depthwise q/k/v convolutions, the MLA MHA-form score and value einsums over the full ``T x T`` square (the
    reference masks, it does not skip, the upper triangle), and the matmuls of the KDA chunked form, used for
    ``T > kda_recurrent_max_len`` (chunk ``C = min(kda_chunk_size, T)``, sub-blocks of ``c``): decayed pair
    products (4 C^2 K + 4 C c K), the decay sums written as 0/1-weighted contractions (2 (C/c)^3 K between
    sub-blocks, 2 C c^2 K inside them), state terms (6 C K V) and ``A_qk U`` (2 C^2 V) per chunk and head. This mirrors the structure of ``openk3.ops.kda.chunk``; update both together.

    Not visible to the counter (and so not counted here): the KDA token recurrence used for short inputs
    (broadcast multiply + sum, ~7 K V per token per head), the triangular solve of the chunk form
    (``linalg.solve_triangular``, ~C^3/3 per chunk per head), all elementwise work (norms, L2 norms, gates,
    sigmoid/SiTU/SiLU, softmax, decay exponentials, state decay ``alpha * S``), the AttnRes reads (implemented as
    broadcast multiply + sum: ~4 S d FLOPs per read of S candidates), the embedding gather, expert
    ``index_add``, and ``torch._grouped_mm`` (used by GPU expert backends, not by the reference).
    """
    T = seq_len
    tokens = batch * T
    n = _counts(cfg)
    d = cfg.hidden_size
    Hk, Dk = cfg.kda_num_heads, cfg.kda_head_dim
    H = cfg.num_attention_heads
    parts = dict.fromkeys(FLOP_COMPONENTS, 0.0)
    parts["kda_proj"] = 2.0 * tokens * n["kda"] * _kda_matmul_params(cfg)
    parts["kda_conv"] = 2.0 * tokens * n["kda"] * 3 * Hk * Dk * cfg.short_conv_kernel_size
    if T <= kda_recurrent_max_len:
        per_head = 0.0  # elementwise recurrence: nothing the counter sees
    else:
        C = min(kda_chunk_size, T)
        c = _sub_block(C)
        nb = C // c
        chunks = -(-T // C)
        pairs = 4.0 * C * C * Dk + 4.0 * C * c * Dk  # off-diagonal + diagonal decayed q.k and k.k products
        sums = (
            2.0 * nb**3 * Dk + 2.0 * C * c * c * Dk
        )  # 0/1-weighted decay sums: between sub-blocks, inside them
        per_chunk = pairs + sums + 6.0 * C * Dk * Dk + 2.0 * C * C * Dk
        per_head = chunks * per_chunk
    parts["kda_state"] = batch * n["kda"] * Hk * per_head
    parts["mla_proj"] = 2.0 * tokens * n["mla"] * _mla_matmul_params(cfg)
    parts["mla_attn"] = 2.0 * batch * n["mla"] * H * T * T * (cfg.qk_head_dim + cfg.v_head_dim)
    parts["dense_ffn"] = 2.0 * tokens * n["dense"] * 3 * cfg.intermediate_size * d
    parts["moe_routed"] = 2.0 * tokens * n["moe"] * cfg.num_experts_per_token * routed_expert_params(cfg)
    parts["moe_shared"] = 2.0 * tokens * n["moe"] * _shared_params(cfg)
    parts["moe_latent"] = 2.0 * tokens * n["moe"] * (2 * cfg.moe_width * d if cfg.use_latent_moe else 0)
    parts["router"] = 2.0 * tokens * n["moe"] * cfg.num_experts * d
    parts["lm_head"] = 2.0 * tokens * cfg.vocab_size * d if include_lm_head else 0.0
    return FlopsBreakdown(mode="reference-forward", context=T, parts=parts)


def _sub_block(C: int) -> int:
    """Sub-block size of the reference chunk kernel: largest divisor of C not above ceil(sqrt(C))."""
    top = math.isqrt(C)
    if top * top < C:
        top += 1
    return max(x for x in range(1, top + 1) if C % x == 0)


# ---------------------------------------------------------------------------------------------------------------
# HBM bytes of a decode step


def expected_experts_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected number of distinct experts hit by ``tokens`` tokens each choosing ``top_k`` of ``num_experts``
    uniformly: ``N (1 - (1 - K/N)^tokens)``."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass
class DecodeBytes:
    """HBM bytes of one step over the whole model (one replica), per component."""

    batch: int
    context: int
    tokens: int
    parts: dict[str, float]
    experts_touched_per_layer: float
    dtypes: dict[str, str]

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def weights(self) -> float:
        return self.parts["expert_weights"] + self.parts["dense_weights"]


def _kda_state_values(cfg: K3Config) -> tuple[int, int]:
    """(recurrent state values, conv history values) of one KDA layer for one sequence."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    return H * K * K, 3 * H * K * (cfg.short_conv_kernel_size - 1)


def decode_step_bytes(
    cfg: K3Config,
    batch: int,
    context: int,
    *,
    expert_dtype: str = "bf16",
    dense_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    state_dtype: str = "fp32",
    conv_dtype: str = "fp32",  # the engine keeps the short-conv history in fp32 (openk3.infer.cache)
    mode: str = "decode",
) -> DecodeBytes:
    """HBM bytes read + written by one step over the whole model.

    ``mode="decode"``: ``batch`` sequences advance one token with ``context`` tokens cached.
    ``mode="prefill"``: ``batch`` prompts of ``context`` tokens in one step (weights read once; the MLA latent
    written, not re-read; KDA state written once).

    Components: ``expert_weights`` -- the routed experts touched (expected distinct experts per MoE layer under
    uniform routing) at ``expert_dtype``; ``dense_weights`` -- every other weight except the embedding table at
    ``dense_dtype``; ``embedding_rows`` -- the gathered rows; ``mla_cache_read`` / ``mla_cache_write`` -- the
    latent + shared key part (``kv_lora_rank + qk_rope_head_dim`` values per token per MLA layer);
    ``kda_state`` -- recurrent state read + write (``state_dtype``); ``kda_conv`` -- conv history read + write.
    Activations are not counted (they stay on chip at these sizes or are small next to the weights).
    """
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    pc = param_counts(cfg)
    n = pc.layers
    eb, db, kb = _dtype_bytes(expert_dtype), _dtype_bytes(dense_dtype), _dtype_bytes(kv_dtype)
    sb, cb = _dtype_bytes(state_dtype), _dtype_bytes(conv_dtype)
    tokens = batch * (context if mode == "prefill" else 1)
    touched = expected_experts_touched(cfg.num_experts, cfg.num_experts_per_token, tokens)
    dense = pc.total_params - pc.total["moe_routed"] - pc.total["embedding"]
    if cfg.tie_word_embeddings:
        dense += pc.total["embedding"]  # the tied table is read in full as the head
    cache_per_tok = n["mla"] * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    state, conv = _kda_state_values(cfg)
    parts = {
        "expert_weights": n["moe"] * touched * pc.per_layer["routed_expert"] * eb,
        "dense_weights": dense * db,
        "embedding_rows": tokens * cfg.hidden_size * db,
        "mla_cache_read": (batch * context * cache_per_tok * kb) if mode == "decode" else 0.0,
        "mla_cache_write": tokens * cache_per_tok * kb,
        "kda_state": (2.0 if mode == "decode" else 1.0) * batch * n["kda"] * state * sb,
        "kda_conv": 2.0 * batch * n["kda"] * conv * cb,
    }
    return DecodeBytes(
        batch=batch,
        context=context,
        tokens=tokens,
        parts=parts,
        experts_touched_per_layer=touched,
        dtypes={
            "expert": expert_dtype,
            "dense": dense_dtype,
            "kv": kv_dtype,
            "state": state_dtype,
            "conv": conv_dtype,
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# expert-parallel communication


@dataclass
class EPComm:
    """One MoE layer under expert parallelism over ``ep_ranks`` GPUs with ``tokens_per_domain`` tokens in flight.

    Times are per rank (all ranks work in parallel). ``ratio`` = network time / expert time, where the expert
    time is the larger of the GEMM compute time and the touched-weight read time; once compute-bound it tends to
    ``ratio_limit = b_act F / (3 m B_net)`` (``b_act`` bytes per activation value, ``m`` the expert intermediate
    size) -- independent of batch, width and top-k."""

    tokens_per_domain: float
    ep_ranks: int
    num_experts: int
    top_k: int
    width: int
    intermediate: int
    bytes_per_token: float  # dispatch + combine bytes of one token: 2 K W b_act
    bytes_domain: float  # 2 t K W b_act
    bytes_per_rank: float
    tokens_per_expert: float  # t K / N
    experts_touched_per_rank: float
    flops_per_rank: float
    weight_bytes_per_rank: float
    act_bytes_per_rank: float
    arithmetic_intensity: float  # expert GEMM FLOPs / HBM bytes
    machine_balance: float  # F / B_hbm
    t_compute: float
    t_hbm: float
    t_net: float
    ratio: float
    ratio_limit: float
    bound: str
    net_bw: float


def ep_comm(
    cfg: K3Config,
    tokens_per_domain: float,
    ep_ranks: int,
    hw: str | Hardware = "h200",
    *,
    net: str | float = "auto",
    expert_dtype: str = "bf16",
    act_dtype: str = "fp8",
    compute_dtype: str = "bf16",
    exclude_local: bool = False,
) -> EPComm:
    """Dispatch + combine traffic and expert time of one MoE layer.

    Network bytes over the domain: ``2 t K W b_act`` (W = latent width for LatentMoE, d otherwise), every routed
    copy counted as crossing the network (the notes' convention; ``exclude_local=True`` drops the ``1/E`` that
    stays on-rank under uniform routing). Per rank: ``/ E``. Expert compute per rank: ``(t K / E) 6 I W``;
    weights read per rank: the rank's share of the touched experts, ``3 I W`` each at ``expert_dtype``.
    """
    if ep_ranks < 1:
        raise ConfigError(f"ep_ranks must be >= 1, got {ep_ranks}")
    h = get_hardware(hw)
    t = float(tokens_per_domain)
    N, K, W, m = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_width, cfg.moe_intermediate_size
    ab, eb = _dtype_bytes(act_dtype), _dtype_bytes(expert_dtype)
    per_tok = 2.0 * K * W * ab
    domain = t * per_tok
    local = (1.0 - 1.0 / ep_ranks) if exclude_local else 1.0
    per_rank = domain / ep_ranks * local if ep_ranks > 1 else 0.0
    net_bw = h.net_bw(net, ep_ranks)
    copies_rank = t * K / ep_ranks
    flops = copies_rank * 2.0 * 3 * m * W
    touched = expected_experts_touched(N, K, t) / ep_ranks
    wbytes = touched * 3 * m * W * eb
    abytes = copies_rank * (2 * W + 3 * m) * ab  # x in, y out, gate/up/act intermediates (roughly)
    peak = h.peak(compute_dtype)
    t_c, t_h, t_n = flops / peak, (wbytes + abytes) / h.hbm_bw, per_rank / net_bw
    t_exp = max(t_c, t_h)
    times = {"compute-bound": t_c, "HBM-bound": t_h, "network-bound": t_n}
    return EPComm(
        tokens_per_domain=t,
        ep_ranks=ep_ranks,
        num_experts=N,
        top_k=K,
        width=W,
        intermediate=m,
        bytes_per_token=per_tok,
        bytes_domain=domain,
        bytes_per_rank=per_rank,
        tokens_per_expert=t * K / N,
        experts_touched_per_rank=touched,
        flops_per_rank=flops,
        weight_bytes_per_rank=wbytes,
        act_bytes_per_rank=abytes,
        arithmetic_intensity=flops / (wbytes + abytes) if wbytes + abytes else 0.0,
        machine_balance=peak / h.hbm_bw,
        t_compute=t_c,
        t_hbm=t_h,
        t_net=t_n,
        ratio=t_n / t_exp if t_exp else 0.0,
        ratio_limit=(ab * peak / (3.0 * m * net_bw) * local) if ep_ranks > 1 else 0.0,
        bound=max(times, key=times.get),
        net_bw=net_bw,
    )


# ---------------------------------------------------------------------------------------------------------------
# cache and serving memory


@dataclass
class CacheBytes:
    """Per-sequence cache at ``context`` tokens: linear MLA latent vs constant KDA state (+ conv history)."""

    context: int
    mla: float
    kda_state: float
    kda_conv: float
    mla_per_token: float
    kda_state_per_layer: float
    mla_per_token_per_layer: float

    @property
    def total(self) -> float:
        return self.mla + self.kda_state + self.kda_conv

    @property
    def crossover_length(self) -> float:
        """Context at which the model's MLA latent cache equals its KDA state + conv (inf without MLA)."""
        return (self.kda_state + self.kda_conv) / self.mla_per_token if self.mla_per_token else math.inf

    @property
    def layer_crossover_length(self) -> float:
        """Context at which one MLA layer's cache equals one KDA layer's recurrent state."""
        return (
            self.kda_state_per_layer / self.mla_per_token_per_layer
            if self.mla_per_token_per_layer
            else math.inf
        )


def cache_bytes(
    cfg: K3Config,
    context: int,
    *,
    kv_dtype: str = "bf16",
    state_dtype: str = "fp32",
    conv_dtype: str = "fp32",  # the engine keeps the short-conv history in fp32 (openk3.infer.cache)
) -> CacheBytes:
    n = _counts(cfg)
    kb, sb, cb = _dtype_bytes(kv_dtype), _dtype_bytes(state_dtype), _dtype_bytes(conv_dtype)
    per_layer_tok = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kb
    state, conv = _kda_state_values(cfg)
    return CacheBytes(
        context=context,
        mla=n["mla"] * per_layer_tok * context,
        kda_state=n["kda"] * state * sb,
        kda_conv=n["kda"] * conv * cb,
        mla_per_token=n["mla"] * per_layer_tok,
        kda_state_per_layer=state * sb if n["kda"] else 0.0,
        mla_per_token_per_layer=per_layer_tok if n["mla"] else 0.0,
    )


def crossover_length(cfg: K3Config, **dtypes: str) -> float:
    """Context length where the (linear) MLA latent cache overtakes the (constant) KDA state, whole model."""
    return cache_bytes(cfg, 0, **dtypes).crossover_length


@dataclass
class ServingMemory:
    batch: int
    context: int
    ep_ranks: int
    weights: float
    expert_weights: float
    cache: float
    per_gpu: float
    hbm_per_gpu: float

    @property
    def total(self) -> float:
        return self.weights + self.cache

    @property
    def fits(self) -> bool:
        return self.per_gpu <= self.hbm_per_gpu


def serving_memory(
    cfg: K3Config,
    batch: int,
    context: int,
    *,
    ep_ranks: int = 1,
    tp: int = 1,
    hw: str | Hardware = "h200",
    expert_dtype: str = "bf16",
    dense_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    state_dtype: str = "fp32",
) -> ServingMemory:
    """Weights + cache of ``batch`` sequences of ``context`` tokens on ``ep_ranks`` GPUs: experts split over all
    ranks, the other weights split over ``tp`` tensor-parallel ranks (``tp=1``: replicated, data-parallel
    attention), sequences spread evenly over the ``ep_ranks / tp`` groups (the MLA latent is replicated inside a
    TP group -- it is shared by all heads -- the KDA state is split by heads). Activations and the runtime's
    workspace are not included."""
    _check_tp(ep_ranks, tp)
    pc = param_counts(cfg)
    eb, db = _dtype_bytes(expert_dtype), _dtype_bytes(dense_dtype)
    experts = pc.total["moe_routed"] * eb
    dense = (pc.total_params - pc.total["moe_routed"]) * db
    cb = cache_bytes(cfg, context, kv_dtype=kv_dtype, state_dtype=state_dtype)
    h = get_hardware(hw)
    return ServingMemory(
        batch=batch,
        context=context,
        ep_ranks=ep_ranks,
        weights=experts + dense,
        expert_weights=experts,
        cache=batch * cb.total,
        per_gpu=experts / ep_ranks
        + dense / tp
        + batch * (cb.mla * tp + cb.kda_state + cb.kda_conv) / ep_ranks,
        hbm_per_gpu=h.hbm_bytes,
    )


def _check_tp(ep_ranks: int, tp: int) -> None:
    if ep_ranks < 1 or tp < 1 or ep_ranks % tp:
        raise ConfigError(
            f"need ep_ranks >= 1 and tp >= 1 with tp dividing ep_ranks; got ep_ranks={ep_ranks}, tp={tp}"
        )


def _rank_share(parts: dict[str, float], ep_ranks: int, tp: int) -> dict[str, float]:
    """Per-rank share of whole-model step bytes (see :func:`serving_memory` for the layout)."""
    share = {
        "expert_weights": 1.0 / ep_ranks,
        "dense_weights": 1.0 / tp,
        "embedding_rows": tp / ep_ranks,
        "mla_cache_read": tp / ep_ranks,
        "mla_cache_write": tp / ep_ranks,
    }
    return {k: v * share.get(k, 1.0 / ep_ranks) for k, v in parts.items()}


# ---------------------------------------------------------------------------------------------------------------
# step time (roofline)


@dataclass
class StepTime:
    """Roofline time of one step on one rank of the EP domain. ``t_step`` = max of the three when ``overlap``
    (communication hidden behind compute/memory), else max(t_hbm, t_compute) + t_net."""

    mode: str
    batch: int
    context: int
    ep_ranks: int
    hw: str
    tokens: int
    bytes_per_rank: float
    flops_per_rank: float
    net_bytes_per_rank: float
    t_hbm: float
    t_compute: float
    t_net: float
    t_step: float
    bound: str
    experts_touched_per_layer: float
    bytes_parts: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.t_step if self.t_step else math.inf

    @property
    def time_per_token(self) -> float:
        return self.t_step / self.tokens if self.tokens else 0.0


def step_time(
    cfg: K3Config,
    batch: int,
    context: int,
    hw: str | Hardware = "h200",
    *,
    mode: str = "decode",
    ep_ranks: int = 1,
    tp: int = 1,
    net: str | float = "auto",
    expert_dtype: str = "bf16",
    dense_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    state_dtype: str = "fp32",
    act_dtype: str = "fp8",
    compute_dtype: str = "bf16",
    overlap: bool = True,
) -> StepTime:
    """Roofline time of one decode step (``batch`` sequences, ``context`` cached tokens) or one prefill step
    (``batch`` prompts of ``context`` tokens) served over ``ep_ranks`` GPUs: experts split over all ranks, the
    other weights over ``tp`` tensor-parallel ranks (1 = replicated), sequences split evenly (layout of
    :func:`serving_memory`). Bytes from :func:`decode_step_bytes`, FLOPs from :func:`flops_per_token`, network
    from :func:`ep_comm` per MoE layer. Tensor-parallel all-reduce traffic is not modelled."""
    _check_tp(ep_ranks, tp)
    h = get_hardware(hw)
    E = ep_ranks
    by = decode_step_bytes(
        cfg,
        batch,
        context,
        expert_dtype=expert_dtype,
        dense_dtype=dense_dtype,
        kv_dtype=kv_dtype,
        state_dtype=state_dtype,
        mode=mode,
    )
    per_rank = _rank_share(by.parts, E, tp)
    fl = flops_per_token(cfg, context, "prefill" if mode == "prefill" else "decode").total * by.tokens / E
    n_moe = _counts(cfg)["moe"]
    net_b = (
        n_moe * ep_comm(cfg, by.tokens, E, h, net=net, act_dtype=act_dtype).bytes_per_rank if E > 1 else 0.0
    )
    nb = h.net_bw(net, E)
    t_h = sum(per_rank.values()) / h.hbm_bw
    t_c = fl / h.peak(compute_dtype)
    t_n = net_b / nb
    times = {"HBM-bound": t_h, "compute-bound": t_c, "network-bound": t_n}
    t_step = max(t_h, t_c, t_n) if overlap else max(t_h, t_c) + t_n
    return StepTime(
        mode=mode,
        batch=batch,
        context=context,
        ep_ranks=E,
        hw=h.name,
        tokens=by.tokens,
        bytes_per_rank=sum(per_rank.values()),
        flops_per_rank=fl,
        net_bytes_per_rank=net_b,
        t_hbm=t_h,
        t_compute=t_c,
        t_net=t_n,
        t_step=t_step,
        bound=max(times, key=times.get),
        experts_touched_per_layer=by.experts_touched_per_layer,
        bytes_parts=per_rank,
    )


def predict_decode_time(
    cfg: K3Config, batch: int, context: int, hw: str | Hardware = "h200-measured", **kw: Any
) -> float:
    """Predicted seconds per decode step (roofline: max of HBM time and compute time; plus network with EP), to
    compare with a measured decode step. Kernel-launch and framework overheads are not modelled: at small
    models and batches they dominate, so expect measured / predicted > 1 there."""
    return step_time(cfg, batch, context, hw, mode="decode", **kw).t_step


# ---------------------------------------------------------------------------------------------------------------
# workloads, tables, sweeps


@dataclass
class Workload:
    """Everything :func:`report`, :func:`compare` and :func:`sweep` need besides the config."""

    batch: list[int] = field(default_factory=lambda: [1, 256])
    context: int = 4096
    mode: str = "decode"
    ep_ranks: int = 1
    tp: int = 1
    tokens_per_domain: int | None = None  # default: the step's tokens (batch, or batch x context for prefill)
    hw: str = "h200"
    net: str = "auto"
    expert_dtype: str = "bf16"
    dense_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    state_dtype: str = "fp32"
    act_dtype: str = "fp8"
    compute_dtype: str = "bf16"
    overlap: bool = True
    regime_batches: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256, 1024, 4096, 16384])
    contexts: list[int] = field(default_factory=lambda: [4096, 32768, 131072, 262144, 1048576])

    def memory_kw(self) -> dict[str, Any]:
        """Keyword arguments of :func:`serving_memory` for this workload."""
        return {
            "ep_ranks": self.ep_ranks,
            "tp": self.tp,
            "hw": self.hw,
            "expert_dtype": self.expert_dtype,
            "dense_dtype": self.dense_dtype,
            "kv_dtype": self.kv_dtype,
            "state_dtype": self.state_dtype,
        }

    def step_kw(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ep_ranks": self.ep_ranks,
            "tp": self.tp,
            "net": self.net,
            "expert_dtype": self.expert_dtype,
            "dense_dtype": self.dense_dtype,
            "kv_dtype": self.kv_dtype,
            "state_dtype": self.state_dtype,
            "act_dtype": self.act_dtype,
            "compute_dtype": self.compute_dtype,
            "overlap": self.overlap,
        }

    def describe(self) -> str:
        return (
            f"hw={get_hardware(self.hw).name} EP={self.ep_ranks} TP={self.tp} net={self.net} context={self.context} "
            f"mode={self.mode} experts={self.expert_dtype} dense={self.dense_dtype} kv={self.kv_dtype} "
            f"state={self.state_dtype} act={self.act_dtype}"
        )


@dataclass
class Table:
    """A titled table. ``kinds`` says how to format each column: str, int, params, flops, bytes, time, x (ratio),
    float, pct, rate (tokens/s)."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    kinds: list[str]
    notes: list[str] = field(default_factory=list)
    row_kinds: list[str] | None = None  # if set: one kind per row for every column after the first

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r)) for r in self.rows]

    def cell_kinds(self, i: int) -> list[str]:
        if self.row_kinds is None:
            return self.kinds
        return [self.kinds[0]] + [self.row_kinds[i]] * (len(self.columns) - 1)


def _si(v: float, unit: str, digits: int = 4, giga: str = "G") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
        return "inf" if math.isinf(v) else "nan"
    a = abs(v)
    for s, f in (("P", 1e15), ("T", 1e12), (giga, 1e9), ("M", 1e6), ("k", 1e3)):
        if a >= f:
            return f"{v / f:.{digits}g} {s}{unit}"
    return f"{v:.{digits}g} {unit}".rstrip()


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, _Ratio):
        return f"{float(v):.3f}"
    if kind == "str" or isinstance(v, str):
        return str(v)
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if kind == "int":
        return f"{int(round(v)):,}"
    if kind == "params":
        return _si(v, "", 5, giga="B")
    if kind == "flops":
        return _si(v, "FLOP", 4)
    if kind == "bytes":
        return _si(v, "B", 4)
    if kind == "time":
        if v == 0:
            return "0"
        for s, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
            if abs(v) >= f:
                return f"{v / f:.4g} {s}"
        return f"{v:.3g} s"
    if kind == "x":
        return f"{v:.3g}"
    if kind == "pct":
        return f"{100 * v:.1f} %"
    if kind == "rate":
        return _si(v, "tok/s", 4)
    return f"{v:.4g}"


def render(tables: list[Table], fmt: str = "table", header: str = "") -> str:
    """Tables as an aligned terminal table, GitHub markdown, or JSON (raw numbers)."""
    if fmt == "json":
        out = {
            "header": header,
            "tables": [{"title": t.title, "rows": t.records(), "notes": t.notes} for t in tables],
        }
        return json.dumps(_finite(out), indent=2, default=_json_default) + "\n"
    if fmt not in ("table", "markdown"):
        raise ConfigError(f"format must be table, markdown or json, got {fmt!r}")
    lines: list[str] = []
    if header:
        lines += [f"# {header}" if fmt == "markdown" else header, ""]
    for t in tables:
        cells = [[_fmt(v, k) for v, k in zip(r, t.cell_kinds(i))] for i, r in enumerate(t.rows)]
        if fmt == "markdown":
            lines.append(f"### {t.title}")
            lines.append("")
            lines.append("| " + " | ".join(t.columns) + " |")
            lines.append("|" + "|".join("---" if k == "str" else "---:" for k in t.kinds) + "|")
            lines += ["| " + " | ".join(c) + " |" for c in cells]
            lines.append("")
            lines += [f"- {n}" for n in t.notes]
        else:
            widths = [
                max(len(str(c)), *(len(r[i]) for r in cells)) if cells else len(c)
                for i, c in enumerate(t.columns)
            ]
            lines.append(t.title)
            lines.append(
                "  ".join(
                    c.ljust(w) if k == "str" else c.rjust(w) for c, w, k in zip(t.columns, widths, t.kinds)
                )
            )
            lines.append("  ".join("-" * w for w in widths))
            for r in cells:
                lines.append(
                    "  ".join(c.ljust(w) if k == "str" else c.rjust(w) for c, w, k in zip(r, widths, t.kinds))
                )
            lines += [f"  * {n}" for n in t.notes]
        if t.notes or fmt != "markdown":
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _finite(o: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return _finite(asdict(o))
    return str(o)


# --- single-config report ---------------------------------------------------------------------------------------


def _P(v: float) -> str:
    return _si(v, "", 4, giga="B")


def _param_table(cfg: K3Config) -> Table:
    pc = param_counts(cfg)
    n = pc.layers
    per = pc.per_layer
    note = {
        "embedding": "not active (gather)",
        "kda": f"{n['kda']} x {_P(per['kda_layer'])}",
        "mla": f"{n['mla']} x {_P(per['mla_layer'])}",
        "dense_ffn": f"{n['dense']} x {_P(per['dense_ffn_layer'])}",
        "moe_routed": f"{n['moe']} x {cfg.num_experts} x {_P(per['routed_expert'])} "
        f"(top-{cfg.num_experts_per_token})",
        "moe_shared": f"{n['moe']} x {_P(per['moe_shared'])}",
        "moe_latent": f"{n['moe']} x {_P(per['moe_latent'])}" if cfg.use_latent_moe else "no LatentMoE",
        "router": f"{n['moe']} x {_P(per['moe_router'])}",
        "attn_res": f"{4 * cfg.num_hidden_layers + 2} vectors" if cfg.use_attn_res else "no AttnRes",
        "norms": "layer + final RMSNorms",
        "lm_head": "tied" if cfg.tie_word_embeddings else "untied",
    }
    rows = [[k, pc.total[k], pc.active[k], note[k]] for k in PARAM_COMPONENTS]
    rows.append(["total", pc.total_params, pc.active_params, f"MoE layer {_P(per['moe_layer'])}"])
    return Table(
        f"Parameters ({cfg.name or 'config'})",
        ["component", "total", "active/token", "detail"],
        rows,
        ["str", "params", "params", "str"],
        ["active excludes the input embedding and counts top-K routed experts"],
    )


def _flops_table(cfg: K3Config, context: int) -> Table:
    pre = flops_per_token(cfg, context, "prefill")
    dec = flops_per_token(cfg, context, "decode")
    tr = flops_per_token(cfg, context, "train")
    rows = [[k, pre[k], dec[k], tr[k]] for k in FLOP_COMPONENTS]
    rows.append(["total", pre.total, dec.total, tr.total])
    return Table(
        f"FLOPs per token at context {context:,}",
        ["component", "prefill (avg)", "decode", "train (fwd+bwd)"],
        rows,
        ["str", "flops", "flops", "flops"],
        [
            "MLA attention grows with context (prefill causal average (c+1)/2 keys, decode absorbed over c+1); "
            "KDA state cost is constant",
            "elementwise work (norms, activations, softmax, gates) not counted",
        ],
    )


def _decode_table(cfg: K3Config, wl: Workload) -> Table:
    sts = [step_time(cfg, b, wl.context, wl.hw, **wl.step_kw()) for b in wl.batch]
    keys = list(sts[0].bytes_parts)
    rows = [[k] + [s.bytes_parts[k] for s in sts] for k in keys]
    rows.append(["total HBM bytes / rank"] + [s.bytes_per_rank for s in sts])
    rows.append(["experts touched / layer"] + [s.experts_touched_per_layer for s in sts])
    rows.append(["FLOPs / rank"] + [s.flops_per_rank for s in sts])
    rows.append(["network bytes / rank"] + [s.net_bytes_per_rank for s in sts])
    rows.append(["t_hbm"] + [s.t_hbm for s in sts])
    rows.append(["t_compute"] + [s.t_compute for s in sts])
    rows.append(["t_net"] + [s.t_net for s in sts])
    rows.append(["t_step"] + [s.t_step for s in sts])
    rows.append(["tokens/s (domain)"] + [s.tokens_per_s for s in sts])
    rows.append(["bound"] + [s.bound for s in sts])
    row_kinds = ["bytes"] * len(keys) + ["bytes", "float", "flops", "bytes"] + ["time"] * 4 + ["rate", "str"]
    return Table(
        f"{wl.mode.capitalize()} step at context {wl.context:,} ({wl.describe()})",
        ["per step"] + [f"batch {b}" for b in wl.batch],
        rows,
        ["str"] + ["x"] * len(wl.batch),
        [
            "experts touched: N (1 - (1 - K/N)^tokens) per MoE layer (uniform routing); per rank: experts split "
            "over the EP ranks, other weights over TP (replicated at TP 1), sequences over the EP/TP groups"
        ],
        row_kinds=row_kinds,
    )


def _mem_per_gpu(cfg: K3Config, batch: int, wl: Workload) -> float:
    return serving_memory(cfg, batch, wl.context, **wl.memory_kw()).per_gpu


def regime_table(cfg: K3Config, batches: list[int], wl: Workload | None = None, **kw: Any) -> Table:
    """Batch sweep across the latency-bound and throughput regimes: per row the MoE layer's tokens per expert,
    arithmetic intensity, expert/network times and verdict, and the whole step's roofline time and bound."""
    wl = wl or Workload(**kw)
    h = get_hardware(wl.hw)
    rows = []
    for b in batches:
        st = step_time(cfg, b, wl.context, h, **wl.step_kw())
        t = wl.tokens_per_domain or st.tokens
        ep = ep_comm(
            cfg,
            t,
            wl.ep_ranks,
            h,
            net=wl.net,
            expert_dtype=wl.expert_dtype,
            act_dtype=wl.act_dtype,
            compute_dtype=wl.compute_dtype,
        )
        rows.append(
            [
                b,
                ep.tokens_per_expert,
                ep.arithmetic_intensity,
                ep.t_hbm,
                ep.t_compute,
                ep.t_net,
                ep.ratio,
                ep.bound,
                st.t_step,
                st.time_per_token,
                st.tokens_per_s,
                st.bound,
                _mem_per_gpu(cfg, b, wl),
            ]
        )
    ep1 = ep_comm(
        cfg, 1, max(wl.ep_ranks, 2), h, net=wl.net, act_dtype=wl.act_dtype, compute_dtype=wl.compute_dtype
    )
    notes = [
        f"machine balance F/B_hbm = {h.peak(wl.compute_dtype) / h.hbm_bw:.0f} FLOP/B; expert GEMM AI ~ "
        f"2 (tK/N) / b_w; network {h.net_bw(wl.net, wl.ep_ranks) / 1e9:.0f} GB/s per GPU",
        f"compute-bound comm/compute limit b_act F / (3 m B_net) = {ep1.ratio_limit:.3g}"
        + ("" if wl.ep_ranks > 1 else " (at EP > 1; EP = 1 has no network)"),
        "MoE columns: one MoE layer on one rank (expected values under uniform routing); step columns: the whole "
        f"model; mem/GPU: weights + cache at context {wl.context:,} (HBM {h.hbm_bytes / 1e9:.0f} GB)",
    ]
    return Table(
        f"Serving regimes ({cfg.name or 'config'}, {wl.describe()})",
        [
            "batch",
            "tok/expert",
            "AI (FLOP/B)",
            "MoE t_hbm",
            "MoE t_comp",
            "MoE t_net",
            "comm/comp",
            "MoE verdict",
            "step time",
            "time/token",
            "tokens/s",
            "step bound",
            "mem/GPU",
        ],
        rows,
        ["int", "x", "x", "time", "time", "time", "x", "str", "time", "time", "rate", "str", "bytes"],
        notes,
    )


def _cache_table(cfg: K3Config, wl: Workload, batch: int) -> Table:
    rows = []
    for c in wl.contexts:
        cb = cache_bytes(cfg, c, kv_dtype=wl.kv_dtype, state_dtype=wl.state_dtype)
        sm = serving_memory(cfg, batch, c, **wl.memory_kw())
        rows.append(
            [
                c,
                cb.mla,
                cb.kda_state + cb.kda_conv,
                cb.total,
                sm.cache,
                sm.weights,
                sm.per_gpu,
                "yes" if sm.fits else "no",
            ]
        )
    cb0 = cache_bytes(cfg, 0, kv_dtype=wl.kv_dtype, state_dtype=wl.state_dtype)
    return Table(
        f"Cache per sequence and serving memory (batch {batch}, EP {wl.ep_ranks}, TP {wl.tp}, {wl.hw})",
        [
            "context",
            "MLA latent",
            "KDA state+conv",
            "cache/seq",
            "cache (batch)",
            "weights",
            "per GPU",
            "fits",
        ],
        rows,
        ["int", "bytes", "bytes", "bytes", "bytes", "bytes", "bytes", "str"],
        [
            f"crossover: MLA latent = KDA state at {cb0.crossover_length:,.0f} tokens (whole model); one MLA layer "
            f"= one KDA layer's state at {cb0.layer_crossover_length:,.0f} tokens",
            f"MLA latent {cb0.mla_per_token:,.0f} B/token; KDA state {cb0.kda_state / 1e6:,.1f} MB + conv "
            f"{cb0.kda_conv / 1e6:,.2f} MB per sequence",
        ],
    )


def report(cfg: K3Config, wl: Workload | None = None) -> list[Table]:
    """The full single-config report: parameters, FLOPs, step bytes/time, serving regimes, cache/memory."""
    wl = wl or Workload()
    return [
        _param_table(cfg),
        _flops_table(cfg, wl.context),
        _decode_table(cfg, wl),
        regime_table(cfg, wl.regime_batches, wl),
        _cache_table(cfg, wl, max(wl.batch)),
    ]


# --- comparisons and sweeps -------------------------------------------------------------------------------------

_METRICS: list[tuple[str, str]] = [
    ("experts N", "int"),
    ("top-K", "int"),
    ("expert width W", "int"),
    ("N x W", "int"),
    ("K x W (all-to-all / token)", "int"),
    ("total params", "params"),
    ("active params", "params"),
    ("routed expert params", "params"),
    ("FLOPs/token prefill", "flops"),
    ("FLOPs/token decode", "flops"),
    ("FLOPs/token train", "flops"),
    ("MLA cache / token", "bytes"),
    ("cache / seq", "bytes"),
    ("crossover length", "int"),
    ("EP bytes / token / MoE layer", "bytes"),
    ("EP bytes / token (model)", "bytes"),
]


def _metrics(cfg: K3Config, wl: Workload) -> dict[str, Any]:
    pc = param_counts(cfg)
    n = pc.layers
    ep = ep_comm(cfg, 1, max(wl.ep_ranks, 2), wl.hw, net=wl.net, act_dtype=wl.act_dtype)
    cb = cache_bytes(cfg, wl.context, kv_dtype=wl.kv_dtype, state_dtype=wl.state_dtype)
    m: dict[str, Any] = {
        "experts N": cfg.num_experts,
        "top-K": cfg.num_experts_per_token,
        "expert width W": cfg.moe_width,
        "N x W": cfg.num_experts * cfg.moe_width,
        "K x W (all-to-all / token)": cfg.num_experts_per_token * cfg.moe_width,
        "total params": pc.total_params,
        "active params": pc.active_params,
        "routed expert params": pc.total["moe_routed"],
        "FLOPs/token prefill": flops_per_token(cfg, wl.context, "prefill").total,
        "FLOPs/token decode": flops_per_token(cfg, wl.context, "decode").total,
        "FLOPs/token train": flops_per_token(cfg, wl.context, "train").total,
        "MLA cache / token": cb.mla_per_token,
        "cache / seq": cb.total,
        "crossover length": cb.crossover_length,
        "EP bytes / token / MoE layer": ep.bytes_per_token,
        "EP bytes / token (model)": ep.bytes_per_token * n["moe"],
    }
    for b in wl.batch:
        st = step_time(cfg, b, wl.context, wl.hw, **wl.step_kw())
        m[f"HBM bytes/step b={b}"] = st.bytes_per_rank
        m[f"step time b={b}"] = st.t_step
        m[f"bound b={b}"] = st.bound
    return m


def _metric_kinds(wl: Workload) -> list[tuple[str, str]]:
    out = list(_METRICS)
    for b in wl.batch:
        out += [(f"HBM bytes/step b={b}", "bytes"), (f"step time b={b}", "time"), (f"bound b={b}", "str")]
    return out


def compare(cfgs: list[K3Config], wl: Workload | None = None, labels: list[str] | None = None) -> Table:
    """Side-by-side metrics; the last column is the ratio last / first for numeric rows."""
    wl = wl or Workload()
    labels = labels or [c.name or f"config{i}" for i, c in enumerate(cfgs)]
    ms = [_metrics(c, wl) for c in cfgs]
    rows, row_kinds = [], []
    for key, kind in _metric_kinds(wl):
        vals = [m[key] for m in ms]
        row = [key] + vals
        if len(cfgs) > 1:
            ok = kind != "str" and vals[0] not in (0, None) and math.isfinite(float(vals[0]))
            row.append(_Ratio(float(vals[-1]) / float(vals[0])) if ok else None)
        rows.append(row)
        row_kinds.append(kind)
    cols = ["metric"] + labels + ([f"{labels[-1]}/{labels[0]}"] if len(cfgs) > 1 else [])
    return Table(
        f"Comparison ({wl.describe()})",
        cols,
        rows,
        ["str"] * len(cols),
        ["EP bytes = dispatch + combine = 2 K W b_act per token per MoE layer (W = latent width or d)"],
        row_kinds=row_kinds,
    )


class _Ratio(float):
    """A ratio cell in a table whose rows carry other units: always printed as a plain number."""


def _latent_variant(cfg: K3Config, alpha: float, variant: str) -> K3Config:
    d = cfg.hidden_size
    a0 = d / cfg.moe_width
    if not (math.isfinite(alpha) and alpha >= 1):
        raise ConfigError(f"latent_alpha must be a finite number >= 1 (latent width d / alpha), got {alpha}")
    W = round(d / alpha)
    if W < 1 or W > d:
        raise ConfigError(f"latent_alpha={alpha} gives latent width {W}; it must lie in [1, hidden_size={d}]")
    if variant == "eff":
        N, K = cfg.num_experts, cfg.num_experts_per_token
    elif variant == "acc":
        N = round(cfg.num_experts / a0 * alpha)
        K = round(cfg.num_experts_per_token / a0 * alpha)
    else:
        raise ConfigError(f"variant must be 'eff' or 'acc', got {variant!r}")
    K = min(K, N)
    groups = cfg.num_expert_group if N % cfg.num_expert_group == 0 else 1
    return cfg.replace(
        routed_expert_hidden_size=None if W == d else W,
        num_experts=N,
        num_experts_per_token=K,
        num_expert_group=groups,
        topk_group=min(cfg.topk_group, groups),
    )


def _coerce(cfg: K3Config, key: str, raw: str) -> Any:
    cur = getattr(cfg, key)
    if raw.lower() in ("none", "null"):
        return None
    if isinstance(cur, list) or raw.lstrip().startswith("["):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ConfigError(f"{key}: expected a JSON list such as [4,8,12], got {raw!r}") from None
    if isinstance(cur, bool):
        word = raw.strip().lower()
        if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ConfigError(f"{key}: expected true or false, got {raw!r}")
        return word in ("1", "true", "yes", "on")
    if isinstance(cur, int) or (cur is None and raw.lstrip("-").isdigit()):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {raw!r}") from None
    if isinstance(cur, float) or cur is None:
        try:
            return float(raw)
        except ValueError:
            return raw
    return raw


WORKLOAD_KEYS = ("batch", "context")


def sweep_configs(
    cfg: K3Config, key: str, values: list[str], variant: str = "eff"
) -> list[tuple[str, K3Config]]:
    """(label, config) for every value of a config sweep.

    ``latent_alpha``: latent width ``d / alpha``. ``eff`` keeps the base's N experts and top-K ("bank the
    savings"); ``acc`` reinvests: N' = N1 alpha, K' = K1 alpha from the alpha = 1 design (N1, K1) = (N, K) /
    alpha0 of the base (alpha0 = d / its width), so N' l = N1 d (total expert parameters) and K' l = K1 d
    (all-to-all bytes) stay fixed. ``mla_split``: ``kv_lora_rank:qk_rope_head_dim`` (cache values per token =
    the sum). Any other :class:`K3Config` field: ``field=v1,v2``."""
    out = []
    for raw in values:
        if key == "latent_alpha":
            try:
                a = float(raw)
            except ValueError:
                raise ConfigError(f"latent_alpha values are numbers such as 1,2,4; got {raw!r}") from None
            c = _latent_variant(cfg, a, variant)
            label = f"alpha={raw} ({variant})"
        elif key == "mla_split":
            try:
                kv, r = (int(x) for x in raw.split(":"))
            except ValueError:
                raise ConfigError(
                    f"mla_split values look like 512:64 (kv_lora_rank:qk_rope_head_dim), got {raw!r}"
                ) from None
            c = cfg.replace(kv_lora_rank=kv, qk_rope_head_dim=r)
            label = f"{kv}:{r}"
        elif key in K3Config.__dataclass_fields__:
            c = cfg.replace(**{key: _coerce(cfg, key, raw)})
            label = f"{key}={raw}"
        else:
            raise ConfigError(
                f"cannot sweep {key!r}: use latent_alpha, mla_split, batch, context or a K3Config field name"
            )
        c.name = f"{cfg.name}[{label}]" if cfg.name else label
        out.append((label, c))
    return out


def sweep(
    cfg: K3Config, key: str, values: list[str], wl: Workload | None = None, variant: str = "eff"
) -> Table:
    """One table for a sweep: the regime table for ``batch``, a context table for ``context``, else a
    comparison of the swept configs (see :func:`sweep_configs`)."""
    wl = wl or Workload()
    if key == "batch":
        return regime_table(cfg, [int(v) for v in values], wl)
    if key == "context":
        rows = []
        for v in values:
            c = int(v)
            cb = cache_bytes(cfg, c, kv_dtype=wl.kv_dtype, state_dtype=wl.state_dtype)
            rows.append(
                [
                    c,
                    flops_per_token(cfg, c, "prefill").total,
                    flops_per_token(cfg, c, "decode").total,
                    cb.total,
                ]
                + [step_time(cfg, b, c, wl.hw, **wl.step_kw()).t_step for b in wl.batch]
            )
        return Table(
            f"Context sweep ({cfg.name}, {wl.describe()})",
            ["context", "prefill FLOPs/tok", "decode FLOPs/tok", "cache/seq"]
            + [f"step b={b}" for b in wl.batch],
            rows,
            ["int", "flops", "flops", "bytes"] + ["time"] * len(wl.batch),
        )
    pairs = sweep_configs(cfg, key, values, variant)
    t = compare([c for _, c in pairs], wl, labels=[lab for lab, _ in pairs])
    t.title = f"Sweep {key} ({cfg.name}{', ' + variant if key == 'latent_alpha' else ''}; {wl.describe()})"
    if key == "latent_alpha":
        t.notes.append(
            "eff: same N, K, width d/alpha (bank the savings); acc: N' = N1 alpha, K' = K1 alpha from the alpha=1 "
            "design, so N'l = N1 d and K'l = K1 d stay constant (reinvest)"
        )
    return t


# ---------------------------------------------------------------------------------------------------------------
# plots (matplotlib optional)


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("plots need matplotlib: pip install matplotlib (or openk3[plot])") from e
    return plt


def plot_regimes(cfg: K3Config, batches: list[int], path: str, wl: Workload | None = None) -> str:
    """Time per step and per token vs batch with the three bounds (HBM, compute, network), log-log."""
    plt = _plt()
    wl = wl or Workload()
    sts = [step_time(cfg, b, wl.context, wl.hw, **wl.step_kw()) for b in batches]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, per_tok in zip(axes, (False, True)):
        div = [s.tokens if per_tok else 1 for s in sts]
        ax.plot(
            batches,
            [s.t_step / q for s, q in zip(sts, div)],
            "-",
            color="0.75",
            lw=5,
            label="step (roofline)",
        )
        for attr, lab, sty in (
            ("t_hbm", "HBM", "--"),
            ("t_compute", "compute", "-."),
            ("t_net", "network", ":"),
        ):
            ys = [getattr(s, attr) / q for s, q in zip(sts, div)]
            if any(y > 0 for y in ys):
                ax.plot(batches, ys, sty, lw=1.5, label=f"{lab} bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences per step)" if wl.mode == "decode" else "prompts per step")
        ax.set_ylabel("seconds per token" if per_tok else "seconds per step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{cfg.name}: {wl.mode} at context {wl.context:,}\n{wl.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(cfgs: list[K3Config], contexts: list[int], path: str, wl: Workload | None = None) -> str:
    """Cache bytes per sequence vs context: constant KDA state, linear MLA latent, total; crossover marked."""
    plt = _plt()
    wl = wl or Workload()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cfg in cfgs:
        cbs = [cache_bytes(cfg, c, kv_dtype=wl.kv_dtype, state_dtype=wl.state_dtype) for c in contexts]
        (line,) = ax.plot(contexts, [c.total for c in cbs], "-", lw=2, label=f"{cfg.name} total")
        col = line.get_color()
        ax.plot(contexts, [c.mla for c in cbs], "--", color=col, label=f"{cfg.name} MLA latent")
        if cbs[0].kda_state:
            ax.plot(
                contexts,
                [c.kda_state + c.kda_conv for c in cbs],
                ":",
                color=col,
                label=f"{cfg.name} KDA state",
            )
        x = cbs[0].crossover_length
        if math.isfinite(x) and contexts[0] <= x <= contexts[-1]:
            ax.axvline(x, color=col, alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("bytes per sequence")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(pairs: list[tuple[str, K3Config]], path: str, wl: Workload | None = None) -> str:
    """Bars of the main costs of each swept config, relative to the first."""
    plt = _plt()
    wl = wl or Workload()
    keys = [
        "total params",
        "active params",
        "FLOPs/token decode",
        "EP bytes / token (model)",
        "cache / seq",
    ] + [f"HBM bytes/step b={b}" for b in wl.batch]
    ms = [_metrics(c, wl) for _, c in pairs]
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(keys)), 4.5))
    width = 0.8 / len(pairs)
    for i, ((lab, _), m) in enumerate(zip(pairs, ms)):
        vals = [float(m[k]) / float(ms[0][k]) if ms[0][k] else 0.0 for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=lab)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels(keys, rotation=25, ha="right", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel(f"relative to {pairs[0][0]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
