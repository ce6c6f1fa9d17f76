"""``megarl sft``, ``megarl train-rm`` and ``megarl dpo``: supervised fine-tuning of the user's
model on their chat data, reward-model training and DPO on preference pairs, on the RL trainer's
engine and run machinery (Ray workers in the actor's layout, run checkpoints, resume,
the trackers): the run directory it writes is one ``megarl export-hf`` exports and
``megarl train model.path=RUN_DIR`` starts from.

The driver reads every row first (megarl/data/sft.py: the chat template's assistant tokens are
the loss mask), then each step sends ``data.global_batch_size`` examples to the workers, which
train on their data-parallel share (megarl/roles/sft.py). ``data.val_files`` gives ``val/loss``
every ``trainer.val_interval`` steps (and before training, with ``trainer.val_before_train``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megarl.config import ConfigError, MegarlConfig, load_config, to_yaml, validate
from megarl.config.schema import Truncation
from megarl.registry import Registry

__all__ = ["main", "prepare_sft", "run", "STAGES"]


class Stage:
    """A supervised stage on the RL trainer's machinery: what a dataset row becomes (and what
    data.global_batch_size counts), how a batch is made, the worker that trains on it, and what a
    held-out evaluation reports."""

    command = "sft"
    worker = "megarl.controller.sft_worker:SFTWorker"  # ``module:Class``
    rows = "examples"
    console = ("train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "time/step_s")
    curve = ("train/loss", "loss_curve.png")  # the metric drawn at the end, and its PNG
    uses = "megarl train model.path={run_dir}"  # what takes the run's export

    def load(self, files, data, tok, max_length: int, key: str = "data.train_files") -> List:
        from megarl.data.sft import load_examples

        return load_examples(files, data, tok, max_length, key)

    def collate(self, items, pad_id: int, rows: Optional[int] = None):
        from megarl.data.sft import collate

        return collate(items, pad_id, rows)

    def held_out(self, learner, items, pad_id: int, n: int) -> Tuple[dict, List[dict]]:
        """(``val/loss``: the token-mean cross entropy of every held-out example; no rows)."""
        total = count = 0.0
        for i in range(0, len(items), n):
            loss, tokens = learner.eval_loss(self.collate(items[i:i + n], pad_id, rows=n))
            total, count = total + loss, count + tokens
        return {"val/loss": total / count, "val/tokens": count}, []

    @staticmethod
    def tokens(items) -> int:
        """Every input token of ``items``."""
        return sum(len(e.ids) for item in items for e in (item if isinstance(item, tuple) else (item,)))


class PairStage(Stage):
    """Rows of a prompt with a chosen and a rejected response; a batch's rows are the pairs
    interleaved, chosen then rejected."""

    rows = "pairs"

    def load(self, files, data, tok, max_length: int, key: str = "data.train_files") -> List:
        from megarl.data.sft import load_pairs

        return load_pairs(files, data, tok, max_length, key)

    def collate(self, items, pad_id: int, rows: Optional[int] = None):
        from megarl.data.sft import collate

        return collate([e for pair in items for e in pair], pad_id, 2 * rows if rows else None)


class RewardModelStage(PairStage):
    command = "train-rm"
    worker = "megarl.controller.sft_worker:RMWorker"
    console = ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "time/step_s")
    curve = ("train/accuracy", "accuracy_curve.png")
    uses = "reward_model.path=OUT"

    def collate(self, items, pad_id: int, rows: Optional[int] = None):
        from megarl.data.sft import collate_scored

        return collate_scored([e for pair in items for e in pair], pad_id, 2 * rows if rows else None)

    def held_out(self, learner, items, pad_id: int, n: int) -> Tuple[dict, List[dict]]:
        """(the mean Bradley–Terry ``val/loss``, ``val/accuracy`` and ``val/margin`` over the pairs;
        each pair's row, its source and both scores)."""
        import torch

        scores = torch.cat([learner.scores(self.collate(items[i:i + n], pad_id, rows=n))[:2 * len(items[i:i + n])]
                            for i in range(0, len(items), n)]).double()
        margin = scores[0::2] - scores[1::2]
        rows = [{"source": chosen.source, "chosen_score": c, "rejected_score": r}
                for (chosen, _), c, r in zip(items, scores[0::2].tolist(), scores[1::2].tolist())]
        return {"val/loss": -torch.nn.functional.logsigmoid(margin).mean().item(),
                "val/accuracy": (margin > 0).double().mean().item(), "val/margin": margin.mean().item(),
                "val/pairs": float(len(items))}, rows


class DPOStage(PairStage):
    command = "dpo"
    worker = "megarl.controller.sft_worker:DPOWorker"
    console = ("train/loss", "train/accuracy", "train/margin", "train/chosen_logp", "train/rejected_logp",
               "time/step_s")
    curve = ("train/accuracy", "accuracy_curve.png")

    def held_out(self, learner, items, pad_id: int, n: int) -> Tuple[dict, List[dict]]:
        """(the means over the pairs of the DPO ``val/loss`` and metrics: accuracy, margin, rewards,
        log-probs; no rows)."""
        sums: dict = {}
        for i in range(0, len(items), n):
            for key, value in learner.eval_pairs(self.collate(items[i:i + n], pad_id, rows=n)).items():
                sums[key] = sums.get(key, 0.0) + value
        pairs = sums.pop("pairs")
        return {f"val/{k}": v / pairs for k, v in sums.items()} | {"val/pairs": pairs}, []


STAGES: Registry = Registry("supervised stage")
for _stage in (Stage(), RewardModelStage(), DPOStage()):
    STAGES.register(_stage.command)(_stage)


@dataclass
class PreparedSFT:
    cfg: MegarlConfig
    tokenizer: object  # megarl.data.tokenizer.HFTokenizer
    train: List  # SFTExample, or (chosen, rejected) pairs of them
    val: Optional[List]
    stage: Stage


def prepare_sft(cfg: MegarlConfig, stage: str = "sft") -> PreparedSFT:
    """Check the configuration and read every row, before any process starts."""
    from megarl.checkpoint.load import check_pretrained_sources
    from megarl.controller.cluster import check_cluster
    from megarl.controller.prepare import check_lora, resolve_paths, world_size
    from megarl.data.tokenizer import HFTokenizer, check_vocab, load_tokenizer
    from megarl.models.builder import check_layout
    from megarl.models.hf_config import megatron_args_from_hf, read_hf_config
    from megarl.parallel import Layout
    from megarl.trainer.logger import check_logging
    from megarl.trainer.resume import check_resume

    validate(cfg)
    chosen = STAGES.get(stage)
    cfg = resolve_paths(cfg)
    data = cfg.data
    if not data.train_files:
        rows = (f"'{data.prompt_key}', '{data.chosen_key}' and '{data.rejected_key}' rows" if chosen.rows == "pairs"
                else f"'{data.messages_key}' conversations or '{data.prompt_key}'/'{data.response_key}' pairs")
        raise ConfigError(f"megarl {stage} needs data.train_files (jsonl, parquet, globs or HF datasets directories "
                          f"of {rows})")
    check_cluster(cfg.trainer)
    layout = Layout.from_config(cfg.parallel.actor, world_size(cfg))
    args = megatron_args_from_hf(cfg.model.hf_config)
    check_layout(args, layout, cfg.model)
    cfg.model.lora = check_lora(cfg, args)
    if data.global_batch_size % (layout.dp * data.micro_batch_size):
        raise ConfigError(f"data.global_batch_size={data.global_batch_size} must divide by dp={layout.dp} x "
                          f"data.micro_batch_size={data.micro_batch_size}")
    if stage == "dpo":
        from megarl.algorithms.preference import DPO_VARIANTS

        if cfg.algorithm.dpo_loss not in DPO_VARIANTS.names():
            raise ConfigError(f"algorithm.dpo_loss='{cfg.algorithm.dpo_loss}' must be one of {DPO_VARIANTS.names()}")
    if data.truncation == Truncation.left:
        raise ConfigError("data.truncation=left: megarl sft keeps a conversation's start (its system prompt and "
                          "first turns); use right, skip or error")
    changed = check_resume(cfg)
    if changed:
        print(f"megarl: warning: {changed}", file=sys.stderr, flush=True)
    check_logging(cfg.logging)
    check_pretrained_sources(cfg)
    tok = load_tokenizer(data.tokenizer, data.chat_template, system_prompt=data.system_prompt,
                         template_kwargs=data.chat_template_kwargs, template_path=data.chat_template_path)
    if not isinstance(tok, HFTokenizer):
        raise ConfigError("megarl sft reads text: set data.tokenizer (or a model.path with tokenizer files) to an "
                          "HF tokenizer")
    check_vocab(tok.vocab_size, args.vocab_size)
    positions = read_hf_config(cfg.model.hf_config).get("max_position_embeddings")
    if data.max_length is None:
        data.max_length = positions or 4096
    elif positions and data.max_length > positions:
        raise ConfigError(f"data.max_length={data.max_length} is more than the model's max_position_embeddings "
                          f"{positions}")
    train = chosen.load(data.train_files, data, tok, data.max_length)
    val = chosen.load(data.val_files, data, tok, data.max_length, key="data.val_files") if data.val_files else None
    if cfg.trainer.total_epochs:
        cfg.trainer.train_steps = math.ceil(cfg.trainer.total_epochs * len(train) / data.global_batch_size)
        print(f"megarl: trainer.total_epochs={cfg.trainer.total_epochs} over {len(train)} examples, "
              f"data.global_batch_size={data.global_batch_size}: trainer.train_steps={cfg.trainer.train_steps}",
              file=sys.stderr, flush=True)
    trained = sum(e.trained for item in train for e in (item if isinstance(item, tuple) else (item,)))
    print(f"megarl {stage}: {len(train)} training {chosen.rows} ({trained} trained tokens of {Stage.tokens(train)})"
          + (f", {len(val)} validation {chosen.rows}" if val else ""), file=sys.stderr, flush=True)
    return PreparedSFT(cfg, tok, train, val, chosen)


def run(prepared: PreparedSFT) -> List[dict]:
    """Train under ``trainer.run_dir``'s lock (megarl.trainer.run_dir.run_locked)."""
    from megarl.trainer.run_dir import run_locked

    return run_locked(prepared.cfg.trainer.run_dir, lambda: _run_locked(prepared))


def _run_locked(prepared: PreparedSFT) -> List[dict]:
    from megarl.controller.cluster import RaySession
    from megarl.controller.group import WorkerGroup, gpu_assignment
    from megarl.controller.prepare import world_size
    from megarl.data.sft import ExampleStream
    from megarl.registry import load_object
    from megarl.runtime.signals import Preemption
    from megarl.trainer.checkpoint import CheckpointSchedule, Checkpoints, resume
    from megarl.trainer.logger import RunLogger

    cfg, tok = prepared.cfg, prepared.tokenizer
    stream = ExampleStream(prepared.train, cfg.trainer.seed, cfg.data.shuffle)
    preemption = Preemption(cfg.trainer.signal_grace_s)
    try:
        session = RaySession(cfg.trainer, num_cpus=world_size(cfg))
    except BaseException:
        preemption.close()
        raise
    preemption.install()
    group = None
    try:
        import ray

        gpus, why = gpu_assignment(ray.cluster_resources().get("GPU", 0), world_size(cfg))
        print(f"megarl: {why}", file=sys.stderr, flush=True)
        group = WorkerGroup(load_object(prepared.stage.worker), world_size(cfg), cfg, gpus_per_worker=gpus,
                            env=session.worker_env, nnodes=cfg.trainer.nnodes, liveness=session.liveness)
        learner = group.roles()["actor"]
        checkpoints = Checkpoints(cfg.trainer.run_dir, cfg.trainer.keep_checkpoints)
        done, run_ids = resume(checkpoints, group, stream) if cfg.trainer.resume else (0, {})
        log = RunLogger(cfg, cfg.trainer.train_steps, start_step=done, run_ids=run_ids, desc=prepared.stage.command)
        schedule = CheckpointSchedule(checkpoints, cfg.trainer, group, lambda step: {
            "step": step, "stream": stream.state(), "tracker_run_ids": log.run_ids}, to_yaml(cfg), preemption)
        with schedule.running():
            train(cfg, prepared.stage, learner, stream, prepared.val, tok.pad_token_id, log, done + 1,
                  schedule.after_step)
        schedule.finish(blocking=True)
        final = {"step": cfg.trainer.train_steps, "actor_weights_checksum": group.call_first("actor_weights_checksum")}
        (log.run_dir / "final.json").write_text(json.dumps(final))
        png = log.close(*prepared.stage.curve)
        print(f"run directory {log.run_dir}: metrics.jsonl, checkpoints/, {png.name}, final.json "
              f"(megarl export-hf {log.run_dir} OUT; {prepared.stage.uses.format(run_dir=log.run_dir)})", flush=True)
        return log.history
    finally:
        preemption.close()
        if group is not None:
            group.shutdown()
        session.close()


def train(cfg, stage: Stage, learner, stream, val, pad_id: int, log, start_step: int, after_step) -> None:
    """The loop: a global batch per step, validation every trainer.val_interval steps."""
    t, data = cfg.trainer, cfg.data
    if start_step == 1 and val and t.val_before_train:
        held_out(stage, learner, val, data, pad_id, log, 0)
    for step in range(start_step, t.train_steps + 1):
        items = stream.take(data.global_batch_size)
        start = time.perf_counter()
        metrics = learner.train_step(stage.collate(items, pad_id))
        seconds = time.perf_counter() - start
        log.scalars(step, {f"train/{k}": v for k, v in metrics.items()} | {
            "train/tokens_per_s": Stage.tokens(items) / seconds, "train/epoch": stream.epoch}, stage.console)
        if val and t.val_interval and (step % t.val_interval == 0 or step == t.train_steps):
            held_out(stage, learner, val, data, pad_id, log, step)
        after_step(step)


def held_out(stage: Stage, learner, val, data, pad_id: int, log, step: int) -> dict:
    """Every held-out row, in batches of data.global_batch_size, logged at ``step`` (the reward
    model's scores of each pair in <run_dir>/validation/step_<N>.jsonl)."""
    metrics, rows = stage.held_out(learner, val, pad_id, data.global_batch_size)
    log.validation(step, metrics, rows)
    return metrics


def main(argv=None, stage: str = "sft") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    files = [a for a in argv if a.endswith((".yaml", ".yml"))]
    history = run(prepare_sft(load_config(files, [a for a in argv if a not in files]), stage))
    if history:
        print(json.dumps({"steps": len(history), "loss_first": round(history[0]["train/loss"], 4),
                          "loss_last": round(history[-1]["train/loss"], 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
