"""Independent fp64 reference of the optimizer and balancing math in SPEC.md §4.4 and §6.

Written from the SPEC text only; every function works on plain tensors, one matrix / head / expert at a
time (loops instead of batching), so that it shares no structure with the code it checks.

* §6.1 Muon (Moonlight/K2 convention): ``M <- mu M + G``; Nesterov (Assumed, Moonlight) uses
  ``U = G + mu M``, else ``U = M``; ``O = NS5(U) * 0.2 sqrt(max(rows, cols))``; ``W <- W - lr (O + wd W)``.
* §6.3 Per-Head Muon: ``[H * d_h, d_in]`` viewed as ``[H, d_h, d_in]``, each head block orthogonalised
  and scaled with its own dims; stacked experts ``[E, out, in]`` per expert.
* §6.2 QK-Clip with the NoPE MLA mapping, plus the max-logit statistic from MLA weights (§2.1-2.2).
* §6.4 1% linear warmup + cosine (and a linear WSD for the ablation); SPEC fixes neither the step
  indexing nor the final LR, so those are parameters / documented conventions here.
* §4.4 Quantile Balancing: exact (sort) and histogram estimators, ``q = floor(m k / n)``; histogram
  saturation at the range ends (SPEC: Assumed, to be defined by the implementation).
"""

import math

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)


# ---------------------------------------------------------------------------------------------------------
# Muon (§6.1, §6.3)
# ---------------------------------------------------------------------------------------------------------


def ns5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Quintic Newton–Schulz of one matrix in fp64: normalise, transpose if tall, iterate, transpose back."""
    a, b, c = NS_COEFFS
    X = G.double()
    X = X / (torch.linalg.matrix_norm(X, "fro") + eps)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def block_scale(rows: int, cols: int, rule: str = "moonlight") -> float:
    """Update scale of one orthogonalised ``rows x cols`` block: §6.1 RMS matching, or §6.3's DeepSpeed rule."""
    if rule == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(rule)


def orthogonal_update(U: torch.Tensor, head_dim: int | None = None, rule: str = "moonlight") -> torch.Tensor:
    """Scaled NS5 of ``U``: whole matrix, per head (``head_dim`` rows per block) or per expert (3-D ``U``)."""
    U = U.double()
    if U.dim() == 3:  # [E, out, in]: every expert separately
        return torch.stack([orthogonal_update(U[e], None, rule) for e in range(U.shape[0])])
    rows, cols = U.shape
    if head_dim is None:
        return ns5(U) * block_scale(rows, cols, rule)
    assert rows % head_dim == 0
    out = torch.empty_like(U)
    for h in range(rows // head_dim):
        sl = slice(h * head_dim, (h + 1) * head_dim)
        out[sl] = ns5(U[sl]) * block_scale(head_dim, cols, rule)
    return out


def muon_step(
    W: torch.Tensor,
    G: torch.Tensor,
    M: torch.Tensor | None,
    *,
    lr: float,
    momentum: float = 0.95,
    weight_decay: float = 0.1,
    nesterov: bool = True,
    head_dim: int | None = None,
    rule: str = "moonlight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Muon step in fp64; returns ``(W_new, M_new)``. ``M=None`` is the zero initial buffer."""
    W, G = W.double(), G.double()
    M = G.clone() if M is None else momentum * M.double() + G
    U = G + momentum * M if nesterov else M
    O = orthogonal_update(U, head_dim, rule)
    return W - lr * (O + weight_decay * W), M


# ---------------------------------------------------------------------------------------------------------
# QK-Clip (§6.2) and the MLA max-logit statistic (§2.1-2.2)
# ---------------------------------------------------------------------------------------------------------


def qk_clip(
    q_w: torch.Tensor,
    kv_b_w: torch.Tensor,
    max_logits: torch.Tensor,
    *,
    tau: float,
    heads: int,
    nope: int,
    rope: int,
    v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(q_w', kv_b_w', gamma)``: per head, q nope rows and k nope rows x sqrt(gamma), q rope rows x gamma."""
    q_w, kv_b_w = q_w.double().clone(), kv_b_w.double().clone()
    gamma = torch.ones(heads, dtype=torch.float64)
    for h in range(heads):
        s = float(max_logits[h])
        if s <= tau:
            continue
        g = tau / s
        gamma[h] = g
        q0 = h * (nope + rope)
        q_w[q0 : q0 + nope] *= math.sqrt(g)
        q_w[q0 + nope : q0 + nope + rope] *= g
        k0 = h * (nope + v)
        kv_b_w[k0 : k0 + nope] *= math.sqrt(g)
    return q_w, kv_b_w, gamma


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp64."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def mla_max_logits(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    *,
    heads: int,
    nope: int,
    rope: int,
    v: int,
    eps: float,
    doc_lens: list[int] | None = None,
) -> torch.Tensor:
    """Per-head max of the scaled causal logits ``q.k / sqrt(nope + rope)`` of one MLA layer, fp64 [H].

    ``x`` [T, d] (one packed sequence; ``doc_lens`` splits it into independent documents). ``weights`` holds
    ``q_proj`` or ``q_a_proj``/``q_a_norm``/``q_b_proj``, ``kv_a_proj``, ``kv_a_norm``, ``kv_b_proj``.
    """
    x = x.double()
    w = {k: t.double() for k, t in weights.items()}
    if "q_proj" in w:
        q = x @ w["q_proj"].T
    else:
        q = rms_norm(x @ w["q_a_proj"].T, w["q_a_norm"], eps) @ w["q_b_proj"].T
    ckv = x @ w["kv_a_proj"].T
    dc = ckv.shape[-1] - rope
    c_hat = rms_norm(ckv[:, :dc], w["kv_a_norm"], eps)
    k_r = ckv[:, dc:]
    kv = c_hat @ w["kv_b_proj"].T
    T = x.shape[0]
    doc_lens = doc_lens or [T]
    best = torch.full((heads,), -math.inf, dtype=torch.float64)
    for h in range(heads):
        qh = q[:, h * (nope + rope) : (h + 1) * (nope + rope)]
        kh = torch.cat([kv[:, h * (nope + v) : h * (nope + v) + nope], k_r], -1)
        start = 0
        for n in doc_lens:
            for i in range(start, start + n):
                logits = kh[start : i + 1] @ qh[i] / math.sqrt(nope + rope)
                best[h] = max(best[h], logits.max())
            start += n
    return best


# ---------------------------------------------------------------------------------------------------------
# Schedules (§6.4)
# ---------------------------------------------------------------------------------------------------------


def warmup_len(total: int, frac: float) -> int:
    """Warmup updates: ``frac`` (1%) of the run, at least one."""
    return max(1, round(frac * total))


def cosine_factor(step: int, total: int, *, warmup_frac: float = 0.01, floor: float = 0.0) -> float:
    """LR multiplier before update ``step + 1`` (``step`` updates done).

    Linear warmup ``(step + 1) / W`` so that the first update is not wasted; afterwards cosine from 1 to
    ``floor`` as a function of progress ``(step - W) / (total - W)`` (reaches ``floor`` at ``total``).
    """
    W = warmup_len(total, warmup_frac)
    if step < W:
        return (step + 1) / W
    p = min(1.0, max(0.0, (step - W) / max(1, total - W)))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


def wsd_linear_factor(
    step: int, total: int, *, warmup_frac: float = 0.01, decay_frac: float = 0.2, floor: float = 0.0
) -> float:
    """Warmup as above, then 1, then a straight line to ``floor`` over the last ``decay_frac`` of the run."""
    W = warmup_len(total, warmup_frac)
    if step < W:
        return (step + 1) / W
    D = round(decay_frac * total)
    start = total - D
    if step < start or D == 0:
        return 1.0
    p = min(1.0, (step - start) / D)
    return 1.0 - (1.0 - floor) * p


# ---------------------------------------------------------------------------------------------------------
# Quantile Balancing (§4.4)
# ---------------------------------------------------------------------------------------------------------


def qb_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Steps 1-2: ``a_i`` = (k+1)-th largest of ``s_i + b``; margins ``M_ij = s_ij - a_i`` (fp64 [m, n])."""
    s = scores.double()
    a = torch.sort(s + bias.double(), dim=-1, descending=True).values[:, k]
    return s - a[:, None]


def qb_target(m: int, k: int, n: int) -> int:
    """Target load ``q = floor(m k / n)`` (SPEC's Assumed rounding option)."""
    return (m * k) // n


def qb_order_stat(margins: list[torch.Tensor], k: int) -> torch.Tensor:
    """The (q+1)-th largest margin of every expert over the margins of all micro-batches (each [m_b, n])."""
    allM = torch.cat([M.double() for M in margins])
    m, n = allM.shape
    return torch.sort(allM, dim=0, descending=True).values[qb_target(m, k, n)]


def qb_exact(scores: torch.Tensor, bias: torch.Tensor, k: int, *, center: bool = True) -> torch.Tensor:
    """Steps 3-4 with an exact order statistic: ``b_hat_j = -((q+1)-th largest of M[:, j])``, then centred."""
    b_hat = -qb_order_stat([qb_margins(scores, bias, k)], k)
    return b_hat - b_hat.mean() if center else b_hat


def qb_histogram(
    margins: list[torch.Tensor],
    k: int,
    *,
    bins: int,
    lo: float,
    hi: float,
    center: bool = True,
) -> torch.Tensor:
    """Histogram estimate from the margins of several micro-batches (each [m_b, n]).

    Bins: ``bins`` equal bins over ``[lo, hi)`` plus an underflow and an overflow bin. The first bin whose
    ascending cumulative count reaches ``m - q`` is the bin holding the ``(m - q)``-th smallest = (q+1)-th
    largest margin; the estimate is its right edge (underflow -> ``lo``, overflow -> ``hi``, the Assumed
    saturation) and ``b_hat_j`` is minus the estimate.
    """
    v = qb_order_stat(margins, k)  # only the bin of this order statistic matters
    width = (hi - lo) / bins
    edge = lo + (torch.floor((v - lo) / width) + 1) * width
    edge = torch.where(v < lo, torch.full_like(v, lo), edge)
    edge = torch.where(v >= hi, torch.full_like(v, hi), edge)
    b_hat = -edge
    return b_hat - b_hat.mean() if center else b_hat
