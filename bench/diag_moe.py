"""Diagnostic: where the time of the grouped-GEMM expert path goes (fwd+bwd, one CUDA profile per variant) and
what the separate-vs-adjacent gate/up weight layout costs. Prints kernel tables and a short timing table.

    python bench/diag_moe.py [--variants fused_keepx] [--E 64 --K 8 --W 1024 --I 640 --N 16384]
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def main():
    from openk3.fast.moe import experts_grouped
    from run_all import timeit, timeit_pipelined

    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="fused_keepx")
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--W", type=int, default=1024)
    ap.add_argument("--I", type=int, default=640)
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    E, K, W, I, N = a.E, a.K, a.W, a.I, a.N
    dt = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(N, W, device="cuda", dtype=dt).requires_grad_()
    logits = torch.randn(N, E, device="cuda")
    idx = logits.topk(K, dim=-1).indices
    w = torch.softmax(logits.gather(1, idx), -1).requires_grad_()
    w13 = (torch.randn(E, 2 * I, W, device="cuda", dtype=dt) * W**-0.5).requires_grad_()
    sep = [
        (torch.randn(E, I, W, device="cuda", dtype=dt) * W**-0.5).requires_grad_(),
        (torch.randn(E, W, I, device="cuda", dtype=dt) * I**-0.5).requires_grad_(),
        (torch.randn(E, I, W, device="cuda", dtype=dt) * W**-0.5).requires_grad_(),
    ]
    # adjacent layout: w1 and w3 are the two halves of one [E, 2I, W] buffer (leaf views through a detached base)
    base = w13.detach()
    adj = [base[:, :I].requires_grad_(), sep[1], base[:, I:].requires_grad_()]
    dy = torch.randn(N, W, device="cuda", dtype=dt)
    xr = torch.randn(N * K, W, device="cuda", dtype=dt).requires_grad_()
    d1 = (torch.randn(W, I, device="cuda", dtype=dt) * W**-0.5).requires_grad_()
    d3 = (torch.randn(W, I, device="cuda", dtype=dt) * W**-0.5).requires_grad_()
    d2 = (torch.randn(I, W, device="cuda", dtype=dt) * I**-0.5).requires_grad_()
    dyr = torch.randn(N * K, W, device="cuda", dtype=dt)

    def dense():
        ((xr @ d1) * (xr @ d3)) @ d2

    def clear():
        for t in (x, w, *sep, *adj, xr, d1, d2, d3):
            t.grad = None

    f_dense = lambda: (((xr @ d1) * (xr @ d3)) @ d2).backward(dyr)  # noqa: E731
    t_dense = timeit(f_dense, setup=clear)
    t_dense_p = timeit_pipelined(f_dense, setup=clear)
    print(
        f"dense peer fwd+bwd (grads cleared each run): {t_dense * 1e3:.3f} ms, "
        f"back to back (pipelined): {t_dense_p * 1e3:.3f} ms"
    )
    from openk3.fast import moe as fast_moe

    rows = []
    for v in [s for s in a.variants.split(",") if s]:
        for lay, ws in (("separate w1/w3", sep), ("adjacent w1/w3", adj)):
            for split in (True, False):
                fast_moe.SPLIT_DW13 = split
                f = lambda ws=ws, v=v: experts_grouped(x, idx, w, *ws, variant=v).backward(dy)  # noqa: E731
                t_acc = timeit(f)
                t_clr = timeit(f, setup=clear)
                t_pip = timeit_pipelined(f, setup=clear)
                rows.append((v + (" dW split" if split else " dW one"), lay, t_acc, t_clr, t_pip))
    fast_moe.SPLIT_DW13 = True
    print(
        f"{'variant':22} | {'layout':15} | {'ms (grads accumulate)':>22} | {'ms (grads cleared)':>19} | % of dense"
        f" | {'ms (cleared, pipelined)':>24} | % of dense (pipelined)"
    )
    for v, lay, t_acc, t_clr, t_pip in rows:
        print(
            f"{v:22} | {lay:15} | {t_acc * 1e3:22.3f} | {t_clr * 1e3:19.3f} | {t_dense / t_clr * 100:9.1f} %"
            f" | {t_pip * 1e3:24.3f} | {t_dense_p / t_pip * 100:.1f} %"
        )
    from torch.profiler import ProfilerActivity, profile

    for v in [s for s in a.variants.split(",") if s]:
        for lay, ws in (("separate", sep), ("adjacent", adj)):
            f = lambda ws=ws, v=v: experts_grouped(x, idx, w, *ws, variant=v).backward(dy)  # noqa: E731
            clear()
            f()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    clear()
                    f()
                torch.cuda.synchronize()
            print(f"\n== {v} / {lay} w1,w3: CUDA kernels over 5 fwd+bwd ==")
            print(
                prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70
                )
            )
    clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            clear()
            (((xr @ d1) * (xr @ d3)) @ d2).backward(dyr)
        torch.cuda.synchronize()
    print("\n== dense peer: CUDA kernels over 5 fwd+bwd ==")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    del dense


if __name__ == "__main__":
    main()
