"""``megarl train``'s run before any process starts: the config resolved (absolute paths, the
defaults that follow ``model.path``), every check of a whole run's config, each next to the
part it is about, and the prompts loaded and checked. Everything a user can get wrong fails
here, with exit 2: layouts, the rollout layout against the actor's, batch sizes against data
parallelism, datasets and their keys, the reward function, the tokenizer against the model."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megarl.agent.envs import env_factory
from megarl.agent.loop import Agent
from megarl.agent.validate import check_agent
from megarl.algorithms.correction import check_rollout_correction
from megarl.algorithms.presets import preset, resolve
from megarl.checkpoint.load import (
    check_pretrained, check_pretrained_sources, locate, newest_checkpoint, resolve_model_config,
)
from megarl.config import ConfigError, MegarlConfig, validate
from megarl.config.schema import REWARD_MODEL, LoRAConfig, Loop, LoraSync, Placement, WeightSync
from megarl.controller.cluster import check_cluster
from megarl.controller.roles import check_role_layouts
from megarl.controller.split import check_placement
from megarl.data.datasets import load_records
from megarl.data.tokenizer import check_vocab, load_tokenizer
from megarl.hybrid import regroup
from megarl.models import lora, routing_replay
from megarl.models.builder import check_layout
from megarl.models.hf_config import UnsupportedModelError, megatron_args_from_hf
from megarl.parallel import Layout
from megarl.rollout.backends import rollout_backend
from megarl.tasks.registry import builtin_records
from megarl.trainer.logger import check_logging
from megarl.trainer.resume import check_resume
from megarl.trainer.steps import PromptStream, Scorer, check_batch_split, check_prompt_tokens

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    cfg: MegarlConfig
    layout: Layout
    stream: PromptStream
    scorer: Scorer
    tokenizer: Any
    agent: Optional[Agent] = None  # multi-turn episodes (rollout.env), else None
    val_stream: Optional[PromptStream] = None  # the held-out prompts (data.val_files), else None


def world_size(cfg: MegarlConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.nproc_per_node


def prepare(cfg: MegarlConfig) -> Prepared:
    """Validate the whole configuration and load the data (no process started)."""
    validate(cfg)  # a config built in code; load_config checks those it composes
    cfg = resolve_paths(cfg)
    check_cluster(cfg.trainer)
    layout = Layout.from_config(cfg.parallel.actor, world_size(cfg))
    args = megatron_args_from_hf(cfg.model.hf_config)
    check_layout(args, layout, cfg.model)
    r = cfg.parallel.rollout
    if cfg.trainer.placement != Placement.split:  # colocated: the generation layout is regrouped from the actor's
        try:
            regroup(layout, r.tp, r.pp, r.ep, args.num_experts or 0)
        except ValueError as err:
            raise ConfigError(f"parallel.rollout: {err}") from None
    check_role_layouts(cfg.parallel, layout)
    check_placement(cfg, args)
    check_weight_sync(cfg)
    cfg.model.lora = check_lora(cfg, args)
    try:  # the algorithm's preset fills its defaults; every algorithm field is checked there
        cfg.algorithm = resolve(cfg.algorithm)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    algo, data = cfg.algorithm, cfg.data
    if preset(algo).prm:
        check_prime(cfg)
    if cfg.reward_model.generative:
        check_judge(cfg, layout)
    if cfg.trainer.critic_warmup_steps and not preset(algo).critic:
        raise ConfigError(f"trainer.critic_warmup_steps={cfg.trainer.critic_warmup_steps} warms up a critic; "
                          f"algorithm.name={algo.name} has none (use ppo or vapo, or set it to 0)")
    changed = check_resume(cfg)  # a resume under another config: refused by name, or listed
    if changed:
        log.warning(changed)
        print(f"megarl: warning: {changed}", file=sys.stderr, flush=True)
    try:
        check_rollout_correction(algo.rollout_correction, algo.rollout_correction_threshold,
                                 algo.rollout_correction_threshold_low)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    backend = rollout_backend(r.engine)
    backend.check(cfg)  # engine, dtype and the other choices are checked by validate()
    if args.config_kwargs.get("window_size") and not backend.sliding_window:
        raise ConfigError(f"parallel.rollout.engine={r.engine} with a sliding-window model (model.hf_config's "
                          f"sliding_window, window_size={args.config_kwargs['window_size']}): that engine's "
                          f"handling of the window is unverified; use parallel.rollout.engine=native")
    if args.config_kwargs.get("experimental_attention_variant") == "gated_delta_net" and not backend.gated_delta_net:
        raise ConfigError(f"parallel.rollout.engine={r.engine} with a gated delta net model ({args.model_type}): that "
                          f"engine's delta-net loader and kernels are unverified against megarl's weight sync; use "
                          f"parallel.rollout.engine=native")
    if backend.hf_weight_names:
        from megarl.hybrid.hf_names import HFNames

        try:  # a model the HF-named weight sync cannot take (gpt_oss's stacked experts), before Ray starts
            HFNames(args, cfg.model.make_vocab_size_divisible_by)
        except UnsupportedModelError as err:
            raise ConfigError(f"parallel.rollout.engine={r.engine}: {err}") from None
    check_logging(cfg.logging)
    check_batch_split(data, algo, layout.dp)
    if algo.routing_replay:
        routing_replay.check_config(backend.records_routing, args.num_experts, cfg.model.recompute_granularity)
    check_pretrained_sources(cfg)
    tokenizer = load_tokenizer(data.tokenizer, data.chat_template, system_prompt=data.system_prompt,
                               template_kwargs=data.chat_template_kwargs, template_path=data.chat_template_path)
    rm_vocab = None
    # the reward model scores the policy's token ids (and PRIME's PRM from reward_model.path reads them)
    # (a generative judge reads text through its own tokenizer)
    if (algo.reward_fn == REWARD_MODEL and not cfg.reward_model.generative) or (preset(algo).prm and cfg.reward_model.path):
        rm_vocab = megatron_args_from_hf(cfg.reward_model.hf_config or cfg.model.hf_config).vocab_size
    check_vocab(tokenizer.vocab_size, args.vocab_size, rm_vocab)
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
    if room < 1:
        budget = "the episode budget of" if agent else "algorithm.max_new_tokens="
        raise ConfigError(f"{budget}{response_room} response tokens leave no room for a prompt in the model's "
                          f"{args.max_position_embeddings} positions: lower algorithm.max_new_tokens")
    stream = prompt_stream(records, tokenizer, cfg, room)
    check_prompt_tokens(stream, args.vocab_size, data.bad_rows if data.train_files else None)
    if cfg.trainer.total_epochs:  # after the rows skipped (bad or too long) are gone
        # a step draws prompts_per_step prompts, oversample_factor x as many under the accuracy filter
        drawn = math.ceil(data.prompts_per_step * (algo.oversample_factor if algo.filter_accuracy else 1.0))
        cfg.trainer.train_steps = -(-cfg.trainer.total_epochs * len(stream.records) // drawn)
        print(f"megarl: trainer.total_epochs={cfg.trainer.total_epochs} over {len(stream.records)} prompts, "
              f"{drawn} a step: trainer.train_steps={cfg.trainer.train_steps}", flush=True)
    val_stream = validation_stream(cfg, tokenizer, args, agent)
    return Prepared(cfg, layout, stream, Scorer(algo, tokenizer, cfg.reward_model), tokenizer, agent,
                    val_stream)


def check_prime(cfg: MegarlConfig) -> None:
    """algorithm.name=prime: its implicit PRM is a full causal LM in the actor's layout, trained with
    the verifier's outcome (the reward_model section is its own)."""
    algo, rm = cfg.algorithm, cfg.reward_model
    if algo.reward_fn == REWARD_MODEL:
        raise ConfigError("algorithm.name=prime with algorithm.reward_fn=model: PRIME's outcome is a verifier's "
                          "and reward_model.path is its implicit PRM; use a reward function")
    if rm.checkpoint:
        raise ConfigError("algorithm.name=prime starts its implicit PRM from the policy or reward_model.path (an HF "
                          "causal LM); reward_model.checkpoint is a scalar-head reward model's: unset it")
    if cfg.model.lora.rank:
        raise ConfigError("algorithm.name=prime with model.lora.rank > 0: the implicit PRM is trained in full "
                          "beside the adapters' base; set model.lora.rank=0")
    if rm.path:  # files, names, shapes and dtypes before any worker starts, named
        check_pretrained(rm.path, dataclasses.replace(cfg.model, path=rm.path, hf_config=rm.hf_config),
                         "reward_model.path")


def check_judge(cfg: MegarlConfig, layout: Layout) -> None:
    """reward_model.generative: an HF causal LM at reward_model.path, on the training ranks in the
    generation layout, its engine's own checks, the template's fields and the parser, before any
    worker starts."""
    from megarl.rewards.judge import check_template, compile_parser, is_function, judge_hf_config
    from megarl.rewards.registry import reward_fn_path

    algo, rm, r, t = cfg.algorithm, cfg.reward_model, cfg.parallel.rollout, cfg.trainer
    if not rm.path:
        raise ConfigError("reward_model.generative needs reward_model.path: the judge's HF causal LM directory "
                          "(config, weights and its tokenizer)")
    if rm.checkpoint:
        raise ConfigError("reward_model.generative reads an HF causal LM at reward_model.path; reward_model.checkpoint "
                          "is a scalar-head reward model's: unset it")
    if preset(algo).prm:
        raise ConfigError("reward_model.generative with algorithm.name=prime: reward_model.path is PRIME's implicit "
                          "PRM; a judge and an implicit PRM cannot share it")
    if t.placement == Placement.split or t.loop != Loop.sync:
        raise ConfigError(f"reward_model.generative with trainer.placement={t.placement}, trainer.loop={t.loop}: the "
                          f"judge runs on the training ranks between generation and training (colocated, "
                          f"synchronous loop); its own ranks are not supported yet")
    if algo.reward_fn != REWARD_MODEL and REWARD_MODEL not in algo.reward_fn_by_source.values() \
            and rm.rule_weight is None:
        raise ConfigError(f"reward_model.generative with algorithm.reward_fn={algo.reward_fn}: no row would be judged; "
                          f"set algorithm.reward_fn=model (the judge alone), map data sources to model in "
                          f"algorithm.reward_fn_by_source, or set reward_model.rule_weight (rule + judge)")
    if algo.reward_fn == REWARD_MODEL and not algo.reward_fn_by_source and rm.rule_weight is not None:
        raise ConfigError("reward_model.rule_weight sums a rule's reward with the judge's, but algorithm.reward_fn=model "
                          "scores with the judge alone: set algorithm.reward_fn to a rule or unset reward_model.rule_weight")
    try:
        check_template(rm.template)
        if is_function(rm.parser):
            reward_fn_path(rm.parser)
        else:
            compile_parser(rm.parser)
    except ValueError as err:
        raise ConfigError(str(err).replace("algorithm.reward_fn", "reward_model.parser")) from None
    judge_model = dataclasses.replace(cfg.model, path=rm.path, hf_config=judge_hf_config(rm), lora=LoRAConfig())
    check_pretrained(rm.path, judge_model, "reward_model.path")
    try:
        args = megatron_args_from_hf(judge_model.hf_config)
    except UnsupportedModelError as err:
        raise ConfigError(f"reward_model.path: {err}") from None
    check_layout(args, layout, judge_model)
    try:
        regroup(layout, r.tp, r.pp, r.ep if args.num_experts else 1, args.num_experts or 0)
    except ValueError as err:
        raise ConfigError(f"reward_model.generative in parallel.rollout's layout: {err}") from None
    engine = rm.engine or r.engine
    judge_cfg = dataclasses.replace(cfg, model=judge_model, algorithm=dataclasses.replace(algo, top_p=1.0, top_k=0),
                                    parallel=dataclasses.replace(cfg.parallel, rollout=dataclasses.replace(r, engine=engine)))
    backend = rollout_backend(engine)
    try:
        backend.check(judge_cfg)
        backend.check_available(judge_cfg)
    except ConfigError as err:
        raise ConfigError(f"reward_model.engine={engine}: {err}") from None


def validation_stream(cfg: MegarlConfig, tokenizer, args, agent) -> Optional[PromptStream]:
    """data.val_files' prompts, checked as the training prompts are (every row, before any worker
    starts), within the room of validation's own response budget; None without val_files."""
    data, algo, t = cfg.data, cfg.algorithm, cfg.trainer
    if not data.val_files:
        if t.val_interval:
            raise ConfigError(f"trainer.val_interval={t.val_interval} needs data.val_files (held-out prompts)")
        return None
    if agent is not None:
        raise ConfigError("data.val_files with rollout.env: validation of multi-turn episodes is not supported yet; "
                          "leave data.val_files empty")
    if t.loop == Loop.one_step_off and t.placement == Placement.split and algo.reward_fn == REWARD_MODEL:
        raise ConfigError("data.val_files with algorithm.reward_fn=model, trainer.placement=split and "
                          "trainer.loop=one_step_off: the reward model's ranks serve the drawing thread; validate with "
                          "the synchronous loop or colocated placement, or score validation with megarl eval")
    records = load_records(data.val_files, data.prompt_key, data.answer_key, data.bad_rows, "data.val_files")
    room = args.max_position_embeddings - (algo.val_max_new_tokens or algo.max_new_tokens)
    stream = prompt_stream(records, tokenizer, cfg, room)
    check_prompt_tokens(stream, args.vocab_size, data.bad_rows)
    return stream


def prompt_stream(records, tokenizer, cfg: MegarlConfig, room: int) -> PromptStream:
    """The prompts' stream with data.max_prompt_length (at most the model's ``room``) and data.truncation."""
    data = cfg.data
    limit = data.max_prompt_length
    if limit is None:
        return PromptStream(records, tokenizer, cfg.trainer.seed, room, data.truncation, shuffle=data.shuffle)
    if not 1 <= limit <= room:
        raise ConfigError(f"data.max_prompt_length={limit} must be in [1, {room}]: the model's positions less "
                          f"algorithm.max_new_tokens leave {room} prompt tokens")
    return PromptStream(records, tokenizer, cfg.trainer.seed, limit, data.truncation,
                        limit=f"data.max_prompt_length={limit}", shuffle=data.shuffle)


def check_weight_sync(cfg: MegarlConfig) -> None:
    """parallel.rollout.weight_sync=delta needs transports that keep the shards between syncs."""
    r = cfg.parallel.rollout
    if r.weight_sync == WeightSync.delta and not rollout_backend(r.engine).delta_sync:
        raise ConfigError(f"parallel.rollout.weight_sync=delta: engine={r.engine} takes whole tensors each sync "
                          f"(nothing to apply a delta to); use parallel.rollout.weight_sync=full or "
                          f"parallel.rollout.engine=native or vllm")


def check_lora(cfg: MegarlConfig, args):
    """``model.lora`` checked against the model and the rollout, with rank, alpha and targets
    filled from its PEFT ``path``; returned as the run uses it."""
    m = cfg.model
    try:
        lora_cfg = lora.resolve(m.lora)
        if not lora_cfg.rank:
            return lora_cfg
        lora.check_targets(lora_cfg, args)
    except lora.LoRAError as err:
        raise ConfigError(str(err)) from None
    if not m.path:
        raise ConfigError("model.lora.rank > 0 trains adapters on a pretrained base: set model.path (an HF "
                          "directory or a Megatron checkpoint); the checkpoints then hold the adapters and point to it")
    r = cfg.parallel.rollout
    if r.lora_sync == LoraSync.adapter:
        if not rollout_backend(r.engine).serves_lora:
            raise ConfigError(f"parallel.rollout.lora_sync=adapter: engine={r.engine} does not serve LoRA adapters; "
                              f"use parallel.rollout.engine=vllm, or parallel.rollout.lora_sync=merged")
        if cfg.trainer.placement == Placement.split:
            raise ConfigError("parallel.rollout.lora_sync=adapter with trainer.placement=split is not built yet (the "
                              "adapters reach the engine from the training ranks it shares); use colocated "
                              "placement or parallel.rollout.lora_sync=merged")
        if lora_cfg.modules_to_save:
            raise ConfigError(f"parallel.rollout.lora_sync=adapter with model.lora.modules_to_save="
                              f"{list(lora_cfg.modules_to_save)}: the engine serves adapters on a fixed base; use "
                              f"parallel.rollout.lora_sync=merged")
    return lora_cfg


def resolve_paths(cfg: MegarlConfig) -> MegarlConfig:
    """A copy of ``cfg`` with every path absolute (the config snapshot saved with checkpoints works
    from any directory: ``megarl export-hf`` reads it) and the defaults that follow ``model.path``
    and ``reward_model.path`` filled in: the model config and the tokenizer."""
    cfg = copy.deepcopy(cfg)
    m, data, rm = cfg.model, cfg.data, cfg.reward_model

    def absolute(path: Optional[str]) -> Optional[str]:
        return str(Path(path).expanduser().absolute()) if path else path

    m.lora.path = absolute(m.lora.path)
    m.path, m.hf_config, rm.path, rm.hf_config, rm.checkpoint, data.tokenizer = map(
        absolute, (m.path, m.hf_config, rm.path, rm.hf_config, rm.checkpoint, data.tokenizer))
    data.train_files = [absolute(f) for f in data.train_files]
    cfg.trainer.run_dir = absolute(cfg.trainer.run_dir)
    if m.path:
        m.path = newest_checkpoint(m.path)  # a run directory (megarl train's, megarl sft's): its newest
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
