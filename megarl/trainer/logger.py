"""What a run shows and keeps: a console progress bar, per-phase timings, metrics to MLflow (a
sqlite store in the run directory unless a tracking URI is set) and to ``metrics.jsonl``, and a
reward-curve PNG at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch

from megarl.controller.protocol import Batch


def _flat(prefix: str, obj) -> Dict[str, str]:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        out.update(_flat(key + ".", value) if dataclasses.is_dataclass(value) else {key: str(value)[:250]})
    return out


class RunLogger:
    def __init__(self, cfg, total_steps: int, start_step: int = 0, mlflow_run_id: Optional[str] = None):
        """``start_step``: the last step already done (a resumed run keeps the metrics up to it)."""
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.history: List[Dict[str, float]] = []
        if self.metrics_path.is_file():  # steps past the checkpoint were lost with the crash
            kept = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
            self.history = [r for r in kept if r["step"] <= start_step]
            tmp = self.metrics_path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            tmp.replace(self.metrics_path)
        self.timings: Dict[str, float] = {}
        self.mlflow = self.mlflow_run_id = None
        if cfg.logging.mlflow:
            import mlflow

            uri = cfg.logging.mlflow_tracking_uri or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(cfg.logging.experiment)
            if mlflow_run_id:
                mlflow.start_run(run_id=mlflow_run_id)
            else:
                mlflow.start_run(run_name=self.run_dir.name)
                mlflow.log_params(_flat("", cfg))
            self.mlflow = mlflow
            self.mlflow_run_id = mlflow.active_run().info.run_id
        self.bar = None
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step", dynamic_ncols=True)
        self.step_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timings[f"time/{name}_s"] = self.timings.get(f"time/{name}_s", 0.0) + time.perf_counter() - start

    def step(self, step: int, batch: Batch, metrics: Dict[str, float]) -> Dict[str, float]:
        mask = batch["loss_mask"]
        lengths = batch["response_lengths"].float()
        seconds = time.perf_counter() - self.step_start
        record = {
            "step": step, "reward/mean": batch["raw_scores"].mean().item(), "reward/max": batch["raw_scores"].max().item(),
            "reward/min": batch["raw_scores"].min().item(), "reward/shaped_mean": batch["scores"].mean().item(),
            "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
            "time/step_s": seconds, "throughput/tokens_per_s": (mask.sum().item() + batch["lengths"].sum().item()) / seconds,
            "policy_version": batch.policy_version, "batch/rows": len(batch),
        }
        if "baseline_scores" in batch.tensors:
            record["reward/baseline_mean"] = batch["baseline_scores"].mean().item()
        if "old_log_probs" in batch.tensors:  # rollout vs trainer log-probs of the same tokens
            diff = ((batch["old_log_probs"] - batch["rollout_log_probs"]).abs() * mask).max().item()
            record["rollout/logp_max_abs_diff"] = diff
        record.update({f"actor/{k}" if "/" not in k else k: v for k, v in metrics.items()})
        record.update(self.timings)
        record["memory/peak_rss_gb"] = _peak_rss_gb()
        self.timings = {}
        self.history.append(record)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.mlflow:
            self.mlflow.log_metrics({k.replace("/", "."): float(v) for k, v in record.items() if k != "step"}, step=step)
        if self.bar:
            self.bar.set_postfix(reward=f"{record['reward/mean']:.3f}", step_s=f"{seconds:.1f}")
            self.bar.update(1)
        self.step_start = time.perf_counter()
        return record

    def close(self) -> Path:
        """Write the reward curve; end the MLflow run."""
        png = self.run_dir / "reward_curve.png"
        if self.history:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            steps = [r["step"] for r in self.history]
            rewards = [r["reward/mean"] for r in self.history]
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(steps, rewards, label="mean reward")
            window = max(1, len(rewards) // 10)
            smooth = torch.tensor(rewards).unfold(0, window, 1).mean(-1).tolist() if len(rewards) >= window else rewards
            ax.plot(steps[window - 1:], smooth, label=f"moving mean ({window})")
            ax.set_xlabel("step")
            ax.set_ylabel("reward")
            ax.set_title(f"{self.cfg.algorithm.name} on {self.cfg.algorithm.reward_fn}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(png, dpi=100)
            plt.close(fig)
            if self.mlflow:
                self.mlflow.log_artifact(str(png))
        if self.mlflow:
            self.mlflow.end_run()
        if self.bar:
            self.bar.close()
        return png


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
