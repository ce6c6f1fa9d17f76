"""Write the GPU check's model config: a Qwen2.5-0.5B-shaped Hugging Face ``config.json`` (random
weights; no hub), or with ``--small`` the same architecture at test size for the CPU harness.

    python3 benchmarks/gpu/model_config.py OUT.json [--small]

Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 heads of 64, 2 KV heads, intermediate 4864,
vocabulary 151936, tied embeddings, q/k/v biases (Qwen2's), rope theta 1e6. No sliding window
(Qwen2.5-0.5B's ``use_sliding_window`` is false)."""

from __future__ import annotations

import json
import sys

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768),
    # the harness's size: the same architecture (tied, GQA, biases); the digit tokenizer's ids fit
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=256),
}


def qwen2_config(shape: str) -> dict:
    s = SHAPES[shape]
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **s, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "initializer_range": 0.02, "tie_word_embeddings": True,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "layer_types": ["full_attention"] * s["num_hidden_layers"], "use_sliding_window": False,
            "sliding_window": None, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}


def main(argv) -> int:
    if len(argv) not in (1, 2) or (len(argv) == 2 and argv[1] != "--small"):
        sys.exit(__doc__)
    with open(argv[0], "w") as f:
        json.dump(qwen2_config("small" if len(argv) == 2 else "qwen2.5-0.5b"), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
