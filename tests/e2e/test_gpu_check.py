"""benchmarks/gpu/run.sh, the GPU check, in its CPU-harness variant: ``--small`` (a small model,
small sizes) under the GPU-shaped harness (MEGARL_GPU_SHAPED=1), with Ray and every other package
the lent GPU machine lacks (and the check does not carry) unimportable, as there: host copies,
bf16 against fp32 log-prob parity, and GRPO through megarl's own loop without Ray, colocated and
offloaded, with per-phase memory; then its summary. One run of the script serves every test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_shaped
# on the lent machine (KINDS.md's package list) none of these is installed; megatron-core and
# omegaconf travel as wheels (run.sh's header)
UNAVAILABLE = ("ray", "mlflow", "sqlalchemy", "alembic", "sglang", "vllm", "transformer_engine")
SITECUSTOMIZE = f'''"""Packages the lent GPU machine lacks: importing one fails as it does there."""
import sys


class Unavailable:
    names = {UNAVAILABLE!r}

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {{name!r}} (unimportable: tests/e2e/test_gpu_check.py)",
                                      name=name)
        return None


sys.meta_path.insert(0, Unavailable())
'''


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """The environment of the lent machine, as far as imports go: ``python3`` is this
    interpreter, and the packages it lacks cannot be imported."""
    work = tmp_path_factory.mktemp("gpu_check")
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=str(work / "site"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               MEGARL_GPU_SHAPED="1", OMP_NUM_THREADS="1", RUNS_DIR=str(work / "runs"))
    return work, env


@pytest.fixture(scope="module")
def check(machine):
    work, env = machine
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "--small"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = proc.stdout.splitlines()

    def tagged(tag):
        return [json.loads(line[len(tag) + 1:]) for line in lines if line.startswith(tag + " {")]

    return proc, tagged, work / "runs"


def test_the_packages_are_unimportable_there(machine):
    _, env = machine
    for name in UNAVAILABLE[:2]:
        proc = subprocess.run(["python3", "-c", f"import {name}"], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "unimportable: tests/e2e/test_gpu_check.py" in proc.stderr, proc.stderr


def test_the_check_passes_without_ray(check):
    proc, tagged, _ = check
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "CHECK_OK" in proc.stdout
    summary = tagged("SUMMARY")
    assert [s["part"] for s in summary] == ["copies", "parity", "loop"] and all(s["ok"] for s in summary), summary


def test_host_copies(check):
    _, tagged, _ = check
    rows = {r["memory"]: r for r in tagged("COPY")}
    assert set(rows) == {"pageable", "pinned"}
    assert all(r["intact"] and r["d2h_gbps"] > 0 and r["h2d_gbps"] > 0 for r in rows.values()), rows


def test_bf16_against_fp32_parity(check):
    """Each comparison is within its bound, and the bf16 ones saw bf16's rounding (the dtypes
    really differ): well above fp32's, which is exact to a few ulps here."""
    _, tagged, _ = check
    rows = {r["case"]: r for r in tagged("PARITY")}
    assert set(rows) == {"rollout_vs_trainer/float32", "rollout_vs_trainer/bfloat16", "bf16_vs_fp32"}
    assert all(r["ok"] and r["max_abs"] <= r["tolerance"]["max_abs"] for r in rows.values()), rows
    assert rows["rollout_vs_trainer/float32"]["max_abs"] <= 1e-5
    assert rows["bf16_vs_fp32"]["max_abs"] > 100 * rows["rollout_vs_trainer/float32"]["max_abs"]
    assert tagged("GENERATE")[0]["tokens_per_s"] > 0


def test_grpo_loop_colocated_offloaded(check):
    """Two GRPO steps with a reference, the trainer's state offloaded while generating: each step
    timed offload and reload; every verb's phase line; the checkpoint reloaded into the same weights."""
    _, tagged, _ = check
    steps = tagged("LOOP")
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert all(s["time/offload_s"] > 0 and s["time/reload_s"] > 0 for s in steps), steps
    phases = {p["phase"]: p for p in tagged("PHASE")}
    assert {"rollout.generate", "rollout.update_weights", "rollout.release_memory", "actor.compute_log_prob",
            "reference.compute_log_prob", "actor.update", "checkpoint.save", "checkpoint.load"} <= set(phases)
    assert phases["rollout.generate"]["calls"] == 2
    assert all({"reserved_gb", "max_reserved_gb", "device_used_gb"} <= set(p) for p in phases.values())
    (ckpt,) = tagged("CKPT")
    assert ckpt["checksum"] == ckpt["reloaded_checksum"] and ckpt["same_layout"]


def test_a_failed_part_fails_the_check(check, tmp_path):
    """The summary's verdict follows the parts: a loop whose log lacks LOOP_OK fails the check."""
    _, _, runs = check
    shutil.copytree(runs, tmp_path / "runs", ignore=shutil.ignore_patterns("loop"))
    log = tmp_path / "runs" / "loop.log"
    log.write_text(log.read_text().replace("LOOP_OK", "LOOP_FAILED"))
    proc = subprocess.run([sys.executable, "benchmarks/gpu/summarize.py", str(tmp_path / "runs")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "CHECK_FAILED" in proc.stdout, proc.stdout
    assert not json.loads(proc.stdout.splitlines()[2][len("SUMMARY "):])["ok"]
