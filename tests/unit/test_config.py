"""Configuration: YAML + overrides round-trip; unknown keys and wrong types are named."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, MegarlConfig, ParallelConfig, load_config, to_yaml


def test_defaults_are_typed_dataclasses():
    cfg = load_config()
    assert isinstance(cfg, MegarlConfig)
    assert isinstance(cfg.parallel.actor, ParallelConfig)
    assert cfg.parallel.actor.etp is None and cfg.optimizer.lr == 1e-6


def test_yaml_then_overrides_then_round_trip(tmp_path):
    first = tmp_path / "a.yaml"
    first.write_text("parallel:\n  actor: {tp: 2, pp: 2}\noptimizer:\n  lr: 0.01\n")
    second = tmp_path / "b.yaml"
    second.write_text("optimizer:\n  lr: 0.02\ndata:\n  train_files: [x.jsonl, y.parquet]\n")
    cfg = load_config([first, second], ["parallel.rollout.tp=1", "trainer.seed=7", "model.params_dtype=float32"])
    assert (cfg.parallel.actor.tp, cfg.parallel.actor.pp) == (2, 2)
    assert cfg.optimizer.lr == 0.02  # later file wins
    assert cfg.data.train_files == ["x.jsonl", "y.parquet"]
    assert cfg.trainer.seed == 7 and cfg.model.params_dtype == "float32"

    dumped = tmp_path / "dump.yaml"
    dumped.write_text(to_yaml(cfg))
    assert load_config([dumped]) == cfg


@pytest.mark.parametrize("override, key", [
    ("parallel.actor.tpp=2", "parallel.actor.tpp"),
    ("optimizer.learning_rate=1", "optimizer.learning_rate"),
    ("nonsense=1", "nonsense"),
])
def test_unknown_key_is_named(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config([], [override])


@pytest.mark.parametrize("override, key", [
    ("optimizer.lr=fast", "optimizer.lr"),
    ("parallel.actor.tp=1.5", "parallel.actor.tp"),
    ("optimizer.use_distributed_optimizer=maybe", "optimizer.use_distributed_optimizer"),
])
def test_wrong_type_is_named(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config([], [override])


def test_bad_yaml_key_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*'trainer.stepz'"):
        load_config([bad])


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["/no/such.yaml"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config([], ["parallel.actor.tp"])


def test_shipped_configs_load():
    cfg = load_config(["configs/lm_demo.yaml"])
    assert cfg.parallel.actor.tp == 2 and cfg.trainer.nproc_per_node == 2
