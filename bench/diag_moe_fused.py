"""Diagnostic: where the one-launch MoE decode step (``openk3.fast.moe_fused.moe_token``) spends its time, per phase,
from each program's global-timer readings, for a few launch settings (48B shape, one token, bf16, L2 flushed by a
read before each call).

    python3 bench/diag_moe_fused.py [--reps 20] [--configs default,noprefetch,...]

Per setting: the call's time (CUDA events, median) and, over the reps' medians, the phase boundaries in us since the
earliest program start: the last program through phase 1, out of the first barrier, into phase 2's loop, through
phase 2 (first and last), through phase 3 (last), and done (first and last).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

CONFIGS = {
    "default": {},
    "rb8": {"rb": 8},
    "rb32": {"rb": 32},
    "stream1": {"whole1_max_elems": 0},
    "stages4": {"stages": 4},
    "bk2_256": {"bk2": 256},
    # several programs per SM (as many as are resident: the launch lowers the count where they are not)
    "w8_ps2": {"per_sm": 2},
    "w4_ps2": {"num_warps": 4, "per_sm": 2},
    "w4_ps3": {"num_warps": 4, "per_sm": 3},
    "w4_ps4": {"num_warps": 4, "per_sm": 4},
    "w4_ps4_stream1": {"num_warps": 4, "per_sm": 4, "whole1_max_elems": 0},
    "w4_ps4_bk64": {"num_warps": 4, "per_sm": 4, "bk2": 64},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    from openk3.fast import moe_fused, moe_small

    dev, bf = "cuda", torch.bfloat16
    E, K, D, I, SH = 256, 8, 2304, 1024, 1024
    torch.manual_seed(0)
    r = torch.randn(1, D, device=dev).to(bf)
    nw = (1 + 0.1 * torch.randn(D, device=dev)).to(bf)
    wr = (torch.randn(E + 2 * SH, D, device=dev) * D**-0.5).to(bf)
    bias = torch.randn(E, device=dev) * 0.01
    w1 = (torch.randn(E, I, D, device=dev) * D**-0.5).to(bf)
    w3 = (torch.randn(E, I, D, device=dev) * D**-0.5).to(bf)
    w2 = (torch.randn(E, D, I, device=dev) * I**-0.5).to(bf)
    sw2 = (torch.randn(D, SH, device=dev) * SH**-0.5).to(bf)
    shared = moe_small.SharedExperts(wr[E : E + SH], wr[E + SH :], sw2, act="silu")
    kw = dict(top_k=K, activation="sigmoid", renormalize=True, scaling=2.5, act="silu", shared=shared)
    ctr = moe_fused.new_counter(r.device)
    flush = torch.empty(32 << 20, dtype=torch.int64, device=dev)
    sink = torch.empty((), dtype=torch.int64, device=dev)
    G = torch.cuda.get_device_properties(0).multi_processor_count
    base = dict(moe_fused.CONFIG)
    names = ["p1 end", "bar1 out", "p2 start", "p2 end min", "p2 end", "p3 end", "end min", "end"]
    print(f"{'config':<18} {'call us':>8}  " + "  ".join(f"{n:>10}" for n in names), flush=True)
    for name in args.configs.split(","):
        moe_fused.CONFIG.clear()
        moe_fused.CONFIG.update(base, **CONFIGS[name])
        ts = torch.zeros(32 * G, 8, dtype=torch.int64, device=dev)
        try:
            with torch.no_grad():
                _, info = moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, timeline=ts, **kw)
                torch.cuda.synchronize()
                moe_fused.check_counter(ctr)
                grid = info.grid
                calls, marks = [], []
                for _ in range(args.reps):
                    torch.sum(flush, dim=0, out=sink)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    moe_fused.moe_token(r, nw, 1e-6, wr, bias, w1, w2, w3, ctr, timeline=ts, **kw)
                    b.record()
                    b.synchronize()
                    calls.append(a.elapsed_time(b) * 1e3)
                    tg = ts[:grid]
                    t = (tg - tg[:, 0].min()).double().cpu() / 1e3  # us since the first program started
                    marks.append(
                        [
                            t[:, 2].max(),
                            t[:, 3].max(),
                            t[:, 4].max(),
                            t[:, 5].min(),
                            t[:, 5].max(),
                            t[:, 6].max(),
                            t[:, 7].min(),
                            t[:, 7].max(),
                        ]  # fmt: skip
                    )
        except Exception as e:  # a setting that does not compile or run
            print(f"{name:<18} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        moe_fused.check_counter(ctr)
        med = [statistics.median(float(m[k]) for m in marks) for k in range(len(names))]
        print(
            f"{name:<18} {statistics.median(calls):8.1f}  "
            + "  ".join(f"{v:10.1f}" for v in med)
            + f"  G={grid}",
            flush=True,
        )
    moe_fused.CONFIG.clear()
    moe_fused.CONFIG.update(base)


if __name__ == "__main__":
    main()
