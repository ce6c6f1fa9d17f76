"""Worker for test_offload.py: two identical training states, one offloaded to host memory
between steps, all kinds at once, each kind alone, and through the RL loop's PhaseOffload. Checks
the storages really are freed (only those of the kinds asked for), come back bit-identical, and
that training continues bit-identically. Prints RESULT lines on rank 0."""

import json

import torch
import torch.distributed as dist

from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines import supervised
from megarl.engines.megatron_engine import MicroBatching
from megarl.engines.offload import KINDS, PhaseOffload, _storages, _storages_by_kind, offload
from megarl.engines.train_state import build_train_state
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed
from megarl.tasks.reverse_digits import reverse_digits_batch


def snapshot(state):
    params = [p.detach().clone() for chunk in state.model for p in chunk.parameters()]
    opt_state = []
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for values in opt.optimizer.state.values():
            opt_state += [v.clone() for v in values.values() if torch.is_tensor(v)]
    return params + opt_state


def build(model, layout):
    groups = build_groups(layout)
    states = []
    for _ in range(2):
        set_seed(4, groups)  # same seed: the two states start identical
        states.append(build_train_state(ModelConfig(hf_config=model), OptimizerConfig(lr=1e-3), groups, 4))
    return groups, states


if __name__ == "__main__":
    init_distributed()
    for model, layout in (("configs/models/tiny-llama.json", Layout(tp=1, dp=2)),
                          ("configs/models/tiny-qwen3-moe.json", Layout(tp=1, dp=2, ep=2, etp=1)),
                          ("configs/models/tiny-llama.json", Layout(tp=2, dp=1))):
        groups, (plain, moved) = build(model, layout)
        batch = lambda step: supervised.dp_shard(reverse_digits_batch(step, 8, 4, seed=1), groups)
        losses, engines, how = [[], []], [supervised.engine(plain), supervised.engine(moved)], MicroBatching(2)
        for engine, out in zip(engines, losses):
            out.append(supervised.train_step(engine, batch(0), how)["loss"])
        before = snapshot(moved)
        handle = offload(moved)
        freed = all(s.nbytes() == 0 for s in _storages(moved).values()) and all(
            p.untyped_storage().nbytes() == 0 for chunk in moved.model for p in chunk.parameters())
        offloaded_mb = handle.nbytes / 2**20
        handle.reload()
        restored = all(torch.equal(a, b) for a, b in zip(before, snapshot(moved)))
        kinds_ok = {}  # each kind alone frees its storages (there are some) and no other kind's
        for kind in KINDS:
            by_kind = _storages_by_kind(moved)
            handle = offload(moved, (kind,))
            kinds_ok[kind] = bool(by_kind[kind]) and all(
                (s.nbytes() == 0) == (k == kind) for k in KINDS for s in by_kind[k])
            handle.reload()
        restored = restored and all(torch.equal(a, b) for a, b in zip(before, snapshot(moved)))
        phases = PhaseOffload([moved], params=True, grads=True, optimizer=True)
        first = phases.enter_generate()  # the sync before step 1: offload only
        phase_freed = all(s.nbytes() == 0 for s in phases.handles[0].storages)
        phases.enter_train()
        resident = all(p.untyped_storage().nbytes() > 0 for chunk in moved.model for p in chunk.parameters())
        phase_metrics = phases.enter_generate()
        phases.enter_train()
        restored = restored and all(torch.equal(a, b) for a, b in zip(before, snapshot(moved)))
        for step in (1, 2):
            for engine, out in zip(engines, losses):
                out.append(supervised.train_step(engine, batch(step), how)["loss"])
        same_params = all(torch.equal(a, b) for a, b in zip(snapshot(plain), snapshot(moved)))
        ok = torch.tensor([float(freed and restored and same_params and losses[0] == losses[1]
                                 and all(kinds_ok.values()) and phase_freed and resident)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"layout": str(layout), "freed": freed, "restored": restored,
                                          "same_after_training": same_params, "losses": losses,
                                          "offloaded_mb": offloaded_mb, "kinds_ok": kinds_ok,
                                          "phase_freed": phase_freed, "resident": resident,
                                          "first_metrics": first, "phase_metrics": phase_metrics,
                                          "all_ranks_ok": bool(ok.item())}), flush=True)
        groups.destroy()
