"""Token-by-token KDA recurrence (the ground-truth definition) and shared input handling.

Per head, with state ``S`` of shape ``[K, V]`` (row ``i`` belongs to key channel ``i``), each token does::

    S' = diag(exp(g_t)) S          # per-key-channel decay
    p  = S'^T k_t                  # prediction
    u  = beta_t * (v_t - p)        # delta-rule correction
    S  = S' + k_t u^T              # write
    o_t = S^T q_t                  # read after the write

which is ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.ops.kda.gate import compute_dtype, l2norm

__all__ = ["kda_recurrent"]


@dataclass
class _Layout:
    """Where each packed token lives in the padded ``[N, L_pad]`` per-sequence layout."""

    B: int
    T: int
    N: int
    L_pad: int
    cu: list[int] | None  # sequence boundaries (varlen only)
    gather_idx: torch.Tensor | None = None  # [N, L_pad] into the packed axis; T = zero row
    scatter_idx: torch.Tensor | None = None  # [T] into the flattened [N * L_pad] axis


def _check_inputs(
    fn: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[int, list[int] | None, float]:
    """Validate shapes; return ``(N, cu_seqlens as a list or None, scale)``."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{fn}: {name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"{fn}: q must have shape [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{fn}: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"{fn}: g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"{fn}: v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"{fn}: beta must have shape [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if B < 1 or T < 1 or H < 1 or K < 1 or v.shape[-1] < 1:
        raise ValueError(f"{fn}: all dimensions must be >= 1, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    V = v.shape[-1]

    if scale is None:
        scale = K**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{fn}: scale must be None or a finite number, got {scale!r}")

    cu: list[int] | None = None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise ValueError(
                f"{fn}: cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}"
            )
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{fn}: cu_seqlens must be 1-D [N + 1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{fn}: cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"{fn}: cu_seqlens needs at least 2 entries (N + 1 with N >= 1)")
        if B != 1:
            raise ValueError(f"{fn}: with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        cu = [int(x) for x in cu_seqlens.tolist()]
        if cu[0] != 0:
            raise ValueError(f"{fn}: cu_seqlens must start at 0, got {cu[0]}")
        if any(b <= a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"{fn}: cu_seqlens must be strictly increasing (no empty sequences), got {cu}")
        if cu[-1] != T:
            raise ValueError(f"{fn}: cu_seqlens must end at the sequence length T={T}, got {cu[-1]}")
        N = len(cu) - 1
    else:
        N = B

    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError(f"{fn}: initial_state must be a floating-point torch.Tensor")
        if initial_state.shape != (N, H, K, V):
            raise ValueError(
                f"{fn}: initial_state must have shape [N, H, K, V] = [{N}, {H}, {K}, {V}], got "
                f"{tuple(initial_state.shape)}"
            )
    return N, cu, float(scale)


def _make_layout(B: int, T: int, cu: list[int] | None, multiple: int, device: torch.device) -> _Layout:
    """Per-sequence layout whose length is ``max sequence length`` rounded up to ``multiple``."""
    if cu is None:
        return _Layout(B=B, T=T, N=B, L_pad=-(-T // multiple) * multiple, cu=None)
    N = len(cu) - 1
    starts = torch.tensor(cu[:-1], dtype=torch.long, device=device)
    lens = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], dtype=torch.long, device=device)
    L_pad = -(-int(lens.max()) // multiple) * multiple
    pos = torch.arange(L_pad, device=device)
    inside = pos[None, :] < lens[:, None]
    gather_idx = torch.where(
        inside, starts[:, None] + pos[None, :], torch.full_like(inside, T, dtype=torch.long)
    )
    seq_of_token = torch.repeat_interleave(torch.arange(N, device=device), lens)
    tok = torch.arange(T, device=device)
    scatter_idx = seq_of_token * L_pad + (tok - starts[seq_of_token])
    return _Layout(B=B, T=T, N=N, L_pad=L_pad, cu=cu, gather_idx=gather_idx, scatter_idx=scatter_idx)


def _to_padded(x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """``[B, T, ...]`` packed/batched tensor -> ``[N, L_pad, ...]``; padding is zeros."""
    if lay.gather_idx is None:
        extra = lay.L_pad - lay.T
        if extra == 0:
            return x
        return F.pad(x, [0, 0] * (x.dim() - 2) + [0, extra])
    rows = torch.cat([x[0], x.new_zeros((1,) + tuple(x.shape[2:]))], dim=0)  # [T + 1, ...]
    return rows[lay.gather_idx]


def _from_padded(y: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """Inverse of :func:`_to_padded` for an output ``[N, L_pad, ...]`` -> ``[B, T, ...]``."""
    if lay.scatter_idx is None:
        return y[:, : lay.T]
    flat = y.reshape((lay.N * lay.L_pad,) + tuple(y.shape[2:]))
    return flat[lay.scatter_idx].unsqueeze(0)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    initial_state: torch.Tensor | None,
    N: int,
) -> tuple[torch.Tensor, ...]:
    """Cast to the compute dtype, L2-normalise q/k (optional), scale q; build the starting state."""
    dtype = compute_dtype(q, k, v, g, beta)
    if use_qk_l2norm:
        q, k = l2norm(q.to(dtype)), l2norm(k.to(dtype))
    q = q.to(dtype) * scale
    k, v, g, beta = k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype)
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    if initial_state is None:
        S0 = q.new_zeros((N, H, K, V))
    else:
        S0 = initial_state.to(dtype)
    return q, k, v, g, beta, S0


def _recurrent_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g: ``[N, L, H, K]``, v: ``[N, L, H, V]``, beta: ``[N, L, H]``, S: ``[N, H, K, V]``."""
    alpha = torch.exp(g).unsqueeze(-1)  # [N, L, H, K, 1]
    k_col = k.unsqueeze(-1)  # [N, L, H, K, 1]
    q_col = q.unsqueeze(-1)
    v_row = v.unsqueeze(-2)  # [N, L, H, 1, V]
    b = beta[..., None, None]  # [N, L, H, 1, 1]
    outs = []
    # Broadcast-and-reduce instead of tiny matmuls: much faster on CPU (also under autograd).
    for t in range(q.shape[1]):
        kt = k_col[:, t]
        S = alpha[:, t] * S
        p = (kt * S).sum(dim=-2, keepdim=True)  # S'^T k: [N, H, 1, V]
        S = S + kt * (b[:, t] * (v_row[:, t] - p))
        outs.append((q_col[:, t] * S).sum(dim=-2))
    return torch.stack(outs, dim=1), S


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA, one token at a time (vectorised over batch/sequences and heads).

    Args:
        q, k: ``[B, T, H, K]`` queries/keys.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log decay (already activated, ``<= 0``), e.g. from :func:`kda_gate`.
        beta: ``[B, T, H]`` write strength in ``(0, 1)`` (already passed through a sigmoid).
        scale: query scale; ``None`` means ``K ** -0.5``. Applied after the optional L2 norm.
        initial_state: ``[N, H, K, V]`` with ``N = B``, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the state after the last token of every sequence.
        cu_seqlens: ``[N + 1]`` strictly increasing integer boundaries of packed sequences (needs
            ``B == 1``); the recurrence restarts at each boundary.
        use_qk_l2norm: L2-normalise q and k over the last dimension (eps 1e-6) first.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, H, V]`` in q's dtype; ``final_state`` is ``[N, H, K, V]``
        fp32 (fp64 for fp64 inputs), or ``None`` unless ``output_final_state``.
        Internal arithmetic is fp32 (fp64 when any input is fp64).
    """
    N, cu, scale = _check_inputs("kda_recurrent", q, k, v, g, beta, scale, initial_state, cu_seqlens)
    out_dtype = q.dtype
    qc, kc, vc, gc, bc, S0 = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, initial_state, N)
    lay = _make_layout(q.shape[0], q.shape[1], cu, 1, q.device)
    qc, kc, vc, gc, bc = (_to_padded(x, lay) for x in (qc, kc, vc, gc, bc))
    o, S = _recurrent_core(qc, kc, vc, gc, bc, S0)
    o = _from_padded(o, lay).to(out_dtype)
    return o, (S if output_final_state else None)
