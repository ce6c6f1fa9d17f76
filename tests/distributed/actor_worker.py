"""Worker for test_actor_update.py (under torchrun). ``run``: for each spec, one actor update
(PPO with clipping engaged + k3 KL loss + entropy bonus), critic update or implicit-PRM update
(PRIME's BCE) from shared initial weights on a shared batch; saves the reduced gradients and the new weights as dist checkpoints and the metrics. A mode
ending in ``+mb`` makes the update PPO's 4 mini-batches x 2 epochs (8 optimizer steps, shuffled),
with the rows split over DP ranks in order, as the driver splits a batch.
``replay`` is the MoE model with routing replay of a routing that differs from its own (see
:func:`recorded_routing`). ``compare``: one process reads them back whole and reports relative
differences to the single-process run. Prints RESULT lines on rank 0."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines.batching import balance_across_dp
from megarl.engines.megatron_engine import MegatronEngine, MiniBatches
from megarl.models import build_model, megatron_args_from_hf
from megarl.models.value_head import attach_value_head
from megarl.parallel import Layout, build_groups
from megarl.roles.actor import Actor, ActorLossConfig
from megarl.roles.critic import Critic, CriticLossConfig
from megarl.roles.prm import ImplicitPRM
from megarl.runtime import init_distributed, set_seed
from tests.distributed.specs import HOW, parse
from megarl.checkpoint.dist_ckpt import save_model
from megarl.engines.train_state import build_train_state
from tests.distributed.parity_worker import _full_tensors, _rel, grads_as_weights

MODELS = {"dense": "configs/models/tiny-llama.json", "moe": "configs/models/tiny-qwen3-moe.json",
          "critic": "configs/models/tiny-llama.json",  # critic: the dense backbone with a value head
          "replay": "configs/models/tiny-qwen3-moe.json",  # moe with routing replay of ROUTING
          "prm": "configs/models/tiny-llama.json"}  # PRIME's implicit PRM: the dense model, its BCE update
INIT = {"replay": "moe", "prm": "dense"}  # models that start from another's initial weights
PRM_BETA = 0.5  # z = beta * sum(logp - ref) of a few units: the BCE's gradient far from 0
LOSS = ActorLossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01)
ROWS, SEQ = 8, 14
MINI = "+mb"
MINI_BATCHES = MiniBatches(size=ROWS // 4, epochs=2, seed=5)


def rl_batch(vocab: int):
    """Prompt + response rows of varying length (right padding), old/ref log-probs near the
    model's so some ratios fall outside the clip range, per-sequence advantages."""
    gen = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=gen)
    lengths = torch.tensor([14, 6, 10, 14, 4, 9, 12, 7])
    prompt = torch.tensor([3, 2, 4, 5, 1, 3, 2, 2])
    pos = torch.arange(SEQ).unsqueeze(0)
    loss_mask = ((pos >= prompt.unsqueeze(1)) & (pos < lengths.unsqueeze(1))).float()
    advantages = torch.randn(ROWS, 1, generator=gen).expand(ROWS, SEQ) * loss_mask
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": pos.expand(ROWS, -1).contiguous(), "loss_mask": loss_mask,
             "advantages": advantages.contiguous(),
             "noise_old": torch.randn(ROWS, SEQ, generator=gen) * 0.3,
             "noise_ref": torch.randn(ROWS, SEQ, generator=gen) * 0.3,
             "returns": torch.randn(ROWS, SEQ, generator=gen) * loss_mask}
    return batch, lengths


ROUTING = "routing.pt"  # replay: the live routing of the batch with about half its (token, layer) sets changed


def recorded_routing(work: Path, engine: MegatronEngine, batch, lengths) -> None:
    """Single process: record the model's own routing of the whole batch (one micro-batch) and
    save it with about half of its (token, layer) top-k sets changed to other experts."""
    from megarl.engines.megatron_engine import MicroBatching

    engine.track_routing(replay=False)
    handles = sorted(sum(engine.routers.values(), []), key=lambda h: h.moe_index)
    for handle in handles:
        handle.record = True
    Actor(engine, LOSS).compute_log_prob(batch, lengths, MicroBatching(micro_batch_size=ROWS))
    live = torch.stack([h.recorded for h in handles], dim=1)  # [s * rows, layers, topk]
    live = live.view(SEQ, ROWS, *live.shape[1:]).transpose(0, 1).clone()  # [rows, s, layers, topk]
    gen = torch.Generator().manual_seed(3)
    experts = megatron_args_from_hf(MODELS["replay"]).num_experts
    other = torch.rand(experts, generator=gen).argsort()[: live.shape[-1]]
    change = torch.rand(live.shape[:3], generator=gen) < 0.5
    routing = torch.where(change[..., None], other, live)
    padding = torch.arange(SEQ)[None, :] >= lengths[:, None]
    live[padding], routing[padding] = -1, -1  # no token there
    # its own routing, compared in micro-batches of 2 rows (other widths, other padding): no mismatch
    Actor(engine, LOSS).compute_log_prob(batch | {"routing": live}, lengths, HOW["fixed"])
    assert engine.routing_mismatch == {"routing_mismatch_frac": 0.0, "routing_live_mismatch_frac": 0.0}, \
        engine.routing_mismatch
    torch.save(routing, work / ROUTING)
    engine.routers = {}


def tag(spec: str) -> str:
    return spec.replace("@", "-").replace(",", "").replace(":", "-")


def run(work: Path, specs, reference: bool) -> None:
    for spec in specs:
        name, layout, mode = parse(spec)
        mini = MINI_BATCHES if mode.endswith(MINI) else None
        mode = mode.removesuffix(MINI)
        dp = layout.dp
        groups = build_groups(layout)
        set_seed(9, groups)
        model_cfg = ModelConfig(hf_config=MODELS[name])
        init = work / INIT.get(name, name) / "init"
        critic = name == "critic"
        if reference and not init.exists():
            chunks = build_model(model_cfg, groups)
            if critic:
                attach_value_head(chunks)
            save_model(chunks, init)
        state = build_train_state(model_cfg, OptimizerConfig(lr=1e-4, clip_grad=1.0), groups, 1,
                                  use_distributed_optimizer=False, init_checkpoint=str(init),
                                     value_head=critic)
        vocab = megatron_args_from_hf(MODELS[name]).vocab_size
        engine = MegatronEngine(state, None if critic else vocab)
        batch, lengths = rl_batch(vocab)
        if name == "replay":
            if reference and not (work / ROUTING).exists():
                recorded_routing(work, engine, batch, lengths)
            batch["routing"] = torch.load(work / ROUTING)
            engine.track_routing(replay=True)
        if mini:  # mini-batches are cut from the global order: DP ranks hold it in order
            rows = torch.arange(ROWS).chunk(dp)[groups.dp_rank]
        else:
            rows = balance_across_dp(lengths, dp)[groups.dp_rank]  # each DP rank its share
        mine = {k: v[rows] for k, v in batch.items()}
        noise_old, noise_ref = mine.pop("noise_old"), mine.pop("noise_ref")
        if name == "prm":  # the policy's reference shared: its log-probs come with the batch
            logp = Actor(engine, LOSS).compute_log_prob(mine, lengths[rows], HOW[mode])
            mine["ref_log_probs"] = (logp + noise_ref) * mine["loss_mask"]
            mine["prm_labels"] = (torch.arange(ROWS)[rows] % 2).float()[:, None] * mine["loss_mask"]
            role = ImplicitPRM(engine, engine, PRM_BETA, 1.0, shares_policy_reference=True)
        elif critic:
            role = Critic(engine, CriticLossConfig(clip_range=0.05))
            values = role.compute_values(mine, lengths[rows], HOW[mode])
            mine["old_values"] = (values + noise_old * 0.3) * mine["loss_mask"]  # some clipped
        else:
            role = Actor(engine, LOSS)
            logp = role.compute_log_prob(mine, lengths[rows], HOW[mode])
            # old = current + noise: ratios around exp(0.3) engage the clip; the first-step
            # invariant (ratio 1) is the rollout issue's test.
            mine["old_log_probs"] = (logp + noise_old) * mine["loss_mask"]
            mine["ref_log_probs"] = (logp + noise_ref) * mine["loss_mask"]
        metrics = role.update(mine, lengths[rows], HOW[mode], mini)
        metrics.update(engine.routing_mismatch)  # of the log-prob pass, against the replayed routing
        out = work / name / tag(spec)
        with grads_as_weights(state.model):
            save_model(state.model, out / "grads")
        save_model(state.model, out / "weights")
        if dist.get_rank() == 0:
            (out / "metrics.json").write_text(json.dumps(metrics))
            print("RESULT " + json.dumps({"spec": spec, **metrics}), flush=True)
        groups.destroy()


def compare(work: Path) -> None:
    groups = build_groups(Layout())
    for name in [n for n in MODELS if (work / n).is_dir()]:
        model_cfg = ModelConfig(hf_config=MODELS[name])
        refs = {}
        for suffix in ("", ":dynamic" + MINI):  # one reference per kind of update
            ref_dir = work / name / tag(f"{name}@1,1,1,1{suffix}")
            if ref_dir.is_dir():
                refs[suffix.endswith(MINI)] = (
                    {k: _full_tensors(model_cfg, groups, ref_dir / k, value_head=name == "critic")
                     for k in ("grads", "weights")}, json.loads((ref_dir / "metrics.json").read_text()))
        for run_dir in sorted(p for p in (work / name).iterdir() if p.name != "init"):
            ref, ref_metrics = refs[run_dir.name.endswith(MINI)]
            got_metrics = json.loads((run_dir / "metrics.json").read_text())
            record = {"run": f"{name}/{run_dir.name}",
                      "loss": abs(got_metrics["loss"] - ref_metrics["loss"]) / abs(ref_metrics["loss"]),
                      "clip_frac": ref_metrics.get("clip_frac"), "metrics": got_metrics}
            for kind in ("grads", "weights"):
                got = _full_tensors(model_cfg, groups, run_dir / kind, value_head=name == "critic")
                record[kind] = max(_rel(got[k], ref[kind][k]) for k in ref[kind])
                if kind == "grads" and name == "replay":
                    record["router_grad_norm_min"] = min(float(v.norm()) for k, v in got.items() if "router" in k)
            print("RESULT " + json.dumps(record), flush=True)
    groups.destroy()


if __name__ == "__main__":
    init_distributed()
    mode, work = sys.argv[1], Path(sys.argv[2])
    if mode == "compare":
        compare(work)
    else:
        run(work, sys.argv[3:], reference=mode == "reference")
