"""Plain-PyTorch MLA attention (materialises the score matrix; fp32 softmax).

Two mathematically equal forms (SPEC.md §2.2, §2.4):

* MHA form: per-head keys ``k_h = [W_UK_h c_hat ; k_r]`` (the 64-d part shared by all heads, never rotated) and
  values ``v_h = W_UV_h c_hat``; scores ``q_h . k_h * scale`` with ``scale = (d_nope + d_rope) ** -0.5``.
* absorbed (MQA) form: ``q~_h = W_UK_h^T q_nope_h`` (width kv_lora_rank), one shared key ``[c_hat ; k_r]`` and one
  shared value ``c_hat``; ``o_h = W_UV_h (softmax(...) c_hat)``. Same scale.
"""

from __future__ import annotations

import torch


def varlen_causal_mask(
    q_len: int, k_len: int, *, device, cu_seqlens: torch.Tensor | None = None, q_offset: int | None = None
) -> torch.Tensor:
    """Boolean mask [q_len, k_len], True = may attend. Queries are the last ``q_len`` positions of the keys unless
    ``q_offset`` says otherwise. With ``cu_seqlens`` (packed, q_len == k_len) attention is block-diagonal causal."""
    off = (k_len - q_len) if q_offset is None else q_offset
    qi = torch.arange(q_len, device=device)[:, None] + off
    ki = torch.arange(k_len, device=device)[None, :]
    mask = ki <= qi
    if cu_seqlens is not None:
        if q_len != k_len:
            raise ValueError("packed (cu_seqlens) attention needs as many keys as queries")
        seg = torch.zeros(k_len, dtype=torch.long, device=device)
        seg[cu_seqlens[1:-1].long()] = 1
        seg = seg.cumsum(0)
        mask = mask & (seg[:, None] == seg[None, :])
    return mask


def mla_mha_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    causal: bool = True,
    return_max_logit: bool = False,
):
    """q: [B, T, H, Dqk]; k: [B, S, H, Dqk]; v: [B, S, H, Dv] (S >= T; queries are the last T positions).
    Returns o [B, T, H, Dv] (q.dtype) and, if asked, the per-head max scaled logit [H] (fp32, over the batch)."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    logits = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    if causal:
        mask = varlen_causal_mask(T, S, device=q.device, cu_seqlens=cu_seqlens)
        logits = logits.masked_fill(~mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    o = torch.einsum("bhts,bshd->bthd", p, v.float()).to(q.dtype)
    if return_max_logit:
        return o, logits.detach().amax(dim=(0, 2, 3))
    return o


def mla_absorbed_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    c: torch.Tensor,
    k_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
    lengths: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Absorbed MLA over the latent cache.

    q_nope: [B, T, H, Dn]; q_rope: [B, T, H, Dr]; c: [B, S, Dc] (normed latent); k_rope: [B, S, Dr];
    w_uk: [H, Dn, Dc]; w_uv: [H, Dv, Dc]; lengths: optional [B] valid cache lengths (queries are the last T of each
    row's valid prefix). Returns o [B, T, H, Dv] in q_nope.dtype.
    """
    B, T, H, _ = q_nope.shape
    S = c.shape[1]
    qa = torch.einsum("bthn,hnc->bthc", q_nope.float(), w_uk.float())  # [B,T,H,Dc]
    logits = torch.einsum("bthc,bsc->bhts", qa, c.float())
    if q_rope.shape[-1]:
        logits = logits + torch.einsum("bthr,bsr->bhts", q_rope.float(), k_rope.float())
    logits = logits * scale
    kpos = torch.arange(S, device=c.device)
    if lengths is None:
        lengths = torch.full((B,), S, device=c.device, dtype=torch.long)
    valid = kpos[None, :] < lengths[:, None]  # [B, S]
    mask = valid[:, None, None, :].expand(B, 1, T, S)
    if causal:
        qpos = lengths[:, None] - T + torch.arange(T, device=c.device)[None, :]  # [B, T]
        mask = mask & (kpos[None, None, :] <= qpos[:, :, None])[:, None]
    logits = logits.masked_fill(~mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    cbar = torch.einsum("bhts,bsc->bthc", p, c.float())
    o = torch.einsum("bthc,hvc->bthv", cbar, w_uv.float())
    return o.to(q_nope.dtype)


@torch.no_grad()
def mla_max_logit(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    block: int = 1024,
) -> torch.Tensor:
    """Per-head max of the scaled causal pre-softmax logits over the batch (the QK-Clip statistic), computed in
    query blocks so memory stays O(block x S) whatever attention kernel produced the output.
    q: [B, T, H, D]; k: [B, S, H, D] (queries are the last T positions). Returns [H] fp32."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    out = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    full_mask = (
        varlen_causal_mask(T, S, device=q.device, cu_seqlens=cu_seqlens) if cu_seqlens is not None else None
    )
    kf = k.float()
    for s0 in range(0, T, block):
        s1 = min(T, s0 + block)
        logits = torch.einsum("bthd,bshd->bhts", q[:, s0:s1].float(), kf) * scale
        if full_mask is not None:
            mask = full_mask[s0:s1]
        else:
            qi = torch.arange(s0, s1, device=q.device)[:, None] + (S - T)
            mask = torch.arange(S, device=q.device)[None, :] <= qi
        logits = logits.masked_fill(~mask, float("-inf"))
        out = torch.maximum(out, logits.amax(dim=(0, 2, 3)))
    return out
