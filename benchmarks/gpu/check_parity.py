"""The GPU check's log-prob parity: one model's random weights in fp32 and the same weights cast to
bf16, on the device. Three comparisons over the response tokens of sampled rows:

* ``rollout_vs_trainer`` in fp32 and in bf16: the native engine's KV-cached decode against the
  trainer's full forward (MegatronEngine.forward_log_probs) on the same sequences;
* ``bf16_vs_fp32``: the trainer's bf16 forward against its fp32 forward of the same weights,
  on the fp32 rollout's sequences (the rounding a bf16 run adds);
* ``sglang_vs_trainer`` in each dtype where SGLang is importable (not on the lent machine).

Then generated tokens/s of the bf16 native engine. Prints ``PARITY`` and ``GENERATE`` lines; exits 1
when a comparison exceeds its bound (TOLERANCES).

    python3 benchmarks/gpu/check_parity.py MODEL_JSON [--prompts N] [--new-tokens N]
"""

from __future__ import annotations

import argparse
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

# Bounds on |log p| differences over response tokens (log-probs of magnitude ~12 for a random
# 151936-token model). fp32: matmuls in true fp32 (torch's default, no TF32); a decode step and a
# full forward reduce in other orders. bf16: 8 mantissa bits, each layer's output rounded. Measured
# under the GPU-shaped harness (CPU kernels) at the 0.5B shape, 256 tokens: fp32 rollout against
# trainer 3.8e-6 max; bf16 rollout against trainer 0.049 max, 0.013 mean; bf16 against fp32 0.052
# max, 0.013 mean (about normal with sigma 0.017: the max of 1024 tokens is near 0.06). The bounds
# leave 3x for the GPU's kernels; a wrong or stale weight moves log-probs by 1 or more.
TOLERANCES = {
    "rollout_vs_trainer/float32": {"max_abs": 1e-4},
    "rollout_vs_trainer/bfloat16": {"max_abs": 0.15, "mean_abs": 0.03},
    "bf16_vs_fp32": {"max_abs": 0.15, "mean_abs": 0.03},
}
# SGLang's kernels (where it is importable) under the native engine's bounds
TOLERANCES |= {f"sglang_vs_trainer/{d}": TOLERANCES[f"rollout_vs_trainer/{d}"] for d in ("float32", "bfloat16")}


def trainer_log_probs(engine, prompts, responses, temperature) -> torch.Tensor:
    """The trainer's log-probs of every response token, flattened in the responses' order."""
    seqs = [prompts[r.prompt_index] + r.token_ids for r in responses]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width + 1, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    batch = {"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda(),
             "position_ids": torch.arange(width).expand(len(seqs), -1).contiguous().cuda()}
    logp = engine.forward_log_probs(batch, torch.tensor([len(s) for s in seqs]), MicroBatching(max_tokens=4096),
                                    temperature)["log_probs"].float().cpu()  # [rows, width]
    return torch.cat([logp[i, len(prompts[r.prompt_index]) - 1:][: r.length] for i, r in enumerate(responses)])


def compare(name: str, a: torch.Tensor, b: torch.Tensor, seconds: float) -> bool:
    diff = (a - b).abs()
    measured = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item()}
    bound = TOLERANCES[name]
    ok = all(measured[k] <= v for k, v in bound.items())
    if dist.get_rank() == 0:
        print("PARITY " + json.dumps({"case": name, **measured, "tolerance": bound, "tokens": a.numel(),
                                      "seconds": round(seconds, 2), "ok": ok}), flush=True)
    return ok


def rollout_vs_trainer(name: str, rollout, engine, prompts, sampling):
    """Sample with ``rollout`` (weights synced from ``engine``'s model); compare its log-probs
    with the trainer's. Returns (within bounds, responses, the trainer's log-probs)."""
    rollout.update_weights(1)
    rollout.resume_kv_cache()  # SGLang: its KV cache comes back after the sync (a no-op for native)
    start = time.perf_counter()
    responses = rollout.generate(prompts, sampling)
    trainer = trainer_log_probs(engine, prompts, responses, sampling.temperature)
    ok = compare(name, torch.tensor([p for r in responses for p in r.log_probs]), trainer,
                 time.perf_counter() - start)
    return ok, responses, trainer


def throughput(rollout, prompts, new_tokens: int) -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    responses = rollout.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=1))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        tokens = sum(r.length for r in responses)
        print("GENERATE " + json.dumps({"engine": "native", "dtype": "bfloat16", "rows": len(responses),
                                        "tokens": tokens, "seconds": round(seconds, 2),
                                        "tokens_per_s": round(tokens / seconds, 1)}), flush=True)


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_json")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    opts = parser.parse_args(argv)
    init_distributed()
    args = megatron_args_from_hf(opts.model_json)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 30, (opts.prompts,), generator=gen)]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, n=2, max_new_tokens=opts.new_tokens, seed=0)
    groups = build_groups(Layout(tp=dist.get_world_size()))
    rg = regroup(groups.layout, 1)
    cfgs = {d: ModelConfig(hf_config=opts.model_json, params_dtype=d) for d in ("float32", "bfloat16")}
    set_seed(0, groups)
    states = {"float32": build_frozen_state(cfgs["float32"], groups)}
    states["bfloat16"] = build_frozen_state(cfgs["bfloat16"], groups)
    with torch.no_grad():  # the same weights, rounded to bf16
        fp32, bf16 = (dict(states[d].model[0].named_parameters()) for d in ("float32", "bfloat16"))
        assert fp32.keys() == bf16.keys(), sorted(fp32.keys() ^ bf16.keys())
        for name, param in bf16.items():
            param.copy_(fp32[name])
    engines = {d: MegatronEngine(states[d], args.vocab_size) for d in states}
    try:
        import sglang  # noqa: F401  (not on the lent machine; a GPU machine with it checks it too)
    except ImportError:
        sglang = None
    ok, fp32_run = True, None
    for dtype in ("float32", "bfloat16"):
        rollout = NativeRollout.colocated(cfgs[dtype], args, rg, states[dtype].model)
        case_ok, responses, trainer = rollout_vs_trainer(f"rollout_vs_trainer/{dtype}", rollout, engines[dtype],
                                                         prompts, sampling)
        ok &= case_ok
        if dtype == "float32":
            fp32_run = (responses, trainer)
        else:
            start = time.perf_counter()
            bf16_of_fp32 = trainer_log_probs(engines["bfloat16"], prompts, fp32_run[0], sampling.temperature)
            ok &= compare("bf16_vs_fp32", bf16_of_fp32, fp32_run[1], time.perf_counter() - start)
            throughput(rollout, prompts * 4, opts.new_tokens)
        del rollout
        if sglang is not None:
            from megarl.config.schema import RolloutLayoutConfig
            from megarl.rollout.sglang_engine import colocated_rollout

            rollout = colocated_rollout(cfgs[dtype], RolloutLayoutConfig(tp=rg.gen.tp, engine="sglang"), args, rg,
                                        states[dtype].model)
            try:
                ok &= rollout_vs_trainer(f"sglang_vs_trainer/{dtype}", rollout, engines[dtype], prompts, sampling)[0]
            finally:
                rollout.shutdown()  # the next dtype's engine takes the same ports
    groups.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
