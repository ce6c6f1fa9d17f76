"""``megarl train``: RL post-training with a single controller on Ray (colocated or split placement).

Everything a user can get wrong is checked in :func:`prepare`, before Ray or any worker
starts: layouts, the rollout layout against the actor's, batch sizes against data parallelism,
datasets and their keys, the reward function, the tokenizer against the model.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from megarl.agent.envs import env_factory
from megarl.agent.loop import Agent, check_config as check_agent_config, total_budget
from megarl.algorithms.correction import check_rollout_correction
from megarl.algorithms.presets import preset, resolve
from megarl.checkpoint.load import check_pretrained, locate, resolve_model_config
from megarl.config import ConfigError, MegarlConfig, ParallelConfig, load_config, validate
from megarl.config.schema import REWARD_MODEL, Loop, Placement, RolloutConfig
from megarl.data.datasets import load_records
from megarl.data.tokenizer import load_tokenizer
from megarl.hybrid import regroup
from megarl.models.builder import check_layout
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout
from megarl.runtime.signals import Preemption
from megarl.tasks.registry import builtin_records
from megarl.trainer.resume import check_resume
from megarl.rollout.backends import rollout_backend, rollout_dtype
from megarl.trainer.steps import PromptStream, Scorer

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    cfg: MegarlConfig
    layout: Layout
    stream: PromptStream
    scorer: Scorer
    tokenizer: Any
    agent: Optional[Agent] = None  # multi-turn episodes (rollout.env), else None


def world_size(cfg: MegarlConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.nproc_per_node


def prepare(cfg: MegarlConfig) -> Prepared:
    """Validate the whole configuration and load the data (no process started)."""
    validate(cfg)  # a config built in code; load_config checks those it composes
    cfg = resolve_paths(cfg)
    world = world_size(cfg)
    if cfg.trainer.nnodes > 1 and not cfg.trainer.ray_address:
        raise ConfigError(f"trainer.nnodes={cfg.trainer.nnodes} needs trainer.ray_address (a Ray cluster; "
                          f"launch/slurm/train.sbatch starts one); a private Ray spans one machine")
    layout = Layout.from_config(cfg.parallel.actor, world)
    args = megatron_args_from_hf(cfg.model.hf_config)
    check_layout(args, layout, cfg.model)
    r = cfg.parallel.rollout
    if cfg.trainer.placement != Placement.split:  # colocated: the generation layout is regrouped from the actor's
        try:
            regroup(layout, r.tp, r.pp, r.ep, args.num_experts or 0)
        except ValueError as err:
            raise ConfigError(f"parallel.rollout: {err}") from None
    for role in ("critic", "reference"):  # the trained roles share the trainer's ranks and layout
        if getattr(cfg.parallel, role) not in (ParallelConfig(), cfg.parallel.actor):
            raise ConfigError(f"parallel.{role} differs from parallel.actor: the {role} runs on the trainer's ranks in "
                              f"the actor's layout {layout} (one Megatron layout per process); leave parallel.{role} "
                              f"unset or equal to parallel.actor")
    check_placement(cfg, args)
    try:  # the algorithm's preset fills its defaults; every algorithm field is checked there
        cfg.algorithm = resolve(cfg.algorithm)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    algo, data = cfg.algorithm, cfg.data
    changed = check_resume(cfg)  # a resume under another config: refused by name, or listed
    if changed:
        log.warning(changed)
        print(f"megarl: warning: {changed}", file=sys.stderr, flush=True)
    try:
        check_rollout_correction(algo.rollout_correction, algo.rollout_correction_threshold)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    rollout_backend(r.engine).check(cfg)  # engine, dtype and the other choices are checked by validate()
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true needs the tensorboard package: pip install 'megarl[tensorboard]'")
    rows = data.prompts_per_step * algo.samples_per_prompt
    if rows % layout.dp:
        raise ConfigError(f"data.prompts_per_step={data.prompts_per_step} x algorithm.samples_per_prompt="
                          f"{algo.samples_per_prompt} = {rows} rows do not split over the actor's dp={layout.dp}; "
                          f"make the product a multiple of {layout.dp}")
    mini = algo.ppo_mini_batch_size
    if mini and (rows % mini or mini % layout.dp):
        raise ConfigError(f"algorithm.ppo_mini_batch_size={mini} must divide the {rows} rows per step "
                          f"(data.prompts_per_step x algorithm.samples_per_prompt) and be a multiple of the "
                          f"actor's dp={layout.dp}; null = the whole batch")
    if algo.routing_replay:
        if not rollout_backend(r.engine).records_routing:
            raise ConfigError("algorithm.routing_replay=true needs the rollout's expert choices, which only the native "
                              "engine records; set parallel.rollout.engine=native or algorithm.routing_replay=false")
        if not args.num_experts:
            raise ConfigError("algorithm.routing_replay=true needs an MoE model; model.hf_config describes a dense "
                              "one (no experts); set algorithm.routing_replay=false")
        if cfg.model.recompute_granularity == "full":
            # full recompute re-routes in the backward pass, out of step with the micro-batch being replayed
            raise ConfigError("algorithm.routing_replay=true does not support model.recompute_granularity='full'; "
                              "use selective or no recompute")
    check_pretrained_sources(cfg)
    tokenizer = load_tokenizer(data.tokenizer, data.chat_template)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model's vocab_size is "
                          f"{args.vocab_size} (model.hf_config)")
    if algo.reward_fn == REWARD_MODEL:  # the reward model scores the policy's token ids
        rm_vocab = megatron_args_from_hf(cfg.reward_model.hf_config or cfg.model.hf_config).vocab_size
        if tokenizer.vocab_size > rm_vocab:
            raise ConfigError(f"the reward model's vocab_size is {rm_vocab} but the policy's tokenizer has "
                              f"{tokenizer.vocab_size} tokens: the reward model reads the policy's token ids, so "
                              f"it needs the policy's tokenizer (reward_model.path / reward_model.hf_config)")
    if data.train_files:
        records = load_records(data.train_files, data.prompt_key, data.answer_key, data.bad_rows)
    else:
        records = builtin_records(data.task, data.builtin_size, data.num_digits, cfg.trainer.seed)
    agent = None
    if check_agent(cfg, args):
        try:
            agent = Agent(cfg.rollout, env_factory(cfg.rollout.env, cfg.rollout.max_tool_seconds,
                                                  sandbox=cfg.rollout.sandbox), tokenizer)
        except ValueError as err:  # a chat template that cannot place observations
            raise ConfigError(f"rollout.env with tokenizer {data.tokenizer}: {err}") from None
    response_room = agent.budget(algo.max_new_tokens) if agent else algo.max_new_tokens
    room = args.max_position_embeddings - response_room
    stream = PromptStream(records, tokenizer, cfg.trainer.seed, room)
    check_prompt_tokens(stream, args.vocab_size, data.bad_rows if data.train_files else None)
    return Prepared(cfg, layout, stream, Scorer(algo, tokenizer), tokenizer, agent)


def check_agent(cfg: MegarlConfig, args) -> bool:
    """The ``rollout:`` section (multi-turn episodes) and what it cannot combine with; True when
    ``rollout.env`` is set."""
    r, algo = cfg.rollout, cfg.algorithm
    if r.env is None:
        if r != RolloutConfig():
            log.warning("rollout.* is set but rollout.env is null: the run is single-turn and ignores it")
        return False
    from megarl.agent.envs import check_sandbox

    try:
        check_agent_config(r, algo.max_new_tokens)
        env_factory(r.env, r.max_tool_seconds, sandbox=r.sandbox)  # imports and checks the environment
        check_sandbox(r.env, r.sandbox)  # one confined call: can this machine hide the host from the tool?
    except ValueError as err:
        raise ConfigError(str(err)) from None
    budget = total_budget(r, algo.max_new_tokens)
    if budget >= args.max_position_embeddings:
        raise ConfigError(f"rollout.max_total_tokens={budget} (null: max_turns x algorithm.max_new_tokens) leaves no "
                          f"room for prompts in the model's {args.max_position_embeddings} positions; lower it")
    if algo.routing_replay:
        # the native engine records the routing of each call's tokens; a multi-turn sample spans
        # several calls (each re-reads the earlier turns), so no single record replays them all
        raise ConfigError("algorithm.routing_replay=true does not support multi-turn rollouts (rollout.env); "
                          "set algorithm.routing_replay=false or rollout.env=null")
    if preset(algo).greedy_baseline:
        raise ConfigError(f"algorithm.name={algo.name}: the greedy baseline is a single-turn response; with "
                          f"rollout.env use another estimator (e.g. grpo, rloo)")
    if r.reward == "verifier" and algo.reward_fn == REWARD_MODEL:
        raise ConfigError("rollout.reward=verifier scores the final turn with algorithm.reward_fn; the reward "
                          "model (reward_fn=model) reads whole sequences: use a verifier or rollout.reward=env")
    return True


def check_placement(cfg: MegarlConfig, args) -> None:
    """trainer.placement, parallel.rollout.nproc, trainer.loop and trainer.max_staleness together."""
    from megarl.rollout.backends import rollout_layout, transfer_plan

    t, r, algo = cfg.trainer, cfg.parallel.rollout, cfg.algorithm
    if t.placement == Placement.colocated:
        if t.max_staleness:
            raise ConfigError(f"trainer.max_staleness={t.max_staleness} streams batches from the rollout's own ranks: "
                              f"set trainer.placement=split (colocated ranks cannot generate while they train)")
        return
    if r.nproc < 1:
        raise ConfigError("trainer.placement=split needs parallel.rollout.nproc >= 1 (the rollout's own ranks)")
    if r.nproc % r.tp:
        raise ConfigError(f"parallel.rollout.nproc={r.nproc} must be a multiple of parallel.rollout.tp={r.tp}")
    if r.pp != 1 or r.ep != 1:
        raise ConfigError(f"trainer.placement=split generates with parallel.rollout.pp=1 and ep=1 "
                          f"(got pp={r.pp}, ep={r.ep})")
    if any(vars(t.offload).values()):
        raise ConfigError("trainer.offload is for colocated placement (the rollout borrows the trainer's devices); "
                          "with trainer.placement=split the rollout has its own: set trainer.offload.* to false")
    if t.nnodes > 1:
        raise ConfigError("trainer.placement=split runs on one node for now (trainer.nnodes=1); use colocated "
                          "placement across nodes")
    if t.max_staleness and t.loop != Loop.one_step_off:
        raise ConfigError(f"trainer.max_staleness={t.max_staleness} needs trainer.loop=one_step_off (the "
                          f"asynchronous loop)")
    if t.max_staleness > 1 and algo.rollout_correction == "none":
        raise ConfigError(f"trainer.max_staleness={t.max_staleness}: samples up to {t.max_staleness} versions old "
                          f"need importance weights; set algorithm.rollout_correction (e.g. token_tis)")
    if t.loop == Loop.one_step_off and algo.reward_fn == REWARD_MODEL:
        raise ConfigError("algorithm.reward_fn=model with trainer.placement=split and trainer.loop=one_step_off: the "
                          "reward model runs on the trainer's ranks, which are training while the next batch is "
                          "scored; use trainer.loop=sync or a reward function")
    try:
        transfer_plan(cfg, args)
    except ValueError as err:
        raise ConfigError(f"parallel.rollout (split placement, layout {rollout_layout(cfg)}): {err}") from None


def check_prompt_tokens(stream: PromptStream, vocab_size: int, bad_rows: Optional[str] = None) -> None:
    """Every prompt renders (chat template), fits the model's positions and uses only token ids the
    model has; so do the EOS and pad ids. A bad row fails here, naming its ``file:row``, before any
    worker starts, or with ``bad_rows="skip"`` (data.bad_rows; None: the built-in task's records,
    never skipped) is logged and dropped from the stream. The token ids stay cached for the run
    (10k short chat prompts through an HF chat template: about 0.9 s on one CPU core)."""
    kept = []
    for record in stream.records:  # source: "file:row" or "task:index"
        problem = _prompt_problem(stream, record, vocab_size)
        if problem is None:
            kept.append(record)
        elif bad_rows == "skip":
            log.warning("skipping %s: %s", record.source, problem)
        else:
            hint = " (set data.bad_rows=skip to skip such rows)" if bad_rows == "fail" else ""
            raise ConfigError(f"{record.source}: {problem}{hint}")
    if len(kept) < len(stream.records):
        log.warning("skipped %d of %d prompts (data.bad_rows=skip)", len(stream.records) - len(kept),
                    len(stream.records))
        if not kept:
            raise ConfigError("every prompt of data.train_files was skipped (data.bad_rows=skip); see the log above")
        stream.records = kept
    tok = stream.tokenizer
    for name, ids in (("EOS", tok.eos_token_ids), ("pad", [tok.pad_token_id])):
        outside = [i for i in ids if not 0 <= i < vocab_size]
        if outside:
            raise ConfigError(f"the tokenizer's {name} id(s) {outside} are outside the model's vocabulary of "
                              f"{vocab_size} (data.tokenizer does not belong to the model)")


def _prompt_problem(stream: PromptStream, record, vocab_size: int) -> Optional[str]:
    """Why ``record``'s prompt cannot be used, or None."""
    import jinja2

    try:
        ids = stream.token_ids(record)
    except (jinja2.TemplateError, TypeError, KeyError) as err:
        return f"the prompt does not render with data.tokenizer's chat template: {err}"
    except ValueError as err:  # too long (the message names the row), or characters it cannot encode
        return str(err).removeprefix(f"{record.source}: ")
    if not ids:
        return "the prompt has no tokens"
    if min(ids) < 0 or max(ids) >= vocab_size:
        outside = sorted({i for i in ids if not 0 <= i < vocab_size})
        return (f"the prompt has token id(s) {outside[:5]} outside the model's vocabulary of {vocab_size}; "
                f"data.tokenizer does not belong to the model")
    return None


def resolve_paths(cfg: MegarlConfig) -> MegarlConfig:
    """A copy of ``cfg`` with every path absolute (the config snapshot saved with checkpoints works
    from any directory: ``megarl export-hf`` reads it) and the defaults that follow ``model.path``
    and ``reward_model.path`` filled in: the model config and the tokenizer."""
    cfg = copy.deepcopy(cfg)
    m, data, rm = cfg.model, cfg.data, cfg.reward_model

    def absolute(path: Optional[str]) -> Optional[str]:
        return str(Path(path).expanduser().absolute()) if path else path

    m.path, m.hf_config, rm.path, rm.hf_config, rm.checkpoint, data.tokenizer = map(
        absolute, (m.path, m.hf_config, rm.path, rm.hf_config, rm.checkpoint, data.tokenizer))
    data.train_files = [absolute(f) for f in data.train_files]
    cfg.trainer.run_dir = absolute(cfg.trainer.run_dir)
    if m.path:
        # a bare dist checkpoint (Megatron-LM's: no hf/ subdir) needs model.hf_config
        source = locate(m.path, "model.path", need_config=not m.hf_config)
        m.hf_config = m.hf_config or str(source.config)
        if not data.tokenizer and source.tokenizer:
            data.tokenizer = str(source.tokenizer)
        elif not data.tokenizer:
            print(f"megarl: warning: model.path={m.path} has no tokenizer files; data.tokenizer=null uses the "
                  f"built-in digit tokenizer", file=sys.stderr, flush=True)
    m.hf_config = absolute(resolve_model_config(m).hf_config)
    if rm.path and not rm.hf_config:
        rm.hf_config = str(locate(rm.path, "reward_model.path").config)
    return cfg


def check_pretrained_sources(cfg: MegarlConfig) -> None:
    """``model.path`` and the reward model's weights against their configs: files present and
    complete, every tensor's name, shape and dtype (a named ConversionError otherwise)."""
    rm = cfg.reward_model
    if cfg.algorithm.reward_fn == REWARD_MODEL and not (rm.path or rm.checkpoint):
        raise ConfigError("algorithm.reward_fn=model needs reward_model.path (an HF *ForSequenceClassification "
                          "directory) or reward_model.checkpoint (a Megatron dist checkpoint of a backbone with "
                          "a scalar head)")
    if rm.path and rm.checkpoint:
        raise ConfigError("set one of reward_model.path and reward_model.checkpoint, not both")
    if cfg.model.path:
        check_pretrained(cfg.model.path, cfg.model, "model.path")
    if cfg.algorithm.reward_fn == REWARD_MODEL:
        rm_cfg = dataclasses.replace(cfg.model, path=None, hf_config=rm.hf_config or cfg.model.hf_config)
        field = "reward_model.path" if rm.path else "reward_model.checkpoint"
        check_pretrained(rm.path or rm.checkpoint, rm_cfg, field, value_head=True)


def run(prepared: Prepared) -> List[dict]:
    """Train, holding ``trainer.run_dir``'s lock from before Ray starts to the end: a second run on
    the directory refuses (RunDirInUse) having written nothing. A run that raises, or is
    interrupted, is marked FAILED, or KILLED, in MLflow."""
    from megarl.trainer.logger import end_unfinished_mlflow_run
    from megarl.trainer.run_dir import lock_run_dir

    rollout_backend(prepared.cfg.parallel.rollout.engine).check_available(prepared.cfg)
    with lock_run_dir(prepared.cfg.trainer.run_dir):
        try:
            return _run_locked(prepared)
        except BaseException as err:
            end_unfinished_mlflow_run(err)
            raise


def _run_locked(prepared: Prepared) -> List[dict]:
    from megarl.config import to_yaml
    from megarl.controller.cluster import RaySession
    from megarl.controller.roles import build_roles, rollout_ranks, start_groups
    from megarl.trainer import loop, one_step_off
    from megarl.trainer.checkpoint import CheckpointSchedule, Checkpoints
    from megarl.trainer.logger import RunLogger

    cfg = prepared.cfg
    preemption = Preemption(cfg.trainer.signal_grace_s)  # SIGTERM: finish the step, checkpoint, exit 143
    try:  # private on loopback, or trainer.ray_address
        session = RaySession(cfg.trainer, num_cpus=world_size(cfg) + rollout_ranks(cfg))
    except BaseException:
        preemption.close()
        raise
    preemption.install()  # over the handler Ray's core worker set
    try:
        groups = start_groups(cfg, session)
    except BaseException:
        preemption.close()
        prepared.scorer.close()
        session.close()
        raise
    group = groups[0]
    try:
        roles = build_roles(*groups)
        prepared.scorer.model = roles.reward_model
        checkpoints = Checkpoints(cfg.trainer.run_dir, cfg.trainer.keep_checkpoints)
        found = checkpoints.latest() if cfg.trainer.resume else None
        done, run_id = 0, None
        if found:
            path, driver = found
            same_layout = all(group.call("load_checkpoint", str(path)))
            prepared.stream.load_state(driver["stream"])
            prepared.scorer.failures = driver["reward_failures"]
            done, run_id = driver["step"], driver.get("mlflow_run_id") or None
            relayout = "" if same_layout else " into another layout (weights, optimizer and schedule exact; RNG reseeded)"
            print(f"megarl: resuming after step {done} from {path}{relayout}", flush=True)
        log = RunLogger(cfg, cfg.trainer.train_steps, start_step=done, mlflow_run_id=run_id,
                        decode=prepared.tokenizer.decode)
        schedule = CheckpointSchedule(
            checkpoints, cfg.trainer, group, lambda step: {
                "step": step, "stream": prepared.stream.state(), "reward_failures": prepared.scorer.failures,
                "mlflow_run_id": log.mlflow_run_id or ""}, to_yaml(cfg), preemption)
        train = one_step_off.train if cfg.trainer.loop == Loop.one_step_off else loop.train
        tok = prepared.tokenizer
        preemption.armed = True  # a SIGTERM from here on lets the step finish
        train(cfg, roles, prepared.stream, prepared.scorer, log, tok.eos_token_ids, tok.pad_token_id,
              start_step=done + 1, after_step=schedule.after_step, agent=prepared.agent)
        preemption.armed = False
        schedule.finish(blocking=True)
        final = {"step": cfg.trainer.train_steps, "actor_weights_checksum": group.call_first("actor_weights_checksum")}
        (log.run_dir / "final.json").write_text(json.dumps(final))
        png = log.close()
        print(f"run directory {log.run_dir}: metrics.jsonl, mlflow.db, {png.name}, final.json", flush=True)
        return log.history
    finally:
        preemption.close()
        prepared.scorer.close()  # the reward workers, even one stuck in a hanging function
        for g in groups:
            g.shutdown()
        session.close()  # Ray, then any process of the run still alive


def plan(prepared: Prepared) -> str:
    """What a run would start: nodes, ranks, the actor and rollout layouts, micro-DP groups."""
    cfg, layout = prepared.cfg, prepared.layout
    args = megatron_args_from_hf(cfg.model.hf_config)
    r = cfg.parallel.rollout
    if cfg.trainer.placement == Placement.split:
        return split_plan(prepared, args)
    rg = regroup(layout, r.tp, r.pp, r.ep, args.num_experts or 0)
    lines = [f"nodes {cfg.trainer.nnodes} x {cfg.trainer.nproc_per_node} ranks = world {layout.world_size}; "
             f"ray {cfg.trainer.ray_address or 'private, 127.0.0.1'}",
             f"actor layout {layout}; rollout layout {rg.gen} ({r.engine}); micro-DP size {rg.micro_dp}",
             f"algorithm {cfg.algorithm.name}; {cfg.data.prompts_per_step} prompts x "
             f"{cfg.algorithm.samples_per_prompt} samples per step; loop {cfg.trainer.loop}"]
    lines += rollout_backend(r.engine).plan_lines(cfg, rg.gen, cfg.trainer.placement)
    for rank in range(layout.world_size):
        c, g = layout.coords(rank), rg.gen_coords(rank)
        lines.append(f"rank {rank:4d} node {rank // cfg.trainer.nproc_per_node}: actor tp={c['tp']} pp={c['pp']} "
                     f"dp={c['dp']} ep={c['ep']} | rollout tp={g['tp']} pp={g['pp']} dp={g['dp']} | "
                     f"micro-DP group {list(rg.micro_dp_group(rank))}")
    return "\n".join(lines)


def split_plan(prepared: Prepared, args) -> str:
    """The plan of split placement: the trainer's ranks, the rollout's, and what each rollout rank
    receives per sync (its generation shard) from which training ranks."""
    from megarl.rollout.backends import transfer_plan

    cfg, layout = prepared.cfg, prepared.layout
    r, t = cfg.parallel.rollout, cfg.trainer
    tp = transfer_plan(cfg, args)
    backend = rollout_backend(r.engine)
    itemsize = 2 if (rollout_dtype(r) or cfg.model.params_dtype) == "bfloat16" else 4
    staleness = {Loop.sync: "0", Loop.one_step_off: str(t.max_staleness or 1)}[t.loop]
    lines = [f"placement split: trainer {layout.world_size} ranks (actor layout {layout}); rollout {r.nproc} ranks "
             f"(layout {tp.gen}, {r.engine}); ray {t.ray_address or 'private, 127.0.0.1'}",
             f"algorithm {cfg.algorithm.name}; {cfg.data.prompts_per_step} prompts x {cfg.algorithm.samples_per_prompt} "
             f"samples per step; loop {t.loop}"
             + (f", streaming up to {t.max_staleness} versions ahead" if t.max_staleness else "")
             + f" (staleness <= {staleness})",
             f"weight sync: {len(tp.buckets)} bucket(s) over the group spanning trainer ranks 0..{tp.offset - 1} and "
             f"rollout ranks {tp.offset}..{tp.world_size - 1}"
             + backend.weight_path()]
    lines += backend.plan_lines(cfg, tp.gen, t.placement)
    whole = backend.split_plan_lines(cfg, tp, layout, itemsize)
    if whole is not None:  # whole tensors by broadcast, not shards point to point
        return "\n".join(lines + whole)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        lines.append(f"trainer rank {rank:4d}: actor tp={c['tp']} pp={c['pp']} dp={c['dp']} ep={c['ep']} | sends "
                     f"{tp.sent(rank) * itemsize / 2**20:.2f} MiB per sync")
    for v in range(tp.gen.world_size):
        g = tp.gen.coords(v)
        sources = sorted({s.src for b in tp.buckets for s in b if s.dst == tp.offset + v})
        lines.append(f"rollout rank {v:4d} (group rank {tp.offset + v}): tp={g['tp']} dp={g['dp']} | receives "
                     f"{tp.received(v) * itemsize / 2**20:.2f} MiB = its generation shard "
                     f"({tp.shard_elems(v)} elements) from trainer ranks {sources}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    files = [a for a in argv if a.endswith((".yaml", ".yml"))]
    cfg = load_config(files, [a for a in argv if a not in files])
    prepared = prepare(cfg)
    if dry_run:
        print(plan(prepared))
        return 0
    history = run(prepared)
    if history:
        first, last = history[: max(1, len(history) // 10)], history[-max(1, len(history) // 10):]
        mean = lambda rows: sum(r["reward/mean"] for r in rows) / len(rows)
        print(json.dumps({"steps": len(history), "reward_first_10pct": round(mean(first), 4),
                          "reward_last_10pct": round(mean(last), 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
