"""What an external inference engine (SGLang, vLLM) starts from: an HF directory with the
model's ``config.json`` (and the tokenizer's files, if any), and the environment its processes
inherit. Its weights come from the trainer at the first sync, so the directory holds none."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Optional

import torch

from megarl.checkpoint.hf_files import export_config


def write_hf_dir(hf_config: Dict, dtype: torch.dtype, tokenizer: Optional[str] = None, prefix: str = "megarl-engine-") -> str:
    """A directory an engine starts from: ``config.json`` as the HF export writes it (the model
    type's causal-LM class in ``architectures``, ``dtype``/``torch_dtype``) and the tokenizer's
    files, if any. Written under a temporary name, then renamed (never half-written)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    partial = root / "partial"
    partial.mkdir()
    if tokenizer is not None:
        source = Path(tokenizer)
        if not source.is_dir():
            raise FileNotFoundError(f"data.tokenizer={tokenizer} is not a directory")
        for file in source.iterdir():
            if file.is_file() and file.name != "config.json":
                shutil.copy2(file, partial / file.name)
    (partial / "config.json").write_text(json.dumps(export_config(hf_config, dtype), indent=2))
    os.replace(partial, root / "hf")
    return str(root / "hf")


@contextlib.contextmanager
def engine_env(values: Dict[str, Optional[str]]) -> Iterator[None]:
    """``values`` in the environment while an engine starts (its processes inherit them; None:
    the variable is unset meanwhile), this process's own environment back afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
