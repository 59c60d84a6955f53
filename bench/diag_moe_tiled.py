"""Diagnostic: the routed experts of a decode batch -- the expert-tiled kernels (openk3.fast.moe_tiled) against the
permuted grouped GEMMs (torch._grouped_mm) and the per-pair kernels (openk3.fast.moe_small), beside the HBM roofline.

    python3 bench/diag_moe_tiled.py [--shapes 48b,medium,k3] [--tokens 16,32,64,128,256] [--sweep] [--bms 16,32,64]
        [--out FILE]
    TRITON_INTERPRET=1 python3 bench/diag_moe_tiled.py --device cpu --shapes tiny --tokens 5,20  # a smoke run

Per expert shape and token count: random routing (every token's k experts distinct, uniform over the experts held),
bf16 weights and activations, each path timed by CUDA-graph replay (10 calls per graph, median of 5 replays), checked
against ``openk3.ops.moe.experts_reference``. Bytes: the distinct experts' weights (3 x I x W each) plus the
activations in and out; roofline: those bytes at the device copy rate measured in the same run. ``--sweep`` also
times the tiled kernels' launch tiles at the 48B shape and 64 tokens; ``--bms`` times fixed row steps (``BM``,
``moe_tiled.rows_per_step`` picks one by default) beside the default. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

# (name, experts held, k, W, I): the 48B shape (all 256 experts), medium (all 64), K3's expert widths with 256 of its
# 896 experts held (the routing then gives each ~3.5x K3's pairs per expert)
SHAPES = {
    "tiny": (8, 2, 64, 32),  # (CPU smoke runs)
    "48b": (256, 8, 2304, 1024),
    "medium": (64, 8, 1024, 640),
    "k3": (256, 16, 3584, 3072),
}
# (bi, bk, stages, bo, bk_down) of moe_tiled.TILED tried with --sweep
SWEEP = [
    (64, 128, 3, 64, 128),
    (64, 64, 4, 64, 64),
    (64, 128, 4, 64, 128),
    (32, 128, 3, 32, 128),
    (64, 256, 2, 128, 128),
]


DEV = "cuda"


def copy_tbs() -> float:
    """Device copy bandwidth (read + written bytes), TB/s (bench/run_all.py's measurement); 0 on the CPU."""
    if DEV != "cuda":
        return 0.0
    from run_all import copy_rate

    return copy_rate()[0] / 1e12


def time_graph(fn, calls: int = 10) -> float:
    """us per call: ``calls`` calls in one CUDA graph (bench/diag_mla.py's ``graph_us``, median of 5 replays); on
    the CPU, the wall time of one eager call."""
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from diag_mla import graph_us

    return graph_us([fn] * calls)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def measure(fn, ops, ref) -> tuple[float, float]:
    """(us per call, relative error against ``ref``) of ``fn(*ops)``."""
    err = rel(fn(*ops), ref)
    return time_graph(lambda: fn(*ops)), err


def measure_with(settings: dict, fn, ops, ref) -> tuple[float, float]:
    """:func:`measure` of ``fn`` without autograd, ``moe_tiled.TILED`` updated by ``settings`` meanwhile."""
    from openk3.fast import moe_tiled

    base = dict(moe_tiled.TILED)
    moe_tiled.TILED.update(settings)
    try:
        with torch.no_grad():
            return measure(fn, ops, ref)
    finally:
        moe_tiled.TILED.clear()
        moe_tiled.TILED.update(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="48b,medium,k3")
    ap.add_argument("--tokens", default="16,32,64,128,256")
    ap.add_argument(
        "--per-pair-max", type=int, default=32, help="time the per-pair kernels up to this many tokens"
    )
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--bms",
        default="",
        help="also time the tiled kernels with these fixed row steps (e.g. 16,32,64; 64w8 = 8 warps) where the "
        "routing gives at least --bm-from pairs per expert",
    )
    ap.add_argument("--bm-from", type=float, default=4.0)
    ap.add_argument(
        "--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (fp16, no timing)"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "diag_moe_tiled.json"))
    a = ap.parse_args()
    import openk3.fast  # noqa: F401
    from openk3.fast import moe_small, moe_tiled
    from openk3.fast.moe import experts_grouped
    from openk3.ops.moe import experts_reference

    global DEV
    DEV = a.device
    torch.manual_seed(0)
    bw = copy_tbs()
    name_dev = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"{name_dev}: copy {bw:.2f} TB/s")
    rows = []
    bf = torch.bfloat16 if DEV == "cuda" else torch.float16  # (the interpreter's bf16 products are wrong)
    for name in a.shapes.split(","):
        E, K, W, I = SHAPES[name]
        w13 = torch.randn(E, 2 * I, W, device=DEV, dtype=bf) * W**-0.5
        w1, w3 = w13[:, :I], w13[:, I:]
        w2 = torch.randn(E, W, I, device=DEV, dtype=bf) * I**-0.5
        for N in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(N, W, device=DEV, dtype=bf)
            idx = torch.stack([torch.randperm(E, device=DEV)[:K] for _ in range(N)])
            wt = torch.rand(N, K, device=DEV)
            ne = int(idx.unique().numel())
            nbytes = ne * 3 * I * W * 2 + 2 * N * W * 2
            roof = nbytes / (bw * 1e12) * 1e6 if bw else float("nan")
            ops = (x, idx, wt, w1, w2, w3)
            with torch.no_grad():
                ref = experts_reference(*ops)
            res = {
                "tiled": measure_with({}, moe_tiled.experts_tiled, ops, ref),
                "grouped": measure_with(dict(max_pairs_per_expert=0), experts_grouped, ops, ref),
            }
            if N <= a.per_pair_max:
                res["per_pair"] = measure_with({}, moe_small.experts_small, ops, ref)
            row = dict(shape=name, E=E, K=K, W=W, I=I, N=N, pairs_per_expert=N * K / E, experts_touched=ne,
                       MB=nbytes / 1e6, roofline_us=roof,
                       **{f"{k}_us": v[0] for k, v in res.items()}, **{f"{k}_err": v[1] for k, v in res.items()})  # fmt: skip
            rows.append(row)
            cells = " | ".join(
                f"{k} {v[0]:.1f} ({nbytes / v[0] / 1e6:.2f} TB/s, err {v[1]:.1e})" for k, v in res.items()
            )
            print(
                f"| {name} N{N} ({N * K / E:.2f} pairs/expert, {nbytes / 1e6:.0f} MB) | roof {roof:.1f} | {cells} |"
            )
            if a.bms and N * K / E >= a.bm_from:
                for spec in a.bms.split(","):
                    bm, _, nw = spec.partition("w")
                    settings = dict(bm=int(bm), num_warps=int(nw or moe_tiled.TILED["num_warps"]))
                    t, e = measure_with(settings, moe_tiled.experts_tiled, ops, ref)
                    print(
                        f"|   rows per step {spec} | {t:.1f} us ({nbytes / t / 1e6:.2f} TB/s), err {e:.1e} |"
                    )
                    rows.append(dict(shape=name, N=N, bm=spec, us=t, err=e))
            if a.sweep and name == "48b" and N == 64:
                for bi, bk, st, bo, bkd in SWEEP:
                    settings = dict(bi=bi, bk=bk, stages=st, bo=bo, bk_down=bkd)
                    t, e = measure_with(settings, moe_tiled.experts_tiled, ops, ref)
                    print(
                        f"|   tiles bi{bi} bk{bk} st{st} bo{bo} bkd{bkd} | {t:.1f} us ({nbytes / t / 1e6:.2f} TB/s), err {e:.1e} |"
                    )
                    rows.append(dict(sweep=(bi, bk, st, bo, bkd), us=t, err=e))
        w13 = w1 = w2 = w3 = ops = None
        if DEV == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(device=name_dev, copy_TBs=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
