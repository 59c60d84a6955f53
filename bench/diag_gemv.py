"""Diagnostic: the decode step's projections at one to a few rows, cuBLAS (``F.linear``) against the Triton GEMV
(``openk3.infer.gemv``) at its default launch parameters and a sweep of others, beside the copy roofline.

    python3 bench/diag_gemv.py [--presets medium,kimi-linear-48b] [--rows 1,4] [--sweep] [--out PATH]

Shapes: every distinct ``[N, K]`` weight the engine's decode step multiplies (from the engine's plan of the preset cut
to four layers: a dense, two KDA + MoE and an MLA + MoE layer; the LM head included). Timing: one CUDA
graph holding each product 24+ times over enough weight copies (>= 256 MB in all) that every call reads its weight
from HBM, as in a decode step; microseconds per call and TB/s of weight bytes. "PDL" replays the GEMV chain with
programmatic dependent launch: each GEMV requests its weights while the one before drains (the engine's
``EngineConfig.pdl``). Roofline: weight bytes over this run's measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

WHOLE = [dict(BN=bn, BK=0, num_warps=w, num_stages=1) for bn in (2, 4, 8) for w in (4, 8)]
LOOP = [dict(BN=bn, BK=bk, num_warps=4, num_stages=1) for bn, bk in ((16, 256), (32, 256), (16, 512))]
# the persistent whole-row form: (rows per tile, programs per SM)
PERSIST = [
    dict(BN=bn, BK=0, num_warps=4, num_stages=1, persist=p)
    for bn, p in ((2, 4), (4, 2), (4, 4), (2, 8), (8, 2))
]


def decode_shapes(preset: str, device: str = "cuda") -> list[tuple[int, int]]:
    """Distinct ``(N, K)`` of the weights the engine's decode step multiplies by ``[1, K]`` rows for ``preset`` (cut
    to four layers: a dense, two KDA + MoE and an MLA + MoE layer), from the engine's plan (no decode run: nothing
    else to compile)."""
    import bench_e2e_decode as E2E
    from openk3.infer.engine import Engine

    E2E.DEV = device
    model = E2E.build(preset, **E2E.first_layers(preset, 4))
    eng = Engine(model, None, max_seqs=1, max_tokens=256, use_cuda_graphs=False, prefix_cache=False)
    ws = [model.output_weight]
    for i, layer in enumerate(model.model.layers):
        m = layer.self_attn
        ws += [eng._fused[i][0]] if i in eng._fused else [p.weight for p in eng._input_projections(layer)]
        ws.append(m.o_proj.weight)
        if layer.attn_type != "kda" and m.q_lora_rank is not None:
            ws.append(m.q_b_proj.weight)
        ws += (
            [eng._fused_ffn[i][0]]
            if i in eng._fused_ffn
            else [p.weight for p in layer.ffn_input_projections()]
        )
        if i in eng._fused_ffn_out:
            ws.append(eng._fused_ffn_out[i])
        else:
            ws += [p.weight for p in layer.ffn_output_projections() if p is not None]
    shapes = list(dict.fromkeys((w.shape[0], w.shape[1]) for w in ws))
    del model, eng, ws
    if device == "cuda":
        torch.cuda.empty_cache()
    return shapes


def copy_tbs() -> float:
    """Device-to-device copy bandwidth (read + written bytes), TB/s (bench/run_all.py's measurement)."""
    from run_all import copy_rate

    return copy_rate()[0] / 1e12


def main():
    from diag_mla import graph_us
    from openk3.fast import _triton
    from openk3.infer.gemv import Normed, _whole_width, gemv, gemv_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="medium,kimi-linear-48b")
    ap.add_argument("--rows", default="1")
    ap.add_argument(
        "--sweep", action="store_true", help="also time the WHOLE and LOOP launch configurations (1 row)"
    )
    ap.add_argument(
        "--sweep-set",
        default="whole,loop",
        help="comma-separated sets of --sweep: whole, loop, persist (the persistent whole-row form)",
    )
    ap.add_argument("--min-mb", type=float, default=0.0, help="only weights of at least this many MB")
    ap.add_argument(
        "--normed", action="store_true", help="also time the product of an RMS-normed row (gemv.Normed)"
    )
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", os.path.join(ROOT, "bench", "out")), "gemv.json")
    )
    args = ap.parse_args()
    bw = copy_tbs()
    print(f"copy bandwidth {bw:.2f} TB/s", flush=True)
    shapes: dict[tuple[int, int], list[str]] = {}
    for p in args.presets.split(","):
        for nk in decode_shapes(p):
            shapes.setdefault(nk, []).append(p)
    rows_out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = {"whole": WHOLE, "loop": LOOP, "persist": PERSIST}
    configs = [c for name in args.sweep_set.split(",") if name for c in sets[name]]
    for (N, K), who in sorted(shapes.items()):
        nbytes = N * K * 2
        if nbytes < args.min_mb * 1e6:
            continue
        copies = max(2, min(64, -(-256 * 2**20 // nbytes)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(copies)]
        reps = max(1, -(-24 // copies))
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = F.linear(x, ws[0])
            err = float((gemv(x, ws[0]).float() - ref.float()).norm() / ref.float().norm())

            def t(fn, ws=ws, reps=reps):
                return graph_us([(lambda w=w: fn(w)) for w in ws] * reps)

            row = dict(N=N, K=K, M=M, MB=nbytes / 1e6, presets=who, rel_err=err, roof_us=nbytes / bw / 1e6)
            row["cublas_us"] = t(lambda w, x=x: F.linear(x, w))
            row["gemv_us"] = t(lambda w, x=x: gemv(x, w))
            row["config"] = gemv_config(M, N, K, x.device)
            with _triton.pdl_scope(True):
                row["gemv_pdl_us"] = t(lambda w, x=x: gemv(x, w))
            if args.normed:
                gain = torch.ones(K, device="cuda", dtype=torch.bfloat16)
                row["gemv_normed_us"] = t(lambda w, x=x, gain=gain: gemv(Normed(x, gain, 1e-6), w))
            if args.sweep and M == 1:
                sweep = {}
                for c in configs:
                    if c["BK"] == 0 and c["BN"] * _whole_width(K) > 32768:
                        continue
                    if c["BK"] and c["BK"] >= K:
                        continue
                    name = f"{'W' if c['BK'] == 0 else 'L' + str(c['BK'])}bn{c['BN']}w{c['num_warps']}"
                    if c.get("persist"):
                        name = f"P{c['persist']}bn{c['BN']}"
                    sweep[name] = t(lambda w, c=c, x=x: gemv(x, w, config=c))
                best = min(sweep, key=sweep.get)
                row.update(sweep=sweep, best=best, best_us=sweep[best])
            rows_out.append(row)
            print(
                f"N {N:6d} K {K:5d} M {M} {row['MB']:7.1f} MB | cuBLAS {row['cublas_us']:7.1f} us "
                f"({row['MB'] / row['cublas_us']:.2f} TB/s) | gemv {row['gemv_us']:7.1f} "
                f"({row['MB'] / row['gemv_us']:.2f}) pdl {row['gemv_pdl_us']:7.1f} | roof {row['roof_us']:6.1f} | "
                + (f"normed {row['gemv_normed_us']:.1f} | " if "gemv_normed_us" in row else "")
                + (f"best {row['best']} {row['best_us']:.1f} | " if "best" in row else "")
                + (
                    " ".join(f"{k} {v:.1f}" for k, v in row["sweep"].items()) + " | "
                    if "sweep" in row
                    else ""
                )
                + f"err {err:.1e} {row['config']}",
                flush=True,
            )
        ws.clear()
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_tbs": bw, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
