"""Run by check_rollout.sh on a GPU machine: the native rollout (and SGLang when importable) on
a tiny model, log-prob parity with the trainer, and generated tokens/s. Prints CHECK lines."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from megarl.config import ModelConfig
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.engines.train_state import build_frozen_state
from megarl.hybrid import regroup
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout, build_groups
from megarl.rollout import SamplingParams
from megarl.rollout.native import NativeRollout
from megarl.runtime import init_distributed, set_seed

HF = "configs/models/tiny-llama.json"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # TF32/bf16 kernels, not the CPU's 1e-5


def trainer_log_probs(engine, prompts, responses, temperature):
    seqs = [prompts[r.prompt_index] + r.token_ids for r in responses]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width + 1, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    batch = {"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda(),
             "position_ids": torch.arange(width).expand(len(seqs), -1).contiguous().cuda()}
    logp = engine.forward_log_probs(batch, torch.tensor([len(s) for s in seqs]), MicroBatching(max_tokens=4096),
                                    temperature)["log_probs"].float().cpu()
    diff = 0.0
    for i, r in enumerate(responses):
        start = len(prompts[r.prompt_index]) - 1
        diff = max(diff, (logp[i, start:start + r.length] - torch.tensor(r.log_probs)).abs().max().item())
    return diff


def check(name, rollout, engine, prompts, dtype) -> bool:
    sampling = SamplingParams(temperature=0.8, top_p=0.95, n=2, max_new_tokens=32, seed=0)
    rollout.update_weights(1)
    rollout.resume_kv_cache()  # SGLang: its KV cache comes back after the sync (no-op for native)
    responses = rollout.generate(prompts, sampling)
    diff = trainer_log_probs(engine, prompts, responses, 0.8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    responses = rollout.generate(prompts * 8, SamplingParams(temperature=1.0, max_new_tokens=64, seed=1))
    torch.cuda.synchronize()
    tokens_per_s = sum(r.length for r in responses) / (time.perf_counter() - start)
    ok = diff <= TOLERANCE[dtype]
    if dist.get_rank() == 0:
        print("CHECK " + json.dumps({"engine": name, "dtype": str(dtype), "max_abs_logp_diff": diff,
                                     "tolerance": TOLERANCE[dtype], "tokens_per_s": round(tokens_per_s, 1),
                                     "ok": ok}), flush=True)
    return ok


def main() -> int:
    init_distributed()
    world = dist.get_world_size()
    args = megatron_args_from_hf(HF)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 30, (16,), generator=gen)]
    ok = True
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model_cfg = ModelConfig(hf_config=HF, params_dtype=dtype_name, transformer_impl="local")
        groups = build_groups(Layout(tp=world))
        set_seed(0, groups)
        state = build_frozen_state(model_cfg, groups)
        engine = MegatronEngine(state, args.vocab_size)
        rg = regroup(groups.layout, 1)
        ok &= check("native", NativeRollout.colocated(model_cfg, args, rg, state.model), engine, prompts, dtype)
        try:
            import sglang  # noqa: F401
        except ImportError:
            if dist.get_rank() == 0:
                print("CHECK " + json.dumps({"engine": "sglang", "skipped": "not importable"}), flush=True)
        else:
            ok &= check_sglang(model_cfg, args, rg, state, engine, prompts, dtype)
        groups.destroy()
    return 0 if ok else 1


def check_sglang(model_cfg, args, rg, state, engine, prompts, dtype) -> bool:
    from megarl.config.schema import RolloutLayoutConfig
    from megarl.rollout.sglang_engine import colocated_rollout

    rollout = colocated_rollout(model_cfg, RolloutLayoutConfig(tp=rg.gen.tp, engine="sglang"), args, rg, state.model)
    try:
        return check("sglang", rollout, engine, prompts, dtype)
    finally:
        rollout.shutdown()  # the next dtype's engine takes the same ports


if __name__ == "__main__":
    sys.exit(main())
