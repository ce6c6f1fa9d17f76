#!/usr/bin/env bash
# The one-command GPU check, under 10 minutes on one GPU, offline:
#   1. train-lm: 20 supervised steps of the tiny Llama on one GPU (torchrun; TRAIN_LM line);
#   2. check_rollout.py: log-prob parity of the native engine (and of SGLang) with the trainer, and
#      generated tokens/s (CHECK lines); check_loop.py: megarl's RL loop without Ray (PPO's roles,
#      offload, checkpoint save and load; LOOP lines, peak GPU memory per phase);
#   3. GRPO through `megarl train` (Ray) on one GPU, colocated, the trainer's state offloaded while
#      the rollout generates: native for 2 steps with a checkpoint, resumed for 2 more ("resuming
#      after step 2"); SGLang; then a 3-step multi-turn SGLang run (AGENT line). Each run's RUN line:
#      tokens/s, sync seconds, peak GPU and host memory per phase, offload and reload seconds;
#   4. needs 2 GPUs: split placement, native and SGLang (one GPU cannot hold the trainer's rank and
#      the rollout's: two ranks of the weights group's NCCL communicator, "Duplicate GPU detected").
# Cases that need SGLang, Ray or a second GPU say SKIP and why. Exits non-zero when one fails.
#
#   benchmarks/gpu/check_rollout.sh
#
# What the GPU machine lacks comes as wheels in .whl/ at the repository root, installed (no index)
# into SITE [/tmp/megarl-site]. Made where a registry is reachable:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl megatron-core==0.16.1 omegaconf==2.4.0 \
#     ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
# (the first two for every case, the rest for Ray's; torch, transformers, safetensors, numpy, einops,
# psutil, pyarrow, tqdm and pyyaml are in the GPU image; MLflow is off here). RUNS_DIR
# [runs/gpu_check] holds the runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
have() { python -c "import $1" 2>/dev/null; }
if compgen -G ".whl/*.whl" >/dev/null && ! (have megatron.core && have omegaconf && have ray); then
  site="${SITE:-/tmp/megarl-site}"
  python -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
have megatron.core || { echo "megatron-core is missing: put its wheel in .whl/ (see the top of $0)" >&2; exit 1; }
gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
sglang=1 ray=1
have sglang || { sglang=0; echo "SKIP SGLang cases: sglang is not importable (pip install 'megarl[sglang]')"; }
have ray || { ray=0; echo "SKIP GRPO runs: ray is not importable (carry its wheels, see the top of $0)"; }
runs="${RUNS_DIR:-runs/gpu_check}"
rm -rf "$runs"
status=0

if python -m megarl.cli train-lm configs/lm_demo.yaml trainer.nproc_per_node=1 parallel.actor.tp=1 \
  trainer.train_steps=20 trainer.log_interval=10 trainer.run_dir="$runs/lm"; then
  echo "TRAIN_LM ok"
else
  echo "TRAIN_LM failed"
  status=1
fi
python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu/check_rollout.py || status=1
# megarl's loop without Ray (Ray's wheel is larger than a lent machine carries): PPO's roles, the
# trainer's state offloaded while generating, a checkpoint each step, reloaded (LOOP lines)
python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu/check_loop.py "$runs/loop" \
  trainer.offload.params=true trainer.offload.grads=true trainer.offload.optimizer=true || status=1
[ "$ray" = 1 ] || exit "$status"

common=(configs/grpo_demo.yaml trainer.nproc_per_node=1 parallel.actor.tp=1 parallel.rollout.tp=1
  logging.mlflow=false trainer.offload.params=true trainer.offload.grads=true trainer.offload.optimizer=true)
grpo() {  # NAME STEPS OVERRIDES...: one run, then its RUN line
  local name="$1" steps="$2"
  shift 2
  python -m megarl.cli train "${common[@]}" trainer.train_steps="$steps" trainer.run_dir="$runs/$name" "$@" \
    | tee "$runs/$name.log" || return 1
  python benchmarks/gpu/summarize_run.py "$name" "$runs/$name" "$steps"
}
mkdir -p "$runs"
grpo native 2 trainer.save_interval=2 || status=1
grpo native 4 trainer.save_interval=0 || status=1
if grep -q "resuming after step 2" "$runs/native.log"; then echo "RESUME ok"; else echo "RESUME failed"; status=1; fi
if [ "$sglang" = 1 ]; then
  grpo sglang 3 parallel.rollout.engine=sglang || status=1
  grpo agent 3 parallel.rollout.engine=sglang rollout.env=tests.e2e.test_agent:ThreeTurnEnv \
    rollout.max_turns=3 rollout.max_total_tokens=20 || status=1
  python - "$runs/agent/metrics.jsonl" <<'PY' || status=1
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"step"' in line]
keys = ("rollout/logp_max_abs_diff", "agent/turns_mean", "agent/observation_tokens_mean", "agent/rows_per_call")
print("AGENT", json.dumps({k: rows[0].get(k) for k in keys}))
# SGLang's kernels differ from the trainer's (bf16): the gap is small, not zero
sys.exit(0 if len(rows) == 3 and rows[0]["agent/observation_tokens_mean"] > 0
         and rows[0]["rollout/logp_max_abs_diff"] < 0.5 else 1)
PY
fi
if [ "$gpus" -lt 2 ]; then
  echo "SKIP split placement: needs 2 GPUs (the trainer's rank and the rollout's), $gpus here"
  exit "$status"
fi
split=(trainer.placement=split parallel.rollout.nproc=1 trainer.offload.params=false trainer.offload.grads=false
  trainer.offload.optimizer=false)
grpo split-native 3 "${split[@]}" || status=1
if [ "$sglang" = 1 ]; then
  grpo split-sglang 3 "${split[@]}" parallel.rollout.engine=sglang || status=1
fi
exit "$status"
