"""Worker for test_reward_model.py (under torchrun): a reward model (backbone + scalar head)
scores sequences of different lengths the same at every layout, and each score is the head's
value at the row's last token. ``reference`` writes the weights and single-process scores.
Both modes also score with the HF sequence classifiers in WORK/hf_rm/* (``reward_model.path``)
at tp = world size and compare with transformers' scores (WORK/hf_rm/*.pt, from the test)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.dist_ckpt import save_model
from megarl.config import ModelConfig
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.engines.train_state import build_frozen_state
from megarl.models.hf_config import read_hf_config
from megarl.parallel import Layout, build_groups
from megarl.roles.reward_model import RewardModel
from megarl.runtime import init_distributed, set_seed

MODEL = ModelConfig(hf_config="configs/models/tiny-llama.json")
LENGTHS = torch.tensor([12, 5, 9, 3])


def batch():
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))
    return {"tokens": tokens, "position_ids": torch.arange(12).expand(4, -1).contiguous()}


def scores(groups, init=None):
    state = build_frozen_state(MODEL, groups, init, value_head=True)
    rm = RewardModel(MegatronEngine(state, None))
    b = batch()
    per = 4 // groups.layout.dp
    rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    mine = {k: v[rows] for k, v in b.items()}
    got = rm.compute_scores(mine, LENGTHS[rows], MicroBatching(max_tokens=16))
    values = rm.engine.forward_log_probs(mine, LENGTHS[rows], MicroBatching(max_tokens=16))["values"]
    last = torch.stack([values[i, n - 1] for i, n in enumerate(LENGTHS[rows].tolist())])
    parts = [torch.empty_like(got) for _ in range(groups.layout.dp)]
    dist.all_gather(parts, got, group=groups.pg.dp)
    return state, torch.cat(parts), (got - last).abs().max().item()


def hf_scores(work: Path) -> None:
    """Each HF sequence classifier loaded at tp = world size scores the test's right-padded rows
    as transformers did."""
    world = dist.get_world_size()
    groups = build_groups(Layout(tp=world))
    for directory in sorted(p for p in (work / "hf_rm").iterdir() if p.is_dir()):
        ref = torch.load(directory.with_suffix(".pt"))
        state = build_frozen_state(ModelConfig(hf_config=str(directory)), groups, str(directory), value_head=True)
        rm = RewardModel(MegatronEngine(state, None), read_hf_config(directory).get("pad_token_id"))
        got = rm.compute_scores({k: ref[k] for k in ("tokens", "position_ids")}, ref["lengths"],
                                MicroBatching(max_tokens=16))
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"hf": directory.name, "tp": world,
                                          "max_abs_diff": (got - ref["scores"]).abs().max().item(),
                                          "scale": ref["scores"].abs().max().item()}), flush=True)
    groups.destroy()


if __name__ == "__main__":
    init_distributed()
    mode, work = sys.argv[1], Path(sys.argv[2])
    if mode == "reference":
        groups = build_groups(Layout())
        set_seed(4, groups)
        state, ref, _ = scores(groups)
        save_model(state.model, work / "rm")
        torch.save(ref, work / "ref.pt")
        groups.destroy()
    else:
        for spec in sys.argv[3:]:
            tp, pp, dp = (int(x) for x in spec.split(","))
            groups = build_groups(Layout(tp=tp, pp=pp, dp=dp))
            set_seed(4, groups)
            _, got, last_diff = scores(groups, str(work / "rm"))
            diff = (got - torch.load(work / "ref.pt")).abs().max().item()
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({"layout": spec, "max_abs_diff": diff, "last_token_diff": last_diff}),
                      flush=True)
            groups.destroy()
    if (work / "hf_rm").is_dir():
        hf_scores(work)
