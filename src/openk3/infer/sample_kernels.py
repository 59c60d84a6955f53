"""Triton kernels for the engine's token draw: :func:`openk3.infer.sampling.sample` with per-row draw keys, without
a sort and without a per-row program walking the whole vocabulary.

The draw is Gumbel-max (``openk3.infer.sampling``): the token is the argmax over the kept tokens of ``x_i + G_i``,
with ``x`` the penalised, temperature-scaled logits and ``G_i`` the counter-based Gumbel noise of (key, i). The
filters keep a top set of ``x``: top-k keeps ``x_i >= x_(k)`` (the k-th largest; ties kept), top-p keeps the tokens
whose strictly more likely tokens hold less than ``p`` of the (top-k renormalised) probability mass. Because the
kept set is a top set, its argmax can be found without forming it (the rejection rounds of sorting-free top-p
samplers): take ``j`` = the argmax of ``x + G`` over every token above a pivot (first: every token); if ``j`` is
kept it is the answer (the kept set lies inside the searched one); else every kept token has ``x > x_j``, so search
again above ``x_j``. A round keeps ``j`` with probability at least ``p``; each round is one pass over the row.

Three launches (grid ``[P, R]`` for the first two, ``P`` chunks of ``CH`` tokens per row):

1. every chunk's max of ``x`` and sum of ``exp(x - max)`` (the softmax normaliser in parts) and its argmax of
   ``x + G`` (first index on ties) with that token's ``x``;
2. (only when a sampled row has ``top_p < 1``) every chunk forms the row's normaliser ``Z`` and first pick ``j1``
   from the parts, its mass strictly above ``x_j1`` and its argmax of ``x + G`` among the tokens above ``x_j1``;
3. one program per row: ``j1`` when it is kept (mass above it ``< p Z``), else the best of the chunks' second picks,
   then further rounds over the whole row in this program until a pick is kept (each round keeps its pick with
   probability ``>= p``; rarely reached at the usual ``p``).

Top-k enters as a per-row lower bound on the penalised logits (the k-th largest, from ``torch.topk``), divided by
the temperature in the kernel exactly as the logits are, so it is the k-th largest scaled logit. Greedy rows
(temperature 0) take the argmax of the penalised logits. Tokens of exactly equal logits at the top-p boundary are
kept or dropped together, as in ``sampling.top_p_filter``; the tokens equal the reference's (``sample`` without keys
on the same noise) up to fp32 rounding of the mass next to ``p``.
"""

from __future__ import annotations

import torch

from openk3.fast._triton import pdl_launch, pdl_on

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing
    triton = tl = None
    HAS_TRITON = False

__all__ = ["SAMPLE_CONFIG", "gumbel_argmax_triton", "logprobs_triton", "sample_triton"]

# CH: tokens per program of the two chunked passes (V = 163,840: 160 programs per row); FB: tokens per step of
# the per-row rounds of the last kernel.
SAMPLE_CONFIG = {"CH": 1024, "num_warps": 4, "FB": 4096, "final_warps": 8}

_BIG = 2147483647

if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait

    @triton.jit
    def _h32(x):
        """openk3.infer.sampling._h32 on uint32 (wrapping arithmetic)."""
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def _gumbel(i, key):
        """The counter-based Gumbel noise of tokens ``i`` under draw key ``key`` (sampling.gumbel_scores)."""
        h = _h32(_h32(i.to(tl.uint32)) ^ key)
        u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), 0.99999994)  # sampling.U_MAX
        return -tl.log(-tl.log(u))

    @triton.jit
    def _gumbel_argmax_kernel(
        x_ptr, key_ptr, out_ptr, V, s_x, BLOCK: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr
    ):
        """out[r] = argmax_i x[r, i] + G(key_r, i), first index on ties (sampling.gumbel_argmax_reference)."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        r = tl.program_id(0).to(tl.int64)
        key = tl.load(key_ptr + r).to(tl.uint32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        besti = tl.full([BLOCK], 2147483647, tl.int32)
        for t in tl.range(NB, num_stages=3):  # the logits stream through shared memory, two blocks ahead
            i = t * BLOCK + tl.arange(0, BLOCK)
            m = i < V
            x = tl.load(x_ptr + r * s_x + i, mask=m, other=float("-inf")).to(tl.float32)
            sc = x + _gumbel(i, key)
            up = m & (sc > best)  # strict: each lane keeps its first maximum
            best = tl.where(up, sc, best)
            besti = tl.where(up, i, besti)
        mx = tl.max(best, 0)
        tl.store(out_ptr + r, tl.min(tl.where(best == mx, besti, 2147483647), 0).to(tl.int64))

    @triton.jit
    def _draw_values(
        x_ptr, seen_ptr, lo_ptr, r, i, V, s_x, s_s, t, pen, key, SEEN: tl.constexpr, LO: tl.constexpr
    ):
        """Tokens ``i`` of row ``r``: ``x`` (penalised, divided by the temperature ``t`` when ``t > 0``, -inf below
        the top-k bound or past ``V``) and the score ``x + G(key, i)`` (``x`` itself for a greedy row)."""
        m = i < V
        x = tl.load(x_ptr + r * s_x + i, mask=m, other=float("-inf")).to(tl.float32)
        if SEEN:
            s = tl.load(seen_ptr + r * s_s + i, mask=m, other=0) != 0
            x = tl.where(s, tl.where(x > 0, x / pen, x * pen), x)
        sampled = t > 0
        x = tl.where(sampled, x / tl.where(sampled, t, 1.0), x)
        if LO:
            lo = tl.load(lo_ptr + r)
            lo = tl.where(sampled, lo / tl.where(sampled, t, 1.0), float("-inf"))  # greedy rows: no bound
            x = tl.where(x < lo, float("-inf"), x)
        if sampled:  # the noise only where it is drawn (a greedy row's chunk is a plain load and max)
            sc = x + _gumbel(i, key)
        else:
            sc = x
        return x, sc

    @triton.jit
    def _row_params(par_ptr, key_ptr, r):
        """Row ``r``'s temperature, top_p, repetition penalty and draw key (``params`` [R, 4], ``keys`` [R])."""
        t = tl.load(par_ptr + r * 4)
        p = tl.load(par_ptr + r * 4 + 1)
        pen = tl.load(par_ptr + r * 4 + 3)
        return t, p, pen, tl.load(key_ptr + r).to(tl.uint32)

    @triton.jit
    def _first_max(sc, i, x):
        """(max of ``sc``, the first ``i`` holding it, that lane's ``x``); (-inf, BIG, -inf) when none is finite."""
        best = tl.max(sc, 0)
        bi = tl.min(tl.where(sc == best, i, 2147483647), 0)
        bi = tl.where(best > float("-inf"), bi, 2147483647)
        bx = tl.max(tl.where(i == bi, x, float("-inf")), 0)
        return best, bi, bx

    @triton.jit
    def _row_parts(ws_ptr, wi_ptr, r, P, PB: tl.constexpr):
        """From the first pass's parts of row ``r``: the max ``m`` of ``x``, ``Z = sum exp(x - m)``, the first pick
        ``j1`` (argmax of the scores, first index on ties) and its ``x``."""
        c = tl.arange(0, PB)
        mc = c < P
        base = r * P * 4 + c * 4
        cm = tl.load(ws_ptr + base, mask=mc, other=float("-inf"))
        cs = tl.load(ws_ptr + base + 1, mask=mc, other=0.0)
        cb = tl.load(ws_ptr + base + 2, mask=mc, other=float("-inf"))
        cx = tl.load(ws_ptr + base + 3, mask=mc, other=float("-inf"))
        ci = tl.load(wi_ptr + r * P * 2 + c * 2, mask=mc, other=2147483647)
        m = tl.max(cm, 0)
        z = tl.sum(tl.where(cm > float("-inf"), cs * tl.exp(cm - m), 0.0), 0)
        _, j, xj = _first_max(cb, ci, cx)  # the chunks' picks: the best, first index on ties
        return m, z, j, xj

    @triton.jit
    def _draw_pass1(
        x_ptr, seen_ptr, lo_ptr, par_ptr, key_ptr, ws_ptr, wi_ptr, V, P, s_x, s_s,
        CH: tl.constexpr, SEEN: tl.constexpr, LO: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (P, R): chunk ``c`` of row ``r``: max of x, sum of exp(x - max), first argmax of the scores."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        c = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        t, p, pen, key = _row_params(par_ptr, key_ptr, r)
        i = c * CH + tl.arange(0, CH)
        x, sc = _draw_values(x_ptr, seen_ptr, lo_ptr, r, i, V, s_x, s_s, t, pen, key, SEEN, LO)
        m = tl.max(x, 0)
        s = tl.zeros_like(m)
        if (t > 0) & (p < 1.0):  # the normaliser only where top-p needs it
            s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), 0)
        best, bi, bx = _first_max(sc, i, x)
        o = (r * P + c) * 4
        tl.store(ws_ptr + o, m)
        tl.store(ws_ptr + o + 1, s)
        tl.store(ws_ptr + o + 2, best)
        tl.store(ws_ptr + o + 3, bx)
        tl.store(wi_ptr + (r * P + c) * 2, bi)

    @triton.jit
    def _draw_pass2(
        x_ptr, seen_ptr, lo_ptr, par_ptr, key_ptr, ws_ptr, wi_ptr, w2_ptr, V, P, s_x, s_s,
        CH: tl.constexpr, PB: tl.constexpr, SEEN: tl.constexpr, LO: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (P, R), rows with top_p < 1 only: chunk ``c``'s mass strictly above the first pick and its first
        argmax of the scores among the tokens above it."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        c = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        t, p, pen, key = _row_params(par_ptr, key_ptr, r)
        if (t > 0) & (p < 1.0):
            m, z, j, xj = _row_parts(ws_ptr, wi_ptr, r, P, PB)
            g = tl.zeros_like(z)
            best = g + float("-inf")
            bx = best
            bi = tl.zeros_like(j) + 2147483647
            # a chunk without a token above the pick has nothing to add (its max, from the first pass)
            if tl.load(ws_ptr + (r * P + c) * 4) > xj:
                i = c * CH + tl.arange(0, CH)
                x, sc = _draw_values(x_ptr, seen_ptr, lo_ptr, r, i, V, s_x, s_s, t, pen, key, SEEN, LO)
                above = x > xj
                g = tl.sum(tl.where(above, tl.exp(x - m), 0.0), 0)
                best, bi, bx = _first_max(tl.where(above, sc, float("-inf")), i, x)
            o = (r * P + c) * 4
            tl.store(w2_ptr + o, g)
            tl.store(w2_ptr + o + 1, best)
            tl.store(w2_ptr + o + 2, bx)
            tl.store(wi_ptr + (r * P + c) * 2 + 1, bi)

    @triton.jit
    def _draw_final(
        x_ptr, seen_ptr, lo_ptr, par_ptr, key_ptr, ws_ptr, wi_ptr, w2_ptr, out_ptr, V, P, s_x, s_s,
        PB: tl.constexpr, FB: tl.constexpr, CPB: tl.constexpr, NB: tl.constexpr, SEEN: tl.constexpr,
        LO: tl.constexpr, TOPP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (R,): the row's token (see the module docstring)."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        r = tl.program_id(0).to(tl.int64)
        t, p, pen, key = _row_params(par_ptr, key_ptr, r)
        m, z, j, xj = _row_parts(ws_ptr, wi_ptr, r, P, PB)
        if TOPP:
            if (t > 0) & (p < 1.0):
                c = tl.arange(0, PB)
                mc = c < P
                base = r * P * 4 + c * 4
                g = tl.sum(tl.load(w2_ptr + base, mask=mc, other=0.0), 0)
                # the first pick is not kept: the chunks' picks above it, then rounds here
                if (g >= p * z) & (xj < m):
                    cb = tl.load(w2_ptr + base + 1, mask=mc, other=float("-inf"))
                    cx = tl.load(w2_ptr + base + 2, mask=mc, other=float("-inf"))
                    ci = tl.load(wi_ptr + r * P * 2 + c * 2 + 1, mask=mc, other=2147483647)
                    _, j, xj = _first_max(cb, ci, cx)
                    done = j == 2147483647  # no token above the first pick (cannot happen: it would be kept)
                    while not done:
                        ga = tl.zeros([FB], tl.float32)
                        nb = tl.full([FB], float("-inf"), tl.float32)
                        ni = tl.full([FB], 2147483647, tl.int32)
                        nx = tl.full([FB], float("-inf"), tl.float32)
                        for b in range(NB):
                            cc = b * CPB + tl.arange(0, CPB)
                            cm = tl.load(ws_ptr + (r * P + cc) * 4, mask=cc < P, other=float("-inf"))
                            if tl.max(cm, 0) > xj:  # blocks without a token above the pick are skipped
                                i = b * FB + tl.arange(0, FB)
                                x, sc = _draw_values(
                                    x_ptr, seen_ptr, lo_ptr, r, i, V, s_x, s_s, t, pen, key, SEEN, LO
                                )
                                above = x > xj
                                ga += tl.where(above, tl.exp(x - m), 0.0)
                                up = above & (sc > nb)  # strict: each lane keeps its first maximum
                                nb = tl.where(up, sc, nb)
                                ni = tl.where(up, i, ni)
                                nx = tl.where(up, x, nx)
                        kept = (tl.sum(ga, 0) < p * z) | (xj >= m)  # the most likely token is always kept
                        _, nj, nxj = _first_max(nb, ni, nx)
                        done = kept | (nj == 2147483647)
                        j = tl.where(kept, j, nj)
                        xj = tl.where(kept, xj, nxj)
        j = tl.where(j == 2147483647, 0, j)  # a row without a finite logit: token 0, as torch's argmax
        tl.store(out_ptr + r, j.to(tl.int64))


if HAS_TRITON:

    @triton.jit
    def _lp_pass1(
        x_ptr, cv_ptr, ci_ptr, ws_ptr, V, P, s_x, CH: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr
    ):
        """Grid (P, N): chunk ``c`` of row ``r``: its max and sum of exp(x - max), and its KP largest logits with
        their ids (largest first; the first index among equal values)."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        c = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        i = c * CH + tl.arange(0, CH)
        x = tl.load(x_ptr + r * s_x + i, mask=i < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), 0)
        tl.store(ws_ptr + (r * P + c) * 2, m)
        tl.store(ws_ptr + (r * P + c) * 2 + 1, s)
        o = (r * P + c) * KP
        for j in tl.static_range(KP):
            v = tl.max(x, 0)
            b = tl.min(tl.where(x == v, i, 2147483647), 0)
            tl.store(cv_ptr + o + j, v)
            tl.store(ci_ptr + o + j, b)
            x = tl.where(i == b, float("-inf"), x)

    @triton.jit
    def _lp_final(
        x_ptr, id_ptr, cv_ptr, ci_ptr, ws_ptr, ch_ptr, tv_ptr, ti_ptr, P, s_x, k,
        PB: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (N,): the row's log-normaliser from the chunks' parts, the chosen token's logprob, and the k best of
        the chunks' candidates (largest first, the first index among equal values) minus the normaliser."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, PB)
        cm = tl.load(ws_ptr + (r * P + c) * 2, mask=c < P, other=float("-inf"))
        cs = tl.load(ws_ptr + (r * P + c) * 2 + 1, mask=c < P, other=0.0)
        m = tl.max(cm, 0)
        lse = m + tl.log(tl.sum(tl.where(cm > float("-inf"), cs * tl.exp(cm - m), 0.0), 0))
        tok = tl.load(id_ptr + r)
        tl.store(ch_ptr + r, tl.load(x_ptr + r * s_x + tok).to(tl.float32) - lse)
        if KP > 0:
            q = tl.arange(0, PB * KP)
            mq = q < P * KP
            v = tl.load(cv_ptr + r * P * KP + q, mask=mq, other=float("-inf"))
            ids = tl.load(ci_ptr + r * P * KP + q, mask=mq, other=2147483647)
            for j in tl.static_range(KP):
                if j < k:
                    best = tl.max(v, 0)
                    b = tl.min(tl.where(v == best, ids, 2147483647), 0)
                    tl.store(tv_ptr + r * k + j, best - lse)
                    tl.store(ti_ptr + r * k + j, b.to(tl.int64))
                    v = tl.where(ids == b, float("-inf"), v)


def logprobs_triton(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """``openk3.infer.sampling.token_logprobs`` in two launches: per chunk of 1,024 logits its max, sum of exps and
    top k (grid [P, N]); per row the merge (grid [N])."""
    if logits.dim() != 2 or ids.shape != (logits.shape[0],):
        raise ValueError(
            f"logprobs: logits [N, V] and ids [N], got {tuple(logits.shape)}, {tuple(ids.shape)}"
        )
    N, V = logits.shape
    if not 0 <= k <= 32 or V >= _BIG:
        raise ValueError(f"logprobs: k must lie in [0, 32] and V below 2**31, got k={k}, V={V}")
    k = min(k, V)
    dev = logits.device
    chosen = torch.empty(N, dtype=torch.float32, device=dev)
    tv = torch.empty(N, k, dtype=torch.float32, device=dev)
    ti = torch.empty(N, k, dtype=torch.long, device=dev)
    if N == 0:
        return chosen, tv, ti
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    CH = min(1024, triton.next_power_of_2(V))
    P = triton.cdiv(V, CH)
    KP = triton.next_power_of_2(k) if k else 0
    ws = torch.empty(N, P, 2, dtype=torch.float32, device=dev)
    cv = torch.empty(N, P, max(KP, 1), dtype=torch.float32, device=dev)
    ci = torch.empty(N, P, max(KP, 1), dtype=torch.int32, device=dev)
    pdl = pdl_on(x)
    _lp_pass1[(P, N)](x, cv, ci, ws, V, P, x.stride(0), CH=CH, KP=KP, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    _lp_final[(N,)](
        x, ids.to(device=dev, dtype=torch.long).contiguous(), cv, ci, ws, chosen, tv, ti, P, x.stride(0), k,
        PB=triton.next_power_of_2(P), KP=KP, PDL=pdl, num_warps=8, **pdl_launch(pdl),
    )  # fmt: skip
    return chosen, tv, ti


def gumbel_argmax_triton(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One program per row of ``logits`` [R, V]: the counter-based draw of ``openk3.infer.sampling.gumbel_argmax``."""
    if logits.dim() != 2 or keys.shape != (logits.shape[0],):
        raise ValueError(
            f"gumbel_argmax: logits [R, V] and keys [R], got {tuple(logits.shape)}, {tuple(keys.shape)}"
        )
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.long, device=logits.device)
    if R == 0:
        return out
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    # one program per row: wide blocks keep enough bytes in flight
    BLOCK = min(2048, triton.next_power_of_2(V))
    pdl = pdl_on(x)
    _gumbel_argmax_kernel[(R,)](
        x, keys.to(device=x.device, dtype=torch.long).contiguous(), out, V, x.stride(0), BLOCK=BLOCK,
        NB=triton.cdiv(V, BLOCK), PDL=pdl, num_warps=8, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def sample_triton(
    logits: torch.Tensor,
    params: torch.Tensor,
    keys: torch.Tensor,
    *,
    lower: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
    top_p: bool = True,
) -> torch.Tensor:
    """Token ids [R] int64 of ``logits`` [R, V] (any float dtype, unit column stride).

    ``params`` [R, 4] fp32 per row: temperature (0 = greedy), top_p (in (0, 1]; 1 = off), unused, repetition
    penalty. ``keys`` [R] int64 draw keys (``sampling.sample_keys``; ignored for greedy rows). ``lower`` [R] fp32:
    each row's top-k bound on the penalised logits (-inf = off). ``seen`` [R, V] bool: tokens the penalty applies
    to. ``top_p=False`` promises that no sampled row has ``top_p < 1`` (one launch fewer)."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [R, V], got {tuple(logits.shape)}")
    R, V = logits.shape
    dev = logits.device
    if params.shape != (R, 4) or params.dtype != torch.float32 or not params.is_contiguous():
        raise ValueError(
            f"sample: params must be a contiguous fp32 [R, 4] = {(R, 4)}, got {tuple(params.shape)}"
        )
    if keys.shape != (R,) or keys.dtype != torch.long:
        raise ValueError(f"sample: keys must be int64 [R] = [{R}], got {tuple(keys.shape)} {keys.dtype}")
    if lower is not None and (lower.shape != (R,) or lower.dtype != torch.float32):
        raise ValueError(f"sample: lower must be fp32 [R] = [{R}], got {tuple(lower.shape)} {lower.dtype}")
    if seen is not None and seen.shape != (R, V):
        raise ValueError(f"sample: seen must be [R, V] = {(R, V)}, got {tuple(seen.shape)}")
    if V >= _BIG:
        raise ValueError(f"sample: a vocabulary of {V} tokens is too large (int32 indices)")
    out = torch.empty(R, dtype=torch.long, device=dev)
    if R == 0 or V == 0:
        return out.zero_()
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    cfg = SAMPLE_CONFIG
    CH = min(cfg["CH"], triton.next_power_of_2(V))
    P = triton.cdiv(V, CH)
    PB = triton.next_power_of_2(P)
    FB = min(cfg["FB"], triton.next_power_of_2(V))
    ws = torch.empty(R, P, 4, dtype=torch.float32, device=dev)
    w2 = torch.empty(R, P, 4, dtype=torch.float32, device=dev) if top_p else ws
    wi = torch.empty(R, P, 2, dtype=torch.int32, device=dev)
    sv = seen if seen is not None else x
    if seen is not None:
        sv = seen.view(torch.uint8) if seen.dtype == torch.bool else seen
        if sv.stride(-1) != 1:
            sv = sv.contiguous()
    lo = lower if lower is not None else params
    ss = sv.stride(0) if seen is not None else 0
    flags = {"SEEN": seen is not None, "LO": lower is not None}
    pdl = pdl_on(x)
    args = (x, sv, lo, params, keys)
    _draw_pass1[(P, R)](
        *args, ws, wi, V, P, x.stride(0), ss, CH=CH, **flags, PDL=pdl, num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )  # fmt: skip
    if top_p:
        _draw_pass2[(P, R)](
            *args, ws, wi, w2, V, P, x.stride(0), ss, CH=CH, PB=PB, **flags, PDL=pdl,
            num_warps=cfg["num_warps"], **pdl_launch(pdl),
        )  # fmt: skip
    _draw_final[(R,)](
        *args, ws, wi, w2, out, V, P, x.stride(0), ss, PB=PB, FB=FB, CPB=FB // CH, NB=triton.cdiv(V, FB), **flags, TOPP=top_p,
        PDL=pdl, num_warps=cfg["final_warps"], **pdl_launch(pdl),
    )  # fmt: skip
    return out
