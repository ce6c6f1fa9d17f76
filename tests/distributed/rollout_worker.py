"""Worker for test_rollout.py (under torchrun). Prints ``RESULT {json}`` lines on rank 0.

``reference WORK MODEL...``: one process builds each full model, saves it as a dist checkpoint
and greedy continuations of PROMPTS by full recomputation (no cache).
``run WORK CASE...``, a case being ``model@t,p,d,e>t_g,e_g[,p_g]``: the actor in the training layout
(the trainer's engine), the native rollout in the generation layout fed by the hybrid engine;
greedy with and without a stop token, seeded sampling twice, and the trainer's log-probs of
every response against the rollout's own (and, for MoE, the trainer's routing against the
rollout's recorded one). At e_g > 1 also greedy with stop tokens that end the first replica's rows
at once while the others run on (the replicas' lock-step). A case ending in ``+bf16`` also builds
a second rollout with bf16 weights (``dtype="bfloat16"``) from the same fp32 training shards and
measures its log-prob mismatch against the fp32 trainer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import megarl  # noqa: F401 - before megatron: its lighter import on CPU (megarl/megatron_import.py)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention

from megarl.checkpoint.dist_ckpt import save_model
from megarl.config import ModelConfig
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.engines.train_state import build_frozen_state
from megarl.hybrid import regroup
from megarl.models import build_model
from megarl.models.hf_config import megatron_args_from_hf
from megarl.models.routing_replay import moe_layer_index
from megarl.parallel import Layout, build_groups
from megarl.rollout import SamplingParams
from megarl.rollout.native import NativeRollout
from megarl.runtime import init_distributed, set_seed

MODELS = {"llama": "configs/models/tiny-llama.json", "qwen3-moe": "configs/models/tiny-qwen3-moe.json",
          "deepseek": "configs/models/tiny-deepseek-v3.json", "gpt-oss": "configs/models/tiny-gpt-oss.json",
          "qwen3-next": "configs/models/tiny-qwen3-next.json"}
TIED = "smollm"  # tied embeddings at a real small model's widths (SmolLM-135M's, 4 layers), written per run


def model_config(work: Path, name: str) -> str:
    """The HF config file of ``name``: MODELS's, or for TIED one written into ``work``."""
    if name != TIED:
        return MODELS[name]
    from tests.fixtures.hf_models import smollm_config

    path = work / f"{TIED}.json"
    if not path.exists():  # written by the reference run, before any multi-rank session reads it
        path.write_text(json.dumps(smollm_config(4)))
    return str(path)


PROMPTS = [[5, 17, 42], [9, 9, 120, 33, 2, 45, 6], [3], [200, 31, 4, 15, 60, 7, 7, 8, 100, 1], [77, 78]]
MAX_NEW = 8


def emit(record) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(record), flush=True)


def reference(work: Path, name: str) -> None:
    groups = build_groups(Layout())
    set_seed(11, groups)
    chunks = build_model(ModelConfig(hf_config=model_config(work, name)), groups)
    save_model(chunks, work / f"{name}-ckpt")
    model, vocab = chunks[0].eval(), megatron_args_from_hf(model_config(work, name)).vocab_size
    torch.save({k: v.detach().clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())},
               work / f"{name}-full.pt")  # for the SGLang adapter's checks (sglang_worker.py)
    greedy = []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = list(prompt)
            for _ in range(MAX_NEW):  # full recomputation of the whole sequence every step
                ids = torch.tensor([seq])
                logits = model(ids, torch.arange(len(seq)).unsqueeze(0), None)[0, -1, :vocab]
                seq.append(int(logits.argmax()))
            greedy.append(seq[len(prompt):])
    (work / f"{name}-greedy.json").write_text(json.dumps(greedy))
    groups.destroy()


def trainer_log_probs(engine: MegatronEngine, responses, temperature: float, prompts=PROMPTS,
                      max_new: int = MAX_NEW) -> torch.Tensor:
    """The actor engine's log-probs of each response given its prompt: [rows, max response]."""
    seqs = [prompts[r.prompt_index] + r.token_ids for r in responses]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width + 1, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(width).expand(len(seqs), -1).contiguous()}
    lengths = torch.tensor([len(s) for s in seqs])
    if all(r.routing is not None for r in responses):  # the experts of every position fed, -1 elsewhere
        batch["routing"] = torch.full((len(seqs), width, *responses[0].routing.shape[1:]), -1, dtype=torch.int32)
        for i, r in enumerate(responses):
            batch["routing"][i, : len(seqs[i]) - 1] = r.routing
    logp = engine.forward_log_probs(batch, lengths, MicroBatching(max_tokens=48), temperature)["log_probs"]
    out = torch.zeros(len(responses), max_new)
    for i, r in enumerate(responses):
        start = len(prompts[r.prompt_index]) - 1  # position predicting the first response token
        out[i, : r.length] = logp[i, start:start + r.length]
    return out


def max_diff(engine, responses, temperature) -> float:
    ref = trainer_log_probs(engine, responses, temperature)
    got = torch.zeros_like(ref)
    for i, r in enumerate(responses):
        got[i, : r.length] = torch.tensor(r.log_probs)
    return (got - ref).abs().max().item()


def bf16_rollout(record, model_cfg, args, rg, state, engine, sampling) -> None:
    """The same samples from a bf16 generation model fed by the fp32 actor: its weights and logits
    are bf16, the training shards stay fp32, and the mismatch to the trainer grows."""
    rollout = NativeRollout.colocated(model_cfg, args, rg, state.model, bucket_bytes=1 << 16, max_batch_rows=3, dtype="bfloat16")
    rollout.update_weights(policy_version=1)
    record["bf16_weight_dtypes"] = sorted({str(t.dtype) for t in rollout.weights})
    record["bf16_train_dtypes"] = sorted({str(p.dtype) for c in state.model for p in c.parameters()})
    # the sync cast each fp32 shard to bf16: the generation weights are the rounded training ones
    train = dict(getattr(state.model[0], "module", state.model[0]).named_parameters())
    gen = dict(rollout.model.named_parameters())
    shared = [n for n in gen if n in train and gen[n].shape == train[n].shape]
    record["bf16_cast_exact"] = all(torch.equal(gen[n], train[n].to(torch.bfloat16)) for n in shared) and bool(shared)
    seen = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(str((out[0] if isinstance(out, tuple) else out).dtype)))
             for m in rollout.model.decoder.layers]
    responses = rollout.generate(PROMPTS, sampling)
    for hook in hooks:
        hook.remove()
    record["bf16_layer_output_dtypes"] = sorted(seen)
    record["bf16_samples"] = len(responses)
    record["bf16_sampled_logp_diff"] = max_diff(engine, responses, sampling.temperature)


SPLIT = 3  # a partial rollout's tokens before its weights change


def _perturbed(state):
    """The training weights moved by noise (the same on every rank holding a tensor of a shape),
    as a context: restored at exit."""
    import contextlib

    @contextlib.contextmanager
    def moved():
        params = [p for chunk in state.model for p in chunk.parameters()]
        saved = [p.detach().clone() for p in params]
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in params:
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, old in zip(params, saved):
                    p.copy_(old)

    return moved()


def _interrupted(rollout, state, sampling, prompts=PROMPTS):
    """Responses begun under policy version 1, interrupted after SPLIT tokens by a sync of moved
    weights (version 3), then finished under them; also the moved weights' context (open)."""
    rollout.update_weights(policy_version=1)  # the training weights as they were
    rollout.begin(prompts, sampling)
    done = rollout.advance(SPLIT)
    moved = _perturbed(state)
    moved.__enter__()
    rollout.update_weights(policy_version=3)
    in_flight = rollout.in_flight()
    done += rollout.advance()
    return sorted(done, key=lambda r: (r.prompt_index, r.sample_index)), in_flight, moved


def partial_rollout(record, rollout, engine, state, greedy_ref) -> None:
    """Partial rollouts (NativeRollout.begin/advance): SPLIT tokens under version 1, a weight sync
    to version 3, the rest under it. Each token carries its version, and its log-prob equals the
    trainer's under that version's weights; with the KV cache recomputed after the sync, greedy
    continuations equal a fresh generation from the same prefix under the new weights; with the
    cache kept, the tokens after the sync differ from a recomputation (the old keys stay)."""
    sampling = SamplingParams(temperature=0.8, top_k=50, n=2, max_new_tokens=MAX_NEW, seed=99)

    def by_version(responses, temperature, moved):
        new = trainer_log_probs(engine, responses, temperature)
        moved.__exit__(None, None, None)
        old = trainer_log_probs(engine, responses, temperature)
        worst = {1: 0.0, 3: 0.0}
        for i, r in enumerate(responses):
            for k, (v, logp) in enumerate(zip(r.token_versions, r.log_probs)):
                ref = (old if v == 1 else new)[i, k].item()
                worst[v] = max(worst[v], abs(logp - ref))
        return worst

    rollout.recompute_kv_after_sync = True
    responses, in_flight, moved = _interrupted(rollout, state, sampling)
    record["partial_in_flight"] = in_flight
    record["partial_versions"] = sorted({tuple(r.token_versions) for r in responses})
    record["partial_policy_versions"] = sorted({r.policy_version for r in responses})
    record["partial_logp_diff"] = by_version(responses, 0.8, moved)

    stop = sorted({g[1] for g in greedy_ref[:2]})  # some rows end before the sync, others after
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=stop)
    continued, _, moved = _interrupted(rollout, state, greedy)
    cut = [r for r in continued if r.length > SPLIT]
    prefixes = [PROMPTS[r.prompt_index] + r.token_ids[:SPLIT] for r in cut]
    fresh = rollout.generate(prefixes, SamplingParams(temperature=0, max_new_tokens=MAX_NEW - SPLIT, stop_token_ids=stop))
    record["partial_early_rows"] = sum(r.length <= SPLIT for r in continued)
    record["partial_fresh_equal"] = [r.token_ids[SPLIT:] == f.token_ids for r, f in zip(cut, fresh)]
    record["partial_fresh_logp_diff"] = max(abs(a - b) for r, f in zip(cut, fresh)
                                            for a, b in zip(r.log_probs[SPLIT:], f.log_probs))
    moved.__exit__(None, None, None)

    rollout.recompute_kv_after_sync = False
    kept, _, moved = _interrupted(rollout, state, sampling)
    record["kept_logp_diff"] = by_version(kept, 0.8, moved)
    rollout.update_weights(policy_version=1)  # the training weights are restored: so are the rollout's


def run(work: Path, case: str) -> None:
    case, _, flag = case.partition("+")
    name, rest = case.split("@")
    train, gen = rest.split(">")
    tp, pp, dp, ep = (int(x) for x in train.split(","))
    gen_tp, gen_ep, gen_pp = (int(x) for x in (gen + ",1").split(",")[:3])
    model_cfg = ModelConfig(hf_config=model_config(work, name))
    args = megatron_args_from_hf(model_config(work, name))
    groups = build_groups(Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 else None))
    set_seed(11, groups)
    state = build_frozen_state(model_cfg, groups, str(work / f"{name}-ckpt"))
    engine = MegatronEngine(state, args.vocab_size)
    rg = regroup(groups.layout, gen_tp, gen_pp, gen_ep, args.num_experts or 0)
    moe = bool(args.num_experts)
    if moe:  # the rollout records each token's experts; the trainer counts those it would route elsewhere
        engine.track_routing(replay=False)
    rollout = NativeRollout.colocated(model_cfg, args, rg, state.model, bucket_bytes=1 << 16, max_batch_rows=3,
                            record_routing=moe)
    rollout.update_weights(policy_version=1)
    record = {"case": case}
    # which layers take the decode's own paths (the rotated-key cache, plain matmuls at t_g = 1)
    modules = list(rollout.model.modules())
    attention = [m for m in modules if isinstance(m, SelfAttention)]
    linears = [m for m in modules if type(m) in (ColumnParallelLinear, RowParallelLinear)]
    record["rotated_kv_layers"] = [sum("_adjust_key_value_for_inference" in m.__dict__ for m in attention), len(attention)]
    record["plain_linears"] = [sum("forward" in m.__dict__ for m in linears), len(linears)]

    greedy_ref = json.loads((work / f"{name}-greedy.json").read_text())
    greedy = rollout.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    record["greedy_equal"] = [r.token_ids == g for r, g in zip(greedy, greedy_ref)]
    record["greedy_finish"] = [r.finish_reason for r in greedy]
    record["greedy_logp_diff"] = max_diff(engine, greedy, 1.0)
    record["policy_versions"] = sorted({r.policy_version for r in greedy})

    rollout.kv_cache = False  # the same decoding by full recomputation inside the rollout
    recomputed = rollout.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    rollout.kv_cache = True
    record["recompute_equal"] = [r.token_ids == g for r, g in zip(recomputed, greedy_ref)]
    record["recompute_logp_diff"] = max(abs(a - b) for r, q in zip(recomputed, greedy)
                                        for a, b in zip(r.log_probs, q.log_probs))

    stop = greedy_ref[0][2]
    stopped = rollout.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=[stop]))
    expected = [g[: g.index(stop) + 1] if stop in g else g for g in greedy_ref]
    record["stop_equal"] = [r.token_ids == e for r, e in zip(stopped, expected)]
    record["stop_finish"] = [(r.finish_reason, "stop" if stop in g else "length") for r, g in zip(stopped, greedy_ref)]

    if gen_ep > 1:  # the first replica's rows stop at their first token, the others' run on
        gen_dp = rg.gen.dp
        share = -(-len(PROMPTS) // gen_dp)
        stops = sorted({greedy_ref[i][0] for i in range(share)})
        early = rollout.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=stops))
        cut = [next((k + 1 for k, t in enumerate(g) if t in stops), len(g)) for g in greedy_ref]
        record["early_equal"] = [r.token_ids == g[:n] for r, g, n in zip(early, greedy_ref, cut)]
        record["early_lengths"] = [r.length for r in early]
        record["early_replica_rows"] = [len(PROMPTS[d * share:(d + 1) * share]) for d in range(gen_dp)]
        record["early_logp_diff"] = max_diff(engine, early, 1.0)

    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, n=3, max_new_tokens=MAX_NEW, seed=1234)
    first = rollout.generate(PROMPTS, sampling)
    again = rollout.generate(PROMPTS, sampling)
    record["samples"] = len(first)
    record["sample_order"] = [(r.prompt_index, r.sample_index) for r in first][:6]
    record["reproducible"] = [r.token_ids for r in first] == [r.token_ids for r in again]
    record["distinct_samples"] = len({tuple(r.token_ids) for r in first})
    record["sampled_logp_diff"] = max_diff(engine, first, 0.8)
    if moe:  # fp32 on both sides: the same experts everywhere
        record["routing_shapes_ok"] = all(r.routing.shape == (len(PROMPTS[r.prompt_index]) + r.length - 1,
                                                              len(moe_layer_index(rollout.model.config)),
                                                              args.config_kwargs["moe_router_topk"])
                                          for r in first)
        record["routing_mismatch"] = engine.routing_mismatch["routing_mismatch_frac"]
    record["sampled_tokens"] = [r.token_ids for r in first]
    if flag == "bf16":
        bf16_rollout(record, model_cfg, args, rg, state, engine, sampling)
    if flag == "sglang":
        from megarl.config.schema import RolloutLayoutConfig
        from tests.distributed import sglang_worker

        full = torch.load(work / f"{name}-full.pt")
        sglang_worker.split(record, args, groups.layout, state, full)
        sglang_worker.colocated(record, model_cfg, RolloutLayoutConfig(tp=gen_tp, ep=gen_ep, bucket_mb=1), args, rg,
                                state, full)
        if gen_pp == 1:
            sglang_worker.contract(record, model_cfg, RolloutLayoutConfig(tp=gen_tp, ep=gen_ep, bucket_mb=1), args,
                                   rg, state, full, PROMPTS[:2], lambda responses, t: max_diff(engine, responses, t))

    partial_rollout(record, rollout, engine, state, greedy_ref)

    rollout.release_memory()
    try:
        rollout.generate(PROMPTS, sampling)
        record["released_refuses"] = False
    except RuntimeError:
        record["released_refuses"] = True
    rollout.resume_memory()
    rollout.update_weights(policy_version=2)
    resumed = rollout.generate(PROMPTS, sampling)
    record["resumed_same"] = [r.token_ids for r in resumed] == [r.token_ids for r in first]
    emit(record)
    groups.destroy()


if __name__ == "__main__":
    init_distributed()
    mode, work = sys.argv[1], Path(sys.argv[2])
    for arg in sys.argv[3:]:
        reference(work, arg) if mode == "reference" else run(work, arg)
