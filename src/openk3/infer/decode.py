"""Single-token decode steps over the engine's cache layouts (see :mod:`openk3.infer.cache`), with fast-path hooks.

Two steps run per decode iteration and per layer; each has a plain-PyTorch reference here and a registry that GPU
backends fill with functions of the same signature:

``FAST_KDA_DECODE[name](layer, q, k, v, z, beta_logits, gate, conv_state, state, slots) -> o``
    Fused KDA step (SPEC.md §1.5 steps 2-5) for ``B`` sequences, one token each.
    ``layer``: the :class:`~openk3.modules.kda.KimiDeltaAttention` module (conv weights ``layer.{q,k,v}_conv1d.weight``
    ``[HK, 1, W]`` fp32, ``layer.A_log``, ``layer.dt_bias`` ``[HK]`` fp32, ``layer.o_norm.weight`` ``[K]`` fp32,
    ``layer.gate_kind`` / ``layer.lower_bound`` / ``layer.eps`` / ``layer.num_heads`` / ``layer.head_dim``).
    ``q, k, v``: ``[B, HK]`` raw projections (before the conv), model dtype; ``z``: ``[B, HK]`` raw decay logits
    (``f_b_proj(f_a_proj(x))``); ``beta_logits``: ``[B, H]``; ``gate``: ``[B, HK]`` output-gate logits.
    ``conv_state``: ``[S, 3, HK, W-1]`` fp32 (this layer's slice of ``PagedHybridCache.conv``), ``state``:
    ``[S, H, K, V]`` fp32 (slice of ``PagedHybridCache.state``), both updated **in place** for rows ``slots [B]``
    (int64; padded rows point at the scratch slot, duplicates allowed there).
    Returns ``o [B, HK]`` in the model dtype: the gated-RMS-normed output, ready for ``o_proj``.

``FAST_MLA_DECODE[name](q, kv_cache, block_table, lengths, *, scale, kv_lora_rank) -> out``
    Absorbed (MQA 576/512) attention of one query token per sequence over the paged latent cache (SPEC.md §2.4).
    ``q``: ``[B, H, dc + dr]`` fp32, the absorbed query ``[W_UK^T q_nope ; q_rope]``; ``kv_cache``:
    ``[num_pages + 1, page_size, dc + dr]`` (this layer's slice of ``PagedHybridCache.kv``, cache dtype; the current
    token is already written); ``block_table``: ``[B, max_pages]`` int32 page ids (padding = scratch page);
    ``lengths``: ``[B]`` int32 valid tokens per row, the current one included (>= 1).
    Returns ``out [B, H, dc]`` fp32: ``softmax_j(scale * q . kv_j) @ kv_j[:dc]`` (the engine applies ``W_UV``).

Two optional steps around the MLA one (``EngineConfig.fuse_mla_glue``, at most a few rows), references here and
Triton kernels in :mod:`openk3.infer.kernels` (``mla_prep_triton``; the post step folded into the reduce of
``mla_decode_triton(..., w_uv=, gate=, out_dtype=)``, or ``mla_post_triton``), same signatures:

``mla_prep(q, c, kr, norm_weight, eps, w_uk, kv_cache, rows) -> ql``
    From one MLA layer's projection outputs: ``q`` ``[B, H, dn + dr]`` (model dtype), the raw latent ``c``
    ``[B, dc]`` and the shared key part ``kr`` ``[B, dr]``. RMS-normalises ``c`` with ``norm_weight`` / ``eps`` as
    :func:`openk3.ops.norm.rms_norm` does, writes ``[c_hat, kr]`` (cache dtype) into ``kv_cache`` (as above) at the
    flat rows ``rows [B]`` (int64, ``page * page_size + offset``) in place, and returns the absorbed query
    ``ql [B, H, dc + dr]`` fp32: ``[q_nope @ w_uk[h] ; q_rope]`` with ``w_uk [H, dn, dc]`` (fp32 products and sums;
    the model dtype or fp32 give the same values, the weights being upcast model-dtype rows).

``mla_post(cbar, w_uv, gate, out_dtype) -> o``
    ``cbar`` ``[B, H, dc]`` fp32 (the attention output) times ``w_uv[h]^T`` (``w_uv [H, dv, dc]``) in fp32, rounded
    to ``out_dtype``, times ``sigmoid(gate)`` when ``gate [B, H * dv]`` (model dtype) is given (sigmoid and product
    rounded to ``out_dtype`` like ``torch.sigmoid(gate) * o``): ``o [B, H * dv]`` in ``out_dtype``, ready for
    ``o_proj``.

Resolution (:func:`resolve_kda_decode`, :func:`resolve_mla_decode`): ``decode_backend="reference"`` or a registered
name forces that step; otherwise, on CUDA, ``FAST_*_DECODE[name]`` with ``name = openk3.ops.backend.resolve(op, True)``
if registered under that name, else the most recently registered entry, else the reference; off CUDA the reference.
Register only kernels that can run here (check Triton / the GPU first). Both references avoid host synchronisation,
so a decode step built from them can be captured in a CUDA graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from openk3.ops import backend as _backend
from openk3.ops.kda import kda_gate, l2norm
from openk3.ops.norm import gated_rms_norm, rms_norm

__all__ = [
    "FAST_KDA_DECODE",
    "FAST_MLA_DECODE",
    "kda_decode_reference",
    "mla_decode_reference",
    "mla_post_reference",
    "mla_prep_reference",
    "resolve_kda_decode",
    "resolve_mla_decode",
]

log = logging.getLogger("openk3.infer")

FAST_KDA_DECODE: dict[str, Callable] = {}
FAST_MLA_DECODE: dict[str, Callable] = {}


def kda_decode_reference(
    layer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    gate: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Reference single-token KDA step (signature and layouts in the module docstring)."""
    B = q.shape[0]
    H, K = layer.num_heads, layer.head_dim
    dtype = q.dtype
    # 1. short conv over [history, current] (fp32), SiLU; shift the history
    w = torch.stack([layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight]).squeeze(2).float()
    hist = conv_state.index_select(0, slots)  # [B, 3, HK, W-1]
    cur = torch.stack([q, k, v], dim=1).float().unsqueeze(-1)  # [B, 3, HK, 1]
    full = torch.cat([hist, cur], dim=-1)  # [B, 3, HK, W]
    y = F.silu((full * w).sum(-1)).to(dtype)  # [B, 3, HK]
    conv_state.index_copy_(0, slots, full[..., 1:])
    qc, kc, vc = (y[:, i].view(B, H, K) for i in range(3))
    # 2. gates, L2 norm, query scale (fp32)
    g = kda_gate(
        z.view(B, H, K), layer.A_log[:H], layer.dt_bias, kind=layer.gate_kind, lower_bound=layer.lower_bound
    )
    beta = torch.sigmoid(beta_logits.float())[..., None]  # [B, H, 1]
    qn = l2norm(qc.float()) * K**-0.5
    kn = l2norm(kc.float())
    # 3. delta-rule update, read after the write
    S = state.index_select(0, slots) * torch.exp(g)[..., None]  # [B, H, K, V]
    pred = (kn[..., None] * S).sum(-2)  # [B, H, V]
    S = S + kn[..., None] * (beta * (vc.float() - pred))[..., None, :]
    o = (qn[..., None] * S).sum(-2)  # [B, H, V]
    state.index_copy_(0, slots, S)
    # 4. gated RMSNorm per head
    o = gated_rms_norm(o.to(dtype), layer.o_norm.weight, gate.view(B, H, K), layer.eps)
    return o.reshape(B, H * K)


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Reference paged absorbed attention (signature in the module docstring): gathers each row's pages into a
    contiguous ``[B, max_pages * page_size, dc + dr]`` view, masks positions >= length (scores and values), softmax
    in fp32."""
    B, Hq, Dl = q.shape
    P, ps, _ = kv_cache.shape
    kv = kv_cache.index_select(0, block_table.reshape(-1).long()).view(B, -1, Dl).float()  # [B, S, Dl]
    logits = torch.einsum("bhd,bsd->bhs", q.float(), kv) * scale
    pos = torch.arange(kv.shape[1], device=q.device)
    past = pos[None, :] >= lengths.long()[:, None]  # [B, S]
    logits = logits.masked_fill(past[:, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    # rows past a length (the rest of a row's last page, recycled pages) may hold anything, NaN included: zeroed, so
    # that a zero weight times them stays zero
    return torch.einsum("bhs,bsc->bhc", p, kv[..., :kv_lora_rank].masked_fill(past[..., None], 0.0))


def mla_prep_reference(
    q: torch.Tensor,
    c: torch.Tensor,
    kr: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_uk: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """Reference MLA prep step (signature in the module docstring): the engine's unfused sequence (norm, cache
    write, absorbed query)."""
    dn = w_uk.shape[1]
    c_hat = rms_norm(c, norm_weight, eps)
    latent = torch.cat([c_hat, kr.to(c_hat.dtype)], dim=-1)
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, rows, latent.to(kv_cache.dtype))
    qa = torch.bmm(q[..., :dn].float().transpose(0, 1), w_uk.float())  # [H, B, dc]
    return torch.cat([qa.transpose(0, 1), q[..., dn:].float()], dim=-1)


def mla_post_reference(
    cbar: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """Reference MLA post step (signature in the module docstring)."""
    B, H, _ = cbar.shape
    o = torch.bmm(cbar.transpose(0, 1), w_uv.float().transpose(1, 2))  # [H, B, dv]
    o = o.transpose(0, 1).to(out_dtype).reshape(B, H * w_uv.shape[1])
    return o if gate is None else torch.sigmoid(gate) * o


def resolve_kda_decode(
    is_cuda: bool, requested: str | None = None, forced: str | None = None, config=None
) -> Callable:
    """The KDA decode step to use: ``forced="reference"`` or a name in :data:`FAST_KDA_DECODE` wins; otherwise the
    backend that ``openk3.ops.backend.resolve("kda", ...)`` picks if it registered a decode step, else the reference.
    With the model ``config``, a fast step whose ``supports(config)`` says no is refused: a clear ``ValueError`` when
    it was forced, the reference with a one-line notice otherwise."""
    return _resolve("kda", FAST_KDA_DECODE, kda_decode_reference, is_cuda, requested, forced, config)


def resolve_mla_decode(
    is_cuda: bool, requested: str | None = None, forced: str | None = None, config=None
) -> Callable:
    return _resolve("mla", FAST_MLA_DECODE, mla_decode_reference, is_cuda, requested, forced, config)


def _supported(fn, config) -> tuple[bool, str]:
    check = getattr(fn, "supports", None)
    if config is None or check is None:
        return True, ""
    return check(config)


def _resolve(op, table, ref, is_cuda, requested, forced, config=None):
    if forced == "reference":
        return ref
    if forced:
        if forced not in table:
            raise ValueError(f"no {op} decode step named {forced!r}; registered: {sorted(table) or 'none'}")
        ok, why = _supported(table[forced], config)
        if not ok:
            raise ValueError(f"{op} decode step {forced!r} cannot run this model: {why}")
        return table[forced]
    if not is_cuda or not table:
        return ref
    name = _backend.resolve(op, is_cuda, requested)
    fn = table[name] if name in table else table[list(table)[-1]]
    ok, why = _supported(fn, config)
    if not ok:
        log.warning("openk3: %s decode uses the reference step (%s)", op, why)
        return ref
    return fn
