"""vLLM's GPU path under the GPU-shaped harness (MEGARL_GPU_SHAPED=1), its engine a recording
stand-in for vLLM 0.32's ``LLM`` and weight-transfer API (the CPU build cannot be a CUDA engine).

Each rank sees one GPU, as a Ray worker does (``CUDA_VISIBLE_DEVICES=<its rank>``, its device 0
reporting that GPU's UUID). The stand-in places its workers as vLLM 0.32 does
(``ParallelConfig.__post_init__``, the multiprocessing executor): worker ``i`` on visible device
``i`` of the ``CUDA_VISIBLE_DEVICES`` the engine starts with, refused when there are fewer than
``tensor_parallel_size`` of them (vLLM's "World size ... is larger than the number of available
GPUs") or when the Ray executor is asked for (it would wait for GPUs megarl's actors hold). It takes
weights only through the weight-transfer API of its ``weight_transfer_config`` backend
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``): each worker opens only handles of its own GPU's UUID (vLLM's "IPC
handle not found for GPU UUID"), unpickled only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in
its environment, and records what it received. A CUDA-IPC handle here is a reference to the
CUDA-shaped tensor (a host tensor is refused: CUDA IPC shares device memory), so no shared-memory
file exists either; writing a safetensors file raises.

Colocated (:func:`colocated_case`, inside test_gpu_shaped.py's session: actor tp=2) at t_g=2 and
t_g=1; split (``__main__``: a trainer and a rollout process, each a world of one, over the spanning
group) at t_g=1.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import itertools
import json
import os
import pickle
import sys
import tempfile
import types
from typing import Dict, List
from unittest import mock

import torch
import torch.distributed as dist

from megarl.testing import device_memory, gpu_shaped

_IPC: Dict[int, torch.Tensor] = {}  # the stand-in's CUDA-IPC handles: what each one shares, until the update ends
_KEYS = itertools.count()


def stand_in_reduce_tensor(tensor: torch.Tensor):
    """``torch.multiprocessing.reductions.reduce_tensor`` of a CUDA tensor: (rebuild, its args)."""
    if not gpu_shaped.is_cuda(tensor):
        raise RuntimeError("CUDA IPC of a host tensor: torch would share it through a shared-memory file")
    key = next(_KEYS)
    _IPC[key] = tensor
    return None, ("harness-ipc", key)


def visible_devices() -> List[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(torch.cuda.device_count())]
    return [d.strip() for d in visible.split(",") if d.strip()]


def device_properties(index=None):
    """This process's CUDA device ``index`` (a node GPU among CUDA_VISIBLE_DEVICES) and its UUID."""
    index = index.index if isinstance(index, torch.device) else (index or 0)
    return types.SimpleNamespace(uuid=f"GPU-{visible_devices()[index]}", name="GPU-shaped")


def worker_devices(kwargs) -> List[str]:
    """The node GPUs vLLM 0.32 puts an engine's workers on (worker i: visible device i)."""
    tp = kwargs.get("tensor_parallel_size", 1)
    visible = visible_devices()
    if kwargs.get("distributed_executor_backend") == "ray":
        raise RuntimeError(f"vLLM's Ray executor asks Ray for {tp} GPUs, which megarl's actors hold: it waits")
    if tp > len(visible):
        raise ValueError(f"World size ({tp}) is larger than the number of available GPUs ({len(visible)}) in this "
                         f"node. If this is intentional and you are using:\n- ray, set '--distributed-executor-backend "
                         f"ray'.\n- multiprocessing, set '--nnodes' appropriately.")
    return visible[:tp]


class StandInLLM:
    """vLLM's ``LLM`` as megarl's vllm backend drives it on GPUs (see the module docstring)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
        self.devices = worker_devices(kwargs)
        self.uuids = [f"GPU-{d}" for d in self.devices]
        self.backend = (kwargs.get("weight_transfer_config") or {}).get("backend")
        self.calls, self.rpcs, self.syncs, self.active = [], [], [], False
        # its memory on the harness's device model: the pool it reserves at start (refused as vLLM
        # refuses below gpu_memory_utilization x total free), given back asleep and at shutdown
        self.pool = device_memory.start_engine("vllm", kwargs.get("gpu_memory_utilization", 0.9))
        stop = lambda: self.pool and device_memory.model().stop_engine(self.pool)  # noqa: E731
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=stop))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.rpcs.append(method)
        tp = len(self.devices)
        if method in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                      "finish_weight_update") and self.backend is None:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable "
                               "weight transfer.")
        if method == "init_weight_transfer_engine":
            assert self.backend == "ipc" and kwargs["init_info"] == {"packed": False}, (self.backend, kwargs)
        elif method == "start_weight_update":
            assert not self.active, "start_weight_update called while a weight update is already active"
            self.active = True
            self.syncs.append([[] for _ in range(tp)])
        elif method == "update_weights":
            assert self.active, "start_weight_update must be called before update_weights"
            infos = kwargs["update_info"]
            assert isinstance(infos, list) and len(infos) == tp, f"one update info per worker ({tp}), got {infos!r}"
            for worker, info in enumerate(infos):
                self._receive(worker, info)
        elif method == "finish_weight_update":
            assert self.active, "finish_weight_update called without a matching start_weight_update"
            self.active = False
            _IPC.clear()  # the update's shared tensors: the sender frees them once it is over
        else:
            raise AssertionError(f"the GPU path called worker method {method} {args}: weights go through vLLM's "
                                 f"weight-transfer API")
        return [None] * tp

    def _receive(self, worker: int, info) -> None:
        """vLLM's IPCWeightTransferEngine.receive_weights (unpacked) on worker ``worker``."""
        if self.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] != "1":
            raise ValueError("Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1")
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        assert len(handles) == len(info["names"]) == len(info["shapes"]) == len(info["dtype_names"])
        for name, dtype, shape, handle in zip(info["names"], info["dtype_names"], info["shapes"], handles):
            uuid = self.uuids[worker]
            if uuid not in handle:
                raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(handle)}")
            tensor = _IPC[handle[uuid][1]]
            assert list(tensor.shape) == list(shape) and str(tensor.dtype) == f"torch.{dtype}", (name, shape, dtype)
            self.syncs[-1][worker].append((name, list(shape), dtype, tensor.cpu().clone()))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(f"sleep{level}")
        if self.pool:
            device_memory.model().release_engine(self.pool)

    def wake_up(self, tags):
        self.calls.append("wake:" + ",".join(tags))
        if self.pool:
            device_memory.model().resume_engine(self.pool)

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        self.calls.append("generate")
        out = []
        for _ in requests:
            tokens = [3] * params[0].max_tokens
            steps = [{t: types.SimpleNamespace(logprob=-1.0)} for t in tokens]
            out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens, logprobs=steps,
                                                                            finish_reason="length")]))
        return out


def install() -> None:
    """The stand-in ``vllm`` package in this process."""
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = StandInLLM, lambda **kw: types.SimpleNamespace(**kw)
    fake.inputs = types.ModuleType("vllm.inputs")
    fake.inputs.TokensPrompt = dict
    sys.modules["vllm"], sys.modules["vllm.inputs"] = fake, fake.inputs


def carrier_files() -> List[str]:
    """Weight files in the places a hand-over could write them."""
    found = []
    for directory in {"/dev/shm", tempfile.gettempdir()}:
        found += glob.glob(os.path.join(directory, "megarl-vllm-*")) + glob.glob(os.path.join(directory, "*.safetensors"))
    return sorted(f for f in found if not os.path.isdir(f))


@contextlib.contextmanager
def one_gpu_per_rank(rank: int):
    """This rank as a Ray worker: one visible GPU (the node's GPU ``rank``), no weight file written."""

    def no_file(*args, **kwargs):
        raise AssertionError("a safetensors file was written on the GPU path")

    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": str(rank)}), \
            mock.patch("torch.cuda.get_device_properties", device_properties), \
            mock.patch("torch.multiprocessing.reductions.reduce_tensor", stand_in_reduce_tensor), \
            mock.patch("safetensors.torch.save_file", no_file), \
            mock.patch("torch.cuda.ipc_collect", lambda: None):
        yield


def hf_export(args, model_cfg, named_parameters) -> Dict[str, torch.Tensor]:
    from megarl.hybrid.hf_names import HFNames

    names = HFNames(args, model_cfg.make_vocab_size_divisible_by)
    out = {}
    for key, tensor in named_parameters:
        out.update((n, t.cpu()) for n, t in names(key, tensor.detach()))
    return out


def check_syncs(llm, engine, want: Dict[str, torch.Tensor]) -> dict:
    """What each worker of ``llm`` received at each sync, against the hand-over's plan and the
    trainer's weights (HF names)."""
    plan = engine.hand_over_plan()
    planned = [(name, list(shape), dtype) for name, shape, dtype in plan]
    planned_bytes = sum(torch.empty(0, dtype=getattr(torch, d)).element_size() * torch.Size(s).numel()
                        for _, s, d in planned)
    out = {"workers": len(llm.devices), "syncs": len(llm.syncs), "planned_bytes": planned_bytes,
           "received_bytes": [], "as_planned": [], "exact": []}
    for sync in llm.syncs:
        out["received_bytes"].append([sum(t.numel() * t.element_size() for *_, t in worker) for worker in sync])
        out["as_planned"].append([[(n, s, d) for n, s, d, _ in worker] == planned for worker in sync])
        out["exact"].append([sorted(n for n, *_ in worker) == sorted(want) and
                             all(torch.equal(t, want[n].to(t.dtype)) for n, _, _, t in worker) for worker in sync])
    return out


def colocated_case(worker, cfg, gen_tp: int) -> dict:
    """The vllm backend built for colocated placement on the training ranks (actor tp=2) at
    t_g=``gen_tp``, driven through two syncs (the second after sleeping) and a generation."""
    import dataclasses

    from megarl.hybrid import regroup
    from megarl.rollout.backends import rollout_backend
    from megarl.rollout.types import SamplingParams

    install()
    rank = dist.get_rank()
    vcfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, rollout=dataclasses.replace(
        cfg.parallel.rollout, engine="vllm", tp=gen_tp, bucket_mb=1)))
    native = worker.roles["rollout"].engine
    state = worker.roles["actor"].engine.state
    record = {"case": f"vllm_colocated_tg{gen_tp}", "error": None}
    before = carrier_files()
    try:
        with one_gpu_per_rank(rank):
            regrouping = regroup(worker.groups.layout, gen_tp, 1, 1, native.args.num_experts or 0)
            try:
                engine, started = rollout_backend("vllm").colocated(vcfg, native.args, regrouping, state.model), None
            except Exception as err:  # noqa: BLE001 - on the engine's rank only: the others must not go on alone
                engine, started = None, f"{type(err).__name__}: {err}"
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, started)
            if any(errors):
                raise RuntimeError(f"the engine did not start: {[e for e in errors if e][0]}")
            synced = []
            engine.update_weights(1)
            synced.append(engine.sync_stats())
            engine.release_memory()
            engine.resume_memory()
            engine.update_weights(2)
            synced.append(engine.sync_stats())
            engine.resume_kv_cache()
            responses = engine.generate([[3, 4, 5], [6, 7]], SamplingParams(temperature=1.0, n=2, max_new_tokens=3,
                                                                            seed=1))
        plan = engine.executor.plan  # the micro-DP plan: elements this rank receives per sync
        record["reshard_bytes"] = [s.bytes_received for s in synced]
        record["reshard_planned"] = plan.received(rank) * engine.dtype.itemsize
        record["engine_bytes"] = [s.engine_bytes for s in synced]
        record["responses"] = len(responses)
        llm = engine.llm
        if llm is not None:
            want = hf_export(native.args, cfg.model, native.model.named_parameters())
            record.update(check_syncs(llm, engine, want))
            record["devices"] = llm.devices
            record["tp_ranks"] = dist.get_process_group_ranks(engine.groups.pg.tp)
            record["env"] = llm.env
            record["keywords"] = {k: llm.kwargs.get(k) for k in ("distributed_executor_backend", "enable_sleep_mode",
                                                                  "gpu_memory_utilization", "tensor_parallel_size")}
            record["rpcs"] = llm.rpcs
            record["calls"] = llm.calls
        engine.shutdown()
    except Exception as err:  # noqa: BLE001 - the test shows what failed
        record["error"] = f"{type(err).__name__}: {err}"
    record["new_files"] = sorted(set(carrier_files()) - set(before))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    return {"case": record["case"], "error": next((r["error"] for r in gathered if r["error"]), None),
            "ranks": gathered}


# ----------------------------------------------------------------------------- split placement
SPLIT_MODEL = "configs/models/tiny-digits.json"


def split_plan():
    from megarl.hybrid import ModelSpec
    from megarl.hybrid.transfer import plan_transfer
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout

    args = megatron_args_from_hf(SPLIT_MODEL)
    model = ModelSpec.from_args(args)
    return args, model, plan_transfer(model, Layout(tp=1), Layout(tp=1), 1 << 14)


def split_trainer(port: int) -> None:
    """The trainer's world (one rank): its weights point to point to the rollout's rank, twice."""
    from megarl.transports.p2p import P2PSender
    from tests.distributed.delta_worker import chunk_of, full_model

    args, model, plan = split_plan()
    chunk = chunk_of(model, full_model(model), plan.sources[0]).cuda()
    sender = P2PSender(plan, [chunk])
    sender.connect("127.0.0.1", port)
    sender.send()
    with torch.no_grad():
        for p in chunk.parameters():
            p.add_(0.25)
    sender.send()


def split_rollout_side(port: int) -> dict:
    """The rollout's world (one rank, t_g=1): the vllm backend's split engine, fed point to point."""
    from megarl.config import ModelConfig
    from megarl.config.schema import LayoutsConfig, MegarlConfig, RolloutLayoutConfig
    from megarl.rollout.backends import rollout_backend
    from tests.distributed.delta_worker import full_model

    install()
    args, model, plan = split_plan()
    cfg = MegarlConfig(model=ModelConfig(hf_config=SPLIT_MODEL), parallel=LayoutsConfig(
        rollout=RolloutLayoutConfig(engine="vllm", tp=1, bucket_mb=1)))
    record = {"case": "vllm_split", "error": None}
    before = carrier_files()
    try:
        with one_gpu_per_rank(0):
            engine = rollout_backend("vllm").split(cfg, args, plan)
            engine.connect_weights("127.0.0.1", port)
            pairs = []
            for version in (1, 2):
                engine.update_weights(version)
                pairs.append(list(engine.sync_bytes()))
        full = full_model(model)
        llm = engine.llm
        first = check_syncs(types.SimpleNamespace(devices=llm.devices, syncs=llm.syncs[:1]), engine,
                            hf_export(args, cfg.model, full.items()))
        second = check_syncs(types.SimpleNamespace(devices=llm.devices, syncs=llm.syncs[1:]), engine,
                             hf_export(args, cfg.model, ((k, v + 0.25) for k, v in full.items())))
        record.update(first)
        record["exact"] = first["exact"] + second["exact"]
        record["as_planned"] = first["as_planned"] + second["as_planned"]
        record["received_bytes"] = first["received_bytes"] + second["received_bytes"]
        record["syncs"] = len(llm.syncs)
        record["sync_bytes"] = pairs
        record["transfer_planned"] = plan.received(0) * engine.dtype.itemsize
        record["rpcs"], record["devices"], record["env"] = llm.rpcs, llm.devices, llm.env
        engine.shutdown()
    except Exception as err:  # noqa: BLE001 - the test shows what failed
        record["error"] = f"{type(err).__name__}: {err}"
    record["new_files"] = sorted(set(carrier_files()) - set(before))
    return record


if __name__ == "__main__":
    from megarl.runtime import init_distributed

    init_distributed()
    if sys.argv[1] == "trainer":
        split_trainer(int(sys.argv[2]))
    else:
        print("RESULT " + json.dumps(split_rollout_side(int(sys.argv[2]))), flush=True)
