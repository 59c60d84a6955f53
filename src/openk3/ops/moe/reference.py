"""Reference MoE ops (SPEC.md §4.1, §4.2)."""

from __future__ import annotations

import torch

from openk3.ops.activations import glu_act


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    activation: str = "sigmoid",
    renormalize: bool = True,
    scaling: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
):
    """Router. x: [N, D]; weight: [E, D]; bias: [E] correction bias (selection only) or None.

    Logits in fp32; scores = sigmoid (or softmax); experts chosen by top-k of ``scores + bias`` (group-limited when
    ``n_group > 1``: keep the ``topk_group`` groups with the largest sum of their top-2 biased scores); mixture
    weights from the *unbiased* scores, renormalised over the chosen experts (``+1e-20``), times ``scaling``.
    Returns (topk_idx [N, k] int64, topk_weight [N, k] fp32, scores [N, E] fp32).
    """
    logits = torch.nn.functional.linear(x.float(), weight.float())
    if activation == "sigmoid":
        scores = torch.sigmoid(logits)
    elif activation == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"unknown router activation {activation!r}")
    choice = scores if bias is None else scores + bias.float()
    E = scores.shape[-1]
    if n_group > 1:
        g = choice.view(-1, n_group, E // n_group)
        gscore = g.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = gscore.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling, scores


def experts_reference(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    act: str = "situ",
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """Weighted sum of GLU experts. x: [N, W]; idx/weights: [N, k]; w1, w3: [E, I, W]; w2: [E, W, I].
    Each expert's output (x.dtype) is multiplied by its fp32 weight and accumulated in fp32; returns x.dtype."""
    N, W = x.shape
    E = w1.shape[0]
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= E):
        raise ValueError(f"expert ids must lie in [0, {E}); got ids in [{int(idx.min())}, {int(idx.max())}]")
    out = torch.zeros(N, W, dtype=torch.float32, device=x.device)
    flat_e = idx.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=w1.shape[0]).tolist()
    tok = order // idx.shape[1]
    wsel = weights.reshape(-1)[order]
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        t = tok[start : start + c]
        xe = x[t]
        h = glu_act(xe @ w1[e].t(), xe @ w3[e].t(), act, beta1, beta2)
        y = h @ w2[e].t()
        out.index_add_(0, t, y.float() * wsel[start : start + c, None])
        start += c
    return out.to(x.dtype)
