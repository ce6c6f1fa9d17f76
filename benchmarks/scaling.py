"""How an RL step scales: measured on this CPU machine, predicted for GPU clusters.

    python benchmarks/scaling.py            # CPU step breakdown at world 2 and 4 + the cost model
    python benchmarks/scaling.py model      # the cost model only (tables + runs/scaling/*.png)

Measured: ``megarl train`` (the GRPO demo) for a few steps at world sizes 2 and 4; the mean time
of each phase from the run's metrics. Predicted: a cost model that takes the weight-sync bytes
from the real 3D-HybridEngine planner (per rank, same-node vs other-node) and the compute from
FLOPs, for 7B and 70B dense models, Qwen3-30B-A3B and DeepSeek-V3 (671B) on 8 to 1024 GPUs.
Every assumption is printed with the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Hardware:
    name: str = "H100 SXM"
    peak_tflops: float = 989.0  # dense bf16
    hbm_tbps: float = 3.35
    nvlink_gbps: float = 450.0  # per GPU, one direction
    ib_gbps: float = 50.0  # per GPU (400 Gb/s)
    gpus_per_node: int = 8
    train_mfu: float = 0.40  # forward+backward
    prefill_mfu: float = 0.50
    decode_hbm_efficiency: float = 0.60  # of HBM bandwidth while streaming weights and KV


@dataclass(frozen=True)
class Workload:
    prompts: int = 512
    samples: int = 8
    prompt_tokens: int = 512
    response_tokens: int = 2048
    bytes_per_param: int = 2


# (model, GPUs, training t,p,d,e, generation t_g,p_g,e_g): typical layouts
SETUPS = [
    ("llama2-7b", 8, (2, 1, 4, 1), (1, 1, 1)),
    ("llama2-7b", 64, (4, 1, 16, 1), (1, 1, 1)),
    ("llama3-70b", 64, (8, 2, 4, 1), (4, 1, 1)),
    ("llama3-70b", 256, (8, 4, 8, 1), (8, 1, 1)),
    ("llama3-70b", 1024, (8, 4, 32, 1), (8, 1, 1)),
    ("qwen3-30b-a3b", 32, (4, 1, 8, 8), (2, 1, 1)),
    ("qwen3-30b-a3b", 128, (4, 2, 16, 8), (4, 1, 8)),
    ("deepseek-v3", 256, (8, 8, 4, 32), (8, 2, 16)),
    ("deepseek-v3", 1024, (8, 16, 8, 64), (8, 2, 32)),
]


def predict(name: str, gpus: int, train, gen, hw: Hardware, wl: Workload):
    from megarl.hybrid import ModelSpec, rank_traffic, regroup
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout

    args = megatron_args_from_hf(ROOT / "configs/models/reference" / f"{name}.json")
    model = ModelSpec.from_args(args)
    topk = args.config_kwargs.get("moe_router_topk", 1)
    n_total = model.numel()
    dense = sum(t.numel for t in model.tensors if t.expert is None)
    experts = n_total - dense
    n_active = dense + (experts * topk / model.num_experts if model.num_experts else 0)
    t, p, d, e = train
    layout = Layout(tp=t, pp=p, dp=d, ep=e, etp=1 if e > 1 else None)
    assert layout.world_size == gpus, (name, gpus)
    rg = regroup(layout, *gen, model.num_experts)
    flops = hw.peak_tflops * 1e12
    rows = wl.prompts * wl.samples
    tokens = rows * (wl.prompt_tokens + wl.response_tokens)
    # Generation: each replica decodes its rows; a decode step streams the replica's weights
    # or is compute-bound (KV-cache reads and attention FLOPs are left out: a lower bound).
    replicas = rg.gen.dp
    rows_per_replica = rows / replicas
    gen_ranks = rg.gen.tp * rg.gen.pp
    prefill = 2 * n_active * rows_per_replica * wl.prompt_tokens / (gen_ranks * flops * hw.prefill_mfu)
    weight_bytes = (dense + experts / max(rg.gen.ep, 1)) * wl.bytes_per_param / gen_ranks
    decode_compute = 2 * n_active * rows_per_replica / (gen_ranks * flops * hw.prefill_mfu)
    decode_memory = weight_bytes / (hw.hbm_tbps * 1e12 * hw.decode_hbm_efficiency)
    generate = prefill + wl.response_tokens * max(decode_compute, decode_memory)
    # Training: old log-probs (forward) + update (forward+backward) of the actor; GRPO, no critic.
    train_s = (2 + 6) * n_active * tokens / (gpus * flops * hw.train_mfu)
    traffic = rank_traffic(model, rg, 0, "micro_dp", hw.gpus_per_node)
    recv = traffic["received"] * wl.bytes_per_param
    other = traffic["received_other_nodes"] * wl.bytes_per_param
    sync = (recv - other) / (hw.nvlink_gbps * 1e9) + other / (hw.ib_gbps * 1e9)
    return {"model": name, "gpus": gpus, "train": train, "gen": gen, "generate_s": generate, "train_s": train_s,
            "sync_s": sync, "step_s": generate + train_s + sync, "total_b": n_total / 1e9, "active_b": n_active / 1e9,
            "sync_gb": recv / 1e9, "decode_bound": "memory" if decode_memory > decode_compute else "compute"}


def cost_model(out_dir: Path) -> None:
    hw, wl = Hardware(), Workload()
    print(f"\nCost model, assumptions: {hw}\n  workload per step: {wl}\n  generation = prefill at prefill_mfu + "
          f"response_tokens decode steps, each max(compute, weights/(HBM x efficiency)) per replica (KV-cache reads, "
          f"attention FLOPs and MoE dispatch are not modelled: generation is a lower bound); training = "
          f"(2 + 6) x active params x tokens at train_mfu (old log-probs + update, GRPO, no critic); weight sync "
          f"= the planner's bytes for rank 0, same-node / NVLink + other-node / InfiniBand; phases not overlapped.")
    print(f"{'model':14s} {'GPUs':>5s} {'params B (active)':>18s} {'train t,p,d,e':>14s} {'gen t,p,e':>10s} "
          f"{'generate s':>11s} {'train s':>8s} {'sync s':>7s} {'sync GB':>8s} {'step s':>8s}  decode")
    results = [predict(*setup, hw, wl) for setup in SETUPS]
    for r in results:
        print(f"{r['model']:14s} {r['gpus']:5d} {r['total_b']:8.1f} ({r['active_b']:6.1f}) "
              f"{','.join(map(str, r['train'])):>14s} {','.join(map(str, r['gen'])):>10s} {r['generate_s']:11.1f} "
              f"{r['train_s']:8.1f} {r['sync_s']:7.2f} {r['sync_gb']:8.2f} {r['step_s']:8.1f}  {r['decode_bound']}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['model']}\n{r['gpus']} GPUs" for r in results]
    bottom = [0.0] * len(results)
    for key, label in (("generate_s", "generate"), ("train_s", "train"), ("sync_s", "weight sync")):
        values = [r[key] for r in results]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("predicted seconds per RL step")
    ax.set_yscale("log")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "cost_model.png", dpi=100)
    print(f"plot: {out_dir / 'cost_model.png'}")


def cpu_breakdown() -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled")
    print("Measured on this machine (GRPO demo, 16 prompts x 8 samples, mean of steps 2-6):")
    print(f"{'world':>5s} {'layout':>14s} " + " ".join(f"{p:>13s}" for p in ("generate", "reward", "old_logprob",
                                                                         "update", "weight_sync", "step")))
    for world, tp in ((2, 2), (4, 2)):
        with tempfile.TemporaryDirectory() as run:
            cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/grpo_demo.yaml", "trainer.train_steps=6",
                   f"trainer.nproc_per_node={world}", f"parallel.actor.tp={tp}", "logging.progress_bar=false",
                   "logging.mlflow=false", f"trainer.run_dir={run}"]
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
            rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()][1:]
        mean = lambda k: sum(r[k] for r in rows) / len(rows)
        keys = ("time/generate_s", "time/reward_s", "time/old_log_prob_s", "time/actor_update_s", "time/weight_sync_s",
                "time/step_s")
        print(f"{world:5d} {f'tp={tp} dp={world // tp}':>14s} " + " ".join(f"{mean(k):13.3f}" for k in keys))


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "all":
        cpu_breakdown()
    cost_model(ROOT / "runs" / "scaling")


if __name__ == "__main__":
    main()
