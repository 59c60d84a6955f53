"""PNG curves of a training run (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import os
import sys


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir!r} an openk3 train output directory?")
    recs: dict[int, dict] = {}
    skipped = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                r = None
            # a run killed while writing a line leaves it cut (and a resumed run appends to it): skip such lines
            if not isinstance(r, dict) or not isinstance(r.get("step"), int) or "loss" not in r:
                skipped.append(n)
                continue
            recs[r["step"]] = r  # a resumed run re-logs steps: keep the newest
    if skipped:
        print(
            f"openk3 plot: skipped {len(skipped)} line(s) of {path} that are not step records: {skipped[:5]}",
            file=sys.stderr,
        )
    if not recs:
        raise ValueError(f"{path} holds no training-step records")
    return [recs[k] for k in sorted(recs)]


def plot_run(run_dir: str, out: str | None = None) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("openk3 plot needs matplotlib: pip install matplotlib") from None
    recs = read_metrics(run_dir)
    out = out or run_dir
    os.makedirs(out, exist_ok=True)
    steps = [r["step"] for r in recs]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    losses = [r["loss"] for r in recs]
    ax.plot(steps, losses, lw=0.7, alpha=0.45, color="C0", label="train loss")
    ema, smooth = losses[0], []
    for x in losses:  # exponential moving average, to show the trend through batch noise
        ema = 0.9 * ema + 0.1 * x
        smooth.append(ema)
    ax.plot(steps, smooth, color="C0", label="train loss (EMA 0.9)")
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    p = os.path.join(out, "loss.png")
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)
    if any("load_max_ratio" in r for r in recs):
        fig, ax = plt.subplots(figsize=(7, 4))
        s = [r["step"] for r in recs if "load_max_ratio" in r]
        ax.plot(
            s, [r["load_max_ratio"] for r in recs if "load_max_ratio" in r], label="max / mean expert load"
        )
        ax.plot(
            s, [r["load_min_ratio"] for r in recs if "load_min_ratio" in r], label="min / mean expert load"
        )
        per = [r["load_max_ratio_per_layer"] for r in recs if "load_max_ratio_per_layer" in r]
        if per and len({len(x) for x in per}) == 1:
            sp = [r["step"] for r in recs if "load_max_ratio_per_layer" in r]
            for li in range(len(per[0])):
                ax.plot(sp, [x[li] for x in per], lw=0.6, alpha=0.35, color="C0")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_xlabel("step")
        ax.set_ylabel("load ratio (worst MoE layer)")
        ax.grid(alpha=0.3)
        ax.legend()
        p = os.path.join(out, "load_balance.png")
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written
