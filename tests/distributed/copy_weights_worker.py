"""Worker for test_copy_weights.py (2 ranks): a critic (value head) and a frozen reference take
the actor's weights in the actor's layout; prints RESULT lines on rank 0."""

import json

import torch
import torch.distributed as dist

from megarl.config import ModelConfig, OptimizerConfig
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed
from megarl.training import lm


def params(state):
    return {name: p for chunk in state.model for name, p in getattr(chunk, "module", chunk).named_parameters()}


def check(layout):
    groups = build_groups(layout)
    set_seed(5, groups)
    model = ModelConfig(hf_config="configs/models/tiny-digits.json")
    actor = lm.build_train_state(model, OptimizerConfig(lr=1e-2), groups, 4)
    critic = lm.build_train_state(model, OptimizerConfig(lr=1e-2), groups, 4, value_head=True)
    reference = lm.build_frozen_state(model, groups)
    head = {n: p.detach().clone() for n, p in params(critic).items() if n.startswith("output_layer")}
    copied = lm.copy_weights(actor, critic)
    ref_copied = lm.copy_weights(actor, reference)
    # An optimizer step with zero gradients leaves Adam's update at 0: the weights it writes back
    # from its fp32 main copies must still be the actor's (stale main copies would undo the copy).
    for chunk in critic.model:
        chunk.zero_grad_buffer()
    critic.optimizer.step()
    a, c, r = params(actor), params(critic), params(reference)
    backbone_equal = all(torch.equal(c[n], a[n]) for n in c if not n.startswith("output_layer"))
    head_kept = all(torch.equal(c[n], head[n]) for n in head)
    ok = torch.tensor([float(backbone_equal and head_kept and all(torch.equal(r[n], a[n]) for n in r))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    result = {"layout": str(layout), "copied": len(copied), "critic_params": len(c), "head": sorted(head),
              "reference_copied": len(ref_copied), "reference_params": len(r), "all_ranks_ok": bool(ok.item())}
    groups.destroy()
    return result


if __name__ == "__main__":
    init_distributed()
    for layout in (Layout(tp=2), Layout(pp=2), Layout(dp=2)):
        result = check(layout)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
