"""GPU fast paths, registered with the backend registry on import.

========  ==============  ==========================================================================
op        backend name    what
========  ==============  ==========================================================================
kda       ``fla``         fla-core ``chunk_kda`` / ``fused_recurrent_kda`` (gate, beta, L2 norm in-kernel)
mla       ``sdpa``        ``scaled_dot_product_attention`` (+ ``varlen_attn`` for packed documents)
mla       ``flex``        FlexAttention with causal / document block masks
moe       ``grouped_mm``  token permutation + ``torch._grouped_mm`` forward/backward, Triton SiTU-GLU; for a
                          few tokens without autograd (``OPENK3_MOE_SMALL_N``) router + experts in five launches;
                          decode batches by expert-tiled kernels (``OPENK3_MOE_TILED``, default 32 pairs per expert)
attnres   ``triton``      two-phase Block AttnRes reader (Triton, exact fp32 mixing, forward/backward)
norm      ``fla``         fla-core fused ``rms_norm`` (every RMSNorm) and ``rms_norm_gated`` (KDA output norm)
glu       ``triton``      fused SiTU-GLU / SwiGLU of the dense FFN and shared experts (one kernel fwd, one bwd)
conv      ``fla``         fla-core ``causal_conv1d`` + SiLU (KDA q/k/v short conv, packed docs, carried state)
========  ==============  ==========================================================================

``auto`` (the default) takes the first available fast backend on CUDA inputs and the reference elsewhere;
``OPENK3_BACKEND_<OP>=name`` or ``model.set_backend(op, name)`` forces one. Importing this package is enough:
``import openk3.fast  # noqa: F401``.
"""

from __future__ import annotations

import warnings

# fla-core warns on import where Triton has no GPU ("roll back to CPU"); openk3 runs fla only on CUDA inputs and
# says which backend each op uses in `openk3 env`, so the warning would only clutter every CPU command's stderr
with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", message="Triton is not supported on current platform", category=UserWarning
    )
    from openk3.fast import attnres, conv, kda, mla, moe, moe_small, moe_tiled, norm
from openk3.ops import backend as _backend
from openk3.ops.backend import Backend

__all__ = ["attnres", "conv", "kda", "mla", "moe", "moe_small", "moe_tiled", "norm", "register_all"]


def register_all() -> None:
    """(Re-)register every fast backend; the last registered per op is the one ``auto`` prefers."""
    from openk3.modules.ffn import FAST_GLU
    from openk3.modules.kda import FAST_CONV, FAST_KDA
    from openk3.modules.mla import FAST_MHA
    from openk3.modules.moe import FAST_EXPERTS, FAST_SMALL
    from openk3.modules.norm import FAST_GATED_NORM, FAST_RMS_NORM
    from openk3.ops.attnres import FAST_READERS

    FAST_KDA["fla"] = kda.kda_core_fla
    _backend.register("kda", Backend("fla", kda.available))

    FAST_MHA["flex"] = mla.mha_flex
    _backend.register("mla", Backend("flex", mla.flex_available))
    FAST_MHA["sdpa"] = mla.mha_sdpa
    _backend.register("mla", Backend("sdpa", mla.sdpa_available))

    FAST_EXPERTS["grouped_mm"] = moe.experts_grouped
    # few tokens without autograd (OPENK3_MOE_SMALL_N, default 16 tokens)
    FAST_SMALL["grouped_mm"] = moe_small
    _backend.register("moe", Backend("grouped_mm", moe.available))

    FAST_READERS["triton"] = attnres.TritonAttnResReader
    _backend.register("attnres", Backend("triton", attnres.available))

    FAST_RMS_NORM["fla"] = norm.rms_norm_fla
    FAST_GATED_NORM["fla"] = norm.gated_rms_norm_fla
    _backend.register("norm", Backend("fla", norm.available))

    FAST_CONV["fla"] = conv.causal_conv1d_fla
    _backend.register("conv", Backend("fla", conv.available))

    FAST_GLU["triton"] = moe.glu_act_triton
    _backend.register("glu", Backend("triton", moe.glu_available))


register_all()
