"""Native rollout throughput: KV cache against full recomputation, batch-size scaling, and
transformers' own ``generate`` on the same weights.

    python benchmarks/rollout.py [--max-new 64] [--repeats 3]

Each setting runs under torchrun on this machine (gloo on CPU, NCCL on GPUs): the actor is built
in its training layout, the rollout in the generation layout is fed by the hybrid engine, and
greedy decoding of random prompts (16-48 tokens) runs with and without the KV cache. Tokens/s
counts generated tokens over the wall time of ``generate``, best of ``--repeats`` runs.

In the one-process setting, the same weights also go into transformers' model of the same config
(through the converters' name mapping) and its ``generate`` (KV cache, SDPA attention, greedy, the
same left-padded prompts and ``max_new_tokens``, no EOS) runs interleaved with the native engine,
one thread each (``torch.set_num_threads(1)``), so that both see the same machine load. The
greedy tokens of both are compared row by row.
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


def worker(args) -> None:
    import torch
    import torch.distributed as dist

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
    for tp, gen_tp, batches in SETTINGS[world]:
        groups = build_groups(Layout(tp=tp, dp=world // tp))
        set_seed(0, groups)
        state = build_frozen_state(model_cfg, groups)
        rollout = NativeRollout.colocated(model_cfg, margs, regroup(groups.layout, gen_tp), state.model)
        rollout.update_weights(0)
        hf = hf_twin(rollout, model_cfg, margs, json.loads(Path(args.model).read_text())) if world == 1 else None
        gen = torch.Generator().manual_seed(0)
        for batch in batches:
            prompts = [torch.randint(3, margs.vocab_size, (int(n),), generator=gen).tolist()
                       for n in torch.randint(16, 49, (batch,), generator=gen)]
            sampling = SamplingParams(temperature=0, max_new_tokens=args.max_new)
            row = {"processes": world, "tp": tp, "gen_tp": gen_tp, "batch": batch}
            for cache in (True, False):
                rollout.kv_cache = cache
                best = best_hf = float("inf")
                for _ in range(args.repeats):
                    dist.barrier()
                    responses = rollout.generate(prompts, sampling)
                    best = min(best, rollout.last.seconds)
                    if hf is not None and cache:  # interleaved: both see the same machine load
                        seconds, hf_tokens = hf_generate(hf, prompts, args.max_new)
                        best_hf = min(best_hf, seconds)
                tokens = sum(r.length for r in responses)
                row["kv_cache" if cache else "recompute"] = tokens / best
                if hf is not None and cache:
                    row["transformers"] = sum(map(len, hf_tokens)) / best_hf
                    row["greedy_equal_rows"] = sum(r.token_ids == t for r, t in zip(responses, hf_tokens))
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(row), flush=True)
        groups.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "worker"])
    parser.add_argument("--model", default="")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting; the best counts")
    args = parser.parse_args()
    if args.what == "worker":
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    print(f"model: llama, hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab "
          f"{MODEL['vocab_size']}; {args.max_new} new tokens per prompt, greedy")
    print(f"{'procs':>5s} {'t':>2s} {'t_g':>3s} {'batch':>5s} {'KV cache tok/s':>15s} {'recompute tok/s':>16s} "
          f"{'speed-up':>9s} {'transformers tok/s':>19s} {'native/HF':>10s} {'equal greedy rows':>18s}")
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "model.json"
        path.write_text(json.dumps(MODEL))
        for world in SETTINGS:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   __file__, "worker", "--model", str(path), "--max-new", str(args.max_new),
                   "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[7:])
                    line = (f"{r['processes']:5d} {r['tp']:2d} {r['gen_tp']:3d} {r['batch']:5d} {r['kv_cache']:15.1f} "
                            f"{r['recompute']:16.1f} {r['kv_cache'] / r['recompute']:8.1f}x")
                    if "transformers" in r:
                        line += (f" {r['transformers']:19.1f} {r['kv_cache'] / r['transformers']:9.2f}x "
                                 f"{r['greedy_equal_rows']:>11d} / {r['batch']}")
                    print(line, flush=True)


if __name__ == "__main__":
    main()
