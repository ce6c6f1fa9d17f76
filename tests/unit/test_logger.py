"""The run logger without workers: model FLOPs and MFU of a step, TensorBoard scalars that read
back (a resumed run drops the steps past its checkpoint), the error without the package."""

from __future__ import annotations

import sys

import pytest
import torch

from megarl.config import MegarlConfig
from megarl.config.schema import LogBackend
from megarl.models.flops import forward_flops
from megarl.models.hf_config import megatron_args_from_hf
from megarl.protocol import Batch
from megarl.trainer.logger import RunLogger


def config(run_dir, tensorboard=True) -> MegarlConfig:
    cfg = MegarlConfig()
    cfg.model.hf_config = "configs/models/tiny-llama.json"  # what train_rl.prepare resolves the default to
    cfg.trainer.run_dir = str(run_dir)
    cfg.logging.backends = [LogBackend.console] + ([LogBackend.tensorboard] if tensorboard else [])
    cfg.logging.progress_bar = False
    return cfg


def batch(reward: float) -> Batch:
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 1, 1]])
    logp = torch.full((2, 4), -0.5)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    return Batch(tokens=tokens, labels=tokens, position_ids=tokens, loss_mask=mask, rollout_log_probs=logp,
                 lengths=torch.tensor([3, 4]), response_lengths=torch.tensor([2, 3]),
                 scores=torch.tensor([reward, reward]), raw_scores=torch.tensor([reward, reward]),
                 index=torch.tensor([0, 1]), policy_versions=torch.tensor([0, 0]), prompt_ids=[[0, 0], [0, 0]],
                 response_ids=[[0, 0], [0, 0, 0]], policy_version=0, old_log_probs=logp)


def run_steps(log: RunLogger, rewards) -> list:
    return [log.step(step, batch(reward), {"loss": 0.1, "perf/gpu_peak_tflops": 100.0})
            for step, reward in rewards.items()]


def scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def test_model_flops_and_mfu(tmp_path):
    log = RunLogger(config(tmp_path, tensorboard=False), total_steps=1)
    record = run_steps(log, {1: 0.5})[0]
    log.close()
    # generation, old log-probs and the update (3x) of the actor over rows of 3 and 4 tokens
    flops = forward_flops(megatron_args_from_hf(log.cfg.model.hf_config))
    assert log._model_flops(batch(0.5)) == 5 * flops.forward([3, 4])
    assert record["perf/model_tflops_per_s"] > 0
    assert record["perf/mfu"] == pytest.approx(record["perf/model_tflops_per_s"] / 100.0)
    assert record["memory/driver_peak_rss_gb"] > 0


def test_tensorboard_scalars_and_resume(tmp_path):
    log = RunLogger(config(tmp_path), total_steps=4)
    run_steps(log, {1: 0.1, 2: 0.2, 3: 0.3})
    log.close()
    assert scalars(tmp_path, "reward/mean") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    # resumed from a checkpoint after step 2: step 3 is logged again, the first one is purged
    log = RunLogger(config(tmp_path), total_steps=4, start_step=2)
    run_steps(log, {3: 0.7, 4: 0.8})
    log.close()
    assert scalars(tmp_path, "reward/mean") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.7, 4: 0.8})
    assert set(scalars(tmp_path, "perf/mfu")) == {1, 2, 3, 4}


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'megarl\[tensorboard\]'"):
        RunLogger(config(tmp_path), total_steps=1)


def test_rollout_dump_rows(tmp_path):
    from megarl.rollout import Response
    from megarl.trainer.steps import Sampled, make_batch

    responses = [Response(0, 0, [7, 8, 2], [-0.1, -0.2, -0.3], "stop"), Response(1, 0, [9], [-0.4], "length")]
    sampled = Sampled(records=[None, None], prompt_ids=[[1, 5], [1, 5, 6, 6]], responses=responses,
                      scores=torch.tensor([1.0, 0.25]), raw_scores=torch.tensor([1.0, 0.5]))
    b = make_batch(sampled, pad_id=0, policy_version=0)
    b.old_log_probs = b.rollout_log_probs * 2
    cfg = config(tmp_path, tensorboard=False)
    cfg.logging.rollout_dump_interval = 2
    log = RunLogger(cfg, total_steps=2, decode=lambda ids: ",".join(map(str, ids)))
    log.step(1, b, {})
    log.step(2, b, {})
    log.close()
    assert not (tmp_path / "rollouts" / "step_1.jsonl").exists()
    import json

    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert [r["prompt_ids"] for r in rows] == [[1, 5], [1, 5, 6, 6]]
    assert [r["response_ids"] for r in rows] == [[7, 8, 2], [9]]
    assert rows[0]["rollout_log_probs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert rows[0]["old_log_probs"] == pytest.approx([-0.2, -0.4, -0.6])
    assert (rows[1]["reward"], rows[1]["shaped_reward"], rows[1]["response"]) == (0.5, 0.25, "9")
    assert not list((tmp_path / "rollouts").glob("*.tmp"))


def test_trackers_end_a_crashed_run_failed(tmp_path, monkeypatch):
    """wandb (offline) and SwanLab (offline) take each step's metrics under metrics.jsonl's names;
    a run that raises ends their runs failed (wandb exit code 1, SwanLab ``crashed``), as MLflow's."""
    from megarl.config.schema import LogBackend
    from megarl.trainer.logger import end_unfinished_runs
    from tests.trackers import swanlab_series, wandb_exit_code, wandb_series

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    cfg = config(tmp_path, tensorboard=False)
    cfg.logging.backends = [LogBackend.wandb, LogBackend.swanlab]
    log = RunLogger(cfg, total_steps=3)
    assert set(log.run_ids) == {"wandb", "swanlab"}
    records = run_steps(log, {1: 0.25, 2: 0.5})
    end_unfinished_runs(RuntimeError("a planted failure"))
    assert log.trackers == {}
    for series in (wandb_series(tmp_path), swanlab_series(tmp_path)):
        assert series["reward/mean"] == {1: 0.25, 2: 0.5}
        assert series["actor/loss"] == {1: 0.1, 2: 0.1}
        assert series["perf/mfu"] == {r["step"]: r["perf/mfu"] for r in records}
    assert wandb_exit_code(tmp_path) == 1
    from swanlab.sdk.internal.core_python.store import DataStoreReader
    from swanlab.sdk.internal.core_python.sync import Record

    reader = DataStoreReader()
    reader.open(next((tmp_path / "swanlog").glob("run-*/run-*.swanlab")))
    finished = [r.finish for r in map(Record.FromString, reader) if r.HasField("finish")]
    assert len(finished) == 1 and "CRASHED" in str(finished[0]).upper()


def test_a_missing_tracker_package_is_refused_before_ray(monkeypatch):
    from megarl.config import ConfigError, load_config
    from megarl.trainer.logger import check_logging

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = load_config(["configs/demo/grpo.yaml"], ["logging.backends=[console,wandb]"])
    with pytest.raises(ConfigError, match=r"logging.backends has wandb, which needs the wandb package: "
                                          r"pip install 'megarl\[wandb\]'"):
        check_logging(cfg.logging)
