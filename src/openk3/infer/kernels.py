"""Triton decode kernels for the inference engine: the fused KDA step and paged absorbed MLA (split-K).

Both implement the signatures of :mod:`openk3.infer.decode` (layouts there) and are registered as
``FAST_KDA_DECODE["triton"]`` / ``FAST_MLA_DECODE["triton"]`` on import when Triton and a CUDA device are present.
They also run under ``TRITON_INTERPRET=1`` on CPU tensors (the tests call :func:`kda_decode_triton` and
:func:`mla_decode_triton` directly). No host synchronisation; the grid depends only on tensor shapes, so both can be
captured in a CUDA graph.

KDA (SPEC.md §1.5), one launch ``[B, H]`` (``[H, B]`` with ``heads_fast``): a program owns one (row, head). Above
the few-row regime it first asks for its head's whole state in L2 (``prefetch.global.L2``; compiled kernels only).
It requests the first state tile, then runs the short conv of q, k and v over the history in ``conv_state`` plus
the raw projections (fp32, SiLU, rounded to the model dtype like the reference), shifts the history in place, computes the gate (``lowerbound``:
``lb * sigmoid(exp(A) (z + dt_bias))``, ``softplus``: ``-exp(A) softplus(z + dt_bias)``), ``beta =
sigmoid(beta_logits)``, L2-normalises q and k (eps 1e-6) and scales q by ``K^-0.5``; then streams the fp32 state
``[K, V]`` through registers in ``BV``-column tiles, each read once and written once, the next tile in flight while
the current one is processed (the loop makes no other memory access)::

    S' = diag(exp g) S;  p = S'^T k;  u = beta (v - p);  S = S' + k u^T;  o = S^T q = S'^T q + (q.k) u

(``S'^T k``, ``S'^T q`` and the tile's slice of v come out of one reduction over the key axis), and finishes with the
gated RMSNorm ``rmsnorm(o) * o_norm.weight * sigmoid(gate)`` (o rounded to the model dtype first, as the reference
does; the raw tiles are staged in the output row and normalised by a second sweep of the same program). Minimal
traffic: ``2 * B * H * K * V * 4`` bytes of state plus the conv history and the activations.

KDA split form (``split_v`` NV, for few rows), one launch ``[NV, H, B]``: program ``(j, h, b)`` owns the state
columns ``[j K / NV, (j + 1) K / NV)`` of one (row, head), so the NV programs of a head run side by side. Each issues
every load it needs before waiting for any (the slot, then the conv weights and taps, the gate parameters, the norm
weight, ``f_b``'s rows for the whole head and ``g_b``'s rows for its columns, its state tile, the conv history, then
the activations), recomputes the head-wide terms (the conv of q and k, their L2 norms, the decay), updates its tile
in place and writes its raw output (rounded) to the output row, the sigmoid of its output gate and its sum of
squares to a scratch buffer, and shifts the history of its own v channels (no other program reads them). It then
adds one to an arrival counter of its (row, head) (acquire-release, GPU scope, after a CTA barrier, so every thread's
reads and writes precede it); the program that arrives last reads the head's staged output, gates and sums (through
L2), writes the gated RMSNorm of the whole head, shifts the q and k history (every program of the head has read it
by then) and sets the counter back to zero for the next launch or graph replay (the counters live for the process:
:func:`kda_split_counters`). Same roundings as the per-head form; the work of the head-wide terms is repeated NV times.

MLA (SPEC.md §2.4), FlashDecoding-style: program ``(head block, split, row)`` takes ``BLOCK_H`` heads of one row and
one contiguous share of that row's context (``lengths[b]`` split in ``num_splits`` parts of whole ``BLOCK_N``-token
blocks; the number of splits depends on shapes only, see :func:`mla_num_splits`). Per block it gathers the latent
rows through ``block_table`` (one load of the 576-wide row serves as key, its first 512 values as value; the page
size is a compile-time constant, so a block needs one table entry when it lies in one page, ``BLOCK_N / page_size``
when it spans whole pages, one per token otherwise), forms ``scale * kv . q`` and ``kv^T p`` with ``tl.dot``
(operands in the cache dtype with fp32 accumulation; three-pass tf32 for fp32 caches; by default transposed, tokens
and latent dims on the M side and heads on the N side, so few heads still fill wgmma tiles) and keeps an online
softmax in fp32. With a block-table load inside the loop, Triton's software pipeliner keeps the rows of only one
block in flight (the table load takes the first stage, the rows the last), so the default loop form
(``prefetch=2``) carries the next block's table entries in registers from one iteration to the next: the row loads
then depend on no load of their own iteration and get ``num_stages - 1`` shared-memory buffers. (``prefetch=True``,
the older form, carries the next block's rows in registers instead.) The split count fills the SMs in whole waves of
the programs they hold at once (:func:`mla_num_splits`, from the compiled kernel's shared memory and registers).
With one split the program writes the output; otherwise it writes a normalised partial and its log2
sum-exp, and a reduce kernel ``[H, B]`` combines the splits that hold tokens. Head blocks of one (row, split) are
adjacent in launch order, so with several head blocks the cache bytes come from L2 after the first. Balanced form
(``balance``, several rows): the same ``num_splits * B`` programs (plus one per row) on one flat axis share the
batch's tokens evenly -- every program derives one blocks-per-split count from all rows' lengths on the device and
finds its (row, split) by a prefix sum over the rows' split counts -- so a short row takes fewer splits and a long
one more, and ragged rows finish together.

MLA glue (:mod:`openk3.infer.decode`'s prep and post steps, ``EngineConfig.fuse_mla_glue``). Prep, one launch of
``H * NC + B`` programs: ``H * NC`` programs each form ``dc / NC`` columns of one head's absorbed query for every
row (fp32 products and sums over ``W_UK`` read as a strided view of ``kv_b_proj``'s weight), and ``B`` programs
normalise one row's latent, write it with the rope key into the paged cache and copy the rope part of the query.
Post: with several splits the reduce, grid ``[VS, H, B]``, combines a (row, head)'s partials and applies ``dv / VS``
rows of ``W_UV``, the rounding to the model dtype and the output gate; after a one-split walk a kernel of the same
grid reads the walk's output instead. ``NC`` and ``VS`` give every SM at least one program (:data:`MLA_GLUE_CONFIG`).
"""

from __future__ import annotations

import logging
import math
import os

import torch

from openk3.fast._triton import pdl_launch, pdl_on, resident_per_sm
from openk3.fast._triton import sm_count as _sm_count
from openk3.infer.decode import FAST_KDA_DECODE, FAST_MLA_DECODE
from openk3.infer.sample_kernels import gumbel_argmax_triton

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing
    triton = tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "KDA_CONFIG",
    "KDA_LAST_LAUNCH",
    "MLA_CONFIG",
    "MLA_GLUE_CONFIG",
    "MLA_GLUE_LAST_LAUNCH",
    "MLA_LAST_LAUNCH",
    "available",
    "gumbel_argmax_triton",
    "kda_decode_triton",
    "kda_split_counters",
    "kda_supports",
    "mla_decode_triton",
    "mla_num_splits",
    "mla_post_triton",
    "mla_prep_triton",
    "mla_supports",
    "register",
]

# Launch parameters (the benchmark sweeps alternatives through the keyword overrides of the wrappers).
# BV = 0: the whole head in one tile. (A two-launch form with one program per state column tile, meant for small
# batches, measured 1.3-3.9x slower than this one at B = 1..256 on an H200 and was removed; bench/NOTES.md.)
# stages = 0: the next state tile is requested by hand one tile ahead (into registers); stages >= 2: a plain loop that
# Triton's pipeliner streams through shared memory, stages - 1 tiles ahead (fewer registers per program).
# "few": launch parameters for batches of at most "few_max_batch" rows (None: the same as above), where one program
# per (row, head) leaves most SMs idle and the tile walk's latency, not bandwidth, sets the time.
# l2_prefetch: each program first requests its head's whole state into L2 (prefetch.global.L2), so the tile walk is
# not limited by the one tile per program that registers hold in flight; heads_fast: grid (H, B) instead of (B, H),
# so the programs running together walk one contiguous stretch of state slots. Both on: B=256 H=32 K=128 0.381 ->
# 0.350 ms on an H200 (3.07 TB/s of state traffic); at B <= 16 both cost 1-6 %, so the few-row regime leaves them off.
# split_v NV >= 2 (a power of two at most K): the split form, for few rows, where one program per (row, head)
# walking its tiles one after another leaves most SMs idle and the time is a chain of dependent loads and
# reductions. NV programs per (row, head), each owning K / NV state columns; each issues all its loads up front
# (state tile, conv history and weights, f_b's rows for the head, g_b's rows for its columns, ...) and recomputes the
# head-wide terms (q / k conv, L2 norms, decay); the last of the head's programs to arrive (an atomic counter per
# (row, head), left at zero for the next launch) applies the gated RMSNorm to the whole head. On an H200 (per call,
# L2 flushed, bench/NOTES.md v13) NV 4 at 4 warps took the 48B shape's step at one row from 17.5 to 11.1 us and
# medium's from 15.7 to 9.9 us; at four rows NV 2 (48B: 19.0 -> 15.2 us, medium: 16.1 -> 11.7 us); eight warps and
# register caps were slower. As configured here NV is the split at one row: it halves while B * H * NV exceeds
# split_programs_per_sm programs per SM (0: no limit), and the per-head form runs once it would reach 1 (the
# kda_decode_triton keyword split_v is taken as given). split_num_warps: warps per program; split_prefetch: the
# state tile is first requested into L1 (1) or L2 (2) by a prefetch instruction (0: not); split_maxnreg: a cap on
# registers per thread (0: none; ptxas otherwise keeps many loads in flight, 160-250 registers at 8 warps for the
# 48B shape, one program per SM; at 128 two fit, with a few spills: bench/diag_kda_compile.py).
KDA_CONFIG = {
    "BV": 32,
    "num_warps": 4,
    "stages": 0,
    "l2_prefetch": True,
    "heads_fast": True,
    "split_v": 0,
    "split_num_warps": 4,
    "split_prefetch": 2,
    "split_maxnreg": 0,
    "split_programs_per_sm": 2,
    "few": {"l2_prefetch": False, "heads_fast": False, "split_v": 4},
    "few_max_batch": 16,
}
KDA_LAST_LAUNCH: dict = {}  # the launch parameters of the latest kda_decode_triton call
MLA_CONFIG = {
    # launch parameters by regime (chosen by measurement on an H200, bench/NOTES.md). prefetch 2: the next block's
    # page-table entries ride in registers, so Triton's pipeliner can stream the latent rows through shared memory
    # (with the table load inside the loop it kept one block in flight). The split count follows from how many
    # programs of the compiled kernel one SM holds (_mla_resident, mla_num_splits).
    "few": {"block_h": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "trans": True, "prefetch": 2},
    "many": {"block_h": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "trans": True, "prefetch": 2},
    "fp32": {"block_h": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "trans": True, "prefetch": True},
    "min_chunk": 128,
    # the least tokens per split for batches of at most "few_min_chunk_rows" rows: smaller values give short contexts
    # at batch 1 more, shorter splits (each program's walk is latency-bound there). H200, one row, 1,024 tokens
    # (bench/diag_mla.py --configs default,chunk32, bench/NOTES.md v13): 16 heads 12.5 -> 9.4 us, 32 heads 13.4 ->
    # 11.1 us; 4,096 tokens unchanged. Only one row measured, so only one row takes it
    "few_min_chunk": 32,
    "few_min_chunk_rows": 1,
    "max_splits": 64,
    "overhead_blocks": 2,  # a program's fixed cost (pipeline fill, epilogue, partials) in blocks of work
    # balanced splits (mla_decode_triton's balance): the split count's programs share all rows' tokens evenly, so
    # a batch of ragged lengths does not wait on its longest row's splits; a row takes at most balance_spread times
    # the even share of splits (the partials' buffer is that much wider). Off: measured slower than the per-row
    # form on an H100 (bench/NOTES.md v28: 3 % at ragged 16 heads, 19-96 % at 96 heads)
    "balance": False,
    "balance_spread": 2,
    # the warp-specialised Gluon split kernel (openk3.infer.mla_gluon: a TMA loader warp and two warp groups on
    # the products, 64 heads per program) for at least "gluon_min_heads" heads and "gluon_min_rows" rows, on Hopper
    # with a bf16 / fp16 cache; the Triton split kernel otherwise. H100, ragged rows (bench/NOTES.md v29, v31): 96
    # heads 1.8-2.2x faster than the Triton kernel (and 1-18 % faster than FlashInfer's), 32 heads 1.2-1.3x, 16 heads
    # 1.02-1.17x (uniform rows at 16 heads within 2 %); H200 (v31): 16 heads 1.18-1.25x ragged, 1.02x uniform, 32
    # heads 1.66x ragged; one row at 32 heads and 1,040 tokens 13.0 against 11.5 us, so one row keeps the Triton
    # kernel
    "gluon": True,
    "gluon_min_heads": 16,
    "gluon_min_rows": 2,
}
# The MLA glue steps around the split kernel (EngineConfig.fuse_mla_glue): the prep kernel (latent norm + cache
# write + absorbed query) and the post step (W_UV product, rounding, output gate; folded into the reduce, or its own
# launch after a one-split walk). Both split the heads' weight slices over enough programs to give every SM at
# least one ("programs_per_sm"): the prep over column chunks of W_UK (at least "prep_min_cols" wide), the post over
# row chunks of W_UV (at least "post_rows" rows, walked "post_rows" at a time).
MLA_GLUE_CONFIG = {
    "programs_per_sm": 1,
    "prep_min_cols": 32,
    # W_UK values per step of a prep program (dn chunk x columns); a head's whole dn in one tile (at 512 / 32 heads,
    # or 512 / 16 heads, and dn 128) is loaded once and held while the rows stream through, "prep_stages" ahead
    "prep_elems": 8192,
    "prep_stages": 2,
    "prep_warps": 4,
    # the held W_UK tile requested before the prep kernel waits for the kernel before it (programmatic dependent
    # launch), instead of after. H200, batch 1 (bench/NOTES.md v21): 48B shape 2.35 -> 2.33-2.34 ms per step
    "prep_early": True,
    "post_rows": 8,
    "post_stages": 2,
    "post_warps": 4,
    # the reduce + post kernel: a program's W_UV slice (rows x dc) of at most this many values, where it spans more
    # than "post_rows" rows, requested before the program waits for the split kernel and held in registers (0, or
    # one step of rows: streamed after the reduce, "post_rows" at a time). H200, batch 1 (bench/NOTES.md v18): 48B
    # shape (16 rows per program) 2.40 -> 2.36-2.37 ms per step; `medium` (8 rows, one step) measured 1.165 -> 1.18
    # with it, so a one-step slice keeps the streamed form
    "post_whole_elems": 8192,
}


log = logging.getLogger("openk3.infer")

# Triton picks the interpreter when a kernel is defined (this module's import), so read the switch once, here.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> tuple[bool, str]:
    """Whether these kernels can run as compiled GPU kernels here."""
    if not HAS_TRITON:
        return False, "triton not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, "triton decode kernels"


if HAS_TRITON:
    from openk3.fast._triton import pdl_trigger, pdl_wait
    from openk3.fast._triton import prefetch as _prefetch
    from openk3.fast._triton import prefetch_l2 as _prefetch_l2
    from openk3.fast._triton import round_to as _round

    @triton.jit
    def _rms_norm_vec(x, w, n, eps, dtype: tl.constexpr):
        """``openk3.ops.norm.rms_norm`` of one fp32 vector ``x`` (``n`` values; zeros past them) with gain ``w``: the
        normalised value rounded to ``dtype``, times the gain rounded to it, rounded again (as fp32)."""
        y = _round(x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps), dtype)
        return _round(_round(w, dtype) * y, dtype)

    @triton.jit
    def _window(x_ptr, hist_ptr, ch, cw, W: tl.constexpr):
        """``[C, WP]`` fp32: the ``W - 1`` history values then the current input (columns past ``W`` are zero)."""
        x = tl.load(x_ptr + ch).to(tl.float32)
        hist = tl.load(hist_ptr + ch[:, None] * (W - 1) + cw[None, :], mask=cw[None, :] < W - 1, other=0.0)
        return tl.where(cw[None, :] == W - 1, x[:, None], hist)

    @triton.jit
    def _conv_silu(x_ptr, w_ptr, hist_ptr, ch, cw, W: tl.constexpr, dtype: tl.constexpr):
        """Depthwise causal conv of one token over ``W - 1`` history values + the current one, SiLU, rounded to
        ``dtype``. ``ch [C]`` channels, ``cw [WP]`` tap index. Returns (y [C] fp32, window [C, WP] fp32)."""
        win = _window(x_ptr, hist_ptr, ch, cw, W)
        w = tl.load(w_ptr + ch[:, None] * W + cw[None, :], mask=cw[None, :] < W, other=0.0).to(tl.float32)
        y = tl.sum(win * w, axis=1)
        y = y * tl.sigmoid(y)
        return _round(y, dtype), win

    @triton.jit
    def _shift_hist(hist_ptr, win, ch, cw, W: tl.constexpr):
        """New history = window[1:] (oldest first)."""
        tl.store(
            hist_ptr + ch[:, None] * (W - 1) + cw[None, :] - 1,
            win,
            mask=(cw[None, :] >= 1) & (cw[None, :] < W),
        )

    @triton.jit
    def _add2(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @triton.jit
    def _add3(a0, b0, c0, a1, b1, c1):
        return a0 + a1, b0 + b1, c0 + c1

    @triton.jit
    def _lowrank_row(a_row, w_ptr, rows, R: tl.constexpr, RC: tl.constexpr, dtype: tl.constexpr):
        """``(w[rows, :] @ a)`` rounded to ``dtype`` (as fp32): a low-rank up projection of one activation row
        ``a [R]`` for the output channels ``rows``, fp32 products and sums, ``RC`` columns of ``w [*, R]`` at a
        time."""
        acc = tl.zeros(rows.shape, dtype=tl.float32)
        for c0 in tl.static_range(0, R, RC):
            cc = c0 + tl.arange(0, RC)
            a = tl.load(a_row + cc).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * R + cc[None, :]).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        return _round(acc, dtype)

    @triton.jit
    def _kda_gate(gate_row, ga_row, gb_ptr, chans, GR: tl.constexpr, GRC: tl.constexpr, dtype: tl.constexpr):
        """The output gate's pre-activation at channels ``chans`` (fp32): read from the gate row, or (``GR`` > 0)
        formed from the low-rank gate activation ``ga [GR]`` and ``g_b_proj``'s rows."""
        if GR > 0:
            g = _lowrank_row(ga_row, gb_ptr, chans, GR, GRC, dtype)
        else:
            g = tl.load(gate_row + chans).to(tl.float32)
        return g

    @triton.jit
    def _kda_prep(
        q, k, z, dt_bias_ptr, a_log_ptr, beta_row, ch, h, lower_bound, q_scale, LB_GATE: tl.constexpr
    ):
        """Per-head scalars of one step (fp32): L2-normalised q (times ``q_scale``) and k, the per-channel decay
        ``exp(g)`` (``lowerbound``: ``lb * sigmoid(exp(A) (z + dt_bias))``, else ``-exp(A) softplus(z + dt_bias)``,
        ``z`` the head's decay projection as fp32), ``beta = sigmoid(beta_logit)`` and ``q . k``."""
        decay = _kda_decay(
            z,
            tl.load(dt_bias_ptr + ch).to(tl.float32),
            tl.load(a_log_ptr + h).to(tl.float32),
            lower_bound,
            LB_GATE,
        )
        beta = tl.sigmoid(tl.load(beta_row + h).to(tl.float32))
        q = q * (q_scale / tl.sqrt(tl.sum(q * q) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        return q, k, decay, beta, tl.sum(q * k)

    @triton.jit
    def _kda_decay(z, dt_bias, a_log, lower_bound, LB_GATE: tl.constexpr):
        """The per-channel decay ``exp(g)`` (fp32) from the decay projection ``z`` and the loaded ``dt_bias`` /
        ``A_log``: ``lowerbound``: ``g = lb * sigmoid(exp(A) (z + dt_bias))``, else ``-exp(A) softplus(z +
        dt_bias)``."""
        zz = z + dt_bias
        a = tl.exp(a_log)
        if LB_GATE:
            g = lower_bound * tl.sigmoid(a * zz)
        else:
            g = -a * tl.where(zz > 20.0, zz, tl.log(1.0 + tl.exp(tl.minimum(zz, 20.0))))
        return tl.exp(g)

    @triton.jit
    def _kda_tile(S, sp, v, q, k, decay, beta, qk, dtype: tl.constexpr, SEL: tl.constexpr):
        """One ``[K, BV]`` tile ``S`` of a head's state (loaded from ``sp``): decay, delta update (written back to
        ``sp``), output. ``v``: this tile's values ``[BV]``, or with ``SEL`` a ``[K, BV]`` tile holding them on the
        matching rows (zero elsewhere), so that the same reduction over the key axis that yields ``S'^T k`` and
        ``S'^T q`` also extracts them. Returns (o rounded to ``dtype``, as fp32; its sum of squares)."""
        S = S * decay[:, None]
        if SEL:
            pred, oq, v = tl.reduce((S * k[:, None], S * q[:, None], v), 0, _add3)
        else:
            pred, oq = tl.reduce((S * k[:, None], S * q[:, None]), 0, _add2)
        u = beta * (v - pred)
        tl.store(sp, S + k[:, None] * u[None, :])
        o = _round(oq + qk * u, dtype)
        return o, tl.sum(o * o)

    @triton.jit
    def _kda_col_tile(
        S, j, sp0, obase, v, q, k, decay, beta, qk, ck, cv, BV: tl.constexpr, dtype: tl.constexpr
    ):
        """Tile ``j`` (BV state columns, loaded into ``S``) of a head: updated state written back, the raw output
        stored at ``obase`` (normalised afterwards); returns the tile's sum of squares of the output."""
        cols = j * BV + cv
        vsel = tl.where(ck[:, None] == cols[None, :], v[:, None], 0.0)
        o, ssj = _kda_tile(S, sp0 + j * BV, vsel, q, k, decay, beta, qk, dtype, True)
        tl.store(obase + cols, o.to(dtype))
        return ssj

    @triton.jit
    def _kda_decode_kernel(
        q_ptr, k_ptr, v_ptr, z_ptr, beta_ptr, gate_ptr, o_ptr,
        s_q, s_k, s_v, s_z, s_beta, s_gate, s_o,
        wq_ptr, wk_ptr, wv_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
        conv_ptr, state_ptr, slots_ptr, s_conv, s_state,
        lower_bound, eps, q_scale,
        H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
        LB_GATE: tl.constexpr, STAGES: tl.constexpr, PF_L2: tl.constexpr, HEADS_FAST: tl.constexpr,
        fa_ptr, fb_ptr, s_fa, ZR: tl.constexpr, ZRC: tl.constexpr,
        ga_ptr, gb_ptr, s_ga, GR: tl.constexpr, GRC: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # HEADS_FAST: grid (H, B), the programs of one row's heads run together (one contiguous state slot)
        if HEADS_FAST:
            h = tl.program_id(0)
            b = tl.program_id(1)
        else:
            b = tl.program_id(0)
            h = tl.program_id(1)
        dtype = o_ptr.dtype.element_ty
        HK: tl.constexpr = H * K
        slot = tl.load(slots_ptr + b).to(tl.int64)
        ck = tl.arange(0, K)
        cv = tl.arange(0, BV)
        head = state_ptr + slot * s_state + h * (K * K)
        if PF_L2:  # the whole head's state requested into L2 at once, so the tile walk below reads it from L2
            _prefetch_l2(head + tl.arange(0, K * K // 32) * 32)
        sp0 = head + ck[:, None] * K + cv[None, :]
        if BV == K or STAGES == 0:
            S_next = tl.load(sp0)  # the first state tile is requested before anything else
        # (PDL: the slots and the state are not written by the kernels of this step before this one, so they may be
        # requested before the previous kernel has finished; the inputs below are its outputs)
        pdl_wait(PDL)
        pdl_trigger(PDL)
        conv = conv_ptr + slot * s_conv
        cw = tl.arange(0, WP)
        ch = h * K + ck
        # 1. short conv + SiLU (whole head: the norms need every channel)
        q, win_q = _conv_silu(q_ptr + b * s_q, wq_ptr, conv, ch, cw, W, dtype)
        k, win_k = _conv_silu(k_ptr + b * s_k, wk_ptr, conv + HK * (W - 1), ch, cw, W, dtype)
        v, win_v = _conv_silu(v_ptr + b * s_v, wv_ptr, conv + 2 * HK * (W - 1), ch, cw, W, dtype)
        # 2. gate, beta, L2 norms, query scale (fp32). ZR > 0: the decay projection z = f_b(f_a) of this head is
        # formed here from the low-rank activation fa [ZR] and f_b's rows (one GEMV launch fewer per layer)
        if ZR > 0:
            z = _lowrank_row(fa_ptr + b * s_fa, fb_ptr, ch, ZR, ZRC, dtype)
        else:
            z = tl.load(z_ptr + b * s_z + ch).to(tl.float32)
        q, k, decay, beta, qk = _kda_prep(
            q, k, z, dt_bias_ptr, a_log_ptr, beta_ptr + b * s_beta, ch, h, lower_bound, q_scale, LB_GATE,
        )  # fmt: skip
        # every thread has consumed the history it loaded: shift it
        tl.debug_barrier()
        _shift_hist(conv, win_q, ch, cw, W)
        _shift_hist(conv + HK * (W - 1), win_k, ch, cw, W)
        _shift_hist(conv + 2 * HK * (W - 1), win_v, ch, cw, W)
        # 3. delta-rule update, BV columns of the state at a time (the next tile is requested before the current
        # one is processed; no other memory access in the loop); 4. gated RMSNorm over the head
        obase = o_ptr + b * s_o + h * K
        if BV == K:
            o, ss = _kda_tile(S_next, sp0, v, q, k, decay, beta, qk, dtype, False)
            y = o * (1.0 / tl.sqrt(ss / K + eps)) * tl.load(norm_w_ptr + cv).to(tl.float32)
            y = y * tl.sigmoid(
                _kda_gate(gate_ptr + b * s_gate, ga_ptr + b * s_ga, gb_ptr, h * K + cv, GR, GRC, dtype)
            )
            tl.store(obase + cv, _round(y, dtype).to(dtype))
        else:
            NT: tl.constexpr = K // BV
            ss = 0.0
            if STAGES == 0:
                for j in tl.range(0, NT):
                    S = S_next
                    S_next = tl.load(sp0 + (j + 1) * BV, mask=j + 1 < NT, other=0.0)
                    ss += _kda_col_tile(S, j, sp0, obase, v, q, k, decay, beta, qk, ck, cv, BV, dtype)
            else:  # the tile loads go through shared memory, STAGES - 1 tiles ahead
                for j in tl.range(0, NT, num_stages=STAGES):
                    S = tl.load(sp0 + j * BV)
                    ss += _kda_col_tile(S, j, sp0, obase, v, q, k, decay, beta, qk, ck, cv, BV, dtype)
            r = 1.0 / tl.sqrt(ss / K + eps)
            tl.debug_barrier()  # the raw tiles were written by other threads of this program
            for j in tl.range(0, NT):
                cols = j * BV + cv
                y = tl.load(obase + cols).to(tl.float32) * r * tl.load(norm_w_ptr + cols).to(tl.float32)
                y = y * tl.sigmoid(
                    _kda_gate(gate_ptr + b * s_gate, ga_ptr + b * s_ga, gb_ptr, h * K + cols, GR, GRC, dtype)
                )
                tl.store(obase + cols, _round(y, dtype).to(dtype))

    @triton.jit
    def _taps(ptr, ch, T: tl.constexpr, N: tl.constexpr):
        """``T`` vectors ``[C]`` (fp32): tap ``t`` of the channels ``ch`` of a ``[*, N]`` row-major table (conv
        weights, ``N = W``; history, ``N = W - 1``). Separate vectors rather than one ``[C, T]`` tile, so that the
        conv's results take whatever layout their users want (a ``[C, T]`` tile's layout would spread to the
        state tile, costing two passes of it through shared memory)."""
        out = ()
        for t in tl.static_range(T):
            out = out + (tl.load(ptr + ch * N + t).to(tl.float32),)
        return out

    @triton.jit
    def _conv_taps(x, hist, w, W: tl.constexpr, dtype: tl.constexpr):
        """Depthwise causal conv of one token from :func:`_taps` vectors (history oldest first, then ``x``), SiLU,
        rounded to ``dtype`` (as fp32)."""
        y = x * w[W - 1]
        for t in tl.static_range(W - 1):
            y += hist[t] * w[t]
        y = y * tl.sigmoid(y)
        return _round(y, dtype)

    @triton.jit
    def _shift_taps(hist_ptr, x, hist, ch, W: tl.constexpr):
        """New history (oldest first) = old taps 1.. then ``x``."""
        for t in tl.static_range(W - 1):
            if t + 1 < W - 1:
                tl.store(hist_ptr + ch * (W - 1) + t, hist[t + 1])
            else:
                tl.store(hist_ptr + ch * (W - 1) + t, x)

    @triton.jit
    def _kda_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, z_ptr, beta_ptr, gate_ptr, o_ptr,
        s_q, s_k, s_v, s_z, s_beta, s_gate, s_o,
        wq_ptr, wk_ptr, wv_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
        conv_ptr, state_ptr, slots_ptr, s_conv, s_state,
        cnt_ptr, sg_ptr, ss_ptr,
        lower_bound, eps, q_scale,
        H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, NV: tl.constexpr, LB_GATE: tl.constexpr,
        fa_ptr, fb_ptr, s_fa, ZR: tl.constexpr, ga_ptr, gb_ptr, s_ga, GR: tl.constexpr, PDL: tl.constexpr,
        PF: tl.constexpr,
    ):  # fmt: skip
        # program (j, h, b): state columns [j * BV, (j + 1) * BV) of head h of row b; the NV programs of one head
        # are adjacent in launch order
        j = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        dtype = o_ptr.dtype.element_ty
        HK: tl.constexpr = H * K
        BV: tl.constexpr = K // NV
        ck = tl.arange(0, K)
        cols = j * BV + tl.arange(0, BV)
        ch = h * K + ck  # the head's q / k channels
        chv = h * K + cols  # this program's v channels (= its state columns)
        # 1. every load, issued before any of them is waited for. The slot comes first (the state and the conv
        # history hang on it); then what hangs on nothing (the weights of the conv, the gates and the norm, the
        # low-rank up projections' rows: f_b's for the whole head, g_b's for these columns only)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        wq = _taps(wq_ptr, ch, W, W)
        wk = _taps(wk_ptr, ch, W, W)
        wv = _taps(wv_ptr, chv, W, W)
        dtb = tl.load(dt_bias_ptr + ch).to(tl.float32)
        a_log = tl.load(a_log_ptr + h).to(tl.float32)
        norm_w = tl.load(norm_w_ptr + ck).to(tl.float32)
        if ZR > 0:
            fb = tl.load(fb_ptr + ch[:, None] * ZR + tl.arange(0, ZR)[None, :])
        if GR > 0:
            gb = tl.load(gb_ptr + chv[:, None] * GR + tl.arange(0, GR)[None, :])
        # the slot's state tile and conv history (PDL: like the state, the history is written only by this layer's
        # step, so both may be requested before the previous kernel has finished)
        # PF: the tile's lines are first requested into L1 (1) or L2 (2) by a prefetch, which holds no register:
        # ptxas places a register load of the tile just before its first use (after the decay's projection), so
        # without it the tile's DRAM latency would follow that of the inputs instead of overlapping it
        head = state_ptr + slot * s_state + h * (K * K)
        if PF > 0:
            _prefetch(head + ck * K + j * BV, PF)
        sp = head + ck[:, None] * K + cols[None, :]
        S = tl.load(sp)
        conv = conv_ptr + slot * s_conv
        hq = _taps(conv, ch, W - 1, W - 1)
        hk = _taps(conv + HK * (W - 1), ch, W - 1, W - 1)
        hv = _taps(conv + 2 * HK * (W - 1), chv, W - 1, W - 1)
        pdl_wait(PDL)
        pdl_trigger(PDL)
        # the activations (outputs of the kernels before this one)
        xq = tl.load(q_ptr + b * s_q + ch).to(tl.float32)
        xk = tl.load(k_ptr + b * s_k + ch).to(tl.float32)
        xv = tl.load(v_ptr + b * s_v + chv).to(tl.float32)
        beta_logit = tl.load(beta_ptr + b * s_beta + h).to(tl.float32)
        if ZR > 0:
            fa = tl.load(fa_ptr + b * s_fa + tl.arange(0, ZR)).to(tl.float32)
        else:
            z = tl.load(z_ptr + b * s_z + ch).to(tl.float32)
        if GR > 0:
            ga = tl.load(ga_ptr + b * s_ga + tl.arange(0, GR)).to(tl.float32)
        else:
            g = tl.load(gate_ptr + b * s_gate + chv).to(tl.float32)
        # 2. short conv + SiLU (q, k over the whole head: the norms need every channel; v over these columns),
        # rounded to the model dtype; the low-rank projections (fp32 products and sums, rounded likewise)
        q = _conv_taps(xq, hq, wq, W, dtype)
        k = _conv_taps(xk, hk, wk, W, dtype)
        v = _conv_taps(xv, hv, wv, W, dtype)
        if ZR > 0:
            z = _round(tl.sum(fb.to(tl.float32) * fa[None, :], axis=1), dtype)
        if GR > 0:
            g = _round(tl.sum(gb.to(tl.float32) * ga[None, :], axis=1), dtype)
        # 3. gates, beta, L2 norms (the three sums over the head in one reduction), query scale
        decay = _kda_decay(z, dtb, a_log, lower_bound, LB_GATE)
        beta = tl.sigmoid(beta_logit)
        sqq, skk, sqk = tl.reduce((q * q, k * k, q * k), 0, _add3)
        rq = q_scale / tl.sqrt(sqq + 1e-6)
        rk = 1.0 / tl.sqrt(skk + 1e-6)
        # 4. delta-rule update of the tile (state written back), raw output (rounded) and its sum of squares
        o, ss = _kda_tile(S, sp, v, q * rq, k * rk, decay, beta, sqk * (rq * rk), dtype, False)
        # 5. stage the raw output (in the output row), the output gate and the sum of squares; shift this
        # program's v history (no other program reads those channels)
        orow = o_ptr + b * s_o + h * K
        part = b * H + h
        tl.store(orow + cols, o.to(dtype))
        tl.store(sg_ptr + part * K + cols, tl.sigmoid(g))
        tl.store(ss_ptr + part * NV + j, ss)
        tl.debug_barrier()  # every thread has consumed the history it loaded
        _shift_taps(conv + 2 * HK * (W - 1), xv, hv, chv, W)
        # 6. the last of the head's programs to arrive normalises the whole head and shifts the q / k history
        # (every program of the head has read it by then); it leaves the counter at zero for the next launch
        tl.debug_barrier()  # this program's stores (all threads) before the release
        arrived = tl.atomic_add(cnt_ptr + part, 1, sem="acq_rel", scope="gpu")
        if arrived == NV - 1:
            tl.debug_barrier()  # every thread's loads below after the acquire
            o_head = tl.load(orow + ck, cache_modifier=".cg").to(tl.float32)
            sg_head = tl.load(sg_ptr + part * K + ck, cache_modifier=".cg")
            ss_head = tl.sum(tl.load(ss_ptr + part * NV + tl.arange(0, NV), cache_modifier=".cg"))
            y = o_head * (1.0 / tl.sqrt(ss_head / K + eps)) * norm_w
            y = y * sg_head
            tl.store(orow + ck, _round(y, dtype).to(dtype))
            _shift_taps(conv, xq, hq, ch, W)
            _shift_taps(conv + HK * (W - 1), xk, hk, ch, W)
            tl.store(cnt_ptr + part, 0)

    @triton.jit
    def _mla_pages(bt, n0, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
        """Block-table entries for tokens ``[n0, n0 + BLOCK_N)`` (blocks start at multiples of ``BLOCK_N``).
        ``MODE`` 1 (``PAGE % BLOCK_N == 0``): the block lies in one page, one id; 2 (``BLOCK_N % PAGE == 0``): the
        ``BLOCK_N // PAGE`` ids of its pages; 0: one id per token."""
        if MODE == 1:
            pages = tl.load(bt + n0 // PAGE, mask=n0 < end, other=0)
        elif MODE == 2:
            j = tl.arange(0, BLOCK_N // PAGE)
            pages = tl.load(bt + n0 // PAGE + j, mask=n0 + j * PAGE < end, other=0)
        else:
            t = n0 + tl.arange(0, BLOCK_N)
            pages = tl.load(bt + t // PAGE, mask=t < end, other=0)
        return pages

    @triton.jit
    def _mla_rows(
        kv_ptr, pages, n0, end, s_kvp, s_kvt,
        DC: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    ):  # fmt: skip
        """The latent rows of tokens ``[n0, min(n0 + BLOCK_N, end))`` (zeros past ``end``), given the block's
        :func:`_mla_pages`: (latent part ``[BLOCK_N, DC]``, rope part ``[BLOCK_N, DR]``)."""
        tn = tl.arange(0, BLOCK_N)
        tm = n0 + tn < end
        if MODE == 1:
            row = kv_ptr + pages.to(tl.int64) * s_kvp + ((n0 % PAGE) + tn).to(tl.int64) * s_kvt
        elif MODE == 2:
            sel = (tn // PAGE)[:, None] == tl.arange(0, BLOCK_N // PAGE)[None, :]
            page = tl.sum(tl.where(sel, pages[None, :], 0), axis=1)
            row = kv_ptr + page.to(tl.int64) * s_kvp + (tn % PAGE).to(tl.int64) * s_kvt
        else:
            row = kv_ptr + pages.to(tl.int64) * s_kvp + ((n0 + tn) % PAGE).to(tl.int64) * s_kvt
        kn = tl.load(row[:, None] + tl.arange(0, DC)[None, :], mask=tm[:, None], other=0.0)
        kr = tl.load(row[:, None] + DC + tl.arange(0, DR)[None, :], mask=tm[:, None], other=0.0)
        return kn, kr

    @triton.jit
    def _mla_fold(
        qn, qr, kn, kr, n0, end, scale_log2, m, l, acc,
        BLOCK_N: tl.constexpr, F32: tl.constexpr, TRANS: tl.constexpr, INTERP: tl.constexpr,
    ):  # fmt: skip
        """Score one block of latent rows and fold it into the online softmax state ``(m, l, acc)`` (log2 domain).
        ``TRANS``: the products are formed transposed, tokens (scores) and latent dims (output) on the M side and
        heads on the N side (``acc [DC, BLOCK_H]``), so that few heads still fill the tensor-core tiles."""
        kv_dtype = kn.dtype
        tm = n0 + tl.arange(0, BLOCK_N) < end
        if INTERP:  # the interpreter's low-precision dot is unusable: same rounding, fp32 products
            kn = kn.to(tl.float32)
            kr = kr.to(tl.float32)
        if TRANS:
            if F32 or INTERP:  # fp32 operands: three-pass tf32 on the tensor cores (about fp32 accuracy)
                s = tl.dot(kn, tl.trans(qn), input_precision="tf32x3")
                s = tl.dot(kr, tl.trans(qr), s, input_precision="tf32x3")
            else:
                s = tl.dot(kn, tl.trans(qn))
                s = tl.dot(kr, tl.trans(qr), s)
            s = tl.where(tm[:, None], s * scale_log2, float("-inf"))  # [BLOCK_N, BLOCK_H]
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[None, :])
            l = l * alpha + tl.sum(p, axis=0)
            if INTERP:
                acc = tl.dot(
                    tl.trans(kn), _round(p, kv_dtype), acc * alpha[None, :], input_precision="tf32x3"
                )
            elif F32:
                acc = tl.dot(tl.trans(kn), p, acc * alpha[None, :], input_precision="tf32x3")
            else:
                acc = tl.dot(tl.trans(kn), p.to(kv_dtype), acc * alpha[None, :])
        else:
            if F32 or INTERP:
                s = tl.dot(qn, tl.trans(kn), input_precision="tf32x3")
                s = tl.dot(qr, tl.trans(kr), s, input_precision="tf32x3")
            else:
                s = tl.dot(qn, tl.trans(kn))
                s = tl.dot(qr, tl.trans(kr), s)
            s = tl.where(tm[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if INTERP:
                acc = tl.dot(_round(p, kv_dtype), kn, acc * alpha[:, None], input_precision="tf32x3")
            elif F32:
                acc = tl.dot(p, kn, acc * alpha[:, None], input_precision="tf32x3")
            else:
                acc = tl.dot(p.to(kv_dtype), kn, acc * alpha[:, None])
        return m_new, l, acc

    @triton.jit
    def _mla_step(
        qn, qr, kv_ptr, bt, kn, kr, pages, n0, end, s_kvp, s_kvt, scale_log2, m, l, acc,
        DC: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
        F32: tl.constexpr, TRANS: tl.constexpr, PREFETCH: tl.constexpr, INTERP: tl.constexpr,
    ):  # fmt: skip
        """Block ``n0`` of the loop. With ``PREFETCH``, ``kn, kr`` are its rows (requested one step earlier) and
        ``pages`` the next block's table entries: request the next block's rows and the table entries of the one
        after, then score this block. Without, load and score. Returns the loop-carried values."""
        if PREFETCH == 2:  # table entries one block ahead in registers; the rows go through the pipeliner
            cur = pages
            pages = _mla_pages(bt, n0 + BLOCK_N, end, PAGE, BLOCK_N, MODE)
            kn_cur, kr_cur = _mla_rows(kv_ptr, cur, n0, end, s_kvp, s_kvt, DC, DR, PAGE, BLOCK_N, MODE)
        elif PREFETCH:
            kn_cur = kn
            kr_cur = kr
            kn, kr = _mla_rows(kv_ptr, pages, n0 + BLOCK_N, end, s_kvp, s_kvt, DC, DR, PAGE, BLOCK_N, MODE)
            pages = _mla_pages(bt, n0 + 2 * BLOCK_N, end, PAGE, BLOCK_N, MODE)
        else:
            cur = _mla_pages(bt, n0, end, PAGE, BLOCK_N, MODE)
            kn_cur, kr_cur = _mla_rows(kv_ptr, cur, n0, end, s_kvp, s_kvt, DC, DR, PAGE, BLOCK_N, MODE)
        m, l, acc = _mla_fold(
            qn, qr, kn_cur, kr_cur, n0, end, scale_log2, m, l, acc, BLOCK_N, F32, TRANS, INTERP
        )
        return kn, kr, pages, m, l, acc

    @triton.jit
    def _mla_balance(len_ptr, B, NP, NS, BLOCK_N: tl.constexpr, BP: tl.constexpr):
        """The balanced split arithmetic (``BAL``): every row's lengths in ``BLOCK_N``-token blocks ``[BP]`` (zeros
        past ``B``) and the blocks per split ``c``, the same for all rows: the least count that gives the batch's
        blocks to at most ``NP`` programs and no row more than ``NS`` splits (row ``r`` takes ``cdiv(blocks[r],
        c)`` splits, so the splits of all rows number at most ``NP + B``)."""
        r = tl.arange(0, BP)
        lens = tl.load(len_ptr + r, mask=r < B, other=0).to(tl.int32)
        blocks = tl.cdiv(lens, BLOCK_N)
        c = tl.maximum(tl.cdiv(tl.sum(blocks, axis=0), NP), tl.cdiv(tl.max(blocks, axis=0), NS))
        return lens, blocks, tl.maximum(c, 1)

    @triton.jit
    def _mla_split_kernel(
        q_ptr, kv_ptr, bt_ptr, len_ptr, out_ptr, part_ptr, lse_ptr,
        s_qb, s_qh, s_kvp, s_kvt, s_btb, s_ob, s_oh,
        H, scale_log2, NS, B, NP,
        PAGE: tl.constexpr, MODE: tl.constexpr, DIRECT: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr, TRANS: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr,
        PDL: tl.constexpr, BAL: tl.constexpr = False, BP: tl.constexpr = 1,
    ):  # fmt: skip
        pdl_wait(PDL)
        pdl_trigger(PDL)
        hb = tl.program_id(0)
        kv_dtype = kv_ptr.dtype.element_ty
        if BAL:
            # program f of the flat grid takes split f - (splits of the rows before b) of the row b whose splits
            # hold it; programs past the last split find b == B and do nothing (their stores are masked off)
            f = tl.program_id(1)
            lens, blocks, c = _mla_balance(len_ptr, B, NP, NS, BLOCK_N, BP)
            r = tl.arange(0, BP)
            cum = tl.cumsum(tl.cdiv(blocks, c), axis=0)
            b = tl.sum((cum <= f).to(tl.int32), axis=0)
            sp = f - tl.sum(tl.where(r == b - 1, cum, 0), axis=0)
            length = tl.sum(tl.where(r == b, lens, 0), axis=0)
            live = b < B
            b = tl.minimum(b, B - 1)
            chunk = c * BLOCK_N
        else:
            sp = tl.program_id(1)
            b = tl.program_id(2)
            length = tl.load(len_ptr + b).to(tl.int32)
            chunk = tl.cdiv(tl.cdiv(length, NS), BLOCK_N) * BLOCK_N
        start = sp * chunk
        end = tl.minimum(start + chunk, length)
        hh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = hh < H
        dc = tl.arange(0, DC)
        dr = tl.arange(0, DR)
        qp = q_ptr + b.to(tl.int64) * s_qb + hh[:, None] * s_qh
        qn = tl.load(qp + dc[None, :], mask=hm[:, None], other=0.0)
        qr = tl.load(qp + DC + dr[None, :], mask=hm[:, None], other=0.0)
        if INTERP:
            qn = _round(qn, kv_dtype)
            qr = _round(qr, kv_dtype)
        else:
            qn = qn.to(kv_dtype)
            qr = qr.to(kv_dtype)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        if TRANS:
            acc = tl.zeros([DC, BLOCK_H], tl.float32)
        else:
            acc = tl.zeros([BLOCK_H, DC], tl.float32)
        bt = bt_ptr + b.to(tl.int64) * s_btb
        # loop-carried rows: used only by the register form (PREFETCH 1)
        kn = tl.zeros([BLOCK_N, DC], kv_dtype)
        kr = tl.zeros([BLOCK_N, DR], kv_dtype)
        pages = _mla_pages(bt, start, start, PAGE, BLOCK_N, MODE)
        if PREFETCH == 2:
            pages = _mla_pages(bt, start, end, PAGE, BLOCK_N, MODE)
        elif PREFETCH:
            # Triton's software pipeliner does not overlap loads whose addresses come from other loads (the block
            # table) with compute, so this is done by hand: while block i is scored, the rows of block i + 1 are in
            # flight (registers) and the block-table entries of block i + 2.
            pages = _mla_pages(bt, start, end, PAGE, BLOCK_N, MODE)
            kn, kr = _mla_rows(kv_ptr, pages, start, end, s_kvp, s_kvt, DC, DR, PAGE, BLOCK_N, MODE)
            pages = _mla_pages(bt, start + BLOCK_N, end, PAGE, BLOCK_N, MODE)
        if INTERP:  # the CPU interpreter cannot take loaded values as range() bounds
            n0 = start
            while n0 < end:
                kn, kr, pages, m, l, acc = _mla_step(
                    qn, qr, kv_ptr, bt, kn, kr, pages, n0, end, s_kvp, s_kvt, scale_log2, m, l, acc,
                    DC, DR, PAGE, BLOCK_N, MODE, F32, TRANS, PREFETCH, INTERP,
                )  # fmt: skip
                n0 += BLOCK_N
        else:
            for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
                kn, kr, pages, m, l, acc = _mla_step(
                    qn, qr, kv_ptr, bt, kn, kr, pages, n0, end, s_kvp, s_kvt, scale_log2, m, l, acc,
                    DC, DR, PAGE, BLOCK_N, MODE, F32, TRANS, PREFETCH, INTERP,
                )  # fmt: skip
        nonempty = l > 0.0
        inv_l = 1.0 / tl.where(nonempty, l, 1.0)
        if DIRECT:  # one split: the program holds the final result
            op = out_ptr + b.to(tl.int64) * s_ob + hh * s_oh
            om = hm
        else:  # [B, H, NS] partials; splits past the row's length write nothing (the reduce skips them)
            row_id = (b.to(tl.int64) * H + hh) * NS + sp
            op = part_ptr + row_id * DC
            om = hm & (start < end)
            if BAL:
                om = om & live
            tl.store(lse_ptr + row_id, m + tl.log2(tl.where(nonempty, l, 1.0)), mask=om)
        if TRANS:
            tl.store(op[None, :] + dc[:, None], acc * inv_l[None, :], mask=om[None, :])
        else:
            tl.store(op[:, None] + dc[None, :], acc * inv_l[:, None], mask=om[:, None])

    @triton.jit
    def _mla_reduce_kernel(
        part_ptr, lse_ptr, len_ptr, out_ptr, H, s_ob, s_oh, NS, B, NP, DC: tl.constexpr, BLOCK_N: tl.constexpr,
        BS: tl.constexpr, PDL: tl.constexpr, BAL: tl.constexpr = False, BP: tl.constexpr = 1, PH: tl.constexpr = 64,
    ):  # fmt: skip
        """Combine the normalised partials of one (row, head) over the splits that hold tokens (the same split
        arithmetic as the split kernel), ``BS`` at a time, online in log2."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        h = tl.program_id(0)
        b = tl.program_id(1)
        dc = tl.arange(0, DC)
        # (the persistent walk wrote a row that one group walked whole into the output itself)
        if BAL != 2 or _mla_persist_slots(len_ptr, b, h, H, PH)[0] != 1:
            cbar = _mla_combine(
                part_ptr, lse_ptr, len_ptr, out_ptr, s_ob, s_oh, b, h, H, NS, B, NP, DC, BLOCK_N, BS, BAL, BP, PH
            )  # fmt: skip
            tl.store(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + dc, cbar)

    @triton.jit
    def _mla_persist_prep_kernel(
        q_ptr, len_ptr, plan_ptr, qb_ptr, s_qb, s_qh, H, B, G, WMIN, ALIGN,
        D: tl.constexpr, PH: tl.constexpr, BLOCK_N: tl.constexpr, BP: tl.constexpr, CB: tl.constexpr,
        INTERP: tl.constexpr,
    ):  # fmt: skip
        """The persistent Gluon walk's preparation, grid ``B * NHB + 1`` (``NHB = cdiv(H, PH)`` head blocks).
        Program ``t < B * NHB`` writes task ``t``'s query rows ``[PH, D]`` (row ``t // NHB``, head block ``t %
        NHB``, zeros past ``H``) rounded to the cache dtype. The last program writes the plan (int32) for ``G``
        groups of ``NHB`` programs: ``W``, ``T``, the rows' first positions (``B`` values, then ``T``) and each
        group's first row. Positions count the rows' ``BLOCK_N``-token blocks one row after the other, ``T`` in
        all; group ``g`` walks positions ``[g W, min((g + 1) W, T))`` with ``W = max(cdiv(T, G), WMIN)``, or the
        longest row's ``M`` blocks cut in ``k = M // W`` shares where ``k >= 1`` and ``cdiv(M, k)`` is at most
        ``ALIGN`` percent more; each program of a group takes one head block."""
        t = tl.program_id(0)
        NHB = tl.cdiv(H, PH)
        if t < B * NHB:
            r = t // NHB
            hh = (t - r * NHB) * PH + tl.arange(0, PH)
            d = tl.arange(0, 64)
            src = q_ptr + r.to(tl.int64) * s_qb + hh[:, None] * s_qh + d[None, :]
            dst = qb_ptr + (t.to(tl.int64) * PH + tl.arange(0, PH))[:, None] * D + d[None, :]
            for j in tl.static_range(D // 64):
                x = tl.load(src + j * 64, mask=(hh < H)[:, None], other=0.0)
                if INTERP:
                    x = _round(x, qb_ptr.dtype.element_ty)
                tl.store(dst + j * 64, x.to(qb_ptr.dtype.element_ty))
        else:
            rows = tl.arange(0, BP)
            lens = tl.load(len_ptr + rows, mask=rows < B, other=0).to(tl.int32)
            blocks = tl.cdiv(lens, BLOCK_N)
            incl = tl.cumsum(blocks, axis=0)
            total = tl.sum(blocks, axis=0)
            w = tl.maximum(tl.cdiv(total, G), WMIN)
            # the longest row cut in k equal shares, where that share is at most ALIGN % longer: rows of one
            # length then split at the same blocks, and a row inside one share is written whole
            most = tl.max(blocks, axis=0)
            wa = tl.cdiv(most, tl.maximum(most // w, 1))
            w = tl.where((wa >= w) & (wa * 100 <= w * (100 + ALIGN)), wa, w)
            tl.store(plan_ptr, w)
            tl.store(plan_ptr + 1, total)
            tl.store(plan_ptr + 2 + rows, incl - blocks, mask=rows < B)
            tl.store(plan_ptr + 2 + B, total)
            g0 = 0
            while g0 < G:  # (a while loop: the CPU interpreter takes no runtime value as a range() bound)
                g = g0 + tl.arange(0, CB)
                # the row that holds position g * w: the first whose blocks end past it (rows without tokens end
                # where they start and are passed over)
                row = tl.sum((incl[None, :] <= (g * w)[:, None]).to(tl.int32), axis=1)
                tl.store(plan_ptr + 3 + B + g, row, mask=g < G)
                g0 += CB

    @triton.jit
    def _mla_persist_slots(plan_ptr, b, h, H, PH: tl.constexpr):
        """Where the persistent Gluon walk (plan: :func:`_mla_persist_prep_kernel`) left row ``b``, head ``h``:
        (segments, first partial row, stride between them). The groups ``g0 ..`` whose shares hold the row's
        blocks wrote its segments for head block ``hb = h // PH`` into slots ``(b + g) NHB + hb`` of the ``[slots,
        PH, DC]`` partials; one segment is the whole row, which the walk wrote into the output itself; a row
        without tokens has none."""
        share = tl.load(plan_ptr)
        rs = tl.load(plan_ptr + 2 + b)
        nb = tl.load(plan_ptr + 3 + b) - rs
        nhb = tl.cdiv(H, PH)
        hb = h // PH
        g0 = rs // share
        used = tl.where(nb > 0, (rs + nb - 1) // share - g0 + 1, 0)
        return used, ((b.to(tl.int64) + g0) * nhb + hb) * PH + (h - hb * PH), nhb * PH

    @triton.jit
    def _mla_combine(
        part_ptr, lse_ptr, len_ptr, cb_ptr, s_cb, s_ch, b, h, H, NS, B, NP, DC: tl.constexpr,
        BLOCK_N: tl.constexpr, BS: tl.constexpr, BAL: tl.constexpr, BP: tl.constexpr, PH: tl.constexpr = 64,
    ):  # fmt: skip
        """The attention output ``[DC]`` fp32 of row ``b``, head ``h`` from the split kernel's partials. ``BAL`` 2:
        the persistent Gluon walk's partials, ``len_ptr`` its plan (:func:`_mla_persist_slots`); a row it walked
        whole is read from ``cb_ptr`` (strides ``s_cb``, ``s_ch``), a row without tokens gives zeros."""
        step = 1
        dc = tl.arange(0, DC)
        whole = False
        if BAL == 2:
            used, base, step = _mla_persist_slots(len_ptr, b, h, H, PH)
            whole = used == 1
            used = tl.where(whole, 0, used)
        else:
            length = tl.load(len_ptr + b).to(tl.int32)
            if BAL:
                chunk = _mla_balance(len_ptr, B, NP, NS, BLOCK_N, BP)[2] * BLOCK_N
            else:
                chunk = tl.cdiv(tl.cdiv(length, NS), BLOCK_N) * BLOCK_N
            used = tl.cdiv(length, chunk)
            base = (b.to(tl.int64) * H + h) * NS
        bs = tl.arange(0, BS)
        mx = float("-inf")
        den = 0.0
        acc = tl.zeros([DC], tl.float32)
        s0 = 0
        while s0 < used:  # (a while loop: the CPU interpreter cannot take a runtime value as range() bound)
            s = s0 + bs
            sm = s < used
            lse = tl.load(lse_ptr + base + s * step, mask=sm, other=float("-inf"))
            m_new = tl.maximum(mx, tl.max(lse, axis=0))  # finite from the first chunk on: split 0 has a token
            alpha = tl.exp2(mx - m_new)
            w = tl.exp2(lse - m_new)
            part = tl.load(
                part_ptr + (base + s * step)[:, None] * DC + dc[None, :], mask=sm[:, None], other=0.0
            )
            acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
            den = den * alpha + tl.sum(w, axis=0)
            mx = m_new
            s0 += BS
        acc = acc / tl.where(den > 0.0, den, 1.0)
        if BAL == 2:
            acc = tl.where(
                whole, tl.load(cb_ptr + b.to(tl.int64) * s_cb + h * s_ch + dc, mask=whole & (dc < DC)), acc
            )
        return acc

    @triton.jit
    def _mla_absorb_row(
        q_row, w_head, w_tile, ql_row, cols, s_wn,
        DN: tl.constexpr, DNP: tl.constexpr, DCB: tl.constexpr, NB: tl.constexpr,
    ):  # fmt: skip
        """``ql_row[cols] = q_row[:DN] @ w_head[:DN, cols]`` in fp32: with ``NB == DNP`` from the tile ``w_tile``
        (loaded once by the caller), else ``NB`` rows of ``w_head`` at a time."""
        if NB == DNP:
            n = tl.arange(0, DNP)
            qn = tl.load(q_row + n, mask=n < DN, other=0.0).to(tl.float32)
            qa = tl.sum(qn[:, None] * w_tile.to(tl.float32), axis=0)
        else:
            acc = tl.zeros([NB, DCB], tl.float32)
            for n0 in tl.static_range(0, DNP, NB):
                n = n0 + tl.arange(0, NB)
                nm = n < DN
                w = tl.load(w_head + n[:, None] * s_wn + cols[None, :], mask=nm[:, None], other=0.0)
                qn = tl.load(q_row + n, mask=nm, other=0.0)
                acc += qn.to(tl.float32)[:, None] * w.to(tl.float32)
            qa = tl.sum(acc, axis=0)
        tl.store(ql_row + cols, qa)

    @triton.jit
    def _mla_prep_kernel(
        q_ptr, c_ptr, kr_ptr, nw_ptr, wuk_ptr, kv_ptr, rows_ptr, ql_ptr,
        s_qb, s_qh, s_cb, s_krb, s_wh, s_wn, s_kvp, s_kvt, s_ob, s_oh,
        B, H, eps,
        DN: tl.constexpr, DNP: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, HP: tl.constexpr,
        DCB: tl.constexpr, NC: tl.constexpr, NB: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr,
        INTERP: tl.constexpr, PDL: tl.constexpr, EARLY_W: tl.constexpr = False,
    ):  # fmt: skip
        """One MLA layer's prep step (:func:`mla_prep_triton`), a 1-D grid of ``H * NC + B`` programs. The first
        ``H * NC`` take one head and ``DCB`` columns of the absorbed query each, ``ql[:, h, cols] = q_nope[:, h] @
        w_uk[h, :, cols]`` for all rows, one row after the other (fp32 products and sums): with ``NB == DNP`` the
        head's ``W_UK`` tile is loaded once and held in registers while the rows' queries stream through (Triton's
        pipeliner, ``STAGES``), otherwise ``NB`` values of ``dn`` per step are read again for each row (from L1 /
        L2). The last ``B`` take one row each: the RMSNorm of its latent (fp32 statistics, rounded to the model
        dtype before and after the gain, as ``rms_norm``), the cache write of ``[c_hat, kr]`` and the rope part of
        its absorbed query. ``EARLY_W`` (with ``NB == DNP``): the held ``W_UK`` tile (a weight, written by no kernel
        of the step) is requested before the wait for the kernel before this one."""
        if not EARLY_W:
            pdl_wait(PDL)
            pdl_trigger(PDL)
        pid = tl.program_id(0)
        dtype = q_ptr.dtype.element_ty
        if pid < H * NC:
            h = pid // NC
            cols = (pid % NC) * DCB + tl.arange(0, DCB)
            w_head = wuk_ptr + h.to(tl.int64) * s_wh
            if NB == DNP:
                n = tl.arange(0, DNP)
                w_tile = tl.load(
                    w_head + n[:, None] * s_wn + cols[None, :], mask=(n < DN)[:, None], other=0.0
                )
            else:
                w_tile = tl.zeros([1, DCB], tl.float32)  # (unused)
            if EARLY_W:
                pdl_wait(PDL)
                pdl_trigger(PDL)
            q_head = q_ptr + h * s_qh
            ql_head = ql_ptr + h * s_oh
            if INTERP:  # the CPU interpreter cannot take an argument as range() bound
                r = 0
                while r < B:
                    _mla_absorb_row(
                        q_head + r * s_qb, w_head, w_tile, ql_head + r * s_ob, cols, s_wn, DN, DNP, DCB, NB
                    )
                    r += 1
            else:
                for r in tl.range(0, B, num_stages=STAGES):
                    rr = r.to(tl.int64)
                    _mla_absorb_row(
                        q_head + rr * s_qb, w_head, w_tile, ql_head + rr * s_ob, cols, s_wn, DN, DNP, DCB, NB
                    )
        else:
            if EARLY_W:
                pdl_wait(PDL)
                pdl_trigger(PDL)
            b = (pid - H * NC).to(tl.int64)
            kv_dtype = kv_ptr.dtype.element_ty
            dc = tl.arange(0, DC)
            dr = tl.arange(0, DR)
            x = tl.load(c_ptr + b * s_cb + dc).to(tl.float32)
            c_hat = _rms_norm_vec(x, tl.load(nw_ptr + dc).to(tl.float32), DC, eps, dtype)
            kr = tl.load(kr_ptr + b * s_krb + dr).to(tl.float32)
            row = tl.load(rows_ptr + b).to(tl.int64)
            dst = kv_ptr + (row // PAGE) * s_kvp + (row % PAGE) * s_kvt
            # (values rounded to the cache dtype first: the interpreter's bf16 cast truncates)
            tl.store(dst + dc, _round(c_hat, kv_dtype).to(kv_dtype))
            tl.store(dst + DC + dr, _round(kr, kv_dtype).to(kv_dtype))
            hh = tl.arange(0, HP)
            hm = hh[:, None] < H
            qr = tl.load(q_ptr + b * s_qb + hh[:, None] * s_qh + DN + dr[None, :], mask=hm, other=0.0)
            tl.store(ql_ptr + b * s_ob + hh[:, None] * s_oh + DC + dr[None, :], qr.to(tl.float32), mask=hm)

    @triton.jit
    def _mla_post_rows(
        cbar, wuv_ptr, gate_ptr, o_ptr, b, h, vs, s_wh, s_wv, s_gb, s_ob,
        DC: tl.constexpr, DV: tl.constexpr, VB: tl.constexpr, VC: tl.constexpr, STAGES: tl.constexpr,
        GATE: tl.constexpr,
    ):  # fmt: skip
        """Output values ``[vs * VB, (vs + 1) * VB)`` of row ``b``, head ``h``, from its attention output ``cbar
        [DC]`` fp32: ``w_uv[h] @ cbar`` (fp32 products and sums, ``VC`` rows of ``w_uv`` at a time) rounded to the
        output dtype, times ``sigmoid(gate)`` (rounded, then the product rounded) with ``GATE``."""
        dc = tl.arange(0, DC)
        w_head = wuv_ptr + h.to(tl.int64) * s_wh
        for v0 in tl.range(0, VB, VC, num_stages=STAGES):
            v = vs * VB + v0 + tl.arange(0, VC)
            vm = v < DV
            w = tl.load(w_head + v[:, None] * s_wv + dc[None, :], mask=vm[:, None], other=0.0)
            _mla_post_out(w, cbar, gate_ptr, o_ptr, b, h, v, vm, s_gb, s_ob, DV, GATE)

    @triton.jit
    def _mla_post_out(
        w, cbar, gate_ptr, o_ptr, b, h, v, vm, s_gb, s_ob, DV: tl.constexpr, GATE: tl.constexpr
    ):
        """Output values ``v`` (mask ``vm``) of row ``b``, head ``h``: the rows ``w`` of ``w_uv[h]`` times ``cbar``
        (fp32 products and sums) rounded to the output dtype, times ``sigmoid(gate)`` (rounded, then the product
        rounded) with ``GATE``; stored."""
        dtype = o_ptr.dtype.element_ty
        o = _round(tl.sum(w.to(tl.float32) * cbar[None, :], axis=1), dtype)
        if GATE:
            g = tl.load(gate_ptr + b.to(tl.int64) * s_gb + h * DV + v, mask=vm, other=0.0).to(tl.float32)
            o = _round(_round(tl.sigmoid(g), dtype) * o, dtype)
        tl.store(o_ptr + b.to(tl.int64) * s_ob + h * DV + v, o.to(dtype), mask=vm)

    @triton.jit
    def _mla_reduce_post_kernel(
        part_ptr, lse_ptr, len_ptr, wuv_ptr, gate_ptr, o_ptr, cb_ptr, H, NS, B, NP, s_wh, s_wv, s_gb, s_ob, s_cb, s_ch,
        DC: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, DV: tl.constexpr, VB: tl.constexpr,
        VC: tl.constexpr, STAGES: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr, WHOLE: tl.constexpr = False,
        BAL: tl.constexpr = False, BP: tl.constexpr = 1, PH: tl.constexpr = 64,
    ):  # fmt: skip
        """The reduce with the post step folded in: program ``(vs, h, b)`` combines the partials of (row ``b``, head
        ``h``) and writes output values ``[vs * VB, (vs + 1) * VB)`` of that head (:func:`_mla_post_rows`).
        ``WHOLE``: the program's ``[VB, DC]`` slice of ``W_UV`` requested before the wait for the split kernel
        (weights: written by no kernel of the step) and held in registers, its product formed in one step."""
        vs = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        if WHOLE:
            dc = tl.arange(0, DC)
            v = vs * VB + tl.arange(0, VB)
            vm = v < DV
            w = tl.load(
                wuv_ptr + h.to(tl.int64) * s_wh + v[:, None] * s_wv + dc[None, :], mask=vm[:, None], other=0.0
            )
        pdl_wait(PDL)
        pdl_trigger(PDL)
        cbar = _mla_combine(
            part_ptr, lse_ptr, len_ptr, cb_ptr, s_cb, s_ch, b, h, H, NS, B, NP, DC, BLOCK_N, BS, BAL, BP, PH
        )
        if WHOLE:
            _mla_post_out(w, cbar, gate_ptr, o_ptr, b, h, v, vm, s_gb, s_ob, DV, GATE)
        else:
            _mla_post_rows(
                cbar, wuv_ptr, gate_ptr, o_ptr, b, h, vs, s_wh, s_wv, s_gb, s_ob, DC, DV, VB, VC, STAGES, GATE
            )

    @triton.jit
    def _mla_post_kernel(
        cbar_ptr, wuv_ptr, gate_ptr, o_ptr, s_cb, s_ch, s_wh, s_wv, s_gb, s_ob,
        DC: tl.constexpr, DV: tl.constexpr, VB: tl.constexpr, VC: tl.constexpr, STAGES: tl.constexpr,
        GATE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """The post step on its own (after a one-split walk, or :func:`mla_post_triton`), grid ``(VS, H, B)``."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        vs = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        cbar = tl.load(cbar_ptr + b.to(tl.int64) * s_cb + h * s_ch + tl.arange(0, DC))
        _mla_post_rows(
            cbar, wuv_ptr, gate_ptr, o_ptr, b, h, vs, s_wh, s_wv, s_gb, s_ob, DC, DV, VB, VC, STAGES, GATE
        )


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def kda_decode_triton(
    layer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    gate: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    *,
    BV: int | None = None,
    num_warps: int | None = None,
    stages: int | None = None,
    l2_prefetch: bool | None = None,
    heads_fast: bool | None = None,
    z_lowrank: torch.Tensor | None = None,
    gate_lowrank: torch.Tensor | None = None,
    split_v: int | None = None,
    split_prefetch: int | None = None,
    split_maxnreg: int | None = None,
) -> torch.Tensor:
    """Fused single-token KDA step (signature and layouts: :mod:`openk3.infer.decode`). ``BV`` (state columns per
    tile, a power of two; 0: the whole head), ``num_warps``, ``stages`` (0, or >= 2: the loop form),
    ``l2_prefetch``, ``heads_fast`` and ``split_v`` (see :data:`KDA_CONFIG`) override :data:`KDA_CONFIG`.
    ``split_v`` NV > 0: the split form, NV programs per (row, head) with ``K // NV`` state columns each (a power of
    two at most K; ``BV``, ``stages``, ``l2_prefetch`` and ``heads_fast`` do not apply; ``num_warps``,
    ``split_prefetch`` and ``split_maxnreg`` default to ``KDA_CONFIG["split_num_warps"]``, ``["split_prefetch"]``
    and ``["split_maxnreg"]``); with ``split_v`` None, a ``BV`` or ``stages`` given selects the per-head form).
    ``z_lowrank``: the
    low-rank decay activation ``f_a_proj(x)`` ``[B, R]``; the kernel then forms ``z = f_b_proj(z_lowrank)`` itself
    (products and sums in fp32, rounded to the model dtype like the GEMM output) and ``z`` must be None (see
    :func:`kda_lowrank_ok`); ``gate_lowrank``: the same for the output gate, ``g_b_proj(gate_lowrank)`` with
    ``gate`` None."""
    B, HK = q.shape
    H, K = layer.num_heads, layer.head_dim
    wq, wk, wv = (c.weight.reshape(HK, -1) for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d))
    W = wq.shape[1]
    if HK != H * K or state.shape[1:] != (H, K, K) or conv_state.shape[1:] != (3, HK, W - 1) or W < 2:
        raise ValueError(
            f"kda_decode_triton: shapes q {tuple(q.shape)}, state {tuple(state.shape)}, conv_state "
            f"{tuple(conv_state.shape)} do not match H={H}, K={K}, W={W}"
        )
    if K & (K - 1):
        raise ValueError(f"kda_decode_triton: head_dim must be a power of two, got {K}")
    if state.dtype != torch.float32 or conv_state.dtype != torch.float32:
        raise ValueError("kda_decode_triton: state and conv_state must be fp32")
    if state[0].stride() != (K * K, K, 1) or conv_state[0].stride() != (HK * (W - 1), W - 1, 1):
        raise ValueError("kda_decode_triton: state / conv_state must be contiguous past the slot dimension")
    cfg = KDA_CONFIG
    if cfg.get("few") and B <= cfg.get("few_max_batch", 0):
        cfg = {**cfg, **cfg["few"]}
    # a caller naming the per-head form's tile (BV / stages) without split_v gets that form
    per_head = split_v is None and (BV is not None or stages is not None)
    nv = int(0 if per_head else cfg.get("split_v", 0) if split_v is None else split_v)
    if nv < 0 or nv & (nv - 1) or nv > K:
        raise ValueError(f"kda_decode_triton: split_v must be 0 or a power of two at most {K}, got {nv}")
    if split_v is None and nv:  # the configured split shrinks as rows are added (see KDA_CONFIG)
        cap = cfg.get("split_programs_per_sm", 0) * _sm_count(q.device)
        while cap and nv > 1 and B * H * nv > cap:
            nv //= 2
        nv = nv if nv > 1 else 0
    bv = cfg["BV"] if BV is None else BV
    bv = K if not bv else min(bv, K)
    if bv & (bv - 1):
        raise ValueError(f"kda_decode_triton: BV must be a power of two, got {bv}")
    # (the stand-ins fill pointer arguments the compiled variant does not read)
    z, fa, fb, zr = _lowrank_args(layer, z, z_lowrank, ("z", "z_lowrank"), "f_b_proj", q)
    gate, ga, gb, gr = _lowrank_args(layer, gate, gate_lowrank, ("gate", "gate_lowrank"), "g_b_proj", q)
    q, k, v, z, beta_logits, gate = (_row_major(t) for t in (q, k, v, z, beta_logits, gate))
    wq, wk, wv = (_row_major(w) for w in (wq, wk, wv))
    a_log = layer.A_log.reshape(-1)
    dt_bias = layer.dt_bias.reshape(-1)
    norm_w = layer.o_norm.weight.reshape(-1)
    o = torch.empty(B, HK, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    lb_gate = layer.gate_kind == "lowerbound"
    pdl = pdl_on(q)
    if nv:
        nw = cfg.get("split_num_warps", cfg["num_warps"]) if num_warps is None else num_warps
        spf = int(cfg.get("split_prefetch", 0) if split_prefetch is None else split_prefetch)
        if spf not in (0, 1, 2):
            raise ValueError(f"kda_decode_triton: split_prefetch must be 0, 1 (L1) or 2 (L2), got {spf}")
        spf = 0 if INTERPRET else spf
        mr = int(cfg.get("split_maxnreg", 0) if split_maxnreg is None else split_maxnreg)
        KDA_LAST_LAUNCH.clear()
        KDA_LAST_LAUNCH.update(
            BV=K // nv, num_warps=nw, stages=0, l2_prefetch=False, heads_fast=False, lowrank=zr, gate_lowrank=gr,
            pdl=pdl, split_v=nv, split_prefetch=spf, split_maxnreg=mr,
        )  # fmt: skip
        # per (row, head): the sigmoid of the output gate [K], then (after all rows) the NV blocks' sums of squares
        part = torch.empty(B * H * (K + nv), dtype=torch.float32, device=q.device)
        _kda_decode_split_kernel[(nv, H, B)](
            q, k, v, z, beta_logits, gate, o,
            q.stride(0), k.stride(0), v.stride(0), z.stride(0), beta_logits.stride(0), gate.stride(0), o.stride(0),
            wq, wk, wv, a_log, dt_bias, norm_w,
            conv_state, state, slots, conv_state.stride(0), state.stride(0),
            kda_split_counters(q.device, B * H), part, part[B * H * K :],
            float(layer.lower_bound) if lb_gate else 0.0, float(layer.eps), K**-0.5,
            H=H, K=K, W=W, NV=nv, LB_GATE=lb_gate, fa_ptr=fa, fb_ptr=fb, s_fa=fa.stride(0), ZR=zr,
            ga_ptr=ga, gb_ptr=gb, s_ga=ga.stride(0), GR=gr, PDL=pdl, PF=spf, num_warps=nw, **pdl_launch(pdl),
            **({"maxnreg": mr} if mr and not INTERPRET else {}),
        )  # fmt: skip
        return o
    nw = cfg["num_warps"] if num_warps is None else num_warps
    st = cfg.get("stages", 0) if stages is None else stages
    if st == 1 or st < 0:
        raise ValueError(f"kda_decode_triton: stages must be 0 or >= 2, got {st}")
    pf = bool(cfg.get("l2_prefetch", False) if l2_prefetch is None else l2_prefetch) and not INTERPRET
    hf = bool(cfg.get("heads_fast", False) if heads_fast is None else heads_fast)
    KDA_LAST_LAUNCH.clear()
    KDA_LAST_LAUNCH.update(
        BV=bv, num_warps=nw, stages=st, l2_prefetch=pf, heads_fast=hf, lowrank=zr, gate_lowrank=gr, pdl=pdl,
        split_v=0,
    )  # fmt: skip
    _kda_decode_kernel[(H, B) if hf else (B, H)](
        q, k, v, z, beta_logits, gate, o,
        q.stride(0), k.stride(0), v.stride(0), z.stride(0), beta_logits.stride(0), gate.stride(0), o.stride(0),
        wq, wk, wv, a_log, dt_bias, norm_w,
        conv_state, state, slots, conv_state.stride(0), state.stride(0),
        float(layer.lower_bound) if lb_gate else 0.0, float(layer.eps), K**-0.5,
        H=H, K=K, W=W, WP=triton.next_power_of_2(W), BV=bv, LB_GATE=lb_gate, STAGES=st, PF_L2=pf, HEADS_FAST=hf,
        fa_ptr=fa, fb_ptr=fb, s_fa=fa.stride(0), ZR=zr, ZRC=min(32, zr) if zr else 1,
        ga_ptr=ga, gb_ptr=gb, s_ga=ga.stride(0), GR=gr, GRC=min(32, gr) if gr else 1, PDL=pdl,
        num_warps=nw, **pdl_launch(pdl),
    )  # fmt: skip
    return o


_KDA_COUNTERS: dict[tuple, torch.Tensor] = {}


def kda_split_counters(device: torch.device, n: int) -> torch.Tensor:
    """The arrival counters of the split KDA form for ``n`` (row, head) pairs: int32, zero between launches (the
    last program of each head resets its counter), allocated once per device and size and kept for the life of the
    process, so that CUDA graphs captured with it stay valid. Launches that share it must not overlap in time (one
    stream, as in the engine's decode step). Asked for the first time while a CUDA graph is being captured, it
    returns a fresh zeroed buffer that is not kept: the graph then zeroes it (a captured fill) before each replay's
    launch, and the graph's memory pool owns it."""
    key = (device.type, device.index, n)
    buf = _KDA_COUNTERS.get(key)
    if buf is None:
        buf = torch.zeros(n, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return buf
        _KDA_COUNTERS[key] = buf
    return buf


def _lowrank_args(layer, full, act, names: tuple[str, str], proj: str, stand_in: torch.Tensor):
    """(tensor for the full input, activation, weight, rank) for one low-rank projection of the KDA step: the full
    input with stand-ins and rank 0, or the activation (also in the full input's place) with ``proj``'s weight."""
    if (full is None) == (act is None):
        raise ValueError(f"kda_decode_triton: give exactly one of {names[0]} and {names[1]}")
    if act is None:
        return full, stand_in, stand_in, 0
    ok, why = kda_lowrank_ok(layer, act, proj)
    if not ok:
        raise ValueError(f"kda_decode_triton: {names[1]}: {why}")
    act = _row_major(act)
    return act, act, _row_major(getattr(layer, proj).weight), act.shape[1]


def kda_lowrank_ok(layer, act: torch.Tensor | None, proj: str = "f_b_proj") -> tuple[bool, str]:
    """Whether :func:`kda_decode_triton` can apply the low-rank up projection ``proj`` (``f_b_proj``: the decay,
    ``g_b_proj``: the output gate) to ``act`` itself: a 2-D activation ``[B, R]``, R a power of two >= 16 matching
    the projection's ``[H * K, R]`` weight (``act`` None: the weight alone, for an activation of width R)."""
    w = getattr(getattr(layer, proj, None), "weight", None)
    if w is None or w.dim() != 2:
        return False, f"the layer has no 2-D {proj} weight"
    R = w.shape[1]
    if act is not None and (act.dim() != 2 or act.shape[1] != R):
        return False, f"activation {tuple(act.shape)} does not match {proj} {tuple(w.shape)}"
    if R < 16 or R & (R - 1):
        return False, f"low-rank width {R} is not a power of two >= 16"
    if w.shape[0] != layer.num_heads * layer.head_dim:
        return (
            False,
            f"{proj} {tuple(w.shape)} does not produce {layer.num_heads} x {layer.head_dim} channels",
        )
    return True, ""


def mla_num_splits(
    batch: int,
    heads: int,
    max_context: int,
    block_h: int,
    device: torch.device,
    *,
    block_n: int = 32,
    resident: int = 1,
    cfg: dict | None = None,
    min_chunk: int | None = None,
) -> int:
    """Context splits per row, from shapes only (a fixed grid for CUDA graphs). Programs run in waves of
    ``resident * SMs``; a program's time is its share of the row plus a fixed cost, so the step takes about
    ``waves(s) * (blocks_per_split(s) + overhead_blocks)``: the smallest split count that minimises that is chosen
    (between 1, and enough splits that each keeps at least ``min_chunk`` tokens of the largest context; default
    ``cfg["few_min_chunk"]`` for at most ``cfg["few_min_chunk_rows"]`` rows, else ``cfg["min_chunk"]``)."""
    cfg = cfg or MLA_CONFIG
    min_chunk = _min_chunk(batch, cfg, min_chunk)
    progs = max(1, batch * triton.cdiv(heads, block_h))
    slots = max(1, resident * _sm_count(device))
    blocks = triton.cdiv(max(1, max_context), block_n)
    cap = max(1, min(cfg["max_splits"], triton.cdiv(max_context, min_chunk)))
    best, best_cost = 1, None
    for ns in range(1, cap + 1):
        cost = triton.cdiv(progs * ns, slots) * (triton.cdiv(blocks, ns) + cfg["overhead_blocks"])
        if best_cost is None or cost < best_cost:
            best, best_cost = ns, cost
    return best


def _min_chunk(batch: int, cfg: dict, min_chunk: int | None = None) -> int:
    """The least tokens per split: ``min_chunk`` if given, else from ``cfg`` by the number of rows."""
    if min_chunk:
        return min_chunk
    if batch <= cfg.get("few_min_chunk_rows", 0):
        return cfg.get("few_min_chunk", cfg["min_chunk"])
    return cfg["min_chunk"]


_RESIDENT: dict[tuple, int] = {}
_SPLITS: dict[tuple, int] = {}
MLA_LAST_LAUNCH: dict = {}  # the launch parameters (splits included) of the latest mla_decode_triton call
MLA_GLUE_LAST_LAUNCH: dict = {}  # "prep" / "post": the launch parameters of the latest MLA glue steps


def _mla_resident(args: tuple, consts: dict, num_warps: int, device: torch.device) -> int:
    """How many programs of the split kernel with these launch parameters one SM holds at once, from the compiled
    kernel's shared memory and registers (compiled once per configuration, not launched); 1 where that cannot be
    read (the interpreter, or a Triton whose API differs)."""
    if INTERPRET or device.type != "cuda":
        return 1
    key = (tuple(sorted(consts.items())), num_warps, str(args[1].dtype), device.index)
    if key not in _RESIDENT:
        try:
            # (NS 2, B 1, NP 2: a split launch's variant; the balanced form's arguments do not change its size)
            ck = _mla_split_kernel.warmup(
                *args, 2, 1, 2, DIRECT=False, **consts, num_warps=num_warps, grid=(1,)
            )
            _RESIDENT[key] = max(1, resident_per_sm(ck, num_warps, device))
        except Exception as e:  # pragma: no cover - depends on the Triton build
            log.warning("openk3: MLA decode occupancy unknown (%s); assuming one program per SM", e)
            _RESIDENT[key] = 1
    return _RESIDENT[key]


def _use_gluon(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, gluon: bool | None) -> bool:
    """Whether :func:`mla_decode_triton`'s split walk runs the Gluon kernel (``gluon``: the caller's choice,
    None: :data:`MLA_CONFIG`'s)."""
    if gluon is False or INTERPRET:
        if gluon:
            raise ValueError("mla_decode_triton: gluon=True has no CPU interpreter form")
        return False
    if gluon is None and not (
        MLA_CONFIG["gluon"]
        and q.shape[1] >= MLA_CONFIG["gluon_min_heads"]
        and q.shape[0] >= MLA_CONFIG["gluon_min_rows"]
    ):
        return False
    from openk3.infer.mla_gluon import gluon_supported

    ok, why = gluon_supported(q, kv_cache, kv_lora_rank)
    if gluon and not ok:
        raise ValueError(f"mla_decode_triton: gluon=True: {why}")
    return ok


def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    trans: bool | None = None,
    prefetch: bool | None = None,
    min_chunk: int | None = None,
    w_uv: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    v_splits: int | None = None,
    balance: bool | None = None,
    gluon: bool | None = None,
    gluon_config: dict | None = None,
) -> torch.Tensor:
    """Paged absorbed MLA decode (signature and layouts: :mod:`openk3.infer.decode`); returns ``[B, H, dc]`` fp32.
    ``num_splits`` (default :func:`mla_num_splits` with the compiled kernel's occupancy), ``block_h`` (heads per
    program), ``block_n``, ``num_warps``, ``num_stages`` (Triton's pipeliner), ``trans`` (transposed products),
    ``prefetch`` (``True``: the next block's rows in registers; ``2``: the next block's page-table entries in
    registers, the rows through the pipeliner) and ``min_chunk`` (least tokens per split) override
    :data:`MLA_CONFIG`. The parameters used are left in :data:`MLA_LAST_LAUNCH`.

    ``balance`` (default ``MLA_CONFIG["balance"]``; several rows and splits only): the ``num_splits * B`` programs
    share the batch's tokens evenly instead of taking ``num_splits`` equal shares of each row, so rows of different
    lengths finish together (:func:`_mla_balance`; a row takes at most ``balance_spread * num_splits`` splits).

    With ``w_uv [H, dv, dc]`` the MLA post step (:mod:`openk3.infer.decode`: ``W_UV``, rounding to ``out_dtype``,
    times ``sigmoid(gate)`` with ``gate [B, H * dv]``) is applied too, folded into the reduce of the splits (one
    split: its own launch after the walk), and the result is ``o [B, H * dv]`` in ``out_dtype``; ``v_splits``
    overrides the number of programs per (row, head) that share its ``dv`` outputs.

    ``gluon`` (default: ``MLA_CONFIG["gluon"]`` where the model has at least ``MLA_CONFIG["gluon_min_heads"]``
    heads, the batch at least ``MLA_CONFIG["gluon_min_rows"]`` rows, no Triton tile parameter or ``balance`` is
    given and :func:`openk3.infer.mla_gluon.gluon_supported` takes the inputs): the split walk runs the
    warp-specialised Gluon kernel (64 heads and 64 tokens per block; the tile parameters above do not apply).
    ``gluon=True`` on inputs it does not take is an error; ``gluon_config`` overrides entries of
    :data:`openk3.infer.mla_gluon.MLA_GLUON_CONFIG` (tile and ring depth)."""
    if w_uv is None and (gate is not None or out_dtype is not None or v_splits is not None):
        raise ValueError("mla_decode_triton: gate, out_dtype and v_splits come with w_uv (the post step)")
    B, H, D = q.shape
    _, page_size, Dk = kv_cache.shape
    DC = kv_lora_rank
    DR = D - DC
    if Dk != D or DC & (DC - 1) or DR < 16 or DR & (DR - 1):
        raise ValueError(
            f"mla_decode_triton: q {tuple(q.shape)} / kv_cache {tuple(kv_cache.shape)} with kv_lora_rank={DC}: "
            "need matching widths, a power-of-two latent and a power-of-two rope part >= 16"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("mla_decode_triton: kv_cache rows must be contiguous")
    q = _row_major(q)
    block_table = _row_major(block_table)
    cfg = MLA_CONFIG
    # a Triton tile or split form asked for by name runs the Triton kernel unless gluon=True says otherwise
    tile = any(v is not None for v in (block_h, block_n, num_warps, num_stages, trans, prefetch)) or bool(
        balance
    )
    use_g = _use_gluon(q, kv_cache, DC, False if gluon is None and tile else gluon)
    base = cfg["fp32"] if kv_cache.dtype == torch.float32 else cfg["few" if H <= 16 else "many"]
    if use_g:
        from openk3.infer.mla_gluon import MLA_GLUON_CONFIG

        gcfg = {**MLA_GLUON_CONFIG, **(gluon_config or {})}
        base = {**base, "block_h": gcfg["block_h"], "BLOCK_N": gcfg["block_n"]}
        block_h = block_n = None
    bh = block_h or base["block_h"]
    bn = block_n or base["BLOCK_N"]
    nw = num_warps or base["num_warps"]
    st = base["num_stages"] if num_stages is None else num_stages
    tr = base["trans"] if trans is None else trans
    pf = base["prefetch"] if prefetch is None else prefetch
    pf = int(pf)
    if pf not in (0, 1, 2):
        raise ValueError(
            f"mla_decode_triton: prefetch must be False/True (rows) or 2 (table entries), got {pf}"
        )
    if pf == 1 and bn >= 64 and bh <= 32 and not INTERPRET:
        # measured: this combination gives wrong results when compiled by Triton 3.6 for an H200
        raise ValueError(
            "mla_decode_triton: prefetch with BLOCK_N >= 64 and block_h <= 32 is not supported (wrong results "
            "when compiled); use prefetch=False or a smaller block_n"
        )
    if page_size % bn == 0:
        mode = 1
    elif bn % page_size == 0:
        mode = 2
    else:
        mode = 0
    out = torch.empty(B, H, DC, dtype=torch.float32, device=q.device)
    post = None
    if w_uv is not None:
        if out_dtype is None:
            raise ValueError("mla_decode_triton: the post step (w_uv) needs out_dtype")
        post = _post_setup(B, H, DC, w_uv, gate, out_dtype, v_splits, q.device, "mla_decode_triton")
    if B == 0:
        return out if post is None else post[0]
    args = (
        q, kv_cache, block_table, lengths, out, out, out,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1),
        H, float(scale) * math.log2(math.e),
    )  # fmt: skip
    consts = dict(
        PAGE=page_size, MODE=mode, DC=DC, DR=DR, BLOCK_H=bh, BLOCK_N=bn, F32=kv_cache.dtype == torch.float32,
        TRANS=tr, PREFETCH=pf, STAGES=st, INTERP=INTERPRET, PDL=pdl_on(q),
    )  # fmt: skip
    # the Gluon walk's persistent schedule: groups of one program per head block, as many groups as the SMs hold,
    # each group an equal share of the batch's blocks (a split count asked for by name keeps the split form)
    persist = use_g and bool(gcfg["persistent"]) and not gcfg["pingpong"] and not num_splits
    persist = persist and B >= gcfg["persist_min_rows"]
    nhb = triton.cdiv(H, bh)
    ns = max(1, _sm_count(q.device) // nhb) if persist else num_splits
    if not ns:  # decided once per shape and configuration (this is on the decode step's host path)
        max_context = block_table.shape[1] * page_size
        min_chunk = _min_chunk(B, cfg, min_chunk)
        key = (B, H, max_context, nw, kv_cache.dtype, q.device, min_chunk, use_g, bh, bn, *consts.values())
        ns = _SPLITS.get(key)
        if ns is None:
            ns = _SPLITS[key] = mla_num_splits(
                B,
                H,
                max_context,
                bh,
                q.device,
                block_n=bn,
                resident=1 if use_g else _mla_resident(args, consts, nw, q.device),
                min_chunk=min_chunk,
            )
    bal = bool(cfg["balance"] if balance is None else balance) and ns > 1 and B > 1 and not use_g
    # partial slots per (row, head): a balanced row may take up to balance_spread times the even share of splits
    nsp = max(ns, int(cfg["balance_spread"]) * ns) if bal else ns
    MLA_LAST_LAUNCH.update(
        splits=ns, block_h=bh, block_n=bn, num_warps=nw, num_stages=st, prefetch=pf, pdl=consts["PDL"],
        min_chunk=min_chunk, post=None if post is None else "reduce" if ns > 1 or persist else "kernel", balance=bal,
        kernel="gluon" if use_g else "triton", schedule="persistent" if persist else "balanced" if bal else "per-row",
    )  # fmt: skip
    pdl = consts["PDL"]
    bkw = dict(BAL=bal, BP=triton.next_power_of_2(B) if bal else 1)
    lens_arg = lengths  # what the reduce reads the split arithmetic from
    part = lse = None  # (one split: the walk writes the output)
    if persist:
        from openk3.infer.mla_gluon import mla_persist_gluon

        qb, plan = mla_persist_prep(q, lengths, kv_cache.dtype, ns, gcfg)
        slots = (B + ns) * nhb
        part = torch.empty(slots, bh, DC, dtype=torch.float32, device=q.device)
        lse = torch.empty(slots, bh, dtype=torch.float32, device=q.device)
        mla_persist_gluon(qb, kv_cache, block_table, lengths, plan, part, lse, out, scale, gcfg)
        lens_arg, bkw = plan, dict(BAL=2, BP=1, PH=bh)
    elif ns > 1:
        part = torch.empty(B, H, nsp, DC, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, nsp, dtype=torch.float32, device=q.device)
        args = (*args[:5], part, lse, *args[7:])
    # balanced: one flat axis of ns * B programs plus one per row (the rows' split counts round up)
    grid = (triton.cdiv(H, bh), ns * B + B, 1) if bal else (triton.cdiv(H, bh), ns, B)
    if use_g and not persist:
        from openk3.infer.mla_gluon import mla_split_gluon

        # (no programmatic dependent launch: the kernel after it waits for its completion)
        mla_split_gluon(
            q, kv_cache, block_table, lengths, args[5], args[6] if ns > 1 else None, ns, scale, gcfg
        )
    elif not use_g:
        _mla_split_kernel[grid](
            *args, nsp, B, ns * B, DIRECT=ns == 1, **consts, **bkw, num_warps=nw, **pdl_launch(pdl)
        )
    return _mla_finish(part, lse, lens_arg, out, w_uv, post, nsp, ns * B, bn, pdl, bkw)


def _mla_finish(part, lse, lens_arg, out, w_uv, post, nsp, np_, bn, pdl, bkw):
    """The steps after the split walk: the reduce of the partials ``part`` / ``lse`` (None: one split, the walk
    wrote ``out`` itself), with the post step folded in where ``post`` (:func:`_post_setup`) is given, or the post
    step on the walk's output. ``lens_arg``: the lengths, or the persistent walk's plan (``bkw["BAL"]`` 2)."""
    B, H, DC = out.shape
    if post is not None:
        o, gate, pc = post
        g = gate if gate is not None else o
        if part is not None:  # the reduce applies the post step
            # W_UV held from before the wait where the streamed form would take more than one step
            whole = pc["VC"] < pc["VB"] and pc["VB"] * DC <= MLA_GLUE_CONFIG["post_whole_elems"]
            _mla_reduce_post_kernel[(pc["VS"], H, B)](
                part, lse, lens_arg, w_uv, g, o, out, H, nsp, B, np_, w_uv.stride(0), w_uv.stride(1), g.stride(0),
                o.stride(0), out.stride(0), out.stride(1), DC=DC, BLOCK_N=bn, BS=8, DV=pc["DV"], VB=pc["VB"],
                VC=pc["VC"], STAGES=pc["STAGES"], GATE=gate is not None, PDL=pdl, WHOLE=whole, **bkw,
                num_warps=pc["num_warps"], **pdl_launch(pdl),
            )  # fmt: skip
        else:  # the walk wrote the attention output: the post step reads it
            _launch_post(out, w_uv, gate, o, pc, pdl)
        return o
    if part is not None:
        _mla_reduce_kernel[(H, B)](
            part, lse, lens_arg, out, H, out.stride(0), out.stride(1), nsp, B, np_, DC=DC, BLOCK_N=bn, BS=8,
            PDL=pdl, **bkw, num_warps=4, **pdl_launch(pdl),
        )  # fmt: skip
    return out


def mla_persist_prep(
    q: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype, groups: int, gcfg: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent Gluon walk's inputs in one launch (:func:`_mla_persist_prep_kernel`): the query rows per task
    ``[B * NHB * block_h, 576]`` in the cache ``dtype`` (zeros past the heads) and the int32 plan for ``groups``
    groups of programs (one program per head block), each group an equal share (at least ``gcfg["min_blocks"]``
    blocks) of the batch's ``gcfg["block_n"]``-token blocks."""
    B, H, D = q.shape
    ph, bn, wmin = int(gcfg["block_h"]), int(gcfg["block_n"]), int(gcfg["min_blocks"])
    if wmin < 1 or groups < 1:
        raise ValueError(f"mla_persist_prep: min_blocks and groups must be >= 1, got {wmin}, {groups}")
    nt = B * triton.cdiv(H, ph)
    qb = torch.empty(nt * ph, D, dtype=dtype, device=q.device)
    plan = torch.empty(3 + B + groups, dtype=torch.int32, device=q.device)
    _mla_persist_prep_kernel[(nt + 1,)](
        q, lengths, plan, qb, q.stride(0), q.stride(1), H, B, groups, wmin, int(gcfg["align"]), D=D, PH=ph, BLOCK_N=bn,
        BP=triton.next_power_of_2(max(B, 2)), CB=32, INTERP=INTERPRET, num_warps=4,
    )  # fmt: skip
    return qb, plan


def _post_setup(B, H, DC, w_uv, gate, out_dtype, v_splits, device, who):
    """Checks and launch parameters of the MLA post step: (output ``[B, H * dv]``, gate or None, parameters)."""
    if w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != DC or w_uv.stride(-1) != 1:
        raise ValueError(
            f"{who}: w_uv must be [H={H}, dv, dc={DC}] with contiguous rows, got {tuple(w_uv.shape)} strides "
            f"{w_uv.stride()}"
        )
    if DC < 16 or DC & (DC - 1):
        raise ValueError(f"{who}: the latent width must be a power of two >= 16, got {DC}")
    DV = w_uv.shape[1]
    if gate is not None:
        if gate.shape != (B, H * DV):
            raise ValueError(f"{who}: gate must be [B, H * dv] = {(B, H * DV)}, got {tuple(gate.shape)}")
        gate = _row_major(gate)
    cfg = MLA_GLUE_CONFIG
    DVP = triton.next_power_of_2(DV)
    VC = min(cfg["post_rows"], DVP)
    if v_splits is None:
        want = triton.cdiv(max(1, int(cfg["programs_per_sm"] * _sm_count(device))), max(1, B * H))
        v_splits = min(DVP // VC, triton.next_power_of_2(want))
    if v_splits < 1 or v_splits & (v_splits - 1) or DVP // v_splits < VC:
        raise ValueError(f"{who}: v_splits must be a power of two <= {DVP // VC}, got {v_splits}")
    o = torch.empty(B, H * DV, dtype=out_dtype, device=device)
    pc = dict(
        VS=v_splits, DV=DV, VB=DVP // v_splits, VC=VC, STAGES=cfg["post_stages"], num_warps=cfg["post_warps"]
    )
    MLA_GLUE_LAST_LAUNCH["post"] = dict(pc, gate=gate is not None)
    return o, gate, pc


def _launch_post(cbar, w_uv, gate, o, pc, pdl) -> None:
    B, H, DC = cbar.shape
    g = gate if gate is not None else o
    _mla_post_kernel[(pc["VS"], H, B)](
        cbar, w_uv, g, o, cbar.stride(0), cbar.stride(1), w_uv.stride(0), w_uv.stride(1), g.stride(0), o.stride(0),
        DC=DC, DV=pc["DV"], VB=pc["VB"], VC=pc["VC"], STAGES=pc["STAGES"], GATE=gate is not None, PDL=pdl,
        num_warps=pc["num_warps"], **pdl_launch(pdl),
    )  # fmt: skip


def mla_post_triton(
    cbar: torch.Tensor,
    w_uv: torch.Tensor,
    gate: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    v_splits: int | None = None,
) -> torch.Tensor:
    """The MLA post step as its own launch (signature: :mod:`openk3.infer.decode`), grid ``(v_splits, H, B)``:
    each program forms ``VB = dv / v_splits`` outputs of one (row, head). (The engine folds the step into
    :func:`mla_decode_triton` instead.)"""
    B, H, DC = cbar.shape
    if cbar.dtype != torch.float32:
        raise ValueError(f"mla_post_triton: cbar must be fp32, got {cbar.dtype}")
    o, gate, pc = _post_setup(B, H, DC, w_uv, gate, out_dtype, v_splits, cbar.device, "mla_post_triton")
    if B:
        _launch_post(_row_major(cbar), w_uv, gate, o, pc, pdl_on(cbar))
    return o


def mla_prep_triton(
    q: torch.Tensor,
    c: torch.Tensor,
    kr: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_uk: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    *,
    chunks: int | None = None,
) -> torch.Tensor:
    """The MLA prep step in one launch (signature and layouts: :mod:`openk3.infer.decode`; kernel:
    :func:`_mla_prep_kernel`). ``chunks``: column chunks of ``W_UK`` per head (a power of two; default from
    :data:`MLA_GLUE_CONFIG`). ``w_uk`` may be a strided view (``kv_b_proj``'s rows) with contiguous rows."""
    B, H, D = q.shape
    if w_uk.dim() != 3 or w_uk.shape[0] != H or w_uk.stride(-1) != 1:
        raise ValueError(
            f"mla_prep_triton: w_uk must be [H={H}, dn, dc] with contiguous rows, got {tuple(w_uk.shape)}"
        )
    _, DN, DC = w_uk.shape
    DR = D - DN
    if DC < 16 or DC & (DC - 1) or DR < 1 or DR & (DR - 1):
        raise ValueError(
            f"mla_prep_triton: need a power-of-two latent >= 16 and a power-of-two rope part, got dc={DC}, dr={DR}"
        )
    if c.shape != (B, DC) or kr.shape != (B, DR) or rows.shape != (B,) or norm_weight.shape != (DC,):
        raise ValueError(
            f"mla_prep_triton: c {tuple(c.shape)}, kr {tuple(kr.shape)}, rows {tuple(rows.shape)}, norm weight "
            f"{tuple(norm_weight.shape)} do not match B={B}, dc={DC}, dr={DR}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != DC + DR or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"mla_prep_triton: kv_cache must be [pages, page_size, {DC + DR}], got {kv_cache.shape}"
        )
    q, c, kr, norm_weight = (_row_major(t) for t in (q, c, kr, norm_weight))
    ql = torch.empty(B, H, DC + DR, dtype=torch.float32, device=q.device)
    if B == 0:
        return ql
    cfg = MLA_GLUE_CONFIG
    if chunks is None:
        want = triton.cdiv(max(1, int(cfg["programs_per_sm"] * _sm_count(q.device))), H)
        chunks = min(max(1, DC // cfg["prep_min_cols"]), triton.next_power_of_2(want))
    if chunks < 1 or chunks & (chunks - 1) or chunks > DC:
        raise ValueError(f"mla_prep_triton: chunks must be a power of two <= {DC}, got {chunks}")
    DCB = DC // chunks
    DNP = triton.next_power_of_2(DN)
    NB = max(1, min(DNP, cfg["prep_elems"] // DCB))
    NB = 1 << (NB.bit_length() - 1)  # a power of two
    rows = rows.to(torch.int64)
    pdl = pdl_on(q)
    st = cfg["prep_stages"]
    early = bool(cfg["prep_early"]) and NB == DNP
    MLA_GLUE_LAST_LAUNCH["prep"] = dict(
        chunks=chunks, NB=NB, stages=st, num_warps=cfg["prep_warps"], pdl=pdl, early=early
    )
    _mla_prep_kernel[(H * chunks + B,)](
        q, c, kr, norm_weight, w_uk, kv_cache, rows, ql,
        q.stride(0), q.stride(1), c.stride(0), kr.stride(0), w_uk.stride(0), w_uk.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), ql.stride(0), ql.stride(1),
        B, H, float(eps),
        DN=DN, DNP=DNP, DC=DC, DR=DR, HP=triton.next_power_of_2(H), DCB=DCB, NC=chunks, NB=NB,
        PAGE=kv_cache.shape[1], STAGES=st, INTERP=INTERPRET, PDL=pdl, EARLY_W=early, num_warps=cfg["prep_warps"],
        **pdl_launch(pdl),
    )  # fmt: skip
    return ql


def kda_supports(config) -> tuple[bool, str]:
    """Whether :func:`kda_decode_triton` can run a model with this config (a power-of-two KDA head dim)."""
    K = config.kda_head_dim
    if K < 1 or K & (K - 1):
        return False, f"the Triton KDA decode step needs a power-of-two head_dim, the model has {K}"
    return True, ""


def mla_supports(config) -> tuple[bool, str]:
    """Whether :func:`mla_decode_triton` can run a model with this config (power-of-two latent, power-of-two shared
    key of at least 16 values)."""
    DC, DR = config.kv_lora_rank, config.qk_rope_head_dim
    if DC < 16 or DC & (DC - 1) or DR < 16 or DR & (DR - 1):
        return False, (
            f"the Triton MLA decode kernel needs a power-of-two kv_lora_rank and a power-of-two shared key >= 16, "
            f"the model has {DC} and {DR}"
        )
    return True, ""


kda_decode_triton.supports = kda_supports
mla_decode_triton.supports = mla_supports


def register() -> bool:
    """Add the kernels to ``FAST_KDA_DECODE`` / ``FAST_MLA_DECODE`` under ``"triton"`` when they can run here."""
    ok, _ = available()
    if ok:
        FAST_KDA_DECODE["triton"] = kda_decode_triton
        FAST_MLA_DECODE["triton"] = mla_decode_triton
    return ok


register()
