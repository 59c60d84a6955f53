"""Diagnostic: the absorbed MLA decode kernel at a few shapes and launch configurations, timed two ways: eager calls
(``triton.testing.do_bench``: L2 flushed, host work of the wrapper included when the GPU waits for it) and replays
of a CUDA graph holding 20 calls (host work excluded), with the split count each call used.

    python3 bench/diag_mla.py [--shapes 1x16x4096,16x16x16384,64x16x8192] [--configs default,old]

The least tokens per split at few rows (``MLA_CONFIG["few_min_chunk"]``) against shorter ones, at batch 1:

    python3 bench/diag_mla.py --shapes 1x16x1024,1x32x1024,1x16x4096 --configs default,chunk64,chunk32
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

CONFIGS = {
    "default": {},
    # the defaults before the table-prefetch loop form (64-token blocks, table entries loaded inside the loop)
    "old": dict(block_n=64, num_stages=2, prefetch=False),
    "n32s3": dict(block_n=32, num_stages=3, prefetch=2),
    "n64s2p2": dict(block_n=64, num_stages=2, prefetch=2),
    # two stages: 72 KB of rows per program, so three programs share an SM instead of two
    "n32s2": dict(block_n=32, num_stages=2, prefetch=2),
    "n32s2w8": dict(block_n=32, num_stages=2, prefetch=2, num_warps=8),
    # the least tokens per split (default: MLA_CONFIG["few_min_chunk"] at few rows, else "min_chunk")
    "chunk64": dict(min_chunk=64),
    "chunk32": dict(min_chunk=32),
    # many heads (compute-bound): 64 heads per program on the M side of both products (heads x tokens scores,
    # heads x latent output), so every product is a Hopper warpgroup MMA (the transposed form's 32-token score
    # tiles fall back to mma.sync); 8 warps hold the [64, 512] fp32 accumulator at 128 registers per thread
    "h64n32s2": dict(block_h=64, block_n=32, num_warps=8, num_stages=2, trans=False),
    "h64n32s3": dict(block_h=64, block_n=32, num_warps=8, num_stages=3, trans=False),
    "h64n16s3": dict(block_h=64, block_n=16, num_warps=8, num_stages=3, trans=False),
    "h64n64s2": dict(block_h=64, block_n=64, num_warps=8, num_stages=2, trans=False),
    "h64n32s2t": dict(block_h=64, block_n=32, num_warps=8, num_stages=2, trans=True),
}


def graph_us(fns) -> float:
    """Median of 5 replays of one CUDA graph holding ``fns`` in order, per function, in microseconds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(5):
        ev[0].record()
        g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        ts.append(ev[0].elapsed_time(ev[1]) * 1e3 / len(fns))
    return sorted(ts)[2]


def main():
    import triton

    from bench_decode import mla_inputs
    from openk3.infer.kernels import MLA_LAST_LAUNCH, mla_decode_triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x16x4096,16x16x4096,16x16x16384,64x16x8192,1x16x65536")
    ap.add_argument("--configs", default="default,old")
    a = ap.parse_args()
    print(
        f"{'config':10s} {'shape':18s} {'splits':>6s} {'eager ms':>9s} {'graph ms':>9s} {'graph TB/s':>10s}"
        f" {'TFLOP/s':>8s} {'rel err':>9s}"
    )
    for sh in a.shapes.split(","):
        B, H, L = (int(v) for v in sh.split("x"))
        q, kv, table, lengths = mla_inputs(B, H, L)
        nbytes = B * L * kv.shape[-1] * kv.element_size()
        # scores over the 576-wide rows, output over the 512 latent
        flops = 2 * B * H * L * (kv.shape[-1] + 512)
        ref = None  # the first config's output: every other config is checked against it
        for name in a.configs.split(","):
            kw = CONFIGS[name]

            def call(kw=kw, ins=(q, kv, table, lengths)):
                return mla_decode_triton(*ins, scale=192**-0.5, kv_lora_rank=512, **kw)

            o = call()
            splits = MLA_LAST_LAUNCH["splits"]
            if ref is None:
                ref = o
            err = float((o - ref).norm() / ref.norm())
            t_eager = triton.testing.do_bench(call, warmup=5, rep=50, return_mode="median")
            t_graph = graph_us([call] * 20) / 1e3
            print(
                f"{name:10s} {sh:18s} {splits:6d} {t_eager:9.4f} {t_graph:9.4f} {nbytes / t_graph / 1e9:10.2f}"
                f" {flops / t_graph / 1e9:8.0f} {err:9.1e}",
                flush=True,
            )
        q = kv = table = lengths = ref = o = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
