"""Exit codes that do not depend on teardown (issue 25, item 2): the converter's named error exits
2 every time, also beside CPU hogs (a failing multi-rank ``megarl train``, the same:
tests/faults/test_interrupted_runs.py). The abort this guards against (``terminate called without an
active exception``, SIGABRT, once in seven runs of ``make test``) came from process groups left
alive to interpreter exit; every entry point now destroys them on its way out
(``megarl.runtime.torn_down``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = 3


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory) -> Path:
    """An HF Llama whose layer-2 down_proj has the wrong shape."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("hf")
    config = json.loads((ROOT / "configs/models/tiny-llama.json").read_text())
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    weights["model.layers.2.mlp.down_proj.weight"] = weights["model.layers.2.mlp.down_proj.weight"][:, :100].contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_named_error_exits_2_every_time_under_load(mismatched, tmp_path):
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 120\nwhile time.time() < end: pass"])
            for _ in range(2)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    try:
        codes = []
        for i in range(RUNS):
            proc = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", "hf-to-mcore", str(mismatched),
                                   str(tmp_path / f"out{i}")], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=300)
            codes.append(proc.returncode)
            assert "model.layers.2.mlp.down_proj.weight" in proc.stderr, proc.stderr[-2000:]
            assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert codes == [2] * RUNS

