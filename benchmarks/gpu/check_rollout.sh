#!/usr/bin/env bash
# GPU check of the rollout engines, in one command on a machine with one or more GPUs:
#   1. check_rollout.py on every GPU: log-prob parity of the native engine and of SGLang (when
#      importable) with the trainer, and generated tokens/s;
#   2. with SGLang importable, two 5-step GRPO runs through `megarl train` on one GPU:
#      colocated (parallel.rollout.engine=sglang: SGLang and the trainer time-share the GPU,
#      the trainer's state offloaded while SGLang generates) and split
#      (trainer.placement=split parallel.rollout.nproc=1: the trainer's rank and the rollout's
#      rank are separate worker groups that share this one GPU; the weights go over NCCL), each
#      summarised from its metrics.jsonl: generated tokens/s, sync seconds, peak memory per phase;
#   3. with SGLang importable, a 3-step multi-turn run (colocated, rollout.env = the e2e test's
#      three-turn environment): the agent loop over SGLang, its first-step rollout/trainer
#      log-prob gap and its observation tokens printed and checked (AGENT line).
#
#   benchmarks/gpu/check_rollout.sh [DIR_WITH_MEGATRON_CORE_WHEEL]
#
# Installs megatron-core from a carried wheel when it is missing (no registry needed). Needs no
# network otherwise. Exits non-zero when a check or a run fails. RUNS_DIR (default
# runs/gpu_check) holds the runs; STEPS (default 5) sets their length.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python -c "import megatron.core" 2>/dev/null; then
    wheel_dir="${1:-wheels}"
    python -m pip install --no-deps --no-index --find-links "$wheel_dir" megatron-core
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nproc="${NPROC:-1}"
python -m torch.distributed.run --standalone --nproc-per-node "$nproc" benchmarks/gpu/check_rollout.py

if ! python -c "import sglang" 2>/dev/null; then
    echo "SKIP GRPO runs: sglang is not importable (pip install 'megarl[sglang]')"
    exit 0
fi
runs="${RUNS_DIR:-runs/gpu_check}"
steps="${STEPS:-5}"
rm -rf "$runs"
# The CPU demo's task and tiny model on one GPU rank; SGLang starts with half the GPU's memory
# free for it (its mem_fraction), the trainer's state is offloaded while it generates.
common=(configs/grpo_demo.yaml trainer.train_steps="$steps" trainer.nproc_per_node=1 parallel.actor.tp=1
        parallel.rollout.tp=1 parallel.rollout.engine=sglang logging.mlflow=false trainer.save_interval=0)
status=0
python -m megarl.cli train "${common[@]}" trainer.placement=colocated \
    trainer.offload.params=true trainer.offload.grads=true trainer.offload.optimizer=true \
    trainer.run_dir="$runs/colocated" || status=1
python benchmarks/gpu/summarize_run.py colocated "$runs/colocated" "$steps" || status=1
python -m megarl.cli train "${common[@]}" trainer.placement=split parallel.rollout.nproc=1 \
    trainer.run_dir="$runs/split" || status=1
python benchmarks/gpu/summarize_run.py split "$runs/split" "$steps" || status=1
python -m megarl.cli train "${common[@]}" trainer.train_steps=3 trainer.placement=colocated \
    rollout.env=tests.e2e.test_agent:ThreeTurnEnv rollout.max_turns=3 rollout.max_total_tokens=20 \
    trainer.run_dir="$runs/agent" || status=1
python - "$runs/agent/metrics.jsonl" <<'PY' || status=1
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"step"' in line]
keys = ("rollout/logp_max_abs_diff", "agent/turns_mean", "agent/observation_tokens_mean", "agent/rows_per_call")
print("AGENT", json.dumps({k: rows[0].get(k) for k in keys}))
# SGLang's kernels differ from the trainer's (bf16): the gap is small, not zero
sys.exit(0 if len(rows) == 3 and rows[0]["agent/observation_tokens_mean"] > 0
         and rows[0]["rollout/logp_max_abs_diff"] < 0.5 else 1)
PY
exit "$status"
