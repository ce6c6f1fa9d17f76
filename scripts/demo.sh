#!/usr/bin/env bash
# make demo: the post-training workflow on CPU, as a user runs it on their own model.
#   1. the warm start's chat data: demonstrations of the task as conversations, and the tokenizer
#      whose chat template renders them (scripts/demo_data.py)
#   2. warm start: supervised fine-tuning of a random tiny Llama on them (megarl sft)
#   3. export it as a Hugging Face directory (megarl export-hf): the "pretrained model"
#   4. GRPO post-training from that directory (megarl train ... model.path=DIR)
#   5. export the result as a Hugging Face directory (megarl export-hf)
#   6. load the export with transformers and generate
# Usage: scripts/demo.sh [key=value ...]   (overrides for the GRPO stage)
# Environment: DEMO_DIR (output, default runs/demo; replaced on every run), SFT_ARGS (overrides
# for the warm start), MEGARL (the megarl command), PYTHON (the interpreter with transformers).
set -euo pipefail
cd "$(dirname "$0")/.."

DEMO_DEFAULT_DIR=runs/demo DEMO_STAGES=6
source scripts/stages.sh
stage 1 "the warm start's conversations and tokenizer -> $out/conversations.jsonl, $out/tokenizer" \
    "$python" scripts/demo_data.py "$out"
stage 2 "supervised fine-tuning of a random tiny Llama on them -> $out/sft" \
    "$megarl" sft configs/demo/sft.yaml "data.train_files=[$out/conversations.jsonl]" "data.tokenizer=$out/tokenizer" \
    "trainer.run_dir=$out/sft" "${sft_args[@]}"
stage 3 "the warm start as a Hugging Face directory -> $out/sft_hf" \
    "$megarl" export-hf "$out/sft" "$out/sft_hf"
stage 4 "GRPO from that directory (model.path) -> $out/grpo" \
    "$megarl" train configs/demo/grpo.yaml "model.path=$out/sft_hf" "trainer.run_dir=$out/grpo" "$@"
stage 5 "export the post-trained actor -> $out/final_hf" \
    "$megarl" export-hf "$out/grpo" "$out/final_hf"
stage 6 "load $out/final_hf with transformers and generate" \
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
