"""Diagnostic: the absorbed MLA decode kernel at the issue's target shape (B64 H16 L8192) with programmatic dependent
launch off and on, and how the timing method's L2 flush moves its number. One CUDA device:

    python3 bench/diag_pdl.py [--out bench/out/diag_pdl.json]

Three timings of the same CUDA graphs: one call per replay after ``triton.testing.do_bench``'s flush (zeroing 256
MB, which leaves up to an L2's worth of dirty lines that are written back while the timed call reads), one call
after a read-only flush (a sum over 256 MB: L2 then holds clean lines), and 20 calls back to back in one replay (no
flush; the working set is 12x the L2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def capture(fn, pdl: bool):
    from openk3.fast._triton import pdl_scope

    with pdl_scope(pdl):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "diag_pdl.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    cache = torch.empty(256 << 20, dtype=torch.int8, device=dev)

    def zero_flush():
        cache.zero_()

    import triton.testing

    from bench_decode import mla_inputs, read_flush, time_calls
    from openk3.infer.kernels import MLA_LAST_LAUNCH, mla_decode_triton

    src = torch.randn(1 << 28, device=dev)
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    copy_bw = 2 * src.numel() * 4 / (t * 1e-3)
    src = dst = None
    print(f"device copy (1 GiB, eager, do_bench): {copy_bw / 1e12:.2f} TB/s")
    rows.append(dict(section="ceiling", copy_tbps=copy_bw / 1e12))

    B, H, L = 64, 16, 8192
    q, kv, table, lengths = mla_inputs(B, H, L)
    nbytes = B * L * kv.shape[-1] * kv.element_size()
    print(f"absorbed MLA decode B={B} H={H} L={L} ({nbytes / 1e6:.0f} MB of latent cache), TB/s:")
    print(f"  {'pdl':5s} {'zero-flush':>10s} {'read-flush':>10s} {'20 back to back':>16s}")
    ref = None
    for pdl in (False, True):
        out = []

        def one(out=out):
            out.append(mla_decode_triton(q, kv, table, lengths, scale=192**-0.5, kv_lora_rank=512))

        g1 = capture(one, pdl)
        g1.replay()
        torch.cuda.synchronize()
        if ref is None:
            ref = out[-1].clone()
        err = float((out[-1] - ref).norm() / ref.norm())

        def twenty(one=one):
            for _ in range(20):
                one()

        g20 = capture(twenty, pdl)
        tz = time_calls(g1.replay, zero_flush, warmup=5)
        tr = time_calls(g1.replay, read_flush, warmup=5)
        tb = time_calls(g20.replay, None, warmup=5, reps=30) / 20
        r = dict(
            section="mla",
            shape=f"B={B} H={H} L={L}",
            pdl=pdl,
            splits=MLA_LAST_LAUNCH["splits"],
            ms_zero_flush=tz,
            ms_read_flush=tr,
            ms_back_to_back=tb,
            tbps_zero_flush=nbytes / (tz * 1e-3) / 1e12,
            tbps_read_flush=nbytes / (tr * 1e-3) / 1e12,
            tbps_back_to_back=nbytes / (tb * 1e-3) / 1e12,
            rel_err_vs_pdl_off=err,
        )
        rows.append(r)
        print(
            f"  {str(pdl):5s} {r['tbps_zero_flush']:10.3f} {r['tbps_read_flush']:10.3f} "
            f"{r['tbps_back_to_back']:16.3f}   (ms {tz:.4f} / {tr:.4f} / {tb:.4f}; rel err {err:.1e})"
        )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1
        )


if __name__ == "__main__":
    main()
