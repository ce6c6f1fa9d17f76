"""Worker for test_engine.py (under torchrun): engine log-probs at each layout vs log_softmax of
the single-process model's logits. ``reference`` writes the shared initial weights and the
reference log-probs; ``run`` checks layouts. Prints RESULT lines on rank 0."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines.megatron_engine import MegatronEngine
from megarl.models import build_model, megatron_args_from_hf
from megarl.parallel import Layout, build_groups
from megarl.roles.reference import Reference
from megarl.runtime import init_distributed, set_seed
from tests.distributed.specs import HOW, parse
from megarl.training import lm
from megarl.training.dist_ckpt import save_model

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


def run(work: Path, specs) -> None:
    for spec in specs:
        name, layout, mode = parse(spec)
        dp, vpp = layout.dp, layout.vpp
        groups = build_groups(layout)
        set_seed(3, groups)
        path = MODELS[name]
        init = str(work / name / "init")
        vocab = megatron_args_from_hf(path).vocab_size
        if name == "moe":  # the MoE runs go through the frozen reference role
            engine = MegatronEngine(lm.build_frozen_state(ModelConfig(hf_config=path), groups, init), vocab)
            compute = Reference(engine).compute_log_prob
        else:
            state = lm.build_train_state(ModelConfig(hf_config=path), OptimizerConfig(), groups, 1, init_checkpoint=init)
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
