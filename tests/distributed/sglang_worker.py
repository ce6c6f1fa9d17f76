"""The SGLang adapter up to SGLang's API, run inside test_rollout.py's torchrun session (cases
flagged ``+sglang``), with this test's own recording stand-in for the ``sglang`` package.

Colocated: the Rollout role drives ``SGLangRollout`` through two loop steps; the stand-in engine
records each call and whether the trainer's parameters were off the device at that moment, and
deserializes every CUDA-IPC payload (here: pickled CPU tensors) per TP rank. Each rank sees one
GPU, as a Ray worker does (CUDA_VISIBLE_DEVICES=<its rank>); the stand-in picks its TP workers'
devices as SGLang's launcher does (``base_gpu_id + tp_rank * gpu_id_step`` among the
CUDA_VISIBLE_DEVICES its processes inherit) and refuses one that is not there. It answers each call
as SGLang 0.5.6.post2 does ((success, message), FlushCacheReqOutput, None), records the torchelastic
store variable its processes would inherit (the worker sets it as torchrun's agent does), and opens
each CUDA-IPC handle on the device the handle names, as torch's rebuild does: by the sender's device
ordinal, or by the GPU's uuid once SGLang's ``monkey_patch_torch_reductions`` has run in the sender's
process (the GPU it opens on is recorded beside the GPU the tensor lives on). Split: the trainer's
``SGLangBroadcaster`` sends a sync over a gloo weights group to the last rank, which receives it
as SGLang's workers do (async broadcasts of the planned tensors, posted up front).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import types
from dataclasses import dataclass
from typing import List
from unittest import mock

import torch
import torch.distributed as dist

from megarl.engines.offload import PhaseOffload
from megarl.hybrid import ModelSpec
from megarl.rollout import SamplingParams
from megarl.hybrid.hf_names import HFNames
from megarl.rollout.sglang_engine import colocated_rollout
from megarl.transports.nccl_broadcast import (SGLangBroadcaster, broadcast_from_root, hf_bucket_plan,
                                              weights_process_group)
from megarl.roles.rollout import Rollout

BUCKET_BYTES = 48 << 10  # small: several buckets


_REDUCTIONS = {"by_uuid": False}  # SGLang's monkey_patch_torch_reductions has run in this process
STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # what torchrun's agent exports to its workers


def _gpu_uuid(node_id: str) -> str:
    return f"GPU-{node_id}"


class _Serializer:
    """Stands in for SGLang's MultiprocessingSerializer (CUDA-IPC handles): a copy, pickled with
    the device field torch's ``reduce_tensor`` writes: the sending process's device ordinal (0:
    each worker sees one GPU, its node GPU <rank>), or that GPU's uuid once SGLang's reductions
    are patched in (sglang/srt/utils/patch_torch.py, 0.5.6.post2)."""

    @staticmethod
    def serialize(tensor):
        node_gpu = str(dist.get_rank())
        device = _gpu_uuid(node_gpu) if _REDUCTIONS["by_uuid"] else 0
        return pickle.dumps((device, node_gpu, tensor.clone()))

    @staticmethod
    def deserialize(data, visible: List[str]):
        """(tensor, GPU it is opened on, GPU it lives on) in a process that sees the node GPUs
        ``visible``: torch's rebuild opens an ordinal among them, SGLang's finds the uuid's."""
        device, node_gpu, tensor = pickle.loads(data)
        if isinstance(device, int):
            opened = visible[device]
        else:
            matches = [gpu for gpu in visible if _gpu_uuid(gpu) == device]
            if not matches:
                raise RuntimeError(f"Invalid device_uuid={device}")
            opened = matches[0]
        return tensor, opened, node_gpu


def _monkey_patch_torch_reductions():
    _REDUCTIONS["by_uuid"] = True


@dataclass
class _LocalSerializedTensor:
    values: List[bytes]


@dataclass
class _FlushCacheReqOutput:
    success: bool


def engine_devices(kwargs) -> List[str]:
    """The node's ids of the GPUs the engine's TP workers would use, as SGLang's launcher picks them
    (sglang/srt/entrypoints/engine.py, 0.5.6.post2); RuntimeError (CUDA's) for one its processes
    would not see."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    ids = [kwargs.get("base_gpu_id", 0) + tp_rank * kwargs.get("gpu_id_step", 1) for tp_rank in range(kwargs["tp_size"])]
    missing = [i for i in ids if i >= len(visible)]
    if missing:
        raise RuntimeError(f"CUDA error: invalid device ordinal: SGLang TP workers on devices {ids}, "
                           f"CUDA_VISIBLE_DEVICES={','.join(visible)!r}")
    return [visible[i] for i in ids]


def install_fake_sglang(log: list, offloaded) -> None:
    """A recording ``sglang`` package: Engine, model_runner.LocalSerializedTensor,
    utils.MultiprocessingSerializer, utils.patch_torch.monkey_patch_torch_reductions."""

    _REDUCTIONS["by_uuid"] = False

    class Engine:
        def __init__(self, **kwargs):
            self.kwargs, self.loaded, self.opened = kwargs, {}, []
            self.devices = engine_devices(kwargs)
            self.store_env = os.environ.get(STORE_ENV)  # what its scheduler processes inherit
            log.append(("start", kwargs["load_format"], kwargs["enable_memory_saver"], kwargs["tp_size"]))

        def release_memory_occupation(self, tags=None):
            log.append(("release", tuple(tags), offloaded()))

        def resume_memory_occupation(self, tags=None):
            log.append(("resume", tuple(tags), offloaded()))

        def update_weights_from_tensor(self, named_tensors, flush_cache=True):
            for name, payload in named_tensors:  # one payload per TP rank, rank order
                self.loaded[name] = []
                for tp_rank, value in enumerate(payload.values):  # TP worker tp_rank sees self.devices
                    tensor, opened, lives_on = _Serializer.deserialize(value, self.devices)
                    self.loaded[name].append(tensor)
                    self.opened.append([name, tp_rank, opened, lives_on])
            log.append(("update_weights_from_tensor", flush_cache))
            return True, "Success"

        def flush_cache(self):
            log.append(("flush_cache",))
            return _FlushCacheReqOutput(success=True)

        def generate(self, input_ids, sampling_params, return_logprob):
            log.append(("generate", len(input_ids), offloaded()))
            return [{"output_ids": [7, 8], "meta_info": {"output_token_logprobs": [(-0.5, 7, None), (-0.25, 8, None)],
                                                         "finish_reason": {"type": "length"}}} for _ in input_ids]

    sglang = types.ModuleType("sglang")
    sglang.Engine = Engine
    runner = types.ModuleType("sglang.srt.model_executor.model_runner")
    runner.LocalSerializedTensor = _LocalSerializedTensor
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = _Serializer
    patch_torch = types.ModuleType("sglang.srt.utils.patch_torch")
    patch_torch.monkey_patch_torch_reductions = _monkey_patch_torch_reductions
    sys.modules.update({"sglang": sglang, "sglang.srt": types.ModuleType("sglang.srt"),
                        "sglang.srt.model_executor": types.ModuleType("sglang.srt.model_executor"),
                        "sglang.srt.model_executor.model_runner": runner, "sglang.srt.utils": utils,
                        "sglang.srt.utils.patch_torch": patch_torch})


def hf_export(args, full) -> dict:
    """The HF tensors of the single-process model, through the converters' tables."""
    names = HFNames(args)
    return {n: t for spec in ModelSpec.from_args(args).tensors for n, t in names(spec.key, full[spec.key])}


def colocated(record, model_cfg, rollout_cfg, args, rg, state, full) -> None:
    log: list = []
    params = [p for chunk in state.model for p in chunk.parameters()]
    install_fake_sglang(log, offloaded=lambda: all(p.untyped_storage().nbytes() == 0 for p in params))
    rank = dist.get_rank()
    # one GPU per worker, as Ray gives it: its device 0 is the node's GPU <rank>; the agent-store
    # variable as torchrun's agent exports it to its workers
    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch("torch.cuda.current_device",
                                                                               return_value=0), \
            mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": str(rank), STORE_ENV: "True"}):
        engine = colocated_rollout(model_cfg, rollout_cfg, args, rg, state.model)
    tp_ranks = dist.get_process_group_ranks(engine.groups.pg.tp)
    if engine.engine is not None and engine.engine.devices != [str(r) for r in tp_ranks]:
        raise AssertionError(f"rank {rank}: the engine's TP workers are on GPUs {engine.engine.devices}, "
                             f"its generation TP ranks {tp_ranks} on GPUs {tp_ranks}")
    if engine.engine is not None and engine.engine.kwargs["mem_fraction_static"] != rollout_cfg.mem_fraction_static:
        raise AssertionError("mem_fraction_static is not parallel.rollout.mem_fraction_static")
    role = Rollout(engine, PhaseOffload([state], params=True, grads=False, optimizer=False))
    sampling = SamplingParams(n=2, max_new_tokens=2, seed=3)
    start = len(log)
    role.update_weights(0)  # the loop's first sync
    role.generate([[5, 6], [7]], sampling)
    role.release_memory()
    first_step = log[start:]
    start = len(log)
    role.resume_memory()
    role.update_weights(1)
    responses = role.generate([[5, 6], [7]], sampling)
    role.release_memory()
    record["sglang_start"] = log[0] if engine.engine is not None else None
    record["sglang_first_log"] = [list(e) for e in first_step]
    record["sglang_step_log"] = [list(e) for e in log[start:]]
    record["sglang_responses"] = [[r.prompt_index, r.sample_index, r.policy_version] for r in responses]
    expected = hf_export(args, full)
    if engine.engine is not None:
        loaded = engine.engine.loaded
        record["sglang_engine_store_env"] = engine.engine.store_env
        record["sglang_ipc_wrong_gpu"] = [e for e in engine.engine.opened if e[2] != e[3]][:4]
        record["sglang_ipc_handles"] = len(engine.engine.opened)
        record["sglang_names_equal"] = sorted(loaded) == sorted(expected)
        record["sglang_payloads_exact"] = all(
            len(values) == rg.gen.tp and all(torch.equal(v, expected[n]) for v in values) for n, values in loaded.items())
    record["sglang_reloaded"] = all(p.untyped_storage().nbytes() > 0 for p in params)


def split(record, args, layout, state, full) -> None:
    """The trainer's rank 0 sends to the last rank over a gloo weights group (world 2)."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    plan = hf_bucket_plan(args, torch.float32, BUCKET_BYTES)
    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    group = None
    if rank in (0, last):
        group = weights_process_group("127.0.0.1", port[0], 0 if rank == 0 else 1, 2, "megarl-test", backend="gloo")
    received, works = {}, []
    if rank == last:  # SGLang's worker: every planned tensor's receive posted before the sender runs
        for bucket in plan:
            for t in bucket.tensors:
                received[t.name] = torch.empty(t.shape, dtype=t.dtype)
                works.append(broadcast_from_root(group, received[t.name]))
    broadcaster = SGLangBroadcaster(args, layout, state.model, plan)
    stats = broadcaster.send(group if rank == 0 else None)
    for work in works:
        work.wait()
    sent = [None] * dist.get_world_size()
    dist.all_gather_object(sent, stats.bytes_sent)
    record["broadcast_sent"] = sent
    record["broadcast_buckets"] = len(plan)
    record["broadcast_max_bucket"] = max((b.nbytes for b in plan if len(b.keys) > 1), default=0)
    if rank == last:
        expected = hf_export(args, full)
        record["broadcast_names_equal"] = sorted(received) == sorted(expected)
        record["broadcast_exact"] = all(torch.equal(received[n], expected[n]) for n in expected)
    ok = [record.get("broadcast_exact")]
    dist.broadcast_object_list(ok, src=last)
    record["broadcast_exact"] = ok[0]
    names_ok = [record.get("broadcast_names_equal")]
    dist.broadcast_object_list(names_ok, src=last)
    record["broadcast_names_equal"] = names_ok[0]
    model_bytes = sum(t.numel() * 4 for t in hf_export(args, full).values())
    record["broadcast_model_bytes"] = model_bytes


def contract(record, model_cfg, rollout_cfg, args, rg, state, full, prompts, logp_diff) -> None:
    """The rollout-backend contract: every backend of ``ROLLOUT_BACKENDS`` that runs here (native;
    SGLang through the recording stand-in), built through the registry for colocated placement,
    driven by the Rollout role through two loop steps (sync, generate, release; resume, sync,
    generate, release). Every backend must: answer n samples per prompt in (prompt, sample)
    order with the policy version of the last sync; have the trainer's parameters off the device
    while it generates and back afterwards; hold exactly the trainer's weights after a sync (native:
    the trainer's log-probs of its responses, ``logp_diff``, equal its own; SGLang, whose stand-in
    generates no real tokens: each tensor it loaded equals the HF export of the single-process
    model)."""
    from megarl.config.schema import LayoutsConfig, MegarlConfig
    from megarl.rollout.backends import ROLLOUT_BACKENDS, rollout_backend

    log: list = []
    params = [p for chunk in state.model for p in chunk.parameters()]
    offloaded = lambda: all(p.untyped_storage().nbytes() == 0 for p in params)  # noqa: E731
    install_fake_sglang(log, offloaded)
    cfg = MegarlConfig(model=model_cfg, parallel=LayoutsConfig(rollout=rollout_cfg))
    sampling = SamplingParams(n=2, max_new_tokens=2, seed=3)
    out = {}
    # vLLM's contract runs in a session of its own (test_vllm_contract.py): its CPU attention takes
    # no head_dim under 32, and these cases' models have 16
    for name in [n for n in ROLLOUT_BACKENDS if n != "vllm"]:
        backend = rollout_backend(name)
        # SGLang's adapter needs CUDA: its stand-in gets one GPU per worker, as in colocated() above
        gpu = contextlib.ExitStack()
        if backend.needs_gpus:
            for patch in (mock.patch("torch.cuda.is_available", return_value=True),
                          mock.patch("torch.cuda.current_device", return_value=0),
                          mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": str(dist.get_rank())})):
                gpu.enter_context(patch)
        with gpu:
            engine = backend.colocated(cfg, args, rg, state.model)
        seen = []
        original = engine.generate

        def generate(prompts_, sampling_, _original=original):  # the trainer's state during generation
            seen.append(offloaded())
            return _original(prompts_, sampling_)

        engine.generate = generate
        role = Rollout(engine, PhaseOffload([state], params=True, grads=False, optimizer=False))
        role.update_weights(0)
        role.generate(prompts, sampling)
        role.release_memory()
        role.resume_memory()
        role.update_weights(1)
        responses = role.generate(prompts, sampling)
        role.release_memory()
        entry = {"order": [[r.prompt_index, r.sample_index] for r in responses],
                 "versions": sorted({r.policy_version for r in responses}),
                 "offloaded_while_generating": seen, "trainer_back": not offloaded()}
        if name == "native":
            entry["logp_diff"] = logp_diff(responses, sampling.temperature)
            entry["weights_exact"] = entry["logp_diff"] <= 1e-5
        elif engine.engine is not None:  # the SGLang stand-in's engine lives on TP rank 0 of each replica
            expected = hf_export(args, full)
            entry["weights_exact"] = sorted(engine.engine.loaded) == sorted(expected) and all(
                all(torch.equal(v, expected[n]) for v in values) for n, values in engine.engine.loaded.items())
        else:
            entry["weights_exact"] = None  # not this rank's to hold
        out[str(name)] = entry
    record["contract"] = out
