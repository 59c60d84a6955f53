"""Diagnostic: AttnRes phase 1 (the scoring at seal time) in decode steps, i.e. a few tokens, with the few-token
tile (``openk3.fast.attnres.FEW_TOKENS``) and with the training tile, from the profiler's kernel times.

    python3 bench/diag_attnres_decode.py [--tokens 1,4,16] [--sources 1,2,3,4] [--Q 8] [--D 2048]
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def scores_us(reader_cls, srcs, sites, reps=20) -> float:
    """Mean CUDA time of one ``_p1_scores`` launch over ``reps`` seals of the last source (after the others)."""
    from torch.profiler import ProfilerActivity, profile

    def run():
        rd = reader_cls(1e-5, max_sources=len(srcs))
        for s in srcs[:-1]:
            rd.seal(s, sites)
        return rd

    rd = run()
    rd.seal(srcs[-1], sites)  # compile outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run().seal(srcs[-1], sites)
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.key == "_p1_scores"]
    calls = sum(e.count for e in ev)
    return sum(e.self_device_time_total for e in ev) / max(1, calls)


def main():
    from openk3.fast import attnres

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--sources", default="1,2,3,4")
    ap.add_argument("--Q", type=int, default=8)
    ap.add_argument("--D", type=int, default=2048)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    few = attnres.FEW_TOKENS
    print(f"{'tokens':>6} {'sources':>7} {'few-token tile us':>18} {'training tile us':>17}")
    with torch.no_grad():  # (the engine's parameters are ordinary tensors, not inference tensors)
        for n in (int(t) for t in a.tokens.split(",")):
            for S in (int(s) for s in a.sources.split(",")):
                srcs = [
                    torch.randn(n, a.D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(S)
                ]
                sites = [
                    (
                        j,
                        0.05 * torch.randn(1, a.D, device="cuda", generator=g),
                        torch.ones(a.D, device="cuda"),
                    )
                    for j in range(a.Q)
                ]
                attnres.FEW_TOKENS = few
                t_few = scores_us(attnres.TritonAttnResReader, srcs, sites)
                attnres.FEW_TOKENS = 0
                t_old = scores_us(attnres.TritonAttnResReader, srcs, sites)
                attnres.FEW_TOKENS = few
                print(f"{n:>6} {S:>7} {t_few:>18.2f} {t_old:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
