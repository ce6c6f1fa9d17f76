"""What a run shows and keeps: a console progress bar, per-phase timings, model TFLOP/s and MFU,
metrics to ``metrics.jsonl`` and to the trackers of ``logging.backends`` (megarl/trainer/trackers.py:
MLflow, TensorBoard, wandb, SwanLab; a run that raises is FAILED in them, an interrupted one
KILLED), a metrics line on the console, and a reward-curve PNG at the end. A full disk
stops the run with :class:`~megarl.checkpoint.disk.DiskFull`, ``metrics.jsonl`` and the rollout
dumps left as they were before the write."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from megarl.checkpoint.disk import append_text, replace_text
from megarl.runtime.signals import Preempted
from megarl.config.schema import REWARD_MODEL, LogBackend
from megarl.models.flops import forward_flops
from megarl.models.hf_config import megatron_args_from_hf
from megarl.protocol import Batch
from megarl.runtime import peak_rss_gb
from megarl.trainer.trackers import TRACKERS, Ending, Tracker, missing_package

_OPEN: List["RunLogger"] = []  # the loggers whose trackers are open: an error ends their runs


def rollout_rows(batch: Batch, decode: Optional[Callable[[List[int]], str]] = None) -> List[Dict]:
    """One record per sample of a step's batch: prompt and response token ids (and text with
    ``decode``), rewards, and the rollout's and the trainer's log-probs of each response token (and,
    from partial rollouts, the policy version that sampled it)."""
    rows = []
    mask = batch.loss_mask.bool()
    for i in range(len(batch)):
        positions = mask[i].nonzero().flatten()  # positions predicting response tokens
        row = {"prompt_index": int(batch.index[i]), "policy_version": int(batch.policy_versions[i]),
               "prompt_ids": batch.prompt_ids[i],
               "response_ids": batch.response_ids[i], "reward": float(batch.raw_scores[i]),
               "shaped_reward": float(batch.scores[i]), "rollout_log_probs": batch.rollout_log_probs[i, positions].tolist()}
        for key in ("old_log_probs", "ref_log_probs", "values", "advantages", "token_versions"):
            if getattr(batch, key) is not None:
                row[key] = getattr(batch, key)[i, positions].tolist()
        if decode is not None:
            row["prompt"], row["response"] = decode(row["prompt_ids"]), decode(row["response_ids"])
        rows.append(row)
    return rows


CONSOLE = ("reward/mean", "response/length_mean", "actor/loss", "actor/grad_norm", "actor/approx_kl", "critic/loss",
           "rollout/logp_max_abs_diff", "time/step_s")  # what trainer.log_interval's line shows, those present


def console_line(record: Dict[str, float]) -> str:
    """``step 10 | reward/mean 0.4125 | ...``: the step's main metrics on one line."""
    parts = [f"step {record['step']}"] + [f"{k} {record[k]:.4g}" for k in CONSOLE if k in record]
    return " | ".join(parts)


class RunLogger:
    def __init__(self, cfg, total_steps: int, start_step: int = 0, run_ids: Optional[Dict[str, str]] = None,
                 decode: Optional[Callable[[List[int]], str]] = None, desc: str = "rl"):
        """``start_step``: the last step already done (a resumed run keeps the metrics up to it).
        ``run_ids``: each tracker's run to reopen (a resumed run's, from its checkpoint).
        ``decode``: token ids -> text, for the samples written by ``logging.rollout_dump_interval``."""
        self.cfg, self.total_steps, self.bar_desc = cfg, total_steps, desc
        self.decode = decode
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.history: List[Dict[str, float]] = []
        if self.metrics_path.is_file():  # steps past the checkpoint were lost with the crash
            kept = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
            self.history = [r for r in kept if r["step"] <= start_step]
            replace_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.history),
                         "the metrics of the steps kept")
        self.timings: Dict[str, float] = {}
        self.validations: List[Dict[str, float]] = []  # this run's validation lines (validation.jsonl)
        val_path = self.run_dir / "validation.jsonl"
        if val_path.is_file():  # a resumed run keeps the validations up to its checkpoint
            kept = [json.loads(line) for line in val_path.read_text().splitlines() if line.strip()]
            self.validations = [r for r in kept if r["step"] <= start_step]
            replace_text(val_path, "".join(json.dumps(r) + "\n" for r in self.validations),
                         "the validation lines kept")
        backends = list(dict.fromkeys(cfg.logging.backends))
        self.console = LogBackend.console in backends
        for backend in backends:  # a missing package fails before any tracker opens a run
            if backend in TRACKERS and missing_package(backend):
                raise ImportError(missing_package(backend))
        self.trackers: Dict[LogBackend, Tracker] = {}
        run_ids = run_ids or {}
        _OPEN.append(self)
        try:
            for backend in backends:
                if backend in TRACKERS:
                    self.trackers[backend] = TRACKERS[backend](cfg, self.run_dir, start_step,
                                                               run_ids.get(backend.value) or None)
        except BaseException as err:
            self.end(err)
            raise
        # each tracker's run id (kept in the checkpoints, for a resumed run to reopen)
        self.run_ids: Dict[str, str] = {b.value: t.run_id for b, t in self.trackers.items() if t.run_id}
        self.world_size = cfg.trainer.nnodes * cfg.trainer.nproc_per_node
        self.flops = forward_flops(megatron_args_from_hf(cfg.model.hf_config))
        self.reward_model_flops = None
        if cfg.algorithm.reward_fn == REWARD_MODEL and not cfg.reward_model.generative:  # a scalar head's forward
            rm_config = cfg.reward_model.hf_config or cfg.model.hf_config
            self.reward_model_flops = forward_flops(megatron_args_from_hf(rm_config))
        self.bar = None
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step", dynamic_ncols=True)
        self.step_start = time.perf_counter()

    @property
    def mlflow_run_id(self) -> Optional[str]:
        return self.run_ids.get(LogBackend.mlflow.value)

    def _track(self, metrics: Dict[str, float], step: int) -> None:
        for t in self.trackers.values():
            t.log(metrics, step)

    def _print(self, line: str) -> None:
        if self.console:
            self.bar.write(line) if self.bar else print(line, flush=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timings[f"time/{name}_s"] = self.timings.get(f"time/{name}_s", 0.0) + time.perf_counter() - start

    def step(self, step: int, batch: Batch, metrics: Dict[str, float]) -> Dict[str, float]:
        mask = batch.loss_mask
        lengths = batch.response_lengths.float()
        seconds = time.perf_counter() - self.step_start
        record = {
            "step": step, "reward/mean": batch.raw_scores.mean().item(), "reward/max": batch.raw_scores.max().item(),
            "reward/min": batch.raw_scores.min().item(), "reward/shaped_mean": batch.scores.mean().item(),
            "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
            # a row's input is its prompt and response but the last token (steps.py)
            "prompt/length_mean": (batch.lengths + 1 - batch.response_lengths).float().mean().item(),
            "time/step_s": seconds, "throughput/tokens_per_s": (mask.sum().item() + batch.lengths.sum().item()) / seconds,
            "policy_version": batch.policy_version, "batch/rows": len(batch),
        }
        if batch.baseline_scores is not None:
            record["reward/baseline_mean"] = batch.baseline_scores.mean().item()
        if batch.kl_penalty is not None:  # the KL in the reward: kl_coef * sum_t KL_t, per row
            record["reward/kl_penalty_mean"] = batch.kl_penalty.mean().item()
        if batch.old_log_probs is not None:  # rollout vs trainer log-probs of the same tokens
            gap = (batch.old_log_probs - batch.rollout_log_probs).abs()
            record["rollout/logp_max_abs_diff"] = (gap * mask).max().item()
            record["rollout/logp_mean_abs_diff"] = (torch.where(mask.bool(), gap, 0.0).sum()
                                                    / mask.sum().clamp(min=1)).item()
        record.update(batch.routing_metrics)  # the old-log-prob pass vs the rollout (MoE)
        record.update({f"actor/{k}" if "/" not in k else k: v for k, v in metrics.items()})
        record.update(self.timings)
        record["memory/driver_peak_rss_gb"] = peak_rss_gb()
        record["perf/model_tflops_per_s"] = self._model_flops(batch) / seconds / self.world_size / 1e12
        if "perf/gpu_peak_tflops" in record:  # a worker knows its GPU's peak
            record["perf/mfu"] = record["perf/model_tflops_per_s"] / record["perf/gpu_peak_tflops"]
        self.timings = {}
        interval = self.cfg.logging.rollout_dump_interval
        if interval and step % interval == 0:
            self._dump_rollouts(step, batch)
        self.history.append(record)
        append_text(self.metrics_path, json.dumps(record) + "\n", f"step {step}'s metrics line")
        self._track({k: v for k, v in record.items() if k != "step"}, step)
        if self.bar:
            self.bar.set_postfix(reward=f"{record['reward/mean']:.3f}", step_s=f"{seconds:.1f}")
            self.bar.update(1)
        if step % self.cfg.trainer.log_interval == 0 or step == self.total_steps:
            self._print(console_line(record))
        self.step_start = time.perf_counter()
        return record

    def scalars(self, step: int, metrics: Dict[str, float], console: Sequence[str]) -> Dict[str, float]:
        """A step of a stage other than RL (``megarl sft``): its metrics and ``time/step_s`` to
        metrics.jsonl and the trackers, and every trainer.log_interval steps (and the last) a
        console line of the ``console`` keys."""
        seconds = time.perf_counter() - self.step_start
        record = {"step": step, **metrics, **self.timings, "time/step_s": seconds,
                  "memory/driver_peak_rss_gb": peak_rss_gb()}
        self.timings = {}
        self.history.append(record)
        append_text(self.metrics_path, json.dumps(record) + "\n", f"step {step}'s metrics line")
        self._track({k: v for k, v in record.items() if k != "step"}, step)
        if self.bar:
            self.bar.set_postfix({k.split("/")[-1]: f"{record[k]:.4g}" for k in console[:1]})
            self.bar.update(1)
        if step % self.cfg.trainer.log_interval == 0 or step == self.total_steps:
            self._print(" | ".join([f"step {step}"] + [f"{k} {record[k]:.4g}" for k in console if k in record]))
        self.step_start = time.perf_counter()
        return record

    def validation(self, step: int, metrics: Dict[str, float], rows: List[Dict]) -> None:
        """A validation's metrics to <run_dir>/validation.jsonl, MLflow, TensorBoard and the console
        at ``step`` (0: before training), its responses to <run_dir>/validation/step_<N>.jsonl. The
        next step's clock starts after it (a step's time/ metrics leave validation out)."""
        record = {"step": step, **metrics}
        folder = self.run_dir / "validation"
        folder.mkdir(exist_ok=True)
        replace_text(folder / f"step_{step}.jsonl", "".join(json.dumps(r) + "\n" for r in rows),
                     f"step {step}'s validation responses")
        append_text(self.run_dir / "validation.jsonl", json.dumps(record) + "\n", f"step {step}'s validation line")
        self.validations.append(record)
        self._track(metrics, step)
        from megarl.trainer.validation import HEADLINE

        shown = [k for k in metrics if HEADLINE.match(k) or k in ("val/loss", "val/accuracy")] + [
            k for k in ("val/response/length_mean",) if k in metrics]
        self._print(f"validation at step {step} | " + " | ".join(f"{k} {metrics[k]:.4g}" for k in shown))
        self.step_start = time.perf_counter()

    def _dump_rollouts(self, step: int, batch: Batch) -> None:
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        text = "".join(json.dumps(row) + "\n" for row in rollout_rows(batch, self.decode))
        replace_text(folder / f"step_{step}.jsonl", text, f"step {step}'s samples")

    def _model_flops(self, batch: Batch) -> float:
        """Model FLOPs of the step (megarl.models.flops): a forward pass over the rows for
        generation and for each log-prob or value pass, forward + backward (3x) for each update.
        Rows generated but not trained on (DAPO's dropped groups, ReMax's greedy baselines) are
        left out; the one-step-off loop generates the next batch, counted as this one."""
        lengths = batch.lengths.tolist()  # tokens through the model per row
        actor = self.flops.forward(lengths)
        total = actor * (1 + 3)  # generation, update
        total += actor * sum(logp is not None for logp in (batch.old_log_probs, batch.ref_log_probs))
        if batch.values is not None:  # the critic: values, then its update
            total += self.flops.forward(lengths, value_head=True) * (1 + 3)
        if self.reward_model_flops:
            total += self.reward_model_flops.forward(lengths, value_head=True)
        return total

    def close(self, key: str = "reward/mean", png_name: str = "reward_curve.png") -> Path:
        """Write the curve of ``key`` (the mean reward, ``megarl sft``'s loss); end every
        tracker's run, FINISHED."""
        png = self.run_dir / png_name
        if self.history:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            steps = [r["step"] for r in self.history]
            rewards = [r[key] for r in self.history]
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(steps, rewards, label=key)
            window = max(1, len(rewards) // 10)
            smooth = torch.tensor(rewards).unfold(0, window, 1).mean(-1).tolist() if len(rewards) >= window else rewards
            ax.plot(steps[window - 1:], smooth, label=f"moving mean ({window})")
            ax.set_xlabel("step")
            ax.set_ylabel(key)
            ax.set_title(f"{self.cfg.algorithm.name} on {self.cfg.algorithm.reward_fn}" if key == "reward/mean"
                         else self.bar_desc)
            ax.legend()
            fig.tight_layout()
            fig.savefig(png, dpi=100)
            plt.close(fig)
            for t in self.trackers.values():
                t.artifact(png)
        self.end(None)
        if self.bar:
            self.bar.close()
        return png

    def end(self, error: Optional[BaseException]) -> None:
        """End every open tracker's run: FINISHED (``error`` None), KILLED (an interrupt:
        KeyboardInterrupt, a signal handler's SystemExit, a SIGTERM's Preempted) or FAILED."""
        if self in _OPEN:
            _OPEN.remove(self)
        ending = (Ending.finished if error is None else
                  Ending.killed if isinstance(error, (KeyboardInterrupt, SystemExit, Preempted)) else Ending.failed)
        trackers, self.trackers = self.trackers, {}
        for t in trackers.values():
            t.end(ending)


def end_unfinished_runs(error: BaseException) -> None:
    """End the tracker runs that ``error`` left open, KILLED or FAILED (a tracker's own exit hook
    would mark them finished)."""
    for log in list(_OPEN):
        log.end(error)


def check_logging(logging_cfg) -> None:
    """What ``logging.backends`` needs installed (before Ray starts)."""
    from megarl.config import ConfigError

    for backend in logging_cfg.backends:
        problem = missing_package(backend)
        if problem:
            raise ConfigError(problem)
