"""Diagnostic: the absorbed MLA decode kernel beside FlashInfer's paged MLA decode (its Hopper ``fa3`` form, a
warp-specialised kernel of the FlashMLA kind) on the same paged latent cache, checked against each other and against
the PyTorch reference, timed as replays of a CUDA graph holding 20 calls (host work and FlashInfer's host-side plan
excluded), beside the HBM roofline (latent bytes over the measured copy bandwidth) and the MMA floor (the
products' FLOP -- 576 + 512 multiply-adds per token and head, the heads padded to 64-row tiles as Hopper's warpgroup
MMAs run them -- over a dense bf16 matmul's measured rate): with many heads the second is the higher.

    python3 bench/diag_mla_peer.py [--shapes 1x32x1040,64x16x8192,64x96x8192] [--page-size 16] [--uniform]
                                   [--variants ours,bal,w8,gluon] [--out PATH]

Lengths are ragged (each row uniform in [L/2, L], row 0 at L) unless ``--uniform``. Our kernel runs in the forms
named by ``--variants`` (default ``ours,bal``): ``ours`` its per-row splits (each row cut in the same number of
shares), ``bal`` its balanced splits (``balance=True``: the programs share the batch's tokens evenly), ``w8`` the
Triton tile at 8 warps, ``gluon`` the warp-specialised Gluon kernel (:mod:`openk3.infer.mla_gluon`, Hopper only).

The FlashInfer column runs the engine's step (``openk3.infer.mla_peer.FlashInferDecodeStep``, which
``EngineConfig.mla_backend="flashinfer"`` uses); its host-side plan is timed apart (``peer_plan_us``).
FlashInfer is optional (``pip install flashinfer-python``; its kernels compile on first use with the CUDA toolkit's
``nvcc``); without it only our kernel and the reference run. FlashInfer takes bf16 queries and writes a bf16
output; ours takes the fp32 absorbed query (rounded to the cache's dtype inside) and writes fp32. The comparison
rounds both outputs to bf16.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

DC, DR = 512, 64
# our kernel's forms (mla_decode_triton keywords) and their table labels
VARIANTS = {
    "ours": dict(balance=False, gluon=False),
    "bal": dict(balance=True, gluon=False),
    # the many-head tile at 8 warps (no spills in its sm_90 compile, against 32 at 4 warps)
    "w8": dict(balance=False, gluon=False, num_warps=8),
    "gluon": dict(gluon=True),
    # the Gluon split walk (one program per head block, split and row) instead of the persistent walk
    "gluon_split": dict(gluon=True, gluon_config={"persistent": False}),
    # the persistent walk at any row count (by default it starts at MLA_GLUON_CONFIG["persist_min_rows"] rows)
    "gluon_persist": dict(gluon=True, gluon_config={"persist_min_rows": 1}),
    # 32-token blocks, a ring of four
    "gluon_n32": dict(gluon=True, gluon_config={"block_n": 32, "stages": 4}),
    # the two warp groups scoring alternate blocks
    "gluon_pp": dict(gluon=True, gluon_config={"pingpong": True}),
    # the same with 32-token blocks in a ring of four (3 spilled values in its sm_90 compile, against ~80)
    "gluon_pp32": dict(
        gluon=True, gluon_config={"pingpong": True, "block_n": 32, "stages": 4, "pv_regs": 240}
    ),
}
LABELS = {
    "ours": "ours, per-row splits",
    "bal": "ours, balanced",
    "w8": "ours, 8 warps",
    "gluon": "ours, Gluon",
    "gluon_split": "ours, Gluon split walk",
    "gluon_persist": "ours, Gluon persistent (any rows)",
    "gluon_n32": "ours, Gluon N32 x4",
    "gluon_pp": "ours, Gluon ping-pong",
    "gluon_pp32": "ours, Gluon ping-pong N32 x4",
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    from diag_mla import graph_us
    from openk3.infer.decode import mla_decode_reference
    from openk3.infer.kernels import MLA_LAST_LAUNCH, mla_decode_triton
    from openk3.infer.mla_peer import FlashInferDecodeStep, flashinfer_available
    from run_all import copy_rate, matmul_rate

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x32x1040,64x16x8192,64x96x8192,16x96x16384,256x96x4096")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--uniform", action="store_true", help="every row at L tokens (default: ragged)")
    ap.add_argument(
        "--out",
        default=os.path.join(os.environ.get("OUT", os.path.join(ROOT, "bench", "out")), "diag_mla_peer.json"),
    )
    ap.add_argument(
        "--variants",
        default="ours,bal",
        help=f"our kernel's forms, comma separated (ours, the per-row splits, always runs): {', '.join(VARIANTS)}",
    )
    a = ap.parse_args()
    variants = ["ours"] + [v for v in a.variants.split(",") if v and v != "ours"]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        sys.exit(f"--variants: unknown {bad} (known: {', '.join(VARIANTS)})")
    from openk3.infer.mla_gluon import HAS_GLUON

    gluon_ok = HAS_GLUON and torch.cuda.get_device_capability()[0] == 9
    if any(v.startswith("gluon") for v in variants) and not gluon_ok:
        print("gluon: skipped (needs Triton's Gluon and a Hopper GPU)")
    ok, why = flashinfer_available()
    print(f"flashinfer: {'yes' if ok else 'no (' + why + ')'}")
    bw = copy_rate()[0] / 1e12  # bytes read + written per second
    print(f"copy bandwidth {bw:.2f} TB/s")
    mm = matmul_rate()[0] / 1e12  # dense bf16 FLOP per second
    print(f"bf16 matmul {mm:.0f} TFLOP/s")
    ps = a.page_size
    scale = 192**-0.5
    rows = []
    for spec in a.shapes.split(","):
        B, H, L = (int(v) for v in spec.split("x"))
        torch.manual_seed(B * 1000 + H)
        pages = -(-L // ps)
        kv = torch.randn(B * pages + 1, ps, DC + DR, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
        # ragged lengths: L at most, every row at least half of it
        lengths = torch.randint(L // 2, L + 1, (B,), device="cuda", dtype=torch.int32)
        lengths[0] = L
        if a.uniform:
            lengths.fill_(L)
        q = torch.randn(B, H, DC + DR, device="cuda")
        latent_bytes = int(lengths.sum()) * (DC + DR) * 2
        # FLOP of the two products, per token and head 2 x (576 + 512), heads padded to 64-row MMA tiles
        mma_flop = int(lengths.sum()) * -(-H // 64) * 64 * 2 * (DC + DR + DC)
        row = {
            "shape": spec,
            "latent_MB": latent_bytes / 1e6,
            "roofline_us": latent_bytes / (bw * 1e12) * 1e6,
            "mma_floor_us": mma_flop / (mm * 1e12) * 1e6,
        }
        fns = {
            v: functools.partial(
                mla_decode_triton, q, kv, table, lengths, scale=scale, kv_lora_rank=DC, **VARIANTS[v]
            )
            for v in variants
            if not v.startswith("gluon") or gluon_ok
        }
        outs = {}
        for v, fn in fns.items():
            outs[v] = fn()
            row[f"{v}_splits"] = MLA_LAST_LAUNCH["splits"]
        ours = outs["ours"]
        row["splits"] = row["ours_splits"]
        for v in fns:
            if v != "ours":
                row[f"{v}_vs_ours_rel"] = rel(outs[v], ours)
        ref = None
        if B * H * L <= 64 * 16 * 8192:
            ref = mla_decode_reference(q, kv, table, lengths, scale=scale, kv_lora_rank=DC)
            for v in fns:
                row[f"{v}_rel_err"] = rel(outs[v].bfloat16(), ref)
        for v, fn in fns.items():
            row[f"{v}_us"] = graph_us([fn] * 20)
            row[f"{v}_TBps"] = latent_bytes / (row[f"{v}_us"] * 1e-6) / 1e12
        if ok:
            # the engine's FlashInfer step: planned on the host from the host table and lengths, then run
            peer = FlashInferDecodeStep(
                torch.device("cuda"), num_heads=H, page_size=ps, scale=scale, kv_lora_rank=DC, rope_dim=DR,
                dtype=torch.bfloat16, max_pages_per_seq=pages,
            )  # fmt: skip
            table_h, lengths_h = table.cpu(), lengths.cpu()
            torch.cuda.synchronize()
            peer.plan(table_h, lengths_h, graph=True)  # first plan: FlashInfer compiles its kernels
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                peer.plan(table_h, lengths_h, graph=True)
            row["peer_plan_us"] = (time.perf_counter() - t0) / 10 * 1e6
            peer_fn = functools.partial(peer, q, kv, table, lengths, scale=scale, kv_lora_rank=DC)
            theirs = peer_fn()
            row["peer_vs_ours_rel"] = rel(theirs, ours.bfloat16().float())
            if ref is not None:
                row["peer_rel_err"] = rel(theirs, ref)
            row["peer_us"] = graph_us([peer_fn] * 20)
            row["peer_TBps"] = latent_bytes / (row["peer_us"] * 1e-6) / 1e12
            del peer, peer_fn
        rows.append(row)
        print(json.dumps(row), flush=True)
        del fns, outs, ours, ref
        torch.cuda.empty_cache()
    print()
    kind = "uniform" if a.uniform else "ragged, L max"
    cols = [v for v in variants if any(f"{v}_us" in r for r in rows)]
    print(
        f"| B x H x L ({kind}) | latent MB | roofline us | MMA floor us | "
        + " | ".join(f"{LABELS[v]} us (TB/s)" for v in cols)
        + " | FlashInfer fa3 us (TB/s) | rel err "
        + " / ".join(cols)
        + " / fa3 |"
    )
    print("| --- | --- | --- | --- | " + "--- | " * len(cols) + "--- | --- |")
    for r in rows:
        p = f"{r['peer_us']:.1f} ({r['peer_TBps']:.2f})" if "peer_us" in r else "--"
        e = " / ".join(f"{r.get(k + '_rel_err', float('nan')):.1e}" for k in [*cols, "peer"])
        t = " | ".join(f"{r[v + '_us']:.1f} ({r[v + '_TBps']:.2f})" if v + "_us" in r else "--" for v in cols)
        print(
            f"| {r['shape']} | {r['latent_MB']:.1f} | {r['roofline_us']:.1f} | {r['mma_floor_us']:.1f} | {t} | {p} "
            f"| {e} |"
        )
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"copy_TBps": bw, "matmul_TFLOPs": mm, "uniform": a.uniform, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
