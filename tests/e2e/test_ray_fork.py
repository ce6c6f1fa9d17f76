"""The shared Ray cluster's workers, forked from the suite's server (:mod:`megarl.testing.ray_fork`):
each is still a process of its own, with the environment, streams and process group a worker
started by the raylet has; one whose import-time environment differs is started anew; one whose
raylet-started process dies goes with it; and a job on any other cluster is left to Ray's own
start."""

from __future__ import annotations

import os
import signal
import sys
import time

from megarl.testing import ray_fork
from tests import ray_cluster


def _gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):  # exited, not reaped yet
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_shared_cluster_worker_is_forked_and_still_its_own_process():
    import ray

    cluster = ray_cluster.shared()
    server = ray_cluster.fork_server_pid()  # None under MEGARL_TEST_FORK=0: every worker starts anew
    # ray.init installs a SIGTERM handler in its driver, which ray.shutdown leaves: the test process's back after
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=1)
        class Probe:
            def facts(self):
                return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "x": os.environ.get("X"),
                        "client": int(os.environ.get(ray_fork.CLIENT_ENV, "0")), "cwd": os.getcwd(),
                        "main": os.path.basename(sys.modules["__main__"].__file__),
                        "stdout": os.readlink("/proc/self/fd/1"), "stderr": os.readlink("/proc/self/fd/2"),
                        "preloaded": "megarl.controller.rl_worker" in sys.modules}

        forked = Probe.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "X": "forked"}}).remote()
        anew = Probe.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "2", "X": "anew"}}).remote()
        f, a = ray.get([forked.facts.remote(), anew.facts.remote()], timeout=180)
        print(f"forked worker {f}\nworker started anew {a}")
        # both: Ray's entry point as __main__, Ray's log files as streams, in a process group of its own
        for w, x in ((f, "forked"), (a, "anew")):
            assert w["main"] == "default_worker.py" and w["x"] == x and w["pgid"] == w["pid"], w
            assert "/logs/worker-" in w["stdout"] and w["stdout"].endswith(".out") and w["stderr"].endswith(".err")
        assert f["cwd"] == a["cwd"]
        # OMP_NUM_THREADS=2 is read when torch loads: not the server's, so Ray's own start
        assert a["ppid"] != server and not a["preloaded"] and a["client"] == 0
        if server is None:  # no server: the first is started anew as well
            assert not f["preloaded"] and f["client"] == 0
        else:  # forked: the server's child, with the server's imports done
            assert f["ppid"] == server and f["preloaded"] and f["client"] not in (0, f["pid"])
            # the process the raylet started dies (SIGKILL: nothing of it runs): the worker goes too
            os.kill(f["client"], signal.SIGKILL)
            assert _gone(f["pid"]), "the forked worker outlived the process the raylet started"
        # ray.kill ends the worker started anew, as always
        ray.kill(anew)
        assert _gone(a["pid"])
    finally:
        ray.shutdown()
        for s, handler in handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _fake_init(address):
    """A frame named ``init`` in a file under ``ray/``, as ``ray.init``'s is, calling the hook."""
    code = compile("def init(address):\n    return hook({'env_vars': {'A': '1'}})\n", "/x/ray/_private/worker.py",
                   "exec")
    scope = {"hook": lambda env: ray_fork.runtime_env_hook(env)}
    exec(code, scope)
    return scope["init"](address)


def test_the_hook_changes_only_a_job_on_the_shared_cluster(monkeypatch):
    monkeypatch.setenv(ray_fork.SHARED_ADDRESS_ENV, "127.0.0.1:6379")
    shared = _fake_init("127.0.0.1:6379")
    assert shared["env_vars"] == {"A": "1"} and shared["py_executable"].endswith("megarl/testing/ray_fork.py")
    assert shared["py_executable"].split()[0] == sys.executable
    for other in (None, "127.0.0.1:6380", "auto"):  # a private cluster's ray.init, another cluster
        assert _fake_init(other) == {"env_vars": {"A": "1"}}
    monkeypatch.delenv(ray_fork.SHARED_ADDRESS_ENV)
    assert _fake_init("127.0.0.1:6379") == {"env_vars": {"A": "1"}}
