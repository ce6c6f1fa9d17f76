"""Worker for test_engine.py (under torchrun): engine log-probs at each layout vs log_softmax of
the single-process model's logits. ``reference`` writes the shared initial weights and the
reference log-probs; ``run`` checks layouts, and a ``nonfinite@...`` spec checks that updates with a
NaN on one rank are skipped on all. Prints RESULT lines on rank 0."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines.megatron_engine import MegatronEngine, NonFiniteUpdateError
from megarl.models import build_model, megatron_args_from_hf
from megarl.parallel import Layout, build_groups
from megarl.roles.reference import Reference
from megarl.runtime import init_distributed, set_seed
from tests.distributed.specs import HOW, parse
from megarl.checkpoint.dist_ckpt import save_model
from megarl.engines.train_state import build_frozen_state, build_train_state

MODELS = {"dense": "configs/models/tiny-llama.json", "moe": "configs/models/tiny-qwen3-moe.json"}


LENGTHS = torch.tensor([12, 5, 9, 12, 3, 7, 11, 6])  # right padding after these


def batch(vocab: int):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (8, 13), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(12).expand(8, -1).contiguous()}


def real(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    return torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)  # [rows, seq]


def reference(work: Path) -> None:
    for name, path in MODELS.items():
        groups = build_groups(Layout())
        set_seed(3, groups)
        model_cfg = ModelConfig(hf_config=path)
        chunks = build_model(model_cfg, groups)
        save_model(chunks, work / name / "init")
        vocab = megatron_args_from_hf(path).vocab_size
        b = batch(vocab)
        with torch.no_grad():
            logits = chunks[0].eval()(b["tokens"], b["position_ids"], None)[..., :vocab]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, b["labels"].unsqueeze(-1)).squeeze(-1)
        torch.save(logp, work / name / "ref_logp.pt")
        groups.destroy()


def _snapshot(state) -> list:
    """Copies of this rank's weights and its optimizer state (Adam moments, step counts)."""
    opts = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    moments = [v for o in opts for st in o.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return [t.detach().clone() for c in state.model for t in c.parameters()] + [t.clone() for t in moments]


def nonfinite(work: Path, spec: str, layout) -> None:
    """Updates with a NaN gradient (finite loss) or a NaN loss on global rank 1 only are skipped on
    every rank (weights and optimizer state bit-identical), counted, and the third bad step in a
    row raises NonFiniteUpdateError on every rank; a good step in between resets the count."""
    groups = build_groups(layout)
    set_seed(3, groups)
    path = MODELS["dense"]
    state = build_train_state(ModelConfig(hf_config=path), OptimizerConfig(lr=1e-2), groups, 10,
                              init_checkpoint=str(work / "dense" / "init"))
    engine = MegatronEngine(state, megatron_args_from_hf(path).vocab_size, max_bad_steps=3)
    per = 8 // layout.dp
    rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    mine = {k: v[rows] for k, v in batch(engine.vocab_size).items()}
    mine["loss_mask"] = real(LENGTHS[rows], 12).float()
    poisoned = dist.get_rank() == 1

    def update(poison: str):
        def loss_fn(logp, _entropy, t):
            if poisoned and poison == "grad":  # the loss stays finite, its gradient is NaN
                logp.register_hook(lambda g: g * float("nan"))
            loss = -(logp * t["loss_mask"]).sum() * (float("nan") if poisoned and poison == "loss" else 1.0)
            return loss, t["loss_mask"].sum(), {}
        return engine.update(mine, LENGTHS[rows], loss_fn, HOW["fixed"])

    checks = {}
    update("none")
    before, lr_steps = _snapshot(state), state.scheduler.num_steps
    skipped = update("grad")
    after = _snapshot(state)
    checks["grad_nan_skipped"] = skipped["skipped_steps"] == 1 and skipped["optimizer_steps"] == 0
    checks["state_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after)
    checks["schedule_unchanged"] = state.scheduler.num_steps == lr_steps
    good = update("none")
    checks["good_step_taken"] = good["skipped_steps"] == 0 and not all(
        torch.equal(a, b) for a, b in zip(after, _snapshot(state)))
    checks["loss_nan_skipped"] = all(update("loss")["skipped_steps"] == 1 for _ in range(2))
    try:
        update("loss")
        checks["third_in_a_row_raises"] = False
    except NonFiniteUpdateError as err:
        checks["third_in_a_row_raises"] = "trainer.max_bad_steps=3" in str(err)
    ok = torch.tensor([float(all(checks.values()))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"spec": spec, "nonfinite_ok": ok.item(), **checks}), flush=True)
    groups.destroy()


def run(work: Path, specs) -> None:
    for spec in specs:
        name, layout, mode = parse(spec)
        if name == "nonfinite":
            nonfinite(work, spec, layout)
            continue
        dp, vpp = layout.dp, layout.vpp
        groups = build_groups(layout)
        set_seed(3, groups)
        path = MODELS[name]
        init = str(work / name / "init")
        vocab = megatron_args_from_hf(path).vocab_size
        if name == "moe":  # the MoE runs go through the frozen reference role
            engine = MegatronEngine(build_frozen_state(ModelConfig(hf_config=path), groups, init), vocab)
            compute = Reference(engine).compute_log_prob
        else:
            state = build_train_state(ModelConfig(hf_config=path), OptimizerConfig(), groups, 1, init_checkpoint=init)
            engine = MegatronEngine(state, vocab)
            compute = lambda *a: engine.forward_log_probs(*a)["log_probs"]
        per = 8 // dp
        rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
        mine = {k: v[rows] for k, v in batch(vocab).items()}
        logp = compute(mine, LENGTHS[rows], HOW[mode])
        shards = [torch.empty_like(logp) for _ in range(dp)]
        dist.all_gather(shards, logp, group=groups.pg.dp)
        got = torch.cat(shards)
        ref = torch.load(work / name / "ref_logp.pt")
        mask = real(LENGTHS, ref.shape[1])
        diff = torch.tensor([((got.double() - ref).abs() * mask).max().item()
                             + got[~mask].abs().max().item()])  # zeros past each length
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"spec": spec, "max_abs_diff": diff.item()}), flush=True)
        groups.destroy()


if __name__ == "__main__":
    init_distributed()
    mode, work = sys.argv[1], Path(sys.argv[2])
    reference(work) if mode == "reference" else run(work, sys.argv[3:])
