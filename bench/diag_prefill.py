"""Where the engine's prefill time goes: each prefill forward (the packed pieces of several prompts, the engine's
default, or with ``--no-batch-prefill`` one prompt's chunk) timed on its own (synchronised), cold and warm, beside
the model's plain forward over the same tokens, and a profile of one warm prompt (of the whole burst with packed
prefill; top operations by device and by host time).

    python3 bench/diag_prefill.py [--prompts 8] [--prompt-len 512] [--no-profile] [--sync-report] [--host-profile]
                                  [any `openk3 serve` model / engine option, e.g. --preset medium --max-prefill-tokens 2048]

Prints a table per run (tokens per forward, forwards, pieces per forward, median / total ms, prompt tokens per
second) and writes JSON
(default ``$OUT/diag_prefill.json`` or ``bench/out/diag_prefill.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def _bucket(t: int) -> str:
    for hi in (1, 16, 64, 256, 1024, 4096):
        if t <= hi:
            return f"<= {hi}"
    return "> 4096"


def _where(path: str) -> str:
    """A source path relative to the checkout, or from site-packages on."""
    return os.path.relpath(path, ROOT) if path.startswith(ROOT) else path.split("site-packages/")[-1]


def _burst_with(engine, params, rng, args, vocab, wrap) -> int:
    """Run one more warm burst of ``args.prompts`` prompts with each prefill forward (one prompt's chunk or packed
    pieces) run through ``wrap(forward)``; the engine's own methods are put back after. Returns the forwards."""
    forwards = [0]

    def wrapped(inner):
        def run(*a):
            forwards[0] += 1
            wrap(inner, *a)

        return run

    saved = engine._prefill_chunk, engine._prefill_packed
    engine._prefill_chunk, engine._prefill_packed = wrapped(saved[0]), wrapped(saved[1])
    try:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        engine.generate(prompts, params)
    finally:
        engine._prefill_chunk, engine._prefill_packed = saved
    return forwards[0]


def _sync_report(engine, params, rng, args, vocab) -> list:
    """Run one more warm burst with the CUDA sync debug mode on inside the prefill forwards (not the decode steps,
    whose token copy to the host is meant); print and return each synchronising source line with its count."""
    import collections
    import warnings

    import torch

    seen: collections.Counter = collections.Counter()

    def watched(inner, *a):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                inner(*a)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchron" in str(w.message).lower():
                seen[f"{_where(w.filename)}:{w.lineno}"] += 1

    forwards = _burst_with(engine, params, rng, args, vocab, watched)
    print(f"\nhost synchronisations inside {forwards} prefill forward(s): {sum(seen.values())}")
    for where, n in seen.most_common():
        print(f"  {n:4d}  {where}")
    return [{"where": w, "count": n} for w, n in seen.most_common()]


def _host_profile(engine, params, rng, args, vocab, sync) -> dict:
    """Run one more warm burst with cProfile on inside the prefill forwards only; print the top functions by own
    time and by cumulative time (per forward) and return them."""
    import cProfile
    import pstats

    prof = cProfile.Profile()

    def profiled(inner, *a):
        sync()
        prof.enable()
        try:
            inner(*a)
        finally:
            prof.disable()
        sync()

    forwards = _burst_with(engine, params, rng, args, vocab, profiled)
    n = max(1, forwards)
    rows = [
        {
            "fn": f"{_where(path)}:{line}({fn})",
            "calls": v[1] / n,
            "own_ms": 1e3 * v[2] / n,
            "cum_ms": 1e3 * v[3] / n,
        }
        for (path, line, fn), v in pstats.Stats(prof).stats.items()
    ]
    total = sum(r["own_ms"] for r in rows)
    print(f"\nhost profile: {forwards} prefill forward(s), {total:.1f} ms of profiled host time per forward")
    out = {"forwards": forwards, "own_ms_per_forward": total}
    for key, title in (("own_ms", "own"), ("cum_ms", "cumulative")):
        top = sorted(rows, key=lambda r: -r[key])[:30]
        print(f"\ntop functions by {title} time, per forward:")
        print("| ms | calls | function |\n| --- | --- | --- |")
        for r in top:
            print(f"| {r[key]:.2f} | {r['calls']:.0f} | {r['fn']} |")
        out[title] = top
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--warm-runs", type=int, default=1, help="warm bursts to time (the median forward is reported)"
    )
    ap.add_argument(
        "--sync-report",
        action="store_true",
        help="(CUDA) one more warm burst with torch.cuda.set_sync_debug_mode('warn') inside the prefill forwards: "
        "where they synchronise with the host, per source line",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="one more warm burst with cProfile on inside the prefill forwards: where their host time goes, by "
        "Python function (the GPU runs behind; a function's own time includes the launches it makes)",
    )
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args(argv)
    if args.prompts < 1 or args.prompt_len < 2:
        raise SystemExit("--prompts must be >= 1 and --prompt-len >= 2")

    import torch

    from openk3.cli import build_parser
    from openk3.infer.cli import _load
    from openk3.infer.sampling import SamplingParams

    engine, name, _ = _load(build_parser().parse_args(["serve", *rest]))
    dev = next(engine.model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # one entry per prefill forward: its pieces [(start, tokens)] and its time
    records: list[tuple[list[tuple[int, int]], float]] = []

    def timed(inner, pieces_of):
        def run(*a):
            sync()
            t0 = time.perf_counter()
            inner(*a)
            sync()
            records.append((pieces_of(*a), 1e3 * (time.perf_counter() - t0)))

        return run

    engine._prefill_chunk = timed(engine._prefill_chunk, lambda req, start, end: [(start, end - start)])
    engine._prefill_packed = timed(engine._prefill_packed, lambda pieces: [(a, b - a) for _, a, b in pieces])
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    vocab = engine.tok_vocab
    result: dict = {"model": name, "device": str(dev), "prompts": args.prompts, "prompt_len": args.prompt_len}
    result["max_prefill_tokens"] = engine.cfg.max_prefill_tokens
    print(
        f"{name} on {dev}: {args.prompts} prompts of {args.prompt_len} tokens, chunks of at most "
        f"{engine.cfg.max_prefill_tokens} tokens per step"
    )
    warm_ms: list[float] = []
    reserved0 = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    for run in ["cold"] + ["warm"] * max(1, args.warm_runs):
        records.clear()
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        sync()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        sync()
        wall = time.perf_counter() - t0
        tokens = sum(n for pieces, _ in records for _, n in pieces)
        print(
            f"\n{run}: {wall:.2f} s wall, {tokens} prompt tokens in {len(records)} forwards, "
            f"{sum(ms for _, ms in records) / 1e3:.2f} s in them, {tokens / wall:.0f} prompt tok/s\n"
        )
        print(
            "| tokens per forward | forwards | pieces per forward | median ms | total ms | tok/s in these forwards |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        rows = {}
        for pieces, ms in records:
            n = sum(k for _, k in pieces)
            rows.setdefault(_bucket(n), []).append((n, len(pieces), ms))
        for b, xs in sorted(rows.items(), key=lambda kv: min(n for n, _, _ in kv[1])):
            tot = sum(ms for *_, ms in xs)
            print(
                f"| {b} | {len(xs)} | {statistics.mean(p for _, p, _ in xs):.1f} | "
                f"{statistics.median(ms for *_, ms in xs):.2f} | {tot:.1f} | {1e3 * sum(n for n, _, _ in xs) / tot:.0f} |"
            )
        result[run] = {"wall_s": wall, "forwards": [{"pieces": p, "ms": ms} for p, ms in records]}
        if run == "warm":
            warm_ms += [ms for _, ms in records]
    if (
        dev.type == "cuda"
    ):  # what the bursts left reserved past the cache pool: activations, graph buffers and pools
        st = engine.stats()
        graphs = {k: v for k, v in st.items() if k.startswith("prefill_") and "graph" in k}
        grown = (torch.cuda.memory_reserved(dev) - reserved0) / 2**20
        result |= {"reserved_growth_mib": grown, "reserve_mib": engine._reserve_bytes() / 2**20}
        result["prefill_graph_stats"] = graphs
        print(
            f"\nCUDA memory reserved by the bursts: {grown:.0f} MiB (the engine set aside "
            f"{result['reserve_mib']:.0f} MiB); prefill graphs {graphs}"
        )
    if args.warm_runs > 1:
        med = statistics.median(warm_ms)
        result["warm_forward_ms"] = warm_ms
        print(f"\nwarm forwards over {args.warm_runs} bursts: median {med:.2f} ms, min {min(warm_ms):.2f} ms")

    # the model's own forward over one prompt (no cache, no pool): what a chunk could cost
    ids = torch.randint(3, vocab, (1, args.prompt_len - 1), device=dev)
    with torch.no_grad():
        for _ in range(2):
            engine.model(ids)
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            engine.model(ids)
        sync()
    fwd_ms = 1e3 * (time.perf_counter() - t0) / 3
    result["model_forward_ms"] = fwd_ms
    print(f"\nmodel forward, [1, {args.prompt_len - 1}] tokens, no cache: {fwd_ms:.2f} ms")

    if args.sync_report and dev.type == "cuda":
        result["syncs"] = _sync_report(engine, params, rng, args, vocab)

    if args.host_profile:
        result["host_profile"] = _host_profile(engine, params, rng, args, vocab, sync)

    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        # packed prefill: the whole burst (its forwards take several prompts); else one prompt
        n = args.prompts if engine.cfg.batch_prefill else 1
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(n)]
        with profile(activities=acts) as prof:
            engine.generate(prompts, params)
            sync()
        ka = prof.key_averages()
        dev_key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"\n{n} warm prompt(s), top operations by device time:")
        print(ka.table(sort_by=dev_key, row_limit=20, max_name_column_width=60))
        print("top operations by host time:")
        print(ka.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
    out = args.out or os.path.join(
        os.environ.get("OUT") or os.path.join(ROOT, "bench", "out"), "diag_prefill.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
