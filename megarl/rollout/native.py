"""Native rollout: the actor's own Megatron ``GPTModel`` in the generation layout, fed in process
by the 3D-HybridEngine, decoding with Megatron's static KV cache. Runs on CPU and GPU.

Prompts are left-padded into one batch; pad positions are masked out as keys (rotary embeddings
depend only on relative positions, so the shift changes nothing). Finished rows are dropped
from the batch and its KV cache at every step. Megatron's static KV cache keeps keys before
rotation and rotates the whole cache again in every layer at every step; the generation model's
standard (GQA) attention layers therefore keep rotated keys in a cache of their own
(:class:`_DecodeContext`), so a step rotates only its new token (MLA layers keep Megatron's).
At t_g = 1 the linear layers run as plain matmuls (:func:`_plain_linears`), and the decode runs
without CPU mode's function hook: at small batches a step is dominated by per-op Python costs.
Each generation data-parallel replica (d·d_g of them) decodes a contiguous share of the rows;
the responses are gathered so that every rank returns all of them.

Every planned generation layout runs:

- MoE at t_g > 1: the generation model runs without sequence parallelism (one-token steps), so
  every tensor-parallel rank routes all tokens; the dispatcher gathers them over the expert
  tensor-parallel group and its reduce-scatter sums the partial expert outputs back (eval only:
  Megatron refuses to *train* MoE so).
- e_g > 1: the members of an expert-parallel group are different replicas (different rows,
  lengths and step counts), yet every expert forward needs all of them. All replicas of a stage
  decode in lock-step (an expert group need not hold whole replicas: at t_g=2, e_g=3 the tensor
  ranks of one replica fall in two): as many micro-batches each, and at every step an all-reduce
  (MAX) of "rows still live" over the stage's ranks; a replica with nothing left (or no rows at
  all) feeds a one-token pad row, whose output is discarded, until every replica is done. Needs
  the alltoall dispatcher (it takes different token counts per rank; allgather does not).
- p_g > 1: each rank builds its pipeline stage; a forward sends the hidden states stage to stage
  (prefill, then one-token steps; each stage keeps the KV cache of its own layers), the last stage
  samples and broadcasts the tokens and their log-probs to its pipeline, so every stage drops the
  same finished rows. Simple, not interleaved: one micro-batch in flight per pipeline, so the
  stages take turns (correct, not fast). Recorded routing is gathered over the stages.

``dtype`` lets generation run in another precision than training (e.g. bf16 weights and
activations while the actor trains in fp32): the hybrid engine casts each fp32 training shard
into the bf16 generation tensors at every sync, and tokens are sampled from the bf16 logits cast
to fp32 (log-softmax in fp32, as SGLang does). This is the train-inference mismatch that
``algorithm.rollout_correction`` corrects.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType

from megarl.config.schema import TokenDispatcher, TransformerImpl
from megarl.hybrid import ModelSpec, Regrouping
from megarl.hybrid.names import check_planned, planned_tensors
from megarl.models import build_model, gated_delta_net
from megarl.models.hf_config import MegatronModelArgs
from megarl.models import routing_replay
from megarl.parallel import LayoutError
from megarl.rollout.sampling import row_key, row_keys, sample
from megarl.rollout.types import Response, RolloutEngine, RolloutStats, SamplingParams, dp_rows
from megarl.runtime import cpu_mode, progress
from megarl.transports import WeightReceiver
from megarl.transports.micro_dp import MicroDPReceiver


class NativeRollout(RolloutEngine):
    """Generation with the actor's architecture in layout ``regrouping.gen``."""

    def __init__(self, model_cfg, args: MegatronModelArgs, weights: WeightReceiver, max_batch_rows: int = 256,
                 kv_cache: bool = True, dtype: Optional[str] = None, record_routing: bool = False,
                 recompute_kv_after_sync: bool = False):
        """``weights`` (megarl.transports) places the generation layout ``weights.gen`` and fills its
        weights: colocated, a :class:`~megarl.transports.micro_dp.MicroDPReceiver` on the training
        ranks, in process (see :meth:`colocated`); split placement, a
        :class:`~megarl.transports.p2p.P2PReceiver` in this world's own layout (:meth:`connect`
        first). ``dtype``: the generation model's ``params_dtype`` (``float32``, ``bfloat16``);
        None = the training model's (``model_cfg.params_dtype``). ``record_routing``: an MoE
        model's responses carry the top-k experts of every token fed through it
        (``Response.routing``, for routing replay). ``recompute_kv_after_sync``: a partial rollout's
        rows (:meth:`advance`) recompute their KV cache under new weights after a sync, instead of
        keeping the one the old weights filled."""
        if dtype is not None:
            model_cfg = dataclasses.replace(model_cfg, params_dtype=dtype)
        gen = dataclasses.replace(weights.gen, sequence_parallel=False)  # decode steps are one token long
        if gen.ep > 1 and model_cfg.moe_token_dispatcher != TokenDispatcher.alltoall:
            raise ValueError(f"rollout.ep={gen.ep} needs model.moe_token_dispatcher=alltoall (got "
                             f"'{model_cfg.moe_token_dispatcher}'): the replicas of an expert group feed "
                             f"different numbers of tokens, which only the alltoall dispatcher takes")
        self.args, self.vocab = args, args.vocab_size
        self.max_batch_rows = max_batch_rows
        self.kv_cache = kv_cache  # False: recompute the whole sequence every step (a baseline)
        self.transport = weights
        try:
            self.groups = weights.place(gen)
            # The local spec always: the decode passes boolean padding masks (left-padded prompts),
            # which Transformer Engine's fused attention ignores under the causal mask types.
            local = dataclasses.replace(model_cfg, transformer_impl=TransformerImpl.local)
            self.model = build_model(local, self.groups, args, initialize=False, training=False)[0].eval()
        except LayoutError as err:
            raise ValueError(f"rollout layout {gen}: {err}") from None
        _cache_rotated_keys(self.model)
        if gen.tp == 1:
            _plain_linears(self.model)
        self.lockstep = gen.ep > 1  # the replicas decode step by step together (see the module docstring)
        self.stages = dist.get_process_group_ranks(self.groups.pg.pp) if gen.pp > 1 else None  # global ranks
        self.first_stage, self.last_stage = self.groups.is_first_stage, self.groups.is_last_stage
        tensors = {n: t.data for n, t in planned_tensors(self.model).items()}
        self.routers = []  # this stage's MoE layers, in MoE layer order
        self.record_routing = bool(record_routing and args.num_experts)
        if self.record_routing:
            self.routers = sorted(routing_replay.attach([self.model])[0], key=lambda h: h.moe_index)
            for handle in self.routers:
                handle.record = True
        self.resharder = weights.bind(ModelSpec.from_args(args, model_cfg.make_vocab_size_divisible_by), tensors)
        shard = weights.shard(self.resharder, dist.get_rank())
        check_planned([self.model], shard, f"rollout rank {dist.get_rank()}")
        self.weights = list(self.resharder.outputs.values())
        self.released = False
        self.parked = None  # the weights on the host while released (delta sync)
        self.stale = True  # no weights yet
        self.recompute_kv_after_sync = recompute_kv_after_sync
        self.session: Optional[_Session] = None  # the rows being decoded (begin/advance)
        self.calls = 0
        self.last = RolloutStats()

    # ---------------------------------------------------------------- weights and memory

    def update_weights(self, policy_version: int) -> None:
        if self.released:
            raise RuntimeError("rollout memory is released; call resume_memory() before update_weights()")
        self.resharder.sync()
        self.policy_version = policy_version
        self.stale = False

    @classmethod
    def colocated(cls, model_cfg, args: MegatronModelArgs, regrouping: Regrouping,
                  train_chunks: Optional[List[torch.nn.Module]] = None, bucket_bytes: int = 256 << 20,
                  delta: bool = False, **kwargs) -> "NativeRollout":
        """Colocated: ``regrouping`` places the generation layout on the training ranks, whose
        ``train_chunks`` feed it in process in buckets of ``bucket_bytes``; ``delta``: syncs after the
        first move what changed (parallel.rollout.weight_sync=delta), so the generation weights are parked on
        the host, not freed, while the trainer runs."""
        return cls(model_cfg, args, MicroDPReceiver(regrouping, train_chunks, bucket_bytes, delta), **kwargs)

    def connect_weights(self, address: str, port: int) -> None:
        """Split placement: join the process group spanning the trainer's ranks and this world's."""
        self.transport.connect(address, port, self.resharder)

    def sync_bytes(self):
        return self.transport.sync_bytes(self.resharder)

    def release_memory(self) -> None:
        """Free the generation weights' storage (the tensors stay, empty) until resume_memory(). A
        delta sync applies the change to the previous weights: they wait on the host (pinned with CUDA)."""
        if getattr(self.resharder, "delta", False):
            pin = torch.cuda.is_available()
            self.parked = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in self.weights]
        for tensor in self.weights:
            tensor.untyped_storage().resize_(0)
        self.released = True

    def resume_memory(self) -> None:
        parked, self.parked = self.parked, None
        for i, tensor in enumerate(self.weights):
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            if parked is not None:
                tensor.copy_(parked[i])
        self.resharder.versions.clear()  # everything moves at the next sync
        self.released, self.stale = False, True

    def flush_cache(self) -> None:
        """Nothing to drop: the KV cache lives for one generate() call (no prefix cache)."""

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        """Every response of ``prompts``, whole; a rollout in flight (a partial or streaming one,
        between two of its calls: validation) is set aside meanwhile and continues after."""
        saved, self.session = self.session, None
        try:
            self.begin(prompts, sampling)
            return self.advance()
        finally:
            self.session = saved

    def begin(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        """Start decoding ``prompts`` (``n`` samples each), to be driven by :meth:`advance`."""
        self.session = None
        self.admit(prompts, sampling, 0)

    def admit(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, first_index: int) -> None:
        """Add ``prompts`` (``n`` samples each) to the rollout in flight, or start one: their rows
        decode beside the others from the next :meth:`advance` on (a micro-batch of their own, each
        with its own KV cache), and their responses' ``prompt_index`` counts from ``first_index``
        (sample-level streaming, ``trainer.loop=async``, keeps its pool topped up with it)."""
        if self.released or self.stale:
            raise RuntimeError("the rollout has no current weights: call update_weights() "
                               "(after resume_memory() if memory was released)")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {first_index + i} is empty")
            if len(prompt) + sampling.max_new_tokens > self.args.max_position_embeddings:
                raise ValueError(f"prompt {first_index + i}: {len(prompt)} tokens + max_new_tokens="
                                 f"{sampling.max_new_tokens} exceed the model's {self.args.max_position_embeddings} "
                                 f"positions")
        seed = sampling.seed if sampling.seed is not None else self.calls
        self.calls += 1
        mine, share = dp_rows(len(prompts), sampling.n, self.groups.layout.dp, self.groups.pg.dp.rank())
        # in lock-step, every replica decodes as many micro-batches (some empty)
        span = max(share, 1) if self.lockstep else len(mine)
        batches = [self._start(prompts, mine[start:start + self.max_batch_rows], sampling, seed, first_index)
                   for start in range(0, span, self.max_batch_rows)]
        if self.session is None:
            self.session = _Session(len(prompts), batches, time.perf_counter())
        else:
            self.session.prompts += len(prompts)
            self.session.batches += batches

    def advance(self, max_tokens: Optional[int] = None) -> List[Response]:
        """Decode up to ``max_tokens`` more tokens of every unfinished row of the session (None:
        to the end); the responses that ended in this call, prompt-major, the same on every rank.
        Between two calls the weights may change (:meth:`update_weights`): the tokens sampled
        after it carry the new policy version (``Response.versions``), and the KV cache of the
        tokens before is kept, or recomputed under the new weights when
        ``recompute_kv_after_sync``."""
        session = self.session
        if session is None:
            raise RuntimeError("no rollout in flight: call begin() first")
        if self.released:
            raise RuntimeError("rollout memory is released; call resume_memory() and update_weights() first")
        out: List[Response] = []
        with cpu_mode.suspended():  # the decode names no CUDA device, and the hook taxes every op
            for b in session.batches:
                self._advance(b, max_tokens)
                out += self._finished(b)
        if not self.lockstep:  # a streaming session admits batch after batch: the finished ones leave
            # (in lock-step the replicas keep theirs: each advances as many batches as the others)
            session.batches = [b for b in session.batches if b.active]
        dp = self.groups.layout.dp
        if dp > 1:
            parts = [None] * dp
            dist.all_gather_object(parts, out, group=self.groups.pg.dp)
            out = [r for part in parts for r in part]
        out.sort(key=lambda r: (r.prompt_index, r.sample_index))
        session.tokens += sum(r.length for r in out)
        if self.in_flight() == 0:
            self.session = None
            self.last = RolloutStats(prompts=session.prompts, tokens=session.tokens,
                                     seconds=time.perf_counter() - session.began)
        return out

    def in_flight(self) -> int:
        """Rows of the session still decoding, over every replica (0: none, or no session)."""
        mine = sum(len(b.active) for b in self.session.batches) if self.session is not None else 0
        if self.groups.layout.dp > 1:
            count = torch.tensor([mine], device=self.weights[0].device)
            dist.all_reduce(count, group=self.groups.pg.dp)
            mine = int(count.item())
        return mine

    def _logits(self, tokens: torch.Tensor, blocked: Optional[torch.Tensor], context) -> Optional[torch.Tensor]:
        """Next-token logits [rows, vocab] (real vocabulary) after ``tokens`` [rows, s]; at p_g > 1
        this stage's part of the forward (from and to its neighbours), logits on the last stage
        only (None on the others)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        if self.stages is not None and not self.first_stage:
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], self.model.config.hidden_size,
                                 dtype=self.model.config.params_dtype, device=tokens.device)
            dist.recv(hidden, src=self.stages[self.groups.pp_rank - 1], group=self.groups.pg.pp)
            self.model.set_input_tensor(hidden)
        logits = self.model(tokens, positions, blocked, inference_context=context,
                            runtime_gather_output=True)  # [rows, 1 or s, padded vocab], gathered over tp
        if not self.last_stage:  # [s, rows, hidden]
            dist.send(logits.contiguous(), dst=self.stages[self.groups.pp_rank + 1], group=self.groups.pg.pp)
            return None
        return logits[:, -1, : self.vocab]

    def _sampled(self, logits, sampling: SamplingParams, keys: torch.Tensor, step: int):
        """The next tokens and their log-probs [rows] each, row i drawing from its stream
        ``keys[i]`` at counter ``step``; at p_g > 1 the last stage samples and broadcasts them to
        its pipeline (token ids are exact in float64, and so are fp32 log-probs)."""
        if self.stages is None:
            return sample(logits, sampling, keys, step)
        both = torch.empty(len(keys), 2, dtype=torch.float64, device=self.weights[0].device)
        if self.last_stage:
            chosen, chosen_logp = sample(logits, sampling, keys, step)
            both[:, 0], both[:, 1] = chosen, chosen_logp
        dist.broadcast(both, src=self.stages[-1], group=self.groups.pg.pp)
        return both[:, 0].long(), both[:, 1]

    def _pace(self, live: bool) -> bool:
        """Lock-step (e_g > 1): whether any replica of this stage still has live rows."""
        flag = torch.tensor([int(live)], device=self.weights[0].device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.pg.tp_dp_cp)
        return bool(flag.item())

    def _pad_step(self) -> None:
        """Lock-step: one forward of a one-token pad row (no cache; the output is discarded), so
        that the other replicas' expert collectives find this one."""
        self._logits(torch.zeros(1, 1, dtype=torch.long, device=self.weights[0].device), None, None)

    def _idle(self) -> None:
        """Lock-step: pad steps for as long as another replica still decodes."""
        while self._pace(False):
            self._pad_step()

    def _routing(self, rows: int) -> torch.Tensor:
        """The last forward's top-k experts, [rows, s, moe_layers, topk] (the router saw [s, rows])."""
        recorded = torch.stack([h.recorded for h in self.routers], dim=1).to("cpu", torch.int32)
        return recorded.view(-1, rows, *recorded.shape[1:]).transpose(0, 1)

    @torch.no_grad()
    def _start(self, prompts, rows, sampling: SamplingParams, seed: int, first_index: int = 0) -> "_Rows":
        """One micro-batch's decode state, before its prefill (which its first step runs); its rows
        are named (``first_index`` + prompt, sample)."""
        device = self.weights[0].device
        lengths = [len(prompts[p]) for p, _ in rows]
        width = max(lengths, default=1)
        total = width + sampling.max_new_tokens
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(rows), total, dtype=torch.bool, device=device)  # real tokens, as keys
        for i, ((p, _), n) in enumerate(zip(rows, lengths)):
            tokens[i, width - n:] = torch.tensor(prompts[p], device=device)
            valid[i, width - n:width] = True
        keys = row_keys((row_key(*sampling.stream_key(seed, p), s) for p, s in rows), device)  # [rows]
        b = _Rows([(first_index + p, s) for p, s in rows], [width - n for n in lengths], tokens, valid, keys,
                  sampling, total)
        b.routing = [[] for _ in rows] if self.routers else None  # at p_g > 1 a stage may hold no MoE layer
        return b

    def _forward(self, b: "_Rows") -> None:
        """The next-token logits of ``b``'s live rows: its prefill; the token sampled last, fed
        through the KV cache; or, when the weights changed since its cache was filled and
        ``recompute_kv_after_sync`` is set (or with no KV cache at all), every token again."""
        device = self.weights[0].device
        length = b.tokens.shape[1]
        fresh = not b.started or (self.recompute_kv_after_sync and b.version != self.policy_version)
        if not fresh and b.context is not None:  # only the new token; keys come from the cache
            b.logits = self._logits(b.tokens[:, -1:], ~b.valid[:, None, None, :length], b.context)
            b.context.sequence_len_offset += 1
        else:
            # Megatron masks are True where attention is blocked; a pad query may see itself so that
            # no softmax row is empty (its output is never used).
            eye = torch.eye(length, dtype=torch.bool, device=device)
            b.context = _DecodeContext(len(b.active), b.total) if self.kv_cache else None
            b.logits = self._logits(b.tokens, ~(b.valid[:, None, None, :length] | eye), b.context)
            if b.context is not None:
                b.context.sequence_len_offset += length
                b.context.enable_decode_mode()
        b.version, b.started, b.fed = self.policy_version, True, True
        if self.routers:  # per row, the routing of each position fed: prompt, then each generated token but the last
            fed = self._routing(len(b.active))
            if fresh:
                for j, i in enumerate(b.active):
                    b.routing[i] = [fed[j, b.offsets[i]:]]
            else:
                for j, i in enumerate(b.active):
                    b.routing[i].append(fed[j, -1:])

    def _step(self, b: "_Rows") -> bool:
        """Sample one token for each live row of ``b`` from its logits; finished rows leave the
        batch (and the KV cache); whether any row is left. The new tokens wait to be fed."""
        device = self.weights[0].device
        progress.tick()  # a decode step: what the driver's hang check sees advance
        sampling = b.sampling
        chosen, chosen_logp = self._sampled(b.logits, sampling, b.keys, b.step)
        b.logits, b.fed, stop, keep = None, False, set(sampling.stop_token_ids), []
        for j, (i, token, logp) in enumerate(zip(b.active, chosen.tolist(), chosen_logp.tolist())):
            b.produced[i].append(token)
            b.log_probs[i].append(logp)
            b.versions[i].append(b.version)
            if token in stop:
                b.finish[i] = "stop"
            elif b.step + 1 == sampling.max_new_tokens:
                b.finish[i] = "length"
            else:
                keep.append(j)
        b.step += 1
        if not keep:
            b.active = []
            return False
        position = b.tokens.shape[1]  # where the new token goes
        b.tokens = torch.cat([b.tokens, chosen.view(-1, 1).to(device)], dim=1)
        if len(keep) < len(b.active):  # drop finished rows from the batch and the KV cache
            index = torch.tensor(keep, device=device)
            if b.context is not None:
                b.context.keep_rows(index, position)
            b.valid, b.tokens, b.keys = (x.index_select(0, index) for x in (b.valid, b.tokens, b.keys))
            b.active = [b.active[j] for j in keep]
        b.valid[:, position] = True
        return True

    @torch.no_grad()
    def _advance(self, b: "_Rows", budget: Optional[int]) -> None:
        """Up to ``budget`` tokens (None: to the end) for each live row of ``b``. The last tokens
        sampled are fed by the next call, under the weights it finds (a partial rollout's pause
        point: every token after it is sampled from the new policy). In lock-step (e_g > 1) the
        replicas agree before each forward whether any of them still has live rows; one that has
        none feeds a pad row, and all stop together, at the budget at the latest."""
        steps = 0
        while budget is None or steps < budget:
            live = bool(b.active)
            if self.lockstep:
                if not self._pace(live):
                    return
                if not live:
                    self._pad_step()
                    steps += 1
                    continue
            elif not live:
                return
            if not b.fed:
                self._forward(b)
            self._step(b)
            steps += 1

    def _finished(self, b: "_Rows") -> List[Response]:
        """``b``'s rows that ended since the last call (each reported once)."""
        live = set(b.active)
        done = [i for i in range(len(b.rows)) if i not in live and i not in b.reported and b.finish[i]]
        b.reported.update(done)
        routes = [torch.cat(b.routing[i]) if b.routing is not None else None for i in done]
        if self.record_routing and self.stages is not None:  # each stage recorded its own MoE layers
            parts = [None] * len(self.stages)
            dist.all_gather_object(parts, routes if b.routing is not None else None, group=self.groups.pg.pp)
            routes = [torch.cat([part[k] for part in parts if part is not None], dim=1) for k in range(len(done))]
        out = []
        for k, i in enumerate(done):
            p, s = b.rows[i]
            versions = b.versions[i]  # kept only where a sync came mid-response
            out.append(Response(p, s, b.produced[i], b.log_probs[i], b.finish[i], min(versions), routes[k],
                                versions=versions if len(set(versions)) > 1 else None))
        return out


@dataclasses.dataclass(eq=False)
class _Rows:
    """One micro-batch of a replica's rows while it decodes: what it has produced, its live rows'
    tokens (left-padded prompts, then the tokens sampled so far), their KV cache and next-token
    logits, and the policy version of the weights that computed them."""

    rows: List  # (prompt, sample) of each row
    offsets: List[int]  # each row's left padding
    tokens: torch.Tensor  # [live rows, length]
    valid: torch.Tensor  # [live rows, total]: real tokens, as keys
    keys: torch.Tensor  # [live rows]: their sampling streams
    sampling: SamplingParams
    total: int  # the longest prompt + max_new_tokens: the KV cache's length
    context: Optional["_DecodeContext"] = None
    logits: Optional[torch.Tensor] = None  # [live rows, vocab] on the last pipeline stage
    started: bool = False  # the prefill ran
    fed: bool = False  # the last tokens sampled have been fed (the logits are theirs)
    version: int = -1  # the policy version that computed the KV cache and logits
    step: int = 0  # tokens sampled per live row: the sampling counter
    active: List[int] = None  # indices of the live rows
    produced: List[List[int]] = None
    log_probs: List[List[float]] = None
    versions: List[List[int]] = None  # each token's policy version
    finish: List[str] = None
    routing: Optional[List[list]] = None
    reported: set = None

    def __post_init__(self):
        n = len(self.rows)
        self.active = list(range(n))
        self.produced, self.log_probs, self.versions = ([[] for _ in range(n)] for _ in range(3))
        self.finish, self.reported = [""] * n, set()


@dataclasses.dataclass(eq=False)
class _Session:
    """The rows of one ``begin`` (:meth:`NativeRollout.begin`) being decoded on this rank."""

    prompts: int
    batches: List[_Rows]
    began: float
    tokens: int = 0


# ----------------------------------------------------------------------------- the KV cache


class _DecodeContext(StaticInferenceContext):
    """Megatron's static inference context plus a cache of rotated keys and values for the layers
    set up by :func:`_cache_rotated_keys`, [rows, groups, max length, head dim] each (a row's keys
    contiguous, as SDPA reads them). Layers left to Megatron (MLA) use its own
    ``key_value_memory_dict``, [max length, rows, groups, head dim]."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        super().__init__(max_batch_size, max_sequence_length)
        self.rotated = {}  # layer number -> (keys, values)
        # gated delta nets (megarl.models.gated_delta_net): layer number -> (convolution inputs, recurrent state)
        self.linear_states = {}

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int):
        """Store ``key``/``value`` [s, rows, groups, dim] at positions start.. and return every
        cached one so far as [start + s, rows, groups, dim] views."""
        if layer not in self.rotated:
            rows, groups = key.shape[1], key.shape[2]
            self.rotated[layer] = (key.new_empty(rows, groups, self.max_sequence_length, key.shape[3]),
                                   value.new_empty(rows, groups, self.max_sequence_length, value.shape[3]))
        keys, values = self.rotated[layer]
        end = start + key.shape[0]
        keys[:, :, start:end] = key.permute(1, 2, 0, 3)
        values[:, :, start:end] = value.permute(1, 2, 0, 3)
        return keys[:, :, :end].permute(2, 0, 1, 3), values[:, :, :end].permute(2, 0, 1, 3)

    def keep_rows(self, index: torch.Tensor, length: int) -> None:
        """Keep only the rows ``index`` (ascending), moved to the front in place; only the first
        ``length`` positions are filled, so only those move."""
        rows = len(index)
        for layer, (keys, values) in self.rotated.items():
            keys[:rows, :, :length] = keys[index, :, :length]
            values[:rows, :, :length] = values[index, :, :length]
            self.rotated[layer] = (keys[:rows], values[:rows])
        for layer, (keys, values) in self.key_value_memory_dict.items():
            keys[:length, :rows] = keys[:length, index]
            values[:length, :rows] = values[:length, index]
            self.key_value_memory_dict[layer] = (keys[:, :rows], values[:, :rows])
        gated_delta_net.keep_rows(self.linear_states, index)


def _rotated_key_values(attention, megatron_adjust, inference_context, query, key, value, rotary_pos_emb,
                        *args, **kwargs):
    """Stands in for ``Attention._adjust_key_value_for_inference`` of one layer: with a
    :class:`_DecodeContext`, rotate the new query and key at their own positions, cache the
    rotated key, and return no rotary embedding (so Megatron rotates nothing more). Elementwise
    the same rotation as Megatron's, so the results are bit-identical."""
    if not isinstance(inference_context, _DecodeContext):
        return megatron_adjust(inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
    start = inference_context.sequence_len_offset
    end = start + key.shape[0]  # key: [s, rows, groups, dim]
    if rotary_pos_emb is not None:
        q_freqs, k_freqs = rotary_pos_emb  # [max length, 1, 1, rotary dim] each
        rotate = functools.partial(apply_rotary_pos_emb, config=attention.config, cp_group=attention.pg_collection.cp,
                                   mscale=_yarn_get_concentration_factor_from_config(attention.config))
        if q_freqs is not None:
            query = rotate(query, q_freqs[start:end])
        if k_freqs is not None:
            key = rotate(key, k_freqs[start:end])
    keys, values = inference_context.append(attention.layer_number, key, value, start)
    # as Megatron: the prompt step is causal (plus the padding mask), later steps see every cached key
    mask_type = AttnMaskType.no_mask if start > 0 else attention.attn_mask_type
    return query, keys, values, None, mask_type, None


def _cache_rotated_keys(model: torch.nn.Module) -> None:
    """Route the KV cache of every standard self-attention layer of ``model`` through
    :func:`_rotated_key_values` (MLA and flash-decode layers keep Megatron's path)."""
    for module in model.modules():
        if isinstance(module, SelfAttention) and not module.config.flash_decode:
            module._adjust_key_value_for_inference = functools.partial(
                _rotated_key_values, module, module._adjust_key_value_for_inference)


# ----------------------------------------------------------------------------- linear layers at t_g = 1


def _column_forward(linear, input_, weight=None, runtime_gather_output=None):
    weight = linear.weight if weight is None else weight  # the output layer gets the tied embedding
    output = torch.matmul(input_, weight.t())
    if linear.bias is not None and not linear.skip_bias_add:
        output = output + linear.bias
    return output, (linear.bias if linear.skip_bias_add else None)


def _row_forward(linear, input_):
    output = torch.matmul(input_, linear.weight.t())
    if linear.skip_bias_add:
        return output, linear.bias
    return (output + linear.bias if linear.bias is not None else output), None


def _plain_linears(model: torch.nn.Module) -> None:
    """Run the local spec's ``ColumnParallelLinear``/``RowParallelLinear`` of a model without
    tensor parallelism as plain matmuls. Megatron's forward wraps each in up to three autograd
    functions (copy to and reduce from the TP region, the linear itself), identities at tp = 1
    that cost about 18% of a batch-1 decode step on CPU. Inference only (the generation model
    never trains); the same ops as Megatron's forward (``input @ weight.t()``, then the bias),
    so the results are bit-identical."""
    for module in model.modules():
        if type(module) is ColumnParallelLinear:  # exact types: subclasses may forward differently
            module.forward = functools.partial(_column_forward, module)
        elif type(module) is RowParallelLinear:
            module.forward = functools.partial(_row_forward, module)
