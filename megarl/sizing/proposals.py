"""``megarl plan``: the training and generation layouts of a model that fit a GPU's memory, ranked
by the cost model's predicted step time (memory: megarl/sizing/memory.py; time:
megarl/sizing/cost.py). Every proposal passes the checks a run makes before it starts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from megarl.algorithms.presets import preset
from megarl.config import ConfigError
from megarl.config.schema import REWARD_MODEL, Engine, ParamsDtype, Placement
from megarl.hybrid import ModelSpec
from megarl.models.builder import check_layout
from megarl.models.hf_config import MegatronModelArgs
from megarl.parallel.layout import Layout, LayoutError
from megarl.rollout.backends import rollout_backend
from megarl.sizing import cost
from megarl.sizing.memory import GiB, GenerationMemory, MicroBatches, ModelMemory, TrainingMemory, phase_peaks
from megarl.trainer.steps import check_batch_split

NO_ENGINE = GenerationMemory(weights=0, kv_per_token=0, pool=0, kv_tokens=0)
SYNC_EXACT = 16  # fitting layouts whose weight sync the planner costs (see plan_layouts)


@dataclass(frozen=True)
class Cluster:
    """What ``megarl plan`` is asked to fit (its command-line flags)."""

    gpus: int
    memory_gb: float  # GiB, as the GPU-shaped harness's MEGARL_GPU_SHAPED_MEMORY_GB
    gpus_per_node: int = 8
    seq_len: Optional[int] = None  # tokens of one sequence; None: from the config
    top: int = 5

    def __post_init__(self):
        for name in ("gpus", "memory_gb", "gpus_per_node", "top"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
        if self.seq_len is not None and self.seq_len <= 0:
            raise ValueError(f"--seq-len={self.seq_len} must be positive")

    @property
    def budget(self) -> int:
        return int(self.memory_gb * GiB)


@dataclass
class Proposal:
    """A training layout, its generation layout and recompute choice, their memory and time."""

    layout: Layout
    gen: Tuple[int, int, int]  # t_g, p_g, e_g
    recompute: bool
    stages: List[TrainingMemory]  # one rank of every pipeline stage
    generation: GenerationMemory
    phases: Dict[str, int]  # the fullest rank's bytes in each phase
    micro_batches: int
    time: Dict[str, object] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    def overrides(self) -> str:
        a, (t_g, p_g, e_g) = self.layout, self.gen
        keys = [f"parallel.actor.tp={a.tp}", f"parallel.actor.pp={a.pp}", f"parallel.actor.cp={a.cp}",
                f"parallel.actor.ep={a.ep}"]
        keys += [f"parallel.actor.etp={a.etp}"] if a.ep > 1 else []
        keys += [f"parallel.rollout.tp={t_g}", f"parallel.rollout.pp={p_g}", f"parallel.rollout.ep={e_g}"]
        return " ".join(keys + [f"model.recompute_granularity={'full' if self.recompute else 'null'}"])


@dataclass
class Plan:
    """What ``megarl plan`` found: the fastest proposals and the sizes behind them."""

    name: str
    cluster: Cluster
    counts: cost.ParamCounts
    inputs: List[str]  # the sizes used and where they come from
    checked: int  # layouts that pass the layout checks
    fitting: int
    proposals: List[Proposal]
    hardware: cost.Hardware
    offload: object  # trainer.offload
    bucket: int  # a weight sync's bucket, bytes


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class Sizer:
    """The candidate layouts of one model and configuration on ``cluster``, their memory and time."""

    def __init__(self, cfg, args: MegatronModelArgs, cluster: Cluster):
        if cfg.trainer.placement == Placement.split:
            raise ValueError("megarl plan sizes colocated placement: trainer.placement=split gives the rollout "
                             "its own parallel.rollout.nproc GPUs, which the plan does not model; plan with "
                             "trainer.placement=colocated")
        self.cfg, self.args, self.cluster = cfg, args, cluster
        data, algo = cfg.data, cfg.algorithm
        self.model = ModelSpec.from_args(args, cfg.model.make_vocab_size_divisible_by)
        self.memory = ModelMemory(args, self.model)
        self.topk = args.config_kwargs.get("moe_router_topk", 1)
        self.counts = cost.ParamCounts.of(self.model, self.topk)
        if cluster.seq_len:
            self.seq_len, source = cluster.seq_len, "--seq-len"
        elif data.max_prompt_length:
            self.seq_len = data.max_prompt_length + algo.max_new_tokens
            source = f"data.max_prompt_length={data.max_prompt_length} + algorithm.max_new_tokens={algo.max_new_tokens}"
        else:
            self.seq_len = args.max_position_embeddings
            source = "the model's max_position_embeddings: data.max_prompt_length is null; set it or --seq-len"
        if self.seq_len <= algo.max_new_tokens:
            raise ValueError(f"sequences of {self.seq_len} tokens ({source}) leave no room for a prompt before "
                             f"algorithm.max_new_tokens={algo.max_new_tokens}; raise --seq-len")
        self.rows = data.prompts_per_step * algo.samples_per_prompt
        self.mini = algo.ppo_mini_batch_size or self.rows
        self.reference = algo.kl_coef > 0 and not cfg.model.lora.rank  # megarl/controller/rl_worker.py
        self.critic = preset(algo).critic
        self.param_bytes = 4 if cfg.model.params_dtype == ParamsDtype.float32 else 2  # auto: bf16 on GPUs
        r = cfg.parallel.rollout
        self.pool = None if r.engine == Engine.native else int(r.mem_fraction_static * cluster.budget)
        self.bucket = r.bucket_mb << 20
        self.hardware = cost.Hardware(gpus_per_node=cluster.gpus_per_node)
        self.workload = cost.Workload(prompts=data.prompts_per_step, samples=algo.samples_per_prompt,
                                      prompt_tokens=self.seq_len - algo.max_new_tokens,
                                      response_tokens=algo.max_new_tokens, bytes_per_param=2)
        self.inputs = self._describe(source)
        self._gen_cache: Dict[Tuple[int, int, int], Tuple[GenerationMemory, float]] = {}
        self.refusals: Dict[Tuple[int, int, int], Optional[str]] = {}  # the rollout backend's, by (t_g, p_g, e_g)

    def _describe(self, seq_source: str) -> List[str]:
        """The sizes the plan uses and where they come from, as the report prints them."""
        cfg, data, algo, r = self.cfg, self.cfg.data, self.cfg.algorithm, self.cfg.parallel.rollout
        steps = ("algorithm.ppo_mini_batch_size" if algo.ppo_mini_batch_size else
                 f"data.prompts_per_step={data.prompts_per_step} x "
                 f"algorithm.samples_per_prompt={algo.samples_per_prompt}")
        roles = ("actor" + (", reference (a frozen copy: algorithm.kl_coef > 0)" if self.reference else "")
                 + (f", critic ({algo.name})" if self.critic else ""))
        optimizer = ("sharded over dp*cp (distributed optimizer)" if cfg.optimizer.use_distributed_optimizer
                     else "unsharded (optimizer.use_distributed_optimizer=false)")
        engine = ("its generation shard and the KV cache of its rows at full length" if self.pool is None else
                  f"a pool of parallel.rollout.mem_fraction_static={r.mem_fraction_static:g} x the GPU")
        offloaded = ", ".join(k for k in ("params", "grads", "optimizer") if getattr(cfg.trainer.offload, k))
        lines = [f"sequences of {self.seq_len} tokens ({seq_source})",
                 f"micro-batches of data.micro_batch_tokens={data.micro_batch_tokens} tokens per CP rank, at least one "
                 f"sequence; {self.mini} sequences per optimizer step ({steps}), "
                 f"algorithm.ppo_epochs={algo.ppo_epochs}",
                 f"roles: {roles}; {'fp32' if self.param_bytes == 4 else 'bf16'} parameters, fp32 main grads, Adam "
                 f"{optimizer}",
                 f"rollout engine {r.engine}: {engine}; weight sync buckets of "
                 f"parallel.rollout.bucket_mb={r.bucket_mb}; "
                 f"trainer.offload: {offloaded or 'nothing'}"]
        not_counted = [what for what, on in (
            ("PRIME's implicit PRM", preset(algo).prm),
            (f"the reward model (algorithm.reward_fn={REWARD_MODEL})", algo.reward_fn == REWARD_MODEL),
            ("model.lora's savings (counted as full fine-tuning)", bool(cfg.model.lora.rank))) if on]
        return lines + (["not counted: " + ", ".join(not_counted)] if not_counted else [])

    # ---------------------------------------------------------------------------- candidates
    def layouts(self) -> Iterator[Layout]:
        """Every layout of the cluster's GPUs that a run would accept: tp (and tp*cp) within a node,
        etp = 1 under expert parallelism (tp without)."""
        gpus, node = self.cluster.gpus, self.cluster.gpus_per_node
        experts = self.model.num_experts
        sp = self.cfg.parallel.actor.sequence_parallel
        for tp in _divisors(node):
            for cp in _divisors(node // tp):
                for pp in _divisors(self.memory.num_layers):
                    if gpus % (tp * cp * pp):
                        continue
                    dp = gpus // (tp * cp * pp)
                    for ep in _divisors(experts) if experts else [1]:
                        layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 else tp, cp=cp,
                                        sequence_parallel=sp)
                        try:
                            layout.validate(gpus)
                            check_layout(self.args, layout, self.cfg.model)
                            check_batch_split(self.cfg.data, self.cfg.algorithm, dp)
                        except (LayoutError, ConfigError):
                            continue
                        yield layout

    def micro_batches(self, layout: Layout) -> MicroBatches:
        """Rows of full length: the data.micro_batch_tokens budget per CP rank, one row at least."""
        rows = max(1, self.cfg.data.micro_batch_tokens * layout.cp // self.seq_len)
        return MicroBatches(self.seq_len, rows, math.ceil(self.mini // layout.dp / rows))

    def training(self, layout: Layout) -> List[TrainingMemory]:
        micro = self.micro_batches(layout)
        return [self.memory.training(layout, stage, micro, self.param_bytes,
                                     self.cfg.optimizer.use_distributed_optimizer, self.reference, self.critic)
                for stage in range(layout.pp)]

    def gen_layout(self, gen: Tuple[int, int, int]) -> Layout:
        t_g, p_g, e_g = gen
        return Layout(tp=t_g, pp=p_g, dp=self.cluster.gpus // (t_g * p_g), ep=e_g, etp=1 if e_g > 1 else t_g)

    def generation(self, gen: Tuple[int, int, int]) -> Tuple[GenerationMemory, float]:
        """The engine's memory at ``gen`` and the cost model's generation seconds (cached)."""
        if gen not in self._gen_cache:
            layout = self.gen_layout(gen)
            tokens = math.ceil(self.rows / layout.dp) * self.seq_len
            memory = self.memory.generation(layout, self.pool, tokens)
            seconds, _ = cost.generation_seconds(self.counts, layout, self.hardware, self.workload)
            self._gen_cache[gen] = (memory, seconds)
        return self._gen_cache[gen]

    def gen_options(self, layout: Layout) -> Iterator[Tuple[int, int, int]]:
        """(t_g, p_g, e_g) the 3D-HybridEngine can regroup ``layout`` into (megarl.hybrid.regroup)
        and the rollout backend takes, fewest pipeline stages first."""
        experts = self.model.num_experts
        for p_g in _divisors(layout.pp):
            for t_g in _divisors(layout.tp):
                for e_g in _divisors(experts) if experts else [1]:
                    if (self.cluster.gpus // p_g) % e_g == 0 and self.backend_refuses((t_g, p_g, e_g)) is None:
                        yield t_g, p_g, e_g

    def backend_refuses(self, gen: Tuple[int, int, int]) -> Optional[str]:
        """The rollout backend's objection to generating at ``gen`` (its ``check``), or None."""
        if gen not in self.refusals:
            r = self.cfg.parallel.rollout
            rollout = dataclasses.replace(r, tp=gen[0], pp=gen[1], ep=gen[2])
            try:
                rollout_backend(r.engine).check(dataclasses.replace(
                    self.cfg, parallel=dataclasses.replace(self.cfg.parallel, rollout=rollout)))
                self.refusals[gen] = None
            except ConfigError as err:
                self.refusals[gen] = str(err)
        return self.refusals[gen]

    def flops_per_param_token(self, recompute: bool) -> int:
        """2 per forward, 4 per backward: old log-probs, the update (ppo_epochs times; a second
        forward with full recompute), the reference's log-probs, the critic's values and update."""
        update = (6 + 2 * recompute) * self.cfg.algorithm.ppo_epochs
        return 2 + update + 2 * self.reference + (2 + update) * self.critic

    def propose(self, layout: Layout) -> Tuple[Optional[Proposal], Optional[Proposal]]:
        """The fitting (generation layout, recompute) of ``layout`` that the cost model finds fastest
        among those with the fewest generation pipeline stages, without recompute if any fits (or
        None); and the smallest-peak one, fitting or not (what the error names when nothing fits).
        Generation pipeline stages only when fewer do not fit: the cost model divides a decode
        step's weight streaming by p_g as by t_g, which one token's pass through a pipeline does not get."""
        stages, micro = self.training(layout), self.micro_batches(layout)
        offload = self.cfg.trainer.offload
        smallest = None
        for recompute in (False, True):
            # each phase's engine term is the same on every stage: the fullest stage without it, plus it
            trainer = {phase: max(phase_peaks(m, NO_ENGINE, recompute, offload, 0)[phase] for m in stages)
                       for phase in ("train", "sync", "generate")}
            best = None
            for gen in self.gen_options(layout):
                if best is not None and gen[1] > best.gen[1]:
                    break
                memory, seconds = self.generation(gen)
                phases = {"train": trainer["train"], "sync": trainer["sync"] + memory.weights + self.bucket,
                          "generate": trainer["generate"] + memory.pool}
                proposal = Proposal(layout, gen, recompute, stages, memory, phases, micro.count,
                                    {"generate_s": seconds})
                if smallest is None or proposal.peak < smallest.peak:
                    smallest = proposal
                fits = proposal.peak <= self.cluster.budget and memory.kv_tokens >= self.seq_len
                if fits and (best is None or seconds < best.time["generate_s"]):
                    best = proposal
            if best is not None:
                return best, smallest
        return None, smallest

    def lower_bound(self, proposal: Proposal) -> float:
        return proposal.time["generate_s"] + cost.training_seconds(
            self.counts, self.cluster.gpus, self.hardware, self.workload,
            self.flops_per_param_token(proposal.recompute), proposal.layout.pp, proposal.micro_batches)

    def predict(self, proposal: Proposal) -> Dict[str, object]:
        return cost.predict(self.model, self.topk, proposal.layout, proposal.gen, self.hardware, self.workload,
                            self.flops_per_param_token(proposal.recompute), proposal.micro_batches)


def plan_layouts(cfg, args: MegatronModelArgs, cluster: Cluster, name: str = "") -> Plan:
    """The ``cluster.top`` fastest proposals; :class:`ValueError` naming what to change when none fits."""
    sizer = Sizer(cfg, args, cluster)
    fitting, checked, smallest = [], 0, None
    for layout in sizer.layouts():
        checked += 1
        best, small = sizer.propose(layout)
        if small is not None and (smallest is None or small.peak < smallest.peak):
            smallest = small
        if best is not None:
            fitting.append(best)
    if not checked:
        raise ValueError(f"no layout of {cluster.gpus} GPUs passes the layout checks (heads, layers, experts and "
                         f"vocabulary divisible by tp, pp and ep; data.prompts_per_step x "
                         f"algorithm.samples_per_prompt = {sizer.rows} rows divisible by dp): choose another --gpus")
    if smallest is None:  # every generation layout refused
        refusal = next(iter(sizer.refusals.values()))
        raise ConfigError(f"no generation layout passes parallel.rollout.engine={cfg.parallel.rollout.engine}'s "
                          f"checks: {refusal}")
    if not fitting:
        raise ValueError(nothing_fits(sizer, smallest, checked, name or args.model_type))
    # The weight sync's seconds need the planner (the slow part) and are small beside the rest:
    # they are computed for the layouts with the least generation + training time, from the
    # fastest on, until no further layout can enter the top or SYNC_EXACT layouts have them.
    fitting.sort(key=sizer.lower_bound)
    ranked: List[Proposal] = []
    for proposal in fitting[:max(SYNC_EXACT, cluster.top)]:
        if len(ranked) >= cluster.top and sizer.lower_bound(proposal) >= ranked[-1].time["step_s"]:
            break
        proposal.time = sizer.predict(proposal)
        ranked = sorted(ranked + [proposal], key=lambda p: (p.time["step_s"], p.peak))[:cluster.top]
    return Plan(name or args.model_type, cluster, sizer.counts, sizer.inputs, checked, len(fitting), ranked,
                sizer.hardware, cfg.trainer.offload, sizer.bucket)


def nothing_fits(sizer: Sizer, smallest: Proposal, checked: int, name: str) -> str:
    """The error when no layout fits: the smallest peak found, what fills it, what to change."""
    cluster, gib = sizer.cluster, lambda n: f"{n / GiB:.1f}"
    stage = max(smallest.stages, key=lambda m: m.peak(smallest.recompute))
    phase = max(smallest.phases, key=smallest.phases.get)
    act = stage.activations_recompute if smallest.recompute else stage.activations
    hints = {"train": "a smaller data.micro_batch_tokens or --seq-len (data.max_prompt_length, "
                      "algorithm.max_new_tokens)",
             "sync": "a larger parallel.rollout.tp (t_g) or a smaller parallel.rollout.bucket_mb",
             "generate": "trainer.offload.params/grads/optimizer or a smaller parallel.rollout.mem_fraction_static"}
    if stage.states > cluster.budget:  # nothing but more memory helps
        advice = f" (the parameters, gradients and optimizer state alone take {gib(stage.states)} GiB a GPU)"
    else:
        advice = "".join(f"; or {hints[p]}" for p, n in smallest.phases.items() if n > cluster.budget)
    kv = ("" if smallest.generation.kv_tokens >= sizer.seq_len else
          f"; its KV cache holds {smallest.generation.kv_tokens} tokens, less than one sequence of {sizer.seq_len}")
    return (f"no layout of {name} ({sizer.counts.total / 1e9:.1f}B parameters) fits {cluster.gpus} "
            f"GPUs of {cluster.memory_gb:g} GiB (--gpus={cluster.gpus} --gpu-memory-gb={cluster.memory_gb:g}): of "
            f"{checked} layouts, the smallest peak is {gib(smallest.peak)} GiB in the {phase} phase at "
            f"{smallest.layout} with rollout (t_g, p_g, e_g) = {smallest.gen}"
            + (", full recompute" if smallest.recompute else "")
            + f" (stage {stage.stage}: params {gib(stage.params)} + grads {gib(stage.grads)} + optimizer "
              f"{gib(stage.optimizer)} + activations {gib(act)} GiB; rollout engine {gib(smallest.generation.pool)} GiB)"
            + kv + ". Use more GPUs (--gpus) or GPUs with more memory (--gpu-memory-gb)" + advice)


# ---------------------------------------------------------------------------------------- text

def plan_lines(plan: Plan) -> List[str]:
    """``megarl plan``'s report: the inputs, the ranked table, each proposal's memory per rank and phase."""
    c, gib = plan.cluster, lambda n: f"{n / GiB:6.1f}"
    lines = [f"megarl plan: {plan.name} ({plan.counts.total / 1e9:.2f}B parameters, {plan.counts.active / 1e9:.2f}B "
             f"active a token) on {c.gpus} GPUs of {c.memory_gb:g} GiB, {c.gpus_per_node} a node"]
    lines += [f"  {line}" for line in plan.inputs]
    lines += [f"  memory: megarl/sizing/memory.py (docs/scaling.md); time: the cost model at {plan.hardware.name} "
              f"constants (megarl/sizing/cost.py). GiB = 2^30 bytes.",
              f"{plan.checked} layouts pass the layout checks, {plan.fitting} fit; the fastest {len(plan.proposals)}:",
              "",
              f"{'':2s}  {'actor layout':^22s}  {'rollout':^11s}",
              f"{'#':>2s}  {'tp':>3s}{'pp':>3s}{'dp':>5s}{'cp':>3s}{'ep':>4s}{'etp':>4s}  "
              f"{'t_g':>3s}{'p_g':>4s}{'e_g':>4s}  "
              f"{'recompute':9s}  {'peak GiB':>8s}  {'step s':>7s} = {'generate':>8s} + {'train':>7s} + {'sync':>5s}"]
    for i, p in enumerate(plan.proposals, 1):
        a, t = p.layout, p.time
        lines.append(f"{i:2d}  {a.tp:3d}{a.pp:3d}{a.dp:5d}{a.cp:3d}{a.ep:4d}{a.etp:4d}  {p.gen[0]:3d}{p.gen[1]:4d}"
                     f"{p.gen[2]:4d}  {'full' if p.recompute else 'none':9s}  {p.peak / GiB:8.1f}  "
                     f"{t['step_s']:7.1f} = "
                     f"{t['generate_s']:8.1f} + {t['train_s']:7.1f} + {t['sync_s']:5.2f}")
    for i, p in enumerate(plan.proposals, 1):
        a, g = p.layout, p.generation
        per_stage = a.tp * a.cp * a.dp
        lines += ["", f"#{i}: {p.overrides()}",
                  f"  GiB per rank{'':14s} {'params':>6s} {'grads':>6s} {'optim':>6s} {'act':>6s} {'act/rc':>6s}"
                  f"   {'train':>6s} {'sync':>6s} {'gen':>6s}"]
        for m in _stages_to_print(p.stages, p.recompute):
            ranks = f"ranks {m.stage * per_stage}-{(m.stage + 1) * per_stage - 1}"
            phases = phase_peaks(m, g, p.recompute, plan.offload, plan.bucket)
            lines.append(f"  stage {m.stage:<3d} {ranks:>16s} {gib(m.params)} {gib(m.grads)} {gib(m.optimizer)} "
                         f"{gib(m.activations)} {gib(m.activations_recompute)}   {gib(phases['train'])} "
                         f"{gib(phases['sync'])} {gib(phases['generate'])}")
        kv_bytes = g.kv_tokens * g.kv_per_token
        lines.append(f"  rollout (t_g, p_g, e_g) = {p.gen}: weights {g.weights / GiB:.1f} GiB + KV cache "
                     f"{kv_bytes / GiB:.1f} GiB ({g.kv_per_token / 1024:.1f} KiB a token) of a {g.pool / GiB:.1f} GiB "
                     f"engine: {g.kv_tokens} tokens; training: {p.micro_batches} micro-batch(es) per DP rank per "
                     f"optimizer step")
    lines += ["", "act: activations without recompute; act/rc: with full recompute; train/sync/gen: the phases' "
              "totals at the proposal's recompute"]
    return lines


def _stages_to_print(stages: List[TrainingMemory], recompute: bool) -> List[TrainingMemory]:
    """All stages up to four, else the first, the fullest and the last."""
    if len(stages) <= 4:
        return stages
    fullest = max(stages, key=lambda m: m.peak(recompute))
    return sorted({s.stage: s for s in (stages[0], fullest, stages[-1])}.values(), key=lambda m: m.stage)
