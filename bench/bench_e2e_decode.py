"""End-to-end decode on one GPU: time per output token vs batch size through the inference engine, against the
cost model's weight-and-cache bandwidth roofline.

    python3 bench/bench_e2e_decode.py [--presets medium,kimi-linear-48b] [--batches 1,4,16,64] [--context 1024]
                                      [--steps 24] [--ragged F] [--moe-small N] [--compare-fusion] [--out PATH]

Per preset: a model with random weights is built on the GPU in bf16 (fp32 where SPEC keeps it), an
:class:`~openk3.infer.engine.Engine` (paged cache, Triton decode steps, CUDA graphs) prefills ``batch`` random prompts
of ``--context`` tokens (``--ragged F``: lengths uniform in [F * context, context], as a continuous-batching server
holds them), then every request decodes; ``--steps`` steady-state engine steps are timed (all rows
decoding, greedy). Two numbers per row:

* ``step``: wall time of one ``Engine.step()`` (scheduling, the decode forward, sampling, bookkeeping): the time per
  output token a client sees;
* ``fwd``: the decode forward alone (graph replay, synchronised), the part the roofline models.

Roofline: ``openk3.cost.predict_decode_time(cfg, batch, context)`` with this project's measured H200 ceilings (bf16
matmul 790 TFLOP/s, copy 4.2 TB/s): bytes of the weights a step touches (the experts the batch is expected to route
to) plus the KDA state and the MLA latent cache, over the copy bandwidth. "% of roofline" = predicted / measured.
``--profile`` adds a kernel table (kernels per step, top kernels by GPU time) for the smallest batch of each
preset. Prints one table and writes JSON to ``--out`` (default ``$OUT/e2e_decode.json`` or ``bench/out/e2e_decode.json``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

ROWS: list[dict] = []
ERRORS: list[str] = []
INFO_PROFILE: dict[str, float] = {}
PROFILE = ""  # directory for kernel profiles (--profile), empty: off
DEV = "cuda"
WALL = False  # --wall-timing
LAYERS = 0  # --layers: the preset's first N decoder layers only (0: all)
SAMPLING: dict = {}  # --temperature / --top-p / --seed / --logprobs: the requests' sampling (default greedy)


def empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


_BUILT: dict = {}  # the latest preset's model, reused by the engines of its variants


def _patch(obj, key, value):
    """Set ``obj[key]`` (a dict) or ``obj.key`` to ``value``; returns the function that restores it."""
    if isinstance(obj, dict):
        old = obj[key]
        obj[key] = value
        return lambda: obj.__setitem__(key, old)
    old = getattr(obj, key)
    setattr(obj, key, value)
    return lambda: setattr(obj, key, old)


def _kda_few(split_v: int):
    from openk3.infer import kernels as KN

    return _patch(KN.KDA_CONFIG, "few", {**KN.KDA_CONFIG["few"], "split_v": split_v})


def _setting(module: str, name: str, value, key=None):
    """A variant: ``module.name`` (or, with ``key``, the dict ``module.name[key]``) set to ``value``."""

    def apply():
        obj = importlib.import_module(module)
        return _patch(obj, name, value) if key is None else _patch(getattr(obj, name), key, value)

    return apply


_MOE_SMALL, _KN = "openk3.fast.moe_small", "openk3.infer.kernels"


def _no_logprobs():
    """The requests without logprobs (with --logprobs: the same run's baseline)."""
    had = "logprobs" in SAMPLING
    old = SAMPLING.pop("logprobs", None)
    return lambda: SAMPLING.__setitem__("logprobs", old) if had else None


# --kernel-variants: module-level launch choices, each set around one engine's run (the default: as configured)
KERNEL_VARIANTS = {
    "default": lambda: lambda: None,
    "kda_split": lambda: _kda_few(8),
    "kda_per_head": lambda: _kda_few(0),
    "no_fuse_select": _setting(_MOE_SMALL, "FUSE_SELECT", False),
    # the few-token gate/up tile (rows, columns, stages): two that fit their registers at 4 warps with the fused
    # selection (bench/diag_moe_compile.py), against the default (16, 256, 3)
    "up_8x256": _setting(_MOE_SMALL, "UP_TILE", (8, 256, 3)),
    "up_16x128": _setting(_MOE_SMALL, "UP_TILE", (16, 128, 3)),
    # the MLA reduce + post kernel as before v18: W_UV streamed after the combine
    "mla_post_streamed": _setting(_KN, "MLA_GLUE_CONFIG", 0, key="post_whole_elems"),
    # where a folded plain MoE layer's shared experts run (engine.FOLD_SHARED): the side stream, one more slot of the
    # routed kernels, or their gate / up rows in the router's GEMV and the rest in the down + combine kernel
    "shared_side": _setting("openk3.infer.engine", "FOLD_SHARED", "side"),
    "shared_slot": _setting("openk3.infer.engine", "FOLD_SHARED", "slot"),
    "shared_router": _setting("openk3.infer.engine", "FOLD_SHARED", "router"),
    # the MLA prep's W_UK tile loaded after the wait (as before v21)
    "mla_prep_late": _setting(_KN, "MLA_GLUE_CONFIG", False, key="prep_early"),
    # the token draw through PyTorch (top-p's sort, one program per row for the Gumbel draw), as before v22
    "draw_sorted": _setting("openk3.infer.sampling", "FAST_DRAW", False, key="on"),
    # with --logprobs: the same requests without logprobs
    "no_logprobs": _no_logprobs,
    # the few-token routing selection by K max-reductions instead of tl.topk (moe_small.SELECT_TOPK, default
    # since v24)
    "select_max": _setting(_MOE_SMALL, "SELECT_TOPK", False, key="on"),
    # the routing selection inside the experts' gate/up kernel up to 4 tokens instead of 1 (every program forms its
    # token's top-k; measured slower for 2+ tokens with K max-reductions, v13)
    "fuse_select_4": _setting(_MOE_SMALL, "FUSE_SELECT_MAX_TOKENS", 4),
    # the absorbed MLA's balanced splits (the programs share the batch's tokens evenly) against the per-row splits
    "mla_balance": _setting(_KN, "MLA_CONFIG", True, key="balance"),
    "mla_per_row": _setting(_KN, "MLA_CONFIG", False, key="balance"),
    # the MLA split walk by the warp-specialised Gluon kernel (openk3.infer.mla_gluon) or by the Triton kernel
    "mla_gluon": _setting(_KN, "MLA_CONFIG", True, key="gluon"),
    "mla_triton": _setting(_KN, "MLA_CONFIG", False, key="gluon"),
    # the Gluon kernel's split walk instead of its persistent walk (the default from 16 rows, v30)
    "mla_gluon_split": _setting("openk3.infer.mla_gluon", "MLA_GLUON_CONFIG", False, key="persistent"),
    # decode batches' routed experts by the expert-tiled kernels (openk3.fast.moe_tiled, v32) up to 16 / 64 pairs per
    # expert on average, or by the permuted grouped GEMMs
    "moe_tiled": _setting("openk3.fast.moe_tiled", "TILED", 16, key="max_pairs_per_expert"),
    "moe_tiled_64": _setting("openk3.fast.moe_tiled", "TILED", 64, key="max_pairs_per_expert"),
    "moe_grouped": _setting("openk3.fast.moe_tiled", "TILED", 0, key="max_pairs_per_expert"),
}


def build(preset: str, **over):
    """Random-weight model of ``preset`` (config fields ``over`` replaced) on the GPU in bf16 (SPEC §5.3 fp32
    parameters and buffers in fp32), built directly on the device so that large presets need no host copy."""
    from openk3.infer.engine import random_model

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    return random_model(preset, device=DEV, dtype=dtype, seed=0, **(first_layers(preset, LAYERS) | over))


def first_layers(preset: str, n: int) -> dict:
    """The overrides keeping ``preset``'s first ``n`` decoder layers (:meth:`openk3.config.K3Config.first_layers`;
    0: all layers, no overrides)."""
    from openk3.config import ConfigError, get_preset

    if not n:
        return {}
    try:
        return get_preset(preset).first_layers(n)
    except ConfigError as e:
        raise SystemExit(f"--layers: {e}") from None


def run_preset(
    preset: str,
    batches: list[int],
    context: int,
    steps: int,
    graphs: bool,
    fuse: bool = True,
    moe_small_n: int | None = None,
    fuse_ffn: bool | None = None,
    fuse_res: bool | None = None,
    flags: dict | None = None,
    variant: str = "",
    ragged: float = 1.0,
) -> None:
    """One engine per call; ``fuse_ffn`` / ``fuse_res`` / ``moe_small_n`` None: the engine's defaults; ``flags``:
    further EngineConfig booleans (e.g. ``fuse_read_norm``); ``variant``: a name of :data:`KERNEL_VARIANTS`, set
    around the engine's whole run; ``ragged`` < 1: prompt lengths drawn uniformly from [ragged * context, context]
    (one draw per batch size, the same for every variant) instead of all ``context``."""
    from openk3.cost import predict_decode_time
    from openk3.fast import moe_small
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams

    small_before = moe_small.SMALL_N
    if moe_small_n is not None:  # before the engine captures its graphs
        moe_small.SMALL_N = moe_small_n
    label = (
        preset
        + (f" {LAYERS}L" if LAYERS else "")
        + ("" if fuse else " unfused-proj")
        + ({None: "", True: " fused-ffn", False: " no-fused-ffn"}[fuse_ffn])
        + (" fused-residual" if fuse_res else "")
        + "".join(
            f" {k.removeprefix('fuse_')}={v if not isinstance(v, bool) else 'on' if v else 'off'}"
            for k, v in (flags or {}).items()
        )
        + ("" if moe_small_n is None else f" moe-small<={moe_small_n}")
        + (f" [{variant}]" if variant else "")
        + (f" ragged>={ragged:g}" if ragged < 1 else "")
        + "".join(f" {k}={v}" for k, v in SAMPLING.items())
    )
    undo = KERNEL_VARIANTS[variant]() if variant else None
    t0 = time.time()
    if _BUILT.get("preset") != preset:  # one model per preset, shared by its variants' engines
        _BUILT.clear()
        gc.collect()
        empty_cache()
        _BUILT.update(preset=preset, model=build(preset))
    model = _BUILT["model"]
    cfg = model.config
    sync()
    mem = torch.cuda.memory_allocated() / 2**30 if DEV == "cuda" else 0.0
    print(
        f"[{preset}] built in {time.time() - t0:.1f}s, {model.num_parameters() / 1e9:.2f} B params, {mem:.1f} GiB",
        flush=True,
    )
    bmax = max(batches)
    warm = 4
    extra = warm + steps + 8 + bmax * context // 8192  # early rows decode while later ones prefill
    eng = Engine(
        model,
        None,
        page_size=16,
        max_seqs=bmax,
        max_tokens=bmax * (context + extra + 16),
        max_prefill_tokens=8192,
        prefix_cache=False,
        use_cuda_graphs=graphs,
        cuda_graph_max_batch=bmax,
        fuse_projections=fuse,
        **({} if fuse_ffn is None else {"fuse_ffn_projections": fuse_ffn}),
        **({} if fuse_res is None else {"fuse_residual": fuse_res}),
        **(flags or {}),
    )
    print(f"[{preset}] engine: {eng.memory_report()}", flush=True)
    fwd_times: list[float] = []
    inner = eng._decode_logits

    def timed(*a, **kw):
        sync()
        t = time.perf_counter()
        out = inner(*a, **kw)
        sync()
        fwd_times.append(time.perf_counter() - t)
        return out

    if not WALL:
        eng._decode_logits = timed
    g = torch.Generator().manual_seed(0)
    V = cfg.vocab_size
    for B in batches:
        try:
            lo = max(1, int(ragged * context))
            lens = (
                [context] * B
                if ragged >= 1
                else [
                    int(n)
                    for n in torch.randint(lo, context + 1, (B,), generator=torch.Generator().manual_seed(B))
                ]
            )
            prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
            params = SamplingParams(max_tokens=extra, ignore_eos=True, **{"temperature": 0.0, **SAMPLING})
            reqs = [eng.submit(p, params) for p in prompts]
            tp = time.time()
            while not all(len(r.output_ids) >= warm for r in reqs):  # prefill + warm-up (graph capture)
                eng.step()
            t_prefill = time.time() - tp
            step_t: list[float] = []
            fwd_times.clear()
            if WALL:  # back to back, synchronised only around the whole run (what overlap changes)
                sync()
                t = time.perf_counter()
                for _ in range(steps):
                    eng.step()
                sync()
                step_t = [(time.perf_counter() - t) / steps]
            else:
                for _ in range(steps):
                    sync()
                    t = time.perf_counter()
                    eng.step()
                    step_t.append(time.perf_counter() - t)
            n_fwd = list(fwd_times) or [float("nan")]
            if PROFILE and B == min(batches) and fuse:
                profile_steps(eng, label, B)
            for r in reqs:
                eng.abort(r.id)
            while eng.has_work():
                eng.step()
            ctx = round(sum(lens) / B) + warm + steps // 2
            pred = predict_decode_time(cfg, B, ctx)
            st, fw = statistics.median(step_t), statistics.median(n_fwd)
            row = {
                "preset": label,
                "batch": B,
                "context": ctx,
                "layers": cfg.num_hidden_layers,
                "step_ms": st * 1e3,
                "fwd_ms": fw * 1e3,
                "tok_s": B / st,
                "pred_ms": pred * 1e3,
                "pct_roofline_step": 100 * pred / st,
                "pct_roofline_fwd": 100 * pred / fw,
                "graphs": int(eng.graphs_enabled),
                "prefill_s": t_prefill,
            }
            ROWS.append(row)
            print(f"[{preset}] {row}", flush=True)
        except Exception as e:  # keep the other rows
            ERRORS.append(f"{preset} B={B}: {e!r}")
            traceback.print_exc()
            empty_cache()
    moe_small.SMALL_N = small_before
    if undo is not None:
        undo()
    # the timing wrapper and the captured graphs form reference cycles through the engine: collect them, or each
    # variant keeps the previous model's weights and cache pool alive (the next, larger preset runs out of memory)
    if not WALL:
        del eng._decode_logits
    inner = timed = None
    del eng, model
    gc.collect()
    empty_cache()


def profile_steps(eng, preset: str, B: int, steps: int = 5) -> None:
    """Kernel-level breakdown of ``steps`` engine steps (all rows decoding): kernels per step and the top kernels by
    GPU time, written next to the JSON (``profile_<preset>_b<B>.txt``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        sync()
    events = prof.key_averages()
    kernels = sum(
        e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    )
    sort = "self_cuda_time_total" if DEV == "cuda" else "self_cpu_time_total"
    table_txt = events.table(sort_by=sort, row_limit=30, max_name_column_width=70)
    head = f"{preset} batch {B}: {kernels / steps:.0f} GPU kernels per engine step ({steps} steps profiled)\n"
    INFO_PROFILE[f"{preset} b{B}"] = kernels / steps
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in preset)
    gaps = ""
    if DEV == "cuda":
        trace = os.path.join(PROFILE, f"trace_{safe}_b{B}.json")
        prof.export_chrome_trace(trace)
        gaps = gap_report(trace, steps)
        os.remove(trace)
    path = os.path.join(PROFILE, f"profile_{safe}_b{B}.txt")
    with open(path, "w") as f:
        f.write(head + table_txt + "\n" + gaps)
    print(head + "\n".join(table_txt.splitlines()[:16]) + "\n" + gaps, flush=True)


def gap_report(trace: str, steps: int, top: int = 12) -> str:
    """Where the device idles between its operations in a profiled run (a chrome trace of torch.profiler): busy and
    idle time per step, and the longest gaps with the operations on either side."""
    with open(trace) as f:
        ev = json.load(f)
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    ops = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?"))
        for e in ev
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not ops:
        return "gap report: no device operations in the trace\n"
    busy, idle, end, prev, gaps = ops[0][1] - ops[0][0], 0.0, ops[0][1], ops[0][2], []
    for t0, t1, name in ops[1:]:
        if t0 > end:
            idle += t0 - end
            gaps.append((t0 - end, prev, name))
        busy += max(0.0, t1 - max(t0, end))
        if t1 >= end:
            end, prev = t1, name
    gaps.sort(reverse=True)
    lines = [
        f"device: {len(ops) / steps:.0f} operations, busy {busy / steps:.1f} us, idle {idle / steps:.1f} us per step "
        f"(span {(end - ops[0][0]) / steps:.1f} us per step)",
        f"longest gaps (us, operation before -> after), of {len(gaps)}:",
    ]
    lines += [f"  {g:7.1f}  {a[:60]} -> {b[:60]}" for g, a, b in gaps[:top]]
    return "\n".join(lines) + "\n"


def table() -> str:
    lines = [
        "| preset | batch | context | step ms | fwd ms | tokens/s | roofline ms | % roofline (step / fwd) | graphs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in ROWS:
        lines.append(
            f"| {r['preset']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['fwd_ms']:.2f} | "
            f"{r['tok_s']:.0f} | {r['pred_ms']:.3f} | {r['pct_roofline_step']:.0f} % / {r['pct_roofline_fwd']:.0f} % "
            f"| {r['graphs']} |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = os.path.join(os.environ["OUT"], "e2e_decode.json") if os.environ.get("OUT") else None
    ap.add_argument("--presets", default="medium,kimi-linear-48b")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="build only each preset's first N decoder layers (its layer pattern kept; the roofline follows), e.g. "
        "the 48B shape's per-layer costs on an 80 GB card (default 0: all layers)",
    )
    ap.add_argument(
        "--ragged",
        type=float,
        default=1.0,
        metavar="F",
        help="prompt lengths uniform in [F * context, context] (e.g. 0.5; the context column is their mean); "
        "default 1: every prompt has --context tokens",
    )
    ap.add_argument("--no-graphs", action="store_true", help="eager decode (no CUDA graphs)")
    ap.add_argument(
        "--compare-unfused",
        action="store_true",
        help="also time each preset with EngineConfig.fuse_projections off (one GEMM per projection)",
    )
    ap.add_argument(
        "--compare-fusion",
        action="store_true",
        help="A/B/C: time each preset without the decode fusions that are off by default, with "
        "EngineConfig.fuse_ffn_projections, and with fuse_ffn_projections + fuse_residual",
    )
    ap.add_argument(
        "--compare-flags",
        default="",
        metavar="NAMES",
        help="A/B: time each preset with these EngineConfig booleans all off, each one on alone, and all on, e.g. "
        "fuse_read_norm,fuse_kda_lowrank",
    )
    ap.add_argument(
        "--mla-backends",
        default="",
        metavar="NAMES",
        help="A/B of EngineConfig.mla_backend: auto (our Triton kernel) and/or flashinfer, e.g. auto,flashinfer",
    )
    ap.add_argument(
        "--moe-small",
        type=int,
        default=None,
        metavar="N",
        help="A/B: time each preset with the few-token MoE path off and on for up to N tokens (OPENK3_MOE_SMALL_N)",
    )
    ap.add_argument(
        "--wall-timing",
        action="store_true",
        help="time the steps back to back, synchronised only before and after them (step ms = the mean; no fwd "
        "column): needed to see EngineConfig.overlap, whose steps overlap the host's work with the GPU's",
    )
    ap.add_argument(
        "--kernel-variants",
        default="",
        metavar="NAMES",
        help=f"A/B of module-level kernel choices, each a separate engine on the same model: {sorted(KERNEL_VARIANTS)}",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests' sampling temperature (default 0: greedy, what the tables report)",
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="the requests' nucleus mass (default 1: off)")
    ap.add_argument("--seed", type=int, default=None, help="seeded requests (counter-based Gumbel draws)")
    ap.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="the requests ask for each token's logprob and K alternatives",
    )
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny presets)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile 5 steps at the smallest batch per preset (kernel table)",
    )
    ap.add_argument("--out", default=default or os.path.join(ROOT, "bench", "out", "e2e_decode.json"))
    args = ap.parse_args()
    if not 0 < args.ragged <= 1:
        ap.error(f"--ragged must lie in (0, 1], got {args.ragged}")
    global DEV, PROFILE, WALL, SAMPLING, LAYERS
    DEV = args.device
    WALL = args.wall_timing
    for preset in args.presets.split(","):  # a bad --layers stops the run before any model is built
        first_layers(preset, args.layers)
    LAYERS = args.layers
    SAMPLING = {
        k: v
        for k, v in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("seed", args.seed),
            ("logprobs", args.logprobs),
        )
        if v is not None and (k, v) not in (("temperature", 0.0), ("top_p", 1.0))
    }
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_e2e_decode.py needs a CUDA device (or --device cpu for a smoke run)")
    batches = [int(b) for b in args.batches.split(",")]
    out = args.out
    if os.path.isdir(out) or out.endswith(os.sep):
        out = os.path.join(out, "e2e_decode.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    if args.profile:
        PROFILE = os.path.dirname(out) or "."
    for preset in args.presets.split(","):
        try:
            for fuse in (True, False) if args.compare_unfused else (True,):
                variants = (
                    ((False, False), (True, False), (True, True)) if args.compare_fusion else ((None, None),)
                )
                names = [n for n in args.compare_flags.split(",") if n]
                flag_sets = [None]
                if names:
                    off = dict.fromkeys(names, False)
                    flag_sets = [off] + [{**off, n: True} for n in names]
                    if len(names) > 1:
                        flag_sets.append(dict.fromkeys(names, True))
                mlas = [m for m in args.mla_backends.split(",") if m]
                if mlas:  # each flag set once per MLA backend ("auto": the engine's default, None)
                    flag_sets = [
                        {**(fl or {}), "mla_backend": None if m == "auto" else m}
                        for fl in flag_sets
                        for m in mlas
                    ]
                kvs = [v for v in args.kernel_variants.split(",") if v] or [""]
                for name in kvs:
                    if name and name not in KERNEL_VARIANTS:
                        raise SystemExit(
                            f"unknown kernel variant {name!r}; expected one of {sorted(KERNEL_VARIANTS)}"
                        )
                for (ffn, res), small, fl, kv in itertools.product(
                    variants, (None,) if args.moe_small is None else (0, args.moe_small), flag_sets, kvs
                ):
                    run_preset(
                        preset,
                        batches,
                        args.context,
                        args.steps,
                        not args.no_graphs,
                        fuse,
                        small,
                        ffn,
                        res,
                        fl,
                        kv,
                        args.ragged,
                    )
        except Exception as e:
            ERRORS.append(f"{preset}: {e!r}")
            traceback.print_exc()
            empty_cache()
    print(table())
    if ERRORS:
        print("errors:", *ERRORS, sep="\n  ")
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    with open(out, "w") as f:
        json.dump(
            {
                "device": dev,
                "torch": torch.__version__,
                "rows": ROWS,
                "kernels_per_step": INFO_PROFILE,
                "errors": ERRORS,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
