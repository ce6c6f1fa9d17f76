"""Resuming a run with another config: before any process starts, the run's newest checkpoint's
``config.yaml`` is compared with the new config. What the checkpoint cannot take (another model
architecture or padded vocabulary, a trained role appearing or going) is refused by name; every
other change is listed in one warning. Layout changes stay allowed (a checkpoint loads into any
layout)."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from megarl.algorithms.presets import preset, resolve
from megarl.config import ConfigError, MegarlConfig, load_config
from megarl.models.hf_config import megatron_args_from_hf, padded_vocab_size
from megarl.trainer.checkpoint import Checkpoints

# Changes a resume makes by design: not listed.
EXPECTED = {"trainer.train_steps"}
# The architecture: MegatronModelArgs fields that decide the weights' names and shapes.
ARCHITECTURE = ("model_type", "config_kwargs", "vocab_size", "tie_word_embeddings", "mla")


def flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    """A config tree as ``{"optimizer.lr": 0.003, ...}`` (enums as their values)."""
    if dataclasses.is_dataclass(node):
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(node):
            out.update(flatten(getattr(node, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix[:-1]: node.value if isinstance(node, enum.Enum) else node}


def config_changes(saved: MegarlConfig, new: MegarlConfig) -> Dict[str, Tuple[Any, Any]]:
    """Fields whose values differ: name -> (saved, new); the expected ones left out."""
    old, now = flatten(saved), flatten(new)
    return {k: (old.get(k), now.get(k)) for k in sorted(set(old) | set(now))
            if k not in EXPECTED and old.get(k) != now.get(k)}


def incompatible(saved: MegarlConfig, new: MegarlConfig) -> List[str]:
    """What a checkpoint of ``saved`` cannot be loaded into under ``new``, one phrase each."""
    out = []
    before, after = megatron_args_from_hf(saved.model.hf_config), megatron_args_from_hf(new.model.hf_config)
    for name in ARCHITECTURE:
        a, b = getattr(before, name), getattr(after, name)
        if isinstance(a, dict):
            out += [f"model.hf_config: {name}.{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
                    if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"model.hf_config: {name} {a!r} -> {b!r}")
    pad = (padded_vocab_size(before.vocab_size, saved.model.make_vocab_size_divisible_by),
           padded_vocab_size(after.vocab_size, new.model.make_vocab_size_divisible_by))
    if pad[0] != pad[1] and before.vocab_size == after.vocab_size:
        out.append(f"model.make_vocab_size_divisible_by: padded vocabulary {pad[0]} -> {pad[1]}")
    critic = [preset(resolve(c.algorithm)).critic for c in (saved, new)]
    if critic[0] != critic[1]:
        out.append(f"algorithm.name={new.algorithm.name}: the checkpoint {'has' if critic[0] else 'has no'} critic, "
                   f"this algorithm {'trains' if critic[1] else 'has'} {'one' if critic[1] else 'none'}")
    return out


def check_resume(cfg: MegarlConfig) -> Optional[str]:
    """Compare ``cfg`` (resolved, as saved with checkpoints) with the config of the checkpoint a run
    in ``trainer.run_dir`` would resume from. Raises :class:`ConfigError` naming what the checkpoint
    cannot take; returns the warning listing the other changes (None when there is none)."""
    if not cfg.trainer.resume:
        return None
    path = Checkpoints(cfg.trainer.run_dir, cfg.trainer.keep_checkpoints).newest()
    if path is None or not (path / "config.yaml").is_file():
        return None
    try:
        saved = load_config([path / "config.yaml"])
        refused = incompatible(saved, cfg)
    except (ConfigError, OSError, ValueError) as err:  # a config of an older schema, a moved HF config
        return f"could not compare the config with {Path(path) / 'config.yaml'}: {err}"
    if refused:
        raise ConfigError(
            f"trainer.run_dir={cfg.trainer.run_dir} holds {path.name} of a run the checkpoint cannot resume under "
            f"this config: {'; '.join(refused)}. Use another trainer.run_dir for the new run, or the run's own "
            f"settings ({path / 'config.yaml'}) to resume it")
    changes = config_changes(saved, cfg)
    if not changes:
        return None
    listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
    return f"resuming {path} with a config that differs from its own ({len(changes)} fields): {listed}"
