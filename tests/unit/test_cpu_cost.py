"""benchmarks/cpu_cost.py's prediction: the collectives it counts per phase (as counted in a tp=2
log-prob pass and update of the demo: 12 per micro-batch forward, 15 more in its backward, 3 per
optimizer step at dp=1 and 4 more plus the gradient all-reduce at dp>1; generate's two world-wide
all-gathers; the weight sync's two world-wide all-reduces and one exchange), the core share, and
the non-negative fit of the generation costs."""

import math

import pytest

from benchmarks import cpu_cost
from megarl.config import load_config

PHASES = ("generate", "old_log_prob", "actor_update", "weight_sync")


@pytest.fixture(scope="module")
def shape():
    return cpu_cost.demo_shape(load_config([cpu_cost.DEMO]))


def constants(latency: float, share: float = 1.0, engine: float = 0.0) -> dict:
    """Every gloo message costs ``latency`` (no bandwidth term); the engines' per-call /
    per-micro-batch / per-step costs and the weight sync's CPU seconds are ``engine``."""
    fit = {"latency_s": latency, "bytes_per_s": math.inf}
    comm = {name: fit for name in ("p2p", "all_reduce", "all_gather", "reduce_scatter")}
    ray = {w: 0.0 for w in (2, 4)}
    layout = {"world_latency_s": {"all_reduce": latency, "all_gather": latency}, "sync_cpu_s": engine}
    return {"flops_per_s": math.inf, "cores": 2, "ray_call_s": ray, "ray_bare_s": ray, "ray_generate_s": ray,
            "comm": {w: {**comm, **layout, "cpu_share": share} for w in (2, 4)},
            **{k: engine for k in ("gen_call_s", "gen_step_s", "gen_row_step_s", "fwd_call_s", "fwd_micro_s",
                                   "upd_call_s", "upd_micro_s")}}


@pytest.mark.parametrize("world", [2, 4])
def test_counted_collectives(shape, world):
    p = cpu_cost.predict(constants(1.0), shape, world, 2, response_mean=4.0, response_max=5.0,
                         sync_bytes=1000.0)
    micro = p["detail"]["micro_batches"]
    assert micro == (2 if world == 2 else 1)  # 128 rows x 9 tokens at a 1024-token budget, over dp
    assert p["old_log_prob"] == pytest.approx(12 * micro, abs=1e-9)
    step = 3 if world == 2 else 3 + 4 + 1
    assert p["actor_update"] == pytest.approx(27 * micro + step, abs=1e-9)
    # the responses' all_gather_object: the sizes, then the payload, each one world-wide all-gather
    assert p["generate"] == pytest.approx(2, abs=1e-9)
    # the changed flags' and the memory peaks' all-reduces, then the exchange with the peer
    assert p["weight_sync"] == pytest.approx(3, abs=1e-9)


def test_engine_cost_over_core_share(shape):
    full = cpu_cost.predict(constants(0.0, 1.0, 0.001), shape, 2, 2, 4.0, 5.0, 0.0)
    half = cpu_cost.predict(constants(0.0, 0.5, 0.001), shape, 2, 2, 4.0, 5.0, 0.0)
    for phase in PHASES:
        assert full[phase] > 0
        assert half[phase] == pytest.approx(2 * full[phase], rel=1e-12)
    # the share the run got, when given, replaces the microbenchmark's
    assert cpu_cost.predict(constants(0.0, 1.0, 0.001), shape, 2, 2, 4.0, 5.0, 0.0, core_share=0.5) == half


def test_nonnegative_line():
    # an exact line is recovered
    assert cpu_cost.nonnegative_line([32, 64, 128], [1.0 + 0.5 * x for x in (32, 64, 128)]) == \
        pytest.approx((1.0, 0.5), rel=1e-12)
    # noise that would make the free fit's intercept negative: through the origin instead
    # (free fit: slope 0.0125, intercept -0.2; through the origin: sum(xy) / sum(x^2))
    xs, ys = [32, 64, 128], [0.2, 0.6, 1.4]
    intercept, slope = cpu_cost.nonnegative_line(xs, ys)
    assert intercept == 0.0
    assert slope == pytest.approx((32 * 0.2 + 64 * 0.6 + 128 * 1.4) / (32 ** 2 + 64 ** 2 + 128 ** 2), rel=1e-12)
    # a falling line: a constant at the mean
    assert cpu_cost.nonnegative_line(xs, [3.0, 2.0, 1.0]) == pytest.approx((2.0, 0.0), abs=1e-12)
