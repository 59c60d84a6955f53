# ruff: noqa: B023
"""All GPU benchmarks in one process: ceilings, KDA, MLA, MoE, AttnRes, norms + KDA short conv, a `medium` training
step, decode.

    python bench/run_all.py [--out DIR] [--sections ceil,kda,mla,moe,attnres,norm,model,decode] [--tests]
                            [--budget-s 540]

Prints ONE table at the end (ours, the peer on the same inputs in the same run, ratio, roofline floor) and writes
``bench.json`` (and ``errors.json`` / ``profile.txt`` when produced) to ``--out`` (default ``$OUT`` or
``bench/out``). Ceilings (bf16 matmul rate, device copy bandwidth) are measured first in the same run and the
floors use them: floor = max(FLOPs / matmul rate, bytes / copy bandwidth). ``--tests`` runs ``tests/gpu`` first in
the same process (shared compile caches). Each section is independent: a failure is recorded and the next runs;
no new section starts once ``--budget-s`` seconds have passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

ROWS: list[dict] = []
INFO: dict = {}
CEIL = {"mm": 790e12, "bw": 4.2e12, "measured": False}


# --------------------------------------------------------------------------------------------------------------
# timing


def timeit(fn, warmup: int = 2, rep: int = 10, setup=None) -> float:
    """Median seconds of ``fn()`` over ``rep`` runs (CUDA events), after ``warmup`` runs."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        if setup:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def timeit_pipelined(fn, warmup: int = 2, rep: int = 10, setup=None) -> float:
    """Mean seconds of ``setup(); fn()`` run ``rep`` times back to back (no synchronisation in between, one pair of
    CUDA events around all of them), after ``warmup`` runs: the throughput a training step sees, where the host
    launches ahead while the GPU works, so host-side launch latency is hidden (``timeit`` synchronises around every
    call and so also counts it)."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(rep):
        if setup:
            setup()
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / rep


def floor_s(flops: float = 0.0, nbytes: float = 0.0) -> float:
    return max(flops / CEIL["mm"], nbytes / CEIL["bw"])


def row(section, name, shape, ours, peer=None, peer_name="", flops=0.0, nbytes=0.0, note="", **extra):
    r = {
        "section": section,
        "name": name,
        "shape": shape,
        "ours_ms": ours * 1e3 if ours is not None else None,
        "peer": peer_name,
        "peer_ms": peer * 1e3 if peer is not None else None,
        "ratio": (ours / peer) if (ours and peer) else None,
        "floor_ms": floor_s(flops, nbytes) * 1e3 if (flops or nbytes) else None,
        "tflops": flops / ours / 1e12 if (flops and ours) else None,
        "flops": flops,
        "bytes": nbytes,
        "note": note,
    }
    r.update(extra)
    ROWS.append(r)
    print(
        f"  {name:44s} {shape:34s} ours {fmt(r['ours_ms'])} ms  peer {fmt(r['peer_ms'])} ms  "
        f"floor {fmt(r['floor_ms'])} ms  {note}",
        flush=True,
    )
    return r


def fmt(v, d=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-2):
            return f"{v:.2e}"
        return f"{v:.{d}f}"
    return str(v)


def free():
    import gc

    gc.collect()
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# sections


def copy_rate(nbytes: int = 1 << 31) -> tuple[float, float]:
    """(bytes read + written per second, seconds per copy) of one device copy of ``nbytes`` (bf16 buffers)."""
    a = torch.randn(nbytes // 4, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    b = torch.empty_like(a)
    t = timeit(lambda: b.copy_(a), rep=20)
    a = b = None
    free()
    return 2 * nbytes / t, t


def matmul_rate(n: int = 8192) -> tuple[float, float]:
    """(FLOP per second, seconds per product) of one dense bf16 ``n x n x n`` matmul of random values."""
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = timeit(lambda: x @ y, rep=20)
    x = y = None
    free()
    return 2 * n**3 / t, t


def sec_ceil():
    CEIL["bw"], t_c = copy_rate()  # 2 GiB per buffer
    CEIL["mm"], t = matmul_rate()
    CEIL["measured"] = True
    row(
        "ceil",
        "device copy (bytes read+written)",
        "2 GiB -> 2 GiB bf16",
        t_c,
        note=f"{CEIL['bw'] / 1e12:.2f} TB/s",
    )
    row("ceil", "bf16 matmul 8192^3 (random)", "8192x8192x8192", t, note=f"{CEIL['mm'] / 1e12:.0f} TFLOP/s")


class _KDALayer(torch.nn.Module):
    def __init__(self, H, K):
        super().__init__()
        self.num_heads, self.head_dim = H, K
        self.gate_kind, self.lower_bound = "lowerbound", -5.0
        self.A_log = torch.nn.Parameter(torch.empty(H, device="cuda").uniform_(1, 16).log())
        self.dt_bias = torch.nn.Parameter(torch.randn(H * K, device="cuda") * 0.5)


def sec_kda():
    from fla.ops.kda import chunk_kda

    from openk3.cost import _kda_state_flops_chunk
    from openk3.fast.kda import kda_core_fla

    cases = [(4, 8192, 16, None), (1, 16384, 16, "varlen")]
    if os.environ.get("BENCH_KDA_H64", "1") == "1":  # another head count = another full set of fla compiles
        cases.insert(0, (2, 8192, 64, None))
    for B, T, H, var in cases:
        K = 128
        layer = _KDALayer(H, K)
        mk = lambda: torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
        q, k, v, z = mk(), mk(), mk(), mk()
        beta = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        cu = None
        if var:
            cuts = sorted(torch.randperm(T - 2)[:6].add(2).tolist())
            cu = torch.tensor([0, 1, *cuts, T], device="cuda")
        do = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)

        def ours():
            return kda_core_fla(
                layer, q, k, v, z, beta, initial_state=None, output_final_state=False, cu_seqlens=cu
            )[0]

        def peer():
            return chunk_kda(
                q,
                k,
                v,
                z,
                beta,
                A_log=layer.A_log,
                dt_bias=layer.dt_bias,
                use_gate_in_kernel=True,
                safe_gate=True,
                lower_bound=-5.0,
                use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                cu_seqlens=cu,
            )[0]

        fl = _kda_state_flops_chunk(K, K, 64) * B * T * H
        by = B * T * H * (4 * K * 2 + 2 + K * 2)
        shape = f"B{B} T{T} H{H} D{K}{' varlen' + str(len(cu) - 1) if var else ''} bf16"
        with torch.no_grad():
            t_o, t_p = timeit(ours), timeit(peer)
        row("kda", "KDA chunk fwd (ours core vs chunk_kda)", shape, t_o, t_p, "fla chunk_kda", fl, by)

        def fb(f):
            return lambda: f().backward(do)

        t_o, t_p = timeit(fb(ours)), timeit(fb(peer))
        row("kda", "KDA chunk fwd+bwd", shape, t_o, t_p, "fla chunk_kda", 3 * fl, 3 * by)
        q = k = v = z = beta = do = None
        free()


def sec_mla():
    from openk3.fast import mla

    H_T = [(16, 4096), (96, 4096), (16, 16384), (96, 16384)]
    for H, T in H_T:
        B = 1
        q = torch.randn(B, T, H, 192, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(B, T, H, 192, device="cuda", dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        do = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
        sc = 192**-0.5
        fl = 2 * B * H * (T * (T + 1) / 2) * (192 + 128)  # causal fwd
        by = B * T * H * (192 * 2 + 128 * 2) * 2
        shape = f"B{B} T{T} H{H} 192/128 causal bf16"
        variants = {
            m: (lambda m=m: mla.mha_sdpa(q, k, v, scale=sc, mode=m)) for m in ("pad", "cudnn", "efficient")
        }
        if T == 4096 and H == 16 and os.environ.get("BENCH_FLEX", "1") == "1":
            variants["flex"] = lambda: mla.mha_flex(q, k, v, scale=sc)
        res = {}
        for m, f in variants.items():
            try:
                with torch.no_grad():
                    tf = timeit(f)
                tb = timeit(lambda f=f: f().backward(do))
                res[m] = (tf, tb)
            except Exception as e:  # a kernel that does not support these shapes
                res[m] = None
                print(f"    mla {m} failed: {type(e).__name__}: {str(e)[:200]}")
        ours_mode = mla.SDPA_MODE
        for m, tt in res.items():
            if tt is None:
                continue
            row(
                "mla",
                f"MLA prefill fwd [{m}]",
                shape,
                tt[0],
                res["pad"][0] if res.get("pad") else None,
                "SDPA flash, V padded",
                fl,
                by,
                note="ours" if m == ours_mode else "",
            )
            row(
                "mla",
                f"MLA prefill fwd+bwd [{m}]",
                shape,
                tt[1],
                res["pad"][1] if res.get("pad") else None,
                "SDPA flash, V padded",
                3 * fl,
                3 * by,
                note="ours" if m == ours_mode else "",
            )
        q = k = v = do = None
        free()
    # packed documents
    T, H = 16384, 16
    q = torch.randn(1, T, H, 192, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(1, T, H, 192, device="cuda", dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(1, T, H, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    do = torch.randn(1, T, H, 128, device="cuda", dtype=torch.bfloat16)
    cuts = sorted(torch.randperm(T - 2)[:6].add(2).tolist())
    bounds = [0, 1, *cuts, T]
    cu = torch.tensor(bounds, device="cuda")
    fl = sum(2 * H * ((b - a) * (b - a + 1) / 2) * 320 for a, b in zip(bounds, bounds[1:]))
    res = {}
    for vm in ("varlen", "loop", "flex") if os.environ.get("BENCH_FLEX", "1") == "1" else ("varlen", "loop"):
        mla.VARLEN_MODE = vm
        try:
            f = lambda: mla.mha_sdpa(q, k, v, scale=192**-0.5, cu_seqlens=cu)  # noqa: E731
            tb = timeit(lambda f=f: f().backward(do))
            res[vm] = tb
        except Exception as e:
            print(f"    mla varlen {vm} failed: {type(e).__name__}: {str(e)[:200]}")
    mla.VARLEN_MODE = os.environ.get("OPENK3_MLA_VARLEN", "varlen")
    for vm, t in res.items():
        row(
            "mla",
            f"MLA packed fwd+bwd [{vm}]",
            f"T{T} H{H} {len(bounds) - 1} docs bf16",
            t,
            res.get("loop"),
            "one SDPA per document",
            3 * fl,
            0,
        )
    free()


def sec_moe():
    """Every variant of the grouped-GEMM expert path (openk3.fast.moe.VARIANTS, or the comma-separated list in
    ``BENCH_MOE_VARIANTS``) on the same inputs in this process, against one dense peer; then the whole medium
    SparseMoE layer per variant; then the K3 expert shape (default variant only)."""
    from openk3.config import K3Config
    from openk3.fast import moe as fast_moe
    from openk3.fast.moe import experts_grouped
    from openk3.ops.moe import experts_reference

    variants = [v for v in os.environ.get("BENCH_MOE_VARIANTS", ",".join(fast_moe.VARIANTS)).split(",") if v]
    INFO["moe_default_variant"] = fast_moe.VARIANT

    def bench_experts(E, K, W, I, N, with_ref, tag, variants):
        dt = torch.bfloat16
        x = torch.randn(N, W, device="cuda", dtype=dt).requires_grad_()
        logits = torch.randn(N, E, device="cuda")
        idx = logits.topk(K, dim=-1).indices
        w = torch.softmax(logits.gather(1, idx), -1).requires_grad_()
        # gate and up as the two halves of one [E, 2I, W] buffer: the layout of openk3.modules.moe.Experts
        w13 = torch.randn(E, 2 * I, W, device="cuda", dtype=dt) * W**-0.5
        ws = [
            w13[:, :I].requires_grad_(),
            (torch.randn(E, W, I, device="cuda", dtype=dt) * I**-0.5).requires_grad_(),
            w13[:, I:].requires_grad_(),
        ]
        dy = torch.randn(N, W, device="cuda", dtype=dt)
        fl = 2 * N * K * 3 * W * I
        wbytes = 3 * E * I * W * 2
        by_fwd = wbytes + N * W * 2 * 2 + N * K * (W + I) * 2 * 2
        # dense GEMMs of the same FLOPs: all N*k rows through one [W, I] / [I, W] weight
        xr = torch.randn(N * K, W, device="cuda", dtype=dt).requires_grad_()
        d1 = (torch.randn(W, I, device="cuda", dtype=dt) * W**-0.5).requires_grad_()
        d3 = (torch.randn(W, I, device="cuda", dtype=dt) * W**-0.5).requires_grad_()
        d2 = (torch.randn(I, W, device="cuda", dtype=dt) * I**-0.5).requires_grad_()
        dyr = torch.randn(N * K, W, device="cuda", dtype=dt)
        dense = lambda: ((xr @ d1) * (xr @ d3)) @ d2  # noqa: E731

        def clear():  # a training step starts from cleared gradients (zero_grad(set_to_none=True))
            for t in (x, w, *ws, xr, d1, d2, d3):
                t.grad = None

        # each timed both ways: synchronised around every call, and back to back (what a training step sees)
        timers = (("", timeit), (" pipelined", timeit_pipelined))

        # seconds: forward without autograd, fwd+bwd from cleared gradients
        def fwd_and_fwdbwd(tm, f, grad_out):
            with torch.no_grad():
                t_f = tm(f)
            return t_f, tm(lambda: f().backward(grad_out), setup=clear)

        peer = {how: fwd_and_fwdbwd(tm, dense, dyr) for how, tm in timers}
        shape = f"E{E} top{K} W{W} I{I} N{N} bf16"
        res = {}
        for v in variants:
            f_fwd = lambda: experts_grouped(x, idx, w, *ws, variant=v)  # noqa: E731
            try:
                ours = {how: fwd_and_fwdbwd(tm, f_fwd, dy) for how, tm in timers}
            except torch.OutOfMemoryError as e:
                print(f"    moe {tag} [{v}] OOM: {str(e)[:200]}")
                free()
                continue
            res[v] = ours[""][1]
            for how, (t_f, t_fb) in ours.items():
                for name, t, t_d, mult in (("fwd", t_f, peer[how][0], 1), ("fwd+bwd", t_fb, peer[how][1], 3)):
                    row(
                        "moe",
                        f"{tag} experts {name}{how} [{v}]",
                        shape,
                        t,
                        t_d,
                        "dense GEMMs same FLOPs",
                        mult * fl,
                        mult * by_fwd,
                        note=f"{t_d / t * 100:.0f}% of dense rate{' (default)' if v == fast_moe.VARIANT else ''}",
                        variant=v,
                    )
        if with_ref and res:
            best = min(res, key=res.get)
            t_r = timeit(
                lambda: experts_reference(x, idx, w, *ws, act="situ").backward(dy),
                warmup=1,
                rep=3,
                setup=clear,
            )
            row(
                "moe",
                f"{tag} experts fwd+bwd [{best}] vs reference loop",
                shape,
                res[best],
                t_r,
                "experts_reference",
                3 * fl,
                0,
            )
        x = w = ws = w13 = dy = xr = d1 = d2 = d3 = dyr = None

    bench_experts(64, 8, 1024, 640, 16384, True, "medium", variants)
    free()
    # whole SparseMoE layer of the medium preset (router, latent down/up, norm, shared experts, routed experts)
    from openk3.modules.moe import SparseMoE

    cfg = K3Config.from_preset("medium")
    layer = SparseMoE(cfg, 1).cuda()
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    layer.to(torch.bfloat16)
    layer.gate.weight.data = layer.gate.weight.data.float()
    N = 16384
    x = torch.randn(1, N, cfg.hidden_size, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    d, Wl = cfg.hidden_size, cfg.moe_width
    fl = (
        2
        * N
        * (
            cfg.num_experts * d
            + 2 * d * Wl
            + 3 * d * cfg.moe_intermediate_size * cfg.num_shared_experts
            + cfg.num_experts_per_token * 3 * Wl * cfg.moe_intermediate_size
        )
    )
    default_variant = fast_moe.VARIANT
    res = {}
    try:
        layer.backend = "reference"
        res["reference"] = timeit(lambda: layer(x).backward(dy), warmup=1, rep=5)
        layer.backend = "grouped_mm"
        for v in variants:
            fast_moe.VARIANT = v
            res[v] = timeit(lambda: layer(x).backward(dy), warmup=1, rep=10)
    finally:
        fast_moe.VARIANT = default_variant
    for v in variants:
        row(
            "moe",
            f"medium SparseMoE layer fwd+bwd [{v}]",
            f"N{N} D{d} E64 top8",
            res[v],
            res["reference"],
            "reference experts",
            3 * fl,
            0,
            variant=v,
        )
    layer = x = dy = None
    free()
    # K3 expert shapes, few tokens: weights (59 GB bf16) + gradients do not leave room for more
    if os.environ.get("BENCH_MOE_K3", "1") == "1":
        try:
            bench_experts(896, 16, 3584, 3072, 4096, False, "K3", [fast_moe.VARIANT])
        except torch.OutOfMemoryError as e:
            print("    K3 MoE shape OOM:", str(e)[:200])
        free()


def sec_attnres():
    from openk3.fast.attnres import TritonAttnResReader
    from openk3.ops.attnres import AttnResReader

    try:
        from flash_attn_res import phase_1_batched_attention_triton_op, phase_2_online_softmax_merge_triton_op
    except Exception:
        phase_1_batched_attention_triton_op = None

    def block(B, T, D, S, Q, dt=torch.bfloat16):
        srcs = [torch.randn(B, T, D, device="cuda", dtype=dt).requires_grad_() for _ in range(S)]
        lives = [torch.randn(B, T, D, device="cuda", dtype=dt).requires_grad_() for _ in range(Q)]
        qs = [(torch.randn(1, D, device="cuda") * 0.05).requires_grad_() for _ in range(Q)]
        nws = [torch.ones(D, device="cuda").requires_grad_() for _ in range(Q)]
        douts = [torch.randn(B, T, D, device="cuda", dtype=dt) for _ in range(Q)]
        return srcs, lives, qs, nws, douts

    def run_reader(cls, srcs, lives, qs, nws, douts, grad=True):
        rd = cls(1e-5)
        for s in srcs[:-1]:
            rd.sealed.append(s)
        rd.seal(srcs[-1], [(j, qs[j], nws[j]) for j in range(len(qs))])
        outs = [rd.read(j, qs[j], nws[j], lives[j]) for j in range(len(qs))]
        if grad:
            torch.autograd.backward(outs, douts)
        return outs

    def run_far(srcs, lives, qs, nws, douts, grad=True):
        V = torch.stack(srcs)
        W = torch.stack([(nw * q.reshape(-1)) for q, nw in zip(qs, nws)])
        pn, lse = phase_1_batched_attention_triton_op(V, W, 1e-5)
        outs = [
            phase_2_online_softmax_merge_triton_op(lives[j], W[j], pn[j], lse[j], 1e-5)
            for j in range(len(qs))
        ]
        if grad:
            torch.autograd.backward(outs, douts)
        return outs

    def plain(srcs, lives, qs, nws, douts, grad=True):  # plain residual: each site's input is r itself
        outs = [lv + 0 for lv in lives]
        if grad:
            torch.autograd.backward(outs, douts)
        return outs

    for B, T, D, S, Q in [(4, 4096, 2048, 4, 8), (1, 4096, 7168, 8, 24)]:
        data = block(B, T, D, S, Q)
        N = B * T
        shape = f"N{N} D{D} S{S} sealed Q{Q} sites bf16"
        # bytes per element of [N, D] (bf16 e = 2, fp32 partials): forward = phase 1 reads the S sources and writes
        # Q partials, each read reads r + its partial and writes out; backward = each read's backward reads dout, r,
        # partial and writes dr, dPn; phase-1 coefficients read the sources and all dPn; the source gradients read
        # both again and write dV. Floor: the phase-1 second pass over the sources assumed to hit L2.
        by_f = N * D * (2 * S + Q * (4 + 4 + 2 + 2))
        by_fb = by_f + N * D * (Q * (3 * 2 + 4 + 4) + (2 * S + 4 * Q) + (2 * S + 4 * Q + 2 * S))
        res = {}
        cands = {
            "ours": lambda g: run_reader(TritonAttnResReader, *data, grad=g),
            "reference": lambda g: run_reader(AttnResReader, *data, grad=g),
            "plain": lambda g: plain(*data, grad=g),
        }
        if phase_1_batched_attention_triton_op is not None and D & (D - 1) == 0:
            cands["flash-attn-res"] = lambda g: run_far(*data, grad=g)
        leaves = [t for part in data for t in part if t.requires_grad]

        def clear(leaves=leaves):  # a training step starts from cleared gradients (no accumulation kernels)
            for t in leaves:
                t.grad = None

        for name, f in cands.items():
            try:
                with torch.no_grad():
                    tf = timeit(lambda f=f: f(False))
                tb = timeit(lambda f=f: f(True), setup=clear)
                res[name] = (tf, tb)
            except Exception as e:
                print(f"    attnres {name} failed: {type(e).__name__}: {str(e)[:300]}")
        for name, (tf, tb) in res.items():
            if name == "ours":
                continue
            row("attnres", f"AttnRes block fwd [ours vs {name}]", shape, res["ours"][0], tf, name, 0, by_f)
            row(
                "attnres",
                f"AttnRes block fwd+bwd [ours vs {name}]",
                shape,
                res["ours"][1],
                tb,
                name,
                0,
                by_fb,
            )
        INFO.setdefault("attnres", {})[shape] = {k: [v[0] * 1e3, v[1] * 1e3] for k, v in res.items()}
        data = None
        free()

    # a model's whole AttnRes walk: every sealed set (S = 1 .. blocks sources), each with its Q reads, one backward.
    # This is what one training step pays for AttnRes; "plain" is a plain residual (each site's input is r itself).
    def walk(cls, srcs, lives, qs, nws, douts, grad=True):
        nb = len(srcs)
        Q = len(qs) // nb
        rd = cls(1e-5, max_sources=nb) if cls is not None else None
        outs = []
        for b in range(nb):
            ids = range(b * Q, (b + 1) * Q)
            if rd is None:
                outs += [lives[j] + 0 for j in ids]
                continue
            rd.seal(srcs[b], [(j, qs[j], nws[j]) for j in ids])
            outs += [rd.read(j, qs[j], nws[j], lives[j]) for j in ids]
        if grad:
            torch.autograd.backward(outs, douts)
        return outs

    for tag, (B, T, D, nb, Q) in (("medium", (4, 4096, 2048, 4, 8)), ("K3", (1, 4096, 7168, 8, 24))):
        srcs, lives, qs, nws, douts = block(B, T, D, nb, nb * Q)
        leaves = [*srcs, *lives, *qs, *nws]

        def clear(leaves=leaves):
            for t in leaves:
                t.grad = None

        shape = f"N{B * T} D{D} {nb} sealed sets x Q{Q} sites bf16"
        res = {}
        cands = {"ours": TritonAttnResReader, "plain": None}
        if tag == "medium":
            cands["reference"] = AttnResReader
        for name, cls in cands.items():
            args = (cls, srcs, lives, qs, nws, douts)
            try:
                with torch.no_grad():
                    tf = timeit(lambda args=args: walk(*args, grad=False), rep=5)
                tb = timeit(lambda args=args: walk(*args, grad=True), rep=5, setup=clear)
                res[name] = (tf, tb)
            except Exception as e:
                print(f"    attnres walk {name} failed: {type(e).__name__}: {str(e)[:300]}")
        if "ours" in res:
            for name, (tf, tb) in res.items():
                if name == "ours":
                    continue
                row("attnres", f"{tag} AttnRes walk fwd [ours vs {name}]", shape, res["ours"][0], tf, name)
                row(
                    "attnres", f"{tag} AttnRes walk fwd+bwd [ours vs {name}]", shape, res["ours"][1], tb, name
                )
            INFO.setdefault("attnres_walk_ms", {})[tag] = {
                k: [v[0] * 1e3, v[1] * 1e3] for k, v in res.items()
            }
        srcs = lives = qs = nws = douts = leaves = None
        free()
    # decode: N = batch tokens, latency bound; forward only (phase 1 once per block + Q reads), per block and per read
    for N, D, S, Q in [(1, 2048, 4, 8), (64, 2048, 4, 8)]:
        data = block(N, 1, D, S, Q)
        shape = f"N{N} D{D} S{S} sealed Q{Q} sites bf16 decode"
        by_f = N * D * (2 * S + Q * (4 + 4 + 2 + 2))
        res = {}
        for name, cls in (("ours", TritonAttnResReader), ("reference", AttnResReader)):
            try:
                with torch.no_grad():
                    res[name] = timeit(lambda cls=cls: run_reader(cls, *data, grad=False), rep=50)
            except Exception as e:
                print(f"    attnres decode {name} failed: {type(e).__name__}: {str(e)[:300]}")
        if "ours" in res:
            rd = TritonAttnResReader(1e-5)
            srcs, lives, qs, nws, _ = data
            with torch.no_grad():
                for s in srcs[:-1]:
                    rd.sealed.append(s)
                rd.seal(srcs[-1], [(j, qs[j], nws[j]) for j in range(Q)])
                t_read = timeit(lambda: rd.read(0, qs[0], nws[0], lives[0]), rep=50)
            row("attnres", "AttnRes decode read [ours, one site]", shape, t_read, None, "", 0, N * D * 8)
            row(
                "attnres",
                "AttnRes decode block fwd [ours vs reference]",
                shape,
                res["ours"],
                res.get("reference"),
                "reference",
                0,
                by_f,
            )
        INFO.setdefault("attnres", {})[shape] = {k: [v * 1e3] for k, v in res.items()}
        data = None
        free()


def sec_norm():
    """RMSNorm, the KDA gated output norm and the KDA short conv (+ SiLU) at `medium` shapes: fla backends (ours)
    vs the plain-PyTorch references. Floors count the bytes each pass must move: norm fwd reads x and writes y, bwd
    reads x and dy and writes dx (the gated norm also reads the gate and writes its gradient); conv the same as the
    norm (weights and per-row statistics are negligible)."""
    from openk3.config import K3Config
    from openk3.fast.conv import causal_conv1d_fla
    from openk3.fast.norm import gated_rms_norm_fla, rms_norm_fla
    from openk3.ops.conv import causal_conv1d
    from openk3.ops.norm import gated_rms_norm, rms_norm

    cfg = K3Config.from_preset("medium")
    B, T, D = 4, 4096, cfg.hidden_size
    N = B * T
    H, K, W, eps = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.rms_norm_eps
    C = H * K
    dt = torch.bfloat16
    cap = os.environ.get("OPENK3_AUTOTUNE_MAX")
    note = f"autotune capped at {cap} configs" if cap else ""

    def bench(tag, shape, ours, ref, leaves, dy, bytes_fwd, bytes_fb):
        def clear():
            for t in leaves:
                t.grad = None

        with torch.no_grad():
            t_of, t_rf = timeit(lambda: ours()), timeit(lambda: ref())
        t_o = timeit(lambda: ours().backward(dy), setup=clear)
        t_r = timeit(lambda: ref().backward(dy), setup=clear)
        row("norm", f"{tag} fwd", shape, t_of, t_rf, "reference", 0, bytes_fwd, note=note)
        row("norm", f"{tag} fwd+bwd", shape, t_o, t_r, "reference", 0, bytes_fb, note=note)

    # every RMSNorm of the residual stream: bf16 activations, bf16 gain (model.to_dtype)
    x = torch.randn(N, D, device="cuda", dtype=dt).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, device="cuda")).to(dt).requires_grad_()
    dy = torch.randn(N, D, device="cuda", dtype=dt)
    bench(
        "RMSNorm [fla]",
        f"N{N} D{D} bf16",
        lambda: rms_norm_fla(x, w, eps),
        lambda: rms_norm(x, w, eps),
        [x, w],
        dy,
        N * D * 2 * 2,
        N * D * 2 * 5,
    )
    x = w = dy = None
    free()
    # KDA output norm: o and gate bf16 [B, T, H, K], o_norm.weight fp32 [K]
    o = torch.randn(B, T, H, K, device="cuda", dtype=dt).requires_grad_()
    g = torch.randn(B, T, H, K, device="cuda", dtype=dt).requires_grad_()
    w = (1 + 0.1 * torch.randn(K, device="cuda")).requires_grad_()
    dy = torch.randn(B, T, H, K, device="cuda", dtype=dt)
    bench(
        "KDA gated RMSNorm [fla]",
        f"B{B} T{T} H{H} K{K} bf16, fp32 gain",
        lambda: gated_rms_norm_fla(o, w, g, eps),
        lambda: gated_rms_norm(o, w, g, eps),
        [o, g, w],
        dy,
        N * C * 2 * 3,
        N * C * 2 * 8,
    )
    o = g = w = dy = None
    free()
    # KDA short conv + SiLU on one of q/k/v: bf16 activations [B, T, H*K], fp32 weight [H*K, 1, W]
    x = torch.randn(B, T, C, device="cuda", dtype=dt).requires_grad_()
    w = (torch.randn(C, 1, W, device="cuda") * W**-0.5).requires_grad_()
    dy = torch.randn(B, T, C, device="cuda", dtype=dt)
    bench(
        "KDA short conv+SiLU [fla]",
        f"B{B} T{T} C{C} W{W} bf16, fp32 weight",
        lambda: causal_conv1d_fla(x, w)[0],
        lambda: causal_conv1d(x, w)[0],
        [x, w],
        dy,
        N * C * 2 * 2,
        N * C * 2 * 5,
    )
    x = w = dy = None
    free()
    # SiTU-GLU of the shared experts / dense FFN: gate and up bf16 [N, I] (the "glu" op), medium shared-expert width
    from openk3.config import K3Config
    from openk3.fast.moe import glu_act_triton
    from openk3.ops.activations import glu_act

    Ig = K3Config.from_preset("medium").moe_intermediate_size * max(
        1, K3Config.from_preset("medium").num_shared_experts
    )
    gg = torch.randn(N, Ig, device="cuda", dtype=dt).requires_grad_()
    uu = (torch.randn(N, Ig, device="cuda", dtype=dt) * 10).requires_grad_()
    dy = torch.randn(N, Ig, device="cuda", dtype=dt)
    bench(
        "SiTU-GLU [triton]",
        f"N{N} I{Ig} bf16",
        lambda: glu_act_triton(gg, uu, "situ"),
        lambda: glu_act(gg, uu, "situ"),
        [gg, uu],
        dy,
        N * Ig * 2 * 3,
        N * Ig * 2 * 7,
    )
    gg = uu = dy = None
    free()


def _medium_model(ckpt: bool, attn_res: bool = True, layers: int | None = None):
    from openk3 import K3Config, K3ForCausalLM

    kw = {} if layers is None else {"num_hidden_layers": layers}
    cfg = K3Config.from_preset("medium", **kw)
    if not attn_res:  # the same model with a plain residual stream
        cfg = K3Config.from_preset("medium", attn_res_block_size=None, **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.02)
    model.to_dtype(torch.bfloat16)
    model.model.gradient_checkpointing = ckpt
    model.train()
    return cfg, model


def _paired_steps(B: int, T: int, half: bool = False):
    """(config, {"attnres": step, "plain": step}): training steps (zero_grad, forward, backward) of the medium
    model with AttnRes and of the same model with a plain residual stream, built in this process on one batch.
    ``half``: also "plain_half", the plain model with half the layers (what the step spends outside the layers)."""
    models = {name: _medium_model(False, attn_res=ar) for name, ar in (("attnres", True), ("plain", False))}
    if half:
        L = models["plain"][0].num_hidden_layers
        models["plain_half"] = _medium_model(False, attn_res=False, layers=L // 2)
    cfg = models["attnres"][0]
    ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    tg = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")

    def stepper(model):
        def step():
            model.zero_grad(set_to_none=True)
            model(ids, targets=tg, return_logits=False).loss.backward()

        return step

    return cfg, {name: stepper(m) for name, (_, m) in models.items()}


def _model_ab(rounds: int) -> None:
    """AttnRes's share of the medium step, paired: the AttnRes model and the same model with a plain residual
    stream, both built in this process and timed alternately for ``rounds`` rounds (3 timed steps each), so that
    drift of the machine falls on both. Reports the median step of each and the per-round shares."""
    from openk3.cost import train_flops_per_token

    B, T = 4, 4096
    cfg, steps = _paired_steps(B, T)
    for st in steps.values():  # compile / warm up both before any timing
        timeit(st, warmup=2, rep=1)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, st in steps.items():
            times[name].append(timeit(st, warmup=1, rep=3))
    shares = sorted((a - p) / a for a, p in zip(times["attnres"], times["plain"]))
    med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    share = (med["attnres"] - med["plain"]) / med["attnres"]
    fl = train_flops_per_token(cfg, T) * B * T
    note = (
        f"AttnRes share of its step {share * 100:.2f}% (per round {shares[0] * 100:.2f}..{shares[-1] * 100:.2f}%, "
        f"{rounds} rounds, paired); target < 3%"
    )
    print("    " + note)
    INFO["attnres_ab"] = {"times_s": times, "share": share, "round_shares": shares}
    row("model", "medium step, AttnRes vs plain residual (paired)", f"B{B} T{T} bf16", med["attnres"],
        med["plain"], "plain residual", fl, 0, note=note, mfu=fl / med["attnres"] / CEIL["mm"])  # fmt: skip
    steps = None
    free()


def _kernel_times(step) -> dict:
    """GPU time (us) per kernel name of one profiled call of ``step`` (CUPTI: the kernels' own durations, so the
    host-bound gaps that make wall-clock steps of the same model differ by 5-10 % do not enter)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return {
        e.key: e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    }


def _model_kernel_ab(rounds: int) -> None:
    """AttnRes's overhead over a plain residual in GPU kernel time: the AttnRes model and the same model with a plain
    residual stream (both in this process, same inputs), one profiled step of each per round, alternating. Per round
    the overhead is (kernel time with AttnRes - kernel time plain) / kernel time with AttnRes, i.e. the issue's
    "AttnRes read overhead vs a plain residual" as a share of the AttnRes step; also the reader's own kernels and the
    kernels whose time differs most between the two models (what the difference is made of)."""
    B, T = 4, 4096
    half = os.environ.get("BENCH_MODEL_LAYER_SHARE", "1") == "1"
    cfg, steps = _paired_steps(B, T, half=half)
    for st in steps.values():  # compile / autotune both before any measurement
        timeit(st, warmup=2, rep=1)
    kt = {name: [] for name in steps}
    for _ in range(rounds):
        for name, st in steps.items():
            kt[name].append(_kernel_times(st))
    tot = {name: [sum(d.values()) for d in v] for name, v in kt.items()}
    shares = sorted((a - p) / a for a, p in zip(tot["attnres"], tot["plain"]))
    share = shares[len(shares) // 2]
    reader = sorted(sum(v for k, v in d.items() if k.startswith(("_p1_", "_p2_"))) for d in kt["attnres"])
    med = {name: sorted(v)[len(v) // 2] for name, v in tot.items()}
    keys = set().union(*kt["attnres"], *kt["plain"])
    diff = {
        k: sorted(a.get(k, 0.0) - p.get(k, 0.0) for a, p in zip(kt["attnres"], kt["plain"]))[rounds // 2]
        for k in keys
    }
    top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]
    note = (
        f"AttnRes overhead over plain residual {share * 100:.2f}% of its step's kernel time (per round "
        f"{shares[0] * 100:.2f}..{shares[-1] * 100:.2f}%, {rounds} rounds; kernel time {med['attnres'] / 1e3:.1f} vs "
        f"{med['plain'] / 1e3:.1f} ms; reader kernels {reader[len(reader) // 2] / 1e3:.2f} ms); target < 3%"
    )
    layer_share = None
    if half:  # the denominator is a layer's time: take off what the step spends outside the layers
        # plain kernel time = outside + L * layer; with L/2 layers = outside + L/2 * layer (L even)
        outside = [2 * h - p for h, p in zip(tot["plain_half"], tot["plain"])]
        layer_shares = sorted((a - p) / (a - o) for a, p, o in zip(tot["attnres"], tot["plain"], outside))
        layer_share = layer_shares[len(layer_shares) // 2]
        note += (
            f"; of the decoder layers' kernel time alone {layer_share * 100:.2f}% (per round "
            f"{layer_shares[0] * 100:.2f}..{layer_shares[-1] * 100:.2f}%; outside the layers "
            f"{sorted(outside)[len(outside) // 2] / 1e3:.1f} ms, from a plain model with half the layers)"
        )
    print("    " + note)
    print("    largest per-kernel differences (AttnRes - plain, median over rounds, ms):")
    for k, v in top:
        print(f"      {v / 1e3:+8.3f}  {k[:90]}")
    INFO["attnres_kernel_ab"] = {
        "kernel_ms": {n: [t / 1e3 for t in v] for n, v in tot.items()},
        "share": share,
        "round_shares": shares,
        "layer_share": layer_share,
        "reader_ms": [r / 1e3 for r in reader],
        "top_diffs_ms": {k: v / 1e3 for k, v in top},
    }
    row("model", "medium step kernel time, AttnRes vs plain residual (paired)", f"B{B} T{T} bf16",
        med["attnres"] / 1e6, med["plain"] / 1e6, "plain residual", 0, 0, note=note)  # fmt: skip
    steps = None
    free()


def sec_model(out_dir):
    import openk3.fast  # noqa: F401
    from openk3.cost import train_flops_per_token
    from openk3.ops import backend

    INFO["backends"] = {op: backend.resolve(op, True) for op in backend.OPS}
    from openk3.fast import attnres as fast_attnres

    ab_rounds = int(os.environ.get("BENCH_MODEL_AB", "0"))
    if ab_rounds:  # only the paired AttnRes / plain comparison
        _model_ab(ab_rounds)
        return
    kernel_rounds = int(os.environ.get("BENCH_MODEL_KERNEL_AB", "0"))
    if kernel_rounds:  # only the paired comparison in kernel time
        _model_kernel_ab(kernel_rounds)
        return
    dm0 = fast_attnres.DIRECT_MAX
    configs = [(4, 4096, False, True, dm0), (8, 4096, True, True, dm0)]
    if os.environ.get("BENCH_MODEL_CKPT", "1") == "0":  # skip the gradient-checkpointing row
        configs = configs[:1]
    if (
        os.environ.get("BENCH_MODEL_PLAIN", "1") == "1"
    ):  # the same step with a plain residual: AttnRes's share
        configs.append((4, 4096, False, False, dm0))
    # BENCH_MODEL_DIRECT="0,4": the AttnRes step again with other DIRECT_MAX values (sets that keep no partials)
    for dm in filter(None, os.environ.get("BENCH_MODEL_DIRECT", "").split(",")):
        configs.append((4, 4096, False, True, int(dm)))
    steps = {}
    for B, T, ckpt, attn_res, dm in configs:
        fast_attnres.DIRECT_MAX = dm
        cfg, model = _medium_model(ckpt, attn_res)
        ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
        tg = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")

        def step():
            model.zero_grad(set_to_none=True)
            model(ids, targets=tg, return_logits=False).loss.backward()

        try:
            torch.cuda.reset_peak_memory_stats()
            t = timeit(step, warmup=2, rep=5)
        except torch.OutOfMemoryError as e:
            print("    medium step OOM:", str(e)[:200])
            model = None
            free()
            continue
        finally:
            fast_attnres.DIRECT_MAX = dm0
        fl = train_flops_per_token(cfg, T) * B * T
        mfu = fl / t / CEIL["mm"]
        mem = torch.cuda.max_memory_allocated() / 2**30
        variant = dm != dm0
        if not variant:
            steps[(B, T, ckpt, attn_res)] = t
        note = f"{B * T / t:,.0f} tok/s MFU {mfu * 100:.1f}% peak {mem:.0f} GiB"
        base = steps.get((B, T, ckpt, True))
        if not attn_res and base:
            note += f"; AttnRes costs {(base - t) / base * 100:.1f}% of the AttnRes step"
        name = f"medium train step (fwd+bwd){' ckpt' if ckpt else ''}{'' if attn_res else ' plain residual'}"
        if variant:
            name += f" AttnRes DIRECT_MAX={dm}"
            plain = steps.get((B, T, ckpt, False))
            if plain:
                note += f"; AttnRes {(t - plain) / plain * 100:.1f}% over plain"
        row(
            "model",
            name,
            f"B{B} T{T} bf16",
            t,
            base if (not attn_res or variant) else None,
            f"AttnRes DIRECT_MAX={dm0}" if variant else ("with AttnRes" if not attn_res else ""),
            fl,
            0,
            note=note,
            mfu=mfu,
            tokens_per_s=B * T / t,
        )
        walk = INFO.get("attnres_walk_ms", {}).get("medium", {})
        if attn_res and not ckpt and not variant and "ours" in walk:
            share = (walk["ours"][1] - walk.get("plain", [0, 0])[1]) / (t * 1e3)
            print(f"    AttnRes walk (fwd+bwd, over plain) = {share * 100:.1f}% of this step (target < 3%)")
            INFO["attnres_share_of_step"] = share
        if attn_res and not ckpt and not variant:
            _profile(step, out_dir)
            per_layer = t / cfg.num_hidden_layers
            INFO["medium_layer_fwd_bwd_ms"] = per_layer * 1e3
        model = ids = tg = None
        free()


def _profile(step, out_dir):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    # AttnRes's own kernels (the two-phase reader's Triton kernels) in this step's GPU time
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in evs)
    ar = sum(e.self_device_time_total for e in evs if e.key.startswith(("_p1_", "_p2_")))
    if total and ar:
        msg = f"AttnRes reader kernels {ar / 1e3:.2f} ms of {total / 1e3:.2f} ms GPU time ({ar / total * 100:.2f}%)"
        print("    " + msg)
        INFO["attnres_kernel_share"] = {"attnres_ms": ar / 1e3, "total_ms": total / 1e3, "share": ar / total}
    with open(os.path.join(out_dir, "profile.txt"), "w") as f:
        f.write(table)
    print("\n".join(table.splitlines()[:19]))


def sec_decode():
    from openk3.cost import Hardware, predict_decode_time

    hw = Hardware("h200-run", CEIL["mm"], CEIL["bw"], 141e9, 450e9)
    cfg, model = _medium_model(False)
    model.eval()
    ctx = 1024
    for b in (1, 16, 64):
        ids = torch.randint(0, cfg.vocab_size, (b, ctx), device="cuda")
        with torch.inference_mode():
            cache = model.new_cache()
            out = model(ids, cache=cache, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(3):
                model(nxt, cache=cache, logits_to_keep=1)
            torch.cuda.synchronize()
            steps = 10
            t0 = time.perf_counter()
            for _ in range(steps):
                model(nxt, cache=cache, logits_to_keep=1)
            torch.cuda.synchronize()
            t = (time.perf_counter() - t0) / steps
        pred = predict_decode_time(cfg, b, ctx + 3 + steps // 2, hw)
        row(
            "decode",
            "medium decode step (contiguous cache)",
            f"batch {b} ctx {ctx} bf16",
            t,
            pred,
            "cost-model roofline",
            note=f"measured/predicted {t / pred:.1f}x",
        )
        cache = out = None
        free()
    model = None
    free()


SECTIONS = {
    "ceil": sec_ceil,
    "kda": sec_kda,
    "mla": sec_mla,
    "moe": sec_moe,
    "attnres": sec_attnres,
    "norm": sec_norm,
    "model": None,
    "decode": sec_decode,
}


def print_table():
    print("\n" + "=" * 150)
    hdr = (
        f"{'section':8s} {'benchmark':46s} {'shape':36s} {'ours ms':>9s} {'peer ms':>9s} {'ratio':>6s} "
        f"{'floor ms':>9s} {'TFLOP/s':>8s}  note"
    )
    print(hdr)
    for r in ROWS:
        print(
            f"{r['section']:8s} {r['name'][:46]:46s} {r['shape'][:36]:36s} {fmt(r['ours_ms']):>9s} "
            f"{fmt(r['peer_ms']):>9s} {fmt(r['ratio'], 2):>6s} {fmt(r['floor_ms']):>9s} "
            f"{fmt(r['tflops'], 1):>8s}  {r['peer']}{' | ' if r['peer'] and r['note'] else ''}{r['note']}"
        )
    print(
        f"ceilings: matmul {CEIL['mm'] / 1e12:.0f} TFLOP/s, copy {CEIL['bw'] / 1e12:.2f} TB/s "
        f"({'measured this run' if CEIL['measured'] else 'defaults'}); device {INFO.get('device')}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "out"))
    ap.add_argument("--sections", default="ceil,kda,mla,moe,attnres,norm,model,decode")
    ap.add_argument("--tests", action="store_true", help="run tests/gpu first in this process")
    ap.add_argument("--test-paths", default="tests/gpu", help="pytest paths / node ids, run in this order")
    ap.add_argument("--test-args", default="", help="extra pytest arguments, space separated")
    ap.add_argument("--budget-s", type=float, default=540.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    INFO.update(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    try:
        import triton

        INFO["triton"] = triton.__version__
    except Exception:
        pass
    import openk3.fast  # noqa: F401

    if args.tests:
        import pytest

        os.environ["OPENK3_ERRLOG"] = os.path.join(args.out, "errors.json")
        t0 = time.time()
        rc = pytest.main(
            [
                "-q",
                "-rf",
                "-p",
                "no:cacheprovider",
                *[os.path.join(ROOT, t) for t in args.test_paths.split()],
                *shlex.split(args.test_args),
            ]
        )
        INFO["tests"] = {"exit": int(rc), "seconds": time.time() - t0}
        print(f"tests/gpu exit {int(rc)} in {time.time() - t0:.0f} s", flush=True)
    SECTIONS["model"] = lambda: sec_model(args.out)
    for name in [s for s in args.sections.split(",") if s]:
        if time.time() - t_start > args.budget_s:
            print(f"[skip {name}: budget]")
            INFO.setdefault("skipped", []).append(name)
            continue
        print(f"[{name}] t={time.time() - t_start:.0f}s", flush=True)
        t0 = time.time()
        try:
            SECTIONS[name]()
        except Exception as e:
            traceback.print_exc()
            INFO.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            free()
        INFO.setdefault("section_s", {})[name] = time.time() - t0
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"ceilings": CEIL, "info": INFO, "rows": ROWS}, f, indent=1, default=str)
    print_table()
    if INFO.get("errors"):
        print("errors:", json.dumps(INFO["errors"], indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
