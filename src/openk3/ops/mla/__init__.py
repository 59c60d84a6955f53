"""Gated MLA with NoPE: prefill (MHA form) and absorbed decode (MQA form over the latent cache)."""

from openk3.ops.mla.reference import (
    mla_absorbed_attention,
    mla_max_logit,
    mla_mha_attention,
    varlen_causal_mask,
)

__all__ = ["mla_mha_attention", "mla_absorbed_attention", "mla_max_logit", "varlen_causal_mask"]
