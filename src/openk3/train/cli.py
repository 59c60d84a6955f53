"""``openk3 train``, ``openk3 export``, ``openk3 plot``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from openk3.config import K3Config
from openk3.ops.backend import split_choices
from openk3.train.trainer import TrainConfig, TrainError

_EPILOG = """examples:
  openk3 train                                   # tiny preset, embedded corpus, CPU, about 3 minutes
  openk3 train --preset small --steps 2000 --seq-len 1024 --batch-tokens 65536 --device cuda
  openk3 train --data corpus.jsonl --text-field text --tokenizer tokenizer.json --out runs/mine
  openk3 train --out runs/mine --resume          # continue from the newest checkpoint
  openk3 train --run-file run.toml               # same keys as the options, in TOML or YAML
  openk3 train --nproc 2 --ep 2                  # torchrun: FSDP2 + expert parallel
"""


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    helps = {
        "preset": "model preset (tiny, small, medium, kimi-linear-48b, k3)",
        "config": "model config.json (overrides --preset)",
        "data": "'stdlib' (embedded corpus), or a .txt/.jsonl/.parquet file or directory",
        "tokenizer": "tokenizer.json / tiktoken file / directory; default: train a byte-level BPE on the data",
        "batch_tokens": "tokens per optimizer step over all ranks and micro-batches",
        "lr": "Muon learning rate (matrices)",
        "adam_lr": "AdamW learning rate (embeddings, head, norms, conv, AttnRes vectors)",
        "router_optimizer": "the MoE router weight's optimizer: muon (a matrix, SPEC 6.1) or adamw",
        "balance": "router balancing: qb (Quantile Balancing), sign (aux-free sign update), none",
        "qk_clip_tau": "QK-Clip threshold on MLA max logits (use 0 to disable)",
        "resume": "continue from the newest checkpoint in --out",
        "nproc": "processes (GPUs) to launch through torchrun",
        "ep": "expert-parallel degree (divides nproc)",
    }
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("overrides", "backends"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        typ = type(default) if default is not None else str
        if f.name == "qk_clip_tau":
            typ = float
        if typ is bool:
            p.add_argument(flag, type=_bool, nargs="?", const=True, default=None, help=helps.get(f.name))
        else:
            p.add_argument(
                flag, type=typ, default=None, help=(helps.get(f.name, "") + f" (default {default})").strip()
            )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. --set attn_res_block_size=2 (JSON values)",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="OP=NAME",
        help="force a backend for one op (kda, mla, moe, attnres, norm, conv, glu), e.g. --backend moe=reference; "
        "`openk3 env` lists the names (default: auto)",
    )
    p.add_argument("--run-file", default=None, help="TOML/YAML file with the same keys as these options")


def train_config_from_args(args) -> TrainConfig:
    d: dict = {}
    if args.run_file:
        d.update(TrainConfig.from_file(args.run_file))
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name not in ("overrides", "backends"):
            d[f.name] = v
    over = dict(d.get("overrides", {}))
    for item in args.set:
        if "=" not in item:
            raise TrainError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            over[k] = json.loads(v)
        except json.JSONDecodeError:
            over[k] = v
    d["overrides"] = over
    try:
        d["backends"] = {**d.get("backends", {}), **split_choices(args.backend)}
    except ValueError as e:
        raise TrainError(f"--backend: {e}") from None
    if d.get("qk_clip_tau") == 0:
        d["qk_clip_tau"] = None
    return TrainConfig(**d)


def run_train(args) -> int:
    tc = train_config_from_args(args)
    if tc.nproc > 1 and "LOCAL_RANK" not in os.environ:
        from openk3.train.distributed import launch

        return launch(tc.nproc, sys.argv[1:])
    return train_main(tc)


def train_main(tc: TrainConfig) -> int:
    from openk3.train.trainer import Trainer

    dist = None
    if "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from openk3.train.distributed import init_distributed

        dist = init_distributed()
    try:
        result = Trainer(tc, dist=dist).run()
        if dist is not None:
            import torch.distributed as td

            if td.is_initialized():
                td.barrier()  # every rank is done with collectives before any of them tears the group down
    finally:
        if dist is not None:
            import torch.distributed as td

            if td.is_initialized():
                td.destroy_process_group()
    if not dist or dist.rank == 0:
        keep = {k: v for k, v in result.items() if k != "sample"}
        print("done: " + json.dumps(keep))
    return 0


def run_export(args) -> int:
    from openk3.checkpoint import engine_notes
    from openk3.train.trainer import export_run

    out = export_run(args.run_dir, args.out_dir)
    print(
        f"wrote released-format checkpoint to {out} (openk3 generate / serve --ckpt {out}, "
        "K3ForCausalLM.from_pretrained; vLLM and SGLang: docs/inference.md)"
    )
    for note in engine_notes(K3Config.from_pretrained(out)):
        print(f"note: {note}", file=sys.stderr)
    return 0


def run_plot(args) -> int:
    from openk3.train.plot import plot_run

    for p in plot_run(args.run_dir, args.out):
        print(p)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a K3-family model (default: tiny on the embedded corpus, CPU)",
        description="Train with Per-Head Muon + QK-Clip + Quantile Balancing on packed documents.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(p)
    p.set_defaults(func=run_train)
    p = sub.add_parser(
        "export",
        help="write a released-format checkpoint from a run directory",
        epilog="example: openk3 export runs/default out/k3-tiny",
    )
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.set_defaults(func=run_export)
    p = sub.add_parser(
        "plot",
        help="PNG loss and load-balance curves of a run",
        epilog="example: openk3 plot runs/default   (writes runs/default/*.png)",
    )
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output directory (default: the run directory)")
    p.set_defaults(func=run_plot)
