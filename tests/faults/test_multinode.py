"""Multi-node runs on one machine (issue 15, item 8): a two-node Ray cluster started with Ray's own
CLI (``ray start --head`` and ``ray start --address``, as launch/slurm/train.sbatch does), the
driver joining it through ``trainer.ray_address``; and the Slurm scripts run against fake
``srun``/``scontrol`` that record their arguments.

Both nodes share the machine's IP, so ranks are told apart by Ray node ID (the driver prints it in
its worker list). The cluster is the test's own: its processes carry ``MEGARL_TEST_CLUSTER`` and
are killed by PID, with the agents found by ancestry, before the harness (conftest.py) checks that
nothing of the case survives. ``ray stop`` is never used: it stops every Ray on the machine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megarl.runtime.processes import RUN_TAG, descendants, tagged_pids
from tests.distributed.launch import ROOT
from tests.ray_cluster import Cluster
from tests.faults.driver import stderr, wait_exit

NNODES, NPROC = 2, 2  # 4 ranks: actor tp=2 within a node, dp=2 across the nodes
ARGS = ["configs/grpo_demo.yaml", f"trainer.nnodes={NNODES}", f"trainer.nproc_per_node={NPROC}",
        "logging.progress_bar=false", "logging.backends=[console]", "data.prompts_per_step=4",
        "algorithm.samples_per_prompt=2"]
RUN_S = 600  # Ray, four ranks and two steps on a loaded 2-core machine
DETECT_S = 30.0  # the driver must notice the lost node and have stopped within this
LEFT_S = 10.0  # then nothing of the run may be alive after this


# ------------------------------------------------------------------------------- the cluster
@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, [NPROC] * NNODES)  # head + worker, token auth on
    try:
        yield c
    finally:
        c.stop()


# ------------------------------------------------------------------------------------ runs
def start(cluster, run_dir, *extra):
    log = open(run_dir.parent / f"{run_dir.name}.stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", *ARGS, *extra,
                             f"trainer.ray_address={cluster.address}", f"trainer.run_dir={run_dir}"],
                            cwd=ROOT, env=cluster.env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    proc.log = log
    return proc


def ranks_by_node(proc) -> dict:
    """rank -> (pid, Ray node ID prefix) from the driver's 'workers (rank: pid@node)' line."""
    line = next(line for line in stderr(proc).splitlines() if "workers (rank: pid@node)" in line)
    return {int(r): (int(p), n) for r, p, n in re.findall(r"(\d+): pid (\d+)@[^\s,]+ \(node (\w+)\)", line)}


def steps_logged(run_dir) -> list:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_two_node_run_then_a_lost_node_is_named_within_seconds(cluster, tmp_path):
    # --- a whole run across the two nodes: placement by node, rendezvous, two steps
    run_dir = tmp_path / "run"
    proc = start(cluster, run_dir, "trainer.train_steps=2")
    took = wait_exit(proc, RUN_S)
    err = stderr(proc)
    print(f"two-node run of 2 steps: {took:.0f}s")
    assert proc.returncode == 0, err[-3000:]
    assert steps_logged(run_dir) == [1, 2], err[-3000:]
    ranks = ranks_by_node(proc)
    head, worker = (n[:8] for n in cluster.node_ids)
    # node r // nproc_per_node holds rank r: both nodes used, each by NPROC consecutive ranks
    nodes = [ranks[r][1] for r in range(NNODES * NPROC)]
    assert {nodes[0], nodes[-1]} == {head, worker}, (nodes, cluster.node_ids)
    assert nodes == [nodes[0]] * NPROC + [nodes[-1]] * NPROC, nodes

    # --- a second run; once its first step is logged, node 2 (the worker node) is lost: SIGKILL
    # to its raylet and every process under it at once (a raylet killed alone leaves its workers
    # running until the GCS's health checks declare the node dead, ~15 s). The driver names a rank
    # of that node and exits 3.
    run_dir = tmp_path / "lost"
    proc = start(cluster, run_dir, "trainer.train_steps=1000")
    try:
        deadline = time.monotonic() + RUN_S
        while not steps_logged(run_dir):
            assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{stderr(proc)[-3000:]}"
            assert time.monotonic() < deadline, f"no step within {RUN_S}s:\n{stderr(proc)[-3000:]}"
            time.sleep(0.5)
        ranks = ranks_by_node(proc)
        lost = {r for r, (_, node) in ranks.items() if node == worker}
        assert len(lost) == NPROC, ranks
        run_tag = dict(e.split(b"=", 1) for e in open(f"/proc/{ranks[min(lost)][0]}/environ", "rb").read()
                       .split(b"\0") if b"=" in e)[RUN_TAG.encode()].decode()
        cluster.note()
        for pid in [cluster.raylets[1], *descendants(cluster.raylets[1])]:  # raylet, workers, agents
            os.kill(pid, signal.SIGKILL)
        took = wait_exit(proc, DETECT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr(proc)
    print(f"driver exited {took:.1f}s after node 2 was killed")
    assert proc.returncode == 3, err[-3000:]
    named = re.search(r"rank (\d+) \(pid (\d+) on node [^)]+\) died \(Ray node (\w+)\)", err)
    assert named and int(named[1]) in lost and named[3] == worker, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # nothing of the run is left on the surviving node: workers, their forks, the reward workers
    deadline = time.monotonic() + LEFT_S
    while time.monotonic() < deadline and tagged_pids(run_tag):
        time.sleep(0.2)
    assert not tagged_pids(run_tag), f"processes of the run outlived it by {LEFT_S}s: {tagged_pids(run_tag)}"


# ------------------------------------------------------------------------ the Slurm scripts
# Fakes of what the scripts call, first on PATH: each appends "name pid RAY_AUTH_MODE token | args"
# to $FAKE_LOG. srun answers `hostname --ip-address`, and a `--block` step (ray start) stays up
# until SIGTERM, which it records; any other step records a line per task it would start ("rank R
# node N local L" and the MASTER_* the task sees; $SLURM_NTASKS tasks, $SLURM_NTASKS_PER_NODE a
# node). `ray health-check` fails once, then answers (the head is up).
FAKES = {
    "srun": r'''
sleeper=
trap 'echo "TERM $$" >> "$FAKE_LOG"; [ -z "$sleeper" ] || kill $sleeper; exit 143' TERM
echo "srun $$ ${RAY_AUTH_MODE:-} ${RAY_AUTH_TOKEN:-} | $*" >> "$FAKE_LOG"
case " $* " in
  *" hostname "*) echo "10.1.0.7 fe80::7" ;;
  *" --head "*" --block "*) if [ -n "${FAKE_HEAD_FAILS:-}" ]; then exit 1; fi ;;&
  *" --block "*) sleep 600 & sleeper=$!; wait $sleeper ;;
  *) tasks="${SLURM_NTASKS:-1}"; per_node="${SLURM_NTASKS_PER_NODE:-$tasks}"
     case " $* " in *" --ntasks=1 "*) tasks=1 ;; esac
     # the step's tasks, as srun starts them (SLURM_PROCID = rank), with the environment each gets
     for ((rank = 0; rank < tasks; rank++)); do
       master="$(env | grep ^MASTER_ | sort | tr '\n' ' ')"
       echo "rank $rank node $((rank / per_node)) local $((rank % per_node)) $master" >> "$FAKE_LOG"
     done ;;
esac''',
    "scontrol": r'''
[ "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" ] || exit 9
printf '%s\n' $FAKE_HOSTS''',
    "ray": r'''
echo "ray $$ ${RAY_AUTH_MODE:-} ${RAY_AUTH_TOKEN:-} | $*" >> "$FAKE_LOG"
[ -z "${FAKE_HEAD_FAILS:-}" ] && [ -e "$FAKE_LOG.up" ] && exit 0
touch "$FAKE_LOG.up"; exit 1''',
    # the driver (MEGARL_PYTHON); `-c` (the script's token) goes to the real interpreter
    "python": rf'''
[ "$1" = "-c" ] && exec {sys.executable} "$@"
echo "driver $$ ${{RAY_AUTH_MODE:-}} ${{RAY_AUTH_TOKEN:-}} | $*" >> "$FAKE_LOG"
# as a real driver would, last until every node's step has started (and can take a SIGTERM)
for _ in $(seq 200); do
  [ "$(grep -c -- --block "$FAKE_LOG")" -ge "$(echo $FAKE_HOSTS | wc -w)" ] && break; sleep 0.1
done
# on SIGTERM it records it, "checkpoints" for a second, and exits 143 (DRIVER-WAITS: its trap is set)
if [ -n "${{FAKE_DRIVER_WAITS:-}}" ]; then
  sleep 600 & s=$!; trap 'echo "DRIVER-TERM $$" >> "$FAKE_LOG"; kill $s; sleep 1; echo "DRIVER-EXIT $$" >> "$FAKE_LOG"; exit 143' TERM
  echo "DRIVER-WAITS $$" >> "$FAKE_LOG"
  wait $s
fi
exit "${{FAKE_DRIVER_EXIT:-0}}"''',
}


def slurm(tmp_path, script, *args, wait=True, **env):
    """Run a launch/slurm script with bash inside a fake 3-node job; returns (proc, log path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body.lstrip("\n") + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))},
            "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "MEGARL_PYTHON": str(bin_dir / "python"),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[1-3]", "SLURM_NNODES": "3", "SLURM_GPUS_ON_NODE": "4",
            "FAKE_HOSTS": "gpu1 gpu2 gpu3", **env}
    proc = subprocess.Popen(["bash", f"launch/slurm/{script}", *args], cwd=ROOT, env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if wait:
        proc.out, proc.err = proc.communicate(timeout=60)
    return proc, log


def wait_logged(proc, log, text: str) -> None:
    """Until ``text`` is in the fake job's log (60 s at most)."""
    deadline = time.monotonic() + 60
    while not (log.exists() and text in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)


def slurm_until_driver(tmp_path):
    """train.sbatch in a fake job whose driver waits for a signal, once the driver has started."""
    proc, log = slurm(tmp_path, "train.sbatch", "cfg.yaml", wait=False, FAKE_DRIVER_WAITS="1")
    wait_logged(proc, log, "driver ")
    return proc, log


def calls(log) -> list:
    """(program, pid, auth mode, token, args) per recorded call, in order; 'TERM pid' lines (and the
    driver's DRIVER-*) as-is."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith(("TERM ", "DRIVER-WAITS ", "DRIVER-TERM ", "DRIVER-EXIT ")):
            out.append((line.split()[0], int(line.split()[1]), "", "", ""))
        elif " | " in line:
            head, args = line.split(" | ", 1)
            prog, pid, *auth = head.split(" ")
            out.append((prog, int(pid), *(auth + ["", ""])[:2], args))
        else:
            out.append(("env", 0, "", "", line))
    return out


def blocking_steps(recorded) -> list:
    return [(pid, args) for prog, pid, _, _, args in recorded if prog == "srun" and "--block" in args]


def assert_stopped(recorded) -> None:
    """Every `ray start --block` step got SIGTERM from the script, and none is alive now."""
    steps = [pid for pid, _ in blocking_steps(recorded)]
    termed = [pid for prog, pid, *_ in recorded if prog == "TERM"]
    assert sorted(termed) == sorted(steps) and len(steps) == 3, (termed, steps)
    for pid in steps:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z", pid


def test_slurm_train_starts_head_workers_driver_and_stops_its_steps(tmp_path):
    proc, log = slurm(tmp_path, "train.sbatch", "cfg.yaml", "parallel.actor.tp=2")
    assert proc.returncode == 0, proc.err
    recorded = calls(log)
    # the head's IP from the head node, the head, a readiness poll, then workers and the driver
    assert recorded[0][0] == "srun" and recorded[0][4] == "--nodes=1 --ntasks=1 -w gpu1 hostname --ip-address"
    steps = blocking_steps(recorded)
    # each Ray step asks Slurm for its node's GPUs and CPUs, and tells Ray how many it got
    step = "--nodes=1 --ntasks=1 --cpus-per-task=4 --gpus-per-node=4"
    assert sorted(args for _, args in steps) == [  # started in the background: recorded in any order
        f"{step} -w gpu1 ray start --head --node-ip-address=10.1.0.7 --port=6379 --num-gpus=4 --num-cpus=4 "
        "--disable-usage-stats --block",
        f"{step} -w gpu2 ray start --address=10.1.0.7:6379 --num-gpus=4 --num-cpus=4 --disable-usage-stats --block",
        f"{step} -w gpu3 ray start --address=10.1.0.7:6379 --num-gpus=4 --num-cpus=4 --disable-usage-stats --block"]
    checks = [i for i, c in enumerate(recorded) if c[0] == "ray"]
    assert [recorded[i][4] for i in checks] == ["health-check --address=10.1.0.7:6379"] * 2
    workers = [i for i, c in enumerate(recorded) if "ray start --address" in c[4]]
    assert max(checks) < min(workers)
    (driver,) = [c for c in recorded if c[0] == "driver"]
    assert driver[4] == ("-m megarl.cli train cfg.yaml parallel.actor.tp=2 trainer.nnodes=3 trainer.nproc_per_node=4 "
                         "trainer.ray_address=10.1.0.7:6379 trainer.node_ip_address=10.1.0.7")
    # one token, made for this job, in token mode everywhere (a worker node cannot join without)
    auth = {(c[2], c[3]) for c in recorded if c[0] in ("srun", "ray", "driver")}
    assert len(auth) == 1 and next(iter(auth))[0] == "token" and re.fullmatch(r"[0-9a-f]{64}", next(iter(auth))[1])
    assert_stopped(recorded)


def test_slurm_train_cleans_up_when_the_driver_fails_or_the_job_is_cancelled(tmp_path):
    (tmp_path / "a").mkdir()
    proc, log = slurm(tmp_path / "a", "train.sbatch", "cfg.yaml",
                      FAKE_DRIVER_EXIT="3", RAY_PORT="7001")
    assert proc.returncode == 3, proc.err  # the driver's code (3: a worker died) is the job's
    recorded = calls(log)
    assert all("10.1.0.7:7001" in args for _, args in blocking_steps(recorded)[1:])
    assert_stopped(recorded)

    # scancel: SIGTERM to the batch shell and the driver; the shell's trap stops the steps
    (tmp_path / "b").mkdir()
    proc, log = slurm_until_driver(tmp_path / "b")
    (driver,) = [c for c in calls(log) if c[0] == "driver"]
    proc.send_signal(signal.SIGTERM)
    os.kill(driver[1], signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert_stopped(calls(log))

    # preemption (sbatch's --signal=B:TERM, or scancel --batch --signal=TERM): SIGTERM to the batch
    # shell alone reaches the driver once; the Ray steps are stopped after the driver has exited
    (tmp_path / "p").mkdir()
    proc, log = slurm_until_driver(tmp_path / "p")
    wait_logged(proc, log, "DRIVER-WAITS")  # the driver's trap is set
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    recorded = calls(log)
    names = [c[0] for c in recorded]
    assert names.count("DRIVER-TERM") == 1, recorded
    assert names.index("DRIVER-EXIT") < names.index("TERM"), recorded  # the steps outlive the driver
    assert_stopped(recorded)
    assert "#SBATCH --signal=B:TERM@360" in (ROOT / "launch" / "slurm" / "train.sbatch").read_text()

    # a head that does not come up: a named error, no worker started, no driver
    (tmp_path / "c").mkdir()
    proc, log = slurm(tmp_path / "c", "train.sbatch", "cfg.yaml", FAKE_HEAD_FAILS="1")
    assert proc.returncode == 1 and "the Ray head on gpu1 (10.1.0.7:6379) exited" in proc.err, proc.err
    recorded = calls(log)
    assert [c[0] for c in recorded].count("srun") == 2 and "driver" not in [c[0] for c in recorded], recorded


def convert_steps(log) -> list:
    """(srun's arguments, [(rank, node, local rank, MASTER_* the task sees)]) per step of convert.sbatch."""
    steps = []
    for prog, _, _, _, args in calls(log):
        if prog == "srun":
            steps.append((args, []))
        elif prog == "env" and args.startswith("rank "):
            _, rank, _, node, _, local, *master = args.split()
            steps[-1][1].append((int(rank), int(node), int(local), master))
    return steps


def test_slurm_convert_runs_its_steps_on_every_rank_with_the_first_nodes_address(tmp_path):
    """convert.sbatch: the conversion and its verification on every task of the job (6: 2 on each
    of 3 nodes), each task with the first node's address, then the inspection on one task; an
    array task takes its entry of a job list; bad arguments exit 2 with the usage."""
    master = ["MASTER_ADDR=gpu1", "MASTER_PORT=29511"]
    every = [(rank, rank // 2, rank % 2, master) for rank in range(6)]
    python, tools = tmp_path / "bin" / "python", ROOT / "checkpoint_tools"
    proc, log = slurm(tmp_path, "convert.sbatch", "hf-to-mcore", "/src", "/dst", "--tp", "2",
                      SLURM_NTASKS="6", SLURM_NTASKS_PER_NODE="2")
    assert proc.returncode == 0, proc.err
    assert convert_steps(log) == [
        (f"--kill-on-bad-exit=1 {python} {tools}/hf_to_mcore.py /src /dst --tp 2", every),
        (f"--kill-on-bad-exit=1 {python} {tools}/verify.py /src /dst --layers 2", every),
        (f"--nodes=1 --ntasks=1 {python} {tools}/inspect.py /dst", [(0, 0, 0, master)])]

    (tmp_path / "a").mkdir()
    proc, log = slurm(tmp_path / "a", "convert.sbatch", "mcore-to-hf", "--list", "jobs.txt", "--dtype", "bfloat16",
                      SLURM_ARRAY_TASK_ID="3", VERIFY_ARGS="--tp 2 --tol 1e-3")
    assert proc.returncode == 0, proc.err
    python = tmp_path / "a" / "bin" / "python"
    assert [args for args, _ in convert_steps(log)] == [
        f"--kill-on-bad-exit=1 {python} {tools}/mcore_to_hf.py --list jobs.txt --dtype bfloat16 --index 3",
        f"--kill-on-bad-exit=1 {python} {tools}/verify.py --list jobs.txt --index 3 --tp 2 --tol 1e-3",
        f"--nodes=1 --ntasks=1 {python} {tools}/inspect.py --list jobs.txt --index 3"]
    for args in (["hf-to-mcore"], ["verify", "/src", "/dst"]):
        proc, _ = slurm(tmp_path, "convert.sbatch", *args)
        assert proc.returncode == 2 and "usage:" in proc.err, proc.err
