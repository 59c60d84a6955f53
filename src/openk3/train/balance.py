"""Router load balancing: Quantile Balancing (SPEC §4.4) and the aux-loss-free sign update (ablation).

Quantile Balancing, per MoE layer, once per optimizer step, for ``m`` real tokens, ``n`` experts, top-``k``:

1. with the old bias ``b`` take the top-(k+1) of ``s_i + b``; the (k+1)-th value is token ``i``'s admission
   cutoff ``a_i``;
2. margins ``M_ij = s_ij - a_i``;
3. ``b_hat_j = -((q+1)-th largest of M[:, j])`` with ``q = floor(m k / n)``; then exactly ``q`` tokens satisfy
   ``s_ij + b_hat_j > a_i`` (ties aside);
4. ``b_new = b_hat - mean(b_hat)``.

The distributed estimator keeps, per expert, a histogram of margins; the counts are plain int64 and add
up across micro-batches and ranks (one ``all_reduce(SUM)``), and the token count is recovered from them
(every token contributes exactly one margin per expert).

Assumed choices (SPEC leaves them open):

* Target ``q = floor(m k / n)`` (no interpolation).
* Histogram: ``num_bins`` (512) equal bins over ``[lo, hi)`` = ``[-1, 1)`` by default, plus one underflow
  (``< lo``) and one overflow (``>= hi``) bin, stored as ``[..., n, num_bins + 2]``. Margins lie in
  ``(-1 - max|b|, 1 + max|b|)``; the quantile actually read is ``-b_hat_j``, so ``[-1, 1)`` covers every bias
  of magnitude below 1. When the quantile falls in an under/overflow bin the estimate saturates at ``lo`` /
  ``hi`` (counted in ``last_saturated``).
* The estimate is the *upper* edge of the bin holding the (q+1)-th largest margin: at most ``q`` tokens are
  admitted (never over target from quantisation), error at most one bin width.
* Padding tokens are excluded (``mask`` argument or pass only real tokens).
* Ties are not broken. Besides exact score ties there is a structural one: for each token the expert at
  rank k+1 defines the cutoff, ``a_i = s_ij + b_j``, so its margin is exactly ``-b_j``. Each expert thus has
  a cluster of about ``m / n`` equal margins at ``-b_j``; when its old load ``<= q <`` old load + cluster size,
  the (q+1)-th largest margin lies in the cluster, ``b_hat_j = b_j`` (before centring) and the expert keeps
  its old load (fewer than ``q`` admitted in the step-3 sense). Near balance this is common and acts as a
  small dead zone; the histogram estimate then returns the upper edge of the cluster's bin.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "admission_cutoff",
    "qb_target",
    "exact_quantile_bias",
    "QuantileBalancer",
    "sign_update_bias",
    "expert_load",
    "load_ratio",
]


def admission_cutoff(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """``a_i`` = the (k+1)-th largest of ``scores_i + bias``; ``scores`` [..., m, n], ``bias`` [..., n].

    Computed in fp32 (fp64 inputs stay fp64)."""
    dt = torch.promote_types(scores.dtype, torch.float32)
    biased = scores.to(dt) + bias.to(dt).unsqueeze(-2)
    return torch.topk(biased, k + 1, dim=-1).values[..., k]


def qb_target(m: int, k: int, n: int) -> int:
    """Per-expert target load ``q = floor(m k / n)`` (Assumed rounding)."""
    return (m * k) // n


def exact_quantile_bias(
    scores: torch.Tensor, bias: torch.Tensor, k: int, *, center: bool = True, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact (sort-based) QB bias for one layer: ``scores`` [m, n] raw sigmoid scores, ``bias`` [n].

    Returns ``b_hat - mean(b_hat)`` (``center=True``) or ``b_hat`` itself, [n] in fp32 (fp64 for fp64 input).
    """
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if mask is not None:
        s = s[mask.bool()]
    m, n = s.shape
    a = admission_cutoff(s, bias, k)
    margins = s - a[:, None]
    q = qb_target(m, k, n)
    xq = torch.topk(margins, q + 1, dim=0).values[q]
    b_hat = -xq
    return b_hat - b_hat.mean() if center else b_hat


class QuantileBalancer:
    """Histogram-based Quantile Balancing for one MoE layer or a stack of ``num_layers`` layers.

    Usage per optimizer step::

        for micro_batch in ...:
            balancer.observe(router_scores, bias)          # or observe(..., layer=l) for stacked use
        # distributed: dist.all_reduce(balancer.histogram_counts())   (in place, SUM)
        new_bias = balancer.compute_bias(); balancer.reset()

    ``counts`` has shape ``[n, num_bins + 2]`` (single layer) or ``[L, n, num_bins + 2]`` (stacked); column 0
    is the underflow bin, columns ``1..num_bins`` the regular bins, column ``num_bins + 1`` the overflow bin.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        num_layers: int | None = None,
        num_bins: int = 512,
        range: tuple[float, float] = (-1.0, 1.0),
        device: torch.device | str | None = None,
    ) -> None:
        if not 0 < top_k < num_experts:
            raise ValueError(f"need 0 < top_k < num_experts, got top_k={top_k}, num_experts={num_experts}")
        lo, hi = float(range[0]), float(range[1])
        if not hi > lo or num_bins < 1:
            raise ValueError(f"bad histogram spec: range={range}, num_bins={num_bins}")
        self.num_experts, self.top_k, self.num_layers = num_experts, top_k, num_layers
        self.num_bins, self.lo, self.hi = num_bins, lo, hi
        self.bin_width = (hi - lo) / num_bins
        lead = () if num_layers is None else (num_layers,)
        self.counts = torch.zeros(*lead, num_experts, num_bins + 2, dtype=torch.int64, device=device)
        self.last_saturated = 0

    # -- accumulation -----------------------------------------------------------------------------------

    def _bin_index(self, margins: torch.Tensor) -> torch.Tensor:
        idx = torch.floor((margins - self.lo) / self.bin_width)
        return idx.clamp_(-1, self.num_bins).long() + 1

    def _accumulate(self, counts: torch.Tensor, margins: torch.Tensor) -> None:
        """Add the margins [m, n] to ``counts`` [n, B+2] (a view into self.counts)."""
        nb = self.num_bins + 2
        flat = self._bin_index(margins) + torch.arange(margins.shape[-1], device=margins.device) * nb
        counts.view(-1).add_(torch.bincount(flat.reshape(-1), minlength=counts.numel()))

    @torch.no_grad()
    def observe(
        self,
        scores: torch.Tensor,
        bias: torch.Tensor,
        *,
        layer: int | None = None,
        mask: torch.Tensor | None = None,
        cutoff: torch.Tensor | None = None,
    ) -> None:
        """Accumulate margins of one (micro-)batch.

        ``scores``: raw sigmoid router scores [m, n] (or [L, m, n] for all layers of a stacked balancer),
        ``bias``: the correction bias the batch was routed with, [n] (or [L, n]); ``layer`` selects one layer
        of a stacked balancer; ``mask`` [m] (bool, True = real token) drops padding; ``cutoff`` [m] (or
        [L, m]) optionally supplies precomputed admission cutoffs ``a_i``.
        """
        if self.counts.device != scores.device:
            self.counts = self.counts.to(scores.device)
        s = scores.float()
        if s.shape[-1] != self.num_experts:
            raise ValueError(f"scores have {s.shape[-1]} experts, balancer has {self.num_experts}")
        stacked_all = self.num_layers is not None and layer is None
        if stacked_all != (s.ndim == 3) or s.ndim not in (2, 3):
            raise ValueError(
                f"scores of shape {tuple(s.shape)}: use [m, n] with layer=... (stacked) / no layer (single), "
                "or [L, m, n] for all layers of a stacked balancer"
            )
        if mask is not None:
            mask = mask.bool()
            s = s[..., mask, :]
            if cutoff is not None:
                cutoff = cutoff[..., mask]
        a = admission_cutoff(s, bias, self.top_k) if cutoff is None else cutoff.float()
        margins = s - a.unsqueeze(-1)
        if self.num_layers is None:
            self._accumulate(self.counts, margins)
        elif layer is not None:
            self._accumulate(self.counts[layer], margins)
        else:
            if s.shape[0] != self.num_layers:
                raise ValueError(f"scores have {s.shape[0]} layers, balancer has {self.num_layers}")
            for layer_idx in range(self.num_layers):
                self._accumulate(self.counts[layer_idx], margins[layer_idx])

    # -- distributed / checkpoint plumbing ----------------------------------------------------------------

    def histogram_counts(self) -> torch.Tensor:
        """The live int64 counts tensor (all-reduce it in place with SUM across data-parallel ranks)."""
        return self.counts

    def num_tokens(self) -> torch.Tensor:
        """Tokens observed so far, per layer (0-d tensor for a single layer): every token adds one count per
        expert, so this is the row sum of any expert's histogram."""
        return self.counts[..., 0, :].sum(-1)

    def load_counts(self, counts: torch.Tensor, m: int | torch.Tensor | None = None) -> None:
        """Replace the counts (e.g. after an external reduction). ``m`` (optional) is checked against them."""
        if counts.shape != self.counts.shape:
            raise ValueError(f"counts shape {tuple(counts.shape)} != {tuple(self.counts.shape)}")
        counts = counts.to(device=self.counts.device, dtype=torch.int64).clone()
        totals = counts.sum(-1)
        if bool((totals != totals[..., :1]).any()):
            raise ValueError("inconsistent counts: experts of one layer saw different token counts")
        if m is not None and not bool((totals[..., 0] == torch.as_tensor(m, device=counts.device)).all()):
            raise ValueError(f"token count {m} does not match the counts ({totals[..., 0].tolist()})")
        self.counts = counts

    def reset(self) -> None:
        self.counts.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": self.counts.clone(),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_layers": self.num_layers,
            "num_bins": self.num_bins,
            "range": (self.lo, self.hi),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (
            ("num_experts", self.num_experts),
            ("top_k", self.top_k),
            ("num_layers", self.num_layers),
            ("num_bins", self.num_bins),
            ("range", (self.lo, self.hi)),
        ):
            theirs = tuple(state[key]) if key == "range" else state[key]
            if theirs != mine:
                raise ValueError(f"balancer state has {key}={state[key]!r}, this balancer has {mine!r}")
        self.load_counts(state["counts"])

    # -- bias estimate ------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_bias(self, *, center: bool = True) -> torch.Tensor:
        """New bias from the accumulated histogram: fp32 [n] (or [L, n]).

        ``b_hat_j = -(upper edge of the bin holding the (q+1)-th largest margin of expert j)``,
        ``q = floor(m k / n)``; then mean-centred per layer unless ``center=False``. Raises if nothing was
        observed.
        """
        m = self.num_tokens()
        if bool((m == 0).any()):
            raise RuntimeError("QuantileBalancer.compute_bias called before any tokens were observed")
        q = (m * self.top_k) // self.num_experts
        # cumulative count from the top bin downwards: rev_cum[..., t] = #margins in bins >= (B+1 - t)
        rev_cum = self.counts.flip(-1).cumsum(-1)
        need = (q + 1).unsqueeze(-1).unsqueeze(-1)
        first = (rev_cum >= need).int().argmax(-1)  # first reverse position reaching q+1
        t = self.num_bins + 1 - first  # storage index of the bin holding the (q+1)-th largest margin
        self.last_saturated = int(((t == 0) | (t == self.num_bins + 1)).sum())
        upper = self.lo + t.clamp(max=self.num_bins).double() * self.bin_width
        b_hat = (-upper).float()
        return b_hat - b_hat.mean(-1, keepdim=True) if center else b_hat


def sign_update_bias(bias: torch.Tensor, expert_load: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """Aux-loss-free sign update (DeepSeek-V3 style, ablation): ``b + rate * sign(mean(load) - load)``.

    Works on [n] or stacked [L, n]; returns a new fp32 tensor (``bias`` is not modified).
    """
    load = expert_load.float()
    return bias.float() + rate * torch.sign(load.mean(-1, keepdim=True) - load)


def expert_load(topk_idx: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert: ``topk_idx`` [m, k] (any leading shape) -> int64 counts [n].

    ``mask`` [m] (True = real token) drops padding rows.
    """
    idx = topk_idx
    if mask is not None:
        idx = idx[mask.bool()]
    return torch.bincount(idx.reshape(-1).long(), minlength=n)


def load_ratio(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max / mean, min / mean)`` of expert loads along the last dim (0-d tensors for a 1-D input)."""
    c = counts.float()
    mean = c.mean(-1)
    return c.amax(-1) / mean, c.amin(-1) / mean
