"""The reward runner: per-sample time limits in worker processes, hung functions killed, bad
rewards counted and scored 0, the prompt and extra fields passed, counts in a step's metrics."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megarl.config import AlgorithmConfig
from megarl.data.datasets import PromptRecord
from megarl.data.tokenizer import DigitTokenizer
from megarl.rewards import RewardPool, RewardSample
from megarl.runtime.processes import exited as gone
from megarl.rollout import Response
from megarl.trainer.steps import PromptStream, Scorer, sample_step

FNS = "tests.unit.reward_fns"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_only_samples_past_the_limit_time_out():
    # 2 workers, both first busy with a hung sample: the six 0.2 s samples queue behind them for
    # the whole 1 s limit, so timing from submission would have scored them all as timeouts.
    pool = RewardPool(f"{FNS}:sleepy", workers=2, timeout_s=1.0)
    first = list(pool.workers)
    hung = [w.proc.pid for w in first]
    try:
        start = time.monotonic()
        report = pool.score([RewardSample("hang", 0)] * 2 + [RewardSample("fast", 0)] * 6)
        elapsed = time.monotonic() - start
        assert report.scores == [0.0, 0.0] + [1.0] * 6
        assert report.timeouts == 2 and report.failed == 0
        assert not any(alive(pid) for pid in hung)  # killed and replaced
        assert len(pool.workers) == 2 and all(w.proc.poll() is None for w in pool.workers)
        # The workers' start (measured: it grows with the host's load) + the 1 s limit + the
        # replacements' start + 3 x 0.2 s
        starts = max(w.start_s for w in first) + max(w.start_s for w in pool.workers)
        assert elapsed < starts + 1.0 + 0.6 + 0.5, (elapsed, starts)
        replacements = [w.proc.pid for w in pool.workers]
    finally:
        pool.close()
    assert not any(alive(pid) for pid in replacements)  # close() leaves no process behind


def test_driver_exits_promptly_with_a_hanging_function(tmp_path):
    # The run is interrupted while the function hangs (limit 1 h): the driver still exits at
    # once and takes the hung worker with it.
    script = textwrap.dedent(f"""
        import signal
        from megarl.rewards import RewardPool, RewardSample
        pool = RewardPool("{FNS}:sleepy", workers=1, timeout_s=3600)
        print(pool.workers[0].proc.pid, flush=True)
        def stop(*_):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, stop)
        signal.alarm(1)
        pool.score([RewardSample("hang", 0)])
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    elapsed = time.monotonic() - start
    pid = int(done.stdout.split()[0])
    try:
        assert "KeyboardInterrupt" in done.stderr and elapsed < 5.0, (elapsed, done.stderr[-500:])
        assert not alive(pid)
    finally:
        if alive(pid):
            os.kill(pid, 9)


def test_bad_rewards_are_counted_failures_scored_zero():
    kinds = ["nan", "inf", "-inf", "str", "none", "raise", "exit", "int", "ok"]
    pool = RewardPool(f"{FNS}:misbehaving", workers=2, timeout_s=5.0)
    try:
        report = pool.score([RewardSample(k, 0) for k in kinds])
        report2 = pool.score([RewardSample("ok", 0)])  # the pool survives a crashed worker
    finally:
        pool.close()
    assert report.scores == [0.0] * 7 + [2.0, 0.5]
    assert dict(report.failures) == {"non-finite": 3, "non-numeric": 2, "exception": 1, "crashed": 1}
    assert report.failed == 7 and report.timeouts == 0
    assert "RuntimeError: bad sample" in report.examples["exception"]
    assert report2.scores == [0.5] and report2.failed == 0


def test_a_crashed_worker_is_named_by_its_exit_code_and_its_group_killed_before_it_is_reaped(tmp_path, monkeypatch):
    """A function that kills its worker (exit code 3) after starting a child: the sample is counted
    as crashed with the worker's exit code, the child (in the worker's process group) is killed,
    and the group is signalled while the dead worker is still unreaped, so its PID, the group's
    ID, cannot yet belong to another process (reaping first, as before, let a new process-group
    leader be given that number and be killed in its place)."""
    import megarl.rewards.runner as runner

    real, signalled = os.killpg, []

    def killpg(pgid, sig):
        signalled.append((pgid, os.path.exists(f"/proc/{pgid}")))
        real(pgid, sig)

    monkeypatch.setattr(runner.os, "killpg", killpg)
    pool = RewardPool(f"{FNS}:crash_leaving_child", workers=1, timeout_s=5.0)
    crashed = pool.workers[0].proc.pid
    try:
        report = pool.score([RewardSample(str(tmp_path / "child.pid"), 0)])
    finally:
        pool.close()
    assert dict(report.failures) == {"crashed": 1} and "exit code 3" in report.examples["crashed"], report
    assert (crashed, True) in signalled, signalled
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child)


@pytest.mark.parametrize("fn,score", [("with_context", 2 + 7.0), ("keyword_prompt_only", 2.0),
                                      ("any_keywords", 1.0), ("two_arguments", 1.0)])
def test_function_gets_prompt_and_extra_when_it_takes_them(fn, score):
    pool = RewardPool(f"{FNS}:{fn}", workers=1, timeout_s=5.0)
    try:
        report = pool.score([RewardSample("42", "42", prompt="p?", extra={"level": 7})])
    finally:
        pool.close()
    assert report.scores == [score] and report.failed == 0


def test_a_function_that_cannot_load_in_a_worker_is_named():
    pool = RewardPool("tests.unit.no_such_module:fn", workers=1, timeout_s=5.0)
    with pytest.raises(ValueError, match="tests.unit.no_such_module:fn' cannot be loaded in a worker process"):
        pool.score([RewardSample("1", 1)])


def test_scorer_counts_reach_the_step_metrics():
    tok = DigitTokenizer()

    class Rollout:  # responses "1", "2", "3", "4" to each prompt
        def generate(self, prompts, sampling):
            return [Response(p, s, tok.encode(str(s + 1)) + [tok.eos_token_id], [-0.5] * 2, "stop")
                    for p in range(len(prompts)) for s in range(sampling.n)]

    algo = AlgorithmConfig(reward_fn=f"{FNS}:by_digit", samples_per_prompt=4, max_new_tokens=4, reward_workers=2)
    records = [PromptRecord(f"{k}=", str(k), f"t:{k}", {"level": k}) for k in range(10, 13)]
    scorer = Scorer(algo, tok)
    try:
        sampled = sample_step(Rollout(), PromptStream(records, tok, seed=0, max_prompt_tokens=16), scorer, algo,
                              prompts_per_step=2, seed=0, eos_token_ids=[tok.eos_token_id])
        levels = [float(r.extra["level"]) for r in sampled.records]
        assert sampled.raw_scores.tolist() == [0.0, 0.0, 0.0, levels[0], 0.0, 0.0, 0.0, levels[1]]
        assert torch.isfinite(sampled.scores).all()
        assert sampled.reward_metrics == {"reward/failures": 6, "reward/timeouts": 0}
        assert scorer.failures == 6 and scorer.take_metrics() == {"reward/failures": 0, "reward/timeouts": 0}
    finally:
        scorer.close()


def test_scorer_checks_its_settings():
    with pytest.raises(ValueError, match="algorithm.reward_workers=0 must be >= 1"):
        Scorer(AlgorithmConfig(reward_workers=0), DigitTokenizer())
    with pytest.raises(ValueError, match="algorithm.reward_fn: unknown reward function 'nope'"):
        Scorer(AlgorithmConfig(reward_fn="nope"), DigitTokenizer())
