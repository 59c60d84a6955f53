"""Diagnostic: registers and spills of the few-token experts' gate/up kernel (``openk3.fast.moe_small``) per launch
tile, compiled for sm_90 on the CPU (``triton.compile`` + ``cuobjdump``; no GPU needed).

    python3 bench/diag_moe_compile.py [--experts 256] [--top-k 8] [--width 2304]
    python3 bench/diag_moe_compile.py --tiled [--width 2304] [--inter 1024] [--out FILE]

The tile is ``(rows, columns, stages)`` as ``OPENK3_MOE_UP_TILE``; the accumulators are ``rows x columns`` fp32 per
matrix, so wide tiles at 4 warps run out of registers, worst with the routing selection fused in (``SELECT``).
The selection's form follows ``moe_small.SELECT_TOPK`` (``OPENK3_MOE_SELECT_TOPK=0``: K max-reductions).

``--tiled``: the expert-tiled kernels of decode batches (``openk3.fast.moe_tiled``) instead, gate/up + GLU and
down, at ``moe_tiled.TILED``'s tiles with 16-, 32- and 64-row steps (``moe_tiled.rows_per_step``) and at a few
other tiles: registers, spills, shared memory, ``cp.async`` copies (the pipelined weight stream) and tensor-core
instructions, as JSON with ``--out``. The CPU interpreter does not type-check kernels, so this is where a kernel that
would not compile for the GPU shows first.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TILES = [(16, 256, 3, 4), (16, 256, 3, 8), (8, 256, 3, 4), (16, 128, 3, 4), (8, 512, 3, 4), (16, 256, 1, 4)]
# the expert-tiled kernels' (rows per program, columns per step, stages) besides moe_tiled.TILED's
TILED_EXTRA = [(64, 64, 4), (128, 128, 3)]


def _sig(fn) -> dict:
    """Argument types of the gate/up kernel on bf16 activations and weights."""
    from diag_kda_compile import signature

    return signature(
        fn,
        ptrs={"idx_ptr": "*i64"} | dict.fromkeys(("logit_ptr", "bias_ptr", "wt_ptr", "score_ptr"), "*fp32"),
        other_ptrs="*bf16",
        ints=("E", "W", "I"),
        int_prefixes=("s_", "s1", "s3"),
        floats=("b1", "ib1", "b2", "ib2", "scaling", "sb1", "isb1", "sb2", "isb2"),
    )


def tiled(width: int, inter: int, top_k: int, out: str) -> None:
    """sm_90 compiles of the expert-tiled gate/up and down kernels (bf16, SwiGLU) at their default tiles and at
    :data:`TILED_EXTRA`, sizes and strides marked divisible by 16 as a launch of the 48B shape marks them."""
    import json

    from diag_kda_compile import compile_one, signature
    from openk3.fast import moe_tiled

    c = moe_tiled.TILED
    ptrs = {"pair_ptr": "*i32", "offs_ptr": "*i32"}
    rows = []
    print(
        "| kernel | rows, columns, stages | pair rows per step, warps | registers | spill loads / stores | shared bytes "
        "| cp.async | MMA instrs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    up = moe_tiled._tiled_up_kernel
    down = moe_tiled._tiled_down_kernel
    nw = c["num_warps"]
    # the default tiles at each row step the auto rule takes (16 / 32 / 64; 64 also at 8 warps), the extra tiles at 16
    steps = [(16, nw), (32, nw), (64, nw), (64, 8)]
    forms = []
    for name, fn, tile in (
        ("gate/up", up, (c["bi"], c["bk"], c["stages"])),
        ("down", down, (c["bo"], c["bk_down"], c["stages"])),
    ):
        forms += [(name, fn, tile, bm, w, bm == 16 and w == nw) for bm, w in steps]
        forms += [(name, fn, t, 16, nw, False) for t in TILED_EXTRA]
    for name, fn, (r, k, st), bm, warps, default in forms:
        ints = ("nk", "s1_e", "s1_i", "s3_e", "s3_i") if fn is up else ("nk", "s2_e", "s2_w")
        sig = signature(fn, ptrs=ptrs, other_ptrs="*bf16", ints=ints, floats=("b1", "ib1", "b2", "ib2"))
        consts = dict(W=width, I=inter, BM=bm, STAGES=st, IEEE=False)
        if fn is up:
            consts.update(K=top_k, SITU=False, BI=r, BK=k)
        else:
            consts.update(BO=r, BK=k)
        res = compile_one(fn, consts, warps, sig=sig, div=ints)
        res.update(kernel=name, tile=[r, k, st], bm=bm, num_warps=warps, default=default)
        rows.append(res)
        print(
            f"| {name} | {r}, {k}, {st} | {bm}, {warps} | {res.get('regs')} | {res['spill_ld']} / {res['spill_st']} | "
            f"{res['shared']} | {res['cp_async']} | {res['mma']} |",
            flush=True,
        )
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("diag_moe_compile.py compiles kernels: run it without TRITON_INTERPRET=1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--width", type=int, default=2304)
    ap.add_argument("--inter", type=int, default=1024, help="--tiled: the experts' intermediate width")
    ap.add_argument("--tiled", action="store_true", help="the expert-tiled kernels of decode batches instead")
    ap.add_argument("--out", default="", help="--tiled: JSON of the compiles")
    args = ap.parse_args()
    if args.tiled:
        tiled(args.width, args.inter, args.top_k, args.out)
        return
    import triton

    from diag_kda_compile import compile_one
    from openk3.fast import moe_small

    fn = moe_small._experts_up_kernel
    base = dict(
        K=args.top_k, SITU=False, PDL=True, KP=triton.next_power_of_2(args.top_k),
        EP=triton.next_power_of_2(args.experts), SOFTMAX=False, HAS_BIAS=True, RENORM=True, K1=0, KT=0, SHARED=0,
        TOPK=moe_small.SELECT_TOPK["on"],
    )  # fmt: skip
    print(
        "| tile (rows, columns, stages) | warps | fused selection | registers | spill loads / stores | shared bytes |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for rows, cols, stages, warps in TILES:
        for select in (True, False):
            c = dict(
                base, SELECT=select, BLOCK_I=rows, BLOCK_W=cols, NW=-(-args.width // cols), STAGES=stages
            )
            sig = _sig(fn)
            # the 48B shape's sizes and strides are multiples of 16: marked so, as a launch would mark them
            r = compile_one(fn, c, warps, sig=sig, div=[n for n, t in sig.items() if t == "i32"])
            print(
                f"| {rows}, {cols}, {stages} | {warps} | {select} | {r.get('regs')} | "
                f"{r['spill_ld']} / {r['spill_st']} | {r['shared']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
