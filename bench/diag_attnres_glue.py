"""Where the AttnRes model's non-reader ("glue") kernel time comes from, on the GPU.

One profiled training step (B4 T4096 bf16) of the ``medium`` model with AttnRes and of the same model with a plain
residual stream: per (aten op, input shapes), the device time and call count in each model, sorted by the
difference, and for the largest differences the openk3 source lines that issued them (Python stacks).

    python3 bench/diag_attnres_glue.py [--top 20] [--out diag_attnres_glue.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def _profile(step):
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True
    ) as p:
        step()
        torch.cuda.synchronize()
    return p


def _by_shape(prof) -> dict:
    """{(op, shapes): (device us, calls)} of the aten ops that launched kernels themselves."""
    out = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.self_device_time_total > 0 and e.key.startswith("aten::"):
            out[(e.key, str(e.input_shapes)[:120])] = (e.self_device_time_total, e.count)
    return out


def _stacks(prof, keys) -> dict:
    """{(op, shapes): {openk3 frame line: device us}} for the given keys."""
    want = set(keys)
    res: dict = {}
    for e in prof.events():
        k = (e.name, str(e.input_shapes)[:120])
        if k not in want or e.self_device_time_total <= 0:
            continue
        frames = [f for f in (e.stack or []) if "openk3" in f and "torch/" not in f][:3]
        where = " <- ".join(frames) or "(no openk3 frame: autograd engine)"
        d = res.setdefault(k, {})
        d[where] = d.get(where, 0.0) + e.self_device_time_total
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("diag_attnres_glue.py needs a CUDA GPU")
    from run_all import _paired_steps, timeit

    _, steps = _paired_steps(4, 4096)
    for st in steps.values():
        timeit(st, warmup=2, rep=1)
    profs = {name: _profile(st) for name, st in steps.items()}
    tabs = {name: _by_shape(p) for name, p in profs.items()}
    keys = set(tabs["attnres"]) | set(tabs["plain"])
    rows = []
    for k in keys:
        ta, ca = tabs["attnres"].get(k, (0.0, 0))
        tp, cp = tabs["plain"].get(k, (0.0, 0))
        rows.append((ta - tp, k, ta, ca, tp, cp))
    rows.sort(key=lambda r: -abs(r[0]))
    rows = rows[: a.top]
    print(f"{'diff ms':>8} {'attnres ms':>10} {'calls':>5} {'plain ms':>9} {'calls':>5}  op  shapes")
    for d, (op, sh), ta, ca, tp, cp in rows:
        print(f"{d / 1e3:8.3f} {ta / 1e3:10.3f} {ca:5d} {tp / 1e3:9.3f} {cp:5d}  {op}  {sh}")
    st = _stacks(profs["attnres"], [r[1] for r in rows if r[0] > 0])
    print("\nwhere the AttnRes model's extra op time comes from:")
    for _, k, *_ in rows:
        if k in st:
            print(f"  {k[0]} {k[1]}")
            for where, us in sorted(st[k].items(), key=lambda kv: -kv[1])[:3]:
                print(f"      {us / 1e3:7.3f} ms  {where}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"rows": [[d, list(k), ta, ca, tp, cp] for d, k, ta, ca, tp, cp in rows],
                 "stacks": {f"{k[0]} {k[1]}": v for k, v in st.items()}},
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
