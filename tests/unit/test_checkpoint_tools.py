"""The pure parts of checkpoint_tools/ (``megarl convert`` with job lists, verify, inspect): list files
and their errors (exit 2, the line named), a slice's config and layer count, and the diff of two
checkpoints on small HF directories written here. The tools on real conversions:
tests/distributed/test_convert.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from megarl.checkpoint.cli import main
from megarl.checkpoint.inspection import diff
from megarl.checkpoint.jobs import read_jobs, select_jobs
from megarl.parallel.layout import Layout


def test_a_job_list_skips_comments_and_names_a_bad_line(tmp_path):
    listed = tmp_path / "jobs.txt"
    listed.write_text("# models\n/hf/a /mc/a\n\n/hf/b /mc/b   # the second\n")
    jobs = read_jobs(listed)
    assert [(str(j.source), str(j.output), j.where) for j in jobs] == [
        ("/hf/a", "/mc/a", f"{listed}:2"), ("/hf/b", "/mc/b", f"{listed}:4")]
    assert select_jobs(jobs, 1, listed) == [jobs[1]] and select_jobs(jobs, None, listed) == jobs
    with pytest.raises(ValueError, match=r"--index 2 is outside .* 2 entries \(0\.\.1\); submit .* --array=0-1"):
        select_jobs(jobs, 2, listed)
    listed.write_text("/hf/a /mc/a\n/hf/b\n")
    with pytest.raises(ValueError, match=rf"{listed}:2: expected 'SRC DST', got 1 field"):
        read_jobs(listed)
    listed.write_text("# nothing\n")
    with pytest.raises(ValueError, match="has no 'SRC DST' entries"):
        read_jobs(listed)


@pytest.mark.parametrize("argv, words", [
    (["hf-to-mcore", "--list", "{bad}"], ["{bad}:1: expected 'SRC DST'"]),
    (["mcore-to-hf", "--list", "{good}", "--index", "5"], ["--index 5 is outside"]),
    (["hf-to-mcore", "/hf/a", "--list", "{good}"], ["give SRC DST or --list FILE, not both"]),
    (["verify", "/hf/a"], ["verify needs SRC DST"]),
    (["inspect", "/mc/a", "--index", "0"], ["--index picks an entry of --list FILE"]),
])
def test_bad_job_arguments_exit_2_naming_them(tmp_path, capsys, argv, words):
    (tmp_path / "bad.txt").write_text("one two three\n")
    (tmp_path / "good.txt").write_text("/hf/a /mc/a\n")
    argv = [a.format(bad=tmp_path / "bad.txt", good=tmp_path / "good.txt") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word.format(bad=tmp_path / "bad.txt") in err, err


def test_a_slice_is_the_first_layers_rounded_to_the_pipeline():
    from megarl.checkpoint.verify import first_layers_config, layers_to_check

    assert layers_to_check(None, 4, Layout()) == 4 and layers_to_check(9, 4, Layout()) == 4
    assert layers_to_check(1, 4, Layout()) == 1
    assert layers_to_check(1, 8, Layout(pp=2, dp=1)) == 2 and layers_to_check(3, 8, Layout(pp=2, dp=1, vpp=2)) == 4
    with pytest.raises(ValueError, match="--layers 0 must be at least 1"):
        layers_to_check(0, 4, Layout())
    hybrid = {"model_type": "qwen3_next", "num_hidden_layers": 4,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    assert first_layers_config(hybrid, 2) == {**hybrid, "num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2}
    assert hybrid["num_hidden_layers"] == 4  # a copy
    wrapped = {"model_type": "qwen3_5_moe", "text_config": dict(hybrid), "vision_config": {"depth": 1}}
    assert first_layers_config(wrapped, 1)["text_config"]["layer_types"] == ["linear_attention"]


def _hf_dir(path, tensors):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_diff_names_what_differs_and_exits_1(tmp_path, capsys):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    nan = torch.tensor([1.0, math.nan])
    a = _hf_dir(tmp_path / "a", {"w": w, "b": torch.zeros(4), "gone": torch.ones(2), "nan": nan, "cast": w.clone()})
    moved = w.clone()
    moved[2, 1] += 1e-3
    b = _hf_dir(tmp_path / "b", {"w": moved, "b": torch.zeros(5), "new": torch.ones(2), "nan": nan.clone(),
                                 "cast": w.to(torch.bfloat16)})
    found, compared = diff(a, b)
    assert compared == 4
    assert [(d.name, d.what) for d in found] == [("gone", "only in A"), ("new", "only in B"), ("b", "shape"),
                                                 ("cast", "dtype"), ("w", "values")]
    assert found[-1].max_abs_diff == pytest.approx(1e-3, rel=1e-3) and found[3].max_abs_diff == 0.0
    assert main(["inspect", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "5 differences (4 tensors in both):" in out and "  values    w max |a - b| = 0.001" in out, out
    assert main(["inspect", str(a), str(a)]) == 0
    assert "same: 5 tensors" in capsys.readouterr().out
    assert main(["inspect", str(a)]) == 0
    out = capsys.readouterr().out
    assert "HF safetensors directory, 5 tensors" in out and "source config" in out and "model_type=llama" in out, out


def test_sample_prompts_use_the_tokenizer_else_seeded_ids(tmp_path):
    from megarl.checkpoint.verify import PROMPTS, RANDOM_PROMPTS, RANDOM_TOKENS, sample_prompts
    from tests.fixtures.hf_models import make_tokenizer

    rows = sample_prompts(tmp_path, 300)  # no tokenizer here
    assert [tuple(r.shape) for r in rows] == [(RANDOM_TOKENS,)] * RANDOM_PROMPTS and max(r.max() for r in rows) < 300
    assert all(torch.equal(a, b) for a, b in zip(rows, sample_prompts(tmp_path, 300)))
    with pytest.raises(ValueError, match="--prompt needs a tokenizer"):
        sample_prompts(tmp_path, 300, ["hello"])
    make_tokenizer(tmp_path / "tok")
    assert [len(r) for r in sample_prompts(tmp_path / "tok", 300)] == [len(p.encode()) for p in PROMPTS]  # a token a byte
    assert sample_prompts(tmp_path / "tok", 300, ["hi"])[0].tolist() == list(b"hi")
