#!/usr/bin/env bash
# The agentic demo on CPU: a tiny Llama learns to use a calculator tool with multi-turn GRPO.
#   1. warm start: supervised training of a random tiny Llama on calculator transcripts in which
#      the demonstrator calls the tool 30% of the time (megarl train-lm, configs/agent/sft.yaml)
#   2. convert it to a Hugging Face directory (megarl convert mcore-to-hf)
#   3. multi-turn GRPO from that directory against megarl.tasks.calculator:CalculatorTask
#      (megarl train configs/agent/calculator.yaml model.path=DIR)
#   4. the reward, the tool-call rate and the step time per phase, per tenth of the steps
# Usage: scripts/agent_demo.sh [key=value ...]   (overrides for the GRPO stage)
# Environment: DEMO_DIR (output, default runs/agent; replaced on every run), SFT_ARGS (overrides
# for the warm start), MEGARL (the megarl command), PYTHON (the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."

DEMO_DEFAULT_DIR=runs/agent DEMO_STAGES=4
source scripts/stages.sh
stage 1 "supervised warm start on calculator transcripts -> $out/sft_model" \
    "$megarl" train-lm configs/agent/sft.yaml "trainer.save_dir=$out/sft_model" "${sft_args[@]}"
stage 2 "the warm start as a Hugging Face directory -> $out/sft_hf" \
    "$megarl" convert mcore-to-hf "$out/sft_model" "$out/sft_hf"
stage 3 "multi-turn GRPO with the calculator tool (model.path) -> $out/grpo" \
    "$megarl" train configs/agent/calculator.yaml "model.path=$out/sft_hf" "trainer.run_dir=$out/grpo" "$@"
stage 4 "the curve" "$python" - "$out/grpo/metrics.jsonl" <<'EOF_PY'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
tenth = max(1, len(rows) // 10)
columns = {"reward": "reward/mean", "tool calls": "agent/tool_calls_mean", "turns": "agent/turns_mean",
           "step s": "time/step_s", "generate s": "time/generate_s", "tool s": "time/tool_s",
           "env step s": "time/tool_step_s",
           "log-prob s": "time/old_log_prob_s", "update s": "time/actor_update_s", "sync s": "time/weight_sync_s"}
print(f"{'steps':>9}  " + "  ".join(f"{name:>10}" for name in columns))
for start in range(0, len(rows), tenth):
    part = rows[start:start + tenth]
    means = [sum(r.get(key, 0.0) for r in part) / len(part) for key in columns.values()]
    print(f"{start + 1:>4}-{start + len(part):<4}  " + "  ".join(f"{m:>10.3f}" for m in means))
EOF_PY

printf '\n=== done in %s s\n' "$SECONDS"
printf '  %s\n' "${times[@]}"
echo "  per-step metrics (agent/*, time/*): $out/grpo/metrics.jsonl; reward curve: $out/grpo/reward_curve.png"
