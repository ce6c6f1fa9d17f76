"""Worker for test_train_ckpt.py (4 ranks): a training state saved in one layout resumes in
another. Layout A trains 2 steps, saves, trains 2 more (the uninterrupted run); layout B is built
from another seed, loads the checkpoint and trains the same 2 steps. Also a control whose
optimizer moments are zeroed after the load (it must drift off), and the dp_reshardable format's
refusal of a tp change. Prints RESULT lines on rank 0."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from megarl.checkpoint.train_state import load_train_state, save_train_state, weights_checksum
from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines import supervised
from megarl.engines.megatron_engine import MicroBatching
from megarl.engines.train_state import build_train_state
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed
from megarl.tasks.reverse_digits import reverse_digits_batch

STEPS = 4  # 2 before the checkpoint, 2 after
CASES = [  # (model, layout A, layout B, distributed optimizer)
    ("configs/models/tiny-llama.json", Layout(tp=2, pp=2, dp=1), Layout(tp=1, pp=1, dp=4), True),
    ("configs/models/tiny-llama.json", Layout(tp=1, pp=1, dp=4), Layout(tp=1, pp=2, dp=2, vpp=2), True),
    ("configs/models/tiny-llama.json", Layout(tp=2, pp=1, dp=2), Layout(tp=1, pp=2, dp=2), False),
    ("configs/models/tiny-qwen3-moe.json", Layout(tp=1, dp=4, ep=2, etp=1), Layout(tp=2, pp=2, dp=1, ep=1), True),
]


def build(model, layout, seed, distributed):
    groups = build_groups(layout)
    set_seed(seed, groups)
    optim = OptimizerConfig(lr=3e-3, lr_warmup_steps=2, lr_decay_style="linear", use_distributed_optimizer=distributed)
    return build_train_state(ModelConfig(hf_config=model), optim, groups, 8)


def train(state, steps):
    batch = lambda step: supervised.dp_shard(reverse_digits_batch(step, 8, 4, seed=3), state.groups)
    engine = supervised.engine(state)
    return [supervised.train_step(engine, batch(step), MicroBatching(2))["loss"] for step in steps]


def zero_moments(state):
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for values in opt.optimizer.state.values():
            values["exp_avg"].zero_()
            values["exp_avg_sq"].zero_()


def shared_dir():
    name = [tempfile.mkdtemp(prefix="megarl-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def remove(path):
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path.parent)


def relayout_case(model, layout_a, layout_b, distributed, fmt="reshardable"):
    path = shared_dir() / "state"
    state = build(model, layout_a, seed=11, distributed=distributed)
    before = train(state, range(0, 2))
    save_train_state(state, path, optimizer_format=fmt)
    checksums = [weights_checksum(state)]
    reference = train(state, range(2, STEPS))
    lr_a = state.optimizer.param_groups[0]["lr"]
    state.groups.destroy()

    runs = {}
    for variant in ("resumed", "moments_zeroed"):
        state = build(model, layout_b, seed=99, distributed=distributed)  # other weights until loaded
        exact = load_train_state(state, path)
        checksums.append(weights_checksum(state))
        if variant == "moments_zeroed":
            zero_moments(state)
        runs[variant] = train(state, range(2, STEPS))
        lr_b = state.optimizer.param_groups[0]["lr"]
        state.groups.destroy()
    remove(path)
    return {"model": Path(model).stem, "a": str(layout_a), "b": str(layout_b), "distributed": distributed,
            "before": before, "reference": reference, "exact_layout": exact, "lr": [lr_a, lr_b], "checksums": checksums, **runs}


def refusal_case():
    model = "configs/models/tiny-llama.json"
    path = shared_dir() / "state"
    state = build(model, Layout(tp=2, dp=2), seed=11, distributed=True)
    train(state, range(0, 2))
    save_train_state(state, path, optimizer_format="dp_reshardable")
    reference = train(state, range(2, STEPS))
    state.groups.destroy()
    state = build(model, Layout(tp=1, dp=4), seed=99, distributed=True)
    try:
        load_train_state(state, path)
        error = None
    except ValueError as err:
        error = str(err)
    state.groups.destroy()
    state = build(model, Layout(tp=2, dp=2), seed=99, distributed=True)  # the same layout resumes exactly
    exact = load_train_state(state, path)
    resumed = train(state, range(2, STEPS))
    state.groups.destroy()
    remove(path)
    return {"error": error, "exact_layout": exact, "reference": reference, "resumed": resumed}


def async_case():
    """Megatron's async save: training goes on (changing the weights in place) while a
    background process writes; the checkpoint holds the weights of the moment of the save."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    model, layout = "configs/models/tiny-llama.json", Layout(tp=2, dp=2)
    path = shared_dir() / "state"
    queue = AsyncCallsQueue()
    state = build(model, layout, seed=11, distributed=True)
    train(state, range(0, 2))
    save_train_state(state, path, async_queue=queue)
    pending_after_save = queue.get_num_unfinalized_calls()
    reference = train(state, range(2, STEPS))  # overlaps the write
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    hashes = recorded_hashes(path) if dist.get_rank() == 0 else None
    state.groups.destroy()
    state = build(model, layout, seed=99, distributed=True)
    exact = load_train_state(state, path)
    resumed = train(state, range(2, STEPS))
    state.groups.destroy()
    remove(path)
    return {"pending_after_save": pending_after_save, "finalized": finalized, "exact_layout": exact,
            "reference": reference, "resumed": resumed, "hashes": hashes}


def weights_digest(state):
    """SHA-256 of this rank's weights, gathered from every rank (a bit-exact comparison)."""
    import hashlib

    digest = hashlib.sha256()
    for chunk in state.model:
        for param in chunk.parameters():
            digest.update(param.detach().float().numpy().tobytes())
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest.hexdigest())
    return out


def adam_steps(state):
    """The step count each inner optimizer keeps: TE's in its param groups, torch's per parameter."""
    opts = [o.optimizer for o in getattr(state.optimizer, "chained_optimizers", [state.optimizer])]
    return sorted({float(g["step"]) for o in opts for g in o.param_groups if g["params"] and "step" in g}
                  | {float(s["step"]) for o in opts for s in o.state.values() if "step" in s})


def fused_adam_case(distributed):
    """Transformer Engine's FusedAdam (the testing stand-in, built by megatron-core as TE's): its
    step lives in the param groups and its state has no per-parameter step. Save after 2 steps,
    resume in the same layout: the next 2 steps equal the uninterrupted run's bit for bit."""
    from megarl.testing.fused_adam import FusedAdam, installed

    model, layout = "configs/models/tiny-llama.json", Layout(tp=2, dp=2)
    path = shared_dir() / "state"
    with installed():
        state = build(model, layout, seed=11, distributed=distributed)
        kind = type(getattr(state.optimizer, "chained_optimizers", [state.optimizer])[0].optimizer).__name__
        train(state, range(0, 2))
        saved_steps = adam_steps(state)
        save_train_state(state, path)
        reference = train(state, range(2, STEPS))
        reference_weights = weights_digest(state)
        state.groups.destroy()
        state = build(model, layout, seed=99, distributed=distributed)
        try:
            load_train_state(state, path)
            error = None
        except Exception as err:  # noqa: BLE001  (recorded for the test's message)
            error = f"{type(err).__name__}: {err}"
        restored_steps = adam_steps(state)
        resumed = train(state, range(2, STEPS)) if error is None else None
        resumed_weights = weights_digest(state) if error is None else None
        state.groups.destroy()
    remove(path)
    return {"case": "fused_adam", "distributed": distributed, "optimizer": kind, "expected": FusedAdam.__name__,
            "error": error, "saved_steps": saved_steps, "restored_steps": restored_steps, "reference": reference,
            "resumed": resumed, "weights_equal": resumed_weights == reference_weights}


def recorded_hashes(path):
    """What the ranks' background writers recorded (integrity.record_hashes): the ranks that
    left a sidecar, the files none covers, and the recorded digests that differ from the files."""
    import hashlib

    from megarl.checkpoint.integrity import HASHES_DIR

    recorded = {}
    sidecars = sorted((path / HASHES_DIR).glob("rank_*.json"))
    for sidecar in sidecars:
        recorded.update(json.loads(sidecar.read_text()))
    files = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and HASHES_DIR not in f.parts)
    wrong = [f for f, e in recorded.items() if hashlib.sha256((path / f).read_bytes()).hexdigest() != e["sha256"]]
    return {"ranks": [s.stem for s in sidecars], "uncovered": [f for f in files if f not in recorded], "wrong": wrong}


if __name__ == "__main__":
    init_distributed()
    for which in sys.argv[1:]:  # the modes share this session (test_train_ckpt runs them all in one)
        if which == "relayout":
            results = [relayout_case(*case) for case in CASES]
        elif which == "async":
            results = [async_case()]
        else:  # the same-layout resumes: the bucket format's and TE FusedAdam's
            results = [refusal_case(), fused_adam_case(distributed=True), fused_adam_case(distributed=False)]
        if dist.get_rank() == 0:
            for r in results:
                print("RESULT " + json.dumps({"mode": which} | r), flush=True)
