"""``megarl report RUN_DIR``: the curves of a run (its ``metrics.jsonl``) as PNG files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

PANELS = {  # file -> [(metric, label)]
    "reward.png": [("reward/mean", "mean"), ("reward/max", "max"), ("reward/min", "min")],
    "response_length.png": [("response/length_mean", "mean"), ("response/length_max", "max")],
    "policy.png": [("actor/loss", "loss"), ("actor/approx_kl", "approx KL"), ("actor/clip_frac", "clip fraction"),
                   ("actor/kl", "KL to reference"), ("actor/entropy", "entropy"), ("actor/grad_norm", "grad norm")],
    "throughput.png": [("throughput/tokens_per_s", "tokens/s"), ("perf/model_tflops_per_s", "model TFLOP/s per rank"),
                       ("perf/mfu", "MFU")],
    "sft.png": [("train/loss", "loss"), ("train/grad_norm", "grad norm"), ("train/tokens_per_s", "tokens/s")],
    "memory.png": [("memory/driver_peak_rss_gb", "driver peak RSS (GB)"),
                   ("memory/worker_peak_rss_gb", "worker peak RSS (GB, max over ranks)"),
                   ("memory/worker_peak_gpu_gb", "worker peak GPU memory (GB, max over ranks)")],
}
STACKED = ("policy.png", "throughput.png", "sft.png")  # one axis per series: their scales differ


def load_metrics(run_dir: Path) -> List[Dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: RUN_DIR must be a megarl run directory (trainer.run_dir)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no steps yet")
    return rows


def report(run_dir) -> List[Path]:
    """Write ``RUN_DIR/report/*.png``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    out_dir = run_dir / "report"
    out_dir.mkdir(exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []
    panels = dict(PANELS)
    phases = sorted({k for r in rows for k in r if k.startswith("time/") and k != "time/step_s"})
    panels["timing.png"] = [(k, k[5:-2]) for k in phases]
    for name, series in panels.items():
        present = [(key, label) for key, label in series if any(key in r for r in rows)]
        if not present:
            continue
        stacked = name in STACKED
        fig, axes = plt.subplots(len(present) if stacked else 1, 1, squeeze=False,
                                 figsize=(7, 2.2 * len(present) if stacked else 3.5))
        for i, (key, label) in enumerate(present):
            ax = axes[i if stacked else 0][0]
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label)
            ax.set_xlabel("step")
            ax.legend(loc="best", fontsize="small")
        axes[0][0].set_title(f"{run_dir.name}: {name[:-4].replace('_', ' ')}")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    validation = run_dir / "validation.jsonl"  # held-out evaluation (data.val_files), when run
    vals = [json.loads(line) for line in validation.read_text().splitlines() if line.strip()] if validation.is_file() else []
    from megarl.trainer.validation import HEADLINE

    keys = sorted({k for r in vals for k in r if HEADLINE.match(k) or k == "val/loss"})  # RL's scores, SFT's loss
    if keys:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key in keys:
            ax.plot([r["step"] for r in vals], [r.get(key, float("nan")) for r in vals], marker="o", label=key)
        ax.set_xlabel("step")
        ax.legend(loc="best", fontsize="small")
        ax.set_title(f"{run_dir.name}: validation")
        fig.tight_layout()
        path = out_dir / "validation.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
