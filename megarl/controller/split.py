"""Split placement on the driver: the rollout's worker group beside the trainer's, and the
rollout role as the loop sees it there (:class:`SplitRollout`).

The loop calls the same verbs as under colocated placement; here ``update_weights`` is one
collective over both groups (the training ranks send, the rollout ranks receive), and
``release_memory``/``resume_memory`` have nothing to do: the rollout keeps its own devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

from megarl.config import ConfigError
from megarl.config.schema import REWARD_MODEL, Loop, Placement, RolloutCorrection
from megarl.rollout.backends import rollout_layout, transfer_plan

if TYPE_CHECKING:  # Ray's worker groups: imported where a split run starts them, so that
    # check_placement (megarl.controller.prepare) runs without Ray (benchmarks/gpu/check_loop.py)
    from megarl.controller.group import RoleProxy, WorkerGroup

class SplitRollout:
    """The rollout role of split placement: generation on the rollout's group, weight syncs
    from the trainer's group to it."""

    def __init__(self, trainer: WorkerGroup, rollout: WorkerGroup, proxy: RoleProxy):
        from megarl.controller.group import wait_groups

        self.trainer, self.rollout, self.proxy = trainer, rollout, proxy
        address, port = trainer.call_one("rendezvous")  # the spanning group's store: trainer rank 0
        wait_groups([(trainer, trainer.submit("connect_weights", address, port)),
                     (rollout, rollout.submit("connect_weights", address, port))])

    def generate(self, prompts, sampling):
        return self.proxy.generate(prompts, sampling)

    def begin(self, prompts, sampling):
        return self.proxy.begin(prompts, sampling)

    def admit(self, prompts, sampling, first_index):
        return self.proxy.admit(prompts, sampling, first_index)

    def advance(self, max_tokens=None):
        return self.proxy.advance(max_tokens)

    def release_memory(self) -> None:
        """Nothing to give back: training runs on other ranks."""

    def resume_memory(self) -> None:
        """Nothing to take back (see :meth:`release_memory`)."""

    def update_weights(self, policy_version: int) -> Dict[str, float]:
        """One sync (both groups at once). Besides the rollout's own metrics:
        ``sync/bytes_sent_max`` (over training ranks) and ``sync/bytes_over_shard_max``, the
        largest difference, over rollout ranks, between what a rank received and its
        generation shard (0: each received exactly its shard); ``sync/peak_extra_mb`` and
        ``sync/delta_copy_mb`` over both groups' ranks."""
        from megarl.controller.group import wait_groups

        sent, received = wait_groups([(self.trainer, self.trainer.submit("publish_weights")),
                                      (self.rollout, self.rollout.submit("call", "rollout", "update_weights",
                                                                         policy_version))])
        metrics = dict(received[0])
        pairs = self.rollout.call("sync_bytes")
        if all(pair is not None for pair in pairs):  # shards point to point (native engine)
            metrics["sync/bytes_over_shard_max"] = max(abs(got - shard) for got, shard in pairs)
        metrics["sync/bytes_sent_max"] = max(n for n, _, _ in sent)
        metrics["sync/peak_extra_mb"] = max([metrics.get("sync/peak_extra_mb", 0.0)]
                                            + [peak / 2**20 for _, peak, _ in sent])
        metrics["sync/delta_copy_mb"] = max([metrics.get("sync/delta_copy_mb", 0.0)]
                                            + [copy / 2**20 for _, _, copy in sent])
        return metrics


def check_partial_rollout(cfg) -> None:
    """parallel.rollout.partial_rollout and recompute_kv_after_sync against the loop and engine."""
    from megarl.rollout.backends import rollout_backend

    t, r = cfg.trainer, cfg.parallel.rollout
    if r.recompute_kv_after_sync and not r.partial_rollout:
        raise ConfigError("parallel.rollout.recompute_kv_after_sync=true applies to partial rollouts: set "
                          "parallel.rollout.partial_rollout=true, or leave it false")
    if not r.partial_rollout:
        return
    if t.placement != Placement.split or t.loop not in (Loop.one_step_off, Loop.async_):
        raise ConfigError(f"parallel.rollout.partial_rollout=true interrupts generation for weight syncs that "
                          f"run beside it: set trainer.placement=split and trainer.loop=one_step_off or async (got "
                          f"{t.placement.value}, {t.loop.value})")
    if not rollout_backend(r.engine).partial_rollout:
        raise ConfigError(f"parallel.rollout.partial_rollout=true: engine={r.engine.value} does not pause for a "
                          f"weight sync here yet; use parallel.rollout.engine=native")


def check_streaming(cfg) -> None:
    """trainer.loop=async (sample-level streaming) and its keys against the rest of the config."""
    from megarl.algorithms.presets import preset
    from megarl.config.schema import StalenessPolicy
    from megarl.rollout.backends import rollout_backend

    t, r, algo = cfg.trainer, cfg.parallel.rollout, cfg.algorithm
    if t.loop != Loop.async_:
        if t.staleness_policy != StalenessPolicy.wait:
            raise ConfigError(f"trainer.staleness_policy={t.staleness_policy.value} applies to sample-level "
                              f"streaming: set trainer.loop=async (batch loops wait for their batch)")
        if r.max_inflight:
            raise ConfigError(f"parallel.rollout.max_inflight={r.max_inflight} applies to trainer.loop=async")
        return
    if t.placement != Placement.split:
        raise ConfigError("trainer.loop=async streams samples from the rollout's own ranks while the trainer's "
                          "train: set trainer.placement=split and parallel.rollout.nproc")
    if not rollout_backend(r.engine).sample_streaming:
        raise ConfigError(f"trainer.loop=async: engine={r.engine.value} does not take requests into a rollout in "
                          f"flight here yet; use parallel.rollout.engine=native or vllm")
    if cfg.rollout.env:
        raise ConfigError("trainer.loop=async streams single-turn samples; multi-turn episodes (rollout.env) run "
                          "with trainer.loop=sync or one_step_off")
    if preset(algo).greedy_baseline:
        raise ConfigError(f"algorithm.name={algo.name}: its greedy baseline is drawn per batch; use trainer.loop="
                          f"sync or one_step_off")
    group = algo.samples_per_prompt
    if r.max_inflight and r.max_inflight < group:
        raise ConfigError(f"parallel.rollout.max_inflight={r.max_inflight} cannot hold one group of "
                          f"algorithm.samples_per_prompt={group} samples: raise it to at least {group}")


def check_placement(cfg, args) -> None:
    """trainer.placement, parallel.rollout.nproc, trainer.loop and trainer.max_staleness together."""
    t, r, algo = cfg.trainer, cfg.parallel.rollout, cfg.algorithm
    check_partial_rollout(cfg)
    check_streaming(cfg)
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
    if t.max_staleness and t.loop == Loop.sync:
        raise ConfigError(f"trainer.max_staleness={t.max_staleness} needs trainer.loop=one_step_off or async (an "
                          f"asynchronous loop)")
    if t.max_staleness > 1 and algo.rollout_correction == RolloutCorrection.none:
        raise ConfigError(f"trainer.max_staleness={t.max_staleness}: samples up to {t.max_staleness} versions old "
                          f"need importance weights; set algorithm.rollout_correction (e.g. token_tis)")
    if t.loop != Loop.sync and algo.reward_fn == REWARD_MODEL:
        raise ConfigError(f"algorithm.reward_fn=model with trainer.placement=split and trainer.loop={t.loop.value}: the "
                          "reward model runs on the trainer's ranks, which are training while the next batch is "
                          "scored; use trainer.loop=sync or a reward function")
    try:
        transfer_plan(cfg, args)
    except ValueError as err:
        raise ConfigError(f"parallel.rollout (split placement, layout {rollout_layout(cfg)}): {err}") from None
