"""Diagnostic, no GPU needed: compiles the absorbed MLA split kernel for sm_90 (Hopper) on this machine, per-row
and balanced split forms, and prints registers per thread, spill instructions, shared memory and SASS size (through
the ``cuobjdump`` that ships with Triton), so that a form's code generation can be compared before a GPU run.

    python3 bench/diag_mla_compile.py [--configs many,few,gluon] [--rows 16,64] [--out PATH]

Each configuration is an ``MLA_CONFIG`` regime ("many": more than 16 heads, "few": 16 or fewer); the balanced
form is compiled for each row count in ``--rows`` (its ``BP``, the rows padded to a power of two, is a compile-time
constant). "gluon": the warp-specialised Gluon split kernel (:mod:`openk3.infer.mla_gluon`), writing partials and
writing the output (one split), and its persistent walk with that walk's Triton preparation and reduce kernels; it
also reports the Gluon kernels' warpgroup MMAs, TMA loads and per-partition register budgets. bf16 latent cache, pages of 16 tokens, partials written (several splits). Run without
``TRITON_INTERPRET`` in the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _signature(fn) -> dict:
    """Argument types of the split kernel as the engine launches it (fp32 queries and outputs, bf16 cache, int32
    table and lengths)."""
    from diag_kda_compile import signature

    return signature(
        fn,
        ptrs={"kv_ptr": "*bf16", "bt_ptr": "*i32", "len_ptr": "*i32"},
        other_ptrs="*fp32",
        ints=("H", "NS", "B", "NP"),
        floats=("scale_log2",),
    )


def _gluon_rows(page: int) -> list[dict]:
    """sm_90 compiles of the Gluon split kernel as :func:`openk3.infer.mla_gluon.mla_split_gluon` launches it
    (bf16 cache, fp32 queries and outputs), writing partials and writing the output."""
    from triton.experimental.gluon import language as gl

    import openk3.infer.mla_gluon as MG
    from diag_kda_compile import compile_one, signature

    if not MG.HAS_GLUON:
        sys.exit("--configs gluon: this Triton has no Gluon")
    cfg = MG.MLA_GLUON_CONFIG
    box = min(page, cfg["block_n"])
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    fn = MG._mla_split_gluon_kernel
    sig = signature(
        fn,
        ptrs={"kv_desc": f"tensordesc<bf16[{box}, 64],{layout!r}>", "bt_ptr": "*i32", "len_ptr": "*i32"},
        other_ptrs="*fp32",
        ints=("H", "NS", "oob_row"),
        floats=("scale_log2",),
    )
    rows = []
    common = dict(
        PAGE=page, BOX=box, BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], STAGES=cfg["stages"],
        PV_REGS=cfg["pv_regs"], LOAD_REGS=cfg["load_regs"],
    )  # fmt: skip
    for label, out in (("partials", 0), ("one split", 1)):
        consts = dict(common, OUT=out, PINGPONG=bool(cfg["pingpong"]))
        r = compile_one(fn, consts, 4, maxnreg=cfg["maxnreg"], sig=sig, gluon=True)
        r.update(config="gluon", form=label)
        rows.append(r)
    # the persistent walk (query rows by TMA too)
    fn = MG._mla_persist_gluon_kernel
    desc = f"tensordesc<bf16[{{}}, 64],{layout!r}>"
    sig = signature(
        fn,
        ptrs={
            "kv_desc": desc.format(box), "q_desc": desc.format(cfg["block_h"]), "bt_ptr": "*i32", "len_ptr": "*i32",
            "plan_ptr": "*i32",
        },
        other_ptrs="*fp32",
        ints=("H", "B", "oob_row"),
        floats=("scale_log2",),
    )  # fmt: skip
    consts = dict(common, LOAD_REGS=cfg["persist_load_regs"])
    r = compile_one(fn, consts, 4, maxnreg=cfg["maxnreg"], sig=sig, gluon=True)
    r.update(config="gluon", form="persistent")
    rows.append(r)
    return rows


def _persist_triton_rows() -> list[dict]:
    """sm_90 compiles of the persistent Gluon walk's Triton kernels: its preparation (query rows and plan) and the
    reduce of its slots, plain and with the post step folded in (the CPU interpreter does not type-check a kernel
    the way the compiler does: these compiles do)."""
    import openk3.infer.kernels as KN
    from diag_kda_compile import compile_one, signature

    plans = {"len_ptr": "*i32", "plan_ptr": "*i32"}
    prep = KN._mla_persist_prep_kernel
    reduce_, post = KN._mla_reduce_kernel, KN._mla_reduce_post_kernel
    common = dict(DC=512, BLOCK_N=64, BS=8, PDL=False, BAL=2, BP=1, PH=64)
    jobs = (
        ("persistent prep", prep, {**plans, "qb_ptr": "*bf16"}, ("H", "B", "G", "WMIN", "ALIGN"),
         dict(D=576, PH=64, BLOCK_N=64, BP=64, CB=32, INTERP=False)),
        ("persistent reduce", reduce_, plans, ("H", "NS", "B", "NP"), common),
        ("persistent reduce + post", post, {**plans, "wuv_ptr": "*bf16", "gate_ptr": "*bf16", "o_ptr": "*bf16"},
         ("H", "NS", "B", "NP"), dict(common, DV=128, VB=64, VC=32, STAGES=2, GATE=True, WHOLE=False)),
    )  # fmt: skip
    rows = []
    for label, fn, ptrs, ints, consts in jobs:
        sig = signature(fn, ptrs=ptrs, other_ptrs="*fp32", ints=ints)
        r = compile_one(fn, consts, 4, sig=sig)
        r.update(config="gluon", form=label)
        rows.append(r)
    return rows


def main():
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("diag_mla_compile.py compiles kernels: run it without TRITON_INTERPRET=1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="many,few", help="MLA_CONFIG regimes to compile")
    ap.add_argument("--rows", default="16,64", help="row counts for the balanced form (its BP)")
    ap.add_argument("--page", type=int, default=16, help="page size in tokens")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import triton

    import openk3.infer.kernels as KN
    from diag_kda_compile import compile_one

    fn = KN._mla_split_kernel
    sig = _signature(fn)
    rows = []
    for name in [c for c in args.configs.split(",") if c]:
        if name not in ("many", "few", "gluon"):
            sys.exit(f"--configs: unknown regime {name!r} (many, few, gluon)")
        if name == "gluon":
            for r in _gluon_rows(args.page) + _persist_triton_rows():
                rows.append(r)
                print(json.dumps(r), flush=True)
            continue
        cfg = KN.MLA_CONFIG[name]
        bn = cfg["BLOCK_N"]
        mode = 1 if args.page % bn == 0 else 2 if bn % args.page == 0 else 0
        forms = [("per-row", False, 1)] + [
            (f"balanced, {b} rows", True, triton.next_power_of_2(int(b))) for b in args.rows.split(",") if b
        ]
        for label, bal, bp in forms:
            consts = dict(
                PAGE=args.page, MODE=mode, DIRECT=False, DC=512, DR=64, BLOCK_H=cfg["block_h"], BLOCK_N=bn,
                F32=False, TRANS=cfg["trans"], PREFETCH=int(cfg["prefetch"]), STAGES=cfg["num_stages"],
                INTERP=False, PDL=False, BAL=bal, BP=bp,
            )  # fmt: skip
            r = compile_one(fn, consts, cfg["num_warps"], sig=sig, div=("H",))
            r.update(config=name, form=label)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("| config | form | registers | spill loads / stores | shared KB | SASS instructions |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['config']} | {r['form']} | {r.get('regs')} | {r['spill_ld']} / {r['spill_st']} | "
            f"{r['shared'] / 1024:.0f} | {r['sass_instrs']} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
