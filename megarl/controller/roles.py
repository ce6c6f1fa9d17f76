"""A run's worker groups and the roles the loop drives, wired for the placement: the trainer's
group (actor, reference, critic, reward model; the rollout too when colocated) and, with split
placement, the rollout's own group joined to it by the backend's weight transport."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, List, Optional

from megarl.config.schema import Placement
from megarl.rollout.backends import rollout_backend


@dataclass
class Roles:
    """The roles of one run, as the loop calls them (megarl.trainer.loop)."""

    actor: Any
    rollout: Any
    reference: Optional[Any] = None
    critic: Optional[Any] = None
    reward_model: Optional[Any] = None  # scores for the Scorer (algorithm.reward_fn=model)
    prm: Optional[Any] = None  # PRIME's implicit process reward model
    judge: Optional[Any] = None  # a generative reward model's engine (reward_model.generative)


def rollout_ranks(cfg) -> int:
    """The rollout's own ranks: parallel.rollout.nproc with split placement, else none."""
    return cfg.parallel.rollout.nproc if cfg.trainer.placement == Placement.split else 0


def start_groups(cfg, session) -> List:
    """Start the trainer's worker group and (split placement) the rollout's, on the Ray of
    ``session`` (megarl.controller.cluster.RaySession); every group started is shut down when a
    later one fails."""
    import ray

    from megarl.controller.group import WorkerGroup, gpu_assignment
    from megarl.controller.rl_worker import RLWorker

    world = cfg.trainer.nnodes * cfg.trainer.nproc_per_node
    extra = rollout_ranks(cfg)
    gpus, why = gpu_assignment(ray.cluster_resources().get("GPU", 0), world + extra, cfg.parallel.rollout.engine)
    print(f"megarl: {why}", file=sys.stderr, flush=True)
    env = {**session.worker_env, **rollout_backend(cfg.parallel.rollout.engine).worker_env()}
    if cfg.reward_model.generative:  # the judge's engine runs on the same workers
        env |= rollout_backend(cfg.reward_model.engine or cfg.parallel.rollout.engine).worker_env()
    groups: List = []
    try:
        groups.append(WorkerGroup(RLWorker, world, cfg, cpus_per_worker=1, gpus_per_worker=gpus, env=env,
                                  nnodes=cfg.trainer.nnodes, liveness=session.liveness))
        if extra:  # the rollout's own ranks, its own torch.distributed world
            from megarl.controller.rollout_worker import RolloutWorker

            groups.append(WorkerGroup(RolloutWorker, extra, cfg, cpus_per_worker=1, gpus_per_worker=gpus,
                                      env=env, name="rollout", liveness=session.liveness))
    except BaseException:
        for g in groups:
            g.shutdown()
        raise
    print(f"megarl: workers (rank: pid@node) {groups[0].describe()}", file=sys.stderr, flush=True)
    if extra:
        print(f"megarl: rollout workers (rank: pid@node) {groups[1].describe()}", file=sys.stderr, flush=True)
    return groups


def build_roles(group, rollout_group=None) -> Roles:
    """The roles the trainer's ``group`` built for this algorithm, with their verbs; with a
    ``rollout_group`` (split placement) the rollout is that group's, synced from ``group``."""
    proxies = group.roles()
    if rollout_group is not None:
        from megarl.controller.split import SplitRollout

        rollout = SplitRollout(group, rollout_group, rollout_group.roles()["rollout"])
    else:
        rollout = proxies["rollout"]
    return Roles(actor=proxies["actor"], rollout=rollout, reference=proxies.get("reference"),
                 critic=proxies.get("critic"), reward_model=proxies.get("reward_model"), prm=proxies.get("prm"),
                 judge=proxies.get("judge"))


def check_role_layouts(parallel, layout) -> None:
    """The trained roles share the trainer's ranks and the actor's layout (one Megatron layout per
    process): ``parallel.critic`` and ``parallel.reference`` unset or equal to ``parallel.actor``."""
    from megarl.config import ConfigError, ParallelConfig

    for role in ("critic", "reference"):
        if getattr(parallel, role) not in (ParallelConfig(), parallel.actor):
            raise ConfigError(f"parallel.{role} differs from parallel.actor: the {role} runs on the trainer's ranks in "
                              f"the actor's layout {layout} (one Megatron layout per process); leave parallel.{role} "
                              f"unset or equal to parallel.actor")
