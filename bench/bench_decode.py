# ruff: noqa: B023
"""GPU benchmark of the Triton decode kernels (openk3.infer.kernels) against their peers, in one process.

    python3 bench/bench_decode.py [--out PATH] [--budget-s 210] [--no-sweep]

* ceilings, measured first: device-to-device copy bandwidth (bytes read + written) and a bf16 matmul rate;
* KDA decode step (conv, gates, L2 norms, delta update of the fp32 state in place, gated RMSNorm). First the
  few-row regime at the model shapes (Kimi-Linear-48B: H=32, low-rank decay and gate; medium: H=16, low-rank decay,
  full-rank gate; B in {1, 4}; the low-rank up projections applied in the kernel): the per-head few-row launch and
  the split form (``split_v`` programs per (row, head), a few launch parameters with the sweep). Then B in
  {1, 16, 64, 256}, H=32, K=V=128, bf16 inputs: ours vs fla-core ``fused_recurrent_kda`` (the recurrence only, in
  place through ``ssm_state_indices``; import guarded, e.g. ``PYTHONPATH=$PWD/.gpu-site``) and vs the PyTorch
  reference ``kda_decode_reference``; bytes = fp32 state read + written, conv history read + written, inputs and
  output (the table's note gives the state-only rate);
* absorbed MLA decode over a paged bf16 latent cache (page size 16, random page order), B in {1, 16, 64, 256},
  H in {16, 96}, context in {4096, 16384, 65536} plus the target shape B=64, L=8192: ours vs ``mla_decode_reference``
  (n/a where the reference would need more than ~24 GB); bytes = latent cache bytes read; combos whose cache
  exceeds 20 GB are skipped;
* a small sweep of launch configurations at the target shapes (``--no-sweep`` skips it);
* few-token MoE (``openk3.fast.moe_small``, section ``moe``) at 1, 4 and 16 tokens for the medium, 48B and K3 expert
  shapes: its router (two kernels) vs ``openk3.ops.moe.route``, its routed experts (three kernels) vs the permuted
  ``torch._grouped_mm`` path; bytes = router weight, resp. the distinct experts' weights the tokens route to;
* the token draw (section ``draw``): sorting-free top-p / Gumbel-max kernels against
  the PyTorch path (sort-based top-p), greedy against ``argmax``, the logprobs of the chosen token and the 5 most
  likely (``token_logprobs``) against ``log_softmax`` + ``topk``; B in {1, 16, 64}, 163,840 fp32 logits.

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call, median; ``--l2-flush read`` flushes
by reading instead of zeroing, which leaves no dirty lines to write back during the call) of a CUDA-graph replay of
the call, as the engine runs it: the Python launch path (tens of microseconds per call, more than a batch-1 kernel
takes) stays outside the timed region; ``--eager-timing`` times the Python call instead, and a call whose capture
fails is timed eagerly and listed in the JSON's ``eager_timed``. Random inputs, warm-up (compilation) outside the
timed region. Roofline per row: floor = max(bytes / copy bandwidth, FLOPs / matmul rate);
"roofline TB/s" = bytes / floor. Before timing, each shape is checked once against the reference (relative error
in the JSON). Prints ONE table at the end and writes JSON to ``--out`` (default ``$OUT/decode.json`` or
``bench/out/decode.json``; a directory gets ``decode.json`` inside).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
if os.path.isdir(os.path.join(ROOT, ".gpu-site")):
    sys.path.insert(1, os.path.join(ROOT, ".gpu-site"))

ROWS: list[dict] = []
INFO: dict = {"errors": [], "checks": {}, "skipped": []}
T0 = time.time()
DEV = "cuda"
# shapes (module constants, so a smoke run can shrink them)
KDA_SHAPE = dict(H=32, K=128, W=4)
KDA_BATCHES = (1, 16, 64, 256)
KDA_SWEEP_AT = (1, 16, 64, 256)  # small batches too: one program per (row, head) walks its tiles one by one
# (BV, num_warps, stages); BV 0: the whole head; stages 0: manual one-tile prefetch, >= 2: pipelined loop
# (BV, num_warps, stages, extra): BV 0 the whole head; stages 0 manual one-tile prefetch, >= 2 pipelined loop; extra:
# further kda_decode_triton keywords (l2_prefetch: the head's state requested into L2 first; heads_fast: grid (H, B))
OFF = dict(l2_prefetch=False, heads_fast=False)
KDA_SWEEP = [
    (32, 4, 0, OFF),
    (32, 4, 0, dict(l2_prefetch=True, heads_fast=False)),
    (32, 4, 0, dict(l2_prefetch=False, heads_fast=True)),
    (32, 4, 0, dict(l2_prefetch=True, heads_fast=True)),
    (32, 2, 0, OFF),
    (32, 2, 0, dict(l2_prefetch=True, heads_fast=True)),
    (64, 4, 0, dict(l2_prefetch=True, heads_fast=True)),
    (0, 8, 0, dict(l2_prefetch=True, heads_fast=True)),
]
# few rows as the engine runs them there, the low-rank projections applied in the kernel (z_lowrank / gate_lowrank):
# name -> (H, K = V, decay rank, gate rank (0: full-rank gate), decay gate); conv 4, bf16
KDA_FEW_SHAPES = {"48b": (32, 128, 128, 128, "softplus"), "medium": (16, 128, 128, 0, "lowerbound")}
KDA_FEW_BATCHES = (1, 4)
# split-form launches timed there beside the per-head few-row launch: (split_v, num_warps, split_prefetch,
# split_maxnreg); the first always, the rest with the sweep
KDA_SPLIT_SWEEP = [
    (4, 8, 2, 0),
    (8, 8, 2, 0),
    (2, 8, 2, 0),
    (2, 4, 2, 0),
    (8, 4, 2, 0),
    (4, 4, 2, 0),
    (16, 4, 2, 0),
    (4, 8, 1, 0),
    (8, 8, 1, 0),
    (4, 8, 0, 0),
    (4, 8, 2, 128),
    (8, 4, 2, 128),
]
KDA_SPLIT_CONFIG = 8  # also timed: KDA_CONFIG["few"]["split_v"] set to this (halved as rows are added)
MLA_DIMS = dict(DC=512, DR=64, page_size=16)
MLA_TARGETS = [(64, 16, 8192), (64, 96, 8192)]  # (B, H, L): swept
MLA_COMBOS = [(B, H, L) for L in (4096, 16384, 65536) for H in (16, 96) for B in (1, 16, 64, 256)]
# (block_h, block_n, num_warps, trans, prefetch, num_stages) tried at the target shapes, by head count
MLA_SWEEP = {
    16: [
        # prefetch 2: the next block's table entries in registers, the rows through Triton's pipeliner
        (16, 32, 8, True, 2, 3),
        (16, 32, 8, True, 2, 2),
        (16, 32, 2, True, 2, 3),
        (16, 16, 4, True, 2, 4),
        (16, 16, 4, True, 2, 6),
        (16, 64, 8, True, 2, 2),
    ],
    96: [
        (32, 32, 4, True, 2, 4),
        (64, 32, 8, True, 2, 3),
        (32, 64, 4, True, 2, 2),
    ],
}
# (config as above, splits) tried at the target shapes after the sweep: the split count against the launch tiles
MLA_SPLIT_SWEEP = {
    16: [((16, 32, 4, True, 2, 3), n) for n in (2, 4, 6)],
    96: [((32, 32, 4, True, 2, 4), n) for n in (1, 2, 4)],
}
CACHE_LIMIT = 20e9  # skip MLA shapes whose latent cache is larger
REF_LIMIT = 24e9  # the MLA reference's gathered fp32 copy and logits


def empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


GRAPH_TIMING = True  # time a CUDA-graph replay of each call (--eager-timing: the Python call itself)


def as_graph(fn):
    """``fn`` captured once in a CUDA graph, returned as its replay (what the engine runs: no Python launch path in
    the timed region); ``fn`` itself when graph timing is off or the capture fails (noted in INFO)."""
    if not GRAPH_TIMING or DEV != "cuda":
        return fn
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compile / autotune outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay
    except Exception as e:  # e.g. a peer that synchronises with the host
        torch.cuda.synchronize()
        INFO.setdefault("eager_timed", []).append(
            f"{getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}"[:300]
        )
        return fn


L2_FLUSH = "zero"  # before each timed call: "zero" (do_bench's: zeroing 256 MB) or "read" (--l2-flush read)
_FLUSH_BUF: list = []


def read_flush() -> None:
    """Evict L2 by reading 256 MB (a sum): L2 then holds clean lines. do_bench's zeroing flush leaves up to an L2's
    worth of dirty lines whose write-back overlaps the timed call (~5 us at the MLA target shape, NOTES.md v9)."""
    if not _FLUSH_BUF:
        _FLUSH_BUF.extend(
            [
                torch.empty(32 << 20, dtype=torch.int64, device=DEV),
                torch.empty((), dtype=torch.int64, device=DEV),
            ]
        )
    buf, sink = _FLUSH_BUF
    torch.sum(buf, dim=0, out=sink)


def bench(fn, graph: bool = True) -> float:
    """Median seconds of one call (replayed from a CUDA graph unless ``graph`` is off, see ``as_graph``; L2 flushed
    before each call, the way ``L2_FLUSH`` says)."""
    import triton.testing

    f = as_graph(fn) if graph else fn
    if L2_FLUSH == "zero" or DEV != "cuda":
        return triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median") / 1e3
    return time_calls(f, read_flush) / 1e3


def time_calls(f, flush=None, warmup: int = 25, reps: int = 100) -> float:
    """Median ms of one call of ``f`` (CUDA events around it), each call after ``flush()`` (outside the timed
    region), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        f()
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def row(op, shape, t_ours, t_peer, peer, nbytes, flops, note=""):
    bw, mm = INFO["copy_bw"], INFO["mm_rate"]
    floor = max(nbytes / bw, flops / mm)
    r = {
        "op": op,
        "shape": shape,
        "ours_ms": t_ours * 1e3,
        "peer": peer,
        "peer_ms": None if t_peer is None else t_peer * 1e3,
        "ratio": None if t_peer is None else t_peer / t_ours,
        "bytes": nbytes,
        "flops": flops,
        "ours_tbps": nbytes / t_ours / 1e12,
        "roofline_tbps": nbytes / floor / 1e12,
        "pct_roofline": 100 * floor / t_ours,
        "note": note,
    }
    ROWS.append(r)
    print(
        f"  {op:<22} {shape:<26} ours {r['ours_ms']:.4f} ms  {peer or '-'} "
        f"{'-' if t_peer is None else f'{t_peer * 1e3:.4f}'} ms  {r['ours_tbps']:.2f} TB/s "
        f"({r['pct_roofline']:.0f}% of roofline) {note}",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------------- ceilings
def ceilings():
    n = 1 << 28  # 1 GiB of fp32
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    # eager, as before: timed as a graph replay this copy measured 2.70 TB/s, where a kernel reading and writing
    # the KDA state in the same run reached 3.87
    t = bench(lambda: dst.copy_(src), graph=False)
    INFO["copy_bw"] = 2 * n * 4 / t
    src = dst = None
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = bench(lambda: a @ b, graph=False)
    INFO["mm_rate"] = 2 * 8192**3 / t
    a = b = None
    empty_cache()
    print(
        f"ceilings: copy {INFO['copy_bw'] / 1e12:.2f} TB/s, bf16 matmul {INFO['mm_rate'] / 1e12:.0f} TFLOP/s"
    )


# ---------------------------------------------------------------------------------------------------------- KDA
def kda_layer(H, K, W):
    HK = H * K
    dev = DEV

    def conv():
        return types.SimpleNamespace(weight=0.5 * torch.randn(HK, 1, W, device=dev))

    return types.SimpleNamespace(
        q_conv1d=conv(),
        k_conv1d=conv(),
        v_conv1d=conv(),
        A_log=torch.log(torch.empty(H, device=dev).uniform_(1, 16)),
        dt_bias=0.5 * torch.randn(HK, device=dev),
        o_norm=types.SimpleNamespace(weight=1 + 0.1 * torch.randn(K, device=dev)),
        gate_kind="lowerbound",
        lower_bound=-5.0,
        eps=1e-5,
        num_heads=H,
        head_dim=K,
    )


def fla_peer():
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        return fused_recurrent_kda_fwd, "fla fused_recurrent_kda"
    except Exception as e:  # optional peer
        INFO["fla"] = f"not available: {type(e).__name__}: {e}"
        print(f"fla-core not importable ({e}); KDA peer column = torch reference only", flush=True)
        return None, None


def kda_section(sweep: bool):
    from openk3.infer.decode import kda_decode_reference
    from openk3.infer.kernels import KDA_CONFIG, kda_decode_triton

    H, K, W = KDA_SHAPE["H"], KDA_SHAPE["K"], KDA_SHAPE["W"]
    HK = H * K
    layer = kda_layer(H, K, W)
    fla_fwd, fla_name = fla_peer()
    INFO["kda_config"] = dict(KDA_CONFIG)
    kda_few_rows(sweep)
    configs = KDA_SWEEP if sweep else []
    for B in KDA_BATCHES:
        if time.time() - T0 > BUDGET:
            INFO["skipped"].append(f"kda B={B}: time budget")
            continue
        S = B
        dt = torch.bfloat16
        q, k, v, z, gate = (torch.randn(B, HK, device=DEV, dtype=dt) for _ in range(5))
        beta = torch.randn(B, H, device=DEV, dtype=dt)
        conv = torch.randn(S + 1, 3, HK, W - 1, device=DEV)
        state = 0.1 * torch.randn(S + 1, H, K, K, device=DEV)
        slots = torch.randperm(S, device=DEV)[:B]
        shape = f"B={B} H={H} K=V={K}"
        # correctness once
        # the timed calls update conv / state in place: the sweep's checks start again from these copies
        conv0, state0 = conv.clone(), state.clone()
        c1, s1, c2, s2 = conv.clone(), state.clone(), conv.clone(), state.clone()
        o1 = kda_decode_triton(layer, q, k, v, z, beta, gate, c1, s1, slots)
        o2 = kda_decode_reference(layer, q, k, v, z, beta, gate, c2, s2, slots)
        INFO["checks"][f"kda {shape}"] = {"o": rel(o1, o2), "state": rel(s1[slots], s2[slots])}
        c1 = s1 = None
        state_bytes = 2 * B * H * K * K * 4
        nbytes = state_bytes + 2 * B * 3 * HK * (W - 1) * 4 + 6 * B * HK * 2 + B * H * 2
        flops = B * H * 7 * K * K

        def ours(**kw):
            return lambda: kda_decode_triton(layer, q, k, v, z, beta, gate, conv, state, slots, **kw)

        t_ours = bench(ours())
        t_ref = bench(lambda: kda_decode_reference(layer, q, k, v, z, beta, gate, conv, state, slots))
        note = f"state-only {state_bytes / t_ours / 1e12:.2f} TB/s"
        row("kda decode", shape, t_ours, t_ref, "torch ref", nbytes, flops, note)
        if fla_fwd is not None:
            qf, kf, vf, zf = (t.view(B, 1, H, K) for t in (q, k, v, z))
            bf = beta.view(B, 1, H)
            try:

                def peer():
                    return fla_fwd(
                        q=qf, k=kf, v=vf, g=zf, beta=bf, A_log=layer.A_log, dt_bias=layer.dt_bias,
                        initial_state=state, inplace_final_state=True, ssm_state_indices=slots,
                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                        lower_bound=-5.0,
                    )  # fmt: skip

                peer()
                t_fla = bench(peer)
                row(
                    "kda decode",
                    shape,
                    t_ours,
                    t_fla,
                    fla_name,
                    nbytes,
                    flops,
                    note + "; peer: recurrence only",
                )
            except Exception as e:
                INFO["errors"].append(f"fla peer B={B}: {type(e).__name__}: {e}")
                print(f"  fla peer failed: {e}", flush=True)
        if B in KDA_SWEEP_AT:
            for bv, nw, st, extra in configs:
                if time.time() - T0 > BUDGET:
                    break
                kw = dict(BV=bv, num_warps=nw, stages=st, **extra)
                tag = "".join(
                    f",{'' if on else 'no-'}{'pf' if n == 'l2_prefetch' else 'hf'}" for n, on in extra.items()
                )
                try:
                    c1, s1 = conv0.clone(), state0.clone()
                    o1 = kda_decode_triton(layer, q, k, v, z, beta, gate, c1, s1, slots, **kw)
                    err = max(rel(o1, o2), rel(s1[slots], s2[slots]))
                    c1 = s1 = None
                    t = bench(ours(**kw))
                    row(
                        f"kda [BV={bv or K},w={nw},st={st}{tag}]", shape, t, t_ours, "ours default", nbytes, flops,
                        f"state-only {state_bytes / t / 1e12:.2f} TB/s; err {err:.1e}",
                    )  # fmt: skip
                except Exception as e:
                    INFO["errors"].append(f"kda config {kw}: {type(e).__name__}: {e}")
                    print(f"  config {kw} failed: {e}", flush=True)
            if B == max(KDA_SWEEP_AT) and sweep:
                state_rmw_rows(state, slots, shape, state_bytes)
        q = k = v = z = gate = beta = conv = state = conv0 = state0 = c2 = s2 = o2 = None
        empty_cache()


def kda_few_rows(sweep: bool):
    """Batches of KDA_FEW_BATCHES rows at the KDA_FEW_SHAPES model shapes: the per-head few-row launch (the current
    default) and the split form (split_v programs per (row, head)), each checked once against the reference."""
    import torch.nn.functional as F

    from openk3.infer.decode import kda_decode_reference
    from openk3.infer.kernels import KDA_CONFIG, KDA_LAST_LAUNCH, kda_decode_triton

    W, dt = 4, torch.bfloat16
    for name, (H, K, zr, gr, gate_kind) in KDA_FEW_SHAPES.items():
        HK = H * K
        layer = kda_layer(H, K, W)
        layer.gate_kind = gate_kind
        layer.f_b_proj = types.SimpleNamespace(weight=(zr**-0.5 * torch.randn(HK, zr, device=DEV)).to(dt))
        if gr:
            layer.g_b_proj = types.SimpleNamespace(weight=(gr**-0.5 * torch.randn(HK, gr, device=DEV)).to(dt))
        for B in KDA_FEW_BATCHES:
            if time.time() - T0 > BUDGET:
                INFO["skipped"].append(f"kda few {name} B={B}: time budget")
                continue
            S = 4 * B
            q, k, v = (torch.randn(B, HK, device=DEV, dtype=dt) for _ in range(3))
            fa = torch.randn(B, zr, device=DEV, dtype=dt)
            ga = torch.randn(B, gr, device=DEV, dtype=dt) if gr else None
            gate = None if gr else torch.randn(B, HK, device=DEV, dtype=dt)
            beta = torch.randn(B, H, device=DEV, dtype=dt)
            conv = torch.randn(S + 1, 3, HK, W - 1, device=DEV)
            state = 0.1 * torch.randn(S + 1, H, K, K, device=DEV)
            slots = torch.randperm(S, device=DEV)[:B]
            lr = dict(z_lowrank=fa, gate_lowrank=ga) if gr else dict(z_lowrank=fa)
            shape = f"{name} B={B} H={H} K=V={K}"
            conv0, state0 = conv.clone(), state.clone()
            c2, s2 = conv.clone(), state.clone()
            z_full = F.linear(fa, layer.f_b_proj.weight)
            gate_full = F.linear(ga, layer.g_b_proj.weight) if gr else gate
            o2 = kda_decode_reference(layer, q, k, v, z_full, beta, gate_full, c2, s2, slots)
            state_bytes = 2 * B * H * K * K * 4
            # state, conv history, f_b / g_b, the inputs (q, k, v, beta, the low-rank activations or the full
            # gate) and the output
            nbytes = state_bytes + 2 * B * 3 * HK * (W - 1) * 4 + HK * (zr + gr) * 2
            nbytes += B * (3 * HK + H + zr + (gr or HK) + HK) * 2
            flops = B * H * 7 * K * K + 2 * B * HK * (zr + gr)

            def call(**kw):
                return lambda: kda_decode_triton(
                    layer, q, k, v, None, beta, gate, conv, state, slots, **lr, **kw
                )

            def err(**kw):
                c1, s1 = conv0.clone(), state0.clone()
                o1 = kda_decode_triton(layer, q, k, v, None, beta, gate, c1, s1, slots, **lr, **kw)
                return max(rel(o1, o2), rel(s1[slots], s2[slots]))

            try:
                e = err(split_v=0)
                INFO["checks"][f"kda few {shape}"] = e
                t_few = bench(call(split_v=0))
                row("kda few (per-head)", shape, t_few, None, None, nbytes, flops, f"err {e:.1e}")
            except Exception as ex:
                INFO["errors"].append(f"kda few {shape}: {type(ex).__name__}: {ex}")
                print(f"  kda few {shape} failed: {ex}", flush=True)
                continue
            configs = KDA_SPLIT_SWEEP if sweep else KDA_SPLIT_SWEEP[:1]
            runs = [
                (
                    f"kda split [NV={nv},w={nw},pf={pf}{f',r{mr}' if mr else ''}]",
                    dict(split_v=nv, num_warps=nw, split_prefetch=pf, split_maxnreg=mr),
                )
                for nv, nw, pf, mr in configs
            ]
            runs.append((f"kda split [config {KDA_SPLIT_CONFIG}]", None))
            for tag, kw in runs:
                if time.time() - T0 > BUDGET:
                    break
                few = KDA_CONFIG["few"]
                try:
                    if kw is None:  # through the configuration, as the engine would launch it
                        KDA_CONFIG["few"] = {**few, "split_v": KDA_SPLIT_CONFIG}
                    e = err(**(kw or {}))
                    got = KDA_LAST_LAUNCH.get("split_v")
                    t = bench(call(**(kw or {})))
                    row(tag, shape, t, t_few, "per-head few", nbytes, flops, f"split_v {got}; err {e:.1e}")
                except Exception as ex:
                    INFO["errors"].append(f"{tag} {shape}: {type(ex).__name__}: {ex}")
                    print(f"  {tag} {shape} failed: {ex}", flush=True)
                finally:
                    KDA_CONFIG["few"] = few
            q = k = v = fa = ga = gate = conv = state = conv0 = state0 = c2 = s2 = o2 = None
            empty_cache()


def state_rmw_rows(state, slots, shape, state_bytes):
    """The KDA step's memory pattern alone: each (row, head) program reads its fp32 state in the same column tiles,
    scales them and writes them back (no conv, gates or reductions), with and without the L2 prefetch. The rate
    this reaches is the ceiling of the access pattern, beside the device copy."""
    import triton
    import triton.language as tl

    from openk3.fast._triton import prefetch_l2 as _prefetch_l2

    @triton.jit
    def rmw(state_ptr, slots_ptr, s_state, K: tl.constexpr, BV: tl.constexpr, PF: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        head = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * s_state + h * (K * K)
        if PF:
            _prefetch_l2(head + tl.arange(0, K * K // 32) * 32)
        tile = head + tl.arange(0, K)[:, None] * K + tl.arange(0, BV)[None, :]
        for j in tl.static_range(K // BV):
            x = tl.load(tile + j * BV)
            tl.store(tile + j * BV, x * 0.5 + 1.0)

    B, H, K = slots.shape[0], state.shape[1], state.shape[2]
    for bv, nw, pf in ((32, 4, False), (32, 4, True), (128, 8, False), (128, 8, True)):
        try:

            def call():
                rmw[(B, H)](state, slots, state.stride(0), K=K, BV=bv, PF=pf, num_warps=nw)

            t = bench(call)
            row(
                f"state rmw [BV={bv},w={nw}{',pf' if pf else ''}]", shape, t, None, None, state_bytes, 0,
                f"state-only {state_bytes / t / 1e12:.2f} TB/s (access pattern alone)",
            )  # fmt: skip
        except Exception as e:
            INFO["errors"].append(f"state rmw {(bv, nw, pf)}: {type(e).__name__}: {e}")
            print(f"  state rmw {(bv, nw, pf)} failed: {e}", flush=True)


# ---------------------------------------------------------------------------------------------------------- MLA
def mla_inputs(B, H, L):
    DC, DR, ps = MLA_DIMS["DC"], MLA_DIMS["DR"], MLA_DIMS["page_size"]
    pages = -(-L // ps)
    P = B * pages
    kv = torch.randn(P + 1, ps, DC + DR, device=DEV, dtype=torch.bfloat16)
    table = torch.randperm(P, device=DEV, dtype=torch.int32).view(B, pages)
    lengths = torch.full((B,), L, device=DEV, dtype=torch.int32)
    q = torch.randn(B, H, DC + DR, device=DEV)
    return q, kv, table, lengths


def _sweep_name(bh, bn, nw, tr, pf, st) -> str:
    pre = {0: f",s{st}", 1: ",P", 2: f",P2,s{st}"}[int(pf)]
    return f"mla [H{bh},N{bn},w{nw}{',T' if tr else ''}{pre}]"


def mla_section(sweep: bool):
    from openk3.infer.decode import mla_decode_reference
    from openk3.infer.kernels import MLA_CONFIG, MLA_LAST_LAUNCH, mla_decode_triton

    INFO["mla_config"] = {k: v for k, v in MLA_CONFIG.items()}
    DC, DR = MLA_DIMS["DC"], MLA_DIMS["DR"]
    scale = 192**-0.5
    combos = MLA_TARGETS + ([] if TARGETS_ONLY else MLA_COMBOS)
    for i, (B, H, L) in enumerate(combos):
        cache_bytes = B * L * (DC + DR) * 2
        if cache_bytes > CACHE_LIMIT:
            INFO["skipped"].append(
                f"mla B={B} H={H} L={L}: cache {cache_bytes / 1e9:.1f} GB > {CACHE_LIMIT / 1e9:.0f} GB"
            )
            continue
        if time.time() - T0 > BUDGET:
            INFO["skipped"].append(f"mla B={B} H={H} L={L}: time budget")
            continue
        q, kv, table, lengths = mla_inputs(B, H, L)
        shape = f"B={B} H={H} L={L}"
        flops = B * H * L * 2 * (2 * DC + DR)
        ref_mem = B * L * (DC + DR) * 6 + 3 * B * H * L * 4
        run_ref = ref_mem < REF_LIMIT

        def ours(**kw):
            return lambda: mla_decode_triton(q, kv, table, lengths, scale=scale, kv_lora_rank=DC, **kw)

        o1 = ours()()
        t_ref = None
        o2 = None
        if run_ref:
            o2 = mla_decode_reference(q, kv, table, lengths, scale=scale, kv_lora_rank=DC)
            INFO["checks"][f"mla {shape}"] = rel(o1, o2)
            if i >= len(MLA_TARGETS):
                o2 = None
            t_ref = bench(lambda: mla_decode_reference(q, kv, table, lengths, scale=scale, kv_lora_rank=DC))
        t = bench(ours())
        ns = MLA_LAST_LAUNCH["splits"]  # of the default launch just timed
        row(
            "mla decode",
            shape,
            t,
            t_ref,
            "torch ref" if run_ref else None,
            cache_bytes,
            flops,
            f"splits={ns}",
        )
        if sweep and i < len(MLA_TARGETS):
            for bh_, bn, nw, tr, pf, st in MLA_SWEEP[16 if H <= 16 else 96]:
                if time.time() - T0 > BUDGET:
                    break
                name = _sweep_name(bh_, bn, nw, tr, pf, st)
                try:
                    kw = dict(block_h=bh_, block_n=bn, num_warps=nw, trans=tr, prefetch=pf, num_stages=st)
                    o3 = ours(**kw)()
                    ns_ = MLA_LAST_LAUNCH["splits"]
                    err = rel(o3, o2 if o2 is not None else o1)
                    INFO["checks"][f"mla {shape} {name}"] = err
                    bad = "" if err < 1e-2 else f"; WRONG (rel err {err:.2g})"
                    tc = bench(ours(**kw))
                    row(name, shape, tc, t, "ours default", cache_bytes, flops, f"splits={ns_}{bad}")
                except Exception as e:
                    INFO["errors"].append(f"{name}: {type(e).__name__}: {e}")
                    print(f"  {name} failed: {e}", flush=True)
            for (bh_, bn, nw, tr, pf, st), n_ in MLA_SPLIT_SWEEP[16 if H <= 16 else 96]:
                if time.time() - T0 > BUDGET:
                    break
                name = _sweep_name(bh_, bn, nw, tr, pf, st)
                try:
                    kw = dict(block_h=bh_, block_n=bn, num_warps=nw, trans=tr, prefetch=pf, num_stages=st)
                    o3 = ours(num_splits=n_, **kw)()
                    err = rel(o3, o2 if o2 is not None else o1)
                    INFO["checks"][f"mla {shape} {name} splits={n_}"] = err
                    bad = "" if err < 1e-2 else f"; WRONG (rel err {err:.2g})"
                    tc = bench(ours(num_splits=n_, **kw))
                    row(name, shape, tc, t, "ours default", cache_bytes, flops, f"splits={n_}{bad}")
                except Exception as e:
                    INFO["errors"].append(f"{name} splits={n_}: {type(e).__name__}: {e}")
                    print(f"  {name} splits={n_} failed: {e}", flush=True)
            for n_ in sorted({max(1, ns // 2), 2 * ns, 4 * ns} - {ns}):
                tc = bench(ours(num_splits=n_))
                row("mla [splits]", shape, tc, t, "ours default", cache_bytes, flops, f"splits={n_}")
        q = kv = table = lengths = o1 = o2 = None
        empty_cache()


# ---------------------------------------------------------------------------------------------------------- main
# ---------------------------------------------------------------------------------------------------------- MoE
# (name, E, k, router input D, expert width W, intermediate I, experts held): medium, the 48B shape, and K3's expert
# shapes with 64 of its 896 experts held (the router row uses all 896)
MOE_SHAPES = [
    ("medium", 64, 8, 2048, 1024, 640, 64),
    ("48b", 256, 8, 2304, 2304, 1024, 256),
    ("k3", 896, 16, 7168, 3584, 3072, 64),
]
MOE_TOKENS = (1, 4, 16)
# (UP_TILE, DOWN_TILE) of openk3.fast.moe_small (rows, columns, stages) tried at one token (medium and 48B shapes)
MOE_TILE_SWEEP = [
    ((16, 256, 3), (32, 128, 3)),
    ((16, 256, 1), (32, 128, 1)),
    ((8, 512, 3), (32, 128, 3)),
    # (bench/diag_moe_compile.py: the default tile with the fused selection compiles to 255 registers and spills at 4
    # warps; these two do not)
    ((8, 256, 3), (32, 128, 3)),
    ((16, 128, 3), (32, 128, 3)),
    ((4, 0, 1), (32, 128, 3)),  # gate/up whole rows (columns 0)
    ((2, 0, 1), (32, 128, 3)),
    ((1, 0, 1), (32, 128, 3)),
]


def moe_section(sweep: bool):
    """Few-token MoE (openk3.fast.moe_small) vs the permuted grouped-GEMM path and the torch router."""
    from openk3.fast import moe_small
    from openk3.fast.moe import experts_grouped
    from openk3.ops.moe import experts_reference, route

    print("MoE decode (router, routed experts; bf16):", flush=True)
    bf = torch.bfloat16
    for name, E, K, D, W, I, held in MOE_SHAPES:
        rw = torch.randn(E, D, device=DEV).div_(D**0.5).to(bf)
        bias = torch.randn(E, device=DEV) * 0.01
        w13 = torch.randn(held, 2 * I, W, device=DEV, dtype=bf) * W**-0.5
        w1, w3 = w13[:, :I], w13[:, I:]
        w2 = torch.randn(held, W, I, device=DEV, dtype=bf) * I**-0.5
        for N in MOE_TOKENS:
            if time.time() - T0 > BUDGET:
                INFO["skipped"].append(f"moe {name} N={N}: time budget")
                continue
            x = torch.randn(N, D, device=DEV, dtype=bf)
            kw = dict(top_k=K, activation="sigmoid", renormalize=True, scaling=2.5)
            with torch.no_grad():
                i_o, w_o, _ = moe_small.route_small(x, rw, bias, **kw)
                i_r, w_r, s_r = route(x, rw, bias, **kw)
                chosen = (s_r + bias).gather(1, i_o) - (s_r + bias).gather(1, i_r)
                INFO["checks"][f"router.{name}.N{N}"] = float(chosen.abs().max())
                t_o = bench(lambda: moe_small.route_small(x, rw, bias, **kw))
                t_r = bench(lambda: route(x, rw, bias, **kw))
            row(
                "moe router",
                f"{name} N{N} E{E} k{K} D{D}",
                t_o,
                t_r,
                "torch route",
                E * D * 2 + N * D * 2,
                2 * N * E * D,
            )
            h = torch.randn(N, W, device=DEV, dtype=bf)
            idx = torch.stack([torch.randperm(held, device=DEV)[:K] for _ in range(N)])
            wt = torch.rand(N, K, device=DEV)
            nbytes = int(idx.unique().numel()) * 3 * I * W * 2 + 2 * N * W * 2
            with torch.no_grad():
                y_o = moe_small.experts_small(h, idx, wt, w1, w2, w3, act="situ")
                y_r = experts_reference(h, idx, wt, w1, w2, w3, act="situ")
                INFO["checks"][f"experts.{name}.N{N}"] = rel(y_o, y_r)
                t_o = bench(lambda: moe_small.experts_small(h, idx, wt, w1, w2, w3, act="situ"))
                t_g = bench(lambda: experts_grouped(h, idx, wt, w1, w2, w3, act="situ"))
            pairs_bytes = N * K * 3 * I * W * 2  # what the per-pair kernels read when tokens share no expert
            row(
                "moe experts",
                f"{name} N{N} E{held} k{K} W{W} I{I}",
                t_o,
                t_g,
                "grouped_mm path",
                nbytes,
                2 * N * K * 3 * I * W,
                f"per-pair reads {pairs_bytes / 1e6:.0f} MB",
            )
            if sweep and N == 1 and name in ("medium", "48b"):
                base = (moe_small.UP_TILE, moe_small.DOWN_TILE)
                for up, down in MOE_TILE_SWEEP:
                    if time.time() - T0 > BUDGET:
                        break
                    moe_small.UP_TILE, moe_small.DOWN_TILE = up, down
                    try:
                        with torch.no_grad():
                            e = rel(moe_small.experts_small(h, idx, wt, w1, w2, w3, act="situ"), y_r)
                            t = bench(lambda: moe_small.experts_small(h, idx, wt, w1, w2, w3, act="situ"))
                        row(
                            "moe experts sweep",
                            f"{name} N1 up{up} down{down}",
                            t,
                            None,
                            None,
                            nbytes,
                            0,
                            f"err {e:.1e}",
                        )
                    finally:
                        moe_small.UP_TILE, moe_small.DOWN_TILE = base
        rw = w13 = w1 = w2 = w3 = None
        empty_cache()


DRAW_BATCHES = (1, 16, 64)
DRAW_VOCAB = 163840  # the Kimi-Linear / K3 vocabulary


def draw_section(sweep: bool):
    """The engine's token draw from fp32 logits [B, 163840]: ours (openk3.infer.sample_kernels, no sort) against
    the PyTorch path it replaced (temperature, sort-based top-p, the one-program-per-row Gumbel kernel), sampled
    with the CLI's defaults (temperature 0.8, top-p 0.95), and greedy against ``argmax``. Bytes: one read of the
    logits."""
    from openk3.infer.sample_kernels import gumbel_argmax_triton, sample_triton
    from openk3.infer.sampling import apply_temperature, sample_keys, token_logprobs, top_p_filter

    print("token draw (fp32 logits):", flush=True)
    V = DRAW_VOCAB
    for B in DRAW_BATCHES:
        if time.time() - T0 > BUDGET:
            INFO["skipped"].append(f"draw B={B}: time budget")
            continue
        x = torch.randn(B, V, device=DEV) * 3
        keys = torch.tensor(sample_keys(range(B), [1] * B), device=DEV)
        par = torch.tensor([[0.8, 0.95, 0.0, 1.0]] * B, device=DEV)
        greedy = torch.tensor([[0.0, 1.0, 0.0, 1.0]] * B, device=DEV)
        t_col = torch.full((B, 1), 0.8, device=DEV)
        p_col = torch.full((B, 1), 0.95, device=DEV)

        def ours():
            return sample_triton(x, par, keys)

        def peer():
            return gumbel_argmax_triton(top_p_filter(apply_temperature(x, t_col), p_col), keys)

        INFO["checks"][f"draw.B{B}.same_tokens"] = float((ours() == peer()).float().mean())
        row("draw top-p", f"B{B} V{V} t0.8 p0.95", bench(ours), bench(peer), "torch sort path", B * V * 4, 0)
        INFO["checks"][f"draw.B{B}.greedy_same"] = float(
            (sample_triton(x, greedy, keys, top_p=False) == x.argmax(-1)).float().mean()
        )
        row(
            "draw greedy",
            f"B{B} V{V}",
            bench(lambda: sample_triton(x, greedy, keys, top_p=False)),
            bench(lambda: x.argmax(-1)),
            "torch argmax",
            B * V * 4,
            0,
        )
        ids = x.argmax(-1)

        def lp_peer():
            lp = torch.log_softmax(x, -1)
            return lp.gather(1, ids[:, None]), lp.topk(5, dim=-1)

        row(
            "logprobs k5",
            f"B{B} V{V}",
            bench(lambda: token_logprobs(x, ids, 5)),
            bench(lp_peer),
            "log_softmax + topk",
            B * V * 4,
            0,
        )
        x = None
        empty_cache()


def table() -> str:
    hdr = (
        "op",
        "shape",
        "ours ms",
        "peer",
        "peer ms",
        "ratio",
        "bytes",
        "ours TB/s",
        "roof TB/s",
        "% roof",
        "note",
    )
    lines = []
    for r in ROWS:
        lines.append(
            (
                r["op"],
                r["shape"],
                f"{r['ours_ms']:.4f}",
                r["peer"] or "-",
                "-" if r["peer_ms"] is None else f"{r['peer_ms']:.4f}",
                "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
                f"{r['bytes'] / 1e6:.1f}MB",
                f"{r['ours_tbps']:.2f}",
                f"{r['roofline_tbps']:.2f}",
                f"{r['pct_roofline']:.0f}",
                r["note"],
            )
        )
    w = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(hdr)]
    out = [" | ".join(h.ljust(w[i]) for i, h in enumerate(hdr)), "-+-".join("-" * x for x in w)]
    out += [" | ".join(c.ljust(w[i]) for i, c in enumerate(x)) for x in lines]
    return "\n".join(out)


def main():
    global BUDGET
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "bench", "out"), "decode.json")
    ap.add_argument("--out", default=default)
    ap.add_argument(
        "--budget-s", type=float, default=210.0, help="no new shape starts after this many seconds"
    )
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    ap.add_argument(
        "--eager-timing",
        action="store_true",
        help="time the Python call instead of a CUDA-graph replay of it",
    )
    ap.add_argument("--sections", default="kda,mla,moe,draw")
    ap.add_argument(
        "--l2-flush",
        choices=("zero", "read"),
        default="zero",
        help="L2 flush before each timed call: zero (triton's do_bench: zeroing 256 MB, whose dirty lines are "
        "written back during the call) or read (a sum over 256 MB: clean lines)",
    )
    ap.add_argument(
        "--targets-only", action="store_true", help="MLA: only the target shapes (and their sweep)"
    )
    ap.add_argument(
        "--mla-shapes", default="", help="MLA: only these BxHxL shapes, e.g. 1x16x4096,16x16x16384"
    )
    ap.add_argument(
        "--mla-sweeps",
        default="tiles,splits",
        help="MLA sweeps at the target shapes: tiles (launch tiles), splits (split counts)",
    )
    ap.add_argument("--moe-tokens", default="", help="MoE: only these token counts, e.g. 1")
    ap.add_argument("--moe-shapes", default="", help="MoE: only these expert shapes, e.g. medium,48b")
    args = ap.parse_args()
    BUDGET = args.budget_s
    global MOE_TOKENS, MOE_SHAPES
    if args.moe_tokens:
        MOE_TOKENS = tuple(int(v) for v in args.moe_tokens.split(","))
    if args.moe_shapes:
        names = args.moe_shapes.split(",")
        MOE_SHAPES = [sh for sh in MOE_SHAPES if sh[0] in names]
    sweeps = set(args.mla_sweeps.split(","))
    for name, table_ in (("tiles", MLA_SWEEP), ("splits", MLA_SPLIT_SWEEP)):
        if name not in sweeps:
            table_.update({h: [] for h in table_})
    global GRAPH_TIMING, L2_FLUSH
    GRAPH_TIMING = not args.eager_timing
    L2_FLUSH = args.l2_flush
    INFO["l2_flush"] = L2_FLUSH
    global TARGETS_ONLY
    TARGETS_ONLY = args.targets_only
    if args.mla_shapes:
        global MLA_COMBOS, MLA_TARGETS
        MLA_TARGETS = []
        MLA_COMBOS = [tuple(int(v) for v in sh.split("x")) for sh in args.mla_shapes.split(",")]
    out = args.out
    if os.path.isdir(out) or out.endswith(os.sep):
        out = os.path.join(out, "decode.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA device")
    import triton

    torch.manual_seed(0)
    p = torch.cuda.get_device_properties(0)
    INFO.update(
        device=p.name,
        sms=p.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        argv=sys.argv,
    )
    ceilings()
    for name, fn in (
        ("kda", kda_section),
        ("mla", mla_section),
        ("moe", moe_section),
        ("draw", draw_section),
    ):
        if name not in args.sections.split(","):
            continue
        try:
            fn(not args.no_sweep)
        except Exception as e:
            INFO["errors"].append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            print(traceback.format_exc(), flush=True)
    INFO["wall_s"] = time.time() - T0
    with open(out, "w") as f:
        json.dump({"info": INFO, "rows": ROWS}, f, indent=1)
    print()
    print(f"checks (rel err vs reference): {json.dumps(INFO['checks'])}")
    if INFO["errors"]:
        print(f"errors: {[e.splitlines()[0] for e in INFO['errors']]}")
    if INFO["skipped"]:
        print(f"skipped: {INFO['skipped']}")
    print(
        f"{INFO['device']}: copy {INFO['copy_bw'] / 1e12:.2f} TB/s, bf16 mm {INFO['mm_rate'] / 1e12:.0f} TFLOP/s; "
        f"wall {INFO['wall_s']:.0f} s; json -> {out}"
    )
    print(table())


BUDGET = 210.0
TARGETS_ONLY = False

if __name__ == "__main__":
    main()
