"""``megarl export-hf RUN_DIR OUT``: the actor of a run's newest usable checkpoint as a Hugging
Face checkpoint, through the same converter as ``megarl convert mcore-to-hf``."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from megarl.checkpoint.convert import mcore_to_hf
from megarl.config import load_config
from megarl.trainer.checkpoint import Checkpoints


def export_hf(run_dir, out_dir, dtype: str = "auto") -> Path:
    found = Checkpoints(run_dir).latest()
    if found is None:
        raise FileNotFoundError(f"{run_dir} has no usable checkpoint (set trainer.save_interval to write them)")
    path, _ = found
    cfg = load_config([path / "config.yaml"])
    source = Path(cfg.model.hf_config)
    with tempfile.TemporaryDirectory() as hf_dir:
        if source.is_dir():  # config.json and tokenizer files
            for file in source.iterdir():
                if file.is_file():
                    shutil.copy2(file, Path(hf_dir) / file.name)
        else:
            shutil.copy2(source, Path(hf_dir) / "config.json")
        mcore_to_hf(path / "actor", out_dir, dtype=dtype, hf_config_dir=hf_dir)
    return path
