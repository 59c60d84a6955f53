"""``openk3 cost``: the analytic cost model (:mod:`openk3.cost`) on the command line.

Registered by the main CLI through :func:`add_cost_parser` / :func:`run_cost`; also runs on its own:
``python -m openk3.cost_cli k3``.
"""

from __future__ import annotations

import argparse
import os
import sys

from openk3 import cost
from openk3.config import ConfigError

EXAMPLES = """\
examples:
  openk3 cost k3                                   # params, FLOPs, decode bytes, regimes, cache (H200, batch 1 and 256)
  openk3 cost k3 --expert-dtype mxfp4 --ep 64 --hw b200 --batch 1,64,1024
  openk3 cost --compare k2-like k3                 # side by side, last/first ratio
  openk3 cost k2-like --sweep latent_alpha=1,2,4 --variant acc    # LatentMoE: reinvest (N'l = Nd, K'l = Kd)
  openk3 cost k3 --sweep latent_alpha=1,2,4 --variant eff         # LatentMoE: bank the savings
  openk3 cost k3 --sweep mla_split=512:64,480:96,576:0            # kv_lora_rank:qk_rope_head_dim
  openk3 cost k3 --sweep batch=1,4,16,64,256,1024,4096 --ep 64 --plot plots/
  openk3 cost path/to/config.json --format json --output cost.json
  openk3 cost medium --hw custom:flops=790T,hbm=4.2T,net=450G --batch 1,8,64
hardware: h100, h200, b200, h200-measured, or custom:flops=..,hbm=..[,net=..,nvlink=..,ib=..,mem=..,fp8=..]
sizes accept k/M suffixes (binary for --context/--contexts/--batch: 4k = 4096, 1M = 1048576)
"""


def _int(s: str) -> int:
    s = s.strip().lower().replace("_", "")
    mult = {"k": 1024, "m": 1024**2}.get(s[-1:], 1)
    if mult > 1:
        s = s[:-1]
    try:
        v = float(s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (k/M suffix allowed), got {s!r}") from None
    if v != int(v):
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}")
    return int(v)


def _int_list(s: str) -> list[int]:
    return [_int(x) for x in s.split(",") if x.strip()]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "configs", nargs="*", metavar="CONFIG", help="preset name (k3, kimi-linear-48b, ...) or config.json"
    )
    p.add_argument("--compare", nargs="+", metavar="CONFIG", help="compare these configs side by side")
    p.add_argument(
        "--sweep",
        action="append",
        metavar="KEY=V1,V2",
        help="latent_alpha=1,2,4 | mla_split=512:64,480:96 | batch=1,8,64 | context=4k,128k | <config field>=a,b "
        "(repeatable)",
    )
    p.add_argument(
        "--variant", choices=("eff", "acc", "both"), default="eff", help="latent_alpha sweep variant"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field"
    )
    p.add_argument("--batch", type=_int_list, default=[1, 256], help="decode batch sizes (default 1,256)")
    p.add_argument("--context", type=_int, default=4096, help="context length (default 4096)")
    p.add_argument(
        "--contexts",
        type=_int_list,
        default=[4096, 32768, 131072, 262144, 1048576],
        help="context lengths of the cache/memory table",
    )
    p.add_argument(
        "--regime-batches",
        type=_int_list,
        default=[1, 4, 16, 64, 256, 1024, 4096, 16384],
        help="batch sizes of the serving-regime table",
    )
    p.add_argument(
        "--mode", choices=("decode", "prefill"), default="decode", help="step kind (default decode)"
    )
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (default 1)")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks for the non-expert weights (default 1)"
    )
    p.add_argument("--tokens-per-domain", type=_int, default=None, help="tokens in flight per EP domain (t)")
    p.add_argument("--hw", default="h200", help="hardware profile (default h200)")
    p.add_argument("--net", default="auto", help="auto | nvlink | ib | bandwidth in B/s (default auto)")
    dts = sorted(cost.DTYPE_BYTES)
    p.add_argument(
        "--expert-dtype", default="bf16", choices=dts, help="routed-expert weights (release: mxfp4)"
    )
    p.add_argument("--dense-dtype", default="bf16", choices=dts, help="all other weights")
    p.add_argument("--kv-dtype", default="bf16", choices=dts, help="MLA latent cache")
    p.add_argument("--state-dtype", default="fp32", choices=dts, help="KDA recurrent state")
    p.add_argument(
        "--act-dtype", default="fp8", choices=dts, help="EP dispatch/combine activations (default fp8)"
    )
    p.add_argument("--compute-dtype", default="bf16", choices=("bf16", "fp8"), help="peak FLOP/s to use")
    p.add_argument(
        "--no-overlap", action="store_true", help="network time adds to (not overlaps) the step time"
    )
    p.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (needs matplotlib)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")


def add_cost_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``cost`` on the main CLI's subparsers; the parser's default ``func`` is :func:`run_cost`."""
    p = subparsers.add_parser(
        "cost",
        help="analytic cost model: params, FLOPs, HBM/network bytes, regimes, cache memory",
        description="Analytic cost model of a K3-family config across serving regimes (no weights needed).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=run_cost)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openk3 cost",
        description="Analytic cost model of a K3-family config across serving regimes (no weights needed).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    return p


def _overrides(items: list[str], cfg) -> dict:
    out = {}
    for it in items:
        if "=" not in it:
            raise ConfigError(f"--set expects FIELD=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        if k not in cfg.__dataclass_fields__:
            raise ConfigError(f"--set: {k!r} is not a K3Config field")
        out[k] = cost._coerce(cfg, k, v)
    return out


def _load(spec: str, sets: list[str]):
    cfg = cost.load_config(spec)
    ov = _overrides(sets, cfg)
    return cost.load_config(cfg, **ov) if ov else cfg


def _workload(args) -> cost.Workload:
    cost.get_hardware(args.hw)  # validate early
    if args.ep < 1:
        raise ConfigError(f"--ep must be >= 1, got {args.ep}")
    if args.tp < 1 or args.ep % args.tp:
        raise ConfigError(f"--tp must divide --ep (got --tp {args.tp}, --ep {args.ep})")
    if any(b < 1 for b in args.batch):
        raise ConfigError("--batch values must be >= 1")
    return cost.Workload(
        batch=args.batch,
        context=args.context,
        mode=args.mode,
        ep_ranks=args.ep,
        tp=args.tp,
        tokens_per_domain=args.tokens_per_domain,
        hw=args.hw,
        net=args.net,
        expert_dtype=args.expert_dtype,
        dense_dtype=args.dense_dtype,
        kv_dtype=args.kv_dtype,
        state_dtype=args.state_dtype,
        act_dtype=args.act_dtype,
        compute_dtype=args.compute_dtype,
        overlap=not args.no_overlap,
        regime_batches=args.regime_batches,
        contexts=args.contexts,
    )


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def run_cost(args: argparse.Namespace) -> int:
    """Run ``openk3 cost`` with parsed arguments; returns the exit status."""
    try:
        return _run(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"openk3 cost: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    wl = _workload(args)
    tables: list[cost.Table] = []
    plots: list[str] = []
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
    specs = list(args.configs)
    if args.compare:
        cfgs = [_load(s, args.set) for s in specs + list(args.compare)]
        tables.append(cost.compare(cfgs, wl))
        header = "openk3 cost: " + " vs ".join(c.name for c in cfgs)
        if args.plot:
            tag = _safe("_vs_".join(c.name for c in cfgs))
            plots.append(
                cost.plot_memory(cfgs, wl.contexts, os.path.join(args.plot, f"memory_{tag}.png"), wl)
            )
            pairs = [(c.name, c) for c in cfgs]
            plots.append(cost.plot_sweep(pairs, os.path.join(args.plot, f"compare_{tag}.png"), wl))
    else:
        if not specs:
            raise ConfigError("give a preset name or a config.json (e.g. `openk3 cost k3`), or --compare A B")
        cfgs = [_load(s, args.set) for s in specs]
        header = "openk3 cost: " + ", ".join(c.name for c in cfgs)
        for cfg in cfgs:
            if args.sweep:
                for sw in args.sweep:
                    if "=" not in sw:
                        raise ConfigError(f"--sweep expects KEY=V1,V2,..., got {sw!r}")
                    key, vals = sw.split("=", 1)
                    values = [v for v in vals.split(",") if v.strip()]
                    if not values:
                        raise ConfigError(f"--sweep {key}= lists no values; give KEY=V1,V2,...")
                    if key in ("batch", "context"):
                        values = [str(_int(v)) for v in values]
                    variants = (
                        ("eff", "acc")
                        if (key == "latent_alpha" and args.variant == "both")
                        else (args.variant,)
                    )
                    for var in variants:
                        tables.append(cost.sweep(cfg, key, values, wl, variant=var))
                        if not args.plot:
                            continue
                        base = os.path.join(
                            args.plot,
                            _safe(
                                f"{cfg.name}_{key}_{var}" if key == "latent_alpha" else f"{cfg.name}_{key}"
                            ),
                        )
                        if key == "batch":
                            plots.append(cost.plot_regimes(cfg, [int(v) for v in values], base + ".png", wl))
                        elif key == "context":
                            plots.append(cost.plot_memory([cfg], [int(v) for v in values], base + ".png", wl))
                        else:
                            pairs = cost.sweep_configs(cfg, key, values, var)
                            plots.append(cost.plot_sweep(pairs, base + ".png", wl))
            else:
                tables += cost.report(cfg, wl)
                if args.plot:
                    tag = _safe(cfg.name or "config")
                    plots.append(
                        cost.plot_regimes(
                            cfg, wl.regime_batches, os.path.join(args.plot, f"regimes_{tag}.png"), wl
                        )
                    )
                    ctx = sorted({2**i for i in range(10, 21)} | set(wl.contexts))
                    plots.append(
                        cost.plot_memory([cfg], ctx, os.path.join(args.plot, f"memory_{tag}.png"), wl)
                    )
    text = cost.render(tables, args.format, header=header)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    for p in plots:
        print(f"wrote {p}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cost(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
