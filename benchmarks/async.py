"""Synchronous vs asynchronous RL on 4 CPU ranks, side by side in one run.

    python benchmarks/async.py [--steps 10] [--warmup 2] [--case all|io|long_tail] [--tail-steps 30] [--engines native,vllm]

Four schedules of the GRPO demo (configs/grpo_demo.yaml, actor tp=2), each on 4 ranks:
colocated sync (actor on all 4, dp=2), split sync (actor on 2, rollout on 2), split
one-step-off, and split streaming with ``trainer.max_staleness=2``. Two cases:

* ``io``: the reward waits on I/O (a remote verifier): each sample sleeps so that scoring a step
  takes about as long as the split trainer's training phases (measured first). Overlap hides it.
* ``compute``: the built-in verifier (instant); generation and training are both CPU work.

Per schedule: mean step time after ``--warmup`` steps, speedup over split sync, the fraction of
generation + scoring hidden behind training (1 - wait / (generate + reward): the trainer's wait
for the next batch against what drawing it took), and the staleness. The cost model line gives
what each schedule would take if every rank had its own device (GPUs): sync = train + generate +
reward + sync, one-step-off = max(train, generate + reward) + sync, from the measured phases.

A third case, ``long_tail`` (:func:`long_tail`): responses of 5 to 48 tokens, for split sync,
one-step-off, batch streaming and sample streaming with partial rollouts (``trainer.loop=async``):
samples per second, the rollout's idle share, the lengths and the reward over the last 10% of
steps. ``--engines native,vllm`` adds vLLM's: the same schedules, and batch streaming with partial
rollouts besides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEDULES = {
    "colocated sync": ["trainer.nproc_per_node=4"],
    "split sync": ["trainer.placement=split", "parallel.rollout.nproc=2"],
    "split one-step-off": ["trainer.placement=split", "parallel.rollout.nproc=2", "trainer.loop=one_step_off"],
    "split stream (max_staleness=2)": ["trainer.placement=split", "parallel.rollout.nproc=2",
                                       "trainer.loop=one_step_off", "trainer.max_staleness=2",
                                       "algorithm.rollout_correction=token_tis"],
}
SPLIT = ["trainer.placement=split", "parallel.rollout.nproc=2"]
# The long tail: the demo task with room for 48 new tokens. A response that has learnt to reverse
# the digits ends after 5 tokens; one that misses the end runs to 48 (10x): early in training
# most rows are long, later most are short with a tail. Each schedule on the same 4 ranks and seed.
LONG_TAIL = {
    "split sync": SPLIT,
    "split one-step-off": [*SPLIT, "trainer.loop=one_step_off"],
    "split batch stream (max_staleness=2)": [*SPLIT, "trainer.loop=one_step_off", "trainer.max_staleness=2",
                                             "algorithm.rollout_correction=token_tis"],
    "split sample stream + partial (max_staleness=2)": [
        *SPLIT, "trainer.loop=async", "trainer.max_staleness=2", "algorithm.rollout_correction=token_tis",
        "parallel.rollout.partial_rollout=true", "parallel.rollout.partial_chunk_tokens=8"],
}
TRAIN_PHASES = ("old_log_prob", "actor_update")


def run(overrides, steps: int, run_dir: Path):
    from megarl.config import load_config
    from megarl.entrypoints.train_rl import prepare, run as train

    cfg = load_config([str(ROOT / "configs/grpo_demo.yaml")],
                      [f"trainer.run_dir={run_dir}", f"trainer.train_steps={steps}", "logging.progress_bar=false",
                       "logging.backends=[console]", *overrides])
    return train(prepare(cfg))


def summarize(rows, warmup: int):
    rows = rows[warmup:]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rows)
    draw = mean("time/generate_s") + mean("time/reward_s")
    wait = mean("time/wait_rollout_s") if "time/wait_rollout_s" in rows[0] else draw  # sync: all of it waits
    train = sum(mean(f"time/{p}_s") for p in TRAIN_PHASES)
    return {"step_s": mean("time/step_s"), "generate_s": mean("time/generate_s"), "reward_s": mean("time/reward_s"),
            "train_s": train, "sync_s": mean("time/weight_sync_s"), "hidden": max(0.0, 1 - wait / draw) if draw else 0.0,
            "staleness_max": max(r.get("sampling/staleness", 0) for r in rows),
            "staleness_mean": mean("sampling/staleness_mean") if "sampling/staleness_mean" in rows[0] else 0.0}


def case(name: str, steps: int, warmup: int, extra, work: Path):
    out = {}
    for schedule, overrides in SCHEDULES.items():
        rows = run([*overrides, *extra], steps, work / f"{name}-{schedule.split()[0]}-{len(out)}")
        out[schedule] = summarize(rows, warmup)
        print(f"[{name}] {schedule}: {json.dumps({k: round(v, 3) for k, v in out[schedule].items()})}", flush=True)
    base = out["split sync"]["step_s"]
    print(f"\n## {name}\n")
    print("| schedule | step s | vs split sync | generate s | reward s | train s | sync s | hidden | staleness max/mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for schedule, s in out.items():
        print(f"| {schedule} | {s['step_s']:.3f} | {base / s['step_s']:.2f}x | {s['generate_s']:.3f} | "
              f"{s['reward_s']:.3f} | {s['train_s']:.3f} | {s['sync_s']:.3f} | {s['hidden']:.0%} | "
              f"{s['staleness_max']}/{s['staleness_mean']:.2f} |")
    s = out["split sync"]
    sync_model = s["train_s"] + s["generate_s"] + s["reward_s"] + s["sync_s"]
    off_model = max(s["train_s"], s["generate_s"] + s["reward_s"]) + s["sync_s"]
    print(f"\ncost model (own device per rank, from split sync's phases): sync {sync_model:.3f} s, one-step-off "
          f"{off_model:.3f} s per step: {sync_model / off_model:.2f}x")
    return out


# vLLM: the same, and batch streaming with partial rollouts (its scheduler paused between chunks)
VLLM_TAIL = {**LONG_TAIL,
             "split batch stream + partial (max_staleness=2)": [
                 *LONG_TAIL["split batch stream (max_staleness=2)"], "parallel.rollout.partial_rollout=true",
                 "parallel.rollout.partial_chunk_tokens=8"]}
TAIL_MODEL = "model.hf_config=configs/models/tiny-digits-hd32.json"  # head_dim 32: vLLM's CPU attention's least


def long_tail(steps: int, warmup: int, work: Path, engine: str = "native") -> dict:
    """Samples per second (rows / mean step time after ``warmup``), the rollout's idle share, the
    response lengths and the reward over the last 10% of steps (equal samples: the same steps of
    the same rows) for each LONG_TAIL schedule (VLLM_TAIL's on vLLM)."""
    out = {}
    schedules = LONG_TAIL if engine == "native" else VLLM_TAIL
    for schedule, overrides in schedules.items():
        rows = run([*overrides, "algorithm.max_new_tokens=48", TAIL_MODEL, f"parallel.rollout.engine={engine}"],
                   steps, work / f"tail-{engine}-{len(out)}")
        mean = lambda key, rs=rows[warmup:]: statistics.mean(r.get(key, 0.0) for r in rs)
        step_s = mean("time/step_s")
        tail = rows[-max(1, len(rows) // 10):]
        # the rollout's idle share: the async loop measures it; the batch loops' rollout is busy
        # for generate_s of each step (split: its own ranks)
        idle = mean("sampling/rollout_idle_frac") if "sampling/rollout_idle_frac" in rows[0] else \
            max(0.0, 1 - mean("time/generate_s") / step_s)
        out[schedule] = {"samples_per_s": 16 * 8 / step_s, "step_s": step_s, "rollout_idle": idle,
                         "length_mean": mean("response/length_mean"), "length_max": mean("response/length_max"),
                         "reward_last10": statistics.mean(r["reward/mean"] for r in tail),
                         "reward_curve": [round(r["reward/mean"], 3) for r in rows]}
        print(f"[long tail, {engine}] {schedule}: {json.dumps({k: v if isinstance(v, list) else round(v, 3) for k, v in out[schedule].items()})}",
              flush=True)
    print(f"\n## long tail, {engine} (max_new_tokens=48; 16 prompts x 8 samples)\n")
    print("| schedule | samples/s | vs one-step-off | step s | rollout idle | length mean / max | reward, last 10% |")
    print("|---|---|---|---|---|---|---|")
    base = out["split one-step-off"]["samples_per_s"]
    for schedule, s in out.items():
        print(f"| {schedule} | {s['samples_per_s']:.1f} | {s['samples_per_s'] / base:.2f}x | {s['step_s']:.3f} | "
              f"{s['rollout_idle']:.0%} | {s['length_mean']:.1f} / {s['length_max']:.0f} | {s['reward_last10']:.3f} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--case", choices=["all", "io", "long_tail"], default="all")
    parser.add_argument("--tail-steps", type=int, default=30)
    parser.add_argument("--engines", default="native", help="long_tail: native and/or vllm (comma-separated)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.case in ("all", "long_tail"):
            for engine in args.engines.split(","):
                tail = long_tail(args.tail_steps, args.warmup, work, engine)
                ratio = (tail["split sample stream + partial (max_staleness=2)"]["samples_per_s"]
                         / tail["split one-step-off"]["samples_per_s"])
                gap = abs(tail["split sample stream + partial (max_staleness=2)"]["reward_last10"]
                          - tail["split sync"]["reward_last10"])
                print(f"\nlong tail, {engine}: sample streaming + partial is {ratio:.2f}x one-step-off's samples/s "
                      f"(target >= 1.3x); its reward over the last 10% of steps is {gap:.3f} from sync's (target <= 0.03)")
            if args.case == "long_tail":
                return 0
        # the split trainer's training seconds per step, to size the I/O wait like it
        probe = summarize(run(SCHEDULES["split sync"], args.warmup + 3, work / "probe"), args.warmup)
        rows = 16 * 8  # prompts x samples of the demo
        workers = 8
        latency = probe["train_s"] * workers / rows
        os.environ["MEGARL_BENCH_REWARD_LATENCY_S"] = str(latency)
        print(f"probe: split trainer trains {probe['train_s']:.3f} s per step; the I/O reward waits {latency * 1e3:.1f} ms "
              f"per sample over {workers} reward workers (~{latency * rows / workers:.3f} s per step)", flush=True)
        io = case("io", args.steps, args.warmup, ["algorithm.reward_fn=benchmarks.async_reward:remote_reverse_digits",
                                                  f"algorithm.reward_workers={workers}"], work)
        compute = case("compute", args.steps, args.warmup, [], work)
    speedup = io["split sync"]["step_s"] / io["split one-step-off"]["step_s"]
    print(f"\nio: split one-step-off is {speedup:.2f}x split sync per step (acceptance: >= 1.5x)")
    print(f"compute: split one-step-off is {compute['split sync']['step_s'] / compute['split one-step-off']['step_s']:.2f}x "
          f"split sync on 2 cores shared by 4 busy processes")
    return 0 if speedup >= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
