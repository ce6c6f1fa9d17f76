"""``megarl export-hf RUN_DIR OUT [--adapter]``: the actor of a run's newest usable checkpoint as a Hugging
Face directory that transformers and SGLang load as is, through the same converter as
``megarl convert mcore-to-hf``: weights, config.json, generation_config.json and the tokenizer."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple

from megarl.checkpoint.convert import mcore_to_hf
from megarl.checkpoint.hf_io import CheckpointFileError
from megarl.checkpoint.load import locate
from megarl.checkpoint.lora_export import export_lora
from megarl.config import ConfigError, load_config
from megarl.trainer.checkpoint import Checkpoints


def side_file_sources(model_cfg, data_cfg, where: str) -> Tuple[Path, Optional[Path]]:
    """(the model config: a config.json or its directory, the tokenizer directory or None) of a
    run's config snapshot ``where``: ``model.hf_config`` (stored absolute, and filled from
    ``model.path`` by ``megarl train``), else ``model.path``'s config; ``data.tokenizer``."""
    path = getattr(model_cfg, "path", None)
    if model_cfg.hf_config:
        config = _existing(model_cfg.hf_config, "model.hf_config", where)
    elif path:
        config = locate(_existing(path, "model.path", where), "model.path").config
    else:
        raise ConfigError(f"{where} names neither model.hf_config nor model.path: the exported "
                          f"config.json would be unknown")
    tokenizer = _existing(data_cfg.tokenizer, "data.tokenizer", where) if data_cfg.tokenizer else None
    return config, tokenizer


def _existing(path: str, field: str, where: str) -> Path:
    p = Path(path)
    if not p.exists():
        relative = "" if p.is_absolute() else " (a relative path: run the export from the run's working directory)"
        raise ConfigError(f"{field}={path} in {where} does not exist{relative}")
    return p


def export_hf(run_dir, out_dir, dtype: str = "auto", adapter: bool = False) -> Path:
    """Write the newest checkpoint's actor to ``out_dir``; returns that checkpoint. One whose
    files differ from its manifest is refused (:class:`CheckpointFileError`, naming the file)
    rather than silently exporting an older one. A LoRA run (``model.lora.rank`` > 0) exports
    its adapters merged into ``model.path``'s base, or with ``adapter`` as a PEFT adapter directory
    (megarl.checkpoint.lora_export)."""
    checkpoints = Checkpoints(run_dir)
    path = checkpoints.newest()
    if path is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint (set trainer.save_interval to write them)")
    if not path.is_dir():
        raise FileNotFoundError(f"{path}, named by {checkpoints.root / 'latest'}, is missing")
    try:
        checkpoints.verify(path)
    except CheckpointFileError as exc:
        older = [p.name for p in checkpoints.complete() if p != path]
        hint = (f"; an older one may be intact: megarl convert mcore-to-hf {path.parent / older[0] / 'actor'} OUT "
                f"--hf-config DIR" if older else "")
        raise CheckpointFileError(f"{exc}{hint}") from None
    cfg = load_config([path / "config.yaml"])
    config, tokenizer = side_file_sources(cfg.model, cfg.data, str(path / "config.yaml"))
    if cfg.model.lora.rank:
        export_lora(path, cfg, Path(out_dir), dtype, adapter, config, tokenizer)
        return path
    if adapter:
        raise ConfigError(f"--adapter: the run {run_dir} trained no LoRA adapters (model.lora.rank=0 in "
                          f"{path / 'config.yaml'}); export without --adapter")
    if config.is_dir() or config.name == "config.json":  # an HF directory: its generation config, tokenizer
        config_dir = config if config.is_dir() else config.parent
        mcore_to_hf(path / "actor", out_dir, dtype=dtype, hf_config_dir=config_dir, tokenizer_dir=tokenizer,
                    hashes=False)  # verified above
        return path
    with tempfile.TemporaryDirectory() as hf_dir:  # a lone json file (configs/models/tiny-llama.json)
        shutil.copy2(config, Path(hf_dir) / "config.json")
        mcore_to_hf(path / "actor", out_dir, dtype=dtype, hf_config_dir=hf_dir, tokenizer_dir=tokenizer,
                    hashes=False)  # verified above
    return path
