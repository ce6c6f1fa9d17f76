"""Worker groups: one Ray actor per rank, all ranks one ``torch.distributed`` world.

A group dispatches a :class:`Batch` by data-parallel rank (every TP/PP rank of one DP index gets
the same chunk) and collects results from tensor-parallel rank 0 of the last pipeline stage. A
:class:`RoleProxy` is a role as the driver sees it: the verbs its class declares
(megarl.protocol), each dispatched as declared.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, RayTaskError, WorkerCrashedError

from megarl.config import ConfigError
from megarl.config.schema import Engine
from megarl.protocol import Batch, Columns, Dispatch, Verb
from megarl.rollout.backends import rollout_backend
from megarl.runtime.progress import describe_stall
from megarl.runtime.processes import WorkerDied, WorkerHung, forks_die_with_this_process

_DEATHS = (ActorDiedError, ActorUnavailableError, WorkerCrashedError, NodeDiedError)
# how often the driver wakes while waiting on the ranks: a failure is acted on at most this late
POLL_S = 1.0
# how long a survivor's error waits for news of a dead peer: Ray reports a dead process within
# ~1 s, a lost node once the GCS's health checks of its raylet have failed (5 x 3 s by default).
# The wait ends early once every rank has answered, so only a run with a silent rank pays it.
DEATH_NOTICE_S = 5.0
NODE_DEATH_NOTICE_S = 30.0
# how long a multi-node run waits for its nodes' slots (Ray's autoscaler may be adding nodes)
PLACEMENT_WAIT_S = 120.0


def _where(start_heartbeat=None) -> tuple:
    """(node IP, PID, Ray node ID) of the calling worker; its later forks die with it (no orphaned
    writers), and its heartbeat starts (when the run checks for hangs). Several nodes may share an
    IP (containers, a test cluster): the node ID tells them apart."""
    forks_die_with_this_process()
    if start_heartbeat is not None:
        start_heartbeat()
    return ray.util.get_node_ip_address(), os.getpid(), ray.get_runtime_context().get_node_id()


def _postmortem(pid: int, node_ip: str, node_id: str) -> str:
    """What the dead worker's machine recorded of its death (:mod:`megarl.runtime.postmortem`),
    read when that machine is the driver's."""
    from megarl.runtime import postmortem

    try:
        here = ray.get_runtime_context().get_node_id()
        node = ray._private.worker.global_worker.node
        logs_dir = node.get_logs_dir_path() if node_id == here else None
        same_machine = node_id == here or node_ip == ray.util.get_node_ip_address()
        return postmortem.explain(pid, logs_dir, same_machine)
    except Exception as err:  # noqa: BLE001 - Ray is going away: the error names the rank without it
        return f"(its logs could not be read: {type(err).__name__})"


def _node_placement(world_size: int, nnodes: int, cpus: float, gpus: float):
    """A placement group with one bundle per node (STRICT_SPREAD: each on a different node) holding
    that node's ``world_size // nnodes`` ranks, so that rank r runs on node r // nproc_per_node, as
    LOCAL_RANK, the plan and the layouts (TP innermost, within a node) assume. Raises ConfigError,
    naming the nodes Ray has, when the cluster cannot hold them."""
    from ray.util.placement_group import placement_group, remove_placement_group

    per_node = world_size // nnodes
    bundle = {"CPU": cpus * per_node, **({"GPU": gpus * per_node} if gpus else {})}
    group = placement_group([bundle] * nnodes, strategy="STRICT_SPREAD")
    if not group.wait(timeout_seconds=PLACEMENT_WAIT_S):
        remove_placement_group(group)
        nodes = "; ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]}): "
                          f"{ {k: v for k, v in n['Resources'].items() if k in ('CPU', 'GPU')} }"
                          for n in ray.nodes() if n["Alive"])
        raise ConfigError(f"trainer.nnodes={nnodes}, trainer.nproc_per_node={per_node}: the Ray cluster has no "
                          f"{nnodes} nodes with {bundle} free each after {PLACEMENT_WAIT_S:.0f}s; alive nodes: {nodes}")
    return group


def gpu_assignment(cluster_gpus: float, ranks: int, engine: Engine = Engine.native) -> Tuple[int, str]:
    """GPUs each of a run's ``ranks`` workers (trainer and rollout together) asks Ray for, and why,
    from the Ray cluster's GPUs (``ray.cluster_resources()``), not the driver's: a GPU-less head node
    still gives the workers on its GPU nodes one each. One GPU per rank: two ranks of one NCCL
    communicator cannot share a GPU (NCCL's "Duplicate GPU detected"), and split placement's
    weights group spans trainer and rollout ranks. Raises ConfigError when the cluster has GPUs but
    fewer than ``ranks``, or none for a GPU-only ``engine`` (sglang)."""
    if not cluster_gpus:
        if rollout_backend(engine).needs_gpus:
            raise ConfigError(f"parallel.rollout.engine={engine} needs GPUs and the Ray cluster has none; "
                              f"use parallel.rollout.engine=native or a cluster with GPU nodes")
        return 0, "the Ray cluster has no GPUs: workers on CPU (gloo)"
    if cluster_gpus < ranks:
        raise ConfigError(f"{ranks} ranks (trainer and rollout) need a GPU each and the Ray cluster has "
                          f"{cluster_gpus:g}; lower trainer.nproc_per_node or parallel.rollout.nproc "
                          f"(split placement needs trainer + rollout GPUs; colocated shares them), or hide "
                          f"the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU")
    return 1, f"the Ray cluster has {cluster_gpus:g} GPUs: one per rank ({ranks} ranks)"


def rendezvous_address(local: bool):
    """(address, free port) on this node: loopback when the whole run is on one machine."""
    address = "127.0.0.1" if local else ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((address, 0))
        return address, s.getsockname()[1]


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls`` forming one process group."""

    def __init__(self, worker_cls, world_size: int, config, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 env: Optional[Dict[str, str]] = None, nnodes: int = 1, name: str = "", liveness=None):
        """``name`` prefixes the ranks named in errors (``rollout rank 1``) when a run has several
        groups. ``liveness`` (:class:`~megarl.controller.monitor.Liveness`): every wait on the ranks
        names one that makes no progress for its ``hang_timeout_s``; None: waits without that check."""
        self.name = f"{name} " if name else ""
        self.liveness = liveness
        self.current_call = "start-up"  # the method the driver last started on the ranks
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(worker_cls)
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self.placement = None  # one node's ranks per bundle; None: on one node, where Ray likes
        self.death_notice_s = DEATH_NOTICE_S if nnodes == 1 else NODE_DEATH_NOTICE_S
        if nnodes > 1:
            self.placement = _node_placement(world_size, nnodes, cpus_per_worker, gpus_per_worker)

        def strategy(rank: int):
            if self.placement is None:
                return "DEFAULT"
            node = rank // (world_size // nnodes)
            return PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=node)

        self.workers = [
            remote.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, scheduling_strategy=strategy(rank),
                           runtime_env={"env_vars": env}).remote(rank, world_size, config)
            for rank in range(world_size)]
        self.where: List[tuple] = []  # (node IP, PID, node ID) per rank, to name a rank that fails
        beats = [liveness.heartbeat((name, rank)) if liveness else None for rank in range(world_size)]
        self.where = self._wait([w.__ray_call__.remote(lambda _, beat: _where(beat), beat)
                                 for w, beat in zip(self.workers, beats)])
        # Rank 0's node hosts the torch.distributed rendezvous (loopback when all is local).
        master_addr, port = self._wait([self.workers[0].rendezvous.remote()])[0]
        self.info: List[Dict[str, Any]] = self.call("setup", master_addr, port)

    def describe(self) -> str:
        return ", ".join(f"{rank}: pid {pid}@{node} (node {node_id[:8]})"
                         for rank, (node, pid, node_id) in enumerate(self.where))

    def _wait(self, futures: List[ray.ObjectRef]) -> List[Any]:
        return wait_groups([(self, futures)])[0]

    def submit(self, method: str, *args, **kwargs) -> List[ray.ObjectRef]:
        """Start ``method`` on every rank; :func:`wait_groups` (or :meth:`call`) collects it."""
        self.current_call = method
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def _rank(self, rank: int) -> str:
        node, pid, _ = self.where[rank] if rank < len(self.where) else ("?", "?", "?")
        return f"{self.name}rank {rank} (pid {pid} on node {node})"

    def _died(self, rank: int, err: Exception) -> None:
        node_ip, pid, node_id = self.where[rank] if rank < len(self.where) else ("?", None, "?")
        how = _postmortem(pid, node_ip, node_id) if pid is not None else ""
        raise WorkerDied(f"{self._rank(rank)} died (Ray node {node_id[:8]}): "
                         f"{type(err).__name__}: {str(err).strip().splitlines()[0]}" + (f"\n  {how}" if how else "")
                         ) from None

    @property
    def dp(self) -> int:
        return self.info[0]["dp"]

    def call(self, method: str, *args, **kwargs) -> List[Any]:
        """Run ``method`` on every rank (SPMD) and return every rank's result."""
        return self._wait(self.submit(method, *args, **kwargs))

    def call_first(self, method: str, *args, **kwargs) -> Any:
        """Run on every rank; return rank 0's result."""
        return self.call(method, *args, **kwargs)[0]

    def call_one(self, method: str, *args, **kwargs) -> Any:
        """Run on rank 0 alone; its result."""
        self.current_call = method
        return self._wait([getattr(self.workers[0], method).remote(*args, **kwargs)])[0]

    def call_dp(self, method: str, batch: Batch, *lead, **kwargs) -> Any:
        """Each rank runs ``method(*lead, chunk)`` with its DP index's chunk; results (Columns or
        dict) of the collecting ranks, in DP order: Columns concatenated, dicts from DP rank 0
        (already reduced)."""
        chunks = batch.chunk(self.dp)
        self.current_call = method
        futures = [getattr(w, method).remote(*lead, chunks[info["dp_rank"]], **kwargs)
                   for w, info in zip(self.workers, self.info)]
        results = self._wait(futures)
        collected = sorted(((info["dp_rank"], r) for info, r in zip(self.info, results) if info["collect"]),
                           key=lambda x: x[0])
        outputs = [r for _, r in collected]
        return Columns.concat(outputs) if isinstance(outputs[0], Columns) else outputs[0]

    def roles(self) -> Dict[str, "RoleProxy"]:
        """A proxy for each role the workers hold (``info["verbs"]``: role -> its declared verbs)."""
        return {name: RoleProxy(self, name, verbs) for name, verbs in self.info[0]["verbs"].items()}

    def shutdown(self) -> None:
        """Kill every rank (idempotent); a rank stuck in a collective does not delay it."""
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or Ray itself is going away
                pass
        self.workers = []
        if self.placement is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement)
            except Exception:  # noqa: BLE001 - Ray itself is going away: the group goes with it
                pass
            self.placement = None


def wait_groups(pending: Sequence[Tuple[WorkerGroup, List[ray.ObjectRef]]]) -> List[List[Any]]:
    """Each group's results, every rank's, failing on the first rank that fails in any group.
    ``ray.get`` of the whole list would wait for all ranks, and the survivors of a dead rank can
    hang in a collective until gloo's timeout; here the first error ends the wait. Groups joined in
    one collective (split placement's weight sync) are waited on together for the same reason."""
    where = {}  # future -> (group index, rank)
    for g, (_, futures) in enumerate(pending):
        where.update({f: (g, rank) for rank, f in enumerate(futures)})
    results: Dict[tuple, Any] = {}
    left = [f for _, futures in pending for f in futures]
    notice = max(group.death_notice_s for group, _ in pending)
    liveness = next((group.liveness for group, _ in pending if group.liveness is not None), None)
    started = time.monotonic()

    def died(future, err):
        g, rank = where[future]
        pending[g][0]._died(rank, err)

    while left:
        ready, left = ray.wait(left, num_returns=len(left), timeout=POLL_S)
        failed = None
        for future in ready:
            try:
                results[where[future]] = ray.get(future)
            except _DEATHS as err:
                died(future, err)
            except RayTaskError as err:
                failed = failed or err
        if failed is not None:
            # a peer's death often surfaces first as a broken collective on a survivor: look
            # briefly for the death, the root cause, before reporting the survivor's error
            deadline = time.monotonic() + notice
            while left and time.monotonic() < deadline:
                late, left = ray.wait(left, num_returns=1, timeout=deadline - time.monotonic())
                for future in late:
                    try:
                        ray.get(future)
                    except _DEATHS as err:
                        died(future, err)
                    except RayTaskError:
                        pass
            raise failed
        if liveness is not None and left:
            _check_progress(liveness, pending, [where[f] for f in left], started)
    return [[results[(g, rank)] for rank in range(len(futures))] for g, (_, futures) in enumerate(pending)]


def _check_progress(liveness, pending, waiting: List[tuple], since: float) -> None:
    """Raise WorkerHung naming the first of the ``waiting`` (group index, rank) that has made no
    progress for the run's ``hang_timeout_s``."""
    keys = {(pending[g][0].name.strip(), rank): (g, rank) for g, rank in waiting}
    hung = liveness.stalled(list(keys), since)
    if hung is not None:
        key, seconds, phase, beat_age = hung
        g, rank = keys[key]
        group = pending[g][0]
        tail = describe_stall(seconds, phase or group.current_call, beat_age, liveness.period_s)
        raise WorkerHung(f"{group._rank(rank)} {tail}")


class RoleProxy:
    """A role as the loop sees it: ``proxy.update(batch)`` runs the role's declared verb on the
    group (each worker's ``call(role, verb, ...)``), dispatched as declared."""

    def __init__(self, group: WorkerGroup, role: str, verbs: Dict[str, Verb]):
        self._group, self._role, self._verbs = group, role, verbs

    def __getattr__(self, name: str):
        verbs = self.__dict__.get("_verbs", {})  # empty while unpickling, before __init__'s fields
        spec = verbs.get(name)
        if spec is None:
            raise AttributeError(f"role '{self.__dict__.get('_role')}' has no verb '{name}'; "
                                 f"its verbs: {', '.join(sorted(verbs))}")
        if spec.dispatch is Dispatch.DP:
            return lambda batch, **kw: self._group.call_dp("call", batch, self._role, name, **kw)
        call = self._group.call_first if spec.dispatch is Dispatch.ALL else self._group.call_one
        return lambda *args, **kw: call("call", self._role, name, *args, **kw)
