"""LoRA against full fine-tuning, side by side in one run: memory, optimizer state, checkpoint,
step time and weight-sync bytes.

    python benchmarks/lora.py [--rank 16] [--steps 4] [--world 2]

Each mode trains the same model (a ~30M-parameter Llama, hidden 512, 8 layers, fp32) at tp=2 in
its own processes (so each has its own memory peaks): ``full`` trains every weight; ``lora`` puts
rank-``--rank`` adapters on all four linears of every layer and freezes the rest. Per mode:
- host peak RSS per phase (build, update, sync, checkpoint), the max over ranks, sampled every 5 ms;
- optimizer state (Adam moments, fp32 main copies where they are copies) and gradient buffers,
  summed over ranks;
- the train-state checkpoint's bytes on disk (LoRA's holds the adapters and their state only);
- the mean step time of an actor update (forward, backward, optimizer) after the first;
- the colocated weight sync to a tp=1 generation layout (the micro-DP all-gather): bytes received
  by all ranks at the first sync and at a later one, and the tensors moved.
Ratios are lora / full.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
PHASES = ("build", "update", "sync", "checkpoint")


class PeakRSS:
    """The peak resident memory of this process during each phase (a sampling thread)."""

    def __init__(self):
        import psutil

        self.process, self.phase, self.peaks = psutil.Process(), None, {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            if self.phase is not None:
                rss = self.process.memory_info().rss
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def enter(self, phase: str) -> None:
        self.phase = phase

    def stop(self) -> dict:
        self.done.set()
        self.thread.join(timeout=1.0)
        return self.peaks


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megarl.checkpoint.train_state import save_train_state
    from megarl.config import ModelConfig, OptimizerConfig
    from megarl.config.schema import LoRAConfig
    from megarl.engines import supervised
    from megarl.engines.megatron_engine import MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.hybrid import regroup
    from megarl.hybrid.executor import Resharder
    from megarl.hybrid.shards import ModelSpec
    from megarl.models import megatron_args_from_hf
    from megarl.parallel import Layout, build_groups
    from megarl.runtime import init_distributed, set_seed

    peaks = PeakRSS()
    init_distributed()
    layout = Layout(tp=dist.get_world_size())
    groups = build_groups(layout)
    set_seed(0, groups)
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank) if args.mode == "lora" else LoRAConfig()
    model = ModelConfig(hf_config=args.model, lora=lora)
    peaks.enter("build")
    state = build_train_state(model, OptimizerConfig(lr=1e-4), groups, args.steps)
    engine = supervised.engine(state)
    # distinct parameters: a TP-split one counted on every rank, a replicated one on TP rank 0
    def distinct(p) -> int:
        return p.numel() if getattr(p, "tensor_model_parallel", False) or groups.tp_rank == 0 else 0

    trainable = sum(distinct(p) for c in state.model for p in c.parameters() if p.requires_grad)
    total = sum(distinct(p) for c in state.model for p in c.parameters())
    gen = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(3, MODEL["vocab_size"], (8, 128), generator=gen)}
    batch["labels"] = batch["tokens"].roll(-1, 1)
    batch["loss_mask"] = torch.ones(8, 128)
    batch["position_ids"] = torch.arange(128).expand(8, -1).contiguous()
    peaks.enter("update")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        supervised.train_step(engine, supervised.dp_shard(batch, groups), MicroBatching(2))
        times.append(time.perf_counter() - start)
    optimizer_bytes = sum(t.numel() * t.element_size() for opt in getattr(state.optimizer, "chained_optimizers",
                                                                          [state.optimizer])
                          for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t))
    optimizer_bytes += sum(p.numel() * p.element_size() for opt in getattr(state.optimizer, "chained_optimizers",
                                                                           [state.optimizer])
                           for g in opt.optimizer.param_groups for p in g["params"]
                           if not any(p is q for c in state.model for q in c.parameters()))  # main copies
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for c in state.model for b in c.buffers)
    peaks.enter("sync")
    args_ = megatron_args_from_hf(args.model)
    resharder = Resharder.create(ModelSpec.from_args(args_), regroup(layout, 1, 1, 1, 0), state.model)
    syncs = []
    for _ in range(2):
        resharder.sync()
        s = resharder.last
        syncs.append({"bytes": s.bytes_received, "moved": s.tensors_moved, "seconds": s.seconds})
    del resharder
    peaks.enter("checkpoint")
    save_train_state(state, Path(args.work) / args.mode)
    peaks.enter(None)
    dist.barrier()
    local = torch.tensor([float(peaks.stop().get(p, 0)) for p in PHASES]
                         + [float(optimizer_bytes), float(grad_bytes), float(trainable), float(total)]
                         + [float(s["bytes"]) for s in syncs])
    maxed, summed = local.clone(), local.clone()
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    dist.all_reduce(summed)
    if dist.get_rank() == 0:
        ckpt = sum(f.stat().st_size for f in (Path(args.work) / args.mode).rglob("*") if f.is_file())
        n = len(PHASES)
        print("RESULT " + json.dumps({
            "peak_rss_mb": {p: maxed[i].item() / 2**20 for i, p in enumerate(PHASES)},
            "optimizer_mb": summed[n].item() / 2**20, "grads_mb": summed[n + 1].item() / 2**20,
            "trainable": summed[n + 2].item(), "params": summed[n + 3].item(), "checkpoint_mb": ckpt / 2**20,
            "step_s": sum(times[1:]) / max(len(times) - 1, 1),
            "sync_first_mb": summed[n + 4].item() / 2**20, "sync_later_mb": summed[n + 5].item() / 2**20,
            "moved_first": syncs[0]["moved"], "moved_later": syncs[1]["moved"]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode")
    parser.add_argument("--model")
    parser.add_argument("--work")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as work:
        config = Path(work) / "model.json"
        config.write_text(json.dumps(MODEL))
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        for mode in ("full", "lora"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
                   __file__, "--worker", f"--mode={mode}", f"--rank={args.rank}", f"--steps={args.steps}",
                   f"--model={config}", f"--work={work}"]
            out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
            results[mode] = next(json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT "))
    full, lora = results["full"], results["lora"]
    print(f"{full['params'] / 1e6:.1f}M-parameter Llama (hidden 512, 8 layers, fp32) at tp={args.world}; "
          f"LoRA rank {args.rank} on linear_qkv, linear_proj, linear_fc1, linear_fc2; {args.steps} steps")
    rows = [("trainable parameters", "trainable", "{:.0f}")]
    rows += [(f"peak host RSS, {p} (MiB, max rank)", ("peak_rss_mb", p), "{:.0f}") for p in PHASES]
    rows += [("optimizer state (MiB, all ranks)", "optimizer_mb", "{:.2f}"), ("gradient buffers (MiB, all ranks)", "grads_mb", "{:.2f}"),
             ("train-state checkpoint (MiB)", "checkpoint_mb", "{:.2f}"), ("step time (s)", "step_s", "{:.3f}"),
             ("sync received, first (MiB)", "sync_first_mb", "{:.2f}"), ("sync received, later (MiB)", "sync_later_mb", "{:.2f}"),
             ("tensors moved, first sync", "moved_first", "{:.0f}"), ("tensors moved, later sync", "moved_later", "{:.0f}")]
    print(f"| {'':41s} | {'full':>10s} | {'lora':>10s} | {'lora/full':>9s} |")
    print(f"|{'-' * 43}|{'-' * 12}|{'-' * 12}|{'-' * 11}|")
    for label, key, fmt in rows:
        a, b = ((r[key[0]][key[1]] if isinstance(key, tuple) else r[key]) for r in (full, lora))
        print(f"| {label:41s} | {fmt.format(a):>10s} | {fmt.format(b):>10s} | {b / a if a else float('nan'):9.3f} |")


if __name__ == "__main__":
    main()
