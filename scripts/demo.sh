#!/usr/bin/env bash
# make demo: the post-training workflow on CPU, as a user runs it on their own model.
#   1. warm start: brief supervised training of a random tiny Llama (megarl train-lm), saved as a
#      Megatron dist checkpoint
#   2. convert it to a Hugging Face directory (megarl convert mcore-to-hf): the "pretrained model"
#   3. GRPO post-training from that directory (megarl train ... model.path=DIR)
#   4. export the result as a Hugging Face directory (megarl export-hf)
#   5. load the export with transformers and generate
# Usage: scripts/demo.sh [key=value ...]   (overrides for the GRPO stage)
# Environment: DEMO_DIR (output, default runs/demo; replaced on every run), SFT_ARGS (overrides
# for the warm start), MEGARL (the megarl command), PYTHON (the interpreter with transformers).
set -euo pipefail
cd "$(dirname "$0")/.."

DEMO_DEFAULT_DIR=runs/demo DEMO_STAGES=5
source scripts/stages.sh
stage 1 "supervised warm start of a random tiny Llama -> $out/sft_model" \
    "$megarl" train-lm configs/demo/sft.yaml "trainer.save_dir=$out/sft_model" "${sft_args[@]}"
stage 2 "the warm start as a Hugging Face directory -> $out/sft_hf" \
    "$megarl" convert mcore-to-hf "$out/sft_model" "$out/sft_hf"
stage 3 "GRPO from that directory (model.path) -> $out/grpo" \
    "$megarl" train configs/demo/grpo.yaml "model.path=$out/sft_hf" "trainer.run_dir=$out/grpo" "$@"
stage 4 "export the post-trained actor -> $out/final_hf" \
    "$megarl" export-hf "$out/grpo" "$out/final_hf"
stage 5 "load $out/final_hf with transformers and generate" \
    "$python" - "$out/final_hf" <<'EOF'
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
for prompt in ("1234=", "9071=", "5558="):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=8, do_sample=False)
    print(f"  {prompt} -> {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)} (greedy)")
EOF

printf '\n=== done in %s s\n' "$SECONDS"
printf '  %s\n' "${times[@]}"
"$python" - "$out/grpo/metrics.jsonl" <<'EOF'
import json
import sys

rewards = [json.loads(line)["reward/mean"] for line in open(sys.argv[1])]
tenth = max(1, len(rewards) // 10)
print(f"  GRPO mean reward: {sum(rewards[:tenth]) / tenth:.3f} over the first 10% of {len(rewards)} steps, "
      f"{sum(rewards[-tenth:]) / tenth:.3f} over the last 10%")
EOF
echo "  reward curve: $out/grpo/reward_curve.png"
echo "The post-trained model (Hugging Face: weights, config, generation config, tokenizer): $out/final_hf"
