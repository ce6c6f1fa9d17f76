"""Registries: lookup, duplicate names, and errors that list what exists."""

from __future__ import annotations

import pytest

from megarl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, Registry


def test_register_get_names():
    reg: Registry = Registry("widget")

    @reg.register("b")
    def b() -> int:
        return 2

    reg.register("a")(lambda: 1)
    assert reg.get("b") is b
    assert reg.names() == ["a", "b"]
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(lambda: 3)


@pytest.mark.parametrize("registry, kind, expected", [
    (ADVANTAGE_ESTIMATORS, "advantage estimator", ["gae", "grpo", "rloo", "reinforce_pp", "remax"]),
    (POLICY_LOSSES, "policy loss", ["ppo", "gspo"]),
    (KL_ESTIMATORS, "KL estimator", ["k1", "k2", "k3"]),
])
def test_unknown_name_lists_available(registry, kind, expected):
    with pytest.raises(KeyError) as err:
        registry.get("nope")
    message = str(err.value)
    assert f"unknown {kind} 'nope'" in message
    for name in expected:
        assert name in message
