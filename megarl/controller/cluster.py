"""The Ray session of one run: a private Ray on loopback, or a user's cluster; every process of the
run tagged, and none left behind when it ends, however it ends (see :mod:`megarl.runtime.processes`).

A private Ray listens on loopback only: Ray (2.60) binds its gRPC servers (GCS, raylet, object
manager, the core worker in the driver and in each worker) and its agents to the node IP, and the
node IP is 127.0.0.1 here. Ray's token authentication stays as Ray defaults it (on, unless the
user sets ``RAY_AUTH_MODE``).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Dict, Optional

from megarl.runtime.processes import RUN_TAG, kill_tagged, new_run_id, run_processes, start_watchdog
from megarl.runtime.signals import InterruptNotice

# Ray resolves a node IP given as 127.0.0.1 to the machine's external address, unless cluster
# support is off (the switch Ray keeps for single-machine use on macOS/Windows; read at import).
_LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class RaySession:
    """Starts Ray for ``trainer`` (a :class:`TrainerConfig`) with ``num_cpus`` slots when private;
    :meth:`close` stops it and kills whatever of the run is still alive."""

    def __init__(self, trainer, num_cpus: int):
        self.run_id = new_run_id()
        self.private = not trainer.ray_address
        changes: Dict[str, str] = {RUN_TAG: self.run_id}
        if self.private:
            changes.update(_LOCAL_ONLY)
        self._saved: Dict[str, Optional[str]] = {k: os.environ.get(k) for k in changes}
        os.environ.update(changes)  # Ray's processes inherit these from the driver
        # workers on other nodes get the tag through their runtime_env; gloo talks over loopback;
        # the GPU-shaped harness of a driver run under it reaches its workers on any cluster
        from megarl.runtime.distributed import GPU_SHAPED_ENV, gpu_shaped_requested

        from megarl.runtime.memory import allocator_env

        # expandable segments for the workers' allocator, merged into the user's setting
        self.worker_env = {RUN_TAG: self.run_id, **({"GLOO_SOCKET_IFNAME": "lo"} if self.private else {}),
                           **({GPU_SHAPED_ENV: "1"} if gpu_shaped_requested() else {}), **allocator_env(os.environ)}
        self.liveness = None
        # Ctrl-C reaches the watchdog even when this process cannot take it (see InterruptNotice)
        self.interrupts = InterruptNotice()
        self.watchdog = start_watchdog(self.run_id, self.interrupts.read_fd)
        self.interrupts.arm()
        import ray
        from ray._private import ray_constants

        self._cluster_support = ray_constants.ENABLE_RAY_CLUSTER
        try:
            if self.private:
                ray_constants.ENABLE_RAY_CLUSTER = False  # when ray was imported before the switch was set
                ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                         configure_logging=False, log_to_driver=False)
            else:  # a cluster started by launch/slurm/train.sbatch or by hand
                ray.init(address=trainer.ray_address, _node_ip_address=trainer.node_ip_address,
                         configure_logging=False, log_to_driver=False)
            from megarl.controller.monitor import Liveness

            self.liveness = Liveness(trainer.hang_timeout_s)  # the run's hang check (trainer.hang_timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Idempotent; a second Ctrl-C during it is ignored, so the cleanup always finishes."""
        import ray

        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            interrupts = getattr(self, "interrupts", None)
            if interrupts is not None:  # before the watchdog that it reports to is stopped
                previous = interrupts.close(previous)
            if getattr(self, "liveness", None) is not None:
                self.liveness.close()  # the hang check's poll thread makes no Ray call after this
            # Ray's agents and forked writers may outlive ray.shutdown by minutes; on a cluster
            # only this node's processes of the run are visible here (the workers' forks die
            # with them: see WorkerGroup). The agents are known by ancestry, before their parent
            # (the raylet) ends and they are re-parented.
            ours = run_processes(self.run_id)
            ray.shutdown()
            kill_tagged(self.run_id, grace_s=2.0, also=ours)
            if self.watchdog is not None:
                self.watchdog.kill()
                self.watchdog.wait()
                self.watchdog = None
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self._cluster_support
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)


def check_cluster(trainer) -> None:
    """``trainer.nnodes`` against ``trainer.ray_address``."""
    from megarl.config import ConfigError

    if trainer.nnodes > 1 and not trainer.ray_address:
        raise ConfigError(f"trainer.nnodes={trainer.nnodes} needs trainer.ray_address (a Ray cluster; "
                          f"launch/slurm/train.sbatch starts one); a private Ray spans one machine")
