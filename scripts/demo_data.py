"""make demo, stage 1: the warm start's chat data. Writes OUT/tokenizer (the built-in digit
tokenizer as an HF tokenizer, with its chat template, and a generation config that stops at its
EOS, which the exports carry) and OUT/conversations.jsonl: COUNT
demonstrations of the built-in task as ``messages`` rows (``1234=`` -> ``4321``), each answer digit
replaced by a random one with probability NOISE, as a user's SFT data would be.

Usage: python scripts/demo_data.py OUT [COUNT] [NOISE] [SEED]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megarl.data.digit_hf import save_digit_tokenizer
from megarl.data.tokenizer import DigitTokenizer
from megarl.tasks.reverse_digits import reverse_digits_conversations


def main(out: str, count: int = 8000, noise: float = 0.3, seed: int = 1) -> None:
    out_dir = Path(out)
    save_digit_tokenizer(out_dir / "tokenizer", chat_template=True)
    digits = DigitTokenizer()
    ids = {"bos_token_id": digits.bos_token_id, "eos_token_id": digits.eos_token_id, "pad_token_id": digits.pad_token_id}
    (out_dir / "tokenizer" / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    rows = reverse_digits_conversations(count, num_digits=4, seed=seed, label_noise=noise)
    tmp = out_dir / "conversations.jsonl.tmp"
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(out_dir / "conversations.jsonl")
    print(f"{out_dir / 'conversations.jsonl'}: {count} conversations; {out_dir / 'tokenizer'}: the digit tokenizer")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], *(int(args[1]),) if len(args) > 1 else (), *(float(args[2]),) if len(args) > 2 else (),
         *(int(args[3]),) if len(args) > 3 else ())
