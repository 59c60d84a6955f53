"""Diagnostic: where the time of a model's AttnRes walk goes (every sealed set with its reads, fwd+bwd from cleared
gradients), for the Triton reader, optionally another reader implementation loaded from a file (to compare
versions), and a plain residual. Prints a timing table and the CUDA kernel table of the Triton reader's walk.

    python bench/diag_attnres.py [--other path/to/attnres.py] [--N 16384 --D 2048 --blocks 4 --Q 8]
                                 [--direct-max 0,1,2,3,4] [--sweep]

``--direct-max`` times the walk once per value of ``openk3.fast.attnres.DIRECT_MAX`` (sealed sets of up to that
many sources keep no partials): synchronised and back to back, plus the summed CUDA kernel time of one walk.
"""

import argparse
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def load_module(path):
    """Another version of ``openk3/fast/attnres.py``, loaded from a file (to time two versions in one process)."""
    spec = importlib.util.spec_from_file_location("attnres_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load(path):
    return load_module(path).TritonAttnResReader


SWEEP = {
    "p1_bwd_dv": [(16, 128, 4), (32, 64, 4), (16, 64, 4), (32, 128, 8), (16, 256, 8)],
    "p2_fwd_direct": [(1, 2048, 4), (2, 1024, 4), (4, 512, 4), (2, 2048, 8), (8, 256, 4)],
    "p2_bwd_direct": [(1, 2048, 8), (2, 2048, 8), (1, 2048, 16), (4, 2048, 16), (2, 1024, 4), (4, 512, 4)],
    "p2_fwd": [(1, 2048, 4), (2, 1024, 4), (4, 512, 4)],
    "p2_bwd": [(2, 2048, 8), (1, 2048, 8), (4, 512, 4)],
    "p1_scores": [(16, 128, 4), (32, 64, 4), (16, 64, 4)],
    "p1_bwd_coef": [(8, 256, 4), (16, 128, 4)],
}


def kernel_ms(walk, make, clear, reps=3):
    """Summed CUDA kernel time of one walk (fwd+bwd), from the profiler: the GPU work alone, without the host
    launch latency that a synchronised wall-clock time of this launch-heavy walk also counts."""
    from torch.profiler import ProfilerActivity, profile

    walk(make)
    clear()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            walk(make)
            clear()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / reps


def sweep(walk, make, clear):
    """Walk kernel time for each candidate (tokens, columns, warps) of one kernel at a time (the others at their
    defaults), then with every kernel at its best; leaves the best in openk3.fast.attnres.TILES."""
    from openk3.fast import attnres

    default = dict(attnres.TILES)
    best = {}
    for name, cands in SWEEP.items():
        times = {}
        for cfg in cands:
            attnres.TILES.update(default)
            attnres.TILES[name] = cfg
            try:
                times[cfg] = kernel_ms(walk, make, clear)
            except Exception as e:  # a tile the compiler refuses (resources) is skipped
                print(f"  {name} {cfg}: {type(e).__name__} {str(e)[:120]}")
        best[name] = min(times, key=times.get)
        print(f"  {name}: " + "  ".join(f"{'x'.join(map(str, c))} {t:.3f}" for c, t in times.items()))
    attnres.TILES.update(best)
    t = kernel_ms(walk, make, clear)
    print(
        "  best: "
        + ",".join(f"{k}={'x'.join(map(str, v))}" for k, v in best.items())
        + f"  kernels {t:.3f} ms"
    )


def main():
    from openk3.fast import attnres
    from openk3.fast.attnres import TritonAttnResReader
    from run_all import timeit, timeit_pipelined

    ap = argparse.ArgumentParser()
    ap.add_argument("--other", default=None, help="a file defining another TritonAttnResReader")
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--D", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--Q", type=int, default=8)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="kernel time per launch tile of each kernel, then all best together",
    )
    ap.add_argument("--direct-max", default="", help="comma-separated DIRECT_MAX values to compare")
    a = ap.parse_args()
    N, D, nb, Q = a.N, a.D, a.blocks, a.Q
    dt = torch.bfloat16
    torch.manual_seed(0)
    mk = lambda: torch.randn(N, D, device="cuda", dtype=dt).requires_grad_()  # noqa: E731
    srcs = [mk() for _ in range(nb)]
    lives = [mk() for _ in range(nb * Q)]
    qs = [(torch.randn(1, D, device="cuda") * 0.05).requires_grad_() for _ in range(nb * Q)]
    nws = [torch.ones(D, device="cuda").requires_grad_() for _ in range(nb * Q)]
    douts = [torch.randn(N, D, device="cuda", dtype=dt) for _ in range(nb * Q)]
    leaves = [*srcs, *lives, *qs, *nws]

    def clear():
        for t in leaves:
            t.grad = None

    def walk(make, grad=True):
        rd = make() if make else None
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

    makers = {"triton": lambda: TritonAttnResReader(1e-5, max_sources=nb), "plain": None}
    if a.other:
        other = _load(a.other)
        makers["other"] = lambda: other(1e-5)
    if a.sweep:
        sweep(walk, makers["triton"], clear)
    res = {}
    for name, make in makers.items():
        with torch.no_grad():
            tf = timeit(lambda make=make: walk(make, grad=False), rep=5)
        tb = timeit(lambda make=make: walk(make), rep=5, setup=clear)
        res[name] = (tf * 1e3, tb * 1e3)
    # bytes one walk must move at least (bf16 sources, fp32 partials): see bench/NOTES.md
    print(f"AttnRes walk N{N} D{D} {nb} sealed sets x Q{Q} sites, bf16")
    print(f"{'reader':10s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'over plain':>11s}")
    for name, (tf, tb) in res.items():
        print(f"{name:10s} {tf:9.3f} {tb:11.3f} {tb - res['plain'][1]:11.3f}")
    from torch.profiler import ProfilerActivity, profile

    if a.direct_max:
        default = attnres.DIRECT_MAX
        print(f"\nDIRECT_MAX (sets of <= that many sources keep no partials; default {default})")
        print(
            f"{'direct_max':>10s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'b2b fwd+bwd':>12s} {'kernels ms':>11s}"
        )
        for dm in (int(x) for x in a.direct_max.split(",")):
            attnres.DIRECT_MAX = dm
            mk_ = makers["triton"]
            with torch.no_grad():
                tf = timeit(lambda: walk(mk_, grad=False), rep=5)  # noqa: B023 (called right here)
            tb = timeit(lambda: walk(mk_), rep=5, setup=clear)  # noqa: B023
            tp = timeit_pipelined(lambda: walk(mk_), rep=5, setup=clear)  # noqa: B023
            kt = kernel_ms(walk, mk_, clear)
            print(f"{dm:10d} {tf * 1e3:9.3f} {tb * 1e3:11.3f} {tp * 1e3:12.3f} {kt:11.3f}")
        attnres.DIRECT_MAX = default
    walk(makers["triton"])
    clear()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        walk(makers["triton"])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
