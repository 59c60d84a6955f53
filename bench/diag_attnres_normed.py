"""Diagnostic: the fused AttnRes read + RMSNorm (``read_normed`` with gradients) at training shapes, kernel time of
phase 2's forward and backward per read, for launch variants of the current reader and optionally another reader
implementation loaded from a file (to compare versions in one process). Stored partials (a set of more than
``DIRECT_MAX`` sources) and direct mode (fewer sources) are timed separately.

    python bench/diag_attnres_normed.py [--N 16384 --D 2048 --Q 4] [--other path/to/attnres.py]
                                        [--maxnreg "default;0"] [--direct-max 2] [--dot tf32x3]
                                        [--rows 64] [--dv fma:2,ieee:1] [--set "p2_bwd_norm=1x2048x8@p2_bwd_norm=0"]
                                        [--out diag.json]

``--maxnreg``: semicolon-separated register caps for the normed backward (0: the compiler's choice; default: the
reader's MAXNREG table), each timed as one variant of the current reader. ``--direct-max``: DIRECT_MAX values (sets
of at most that many sources keep no partials), ``--dot``: the source-gradient kernel's dot precisions (ieee,
tf32x3, fma), ``--dv``: DOT:STAGES pairs (dot precision, site-loop stages of the source-gradient kernel; 0 unrolls
it), ``--rows``: tokens per program of the one-pass normed backward; each value one variant. Column ``all``:
every kernel of the walk (phase 1, its backward and the glue included) per read; ``p1_dv``: the source-gradient
kernel of the walk's one sealed set. ``--set TILES[@MAXNREG]`` (repeatable): one variant with those launch tiles and
register caps on top of the defaults.
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def kernel_times(run, reps):
    """{kernel name: ms per run} from the profiler (GPU time only)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    return {
        e.key: e.self_device_time_total / 1e3 / reps for e in prof.key_averages() if e.self_device_time_total
    }


def main():
    from diag_attnres import load_module
    from openk3.fast import attnres
    from openk3.modules.norm import RMSNorm
    from run_all import copy_rate

    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--D", type=int, default=2048)
    ap.add_argument("--Q", type=int, default=4, help="read sites per sealed set")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--other", default=None, help="a file defining another TritonAttnResReader")
    ap.add_argument("--maxnreg", default="default;0")
    ap.add_argument(
        "--direct-max", default="", help="comma-separated DIRECT_MAX values, each timed once (current reader)"
    )
    ap.add_argument(
        "--dot", default="", help="comma-separated source-gradient dot precisions (ieee, tf32x3, fma)"
    )
    ap.add_argument(
        "--dv",
        default="",
        help="comma-separated DOT:STAGES of the source-gradient kernel (its W-term and its site loop, 0: unrolled)",
    )
    ap.add_argument(
        "--rows", default="", help="comma-separated tokens per program of the one-pass normed backward"
    )
    ap.add_argument(
        "--set",
        action="append",
        help="one variant: TILES[@MAXNREG] in the OPENK3_ATTNRES_TILES / _MAXNREG formats (repeatable)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    N, D, Q = a.N, a.D, a.Q
    dt = torch.bfloat16
    torch.manual_seed(0)
    mk = lambda: (torch.randn(N, D, device="cuda", dtype=dt) * 2).requires_grad_()  # noqa: E731
    srcs = [mk() for _ in range(6)]
    lives = [mk() for _ in range(Q)]
    qs = [(torch.randn(1, D, device="cuda") * 0.05).requires_grad_() for _ in range(Q)]
    nws = [(1 + 0.1 * torch.randn(D, device="cuda")).requires_grad_() for _ in range(Q)]
    norms = []
    for _ in range(Q):
        m = RMSNorm(D, eps=1e-6).cuda()
        m.backend = "reference"
        norms.append(m)
    douts = [torch.randn(N, D, device="cuda", dtype=dt) for _ in range(Q)]
    leaves = [*srcs, *lives, *qs, *nws, *[m.weight for m in norms]]

    def walk(mod, S):
        for t in leaves:
            t.grad = None
        rd = mod.TritonAttnResReader(1e-5, max_sources=8)
        rd.sealed.extend(srcs[: S - 1])
        rd.seal(srcs[S - 1], [(j, qs[j], nws[j]) for j in range(Q)])
        outs = [rd.read_normed(j, qs[j], nws[j], lives[j], norms[j]) for j in range(Q)]
        torch.autograd.backward(outs, douts)

    # (name, module, {module attribute: value} set for the variant, register cap for every MAXNREG entry or None,
    # (TILES spec, MAXNREG spec) parsed on top of the defaults or None)
    variants = []
    for cap in (x for x in a.maxnreg.split(";") if x != ""):
        variants.append((f"current, maxnreg {cap if cap != '0' else 'none'}", attnres, {}, cap, None))
    for dm in (int(x) for x in a.direct_max.split(",") if x != ""):
        variants.append((f"current, DIRECT_MAX {dm}", attnres, {"DIRECT_MAX": dm}, None, None))
    for dot in (x for x in a.dot.split(",") if x != ""):
        variants.append((f"current, dot {dot}", attnres, {"DV_DOT": dot}, None, None))
    for spec in (x for x in a.dv.split(",") if x != ""):
        dot, _, stages = spec.partition(":")
        variants.append(
            (f"current, dv {spec}", attnres, {"DV_DOT": dot, "DV_STAGES": int(stages or 0)}, None, None)
        )
    for rows in (int(x) for x in a.rows.split(",") if x != ""):
        variants.append((f"current, rows {rows}", attnres, {"P2_NORM_ROWS": rows}, None, None))
    for k, spec in enumerate(a.set or []):
        tiles, _, regs = spec.partition("@")
        variants.append((f"current, set {k}", attnres, {}, None, (tiles, regs)))
        print(f"set {k}: tiles {tiles or '-'}; maxnreg {regs or '-'}")
    if a.other:
        variants.append((f"other ({os.path.basename(a.other)})", load_module(a.other), {}, None, None))
    copy_tbs = copy_rate()[0] / 1e12
    rows = []
    print(f"read_normed N{N} D{D} Q{Q} bf16, kernel ms per read (profiler); copy {copy_tbs:.2f} TB/s")
    head = f"{'variant':34s} {'mode':6s} {'p2_fwd':>8s} {'p2_bwd':>8s} {'floor':>7s} {'TB/s':>6s} {'all':>7s}"
    print(head + f" {'p1_dv':>7s}")
    for name, mod, attrs, cap, spec in variants:
        saved = dict(getattr(mod, "MAXNREG", {}))
        saved_tiles = dict(mod.TILES)
        saved_attrs = {k: getattr(mod, k) for k in attrs}
        if spec is not None:
            mod._parse_tiles(spec[0])
            mod._parse_maxnreg(spec[1])
        if cap not in (None, "default"):
            for k in list(mod.MAXNREG):
                mod.MAXNREG[k] = int(cap)
        for k, v in attrs.items():
            setattr(mod, k, v)
        for mode, S in (("S=6", 6), ("S=3", 3), ("S=2", 2)):
            kt = kernel_times(lambda mod=mod, S=S: walk(mod, S), a.reps)
            fwd = sum(v for k, v in kt.items() if k.startswith("_p2_fwd")) / Q
            bwd = sum(v for k, v in kt.items() if k.startswith("_p2_bwd")) / Q
            dv = sum(v for k, v in kt.items() if k.startswith("_p1_bwd_dv"))  # per walk (one sealed set)
            allk = sum(kt.values()) / Q  # every kernel of the walk (phase 1 included), per read
            # bytes phase 2's normed backward moves per element at least: dy, r (bf16), the numerator's operands
            # (fp32 partials, or S bf16 sources), g and dr written (bf16)
            nbytes = N * D * (2 + 2 + (4 if S > mod.DIRECT_MAX else 2 * S) + 2 + 2)
            floor = nbytes / (copy_tbs * 1e12) * 1e3
            row = dict(variant=name, mode=mode, p2_fwd_ms=fwd, p2_bwd_ms=bwd, floor_ms=floor,
                       tbs=nbytes / (bwd / 1e3) / 1e12 if bwd else float("nan"), all_ms=allk, p1_bwd_dv_ms=dv)  # fmt: skip
            rows.append(row)
            print(
                f"{name:34s} {mode:6s} {fwd:8.3f} {bwd:8.3f} {floor:7.3f} {row['tbs']:6.2f} {allk:7.3f} {dv:7.3f}"
            )
        if hasattr(mod, "MAXNREG"):
            mod.MAXNREG.clear()
            mod.MAXNREG.update(saved)
        for k, v in saved_attrs.items():
            setattr(mod, k, v)
        mod.TILES.clear()
        mod.TILES.update(saved_tiles)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(N=N, D=D, Q=Q, copy_tbs=copy_tbs, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
