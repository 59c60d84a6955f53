"""Contiguous hybrid cache for incremental decoding with the reference model.

Per KDA layer: the short-conv history of q/k/v (last W-1 pre-activation projections, [B, H*K, W-1]) and the fp32
recurrent state [B, H, K, V]. Per MLA layer: the normed latent ``c`` [B, S, kv_lora_rank] and the shared unrotated
key part ``kr`` [B, S, qk_rope_head_dim]. (The paged, multi-sequence cache of the inference engine lives in
``openk3.infer``.)
"""

from __future__ import annotations

import torch

from openk3.config import K3Config


class K3Cache:
    def __init__(self, config: K3Config):
        self.config = config
        self.layer_types = config.layer_types
        self.layers: list[dict] = [{} for _ in range(config.num_hidden_layers)]
        self.seq_len = 0  # tokens already processed

    def __len__(self) -> int:
        return self.seq_len

    @property
    def batch_size(self) -> int | None:
        for d in self.layers:
            for v in d.values():
                return v.shape[0]
        return None

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for d in self.layers for v in d.values())

    def select(self, index: torch.Tensor) -> K3Cache:
        """A cache holding only the batch rows ``index`` (e.g. after some sequences finished)."""
        out = K3Cache(self.config)
        out.seq_len = self.seq_len
        out.layers = [{k: v.index_select(0, index.to(v.device)) for k, v in d.items()} for d in self.layers]
        return out

    def copy(self) -> K3Cache:
        out = K3Cache(self.config)
        out.seq_len = self.seq_len
        out.layers = [{k: v.clone() for k, v in d.items()} for d in self.layers]
        return out
