"""Host-side cost of one decode step of the inference engine: everything ``Engine.step()`` does besides the model's
decode forward (building the step's index tensors, sampling, bookkeeping), with the forward replaced by a stub
that returns fixed logits. Runs on CPU or CUDA (the stub keeps its logits on the engine's device).

    python3 bench/bench_engine_host.py [--device cpu] [--batches 1,16,64] [--vocab 65536] [--steps 50] [--out PATH]

Two sampling settings per batch: greedy, and ``temperature=0.8, top_p=0.95`` (the CLI defaults), each request with
its own seed. On a GPU this time adds to the forward's (``bench_e2e_decode.py``: "step" minus "fwd"). Prints one
table and writes JSON (default ``$OUT/engine_host.json`` or ``bench/out/engine_host.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def run(device: str, B: int, vocab: int, steps: int, sampled: bool) -> float:
    from openk3.config import get_preset
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams
    from openk3.model import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny").replace(vocab_size=vocab)).eval().to(device)
    ctx = 1024
    eng = Engine(
        model,
        None,
        max_seqs=B,
        max_tokens=max(B, 4) * (ctx + steps + 64),
        prefix_cache=False,
        max_prefill_tokens=1 << 20,
        use_cuda_graphs=False,
    )
    fake = torch.randn(B, vocab, device=device)

    def stub(meta, lengths, table, B, ids_from=None):
        # the forward (Engine._decode_logits): fixed logits for the step's rows
        return fake[:B].clone()

    eng._decode_logits = stub
    params = (
        SamplingParams(max_tokens=steps + 8, temperature=0.8, top_p=0.95, ignore_eos=True)
        if sampled
        else SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    )
    reqs = [eng.submit([5 + i % 50] * ctx, params) for i in range(B)]
    while not all(len(r.output_ids) >= 2 for r in reqs):  # prefill (the real model) and the first steps
        eng.step()
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = os.path.join(os.environ["OUT"], "engine_host.json") if os.environ.get("OUT") else None
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=65536, help="vocabulary size (65536: the medium preset)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=default or os.path.join(ROOT, "bench", "out", "engine_host.json"))
    args = ap.parse_args()
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        for sampled in (False, True):
            t = run(args.device, B, args.vocab, args.steps, sampled)
            rows.append({"batch": B, "sampling": "t=0.8 top_p=0.95" if sampled else "greedy", "ms": t * 1e3})
            print(rows[-1], flush=True)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nhost time per decode step (forward stubbed), {dev}, vocab {args.vocab}, context 1024:")
    print("| batch | sampling | ms per step |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} | {r['sampling']} | {r['ms']:.3f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "vocab": args.vocab, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
