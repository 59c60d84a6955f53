"""Diagnostic: where one graph-replayed decode step spends its time, kernel by kernel.

    python3 bench/diag_decode_step.py [--presets medium,kimi-linear-48b] [--batch 1] [--context 1024] [--out DIR]

Per preset: a random-weight model (bench_e2e_decode.build), an engine with CUDA graphs, one prompt per row prefilled
and decoded a few steps; then the captured decode graph of that batch is replayed under the profiler. Prints the step
time (graph replays back to back), the kernels per step, their summed durations, the summed gaps between one kernel's
end and the next one's start, and the kernels grouped by name (count per step, us per step, mean us). Writes the
ordered kernel sequence of one step (start offset, duration, gap before, name) to ``DIR/step_<preset>_b<B>.txt``.

``--layers N`` keeps the first N layers of the preset, each of its own type (``K3Config.first_layers``), so that a
large preset's layers fit a smaller card; ``--ragged F`` < 1 draws the prompt lengths uniformly from
[F * context, context] (a serving batch). ``--off NAMES`` builds the engine with these ``EngineConfig`` booleans off (e.g. ``graph_priority``); ``--both``
profiles each preset with them off and then with the defaults, on one model. ``--chain N`` also times chains of N
dependent tiny kernels in one graph (a fixed cost per kernel, no bytes).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def short(name: str) -> str:
    """A kernel name without template arguments and launch suffixes, so that one GEMV shape family is one row."""
    n = re.sub(r"<.*", "", name)
    n = re.sub(r"\(.*", "", n)
    return n[:90]


def replay_ms(g, n: int = 30) -> float:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    g.replay()
    torch.cuda.synchronize()
    ev[0].record()
    for _ in range(n):
        g.replay()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / n


def profile_graph(g, steps: int = 5):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    ks = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
    ]
    ks.sort(key=lambda e: e.time_range.start)
    return ks


def run_preset(
    preset: str, B: int, context: int, out_dir: str, off: tuple = (), model=None, ragged: float = 1.0
) -> None:
    from bench_e2e_decode import build
    from openk3.cost import predict_decode_time
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams

    model = build(preset) if model is None else model
    cfg = model.config
    g0 = torch.Generator().manual_seed(0)
    lens = [context if ragged >= 1 else int(torch.randint(int(ragged * context), context + 1, (1,), generator=g0))
            for _ in range(B)]  # fmt: skip
    # every row must be decoding at once when the step is captured: with chunked prefill (8,192 prompt tokens a step,
    # as bench_e2e_decode.py) the first rows decode while the later ones prefill, so they may generate up to one
    # token per prefill step first
    chunk = 8192
    extra = -(-sum(lens) // chunk) + B + 16
    eng = Engine(model, None, page_size=16, max_seqs=B, max_tokens=B * (context + extra + 16), prefix_cache=False,
                 use_cuda_graphs=True, cuda_graph_max_batch=B, max_prefill_tokens=chunk,
                 **dict.fromkeys(off, False))  # fmt: skip
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g0).tolist() for n in lens]
    params = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)
    reqs = [eng.submit(p, params) for p in prompts]
    while not all(len(r.output_ids) >= 4 for r in reqs):
        eng.step()  # prefill, then decode steps of all B rows (the bucket's graph is captured on its first)
    bucket = eng._bucket(B)
    g = eng._graphs[bucket][0]
    ms = min(replay_ms(g) for _ in range(3))
    steps = 5
    ks = profile_graph(g, steps)
    per = len(ks) // steps
    one = ks[:per]
    t0 = one[0].time_range.start
    lines = []
    gaps = 0.0
    prev_end = None
    for e in one:
        s, d = e.time_range.start, e.time_range.end - e.time_range.start
        gap = 0.0 if prev_end is None else s - prev_end
        gaps += max(gap, 0.0)
        prev_end = e.time_range.end
        lines.append(f"{s - t0:9.1f} {d:7.2f} {gap:6.2f}  {short(e.name)}")
    span = one[-1].time_range.end - t0
    busy = sum(e.time_range.end - e.time_range.start for e in one)
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in ks:
        k = short(e.name)
        groups[k][0] += 1
        groups[k][1] += e.time_range.end - e.time_range.start
    pred = predict_decode_time(cfg, B, sum(lens) // B + 6) * 1e3
    head = (
        f"{preset} ({cfg.num_hidden_layers} layers){''.join(f' {n}=off' for n in off)} batch {B} ctx {context}"
        f"{f' ragged {ragged}' if ragged < 1 else ''}: graph replay {ms:.3f} ms/step (roofline {pred:.3f} ms, "
        f"{100 * pred / ms:.0f} %); {per} kernels/step; kernel time {busy / 1e3:.3f} ms, gaps {gaps / 1e3:.3f} ms, "
        f"span {span / 1e3:.3f} ms"
    )
    print(head)
    print(f"{'n/step':>6} {'us/step':>8} {'mean us':>8}  kernel")
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    for name, (c, t) in rows[:28]:
        print(f"{c / steps:6.1f} {t / steps:8.1f} {t / c:8.2f}  {name}")
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", preset + "".join(f"_no_{n}" for n in off))
    with open(os.path.join(out_dir, f"step_{safe}_b{B}.txt"), "w") as f:
        f.write(head + "\n")
        for name, (c, t) in rows:
            f.write(f"{c / steps:6.1f} {t / steps:8.1f} {t / c:8.2f}  {name}\n")
        f.write("\n   start_us  dur_us gap_us  kernel\n" + "\n".join(lines) + "\n")
    for r in reqs:
        eng.abort(r.id)
    del eng, g
    torch.cuda.empty_cache()


def chain(n: int) -> None:
    """us per kernel for n dependent launches in one graph: a 4 KB add (torch) and a Triton copy of 8 KB."""
    x = torch.zeros(2048, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1.0)
    t = min(replay_ms(g, 10) for _ in range(3))
    print(f"chain of {n} dependent torch adds (8 KB) in one graph: {1e3 * t / n:.2f} us per kernel")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="medium,kimi-linear-48b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chain", type=int, default=400)
    ap.add_argument(
        "--off", default="", metavar="NAMES", help="EngineConfig booleans to turn off, comma-separated"
    )
    ap.add_argument(
        "--both", action="store_true", help="profile with --off's flags off, then with the defaults"
    )
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers of each preset")
    ap.add_argument(
        "--ragged", type=float, default=1.0, help="prompt lengths uniform in [F * context, context]"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "out")))
    a = ap.parse_args()
    from openk3.infer.engine import EngineConfig

    off = tuple(n for n in a.off.split(",") if n)
    known = {f.name for f in dataclasses.fields(EngineConfig) if f.type in (bool, "bool")}
    bad = [n for n in off if n not in known]
    if bad:
        raise SystemExit(f"--off: not EngineConfig booleans: {bad}; expected some of {sorted(known)}")
    os.makedirs(a.out, exist_ok=True)
    if a.chain:
        chain(a.chain)
    for p in a.presets.split(","):
        from bench_e2e_decode import build, first_layers

        model = build(p, **first_layers(p, a.layers or 0))
        for o in (off, ()) if a.both and off else (off,):
            run_preset(p, a.batch, a.context, a.out, o, model, a.ragged)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
