"""Absorbed MLA decode for many heads on Hopper, warp-specialised (Gluon, ``triton.experimental.gluon``).

With many heads (K3 has 96) the split kernel of :mod:`openk3.infer.kernels` is compute-bound: every latent row is scored
against every head (576-wide products) and summed into every head's 512-wide output, and a Triton program whose one
warp group waits for its rows, forms both products and updates the softmax in turn keeps the tensor cores busy a
fraction of the time (bench/NOTES.md v20). This kernel splits that chain over three roles in one program, which Triton
3.6 does not form by itself for this loop:

* a loader warp walks the row's block table and issues TMA copies of whole pages (``[PAGE, 64]`` boxes of the
  ``[pages * PAGE, 576]`` cache) into a ring of ``STAGES`` shared-memory buffers of 64 tokens each, one mbarrier per
  buffer counting the bytes in;
* the score warp group (the kernel's own four warps) forms ``S = Q K^T`` for 64 heads x 64 tokens with
  asynchronous warpgroup MMAs (nine 64-wide slices of the 576 values), keeps the online softmax in fp32 (log2
  domain), hands the bf16 probabilities and the rescale factors to the other group through shared memory, and
  accumulates output columns 0-255 (``P V``, P from registers);
* the second warp group accumulates output columns 256-511 from the same probabilities (P from shared memory).

Both groups release a buffer when their products over it have completed, so the loader refills it while the next
block is scored. Two walks share these roles:

* the split walk (:func:`mla_split_gluon`): one program takes 64 heads of one row and one contiguous share of its
  context (the split of :func:`openk3.infer.kernels.mla_num_splits`, whole 64-token blocks) and writes the
  normalised partial and its log2 sum-exp in the layout of the Triton split kernel, so the same reduce (and reduce +
  post) kernels combine the splits. With rows of different lengths the programs of short rows finish early while
  the long rows' programs still run;
* the persistent walk (:func:`mla_persist_gluon`, the default from ``MLA_GLUON_CONFIG["persist_min_rows"]`` rows):
  as many groups as the SMs hold, one program per 64-head block in each group, launched side by side so that they
  read the same pages at about the same time (L2 reuse). Group ``g`` walks an equal share of the batch's blocks, the
  rows one after the other, as segments (a row's blocks inside the share); the loader also copies each segment's
  query rows by TMA (prepared in the cache dtype by :func:`openk3.infer.kernels.mla_persist_prep`, with the plan).
  A segment that is a whole row is written to the output; the others go to slots that the reduce combines, so every
  SM finishes at about the same time whatever the rows' lengths.
Same roundings as the Triton kernel: the fp32 query is rounded to the cache dtype, products accumulate in fp32, the
probabilities are rounded to the cache dtype before the value product.

Tokens past a row's length inside its last page are read, masked out of the scores and zeroed in shared memory
before the value products, so whatever those cache rows hold (stale or non-finite values) cannot reach the output;
page slots past the end of a split are loaded from outside the cache tensor, which TMA fills with zeros.

:func:`openk3.infer.kernels.mla_decode_triton` takes this walk by default on Hopper from ``MLA_CONFIG
["gluon_min_heads"]`` heads and ``["gluon_min_rows"]`` rows (measured: bench/NOTES.md v29, v31).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
    # the shared-memory layout of every 64-wide slice the kernels copy in (query and cache)
    _SWIZZLE = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # the register layout of every 64-column output tile (a warp group's warpgroup-MMA accumulator)
    _O_L = gl.constexpr(
        gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    )
except Exception:  # pragma: no cover - Triton without Gluon
    HAS_GLUON = False

__all__ = [
    "HAS_GLUON",
    "MLA_GLUON_CONFIG",
    "gluon_supported",
    "mla_persist_gluon",
    "mla_split_gluon",
    "persist_segments",
]

# Launch parameters: heads per program (the MMAs' M side), tokens per block, ring depth, the registers per thread of
# the second group and of the loader (the score group gets what is left of the kernel's register file; the kernel
# runs 4 + 4 + 1 warps, counted as three warp groups), and the kernel's register cap.
MLA_GLUON_CONFIG = {
    "block_h": 64,
    "block_n": 64,
    "stages": 2,
    "pv_regs": 232,
    "load_regs": 24,
    "maxnreg": 168,
    # the two warp groups take alternate blocks' scores (_mla_g_pp) instead of one group scoring every block
    "pingpong": False,
    # one program per SM walks an equal share of the batch's blocks across rows and head blocks
    # (mla_persist_gluon); off: the split walk, one program per (head block, split, row)
    "persistent": True,
    # the least blocks per group of the persistent walk (fewer groups take part when the batch is short)
    "min_blocks": 4,
    # the persistent walk from this many rows (fewer: the split walk)
    "persist_min_rows": 16,
    # the share is the longest row cut in equal parts where that is at most this many percent longer
    "align": 10,
    # the persistent walk's loader registers (at 24 its segment bookkeeping spills; at 32 the score group gets 240
    # registers and spills)
    "persist_load_regs": 40,
}

if HAS_GLUON:

    @gluon.jit
    def _mla_g_load_seg(
        kv_desc, bt_ptr, kv_s, kv_ready, kv_free, start, end, nblk, i0, oob_row,
        PAGE: gl.constexpr, BOX: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """The loader's copies for one segment: ``nblk`` blocks of the row whose block table is ``bt_ptr``, tokens
        ``start .. end``; ``i0`` blocks of the walk came before it (the ring's stages and phases run on across
        segments)."""
        for i in range(nblk):
            st = (i0 + i) % STAGES
            ph = ((i0 + i) // STAGES) & 1
            mbarrier.wait(kv_free.index(st), ph ^ 1)
            mbarrier.expect(kv_ready.index(st), NKC * BLOCK_N * 64 * kv_desc.dtype.primitive_bitwidth // 8)
            n0 = start + i * BLOCK_N
            for ps in gl.static_range(BLOCK_N // BOX):
                t0 = n0 + ps * BOX
                live = t0 < end
                page = gl.load(bt_ptr + t0 // PAGE, mask=live, other=0)
                row = gl.where(live, page * PAGE + t0 % PAGE, oob_row)
                for j in gl.static_range(NKC):
                    dst = kv_s.index(st * NKC + j).slice(ps * BOX, BOX)
                    tma.async_copy_global_to_shared(kv_desc, [row, j * 64], kv_ready.index(st), dst)

    @gluon.jit
    def _mla_g_pv4(a, kv_s, base, al, o0, o1, o2, o3):
        """Issue (asynchronously) a warp group's four 64-column value products over one buffer: ``o_c = o_c * al
        + a @ kv_s[base + c]`` for ``c`` in 0-3 (``a``: the probabilities, in registers or shared memory; ``al``:
        the rescale factor per head)."""
        o0 = warpgroup_mma(a, kv_s.index(base + 0), o0 * al[:, None], is_async=True)
        o1 = warpgroup_mma(a, kv_s.index(base + 1), o1 * al[:, None], is_async=True)
        o2 = warpgroup_mma(a, kv_s.index(base + 2), o2 * al[:, None], is_async=True)
        o3 = warpgroup_mma(a, kv_s.index(base + 3), o3 * al[:, None], is_async=True)
        return o0, o1, o2, o3

    @gluon.jit
    def _mla_g_zero4(BLOCK_H: gl.constexpr):
        """A warp group's four zeroed 64-column output tiles."""
        z = gl.zeros([BLOCK_H, 64], gl.float32, _O_L)
        return z, z, z, z

    @gluon.jit
    def _mla_g_store(
        out_ptr, o, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, J: gl.constexpr, OUT: gl.constexpr,
        BLOCK_H: gl.constexpr,
    ):  # fmt: skip
        """Columns ``64 J .. 64 J + 63`` of the program's normalised output. ``OUT`` 0: the ``[B, H, NS, 512]``
        partials of split ``sp`` (nothing for a split past the row's length); 1: the output row ``[B, H, 512]``
        (one split); 2: slot ``sp`` of the persistent walk's ``[slots, BLOCK_H, 512]`` partials."""
        hl = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, _O_L))
        hh = hb * BLOCK_H + hl
        dd = J * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, _O_L))
        hm = hh < H
        if OUT == 1:
            row = b.to(gl.int64) * s_ob + hh.to(gl.int64) * s_oh
        elif OUT == 2:
            row = (sp.to(gl.int64) * BLOCK_H + hl) * 512
        else:
            row = ((b.to(gl.int64) * H + hh) * NS + sp) * 512
            hm = hm & (start < end)
        gl.store(out_ptr + row[:, None] + dd[None, :], o * inv[:, None], mask=hm[:, None])

    @gluon.jit
    def _mla_g_store4(
        out_ptr, o0, o1, o2, o3, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, J0: gl.constexpr,
        OUT: gl.constexpr, BLOCK_H: gl.constexpr,
    ):  # fmt: skip
        """A warp group's four output tiles, columns ``64 J0 ..`` (:func:`_mla_g_store`)."""
        _mla_g_store(out_ptr, o0, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, J0 + 0, OUT, BLOCK_H)
        _mla_g_store(out_ptr, o1, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, J0 + 1, OUT, BLOCK_H)
        _mla_g_store(out_ptr, o2, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, J0 + 2, OUT, BLOCK_H)
        _mla_g_store(out_ptr, o3, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, J0 + 3, OUT, BLOCK_H)

    @gluon.jit
    def _mla_g_store_lse(
        lse_ptr, m, l, b, hb, sp, start, end, H, NS, OUT: gl.constexpr, BLOCK_H: gl.constexpr, row_l: gl.constexpr
    ):  # fmt: skip
        """The log2 sum-exp of the program's heads beside its partials (``OUT`` 0: ``[B, H, NS]``, 2: ``[slots,
        BLOCK_H]``; one split writes none)."""
        hl = gl.arange(0, BLOCK_H, layout=row_l)
        hh = hb * BLOCK_H + hl
        lse = m + gl.log2(gl.where(l > 0.0, l, 1.0))
        if OUT == 2:
            gl.store(lse_ptr + sp.to(gl.int64) * BLOCK_H + hl, lse, mask=hh < H)
        elif OUT == 0:
            gl.store(lse_ptr + (b.to(gl.int64) * H + hh) * NS + sp, lse, mask=(hh < H) & (start < end))

    @gluon.jit
    def _mla_g_zero_tail(kv_s, base, keep_rows, BLOCK_N: gl.constexpr):
        """Zero rows ``keep_rows ..`` of the value slices (chunks 0-7) of one buffer (generic-proxy stores: the
        caller fences before the value products read them)."""
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
        keep = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zl)) < keep_rows
        for j in gl.static_range(8):
            buf = kv_s.index(base + j)
            x = buf.load(zl)
            buf.store(gl.where(keep[:, None], x, gl.zeros_like(x)))

    @gluon.jit
    def _mla_g_pv_seg(
        kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, nblk, i0, k0,
        BLOCK_H: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """The second warp group over one segment of ``nblk`` blocks: output columns 256-511 and, from the last
        hand-over, ``1 / l``. ``i0``: the walk's blocks before the segment, ``k0``: the hand-overs before it (one
        per block and one per segment)."""
        o4, o5, o6, o7 = _mla_g_zero4(BLOCK_H)
        for i in range(nblk):
            st = (i0 + i) % STAGES
            mbarrier.wait(kv_ready.index(st), ((i0 + i) // STAGES) & 1)
            mbarrier.wait(p_ready, (k0 + i) & 1)
            alpha = a_s.load(gl.SliceLayout(1, _O_L))
            o4, o5, o6, o7 = _mla_g_pv4(p_s, kv_s, st * NKC + 4, alpha, o4, o5, o6, o7)
            o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o4, o5, o6, o7))
            mbarrier.arrive(p_free)
            mbarrier.arrive(kv_free.index(st))
        mbarrier.wait(p_ready, (k0 + nblk) & 1)
        inv = a_s.load(gl.SliceLayout(1, _O_L))
        mbarrier.arrive(p_free)
        return o4, o5, o6, o7, inv

    @gluon.jit
    def _mla_g_score_seg(
        q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, q_free, start, end, nblk, i0, k0, scale_log2,
        ARRIVE_Q: gl.constexpr, BLOCK_H: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """The score warp group over one segment (tokens ``start .. end``, ``nblk`` blocks): scores, online softmax,
        output columns 0-255; hands the probabilities and factors of every block, then ``1 / l``, to the second
        group. Returns the four output tiles, ``1 / l`` and the softmax state ``(m, l)``. ``ARRIVE_Q``: arrive on
        ``q_free`` once the last block's score products are done with the query buffer."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_O_L, k_width=2)
        kv_dtype: gl.constexpr = kv_s.dtype
        m = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_l))
        o0, o1, o2, o3 = _mla_g_zero4(BLOCK_H)
        for i in range(nblk):
            st = (i0 + i) % STAGES
            mbarrier.wait(kv_ready.index(st), ((i0 + i) // STAGES) & 1)
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
            for j in gl.static_range(NKC):
                s = warpgroup_mma(q_s.index(j), kv_s.index(st * NKC + j).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            if ARRIVE_Q:
                if i == nblk - 1:  # the query buffer may take the next segment's rows
                    mbarrier.arrive(q_free)
            n0 = start + i * BLOCK_N
            tok = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
            s = gl.where((tok < end)[None, :], s * scale_log2, float("-inf"))
            if n0 + BLOCK_N > end:
                # the last block: rows past the length (the rest of the row's last page, or zeros) leave the
                # value product, so that whatever those cache rows hold cannot reach the output
                _mla_g_zero_tail(kv_s, st * NKC, end - n0, BLOCK_N)
            m_new = gl.maximum(m, gl.max(s, axis=1))
            alpha = gl.exp2(m - m_new)
            p = gl.exp2(s - m_new[:, None])
            l = l * alpha + gl.sum(p, axis=1)
            m = m_new
            pb = p.to(kv_dtype)
            # the second group has read the previous hand-over
            mbarrier.wait(p_free, ((k0 + i) & 1) ^ 1)
            p_s.store(pb)
            a_s.store(alpha)
            fence_async_shared()
            mbarrier.arrive(p_ready)
            pa = gl.convert_layout(pb, p_l)
            al = gl.convert_layout(alpha, gl.SliceLayout(1, _O_L))
            o0, o1, o2, o3 = _mla_g_pv4(pa, kv_s, st * NKC, al, o0, o1, o2, o3)
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
            mbarrier.arrive(kv_free.index(st))
        inv = 1.0 / gl.where(l > 0.0, l, 1.0)
        # the factors' buffer takes 1 / l once the second group is past the segment's last block
        mbarrier.wait(p_free, ((k0 + nblk) & 1) ^ 1)
        a_s.store(inv)
        mbarrier.arrive(p_ready)
        return o0, o1, o2, o3, gl.convert_layout(inv, gl.SliceLayout(1, _O_L)), m, l

    @gluon.jit
    def _mla_g_loader(
        kv_desc, bt_ptr, kv_s, kv_ready, kv_free, start, end, nblk, oob_row,
        PAGE: gl.constexpr, BOX: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """The split walk's loader warp: its one segment."""
        _mla_g_load_seg(kv_desc, bt_ptr, kv_s, kv_ready, kv_free, start, end, nblk, 0, oob_row, PAGE, BOX, NKC,
                        STAGES, BLOCK_N)  # fmt: skip

    @gluon.jit
    def _mla_g_pv(
        kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, out_ptr, b, hb, sp, start, end, nblk, H, s_ob, s_oh,
        NS, OUT: gl.constexpr, BLOCK_H: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """The split walk's second warp group: output columns 256-511."""
        o4, o5, o6, o7, inv = _mla_g_pv_seg(
            kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, nblk, 0, 0, BLOCK_H, NKC, STAGES
        )
        _mla_g_store4(out_ptr, o4, o5, o6, o7, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, 4, OUT, BLOCK_H)

    @gluon.jit
    def _mla_g_score(
        q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, out_ptr, lse_ptr, b, hb, sp, start, end,
        nblk, H, s_ob, s_oh, NS, scale_log2,
        OUT: gl.constexpr, BLOCK_H: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """The split walk's score warp group: scores, online softmax, output columns 0-255."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o0, o1, o2, o3, inv, m, l = _mla_g_score_seg(
            q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, p_free, start, end, nblk, 0, 0, scale_log2,
            False, BLOCK_H, NKC, STAGES, BLOCK_N,
        )  # fmt: skip
        _mla_g_store4(out_ptr, o0, o1, o2, o3, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, 0, OUT, BLOCK_H)
        _mla_g_store_lse(lse_ptr, m, l, b, hb, sp, start, end, H, NS, OUT, BLOCK_H, gl.SliceLayout(1, s_l))

    @gluon.jit
    def _mla_g_pv_other(o0, o1, o2, o3, kv_s, p_s, a_s, p_ready, kv_free, pt, J0: gl.constexpr,
                        NKC: gl.constexpr, STAGES: gl.constexpr, row_o: gl.constexpr):  # fmt: skip
        """Ping-pong form: fold the other group's block ``pt`` (its probabilities and rescale factor from shared
        memory) into this group's four output tiles, wait for those products (MMA groups complete in order: also
        for any issued before them) and release the block's buffer."""
        mbarrier.wait(p_ready, pt & 1)
        al = a_s.load(row_o)
        o0, o1, o2, o3 = _mla_g_pv4(p_s, kv_s, (pt % STAGES) * NKC + J0, al, o0, o1, o2, o3)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        mbarrier.arrive(kv_free.index(pt % STAGES))
        return o0, o1, o2, o3

    @gluon.jit
    def _mla_g_pp(
        q_s, kv_s, p_s, a_s, ml_s, kv_ready, kv_free, p_ready, ml_ready, out_ptr, lse_ptr, b, hb, sp, start, end,
        nblk, H, s_ob, s_oh, NS, scale_log2,
        PAR: gl.constexpr, OUT: gl.constexpr, BLOCK_H: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """Ping-pong form (``PINGPONG``): warp group ``PAR`` scores the blocks ``PAR, PAR + 2, ...`` and keeps output
        columns ``256 PAR .. 256 PAR + 255`` of every block. The softmax state runs through the blocks in order:
        the owner of block ``t`` reads ``(m, l)`` after block ``t - 1`` from shared memory, writes its own, and
        publishes its bf16 probabilities and rescale factor for the other group; while one group is in its softmax
        the other's score MMAs run. One buffer each for ``(m, l)``, the probabilities and the factor: the group that
        writes block ``t``'s has read block ``t - 1``'s (and waited for its MMAs over them)."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_O_L, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, _O_L)
        kv_dtype: gl.constexpr = kv_s.dtype
        J0: gl.constexpr = 4 * PAR
        o0, o1, o2, o3 = _mla_g_zero4(BLOCK_H)
        for j in range(PAR, nblk, 2):
            st = j % STAGES
            mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
            for c in gl.static_range(NKC):
                s = warpgroup_mma(q_s.index(c), kv_s.index(st * NKC + c).permute((1, 0)), s, is_async=True)
            m_prev = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
            l_prev = gl.zeros([BLOCK_H], gl.float32, row_s)
            if j > 0:  # the other group's block j - 1, in order, while the scores run
                # (its wait also covers the scores issued before)
                o0, o1, o2, o3 = _mla_g_pv_other(
                    o0, o1, o2, o3, kv_s, p_s, a_s, p_ready, kv_free, j - 1, J0, NKC, STAGES, row_o
                )
                mbarrier.wait(ml_ready, (j - 1) & 1)
                m_prev = ml_s.index(0).load(row_s)
                l_prev = ml_s.index(1).load(row_s)
            s = warpgroup_mma_wait(0, deps=(s,))
            n0 = start + j * BLOCK_N
            tok = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
            s = gl.where((tok < end)[None, :], s * scale_log2, float("-inf"))
            m_new = gl.maximum(m_prev, gl.max(s, axis=1))
            alpha = gl.exp2(m_prev - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_new = l_prev * alpha + gl.sum(p, axis=1)
            if n0 + BLOCK_N > end:
                _mla_g_zero_tail(kv_s, st * NKC, end - n0, BLOCK_N)
            pb = p.to(kv_dtype)
            ml_s.index(0).store(m_new)
            ml_s.index(1).store(l_new)
            p_s.store(pb)
            a_s.store(alpha)
            fence_async_shared()
            mbarrier.arrive(ml_ready)
            mbarrier.arrive(p_ready)
            pa = gl.convert_layout(pb, p_l)
            al = gl.convert_layout(alpha, row_o)
            o0, o1, o2, o3 = _mla_g_pv4(pa, kv_s, st * NKC + J0, al, o0, o1, o2, o3)
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
            mbarrier.arrive(kv_free.index(st))
        if nblk > 0:
            if (nblk - 1) % 2 != PAR:  # the other group's last block comes after this group's last
                o0, o1, o2, o3 = _mla_g_pv_other(
                    o0, o1, o2, o3, kv_s, p_s, a_s, p_ready, kv_free, nblk - 1, J0, NKC, STAGES, row_o
                )
            # the state after the last block (no group writes it again)
            mbarrier.wait(ml_ready, (nblk - 1) & 1)
        m = ml_s.index(0).load(row_o)
        l = ml_s.index(1).load(row_o)
        nonempty = (l > 0.0) & (nblk > 0)
        inv = 1.0 / gl.where(nonempty, l, 1.0)
        _mla_g_store4(
            out_ptr, o0, o1, o2, o3, inv, b, hb, sp, start, end, H, s_ob, s_oh, NS, J0, OUT, BLOCK_H
        )
        if PAR == 0:
            _mla_g_store_lse(lse_ptr, m, l, b, hb, sp, start, end, H, NS, OUT, BLOCK_H, row_o)

    @gluon.jit
    def _mla_gp_walk(plan_ptr, B, NHB):
        """This program's part of the persistent walk: its group ``g``, its head block, the group's first and end
        positions (blocks of the rows one after the other) and the row that holds the first."""
        c = gl.program_id(0)
        g = c // NHB
        w = gl.load(plan_ptr)
        pos = g * w
        return g, c - g * NHB, pos, gl.minimum(pos + w, gl.load(plan_ptr + 1)), gl.load(plan_ptr + 3 + B + g)

    @gluon.jit
    def _mla_gp_seg(plan_ptr, len_ptr, r, pos, end_pos, BLOCK_N: gl.constexpr):
        """The segment of row ``r`` that the walk takes from position ``pos``: (first token, end token, blocks,
        whether it is the whole row, the position after it). A row without tokens gives no blocks."""
        rs = gl.load(plan_ptr + 2 + r)
        nb = gl.load(plan_ptr + 3 + r) - rs
        blk0 = pos - rs
        blk1 = gl.minimum(end_pos - rs, nb)
        length = gl.load(len_ptr + r).to(gl.int32)
        nblk = gl.maximum(blk1 - blk0, 0)
        whole = (blk0 == 0) & (blk1 == nb)
        return blk0 * BLOCK_N, gl.minimum(blk1 * BLOCK_N, length), nblk, whole, rs + gl.maximum(blk1, blk0)

    @gluon.jit
    def _mla_gp_loader(
        kv_desc, q_desc, bt_ptr, len_ptr, plan_ptr, kv_s, q_s, kv_ready, kv_free, q_ready, q_free, B, NHB, s_btb,
        oob_row, PAGE: gl.constexpr, BOX: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr,
    ):  # fmt: skip
        """The persistent walk's loader warp: per segment the query rows of the program's head block of the row
        (once the score group is done with the previous ones), then the segment's blocks."""
        g, hb, pos, end_pos, r = _mla_gp_walk(plan_ptr, B, NHB)
        i = 0
        n = 0
        while pos < end_pos:
            start, end, nblk, whole, pos = _mla_gp_seg(plan_ptr, len_ptr, r, pos, end_pos, BLOCK_N)
            if nblk > 0:
                mbarrier.wait(q_free, (n & 1) ^ 1)
                mbarrier.expect(q_ready, NKC * BLOCK_H * 64 * q_desc.dtype.primitive_bitwidth // 8)
                qrow = (r * NHB + hb) * BLOCK_H
                for j in gl.static_range(NKC):
                    tma.async_copy_global_to_shared(q_desc, [qrow, j * 64], q_ready, q_s.index(j))
                _mla_g_load_seg(
                    kv_desc, bt_ptr + r.to(gl.int64) * s_btb, kv_s, kv_ready, kv_free, start, end, nblk, i,
                    oob_row, PAGE, BOX, NKC, STAGES, BLOCK_N,
                )  # fmt: skip
                i += nblk
                n += 1
            r += 1

    @gluon.jit
    def _mla_gp_score(
        q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, q_ready, q_free, len_ptr, plan_ptr, part_ptr,
        lse_ptr, out_ptr, s_ob, s_oh, B, NHB, H, scale_log2,
        BLOCK_H: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """The persistent walk's score warp group: per segment the scores, softmax and output columns 0-255 into
        the segment's slot (``(row + group) NHB + head block``) with the log2 sum-exp."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        g, hb, pos, end_pos, r = _mla_gp_walk(plan_ptr, B, NHB)
        i = 0
        k = 0
        n = 0
        while pos < end_pos:
            start, end, nblk, whole, pos = _mla_gp_seg(plan_ptr, len_ptr, r, pos, end_pos, BLOCK_N)
            if nblk > 0:
                slot = (r + g) * NHB + hb
                mbarrier.wait(q_ready, n & 1)
                o0, o1, o2, o3, inv, m, l = _mla_g_score_seg(
                    q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, q_free, start, end, nblk, i, k,
                    scale_log2, True, BLOCK_H, NKC, STAGES, BLOCK_N,
                )  # fmt: skip
                if whole:  # the row's output itself (the reduce passes it over)
                    _mla_g_store4(out_ptr, o0, o1, o2, o3, inv, r, hb, slot, start, end, H, s_ob, s_oh, 1, 0, 1,
                                  BLOCK_H)  # fmt: skip
                else:
                    _mla_g_store4(part_ptr, o0, o1, o2, o3, inv, r, hb, slot, start, end, H, 0, 0, 1, 0, 2,
                                  BLOCK_H)  # fmt: skip
                    _mla_g_store_lse(lse_ptr, m, l, r, hb, slot, start, end, H, 1, 2, BLOCK_H,
                                     gl.SliceLayout(1, s_l))  # fmt: skip
                i += nblk
                k += nblk + 1
                n += 1
            r += 1

    @gluon.jit
    def _mla_gp_pv(
        kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, len_ptr, plan_ptr, part_ptr, out_ptr, s_ob, s_oh, B,
        NHB, H, BLOCK_H: gl.constexpr, NKC: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """The persistent walk's second warp group: per segment output columns 256-511 into the segment's slot."""
        g, hb, pos, end_pos, r = _mla_gp_walk(plan_ptr, B, NHB)
        i = 0
        k = 0
        while pos < end_pos:
            start, end, nblk, whole, pos = _mla_gp_seg(plan_ptr, len_ptr, r, pos, end_pos, BLOCK_N)
            if nblk > 0:
                o4, o5, o6, o7, inv = _mla_g_pv_seg(
                    kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, nblk, i, k, BLOCK_H, NKC, STAGES
                )
                slot = (r + g) * NHB + hb
                if whole:
                    _mla_g_store4(out_ptr, o4, o5, o6, o7, inv, r, hb, slot, start, end, H, s_ob, s_oh, 1, 4, 1,
                                  BLOCK_H)  # fmt: skip
                else:
                    _mla_g_store4(part_ptr, o4, o5, o6, o7, inv, r, hb, slot, start, end, H, 0, 0, 1, 4, 2,
                                  BLOCK_H)  # fmt: skip
                i += nblk
                k += nblk + 1
            r += 1

    @gluon.jit
    def _mla_g_buffers(
        kv_dtype: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr
    ):
        """Shared memory of both walks: the query (nine 64-wide slices), the ring of ``STAGES`` blocks, the
        probabilities and the per-head factors, and the ring's and hand-over's mbarriers (initialised)."""
        NKC: gl.constexpr = 9
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_s = gl.allocate_shared_memory(kv_dtype, [NKC, BLOCK_H, 64], sw)
        kv_s = gl.allocate_shared_memory(kv_dtype, [STAGES * NKC, BLOCK_N, 64], sw)
        # (the probabilities' rows are BLOCK_N values: a narrower swizzle below 64 tokens)
        p_sw: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=min(128, BLOCK_N * 2), element_bitwidth=16, rank=2
        )
        p_s = gl.allocate_shared_memory(kv_dtype, [BLOCK_H, BLOCK_N], p_sw)
        a_s = gl.allocate_shared_memory(
            gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        )
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for k in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(k), count=1)
            mbarrier.init(kv_free.index(k), count=2)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        return q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free

    @gluon.jit
    def _mla_persist_gluon_kernel(
        q_desc, kv_desc, bt_ptr, len_ptr, plan_ptr, part_ptr, lse_ptr, out_ptr, s_btb, s_ob, s_oh, H, B,
        scale_log2, oob_row,
        PAGE: gl.constexpr, BOX: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        PV_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
    ):  # fmt: skip
        NKC: gl.constexpr = 9
        NHB = gl.cdiv(H, BLOCK_H)
        q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free = _mla_g_buffers(
            kv_desc.dtype, BLOCK_H, BLOCK_N, STAGES
        )
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_free, count=1)
        gl.warp_specialize(
            [
                (
                    _mla_gp_score,
                    (q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, q_ready, q_free, len_ptr, plan_ptr,
                     part_ptr, lse_ptr, out_ptr, s_ob, s_oh, B, NHB, H, scale_log2, BLOCK_H, NKC, STAGES, BLOCK_N),
                ),
                (
                    _mla_gp_pv,
                    (kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, len_ptr, plan_ptr, part_ptr, out_ptr, s_ob,
                     s_oh, B, NHB, H, BLOCK_H, NKC, STAGES, BLOCK_N),
                ),
                (
                    _mla_gp_loader,
                    (kv_desc, q_desc, bt_ptr, len_ptr, plan_ptr, kv_s, q_s, kv_ready, kv_free, q_ready, q_free, B,
                     NHB, s_btb, oob_row, PAGE, BOX, NKC, STAGES, BLOCK_N, BLOCK_H),
                ),
            ],
            [4, 1],
            [PV_REGS, LOAD_REGS],
        )  # fmt: skip

    @gluon.jit
    def _mla_split_gluon_kernel(
        q_ptr, kv_desc, bt_ptr, len_ptr, out_ptr, lse_ptr,
        s_qb, s_qh, s_btb, s_ob, s_oh, H, scale_log2, NS, oob_row,
        PAGE: gl.constexpr, BOX: gl.constexpr, OUT: gl.constexpr, BLOCK_H: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PV_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
        PINGPONG: gl.constexpr = False,
    ):  # fmt: skip
        NKC: gl.constexpr = 9  # 576 = 9 x 64: 512 latent values (also the value), 64 rope values
        hb = gl.program_id(0)
        sp = gl.program_id(1)
        b = gl.program_id(2)
        length = gl.load(len_ptr + b).to(gl.int32)
        chunk = gl.cdiv(gl.cdiv(length, NS), BLOCK_N) * BLOCK_N
        start = sp * chunk
        end = gl.minimum(start + chunk, length)
        nblk = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
        kv_dtype: gl.constexpr = kv_desc.dtype
        q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free = _mla_g_buffers(
            kv_dtype, BLOCK_H, BLOCK_N, STAGES
        )
        # the query rows of this program's heads (zeros past H), rounded to the cache dtype
        ql: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
        hh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ql))
        dd = gl.arange(0, 64, layout=gl.SliceLayout(0, ql))
        qp = q_ptr + b.to(gl.int64) * s_qb + hh[:, None].to(gl.int64) * s_qh + dd[None, :]
        for j in gl.static_range(NKC):
            qj = gl.load(qp + j * 64, mask=(hh < H)[:, None], other=0.0)
            q_s.index(j).store(qj.to(kv_dtype))
        fence_async_shared()
        bt = bt_ptr + b.to(gl.int64) * s_btb
        if PINGPONG:
            ml_s = gl.allocate_shared_memory(
                gl.float32, [2, BLOCK_H], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
            )
            ml_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(ml_ready, count=1)
            gl.warp_specialize(
                [
                    (
                        _mla_g_pp,
                        (q_s, kv_s, p_s, a_s, ml_s, kv_ready, kv_free, p_ready, ml_ready, out_ptr, lse_ptr, b, hb,
                         sp, start, end, nblk, H, s_ob, s_oh, NS, scale_log2, 0, OUT, BLOCK_H, NKC, STAGES, BLOCK_N),
                    ),
                    (
                        _mla_g_pp,
                        (q_s, kv_s, p_s, a_s, ml_s, kv_ready, kv_free, p_ready, ml_ready, out_ptr, lse_ptr, b, hb,
                         sp, start, end, nblk, H, s_ob, s_oh, NS, scale_log2, 1, OUT, BLOCK_H, NKC, STAGES, BLOCK_N),
                    ),
                    (
                        _mla_g_loader,
                        (kv_desc, bt, kv_s, kv_ready, kv_free, start, end, nblk, oob_row, PAGE, BOX, NKC, STAGES,
                         BLOCK_N),
                    ),
                ],
                [4, 1],
                [PV_REGS, LOAD_REGS],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [
                    (
                        _mla_g_score,
                        (q_s, kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, out_ptr, lse_ptr, b, hb, sp,
                         start, end, nblk, H, s_ob, s_oh, NS, scale_log2, OUT, BLOCK_H, NKC, STAGES, BLOCK_N),
                    ),
                    (
                        _mla_g_pv,
                        (kv_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, out_ptr, b, hb, sp, start, end, nblk,
                         H, s_ob, s_oh, NS, OUT, BLOCK_H, NKC, STAGES),
                    ),
                    (
                        _mla_g_loader,
                        (kv_desc, bt, kv_s, kv_ready, kv_free, start, end, nblk, oob_row, PAGE, BOX, NKC, STAGES,
                         BLOCK_N),
                    ),
                ],
                [4, 1],
                [PV_REGS, LOAD_REGS],
            )  # fmt: skip


def gluon_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[bool, str]:
    """Whether :func:`mla_split_gluon` takes these inputs (and why not)."""
    if not HAS_GLUON:
        return False, "this Triton has no Gluon (triton.experimental.gluon)"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False, "the Gluon MLA kernel is for Hopper (sm_90) GPUs"
    if kv_cache.dtype not in (torch.bfloat16, torch.float16):
        return False, f"needs a bf16 or fp16 latent cache, got {kv_cache.dtype}"
    if q.shape[-1] != 576 or kv_lora_rank != 512 or kv_cache.shape[-1] != 576:
        return False, "needs the 512 + 64 latent of K3's MLA"
    page = kv_cache.shape[1]
    if page < 8 or page & (page - 1):
        return False, f"needs a power-of-two page size of at least 8 tokens, got {page}"
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != 576 or kv_cache.stride(0) != page * 576:
        return False, "needs a contiguous [pages, page_size, 576] cache"
    return True, ""


def mla_split_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    num_splits: int,
    scale: float,
    cfg: dict | None = None,
) -> None:
    """The split walk: ``out`` is ``[B, H, 512]`` fp32 with one split, else the ``[B, H, num_splits, 512]``
    partials with ``lse [B, H, num_splits]`` (log2 sum-exp), as :func:`openk3.infer.kernels.mla_decode_triton`'s
    split kernel writes them; every split covers whole ``cfg["block_n"]``-token blocks."""
    cfg, block_table, desc, box, oob = _setup(q, kv_cache, block_table, cfg, "mla_split_gluon")
    B, H, _ = q.shape
    page = kv_cache.shape[1]
    direct = num_splits == 1
    grid = (triton.cdiv(H, cfg["block_h"]), num_splits, B)
    _mla_split_gluon_kernel[grid](
        q, desc, block_table, lengths, out, out if lse is None else lse,
        q.stride(0), q.stride(1), block_table.stride(0),
        out.stride(0) if direct else 0, out.stride(1) if direct else 0,
        H, float(scale) * math.log2(math.e), num_splits, oob,
        PAGE=page, BOX=box, OUT=int(direct), BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], STAGES=cfg["stages"],
        PV_REGS=cfg["pv_regs"], LOAD_REGS=cfg["load_regs"], PINGPONG=bool(cfg["pingpong"]), num_warps=4,
        maxnreg=cfg["maxnreg"],
    )  # fmt: skip


def _setup(q, kv_cache, block_table, cfg, who):
    """Checks and the cache's TMA descriptor: (config, int32 block table, descriptor, box rows, the first row past
    the cache)."""
    cfg = {**MLA_GLUON_CONFIG, **(cfg or {})}
    ok, why = gluon_supported(q, kv_cache, 512)
    if not ok:
        raise ValueError(f"{who}: {why}")
    if block_table.dtype != torch.int32:  # (the loader's page arithmetic and TMA coordinates are 32-bit)
        block_table = block_table.to(torch.int32)
    box = min(kv_cache.shape[1], cfg["block_n"])
    flat = kv_cache.view(-1, 576)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [box, 64], _SWIZZLE)
    return cfg, block_table, desc, box, flat.shape[0]


def mla_persist_gluon(
    qb: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    plan: torch.Tensor,
    part: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    cfg: dict | None = None,
) -> None:
    """The persistent walk (grid: the plan's groups of one program per head block, as many groups as the SMs
    hold): group ``g`` takes positions ``[g W, (g + 1) W)`` of the batch's blocks (the rows one after the other),
    its programs (launched side by side, so that they read the same pages at about the same time) one head block
    each, and writes each segment (a row's blocks inside the share) to slot ``(row + g) NHB + head block`` of
    ``part [slots, block_h, 512]`` / ``lse [slots, block_h]``, or, where one group walks the whole row, to the
    row's output ``out [B, H, 512]`` (:func:`persist_segments` spells out the walk).
    ``qb [B * NHB * block_h, 576]`` and ``plan`` come from :func:`openk3.infer.kernels.mla_persist_prep`; the
    reduce of :mod:`openk3.infer.kernels` combines the slots."""
    B = lengths.shape[0]
    cfg, block_table, desc, box, oob = _setup(
        qb.view(-1, 1, 576), kv_cache, block_table, cfg, "mla_persist_gluon"
    )
    bh = cfg["block_h"]
    heads = out.shape[1]
    programs = (plan.shape[0] - 3 - B) * triton.cdiv(heads, bh)
    if (
        qb.dtype != kv_cache.dtype
        or qb.shape != (B * triton.cdiv(heads, bh) * bh, 576)
        or not qb.is_contiguous()
    ):
        raise ValueError(f"mla_persist_gluon: qb {tuple(qb.shape)} {qb.dtype} is not the prepared query rows")
    q_desc = TensorDescriptor(qb, list(qb.shape), list(qb.stride()), [bh, 64], _SWIZZLE)
    _mla_persist_gluon_kernel[(programs,)](
        q_desc, desc, block_table, lengths, plan, part, lse, out, block_table.stride(0), out.stride(0),
        out.stride(1), heads, B, float(scale) * math.log2(math.e), oob,
        PAGE=kv_cache.shape[1], BOX=box, BLOCK_H=bh, BLOCK_N=cfg["block_n"], STAGES=cfg["stages"],
        PV_REGS=cfg["pv_regs"], LOAD_REGS=cfg["persist_load_regs"], num_warps=4, maxnreg=cfg["maxnreg"],
    )  # fmt: skip


def persist_segments(plan, lengths, heads: int, block_h: int = 64, block_n: int = 64) -> list[tuple]:
    """The persistent walk in plain Python (what each program of :func:`mla_persist_gluon` does, for tests and
    diagnostics): ``(program, slot, row, head block, first token, end token)`` for every segment with blocks; a
    segment that is the whole row (written to the output, not to its slot) has slot -1."""
    plan = [int(x) for x in plan.tolist()]
    lengths = [int(x) for x in lengths.tolist()]
    B = len(lengths)
    nhb = -(-heads // block_h)
    w, total = plan[0], plan[1]
    segs = []
    for g in range(len(plan) - 3 - B):
        pos, end_pos, r = g * w, min(g * w + w, total), plan[3 + B + g]
        while pos < end_pos:
            rs = plan[2 + r]
            blk0, blk1 = pos - rs, min(end_pos - rs, plan[3 + r] - rs)
            if blk1 > blk0:
                first, end = blk0 * block_n, min(blk1 * block_n, lengths[r])
                whole = blk0 == 0 and blk1 == plan[3 + r] - rs
                segs += [
                    (g * nhb + hb, -1 if whole else (r + g) * nhb + hb, r, hb, first, end)
                    for hb in range(nhb)
                ]
            pos = rs + max(blk1, blk0)
            r += 1
    return segs
