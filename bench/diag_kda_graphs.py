"""Diagnostic (CUDA, fla-core): the host and device time of one KDA chunk call of a prefill forward, eager (fla's
``chunk_kda`` varlen call, as the engine made it before ``EngineConfig.prefill_graphs``) against
``openk3.fast.kda.ChunkGraphs`` (copies into the bucket's buffers, one graph replay, the outputs copied out), with
the graph path's parts timed alone. Host time: 10 calls issued back to back after a synchronise; device time: CUDA
events around ``--calls`` calls.

    python3 bench/diag_kda_graphs.py [--shapes 4096x8,512x1,2048x2] [--heads 16] [--calls 50] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def _one_shape(T, N, H, K, kw0, g, timed, calls) -> dict:
    """The parts' (host ms, device ms) per call for ``T`` tokens in ``N`` equal packed sequences."""
    import torch

    import openk3.fast.kda as FK

    dev = "cuda"
    lens = [T // N] * N
    lens[-1] += T - sum(lens)
    cu_cpu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, z = (torch.randn(1, T, H, K, device=dev, generator=g).bfloat16() for _ in range(4))
    beta = torch.randn(1, T, H, device=dev, generator=g).bfloat16()
    h0 = 0.1 * torch.randn(N, H, K, K, device=dev, generator=g)
    kw = {**kw0, "initial_state": h0, "cu_seqlens": cu_cpu.to(dev)}
    graphs = FK.ChunkGraphs(max_tokens=T, max_seqs=N)

    def eager():
        return FK._chunk_kda(q, k, v, z, beta, **kw, cu_seqlens_cpu=cu_cpu)

    def run():
        return graphs.run(q, k, v, z, beta, kw, cu_cpu)

    with torch.no_grad():
        for fn in (eager, run):  # compiles, autotuning, the capture
            fn()
            fn()
        (e,) = graphs.entries.values()
        offs = cu_cpu.tolist()

        def copies():
            graphs._fill(e.bufs, (q, k, v, z, beta), kw, offs)

        def outputs():
            return e.out[0][0, :T].clone(), e.out[1][:N].clone()

        parts = {
            "eager chunk_kda": eager,
            "graph run (all)": run,
            "  copies in": copies,
            "  replay": e.graph.replay,
            "  outputs out": outputs,
        }
        return {name: timed(fn, calls) for name, fn in parts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x8,512x1,2048x2", help="tokens x packed sequences")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import torch

    import openk3.fast.kda as FK

    if not torch.cuda.is_available() or not FK.available()[0]:
        sys.exit(f"diag_kda_graphs.py needs CUDA and fla-core ({FK.available()[1]})")
    dev, H, K = "cuda", args.heads, args.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    kw0 = {
        "use_gate_in_kernel": True,
        "A_log": torch.rand(H, device=dev).mul(15).add(1).log(),
        "dt_bias": torch.zeros(H * K, device=dev),
        "lower_bound": -5.0,
        "safe_gate": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "output_final_state": True,
    }

    def timed(fn, n):
        """(host ms per call, device ms per call). Host: 10 calls issued back to back after a synchronise (few
        enough that the launch queue does not fill and make the host wait for the device)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        host = 1e3 * (time.perf_counter() - t0) / 10
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return host, a.elapsed_time(b) / n

    rows = []
    for shape in args.shapes.split(","):
        T, N = (int(x) for x in shape.lower().split("x"))
        res = _one_shape(T, N, H, K, kw0, g, timed, args.calls)
        print(
            f"\n{T} tokens in {N} sequences, {H} heads x {K}: ms per call (host issuing back to back / device)"
        )
        print("| part | host ms | device ms |\n| --- | --- | --- |")
        for name, (h, d) in res.items():
            print(f"| {name} | {h:.3f} | {d:.3f} |")
        rows.append(
            {"tokens": T, "seqs": N, "heads": H, "head_dim": K, **{k: list(v) for k, v in res.items()}}
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
