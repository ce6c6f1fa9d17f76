"""Resume into another layout, from checkpoints written in the background. (Exact resume after
SIGTERM and SIGKILL, and export-hf of a run: tests/faults/test_interrupted_runs.py.)"""

from __future__ import annotations

import json

from tests.cli import megarl_here
from tests.distributed.launch import ROOT

ARGS = ["configs/grpo_demo.yaml", "trainer.train_steps=8", "trainer.save_interval=2", "logging.progress_bar=false",
        "data.prompts_per_step=4", "algorithm.samples_per_prompt=4"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_async_checkpoints_resume_into_another_layout(tmp_path):
    """Checkpoints written in the background (trainer.async_save) at tp=2 become ``latest``
    once complete; the run resumes at tp=1 (dp=2) with the same weights (float64 sums of squares
    agree to 1e-12) and trains on, the rollout in step with the trainer."""
    run_dir = tmp_path / "run"
    base = ["train", *ARGS, f"trainer.run_dir={run_dir}"]
    first = megarl_here(*base, "trainer.train_steps=4", "trainer.async_save=true", cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == "step_000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000004"]
    saved = json.loads((run_dir / "final.json").read_text())["actor_weights_checksum"]

    tp1 = base + ["parallel.actor.tp=1"]
    same = megarl_here(*tp1, "trainer.train_steps=4", cwd=ROOT)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "resuming after step 4" in same.stdout and "into another layout" in same.stdout, same.stdout[-2000:]
    loaded = json.loads((run_dir / "final.json").read_text())["actor_weights_checksum"]
    assert abs(loaded - saved) <= 1e-12 * saved

    more = megarl_here(*tp1, "trainer.train_steps=6", cwd=ROOT)
    assert more.returncode == 0, more.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows[4:]:  # the re-laid-out actor trains and the rollout gets its weights
        assert r["rollout/logp_max_abs_diff"] < 1e-4 and r["actor/grad_norm"] > 0, r
