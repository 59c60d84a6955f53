"""Diagnostic, no GPU needed: compiles the KDA decode kernels for sm_90 (Hopper) on this machine and prints each
configuration's registers per thread, spills and shared memory (from the cubin, through the ``cuobjdump`` that
ships with Triton), so launch parameters can be checked before a GPU run.

    python3 bench/diag_kda_compile.py [--split 2,4,8] [--warps 4,8] [--prefetch 2] [--maxnreg 0] [--out PATH]

Shapes: the Kimi-Linear-48B layer (H=32, K=128, W=4, bf16, low-rank decay and low-rank output gate of rank 128)
and the ``medium`` preset's (H=16, K=128, full-rank gate, low-rank decay of rank 128). Run without
``TRITON_INTERPRET`` in the environment. The specialisation mirrors a launch on real tensors: pointers and the row
strides divisible by 16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

SHAPES = {
    "48b": dict(H=32, K=128, W=4, ZR=128, GR=128, LB_GATE=False),
    "medium": dict(H=16, K=128, W=4, ZR=128, GR=0, LB_GATE=True),
}


def signature(
    fn, *, ptrs: dict | None = None, other_ptrs: str, ints=(), int_prefixes=("s_",), floats=()
) -> dict:
    """Argument types of the Triton kernel ``fn`` for an sm_90 compile: pointers named in ``ptrs`` get their type
    there, other ``*_ptr`` arguments ``other_ptrs``; arguments named in ``ints`` or starting with one of
    ``int_prefixes`` are i32, those in ``floats`` fp32, the rest constexprs."""
    ptrs = ptrs or {}
    sig = {}
    for name in fn.arg_names:
        if name in ptrs:
            sig[name] = ptrs[name]
        elif name.endswith("_ptr"):
            sig[name] = other_ptrs
        elif name in ints or name.startswith(tuple(int_prefixes)):
            sig[name] = "i32"
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "constexpr"
    return sig


def _types(fn, dtype: str) -> dict:
    """Argument types of a KDA decode kernel launched on model tensors (activations and projection weights in the
    model dtype, the conv / gate / norm parameters and the caches fp32)."""
    fp32_ptrs = (
        "wq_ptr",
        "wk_ptr",
        "wv_ptr",
        "a_log_ptr",
        "dt_bias_ptr",
        "norm_w_ptr",
        "conv_ptr",
        "state_ptr",
    )
    ptrs = {n: "*fp32" for n in (*fp32_ptrs, "sg_ptr", "ss_ptr")} | {"slots_ptr": "*i64", "cnt_ptr": "*i32"}
    return signature(fn, ptrs=ptrs, other_ptrs=f"*{dtype}", floats=("lower_bound", "eps", "q_scale"))


def compile_one(
    fn, consts: dict, num_warps: int, dtype: str = "bf16", maxnreg: int = 0, sig=None, div=(), gluon=False
) -> dict:
    """sm_90 compile of ``fn`` (argument types ``sig``, default: a KDA decode kernel's) with the constexprs
    ``consts``: registers, spills, barriers, instructions. Pointers and ``s_*`` strides are marked divisible by 16,
    and so are the integer arguments named in ``div``: a launch gets that mark for every integer argument that is a
    multiple of 16 (Triton's specialisation), and without it loads are not vectorised or staged through shared
    memory (cp.async), so the registers and shared memory reported would not be the launched kernel's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = sig or _types(fn, dtype)
    missing = [n for n, t in sig.items() if t == "constexpr" and n not in consts]
    if missing:
        raise ValueError(f"constexprs not given: {missing}")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n].startswith("*") or n.startswith("s_") or n in div
    }
    if gluon:  # a Gluon kernel (triton.experimental.gluon): its own front end
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    res = {"num_warps": num_warps, "maxnreg": maxnreg, "shared": c.metadata.shared}
    res["cp_async"] = len(re.findall(r"cp\.async\.(?:ca|cg)", c.asm["ptx"]))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m:
        res.update(regs=int(m[1]), stack=int(m[2]), local=int(m[4]))
    # spills: local-memory loads and stores in the machine code; barriers: bar.sync count
    res["spill_ld"] = len(re.findall(r"\bLDL\b", sass))
    res["spill_st"] = len(re.findall(r"\bSTL\b", sass))
    res["bar_sync"] = len(re.findall(r"\bBAR\.SYNC", sass))
    # warpgroup MMAs, TMA loads and per-partition register budgets (warp-specialised kernels)
    res["hgmma"] = len(re.findall(r"\bHGMMA\.", sass))
    res["mma"] = len(re.findall(r"\bHMMA\.", sass)) + res["hgmma"]  # tensor-core instructions of either kind
    res["tma_loads"] = len(re.findall(r"\bUTMALDG\b", sass))
    res["setmaxnreg"] = sorted(
        {int(x, 16) for x in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d+, )?0x([0-9a-f]+)", sass)}
    )
    res["sass_instrs"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
    return res


def main():
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("diag_kda_compile.py compiles kernels: run it without TRITON_INTERPRET=1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split", default="2,4,8", help="split_v values (programs per (row, head))")
    ap.add_argument("--warps", default="4,8", help="num_warps values of the split form")
    ap.add_argument("--prefetch", type=int, default=2, help="split_prefetch: 0 none, 1 L1, 2 L2")
    ap.add_argument("--maxnreg", type=int, default=0, help="split_maxnreg: register cap (0: none)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import openk3.infer.kernels as KN

    rows = []
    for name, sh in SHAPES.items():
        H, K, W = sh["H"], sh["K"], sh["W"]
        common = dict(H=H, K=K, W=W, LB_GATE=sh["LB_GATE"], ZR=sh["ZR"], GR=sh["GR"])
        common["PDL"] = False
        split = dict(common, PF=args.prefetch)
        for nv in (int(x) for x in args.split.split(",") if x):
            for nw in (int(x) for x in args.warps.split(",") if x):
                r = compile_one(KN._kda_decode_split_kernel, {**split, "NV": nv}, nw, maxnreg=args.maxnreg)
                rows.append({"shape": name, "form": f"split_v={nv}", **r})
                print(json.dumps(rows[-1]), flush=True)
        # the one-program-per-(row, head) form in the few-row configuration, for comparison
        old = dict(
            common,
            WP=1 << (W - 1).bit_length(),
            BV=KN.KDA_CONFIG["BV"],
            STAGES=0,
            PF_L2=False,
            HEADS_FAST=False,
        )
        old.update(ZRC=min(32, sh["ZR"]) if sh["ZR"] else 1, GRC=min(32, sh["GR"]) if sh["GR"] else 1)
        r = compile_one(KN._kda_decode_kernel, old, KN.KDA_CONFIG["num_warps"])
        rows.append({"shape": name, "form": f"per-head BV={old['BV']}", **r})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
