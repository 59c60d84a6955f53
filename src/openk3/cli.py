"""``openk3`` command line. Each command has ``--help`` with an example; errors print one line that says what to do.

Subcommands living in other modules register themselves through ``register(subparsers)`` (see ``_PLUGINS``); a
module that is missing (optional extra not installed) is simply not offered.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

_PLUGINS = [
    "openk3.cost_cli",
    "openk3.train.cli",
    "openk3.infer.cli",
]


def _load_config(spec: str):
    import os

    from openk3.config import K3Config, get_preset

    if os.path.exists(spec):
        return K3Config.from_pretrained(spec)
    return get_preset(spec)


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.4f} {unit}" if unit == "T" else f"{n / div:.2f} {unit}"
    return str(int(n))


def cmd_params(args) -> int:
    import torch

    from openk3.model import K3ForCausalLM

    cfg = _load_config(args.config)
    with torch.device("meta"):
        m = K3ForCausalLM(cfg)
    total, active = m.num_parameters(), m.num_active_parameters()
    if args.json:
        print(json.dumps({"config": args.config, "total": total, "active": active}))
    else:
        print(
            f"{args.config}: total {_fmt(total)} parameters ({total:,}); "
            f"active per token {_fmt(active)} ({active:,}; excludes the input embedding)"
        )
    return 0


def cmd_demo(args) -> int:
    """Build a preset, run forward + backward and a short greedy generation on CPU."""
    import torch

    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM

    torch.manual_seed(args.seed)
    cfg = get_preset(args.preset)
    m = K3ForCausalLM(cfg)
    print(
        f"preset {args.preset}: {m.num_parameters():,} parameters, {m.num_active_parameters():,} active per token"
    )
    print(
        f"layers: {''.join('K' if t == 'kda' else 'M' for t in cfg.layer_types)} (K = KDA, M = MLA), "
        f"AttnRes block {cfg.attn_res_block_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_token}"
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    t0 = time.perf_counter()
    out = m(ids, labels=ids)
    out.loss.backward()
    print(
        f"forward+backward on [2, 64]: loss {out.loss.item():.4f} (ln V = {torch.log(torch.tensor(float(cfg.vocab_size))):.4f})"
        f" in {time.perf_counter() - t0:.2f}s"
    )
    m.eval()
    t0 = time.perf_counter()
    gen = m.generate(ids[:1, :8], max_new_tokens=16)
    print(
        f"greedy generation (16 tokens, cached decode) in {time.perf_counter() - t0:.2f}s: {gen[0, 8:].tolist()}"
    )
    return 0


def cmd_env(args) -> int:
    import platform

    import torch

    from openk3.ops import backend

    _import_fast_paths()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    for mod in ("triton", "fla", "transformers", "safetensors", "tokenizers", "fastapi", "flash_attn_res"):
        try:
            info[mod] = getattr(importlib.import_module(mod), "__version__", "installed")
        except Exception:
            info[mod] = None
    info["backends"] = backend.describe(torch.cuda.is_available())
    info["decode_steps"] = _decode_steps()
    info["fusions"] = _fusions(info["backends"])
    info["attnres_kernels"] = _attnres_knobs()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        if k not in ("backends", "decode_steps", "fusions", "attnres_kernels"):
            print(f"{k:14s} {v if v is not None else '-'}")
    print("op backends (chosen for this machine; OPENK3_BACKEND_<OP>=name overrides):")
    for op, d in info["backends"].items():
        avail = ", ".join(
            f"{n}{'' if a['available'] else ' (unavailable: ' + a['why'] + ')'}"
            for n, a in d["backends"].items()
        )
        print(f"  {op:8s} -> {d['chosen']:12s} [{avail}]")
    print("inference decode steps (openk3 generate / serve; --decode-backend overrides):")
    for op, d in info["decode_steps"].items():
        print(f"  {op:8s} -> {d['chosen']:12s} ({d['why']})")
    print("fusions (training and prefill):")
    for op, d in info["fusions"].items():
        print(f"  {op:8s} -> {d['chosen']:12s} ({d['why']})")
    ak = info["attnres_kernels"]
    if ak is not None:
        caps = ", ".join(f"{k}={v}" for k, v in ak["maxnreg"].items()) or "none"
        print(
            f"attnres kernels (OPENK3_ATTNRES_*): direct_max {ak['direct_max']}, dot {ak['dot']}, "
            f"dv_stages {ak['dv_stages']}, p2_rows {ak['p2_rows']}, maxnreg {caps}"
        )
    return 0


def _attnres_knobs() -> dict | None:
    """The Triton AttnRes reader's settings (from OPENK3_ATTNRES_* at import), or None without Triton."""
    try:
        from openk3.fast import attnres
    except ImportError:
        return None
    return {
        "direct_max": attnres.DIRECT_MAX,
        "dot": attnres.DV_DOT,
        "dv_stages": attnres.DV_STAGES,
        "p2_rows": attnres.P2_NORM_ROWS,
        "maxnreg": dict(attnres.MAXNREG),
        "tiles": {k: list(v) for k, v in attnres.TILES.items()},
    }


def _decode_steps() -> dict:
    """Which single-token decode step the inference engine takes per op on this machine, and why."""
    try:
        from openk3.infer import kernels
    except Exception as e:  # pragma: no cover - import problems are reported, not raised
        ok, why = False, f"decode kernels not importable: {e}"
    else:
        ok, why = kernels.available()
    chosen = "triton" if ok else "reference"
    out = {op: {"chosen": chosen, "why": why} for op in ("kda", "mla")}
    try:
        from openk3.fast import moe_small
    except Exception as e:  # pragma: no cover
        out["moe"] = {"chosen": "layer", "why": f"few-token path not importable: {e}"}
    else:
        if moe_small.SMALL_N <= 0:
            out["moe"] = {
                "chosen": "layer",
                "why": "the layer's backend; few-token path off (OPENK3_MOE_SMALL_N=0)",
            }
        elif not ok:
            out["moe"] = {"chosen": "layer", "why": f"few-token path needs CUDA + triton ({why})"}
        else:
            out["moe"] = {
                "chosen": "few-token",
                "why": f"router + experts in 5 Triton launches at <= {moe_small.SMALL_N} tokens and <= "
                f"{moe_small.PAIRS_PER_EXPERT} (token, slot) pairs per expert (OPENK3_MOE_SMALL_N)",
            }
    out["mla_walk"] = _mla_walk(ok, why)
    from openk3.fast import _triton

    if not ok:
        out["launch"] = {"chosen": "plain", "why": "no Triton decode kernels here"}
    elif _triton.PDL["on"]:
        out["launch"] = {"chosen": "pdl", "why": "programmatic dependent launch on sm_90+ (OPENK3_PDL=1)"}
    else:
        out["launch"] = {
            "chosen": "plain",
            "why": "programmatic dependent launch off (--pdl or OPENK3_PDL=1: on)",
        }
    return out


def _mla_walk(kernels_ok: bool, why: str) -> dict:
    """Which kernel walks the paged latent cache in the MLA decode step: the warp-specialised Gluon kernel
    (Hopper, enough heads and rows) or the Triton split kernel."""
    if not kernels_ok:
        return {"chosen": "reference", "why": why}
    import torch

    from openk3.infer import kernels, mla_gluon

    cfg = kernels.MLA_CONFIG
    if not mla_gluon.HAS_GLUON:
        return {"chosen": "triton", "why": "this Triton has no Gluon (triton.experimental.gluon)"}
    if torch.cuda.get_device_capability(0)[0] != 9:
        return {"chosen": "triton", "why": "the Gluon MLA kernel is for Hopper (sm_90)"}
    if not cfg["gluon"]:
        return {"chosen": "triton", "why": "the Gluon MLA kernel is off (MLA_CONFIG['gluon'])"}
    gcfg = mla_gluon.MLA_GLUON_CONFIG
    walk = (
        f"its persistent walk (one group of programs per SM) from {gcfg['persist_min_rows']} rows"
        if gcfg["persistent"]
        else "its split walk"
    )
    return {
        "chosen": "gluon",
        "why": f"warp-specialised Gluon kernel from {cfg['gluon_min_heads']} heads and {cfg['gluon_min_rows']} "
        f"rows with a bf16 / fp16 cache, {walk}; the Triton split kernel otherwise",
    }


def _fusions(backends: dict) -> dict:
    """Cross-op fusions the model takes on this machine: the AttnRes read + the RMSNorm after it."""
    from openk3.model import fuse_read_norm_default

    be = backends.get("attnres", {}).get("chosen")
    if not fuse_read_norm_default():
        rn = {"chosen": "separate", "why": "off (OPENK3_FUSE_READ_NORM=0)"}
    elif be != "triton":
        rn = {"chosen": "separate", "why": f"needs the triton AttnRes reader (attnres -> {be})"}
    else:
        rn = {
            "chosen": "fused",
            "why": "read + RMSNorm in one Triton kernel, fwd and bwd (OPENK3_FUSE_READ_NORM=0: off)",
        }
    return {"readnorm": rn}


def _import_fast_paths() -> None:
    try:
        importlib.import_module("openk3.fast")
    except ImportError:
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openk3",
        description="Kimi K3 in PyTorch: train, run, serve and cost-model the architecture.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  openk3 train              # tiny preset on the embedded corpus, CPU, ~2 min\n"
        "  openk3 params k3\n  openk3 demo --preset tiny\n  openk3 env",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sp = sub.add_parser(
        "params",
        help="print total and active parameter counts (no weights allocated)",
        description="Count parameters of a preset or config.json on the meta device.",
        epilog="example: openk3 params k3   |   openk3 params path/to/config.json",
    )
    sp.add_argument(
        "config", help="preset name (k3, kimi-linear-48b, k2-like, tiny, small, medium) or config path"
    )
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_params)
    sp = sub.add_parser(
        "demo",
        help="forward/backward and a short greedy generation on a freshly initialised preset",
        epilog="example: openk3 demo --preset tiny",
    )
    sp.add_argument("--preset", default="tiny")
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(func=cmd_demo)
    sp = sub.add_parser(
        "env", help="versions and the backend each op uses", epilog="example: openk3 env --json"
    )
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_env)
    for name in _PLUGINS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        reg = getattr(mod, "register", None) or getattr(mod, "add_cost_parser", None)
        if reg is not None:
            reg(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if getattr(args, "debug", False):
            raise
        print(f"openk3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
