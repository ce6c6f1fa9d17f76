"""``megarl sft``'s training step against a plain transformers + torch loop, side by side in one
process: the same model, weights, batch, optimizer settings and threads.

    python benchmarks/sft.py [--steps 6] [--threads 2] [--rows 16] [--micro 4]

The model is a Llama of real width (hidden 512, 8 layers, vocabulary 8192, fp32; about 30M
parameters), made with transformers and loaded into Megatron through ``model.path``'s loader. The
batch: ``--rows`` conversation-shaped rows of 96-256 tokens, the loss on two assistant spans each.
Per step, both sides run ``--rows / --micro`` micro-batches of forward and backward, then one Adam
step with gradient clipping:

- ``transformers``: ``AutoModelForCausalLM`` in train mode, the token-mean cross entropy of the
  masked labels, ``torch.optim.AdamW``;
- ``megarl padded`` and ``megarl packed``: megarl's SFT learner (megarl.roles.sft: Megatron DDP,
  the distributed optimizer, the engine's micro-batching; packed = THD rows, no compute on padding).

Printed: the first step's loss on each side (the same weights and batch: they agree), then the
mean step time after the first (warm-up) step and tokens/s (real tokens of the batch per second),
and the ratio megarl / transformers (the goal: >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512, "intermediate_size": 1408,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "dtype": "float32"}
LR = 1e-4


def make_batch(rows: int, seed: int = 0) -> dict:
    """Right-padded next-token rows of 96-256 real tokens; two assistant spans trained per row."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(96, 257, (rows,), generator=gen)
    seq = int(lengths.max())
    tokens = torch.randint(3, MODEL["vocab_size"], (rows, seq + 1), generator=gen)
    position = torch.arange(seq)
    real = position.unsqueeze(0) < lengths.unsqueeze(1)
    spans = ((position >= 32) & (position < 64)) | (position >= 80)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": (real & spans).float(), "position_ids": position.expand(rows, -1).contiguous(),
            "lengths": lengths}


def transformers_loop(model_dir: Path, batch: dict, steps: int, micro: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    total = batch["loss_mask"].sum()
    times, first = [], None
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i in range(0, len(batch["tokens"]), micro):
            rows = slice(i, i + micro)
            width = int(batch["lengths"][rows].max())  # each micro-batch padded to its longest row
            logits = model(input_ids=batch["tokens"][rows, :width], position_ids=batch["position_ids"][rows, :width]).logits
            logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["labels"][rows, :width, None]).squeeze(-1)
            loss = -(logp * batch["loss_mask"][rows, :width]).sum() / total
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
        first = loss_sum if first is None else first
    return first, times


def megarl_loop(model_dir: Path, batch: dict, steps: int, micro: int, packed: bool):
    from megarl.config import ModelConfig, OptimizerConfig
    from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.parallel import Layout, build_groups
    from megarl.roles.sft import SupervisedLM
    from megarl.runtime import init_distributed, set_seed

    init_distributed()
    groups = build_groups(Layout())
    set_seed(0, groups)
    optim = OptimizerConfig(lr=LR, min_lr=LR, lr_warmup_steps=0, weight_decay=0.0, clip_grad=1.0)
    state = build_train_state(ModelConfig(hf_config=str(model_dir / "config.json")), optim, groups, steps,
                              init_checkpoint=str(model_dir))
    learner = SupervisedLM(MegatronEngine(state, MODEL["vocab_size"]), groups,
                           MicroBatching(micro_batch_size=micro, packed=packed))
    inputs = {k: v for k, v in batch.items() if k != "lengths"}
    times, first = [], None
    for _ in range(steps):
        start = time.perf_counter()
        metrics = learner.train_step(inputs)
        times.append(time.perf_counter() - start)
        first = metrics["loss"] if first is None else first
    groups.destroy()
    return first, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import transformers

    batch = make_batch(args.rows)
    tokens = int(batch["lengths"].sum())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**MODEL)).save_pretrained(model_dir)
        (model_dir / "config.json").write_text(json.dumps({**json.loads((model_dir / "config.json").read_text())}))
        results = {"transformers": transformers_loop(model_dir, batch, args.steps, args.micro)}
        results["megarl padded"] = megarl_loop(model_dir, batch, args.steps, args.micro, packed=False)
        results["megarl packed"] = megarl_loop(model_dir, batch, args.steps, args.micro, packed=True)
    print(f"SFT step: {args.rows} rows, {tokens} real tokens, micro-batches of {args.micro}, "
          f"{args.threads} threads, {args.steps} steps (the first is warm-up)")
    base = None
    for name, (first, times) in results.items():
        mean = sum(times[1:]) / len(times[1:])
        rate = tokens / mean
        base = base or rate
        print(f"  {name:14s} first loss {first:.6f}  step {mean:6.3f} s  {rate:8.0f} tokens/s  "
              f"ratio {rate / base:.2f}")


if __name__ == "__main__":
    main()
