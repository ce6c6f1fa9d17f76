"""Worker for test_gpu_shaped.py (torchrun, 2 ranks, MEGARL_GPU_SHAPED=1): the demo's RLWorker
(actor tp=2, native rollout t_g=1) driven verb by verb without Ray, first as written, then with
each device fault of issue 24 put back by a monkeypatch: the harness must refuse each one.
Prints ``RESULT {"case": ..., "error": ...}`` lines on rank 0 (error None: the verb ran)."""

import dataclasses
import gc
import json
import os
import sys

import torch

from megarl.config import load_config
from megarl.controller import rl_worker
from megarl.protocol import Batch
from megarl.rollout import SamplingParams
from megarl.testing import gpu_shaped

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [4, 4, 2, 1, 6]]


def attempt(case: str, fn) -> None:
    try:
        fn()
        error = None
    except gpu_shaped.DeviceMismatch as e:
        error = str(e)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({"case": case, "error": error}), flush=True)


def batch_of(responses, width: int = 12) -> Batch:
    rows = [r for r in responses]
    tokens = torch.zeros(len(rows), width + 1, dtype=torch.long)
    lengths = []
    for i, r in enumerate(rows):
        seq = (list(PROMPTS[r.prompt_index]) + list(r.token_ids))[: width + 1]
        tokens[i, :len(seq)] = torch.tensor(seq)
        lengths.append(len(seq) - 1)
    zeros, none = torch.zeros(len(rows), width), torch.zeros(len(rows))
    return Batch(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                 position_ids=torch.arange(width).expand(len(rows), -1).contiguous(), loss_mask=zeros,
                 rollout_log_probs=zeros, lengths=torch.tensor(lengths), response_lengths=none, scores=none,
                 raw_scores=none, index=none, policy_versions=none, prompt_ids=[[]] * len(rows),
                 response_ids=[[]] * len(rows))


def main(work: str) -> None:
    cfg = load_config(["configs/grpo_demo.yaml"], [f"trainer.run_dir={work}", "logging.backends=[console]"])
    worker = rl_worker.RLWorker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg)
    worker.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    sampled = SamplingParams(temperature=1.0, n=2, max_new_tokens=4, seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    out = {}

    def sync_and_generate():
        worker.call("rollout", "update_weights", 1)
        out["sampled"] = worker.call("rollout", "generate", PROMPTS, sampled)
        out["greedy"] = worker.call("rollout", "generate", PROMPTS, greedy)

    attempt("fixed/generate", sync_and_generate)

    def log_probs():
        result = worker.call("actor", "compute_log_prob", batch_of(out["sampled"]))
        out["log_probs"] = result["old_log_probs"]
        assert all(not gpu_shaped.is_cuda(t) for t in result.tensors.values()), "a result left on the device"

    attempt("fixed/log_prob", log_probs)

    # Finding 1: the batch's one device move, removed
    moved = rl_worker.to_device
    rl_worker.to_device = lambda tree, device=None: tree
    attempt("fault/batch_not_moved", log_probs)
    rl_worker.to_device = moved

    # Finding 3 (once CPU generators for the sampling device): the rows' stream keys on the CPU
    from megarl.rollout import native

    for_device = native.row_keys
    native.row_keys = lambda keys, device=None: for_device(keys)
    attempt("fault/cpu_sampler_keys", lambda: worker.call("rollout", "generate", PROMPTS, sampled))
    native.row_keys = for_device

    # Finding 2: a CPU tensor in an NCCL collective (the resharder's change flags)
    from megarl.hybrid import executor

    device_of = executor.group_device
    executor.group_device = lambda group=None: torch.device("cpu")
    attempt("fault/cpu_collective", lambda: worker.call("rollout", "update_weights", 2))
    executor.group_device = device_of

    # Finding 5: a module of ours built on the CPU after the model moved to the device (the
    # critic's value head), fed device activations
    from megarl.models import value_head

    placed = value_head.param_device
    value_head.param_device = lambda config: torch.device("cpu")

    def critic_forward():
        from megarl.models import build_model

        model = build_model(cfg.model, worker.groups, training=False)
        value_head.attach_value_head(model)
        b = batch_of(out["greedy"])
        values = model[0](b.tokens.cuda(), b.position_ids.cuda(), None)
        assert gpu_shaped.is_cuda(values)

    attempt("fault/value_head_on_cpu", critic_forward)
    value_head.param_device = placed
    attempt("fixed/value_head", critic_forward)
    from tests.distributed import vllm_gpu_worker

    for gen_tp in (2, 1):  # one vLLM engine over both ranks' GPUs; one per rank
        record = vllm_gpu_worker.colocated_case(worker, cfg, gen_tp)
        if torch.distributed.get_rank() == 0:
            print("RESULT " + json.dumps(record), flush=True)
    lora_case(worker, cfg, batch_of(out["sampled"]))
    delta_case(worker, cfg)
    memory_case(work)


def memory_case(work: str) -> None:
    """A colocated PPO step (actor, critic, reference) with its rollout on vLLM (the recording
    stand-in, its pool on the harness's device memory model), driven verb by verb through a
    second RLWorker: the engine's start (what this process held then), each verb's peak and its
    live bytes at start and end. Then the same sync with Resharder.release undone: the generation
    shard's buffers outlive the sync (what the test must catch)."""
    from megarl.hybrid.executor import Resharder
    from megarl.testing import device_memory
    from tests.distributed import vllm_gpu_worker

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    record = {"case": "memory", "error": None}
    m = device_memory.model()
    seen, started = len(m.history), len(m.starts)

    def phases():
        return [[p.name, p.live_start, p.peak, p.device_peak, p.live_end] for p in m.history[seen:]]

    def run():
        vllm_gpu_worker.install()
        cfg = load_config(["configs/grpo_demo.yaml"], [f"trainer.run_dir={work}/ppo", "logging.backends=[console]",
                                                        "algorithm.name=ppo", "algorithm.kl_coef=0.01",
                                                        "parallel.rollout.engine=vllm", "trainer.offload.params=true",
                                                        "trainer.offload.grads=true", "trainer.offload.optimizer=true"])
        with vllm_gpu_worker.one_gpu_per_rank(rank):
            gc.collect()  # the earlier cases' garbage (reference cycles) dies now, not during this case
            record["before"] = m.refresh()  # the session's first worker's model, held throughout
            w = rl_worker.RLWorker(rank, world, cfg)
            w.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            record["set_up"] = m.refresh()  # the trained states back, the engine asleep
            actor = w.roles["actor"]
            record["param_bytes"] = next(actor.engine.state.model[0].parameters()).element_size()
            record["layout"] = dataclasses.asdict(w.groups.layout)
            record["starts"] = [dict(s) for s in m.starts[started:]]
            record["budget"] = m.total
            w.call("rollout", "update_weights", 1)
            responses = w.call("rollout", "generate", PROMPTS, SamplingParams(temperature=1.0, n=2, max_new_tokens=4,
                                                                              seed=1))
            w.call("rollout", "release_memory")
            batch = batch_of(responses)
            batch.loss_mask = torch.zeros_like(batch.loss_mask)
            batch.loss_mask[:, 2:6] = 1.0  # the responses' positions
            batch.old_log_probs = w.call("actor", "compute_log_prob", batch)["old_log_probs"]
            batch.ref_log_probs = w.call("reference", "compute_log_prob", batch)["ref_log_probs"]
            batch.values = batch.old_values = w.call("critic", "compute_values", batch)["values"]
            batch.advantages = torch.linspace(-1, 1, batch.tokens.shape[0])[:, None].expand_as(batch.loss_mask).contiguous()
            batch.returns = batch.values + batch.advantages
            record["moments"] = {}
            for role in ("actor", "critic"):
                w.call(role, "update", batch)  # Adam's moments exist from the first step on
                record["moments"][f"{role}.update"] = moments(w.roles[role].engine.state.optimizer)
            w.call("rollout", "resume_memory")
            record["phases"] = phases()
            kept = Resharder.release
            Resharder.release = lambda self: None  # the buffers kept after the hand-over, as before the fix
            try:
                w.call("rollout", "update_weights", 2)
            finally:
                Resharder.release = kept
            record["unreleased"] = phases()[-1]
            w.call("rollout", "release_memory")
            w.roles["rollout"].engine.shutdown()

    attempt("fixed/memory", run)
    if rank == 0:
        print("RESULT " + json.dumps(record), flush=True)


def moments(optimizer) -> int:
    """Bytes of Adam's first and second moments on the device, read from the optimizer's state."""
    held = 0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in sub.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                assert gpu_shaped.is_cuda(state[key]), key
                held += state[key].untyped_storage().nbytes()
    return held


def lora_case(worker, cfg, batch: Batch) -> None:
    """LoRA on the CUDA-shaped devices (actor tp=2): the adapters beside their base weights, the
    actor's log-probs and PPO update through them, the reference pass with them off, and the
    merged weights of a micro-DP sync (tp=2 -> t_g=1), all on the device."""
    import dataclasses

    from megarl.config.schema import LoRAConfig
    from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.hybrid import regroup
    from megarl.hybrid.executor import Resharder
    from megarl.hybrid.shards import ModelSpec
    from megarl.models import lora, megatron_args_from_hf
    from megarl.roles.actor import Actor, ActorLossConfig
    from megarl.runtime.devices import to_device

    record = {"case": "lora", "error": None}

    def run():
        model_cfg = dataclasses.replace(cfg.model, lora=LoRAConfig(rank=4, alpha=8))
        args = megatron_args_from_hf(model_cfg.hf_config)
        state = build_train_state(model_cfg, dataclasses.replace(cfg.optimizer, lr_warmup_steps=0), worker.groups, 2)
        adapters = lora.adapters(state.model)
        record["adapters_on_device"] = all(gpu_shaped.is_cuda(p) for a in adapters for p in a.parameters())
        engine, how = MegatronEngine(state, args.vocab_size), MicroBatching(micro_batch_size=2)
        tensors = to_device({"tokens": batch.tokens, "labels": batch.labels, "position_ids": batch.position_ids,
                             "loss_mask": torch.ones_like(batch.loss_mask),
                             "advantages": torch.linspace(-1, 1, len(batch.lengths)).unsqueeze(1).expand_as(batch.loss_mask).contiguous()})
        tensors["old_log_probs"] = engine.forward_log_probs(tensors, batch.lengths, how)["log_probs"]
        metrics = Actor(engine, ActorLossConfig()).update(tensors, batch.lengths, how)
        record["grad_norm"] = metrics["grad_norm"]
        with lora.adapters_off(state.model):
            base = engine.forward_log_probs(tensors, batch.lengths, how)["log_probs"]
        after = engine.forward_log_probs(tensors, batch.lengths, how)["log_probs"]
        record["adapters_moved_log_probs"] = (after - base).abs().max().item()
        resharder = Resharder.create(ModelSpec.from_args(args), regroup(worker.groups.layout, 1, 1, 1, 0), state.model)
        synced = resharder.sync()
        record["synced_on_device"] = all(gpu_shaped.is_cuda(t) for t in synced.values())
        record["moved"] = resharder.last.tensors_moved
        resharder.sync()
        record["moved_again"] = resharder.last.tensors_moved
        # lora_sync=adapter's gather: whole PEFT-named adapters on every rank, on the host
        whole = lora.gather_peft(state.model, args, contribute=True)
        record["peft_tensors"] = len(whole)
        record["peft_on_host"] = all(not gpu_shaped.is_cuda(t) for t in whole.values())

    attempt("fixed/lora", run)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(record), flush=True)


def delta_case(worker, cfg) -> None:
    """parallel.rollout.weight_sync=delta on the CUDA-shaped devices: the micro-DP resharder (tp=2 ->
    t_g=1) into bf16 generation tensors, full and delta side by side over three small steps of
    the weights: headers, payloads and positions stay on the device (the host paths refuse CUDA
    tensors), and the two agree bit for bit."""
    from megarl.engines.train_state import build_train_state
    from megarl.hybrid import regroup
    from megarl.hybrid.executor import Resharder
    from megarl.hybrid.shards import ModelSpec
    from megarl.models import megatron_args_from_hf

    record = {"case": "delta", "error": None}

    def run():
        args = megatron_args_from_hf(cfg.model.hf_config)
        state = build_train_state(cfg.model, cfg.optimizer, worker.groups, 2)
        model, rg = ModelSpec.from_args(args), regroup(worker.groups.layout, 1, 1, 1, 0)
        full, delta = (Resharder.create(model, rg, state.model, 64 << 10, out_dtype=torch.bfloat16, delta=d)
                       for d in (False, True))
        record["equal"], record["fraction"] = [], []
        for step in range(4):
            with torch.no_grad():
                for p in (p for c in state.model for p in c.parameters()):
                    p.add_(1e-6 * torch.sign(torch.sin(p * 1e4 + step)))
            a, b = full.sync(), delta.sync()
            record["equal"].append(all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a))
            record["fraction"].append(delta.last.bytes_received / max(1, delta.last.dense_received))
        record["on_device"] = all(gpu_shaped.is_cuda(t) for t in b.values())

    attempt("fixed/delta", run)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
