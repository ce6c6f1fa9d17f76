"""Faults in a run's processes (issues 15 and 25): one worker rank crashing (SIGSEGV) or stopped
with SIGSTOP (colocated and split placement), Ctrl-C on ``megarl train`` during such a hang, the
driver killed with SIGKILL while a checkpoint is being written; and what a private Ray listens on.

Each case is one short real run of the demo (private Ray, two ranks, token authentication as Ray
defaults it), stopped once its first step is logged (the stopped-rank case has two, overlapping, and the
killed-vLLM-engine case runs beside their waits).
The harness (conftest.py) then checks that no process of the case is left: Ray's GCS, raylet and
agents, workers, forked checkpoint writers, reward workers, the run's watchdog."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest

from megarl.runtime.processes import RUN_TAG, run_processes, tagged_pids
from tests.distributed.launch import ROOT
from tests.faults.driver import DIAGNOSE_ENV, stderr, wait_exit

ARGS = ["configs/grpo_demo.yaml", "trainer.train_steps=50", "logging.progress_bar=false", "data.prompts_per_step=4",
        "algorithm.samples_per_prompt=4", "logging.backends=[console]"]
STARTUP_S = 300  # Ray, two ranks and the first step on a loaded 2-core machine
DETECT_S = 20.0  # the driver must notice and have stopped everything within this
HANG_S = 30  # trainer.hang_timeout_s of the frozen-rank cases (a rank's setup under load takes several seconds)


def start(run_dir, *extra):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # Ray's default: token auth on
    env.update(DIAGNOSE_ENV)  # a driver that outlives its deadline shows where it was
    env["PYTHONWARNINGS"] = "ignore"
    log = open(run_dir.parent / f"{run_dir.name}.stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", *ARGS, *extra, f"trainer.run_dir={run_dir}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    proc.log = log
    return proc


def wait_for_first_step(proc, run_dir) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + STARTUP_S
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{stderr(proc)[-3000:]}"
        assert time.monotonic() < deadline, f"no step within {STARTUP_S}s:\n{stderr(proc)[-3000:]}"
        time.sleep(0.5)


def worker_pids(proc, group: str = "workers") -> dict:
    """rank -> (pid, node) from the driver's '<group> (rank: pid@node)' line (``rollout workers``
    for the rollout's own group under split placement)."""
    line = next(line for line in stderr(proc).splitlines() if f"megarl: {group} (rank: pid@node)" in line)
    return {int(r): (int(p), n) for r, p, n in re.findall(r"(\d+): pid (\d+)@([^\s,]+)", line)}


def run_tag(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    return entries[RUN_TAG.encode()].decode()


def wait_gone(tag: str, limit_s: float, name: str = RUN_TAG) -> float:
    start_t = time.monotonic()
    while tagged_pids(tag, name) and time.monotonic() - start_t < limit_s:
        time.sleep(0.2)
    left = tagged_pids(tag, name)
    assert not left, f"processes of the run alive {limit_s}s after it ended: {left}"
    return time.monotonic() - start_t


# ---------------------------------------------------------------------------- listening sockets
def _address(hex_addr: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets(pids) -> list:
    """(pid, executable name, address, port) of every TCP socket in LISTEN state the processes hold."""
    listeners = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                hex_addr, hex_port = fields[1].split(":")
                listeners[fields[9]] = (_address(hex_addr), int(hex_port, 16))
    found = []
    for pid in pids:
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in listeners:
                found.append((pid, name, *listeners[inode]))
    return found


def check_listeners(found) -> None:
    """Every listening socket of the run is on loopback (127.0.0.1, ::1 or ::ffff:127.0.0.1):
    Ray's GCS, raylet, object manager, agents, the core-worker servers of the driver and the
    workers, torch's rendezvous store and gloo."""
    for pid, name, addr, port in found:
        mapped = addr.version == 6 and addr.ipv4_mapped
        assert addr.is_loopback or (mapped and mapped.is_loopback), f"pid {pid} ({name}) listens on {addr}:{port}"


# ---------------------------------------------------------------------------------------- cases
def test_a_killed_worker_rank_stops_the_run_named_within_seconds(tmp_path):
    """Rank 1 crashes (SIGSEGV, as a bad native call would): the driver exits 3 within seconds,
    naming the rank, the signal and the fault report that its stderr holds (the Python stack of
    the crash), without a traceback of its own, and nothing of the run is left. (A SIGKILL leaves
    no report, and the error says so: tests/unit/test_dead_processes.py.)"""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.save_interval=1", "trainer.async_save=true")
    try:
        wait_for_first_step(proc, run_dir)
        ranks = worker_pids(proc)
        assert sorted(ranks) == [0, 1] and all(node == "127.0.0.1" for _, node in ranks.values()), ranks
        tag = run_tag(ranks[1][0])
        pids = {proc.pid} | {pid for pid, _ in run_processes(tag)}  # with Ray's (untagged) agents
        found = listening_sockets(pids)
        names = {name for _, name, *_ in found} | {"driver" for pid, *_ in found if pid == proc.pid}
        assert {"driver", "gcs_server", "raylet", "ray::RuntimeEnvAgent"[:15]} <= names, found
        check_listeners(found)
        os.kill(ranks[1][0], signal.SIGSEGV)
        took = wait_exit(proc, DETECT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr(proc)
    print(f"driver exited {took:.1f}s after rank 1 crashed; it said:\n{err[err.find('rank 1 (pid'):][:1500]}")
    assert proc.returncode == 3, err[-3000:]
    assert f"rank 1 (pid {ranks[1][0]} on node 127.0.0.1) died" in err, err[-3000:]
    assert "it received SIGSEGV" in err and "Fatal Python error: Segmentation fault" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    wait_gone(tag, 5.0)


def stopped_rank_run(run_dir, group: str, *extra, stopped: Optional[threading.Event] = None) -> tuple:
    """A run (trainer.hang_timeout_s=HANG_S) whose rank 1 of ``group`` is stopped with SIGSTOP
    once its first step is logged, after every listening socket of the run is seen on loopback:
    the driver exits 3 within HANG_S + 30 s of the stop, without a traceback, and nothing of the
    run is left 5 s later. ``stopped`` is set once the rank is stopped, or the case has failed
    before. Returns (rank 1's pid, the driver's output)."""
    stopped = stopped or threading.Event()
    proc = start(run_dir, f"trainer.hang_timeout_s={HANG_S}", *extra)
    try:
        wait_for_first_step(proc, run_dir)
        ranks = {rank: pid for rank, (pid, _) in worker_pids(proc, group).items()}
        assert sorted(ranks) == [0, 1], ranks
        tag = run_tag(ranks[1])
        check_listeners(listening_sockets({proc.pid} | {pid for pid, _ in run_processes(tag)}))
        os.kill(ranks[1], signal.SIGSTOP)
        stopped.set()
        took = wait_exit(proc, HANG_S + 30)
    finally:
        stopped.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr(proc)
    print(f"{run_dir.name}: driver exited {took:.1f}s after {group} rank 1 was stopped")
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    wait_gone(tag, 5.0)
    return ranks[1], err


STOP_WAIT_S = STARTUP_S + HANG_S + 60  # a run's own deadlines end it before this


def await_stop(stopped: threading.Event, run: str) -> None:
    if not stopped.wait(STOP_WAIT_S):
        pytest.fail(f"{run}: its rank 1 was not stopped, nor did the run fail, within {STOP_WAIT_S} s "
                    f"(start-up {STARTUP_S} s + hang timeout {HANG_S} s + 60 s)")


@pytest.fixture(scope="module")
def waiting_runs(tmp_path_factory):
    """The module's cases that mostly wait, side by side (futures: each test reads its own):
    the colocated stopped-rank run; the split one, started once the colocated run's rank is
    stopped (it starts up while the colocated driver waits out its hang timeout, an idle wait);
    and the killed-vLLM-engine run, started once the split run's rank is stopped too (its engine
    starts while both drivers wait). Alone, one after another: 56 s and 50 s."""
    work = tmp_path_factory.mktemp("waiting")
    colocated_stopped, split_stopped = threading.Event(), threading.Event()
    with ThreadPoolExecutor(3) as pool:
        runs = {"colocated": pool.submit(stopped_rank_run, work / "colocated", "workers", stopped=colocated_stopped)}
        # each event is set as well if its run failed before its rank was stopped
        await_stop(colocated_stopped, "the colocated run")
        runs["split"] = pool.submit(stopped_rank_run, work / "split", "rollout workers", "trainer.placement=split",
                                    "parallel.rollout.nproc=2", "trainer.loop=one_step_off", stopped=split_stopped)
        await_stop(split_stopped, "the split run")
        runs["engine"] = pool.submit(killed_engine_run, work / "engine")
    return runs


def test_a_stopped_rank_is_named_and_the_run_exits_3(waiting_runs):
    """SIGSTOP (what a wedged GPU or a stuck file system looks like from outside) to rank 1 of two
    runs: a colocated one, and one of split placement, one step off (the rollout's own ranks and
    the driver's drawing thread), whose rollout rank is stopped mid-run. The rank's heartbeat
    stops; it is named within trainer.hang_timeout_s, the run exits 3 and nothing of it is left;
    every socket of either run (the split run's weights group's store too) listens on loopback
    only. (A killed rank is named through the same wait in both placements.)"""
    (pid, err), (split_pid, split_err) = waiting_runs["colocated"].result(), waiting_runs["split"].result()
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"megarl train: error: rank 1 \(pid {pid} on node 127\.0\.0\.1\) made no progress "
                        rf"for \d+ s in \S+ \(its heartbeat stopped: .*\)", line), line
    assert f"rollout rank 1 (pid {split_pid} on node 127.0.0.1) made no progress for" in split_err, split_err[-3000:]


def test_ctrl_c_during_a_hang_stops_the_run_with_exit_130_and_one_line(tmp_path):
    """Rank 1 stopped (its hang not yet named: the default hang_timeout_s), then Ctrl-C."""
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    try:
        wait_for_first_step(proc, run_dir)
        ranks = worker_pids(proc)
        tag = run_tag(ranks[0][0])
        os.kill(ranks[1][0], signal.SIGSTOP)
        time.sleep(2)  # the driver is waiting on the stopped rank
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        took = wait_exit(proc, DETECT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr(proc)
    print(f"driver exited {took:.1f}s after SIGINT")
    assert took < 10, err[-3000:]
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "megarl train: interrupted", err[-3000:]
    wait_gone(tag, 5.0)


def test_a_driver_killed_during_a_checkpoint_write_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.save_interval=1", "trainer.async_save=true")
    try:
        wait_for_first_step(proc, run_dir)
        checkpoints = run_dir / "checkpoints"
        while not (checkpoints.is_dir() and any(checkpoints.iterdir())):  # step 1's is being written
            assert proc.poll() is None, stderr(proc)[-3000:]
            time.sleep(0.05)
        tag = run_tag(worker_pids(proc)[0][0])
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
        proc.wait()
        took = wait_gone(tag, DETECT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"every process of the run gone {took:.1f}s after the driver was killed")


# ------------------------------------------------------------- the mechanisms, without a run
CHILD = """
import os, sys, time
from megarl.runtime.processes import forks_die_with_this_process
forks_die_with_this_process()
if os.fork() == 0:  # a checkpoint writer, say: it would outlive its parent without the hook
    time.sleep(60)
    os._exit(0)
print(os.getpid(), flush=True)
time.sleep(60)
"""


def test_a_forked_child_dies_with_its_killed_parent():
    tag = os.environ["MEGARL_TEST_CASE"]
    parent = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    parent.stdout.readline()
    time.sleep(0.3)
    assert len(tagged_pids(tag, "MEGARL_TEST_CASE")) == 2  # the parent and its fork
    parent.kill()
    parent.wait()
    wait_gone(tag, 2.0, name="MEGARL_TEST_CASE")


def test_the_watchdog_kills_what_a_sigkilled_driver_leaves():
    run_id = "watchdog-test"
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env=dict(os.environ, **{RUN_TAG: run_id}), start_new_session=True)
    watchdog = subprocess.Popen([sys.executable, "-m", "megarl.runtime.processes", str(driver.pid), run_id],
                                cwd=ROOT, env={k: v for k, v in os.environ.items() if k != RUN_TAG},
                                start_new_session=True)
    time.sleep(1.0)
    assert orphan.poll() is None and watchdog.poll() is None
    driver.kill()
    driver.wait()
    assert watchdog.wait(timeout=10) == 0
    assert orphan.wait(timeout=1) == -signal.SIGKILL


def killed_engine_run(run_dir) -> tuple:
    """A run on vLLM whose rank 0's engine core process is SIGKILLed once the first step is logged:
    the driver exits 3 within DETECT_S, without a traceback, and nothing of the run is left 5 s
    later. Returns (the engine's pid, the driver's output)."""
    from megarl.runtime.processes import descendants

    proc = start(run_dir, "parallel.rollout.engine=vllm", "model.hf_config=configs/models/tiny-digits-hd32.json")
    try:
        wait_for_first_step(proc, run_dir)
        ranks = worker_pids(proc)
        tag = run_tag(ranks[0][0])
        engines = [pid for pid in descendants(ranks[0][0])
                   if "EngineCore" in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")]
        assert len(engines) == 1, (engines, descendants(ranks[0][0]))
        os.kill(engines[0], signal.SIGKILL)
        took = wait_exit(proc, DETECT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr(proc)
    print(f"driver exited {took:.1f}s after the engine was killed")
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    wait_gone(tag, 5.0)
    return engines[0], err


def test_a_killed_vllm_engine_stops_the_run_named(waiting_runs):
    """parallel.rollout.engine=vllm: the vLLM engine core process of rank 0 (a child of the rank)
    killed mid-run: the run names the rollout rank and the engine's pid, exits 3, and nothing of
    it is left (run in ``waiting_runs``, beside the stopped-rank runs' waits)."""
    engine, err = waiting_runs["engine"].result()
    assert f"rollout rank 0: vllm engine died (pid {engine})" in err, err[-3000:]
