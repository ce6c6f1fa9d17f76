"""Ray clusters of the tests' own, started with Ray's CLI (``ray start``) as a user's cluster is.

:class:`Cluster`: nodes on this machine, every process tagged ``MEGARL_TEST_CLUSTER=<uuid>`` and
killed by PID at the end, the agents found by ancestry (``ray stop`` is never used: it stops every
Ray on the machine).

:func:`shared` is the cluster that the end-to-end tests' runs join through ``trainer.ray_address``
(:func:`overrides`), started once per pytest process on first use and stopped with the session
(``tests/conftest.py``), instead of each run starting and stopping a private Ray (GCS, raylet,
five Python daemons: 6-8 s of a run here). It only serves runs whose subject is not Ray's own
lifecycle: the demo test and the fault suite keep private sessions, so the path users run on one
machine, and a run's cleanup of its own processes, stay tested there. Its workers are forked from
a server that has imported torch, Megatron and megarl (:mod:`megarl.testing.ray_fork`;
``MEGARL_TEST_FORK=0`` starts each anew, as Ray does).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import List, Optional, Sequence

from megarl.runtime.processes import descendants, identity, kill_tagged, tagged_pids
from megarl.testing import ray_fork
from tests.distributed.launch import ForkServer

ROOT = Path(__file__).resolve().parents[1]
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
CLUSTER_TAG = "MEGARL_TEST_CLUSTER"
SHARED_CPUS = 8  # logical slots: the largest end-to-end run takes 4 trainer and 2 rollout ranks
# Idle workers that Ray starts ahead of demand: a run's actors carry their own runtime_env (the
# run's tag), so none of them could use one.
NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raylets(tag: str) -> list:
    return sorted(p for p in tagged_pids(tag, CLUSTER_TAG) if open(f"/proc/{p}/comm").read().strip() == "raylet")


def _node_id(raylet_pid: int) -> str:
    args = open(f"/proc/{raylet_pid}/cmdline", "rb").read().decode().split("\0")
    return next(a.split("=", 1)[1] for a in args if a.startswith("--node_id="))


class Cluster:
    """Ray nodes on this machine (the first the head), ``cpus`` each; token auth on with a token of
    its own when ``token`` (no dependence on ``~/.ray``), off otherwise."""

    def __init__(self, cwd, cpus: Sequence[int], token: bool = True, system_config: Optional[dict] = None,
                 env: Optional[dict] = None, tag: Optional[str] = None):
        self.tag, self.port = tag or uuid.uuid4().hex, free_port()
        self.address = f"127.0.0.1:{self.port}"
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)} if token else \
            {"RAY_AUTH_MODE": "disabled"}
        self.env = {**os.environ, CLUSTER_TAG: self.tag, "PYTHONWARNINGS": "ignore", **auth, **(env or {})}
        self.known: set = set()  # identities of the cluster's processes, agents included
        self.cwd = cwd
        self.raylets: List[int] = []
        self.node_ids: List[str] = []
        # a short temp dir of its own: Ray's socket paths must fit AF_UNIX's 107 bytes
        self.ray_tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
        extra = [f"--system-config={json.dumps(system_config)}"] if system_config else []
        try:
            for i, n in enumerate(cpus):
                common = ["--node-ip-address=127.0.0.1", f"--num-cpus={n}", "--disable-usage-stats"]
                if i == 0:
                    self._ray("start", "--head", f"--port={self.port}", "--include-dashboard=false",
                              f"--temp-dir={self.ray_tmp}", *common, *extra)
                else:
                    self._ray("start", f"--address={self.address}", *common)
        except BaseException:
            self.stop()
            raise

    def _ray(self, *args) -> None:
        before = set(_raylets(self.tag))
        out = subprocess.run([RAY, *args], env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, f"ray {' '.join(args)}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
        (new,) = set(_raylets(self.tag)) - before
        self.raylets.append(new)
        self.node_ids.append(_node_id(new))
        self.note()

    def note(self) -> None:
        """Remember the cluster's processes now: the agents drop the tag (they rewrite their
        environment with their title) and are known by ancestry only while their raylet lives."""
        for pid in tagged_pids(self.tag, CLUSTER_TAG):
            self.known |= {identity(p) for p in [pid, *descendants(pid)]} - {None}

    def stop(self) -> None:
        self.note()
        kill_tagged(self.tag, CLUSTER_TAG, also=self.known)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


_shared: Optional[Cluster] = None
_fork_server = None
# What megarl's worker groups set for every worker (megarl.controller.group): the fork server
# starts with it, so that their import-time environment is its own
WORKER_ENV = {"OMP_NUM_THREADS": "1"}


def shared() -> Cluster:
    """The shared single-node cluster, started on first use. Its workers get the tests' import
    path and no token (loopback only); what a run's driver sets for its workers travels in the
    run's runtime_env, as on any cluster."""
    global _shared, _fork_server
    if _shared is None:
        env, tag = {"PYTHONPATH": str(ROOT), "MLFLOW_DISABLE_TELEMETRY": "true"}, uuid.uuid4().hex
        if os.environ.get("MEGARL_TEST_FORK", "1") != "0":
            # tagged as the cluster's processes are: its stop kills the server and the workers forked
            _fork_server = ForkServer({**os.environ, **env, CLUSTER_TAG: tag, "PYTHONWARNINGS": "ignore",
                                       "RAY_AUTH_MODE": "disabled", **WORKER_ENV}, preload=ray_fork.PRELOAD)
            env[ray_fork.SOCKET_ENV] = _fork_server.path
        _shared = Cluster(ROOT, [SHARED_CPUS], token=False, system_config=NO_PRESTART, env=env, tag=tag)
        if _fork_server is not None:  # the drivers of this process and of its children
            os.environ.update({"RAY_RUNTIME_ENV_HOOK": ray_fork.HOOK, ray_fork.SHARED_ADDRESS_ENV: _shared.address})
    return _shared


def fork_server_pid() -> Optional[int]:
    """The PID of the server that forks the shared cluster's workers, None without one."""
    return _fork_server.proc.pid if _fork_server is not None else None


def overrides() -> List[str]:
    """A run's config overrides that make it join the shared cluster."""
    return [f"trainer.ray_address={shared().address}", "trainer.node_ip_address=127.0.0.1"]


def stop_shared() -> None:
    global _shared, _fork_server
    if _shared is not None:
        _shared.stop()
        _shared = None
    if _fork_server is not None:
        _fork_server.close()
        _fork_server = None
        for key in ("RAY_RUNTIME_ENV_HOOK", ray_fork.SHARED_ADDRESS_ENV):
            os.environ.pop(key, None)


def joined(cli_args: Sequence[str]) -> List[str]:
    """:func:`overrides` for a ``megarl train``, ``sft``, ``train-rm``, ``dpo`` or ``eval`` command
    line, nothing for other commands and for a dry run (which starts no Ray)."""
    if "--dry-run" in cli_args:
        return []
    return overrides() if cli_args and cli_args[0] in ("train", "sft", "train-rm", "dpo", "eval") else []
