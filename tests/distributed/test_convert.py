"""HF <-> Megatron conversion of tiny random models of every architecture (made with
transformers from a config, no hub): logits parity with transformers (max abs diff <= 1e-4,
fp32), a bit-exact HF -> Megatron -> HF round trip, conversion in one layout and loading in
another, streaming export by several ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.distributed.launch import ROOT, torchrun

WORKER = "tests/distributed/convert_worker.py"
TOL = 1e-4
DENSE = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
MOE = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"]
# Variants that exercise shared transforms: vocabulary padding (250 -> 256) and tied embeddings.
VARIANTS = {"tiny-llama": {"vocab_size": 250}, "tiny-qwen2": {"tie_word_embeddings": True}}
SPECS = {  # world size -> name@tp,pp,ep
    1: [f"{n}@1,1,1" for n in DENSE + MOE],
    2: [f"{n}@2,1,1" for n in DENSE + MOE] + [f"{n}@1,2,1" for n in DENSE + MOE] + [f"{n}@1,1,2" for n in MOE],
    4: [f"{n}@2,2,1" for n in DENSE] + [f"{n}@2,1,2" for n in MOE[:2]] + ["tiny-deepseek-v3@1,2,2"],
}


def make_hf_model(name: str, out: Path) -> None:
    config = json.loads((ROOT / "configs" / "models" / f"{name}.json").read_text())
    config.update(VARIANTS.get(name, {}))
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    model.save_pretrained(out)


def parse(output: str):
    return [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("convert")
    for name in DENSE + MOE:
        make_hf_model(name, work / "hf" / name)
    converted = []
    for world, specs in SPECS.items():
        converted += parse(torchrun(world, WORKER, "convert", str(work), *specs))
    assert len(converted) == sum(len(s) for s in SPECS.values())
    return work


@pytest.fixture(scope="module")
def results(work):
    return {tp: parse(torchrun(tp, WORKER, "logits", str(work))) for tp in (1, 2)}


def test_every_conversion_was_checked(results):
    expected = sum(len(s) for s in SPECS.values())
    assert all(len(records) == expected for records in results.values())


@pytest.mark.parametrize("load_tp", [1, 2])
def test_logits_match_transformers(results, load_tp):
    bad = {r["tag"]: r["max_abs_diff"] for r in results[load_tp] if not r["max_abs_diff"] <= TOL}
    assert not bad, f"logits differ from transformers by more than {TOL} (loaded at tp={load_tp}): {bad}"


def test_round_trip_is_bit_exact_and_loadable(results):
    for record in results[1]:
        trip = record["round_trip"]
        assert trip["same_names"] and not trip["differing"] and trip["index"], (record["tag"], trip)
        assert record["round_trip_logits_diff"] == 0.0, record["tag"]


def test_tied_and_padded_variants_were_covered(work):
    assert json.loads((work / "hf" / "tiny-qwen2" / "config.json").read_text())["tie_word_embeddings"]
    from safetensors import safe_open
    rt = next((work / "rt").glob("tiny-llama-t2*"))
    with safe_open(next(rt.glob("*.safetensors")), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == 250
