"""Reference AttnRes read: softmax over sources of a static pseudo-query against RMS-normalised sources."""

from __future__ import annotations

import torch


def attnres_read(
    sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """One AttnRes read site.

    sources: list of S tensors [..., D] (sealed block summaries then the live partial sum) -- the raw values;
    query: [D] or [1, D] (``*_res_proj.weight``); norm_weight: [D] (``*_res_norm.weight``).
    ``score_i = < norm_weight * query, v_i / rms(v_i) >``, ``p = softmax_i(score)``, output ``sum_i p_i v_i``.
    Mixing in fp32 (SPEC.md §5.3); returns the sources' dtype.
    """
    if len(sources) == 1:
        return sources[0]
    w = norm_weight.float() * query.float().reshape(-1)  # folded query [D]
    vals = torch.stack([s.float() for s in sources], dim=0)  # [S, ..., D]
    inv_rms = torch.rsqrt(vals.pow(2).mean(-1, keepdim=True) + eps)
    scores = ((vals * inv_rms) * w).sum(-1)  # [S, ...]
    p = torch.softmax(scores, dim=0)
    out = (p.unsqueeze(-1) * vals).sum(0)
    return out.to(sources[-1].dtype)


class AttnResReader:
    """Reference reader: keeps the sealed sources, recomputes each read from scratch (see package docstring)."""

    def __init__(self, eps: float, max_sources: int | None = None):
        self.eps = eps  # max_sources: a capacity hint for fast readers' buffers (unused here)
        self.sealed: list[torch.Tensor] = []

    @property
    def num_sealed(self) -> int:
        return len(self.sealed)

    def seal(self, r: torch.Tensor, sites) -> None:
        self.sealed.append(r)

    def read(
        self, site_id: int, query: torch.Tensor, norm_weight: torch.Tensor, r: torch.Tensor
    ) -> torch.Tensor:
        return attnres_read([*self.sealed, r], query, norm_weight, self.eps)

    def read_normed(
        self, site_id: int, query: torch.Tensor, norm_weight: torch.Tensor, r: torch.Tensor, norm
    ) -> torch.Tensor:
        """``norm(read(...))`` (fast readers fuse the two)."""
        return norm(self.read(site_id, query, norm_weight, r))
