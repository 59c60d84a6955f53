"""Does a deleted engine give its GPU memory back? Builds one random-weight model, then runs ``--engines`` engines
one after the other on it (prefill, a few decode steps, CUDA graphs as configured), deleting and collecting each.
After each it prints ``torch.cuda.memory_allocated()`` against the model alone, and the CUDA storages that Python
can still reach and that were not there before that engine (one tensor of each: shape, dtype, MiB, what holds it).

    python3 bench/diag_engine_memory.py [--preset medium] [--layers 0] [--engines 3] [--context 1040] [--batch 1]

Memory that grows without any such tensor is held outside Python's reach (CUDA graph pools, allocator blocks that a
C++ object keeps). ``--device cpu`` runs the script itself on the ``tiny`` preset (tensor counts only).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings
import weakref

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def _is_tensor(o) -> bool:
    try:
        return isinstance(o, torch.Tensor)
    except Exception:  # objects that fail isinstance mid-teardown
        return False


def _tensors(dev: str) -> dict[int, weakref.ref]:
    """Weak references to the reachable tensors on ``dev`` (weak: this script must not be what keeps them)."""
    gc.collect()
    out = {}
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        objs = gc.get_objects()
        tensors = [o for o in objs if _is_tensor(o)]
    del objs
    for o in tensors:
        if o.device.type == dev:
            out[id(o)] = weakref.ref(o)
    return out


def _name(o) -> str:
    """A short description of a referrer: an object whose attribute dict it is, a function whose closure cell it
    is, or its type."""
    if isinstance(o, dict):
        for u in gc.get_referrers(o):
            if getattr(u, "__dict__", None) is o:
                return f"{type(u).__qualname__}.__dict__"
        return f"dict({len(o)} keys)"
    if type(o).__name__ == "cell":
        for u in gc.get_referrers(o):
            if getattr(u, "__closure__", None) and o in u.__closure__:
                return f"closure of {u.__qualname__}"
        return "cell"
    return type(o).__qualname__


def _holders(t: torch.Tensor, skip: tuple) -> str:
    """What refers to ``t`` (and what refers to that), leaving out this script's own lists and frames. (Plain
    loops: a generator expression here would add closure cells of its own to the referrers.)"""
    mine = {id(x) for x in skip}
    out = []
    for r in gc.get_referrers(t):
        if id(r) in mine or type(r).__name__ == "frame":
            continue
        ups = []
        for u in gc.get_referrers(r):
            if type(u).__name__ != "frame" and id(u) not in mine and len(ups) < 3:
                ups.append(_name(u))
        out.append(f"{_name(r)} <- {' / '.join(ups) or '?'}")
    return "; ".join(out[:3]) or "(no Python referrer: held from C++ or by a frame)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--layers", type=int, default=0, help="the preset's first N decoder layers (0: all)")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--context", type=int, default=1040)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.engines < 1 or args.batch < 1 or args.context < 1:
        ap.error("--engines, --batch and --context must be >= 1")
    from bench_e2e_decode import first_layers
    from openk3.infer.engine import Engine, random_model
    from openk3.infer.sampling import SamplingParams

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("diag_engine_memory.py needs a CUDA device (or --device cpu)")
    preset = args.preset if dev == "cuda" else "tiny"
    over = first_layers(preset, args.layers)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = random_model(preset, device=dev, dtype=dtype, seed=0, **over)
    V = model.config.vocab_size

    def allocated() -> float:
        gc.collect()
        if dev != "cuda":
            return 0.0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**20

    base = last = allocated()
    before = _tensors(dev)
    print(f"model: {base:.1f} MiB allocated, {len(before)} reachable {dev} tensors", flush=True)
    g = torch.Generator().manual_seed(0)
    for k in range(args.engines):
        eng = Engine(
            model,
            None,
            page_size=16,
            max_seqs=args.batch,
            max_tokens=args.batch * (args.context + args.steps + 32),
            prefix_cache=False,
            use_cuda_graphs=not args.no_graphs,
            cuda_graph_max_batch=args.batch,
        )
        prompts = [torch.randint(0, V, (args.context,), generator=g).tolist() for _ in range(args.batch)]
        sp = [SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True)] * args.batch
        eng.generate(prompts, sp)
        during = allocated()
        del eng
        after = allocated()
        now = _tensors(dev)
        # the first engine's leftovers include the model's own caches (fused weights kept on its modules); later
        # engines should add nothing
        # new storage, not new tensor objects: a later engine may hang a new view on an earlier engine's buffer
        had = set()
        for r in before.values():
            if (t := r()) is not None:
                had.add(t.untyped_storage().data_ptr())
        new, seen = [], set()
        for i, r in now.items():
            t = r()
            if i in before or t is None:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in had and ptr not in seen:
                seen.add(ptr)
                new.append(t)
        mib = sum(t.untyped_storage().nbytes() for t in new) / 2**20
        print(
            f"engine {k}: {during - base:.1f} MiB while alive, {after - base:+.1f} MiB over the model after delete "
            f"({after - last:+.1f} MiB against the engine before); {len(new)} new reachable storages since the "
            f"{'model' if k == 0 else 'engine before'} ({mib:.1f} MiB)",
            flush=True,
        )
        top = sorted(new, key=lambda x: -x.untyped_storage().nbytes())[:8]
        while top:
            x = top.pop(0)
            print(
                f"    {tuple(x.shape)} {x.dtype} {x.untyped_storage().nbytes() / 2**20:.2f} MiB <- "
                f"{_holders(x, (new, top))}",
                flush=True,
            )
        x = t = new = had = seen = None
        before, last = now, after


if __name__ == "__main__":
    main()
