"""Worker for test_copy_weights.py (2 ranks): a critic (value head) and a frozen reference take
the actor's weights in the actor's layout; with a work directory also: an actor built from an HF
directory (``model.path``) in several layouts holds the HF tensors bit-exactly. Prints RESULT
lines on rank 0."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.convert import mcore_to_hf
from megarl.checkpoint.dist_ckpt import save_model
from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines.train_state import build_frozen_state, build_train_state, copy_weights
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed


def params(state):
    return {name: p for chunk in state.model for name, p in getattr(chunk, "module", chunk).named_parameters()}


def check(layout):
    groups = build_groups(layout)
    set_seed(5, groups)
    model = ModelConfig(hf_config="configs/models/tiny-digits.json")
    actor = build_train_state(model, OptimizerConfig(lr=1e-2), groups, 4)
    critic = build_train_state(model, OptimizerConfig(lr=1e-2), groups, 4, value_head=True)
    reference = build_frozen_state(model, groups)
    head = {n: p.detach().clone() for n, p in params(critic).items() if n.startswith("output_layer")}
    copied = copy_weights(actor, critic)
    ref_copied = copy_weights(actor, reference)
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


def tensors(directory: Path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def check_pretrained(work: Path, name: str, layout: Layout):
    """Build the actor from WORK/hf/NAME in ``layout`` (before DDP and the optimizer), take a
    zero-gradient optimizer step (stale fp32 main copies would overwrite the loaded weights),
    write it out and convert back to HF: every tensor must equal the source's bit for bit."""
    groups = build_groups(layout)
    set_seed(5, groups)
    source = work / "hf" / name
    actor = build_train_state(ModelConfig(path=str(source)), OptimizerConfig(lr=1e-2), groups, 4,
                              init_checkpoint=str(source))
    for chunk in actor.model:
        chunk.zero_grad_buffer()
    actor.optimizer.step()
    tag = f"{name}-{layout.tp}{layout.pp}{layout.vpp or 0}{layout.ep}"
    save_model([c.module for c in actor.model], work / "mc" / tag)
    mcore_to_hf(work / "mc" / tag, work / "rt" / tag, hf_config_dir=source)
    result = {"layout": f"{name} {layout}"}
    if dist.get_rank() == 0:
        want, got = tensors(source), tensors(work / "rt" / tag)
        result.update(same_names=sorted(want) == sorted(got), count=len(want),
                      differing=sorted(k for k in want.keys() & got.keys() if not torch.equal(want[k], got[k]))[:5])
    groups.destroy()
    return result


if __name__ == "__main__":
    init_distributed()
    results = [check(layout) for layout in (Layout(tp=2), Layout(pp=2), Layout(dp=2))]
    if len(sys.argv) > 1:
        work = Path(sys.argv[1])
        results += [check_pretrained(work, "llama", Layout(tp=2)),
                    check_pretrained(work, "llama", Layout(pp=2, vpp=2)),
                    check_pretrained(work, "qwen3_moe", Layout(dp=2, ep=2, etp=1))]
    if dist.get_rank() == 0:
        for result in results:
            print("RESULT " + json.dumps(result), flush=True)
