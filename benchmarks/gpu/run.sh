#!/usr/bin/env bash
# The GPU check, one command. On the lent GPU machine (one H200, Python 3.12, torch 2.11, no Ray,
# no network: docs/verification.md says how to run it there) it takes about 4 minutes (estimated;
# each part stops at its deadline, 7.5 minutes in all):
#   1. copies (deadline 60 s): device-to-host and host-to-device copies of a 2 GiB tensor through
#      pageable and pinned host memory, GB/s each way (COPY lines; check_copies.py);
#   2. parity (150 s): a random Qwen2.5-0.5B-shaped model (model_config.py: hidden 896, 24 layers,
#      tied embeddings) in fp32 and the same weights in bf16: the native rollout's log-probs against
#      the trainer's in each dtype, and bf16 against fp32, with the bounds in check_parity.py
#      (PARITY lines), then bf16 generation tokens/s (GENERATE);
#   3. loop (240 s): 3 GRPO steps (16 prompts x 8 samples, 64 new tokens, a reference for the KL)
#      of that model through megarl's own loop without Ray (check_loop.py): native rollout,
#      colocated, the trainer's params, grads and optimizer offloaded while the rollout generates;
#      per step the reward, log-prob agreement, first PPO ratio, phase, offload and reload seconds
#      (LOOP), per verb its seconds and torch's allocated, reserved and max-reserved memory and the
#      device's used memory (PHASE), the last step's checkpoint saved and reloaded (CKPT);
# then one SUMMARY line per part and CHECK_OK or CHECK_FAILED (summarize.py); exits 1 when a part
# fails. Where Ray is importable (not on the lent machine, and outside those minutes) it goes on:
# GRPO through `megarl train` on Ray, colocated and offloaded, native with a checkpoint and a
# resume, SGLang and a multi-turn SGLang run when SGLang is importable, split placement with 2
# GPUs (RUN, RESUME and AGENT lines; SKIP lines say what was left out and why).
#
#   benchmarks/gpu/run.sh            # the GPU check
#   benchmarks/gpu/run.sh --small    # its CPU-harness variant: a small model and sizes, run by the
#                                    # test suite under MEGARL_GPU_SHAPED=1 (tests/e2e/test_gpu_check.py)
#
# Packages the machine lacks come as wheels in .whl/ at the repository root (git-ignored), installed
# (no index, no dependencies) into SITE [/tmp/megarl-site] when missing. Made where a registry is
# reachable (2.8 MB; the carry limit is 64 MiB):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl megatron-core==0.16.1 omegaconf==2.4.0
# (omegaconf 2.4 needs only PyYAML; torch, transformers, safetensors, numpy, packaging, einops,
# psutil, pyarrow, tqdm and pyyaml are in the GPU image). RUNS_DIR [runs/gpu_check] holds the logs.
set -euo pipefail
cd "$(dirname "$0")/../.."
small=0
case "${1:-}" in
  --small) small=1 ;;
  "") ;;
  *) echo "usage: $0 [--small]" >&2; exit 2 ;;
esac
have() { python3 -c "import $1" 2>/dev/null; }
if compgen -G ".whl/*.whl" >/dev/null && ! (have megatron.core && have omegaconf); then
  site="${SITE:-/tmp/megarl-site}"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
have megatron.core || { echo "megatron-core is missing: put its wheel in .whl/ (see the top of $0)" >&2; exit 1; }
have omegaconf || { echo "omegaconf is missing: put its wheel in .whl/ (see the top of $0)" >&2; exit 1; }
runs="${RUNS_DIR:-runs/gpu_check}"
rm -rf "$runs"
mkdir -p "$runs"
model="$runs/model.json"
if [ "$small" = 1 ]; then
  python3 benchmarks/gpu/model_config.py "$model" --small
  copies=(--mib 16) parity=(--prompts 4 --new-tokens 8)
  loop=(data.prompts_per_step=4 algorithm.samples_per_prompt=4 algorithm.max_new_tokens=8 trainer.train_steps=2)
else
  python3 benchmarks/gpu/model_config.py "$model"
  copies=(--mib 2048) parity=(--prompts 16 --new-tokens 32)
  loop=(data.prompts_per_step=16 algorithm.samples_per_prompt=8 algorithm.max_new_tokens=64 trainer.train_steps=3)
fi
status=0
part() {  # NAME DEADLINE_S COMMAND...: run one part under its deadline, its output kept in $runs/NAME.log
  local name="$1" deadline="$2" start=$SECONDS code=0
  shift 2
  echo "== $name (deadline ${deadline}s)"
  timeout --kill-after=10 "$deadline" "$@" 2>&1 | tee "$runs/$name.log" || code=$?
  echo "PART $name $code $((SECONDS - start))" | tee -a "$runs/parts.log"
  [ "$code" = 0 ] || status=1
}
part copies 60 python3 benchmarks/gpu/check_copies.py "${copies[@]}"
part parity 150 python3 benchmarks/gpu/check_parity.py "$model" "${parity[@]}"
part loop 240 python3 benchmarks/gpu/check_loop.py "$runs/loop" model.hf_config="$model" "${loop[@]}" \
  trainer.offload.params=true trainer.offload.grads=true trainer.offload.optimizer=true
python3 benchmarks/gpu/summarize.py "$runs" || status=1

if [ "$small" = 1 ]; then exit "$status"; fi
have ray || { echo "SKIP GRPO through megarl train: ray is not importable (its wheel exceeds a lent machine's carry)"; exit "$status"; }
sglang=1
have sglang || { sglang=0; echo "SKIP SGLang cases: sglang is not importable (pip install 'megarl[sglang]')"; }
gpus="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
common=(configs/grpo_demo.yaml trainer.nproc_per_node=1 parallel.actor.tp=1 parallel.rollout.tp=1
  'logging.backends=[console]' trainer.offload.params=true trainer.offload.grads=true trainer.offload.optimizer=true)
grpo() {  # NAME STEPS OVERRIDES...: one run, then its RUN line
  local name="$1" steps="$2"
  shift 2
  python3 -m megarl.cli train "${common[@]}" trainer.train_steps="$steps" trainer.run_dir="$runs/$name" "$@" \
    | tee "$runs/$name.log" || return 1
  python3 benchmarks/gpu/summarize_run.py "$name" "$runs/$name" "$steps"
}
grpo native 2 trainer.save_interval=2 || status=1
grpo native 4 trainer.save_interval=0 || status=1
if grep -q "resuming after step 2" "$runs/native.log"; then echo "RESUME ok"; else echo "RESUME failed"; status=1; fi
if [ "$sglang" = 1 ]; then
  grpo sglang 3 parallel.rollout.engine=sglang || status=1
  grpo agent 3 parallel.rollout.engine=sglang rollout.env=tests.e2e.test_agent:ThreeTurnEnv \
    rollout.max_turns=3 rollout.max_total_tokens=20 || status=1
  python3 - "$runs/agent/metrics.jsonl" <<'PY' || status=1
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
