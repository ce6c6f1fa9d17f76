"""A training state saved in one layout resumes in another (4 ranks on CPU): weights, the
distributed optimizer's moments and fp32 weights, the LR schedule and Adam's step. The weights'
layout-independent checksum is unchanged by the move (1e-12), and the resumed
run's losses equal the uninterrupted run's within 1e-5 (relative; layouts differ only in the
order of float reductions), while zeroing the restored moments moves the second loss by far more,
so the optimizer state is what makes them equal. The bucket-space format refuses a tp change
with a message that says what to do, and resumes exactly in its own layout."""

import functools
import json

from tests.distributed.launch import torchrun

TOL = 1e-5


MODES = ("relayout", "refusal", "async")


@functools.lru_cache(maxsize=None)  # one session for every worker mode, shared by the tests
def session():
    out = torchrun(4, "tests/distributed/train_ckpt_worker.py", *MODES)
    return [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]


def results(which):
    return [r for r in session() if r["mode"] == which]


def close(a, b, tol=TOL):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


def test_resume_into_another_layout():
    records = results("relayout")
    assert len(records) == 4
    for r in records:
        assert not r["exact_layout"] and r["lr"][0] == r["lr"][1], r
        assert close(r["resumed"], r["reference"]), r
        saved, *loaded = r["checksums"]  # float64 sums of squares of every distinct weight
        assert all(abs(c - saved) <= 1e-12 * saved for c in loaded), r
        # Moments matter: without them the step after the first update lands elsewhere.
        assert abs(r["moments_zeroed"][1] - r["reference"][1]) > 100 * TOL * r["reference"][1], r
        assert r["reference"][1] < r["before"][0], r  # it trains


def test_bucket_format_refuses_a_tp_change_and_resumes_in_place():
    r = results("refusal")[0]
    assert r["error"] and "dp_reshardable" in r["error"] and "tp=2→1" in r["error"], r
    assert "trainer.checkpoint_format=reshardable" in r["error"], r
    assert r["exact_layout"] and r["resumed"] == r["reference"], r


def test_async_save_holds_the_weights_of_its_moment():
    (r,) = results("async")
    assert r["pending_after_save"] == 1 and r["finalized"] == [0], r
    assert r["exact_layout"] and r["resumed"] == r["reference"], r
    # every rank hashed its files in its background writer; only what rank 0 writes at
    # finalize (after the writers) is left to the driver's manifest
    assert r["hashes"] == {"ranks": [f"rank_{i}" for i in range(4)], "uncovered": [".metadata", "metadata.json"],
                           "wrong": []}, r["hashes"]


def test_te_fused_adam_resumes_bit_exactly():
    """Transformer Engine's FusedAdam (megarl.testing.fused_adam: its step in param_group["step"],
    only exp_avg and exp_avg_sq per parameter), with the distributed optimizer (model-space format)
    and without: the checkpoint saves and restores its step, and the 2 steps after the resume equal
    the uninterrupted run's losses and weights bit for bit (Adam's bias correction continues)."""
    cases = [r for r in results("refusal") if r.get("case") == "fused_adam"]
    assert [r["distributed"] for r in cases] == [True, False]
    for r in cases:
        assert r["optimizer"] == r["expected"], r
        assert r["error"] is None, r
        assert r["saved_steps"] == [2.0] and r["restored_steps"] == [2.0], r
        assert r["resumed"] == r["reference"] and r["weights_equal"], r
