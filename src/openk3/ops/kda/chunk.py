"""Chunkwise-parallel KDA in plain PyTorch (exact; differentiable by autograd).

Each sequence is cut into chunks of ``C`` tokens. Inside a chunk (entering state ``S0``, token index
``t = 1..C``) let ``G_t = sum_{s<=t} g_s`` be the inclusive cumulative log decay. With

* ``A_kk[t, s] = beta_t * sum_d k_td k_sd exp(G_td - G_sd)`` for ``s < t`` (strictly lower triangular),
* ``A_qk[t, s] = sum_d q_td k_sd exp(G_td - G_sd)`` for ``s <= t``,

the pseudo-values solve the unit lower-triangular system ``(I + A_kk) U = diag(beta) (V - (K * e^G) S0)``.
Because the matrix does not depend on ``S0`` we precompute (for all chunks in parallel)
``W = (I + A_kk)^{-1} diag(beta) (K * e^G)`` and ``U~ = (I + A_kk)^{-1} diag(beta) V``; the sequential part is

    U   = U~ - W S0
    O   = (Q * e^G) S0 + A_qk U
    S_C = e^{G_C} * S0 + ((e^{G_C - G}) * K)^T U

Numerics: every exponential formed here has a non-positive argument, and every exponent is a direct
sum of exactly the ``g`` terms it covers (never the difference of two long cumulative sums, which in fp32
carries an absolute error of ``eps * |G|`` and loses small decays that follow a large one). The pairwise
factors ``exp(G_t - G_s)`` are never split into ``exp(G_t) * exp(-G_s)`` (which overflows once the decay
accumulated in a chunk passes ~88 in fp32). Instead the chunk is cut into sub-blocks of ``c ~ sqrt(C)``
tokens: for ``s`` in an earlier sub-block ``j`` than ``t`` we go through the last position ``r`` of
sub-block ``j``, ``exp(G_t - G_s) = exp(G_t - G_r) * exp(G_r - G_s)`` with both factors ``<= 1`` (so the
products are plain matmuls), and only the ``c x c`` diagonal sub-blocks use an explicit ``[c, c, K]``
decay tensor. Extra memory is about ``2 sqrt(C)`` times the size of ``k``.
"""

from __future__ import annotations

import math

import torch

from openk3.ops.kda.naive import _check_inputs, _from_padded, _make_layout, _prepare, _to_padded

__all__ = ["kda_chunk"]


def _sub_block(C: int) -> int:
    """Largest divisor of ``C`` not above ``ceil(sqrt(C))`` (balances the two decay tensors' sizes)."""
    top = math.isqrt(C)
    if top * top < C:
        top += 1
    return max(d for d in range(1, top + 1) if C % d == 0)


def _rev_excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_{s > t} x[s]`` along dim -2, summing only the terms involved (no cancellation)."""
    incl = x.flip(-2).cumsum(-2).flip(-2)
    return torch.cat([incl[..., 1:, :], torch.zeros_like(incl[..., :1, :])], dim=-2)


def _pairwise(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal decayed products inside each chunk.

    Args:
        g: ``[..., C, K]`` per-token log decay; q, k: ``[..., C, K]``; c: sub-block size (divides ``C``).

    Returns:
        ``(A_qk, M_kk)`` of shape ``[..., C, C]``: ``A_qk[t, s] = sum_d q_td k_sd e^{G_td - G_sd}`` for ``s <= t``
        and ``M_kk`` the same with ``k`` in place of ``q`` (lower triangular incl. the diagonal; 0 above).

    Every exponent is built from sums of only the ``g`` terms it involves (sub-block-local cumulative
    sums), never as a difference of two long cumulative sums: in fp32 such a difference would carry an
    absolute error of ``eps * |G|``, which is large once the decay accumulated in a chunk reaches hundreds.
    """
    *lead, C, K = g.shape
    nb = C // c
    dev = g.device
    gb = g.reshape(*lead, nb, c, K)
    kb = k.reshape(*lead, nb, c, K)
    qb = q.reshape(*lead, nb, c, K)
    G_loc = gb.cumsum(dim=-2)  # [..., nb, c, K] cumulative decay inside each sub-block
    tot = G_loc[..., -1, :]  # [..., nb, K] total decay of each sub-block

    # Off-diagonal sub-blocks (block(s) = j < block(t) = i), through the reference r = end of block j:
    # G_t - G_r = G_loc_t + gap_ij with gap_ij = sum_{j < m < i} tot_m, and G_r - G_s = sum_{s < s' in block j} g_s'.
    right = kb * torch.exp(_rev_excl_cumsum(gb))  # [..., nb, c, K]; exponent <= 0
    blocks = torch.arange(nb, device=dev)
    between = (blocks[None, :, None] < blocks[None, None, :]) & (
        blocks[None, None, :] < blocks[:, None, None]
    )
    gap = torch.einsum("ijm,...mk->...ijk", between.to(g.dtype), tot)  # [..., nb(i), nb(j), K]
    below = blocks[:, None] > blocks[None, :]  # [nb(i), nb(j)]
    # exp(G_loc_t + gap) = exp(G_loc_t) * exp(gap): both factors <= 1, so the product is safe and only
    # small tensors go through exp().
    gap_dec = torch.exp(gap.masked_fill(~below[:, :, None], float("-inf")))  # [..., nb, nb, K]; 0 if j >= i
    loc_dec = torch.exp(G_loc).unsqueeze(-2)  # [..., nb, c, 1, K]
    dec = (loc_dec * gap_dec.unsqueeze(-3)).reshape(*lead, C, nb, K)
    a_off = torch.einsum("...tjd,...jsd->...tjs", q.unsqueeze(-2) * dec, right)  # [..., C, nb, c]
    m_off = torch.einsum("...tjd,...jsd->...tjs", k.unsqueeze(-2) * dec, right)

    # Diagonal sub-blocks: explicit [c, c, K] decay tensor, lower triangle incl. diagonal. The exponent
    # G_t - G_s = sum_{s < m <= t} g_m is summed directly (a 0/1-weighted contraction), not as
    # G_loc_t - G_loc_s, so a large decay early in the sub-block cannot wipe out small later ones.
    pos = torch.arange(c, device=dev)
    span = (pos[None, :, None] < pos[None, None, :]) & (pos[None, None, :] <= pos[:, None, None])  # [t, s, m]
    tri = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
    expo_d = torch.einsum("tsm,...imk->...itsk", span.to(g.dtype), gb).masked_fill(
        ~tri[:, :, None], float("-inf")
    )
    kdec = torch.exp(expo_d) * kb.unsqueeze(-3)  # [..., nb, c(t), c(s), K]
    a_diag = torch.einsum("...itd,...itsd->...its", qb, kdec)  # [..., nb, c, c]
    m_diag = torch.einsum("...itd,...itsd->...its", kb, kdec)

    eye = torch.eye(nb, dtype=g.dtype, device=dev).reshape(nb, 1, nb, 1)

    def assemble(off: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
        full = off.reshape(*lead, nb, c, nb, c) + diag.unsqueeze(-2) * eye
        return full.reshape(*lead, C, C)

    return assemble(a_off, a_diag), assemble(m_off, m_diag)


def _chunk_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    C: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g: ``[N, L, H, K]``, v: ``[N, L, H, V]``, beta: ``[N, L, H]`` with ``L % C == 0``; S: ``[N, H, K, V]``."""
    N, L, H, K = q.shape
    V = v.shape[-1]
    NC = L // C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [N, L, H, D] -> [N, H, NC, C, D]
        return x.reshape(N, NC, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    b = beta.reshape(N, NC, C, H).permute(0, 3, 1, 2).unsqueeze(-1)  # [N, H, NC, C, 1]
    G = g.cumsum(dim=-2)

    A_qk, M_kk = _pairwise(g, q, k, _sub_block(C))
    A_kk = b * M_kk.tril(-1)
    decay = torch.exp(G)  # <= 1
    rhs = b * torch.cat([k * decay, v], dim=-1)  # [N, H, NC, C, K + V]
    X = torch.linalg.solve_triangular(A_kk, rhs, upper=False, unitriangular=True)  # (I + A_kk)^{-1} rhs
    W, U_tilde = X[..., :K], X[..., K:]
    q_hat = q * decay
    k_out = k * torch.exp(_rev_excl_cumsum(g))  # e^{G_C - G_t} <= 1
    decay_last = torch.exp(G[..., -1:, :]).transpose(-1, -2)  # [N, H, NC, K, 1]

    outs = []
    for n in range(NC):
        U = U_tilde[:, :, n] - W[:, :, n] @ S
        outs.append(q_hat[:, :, n] @ S + A_qk[:, :, n] @ U)
        S = decay_last[:, :, n] * S + k_out[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)  # [N, H, NC, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(N, L, H, V), S


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA; same contract and results as :func:`kda_recurrent`.

    Args:
        q, k: ``[B, T, H, K]`` queries/keys.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log decay (already activated, ``<= 0``).
        beta: ``[B, T, H]`` write strength in ``(0, 1)``.
        chunk_size: tokens per chunk (any positive int; sequences need not be multiples of it).
        scale: query scale; ``None`` means ``K ** -0.5``. Applied after the optional L2 norm.
        initial_state: ``[N, H, K, V]`` with ``N = B``, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the state after the last token of every sequence.
        cu_seqlens: ``[N + 1]`` strictly increasing integer boundaries of packed sequences (``B == 1``).
        use_qk_l2norm: L2-normalise q and k over the last dimension (eps 1e-6) first.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32/fp64 or None)``.

    The tail of every sequence is padded to whole chunks with ``k = q = v = 0``, ``beta = 0``, ``g = 0``;
    such tokens leave the state untouched, so the padding cannot change any result.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"kda_chunk: chunk_size must be a positive int, got {chunk_size!r}")
    N, cu, scale = _check_inputs("kda_chunk", q, k, v, g, beta, scale, initial_state, cu_seqlens)
    out_dtype = q.dtype
    qc, kc, vc, gc, bc, S0 = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, initial_state, N)
    # A chunk longer than the longest sequence only adds padding: shrink it (results are unchanged).
    longest = q.shape[1] if cu is None else max(b - a for a, b in zip(cu[:-1], cu[1:]))
    C = min(chunk_size, longest)
    lay = _make_layout(q.shape[0], q.shape[1], cu, C, q.device)
    qc, kc, vc, gc, bc = (_to_padded(x, lay) for x in (qc, kc, vc, gc, bc))
    o, S = _chunk_core(qc, kc, vc, gc, bc, S0, C)
    o = _from_padded(o, lay).to(out_dtype)
    return o, (S if output_final_state else None)
