"""Split placement on the driver: the rollout's worker group beside the trainer's, and the
rollout role as the loop sees it there (:class:`SplitRollout`).

The loop calls the same verbs as under colocated placement; here ``update_weights`` is one
collective over both groups (the training ranks send, the rollout ranks receive), and
``release_memory``/``resume_memory`` have nothing to do: the rollout keeps its own devices.
"""

from __future__ import annotations

from typing import Dict

from megarl.controller.group import RoleProxy, WorkerGroup, wait_groups

class SplitRollout:
    """The rollout role of split placement: generation on the rollout's group, weight syncs
    from the trainer's group to it."""

    def __init__(self, trainer: WorkerGroup, rollout: WorkerGroup, proxy: RoleProxy):
        self.trainer, self.rollout, self.proxy = trainer, rollout, proxy
        address, port = trainer.call_one("rendezvous")  # the spanning group's store: trainer rank 0
        wait_groups([(trainer, trainer.submit("connect_weights", address, port)),
                     (rollout, rollout.submit("connect_weights", address, port))])

    def generate(self, prompts, sampling):
        return self.proxy.generate(prompts, sampling)

    def release_memory(self) -> None:
        """Nothing to give back: training runs on other ranks."""

    def resume_memory(self) -> None:
        """Nothing to take back (see :meth:`release_memory`)."""

    def update_weights(self, policy_version: int) -> Dict[str, float]:
        """One sync (both groups at once). Besides the rollout's own metrics:
        ``sync/bytes_sent_max`` (over training ranks) and ``sync/bytes_over_shard_max``, the
        largest difference, over rollout ranks, between what a rank received and its
        generation shard (0: each received exactly its shard)."""
        sent, received = wait_groups([(self.trainer, self.trainer.submit("publish_weights")),
                                      (self.rollout, self.rollout.submit("call", "rollout", "update_weights",
                                                                         policy_version))])
        metrics = dict(received[0])
        pairs = self.rollout.call("sync_bytes")
        if all(pair is not None for pair in pairs):  # shards point to point (native engine)
            metrics["sync/bytes_over_shard_max"] = max(abs(got - shard) for got, shard in pairs)
        metrics["sync/bytes_sent_max"] = max(sent)
        return metrics
