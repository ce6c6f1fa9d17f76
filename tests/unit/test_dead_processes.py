"""Processes that end: what a dead worker's machine recorded (megarl.runtime.postmortem, read
from the files Ray writes; their layout is a real crash's, measured with Ray 2.60: a worker's
stderr ``worker-<id>-<job>-<pid>.err`` and its core-worker log
``python-core-worker-<id>_<pid>.log``; a real crash through a run is in
tests/faults/test_worker_faults.py), and kills that hit only the process meant."""

from __future__ import annotations

import signal
import subprocess

from megarl.runtime import postmortem

FAULT = """:job_id:01000000
some output
Fatal Python error: Segmentation fault

Current thread 0x00007f (most recent call first):
  File "/x/megarl/engines/actor.py", line 10 in update
  File "/x/ray/_private/worker.py", line 1069 in main_loop

Extension modules: numpy (total: 1)
"""


def test_a_crash_names_the_signal_and_the_crashing_stack(tmp_path):
    (tmp_path / "worker-ab12-01000000-4242.err").write_text(FAULT)
    (tmp_path / "python-core-worker-ab12_4242.log").write_text(
        "[2026 I 4242 4242] core_worker.cc: ok\n[2026 E 4242 4242] logging.cc:474: *** SIGSEGV received at time=1\n")
    (tmp_path / "worker-cd34-01000000-4243.err").write_text("unrelated\n")
    said = postmortem.explain(4242, str(tmp_path), same_machine=True)
    assert "it received SIGSEGV" in said and "Fatal Python error: Segmentation fault" in said, said
    assert "actor.py\", line 10 in update" in said and "unrelated" not in said and "no crash" not in said, said


def test_a_sigkill_leaves_no_report_and_the_error_says_so(tmp_path):
    proc = subprocess.Popen(["sleep", "30"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (tmp_path / f"worker-ab12-01000000-{proc.pid}.err").write_text(":job_id:01000000\nstep 3\n")
    said = postmortem.explain(proc.pid, str(tmp_path), same_machine=True)
    assert "no crash was recorded" in said and "SIGKILL" in said and "step 3" in said, said


def test_a_worker_elsewhere_adds_nothing(tmp_path):
    assert postmortem.explain(4242, None, same_machine=False) == ""
    # the logs of a node that is not the driver's are not here: nothing is claimed about them
    assert "no crash" not in postmortem.explain(4242, None, same_machine=True)


def test_a_kill_by_identity_spares_a_process_that_got_the_pid():
    """megarl.runtime.processes.kill_exactly signals the process it was given (PID and start
    time), never another that holds the same PID later: a run's cleanup kills what it noted
    minutes before, and the suite's PIDs wrap around several times."""
    from megarl.runtime.processes import identity, kill_exactly

    proc = subprocess.Popen(["sleep", "30"])
    try:
        pid, started = identity(proc.pid)
        assert not kill_exactly((pid, str(int(started) - 1)))  # an earlier process of that number
        assert proc.poll() is None
        assert kill_exactly((pid, started))
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert not kill_exactly((pid, started))  # reaped: nothing of that identity is left


def test_descendants_of_several_processes_in_one_pass():
    """The watchdog's view of a run (megarl.runtime.processes.run_processes, every second): every
    tagged process's descendants, grandchildren too, from one pass over /proc."""
    from megarl.runtime.processes import descendants

    shell = "sleep 30 & sleep 30 & wait"
    roots = [subprocess.Popen(["bash", "-c", shell]) for _ in range(2)]
    try:
        for _ in range(100):  # each shell has started its two sleeps
            if all(len(descendants(r.pid)) == 2 for r in roots):
                break
            subprocess.run(["sleep", "0.05"])
        mine = [set(descendants(r.pid)) for r in roots]
        assert all(len(m) == 2 for m in mine) and not mine[0] & mine[1], mine
        assert set(descendants(*(r.pid for r in roots))) == mine[0] | mine[1]
        outer = subprocess.Popen(["bash", "-c", f"bash -c '{shell}' & wait"])
        try:
            for _ in range(100):
                if len(descendants(outer.pid)) == 3:  # the inner shell and its two sleeps
                    break
                subprocess.run(["sleep", "0.05"])
            assert len(descendants(outer.pid)) == 3
            assert descendants() == []
        finally:
            for pid in descendants(outer.pid):
                subprocess.run(["kill", "-9", str(pid)])
            outer.kill()
            outer.wait()
    finally:
        for r in roots:
            for pid in descendants(r.pid):
                subprocess.run(["kill", "-9", str(pid)])
            r.kill()
            r.wait()
