"""Gated MLA with NoPE (SPEC.md §2)."""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import K3Config
from openk3.modules.norm import RMSNorm
from openk3.ops import backend as _backend
from openk3.ops.mla import mla_absorbed_attention, mla_max_logit, mla_mha_attention

# Fast-path hooks registered by GPU backends: name -> fn(q, k, v, scale=, cu_seqlens=) -> o
FAST_MHA: dict[str, callable] = {}
FAST_ABSORBED: dict[str, callable] = {}


class MLAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        if not config.mla_use_nope:
            raise ValueError(
                "mla_use_nope=False (RoPE MLA) is not supported: openk3 implements the NoPE MLA of K3 / Kimi Linear"
            )
        d = config.hidden_size
        H = config.num_attention_heads
        self.layer_idx = layer_idx
        self.num_heads = H
        self.dn, self.dr, self.dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.dc = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scale = (self.dn + self.dr) ** -0.5  # plain, no mscale (SPEC.md §2.2)
        self.backend: str | None = None
        self.decode_form = "absorbed"  # for cached steps with few new tokens
        self.absorbed_max_len = 1
        self.record_max_logit = False
        self.max_logit: torch.Tensor | None = None
        dq = H * (self.dn + self.dr)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.mla_latent_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.dc + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.dc, config.mla_latent_norm_eps)
        self.kv_b_proj = nn.Linear(self.dc, H * (self.dn + self.dv), bias=False)
        self.use_gate = config.mla_use_output_gate
        if self.use_gate:
            self.g_proj = nn.Linear(d, H * self.dv, bias=False)
        self.o_proj = nn.Linear(H * self.dv, d, bias=False)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_hat [B,T,dc] normed latent, k_r [B,T,dr] shared unrotated key part) -- what the cache holds."""
        ckv = self.kv_a_proj_with_mqa(x)
        c, kr = ckv.split([self.dc, self.dr], dim=-1)
        return self.kv_a_layernorm(c), kr

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, dn, dc], W_UV [H, dv, dc]) from kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.dc)
        return w[:, : self.dn], w[:, self.dn :]

    def forward(
        self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, cache: dict | None = None
    ) -> torch.Tensor:
        """x: [B, T, D]. cache: this layer's dict with ``c`` [B, S, dc] and ``kr`` [B, S, dr], extended in place."""
        B, T, _ = x.shape
        q = self.project_q(x).view(B, T, self.num_heads, self.dn + self.dr)
        c, kr = self.latent(x)
        return self.output(self.attend(q, c, kr, x.dtype, cu_seqlens=cu_seqlens, cache=cache), x)

    def attend(
        self,
        q: torch.Tensor,
        c: torch.Tensor,
        kr: torch.Tensor,
        dtype: torch.dtype,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cache: dict | None = None,
    ) -> torch.Tensor:
        """The attention core: queries ``q`` [B, T, H, dn + dr] over the latent ``c`` / ``kr`` of the same tokens,
        after the ``cache``'s earlier ones (extended in place). Returns the heads' values [B, T, H * dv] in
        ``dtype`` (the layer input's)."""
        B, T, H = q.shape[0], q.shape[1], self.num_heads
        if cache is not None:
            if "c" in cache:
                c = torch.cat([cache["c"], c.to(cache["c"].dtype)], dim=1)
                kr = torch.cat([cache["kr"], kr.to(cache["kr"].dtype)], dim=1)
            cache["c"], cache["kr"] = c, kr
        S = c.shape[1]
        be = _backend.resolve("mla", q.is_cuda, self.backend)
        if (
            cache is not None
            and T <= self.absorbed_max_len
            and self.decode_form == "absorbed"
            and not self.record_max_logit
        ):
            w_uk, w_uv = self.absorbed_weights()
            fn = mla_absorbed_attention if be == "reference" or be not in FAST_ABSORBED else FAST_ABSORBED[be]
            o = fn(
                q[..., : self.dn],
                q[..., self.dn :],
                c.to(dtype),
                kr.to(dtype),
                w_uk,
                w_uv,
                scale=self.scale,
            )
        else:
            kv = self.kv_b_proj(c.to(dtype)).view(B, S, H, self.dn + self.dv)
            k_nope, v = kv.split([self.dn, self.dv], dim=-1)
            k = torch.cat([k_nope, kr.to(dtype)[:, :, None, :].expand(B, S, H, self.dr)], dim=-1)
            if be == "reference" or be not in FAST_MHA:
                res = mla_mha_attention(
                    q, k, v, scale=self.scale, cu_seqlens=cu_seqlens, return_max_logit=self.record_max_logit
                )
                if self.record_max_logit:
                    o, self.max_logit = res
                else:
                    o = res
            else:
                o = FAST_MHA[be](q, k, v, scale=self.scale, cu_seqlens=cu_seqlens)
                if self.record_max_logit:  # QK-Clip statistic beside the fused kernel, in bounded memory
                    self.max_logit = mla_max_logit(q, k, scale=self.scale, cu_seqlens=cu_seqlens)
        return o.reshape(B, T, H * self.dv)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output gate (from the layer input ``x``) and projection of the heads' values ``o`` [B, T, H * dv]."""
        if self.use_gate:
            o = torch.sigmoid(self.g_proj(x)) * o
        return self.o_proj(o)
