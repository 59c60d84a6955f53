"""Diagnostic: which Python call sites launch the GPU kernels of one eager engine decode step. Profiles a few eager
decode steps of a random-weight model (bench_e2e_decode.build) and prints the aten ops that launch kernels, grouped
by their chain of parent ops / openk3 functions, with counts per step and CUDA time.

    python3 bench/diag_decode_ops.py [--preset medium] [--batch 1] [--rows 40]
"""

import argparse
import collections
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def main():
    from torch.profiler import ProfilerActivity, profile

    from bench_e2e_decode import build
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=40)
    a = ap.parse_args()
    model = build(a.preset)
    eng = Engine(model, None, page_size=16, max_seqs=max(a.batch, 1), max_tokens=a.batch * 2048,
                 prefix_cache=False, use_cuda_graphs=False)  # fmt: skip
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(64)] for i in range(a.batch)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.generate(prompts, sp)
    orig = eng._decode_forward
    stats = collections.defaultdict(lambda: [0, 0.0])
    steps = [0]

    def wrapped(*args, **kw):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            out = orig(*args, **kw)
            torch.cuda.synchronize()
        steps[0] += 1
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CPU or not ev.name.startswith("aten::"):
                continue
            kids = [k for k in ev.cpu_children if k.name.startswith("aten::")]
            if kids or ev.device_time_total <= 0:  # leaf aten ops that ran GPU work
                continue
            chain, p = [], ev.cpu_parent  # the nearest two openk3 source lines above the op
            while p is not None and len(chain) < 2:
                if "openk3/" in p.name:
                    chain.append(p.name.split("openk3/", 1)[1])
                p = p.cpu_parent
            key = (ev.name, " <- ".join(chain))
            stats[key][0] += 1
            stats[key][1] += ev.device_time_total
        return out

    eng._decode_forward = wrapped
    eng.generate(prompts, SamplingParams(max_tokens=a.steps + 1, temperature=0.0, ignore_eos=True))
    n = max(steps[0], 1)
    tot_k = sum(v[0] for v in stats.values()) / n
    tot_t = sum(v[1] for v in stats.values()) / n
    print(
        f"{a.preset} batch {a.batch}: {tot_k:.0f} kernel-launching aten ops, {tot_t / 1e3:.3f} ms CUDA per step"
    )
    print(f"{'per step':>8} | {'us/step':>8} | op <- parents")
    for (name, chain), (c, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[: a.rows]:
        print(f"{c / n:8.1f} | {t / n:8.1f} | {name} <- {chain}"[:230])


if __name__ == "__main__":
    main()
