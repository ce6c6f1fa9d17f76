"""HF <-> Megatron conversion of tiny random models of every architecture (made with
transformers from a config, no hub): logits parity with transformers (max abs diff <= 1e-4,
fp32), a bit-exact HF -> Megatron -> HF round trip, conversion in one layout and loading in
another, streaming export by several ranks. The conversions run through checkpoint_tools/
(hf_to_mcore.py, mcore_to_hf.py with a job list), and on four families (dense, MoE, MLA,
delta-net) verify.py passes at two layouts and fails on a copy with one tensor moved by 1e-3,
which inspect.py names; two ranks started by torchrun write what one rank writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

from tests.distributed.convert_worker import FAMILIES, PERTURBATION, PERTURBED
from tests.distributed.launch import ROOT, torchrun

WORKER = "tests/distributed/convert_worker.py"
TOL = 1e-4
DENSE = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
MOE = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3", "tiny-qwen2-moe", "tiny-glm4-moe", "tiny-qwen3-next",
       "tiny-qwen3-5-moe"]
# MoE with biased experts (GptOss): Megatron splits those only with etp=1, so tp > 1 needs ep > 1
# (the worker sets etp=1 whenever ep > 1, and loads these at tp = ep = world size). Its sliding
# window (8) is shorter than the test sequences (12 tokens), and its swiglu_limit (0.1) clamps.
BIASED_MOE = ["tiny-gpt-oss"]
# Variants that exercise shared transforms: vocabulary padding (250 -> 256) and tied embeddings.
VARIANTS = {"tiny-llama": {"vocab_size": 250}, "tiny-qwen2": {"tie_word_embeddings": True}}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 32}
SWA = 5  # tiny-mistral-swa's sliding window (the worker's TOKENS are 12)
# DeepSeek-V3 variants (a repo config plus overrides) for the MLA and routing settings megarl maps
# rather than refuses. Names must not contain "-t" (the worker splits the layout tag there).
DERIVED = {
    # Moonlight-style: a plain q_proj (no q-LoRA) and a single expert group (no group limit)
    "tiny-deepseek-v3-qnull": ("tiny-deepseek-v3", {"q_lora_rank": None, "n_group": 1, "topk_group": 1}),
    # group-limited routing with num_experts_per_tok // topk_group == 2 (scored alike by both)
    "tiny-deepseek-v3-groups": ("tiny-deepseek-v3", {"n_routed_experts": 8, "n_group": 4, "topk_group": 2,
                                                     "num_experts_per_tok": 4}),
    # sigmoid top-1 without renormalisation
    "tiny-deepseek-v3-unnormed": ("tiny-deepseek-v3", {"num_experts_per_tok": 1, "norm_topk_prob": False,
                                                       "n_group": 1, "topk_group": 1}),
    # GptOss's YaRN (untruncated, as gpt-oss-20b's; and truncated, transformers' default), with
    # larger weights so that attention, and the rope, matter: plain rope instead moves
    # transformers' logits by 0.86, truncate by 0.11, the attention factor (mscale) 1 by 0.60
    "tiny-gpt-oss-yarn": ("tiny-gpt-oss", {"initializer_range": 0.1, "rope_parameters": _YARN}),
    "tiny-gpt-oss-yarnfloor": ("tiny-gpt-oss", {"initializer_range": 0.1, "rope_parameters": {**_YARN, "truncate": True}}),
    # Mistral sliding every layer by a window of 5, shorter than the 12 test tokens
    "tiny-mistral-swa": ("tiny-mistral", {"sliding_window": SWA}),
}
SPECS = {  # world size -> name@tp,pp,ep
    1: [f"{n}@1,1,1" for n in DENSE + MOE + BIASED_MOE]
    + ["tiny-deepseek-v3-groups@1,1,1", "tiny-deepseek-v3-unnormed@1,1,1", "tiny-gpt-oss-yarn@1,1,1",
                                                 "tiny-gpt-oss-yarnfloor@1,1,1", "tiny-qwen3-5-moe-vl@1,1,1"],
    2: [f"{n}@2,1,1" for n in DENSE + MOE] + [f"{n}@1,2,1" for n in DENSE + MOE + BIASED_MOE]
    + [f"{n}@1,1,2" for n in MOE + BIASED_MOE] + [f"{n}@2,1,2" for n in BIASED_MOE]
    + ["tiny-deepseek-v3-qnull@2,1,1", "tiny-gpt-oss-yarn@2,1,2", "tiny-mistral-swa@2,1,1",
       "tiny-mistral-swa@1,2,1", "tiny-qwen3-5-moe-vl@2,1,1"],
    4: [f"{n}@2,2,1" for n in DENSE[:3]] + [f"{n}@2,1,2" for n in MOE[:2]] + ["tiny-deepseek-v3@1,2,2"]
    + ["tiny-deepseek-v3-qnull@1,2,2"],
}


# Qwen3.5's vision-language checkpoint (model_type qwen3_5_moe): megarl converts its text model
# (tiny-qwen3-5-moe's) and carries the vision tower into the export unchanged
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
WRAPPED = ["tiny-qwen3-5-moe-vl"]


def make_hf_model(name: str, out: Path) -> None:
    base, overrides = DERIVED.get(name, (name, VARIANTS.get(name, {})))
    if name in WRAPPED:
        base = name.removesuffix("-vl")
    config = json.loads((ROOT / "configs" / "models" / f"{base}.json").read_text())
    config.update(overrides)
    torch.manual_seed(sum(map(ord, name)))
    if name in WRAPPED:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

        model = transformers.AutoModelForImageTextToText.from_config(
            Qwen3_5MoeConfig(text_config=config, vision_config=VISION, tie_word_embeddings=False))
    else:
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    with torch.no_grad():  # transformers starts the expert-choice bias at 0: give it values that matter
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    if base in ("tiny-qwen3-next", "tiny-qwen3-5-moe"):  # transformers starts every norm at its identity:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name:  # zero-centred (1 + w), but the delta net's gated norm is w
                    param.copy_(float(param_name.endswith("linear_attn.norm.weight")) + 0.1 * torch.randn_like(param))
    if base in BIASED_MOE:  # transformers initialises the expert biases to zero: make them count
        with torch.no_grad():
            for param in model.parameters():
                if not param.any():
                    param.normal_(0.0, 0.1)
    model.save_pretrained(out)


def torchrun_itself(nproc: int, script: str, *args: str) -> str:
    """``script`` under torchrun, agent and all, as users start checkpoint_tools/ (the launch harness
    starts ranks as srun does); its ranks' stdout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run([*cmd, str(ROOT / script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"torchrun {script} {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc.stdout


def parse(output: str):
    return [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("convert")
    for name in DENSE + MOE + BIASED_MOE + list(DERIVED) + WRAPPED:
        make_hf_model(name, work / "hf" / name)
    # at 2, started by torchrun itself: its two ranks convert as one does. The one-rank session runs
    # beside it (it keeps one core of two busy; its checkpoints are others')
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(torchrun, 1, WORKER, "convert", str(work), *SPECS[1])
        converted = parse(torchrun_itself(2, WORKER, "convert", str(work), *SPECS[2])) + parse(one.result())
    converted += parse(torchrun(4, WORKER, "convert", str(work), *SPECS[4]))
    assert len(converted) == sum(len(s) for s in SPECS.values())
    return work


@pytest.fixture(scope="module")
def records(work):
    with ThreadPoolExecutor(2) as pool:  # the one-rank load beside the two-rank one
        one = pool.submit(torchrun, 1, WORKER, "logits", str(work))
        two = parse(torchrun(2, WORKER, "logits", str(work)))
        return {1: parse(one.result()), 2: two}


@pytest.fixture(scope="module")
def results(records):
    return {tp: [r for r in rs if r["check"] == "logits"] for tp, rs in records.items()}


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


def test_deepseek_variants_were_covered(results, work):
    from safetensors import safe_open
    with safe_open(next((work / "hf" / "tiny-deepseek-v3-qnull").glob("*.safetensors")), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("q_a_proj" in n or "q_b_proj" in n for n in names)
    tags = {r.get("tag") for r in results[2]}
    assert {"tiny-deepseek-v3-qnull-t2p1e1w2", "tiny-deepseek-v3-qnull-t1p2e2w4",
            "tiny-deepseek-v3-groups-t1p1e1w1", "tiny-deepseek-v3-unnormed-t1p1e1w1"} <= tags


def test_expert_bias_and_glm4_moe_layouts_were_covered(results, work):
    from safetensors import safe_open
    for name in ("tiny-deepseek-v3", "tiny-glm4-moe"):
        with safe_open(next((work / "hf" / name).glob("*.safetensors")), "pt") as f:
            assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").abs().min() > 0, name
    tags = {r.get("tag") for r in results[2]}
    assert {f"tiny-glm4-moe-{t}" for t in ("t1p1e1w1", "t2p1e1w2", "t1p2e1w2", "t1p1e2w2")} <= tags


def test_sliding_window_variant_was_covered_and_bites(results, work):
    """The window drops keys of the test tokens: transformers' logits with it differ from the
    same weights' without it or with a window one key longer or shorter, and megarl matched the
    former (test_logits_match_transformers; measured 1.8e-7 at load tp=1, 3.0e-7 at tp=2)."""
    from tests.distributed.convert_worker import TOKENS

    hf_dir = work / "hf" / "tiny-mistral-swa"
    assert json.loads((hf_dir / "config.json").read_text())["sliding_window"] == SWA < TOKENS.shape[1]
    def logits(**window):
        with torch.no_grad():
            return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **window).eval()(TOKENS).logits

    windowed = logits()
    # a window one key off either way (or none) is far outside TOL: the match is not by chance
    for other in (None, SWA - 1, SWA + 1):
        assert (logits(sliding_window=other) - windowed).abs().max().item() > 100 * TOL, other
    for load_tp in (1, 2):
        tags = {r["tag"] for r in results[load_tp]}
        assert {"tiny-mistral-swa-t2p1e1w2", "tiny-mistral-swa-t1p2e1w2"} <= tags, load_tp


def test_tied_and_padded_variants_were_covered(work):
    assert json.loads((work / "hf" / "tiny-qwen2" / "config.json").read_text())["tie_word_embeddings"]
    from safetensors import safe_open
    rt = next((work / "rt").glob("tiny-llama-t2*"))
    with safe_open(next(rt.glob("*.safetensors")), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == 250


INTEROP_TOL = 1e-5


@pytest.mark.parametrize("load_tp", [1, 2])
def test_megatron_lm_interop_both_directions(records, load_tp):
    """megarl's hf-to-mcore output loads into a plain megatron-core GPTModel (its own local spec,
    default sharded_state_dict); that model's own save goes through megarl's mcore-to-hf and
    load_model. Dense and MoE checkpoints are both stacked (megatron-core's default)."""
    interop = [r for r in records[load_tp] if r["check"] == "interop"]
    assert {r["name"] for r in interop} == {"tiny-llama", "tiny-qwen3-moe"}
    for r in interop:
        assert r["megarl_layout"] == r["megatron_lm_layout"] == "default", r
        assert r["plain_vs_megarl"] <= INTEROP_TOL and r["load_model_vs_plain"] <= INTEROP_TOL, r
        assert r["plain_vs_transformers"] <= INTEROP_TOL and r["export_vs_transformers"] <= INTEROP_TOL, r
        trip = r["export_bit_exact"]
        assert trip["same_names"] and not trip["differing"], r


def test_qwen3_next_layouts_were_covered(results, work):
    """The hybrid models' delta-net layers (0 and 2) and gated full attention (1 and 3) converted
    in every layout (Qwen3-Next's and Qwen3.5's), their norms away from the identity (so a wrong
    transform would show)."""
    from safetensors import safe_open
    with safe_open(next((work / "hf" / "tiny-qwen3-next").glob("*.safetensors")), "pt") as f:
        assert f.get_tensor("model.layers.0.linear_attn.in_proj_qkvz.weight").shape[0] == 2 * 32 + 2 * 64
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").shape[0] == 2 * 64  # [q; gate] per head
        gated = f.get_tensor("model.layers.2.linear_attn.norm.weight")
        assert (gated - 1).abs().min() > 0 and f.get_tensor("model.layers.3.input_layernorm.weight").abs().min() > 0
    for load_tp in (1, 2):
        tags = {r["tag"] for r in results[load_tp]}
        for name in ("tiny-qwen3-next", "tiny-qwen3-5-moe"):
            assert {f"{name}-{t}" for t in ("t1p1e1w1", "t2p1e1w2", "t1p2e1w2", "t1p1e2w2")} <= tags


def test_qwen3_5_vision_language_checkpoint_keeps_its_vision_tower(results, work):
    """Qwen3.5's vision-language checkpoint: its text model converted (its logits checked above,
    as transformers' causal-LM class reads the directory), its vision tower carried through the
    conversion and back, bit-exact (the round trip), and the export loads as the multimodal
    model it was."""
    from safetensors import safe_open
    rt = work / "rt" / "tiny-qwen3-5-moe-vl-t2p1e1w2"
    names = set()
    for shard in rt.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names |= set(f.keys())
    assert any(n.startswith("model.visual.") for n in names)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert json.loads((rt / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(rt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert {f"tiny-qwen3-5-moe-vl-{t}" for t in ("t1p1e1w1", "t2p1e1w2")} <= {r["tag"] for r in results[1]}


# ---------------------------------------------------------------------------- checkpoint_tools/


def tool(name: str):
    """checkpoint_tools/<name>.py's ``main(argv) -> exit code``, run in this process (inspect.py
    reads files only: no process group)."""
    spec = importlib.util.spec_from_file_location(f"checkpoint_tools_{name}", ROOT / "checkpoint_tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_verify_passes_at_two_layouts_and_fails_on_one_perturbed_tensor(records):
    """verify.py per family: at tp=1 on the two-rank tp=2 conversion, and in a two-stage pipeline
    on the first two layers (a slice) of the one-rank conversion: exit 0; on the copy whose
    output layer moved by 1e-3 (tolerance 1e-4): exit 1, at both layouts."""
    for world, rs in records.items():
        ran = {r["family"]: r for r in rs if r["check"] == "tools"}
        assert set(ran) == set(FAMILIES), (world, ran)
        for r in ran.values():
            assert r["verify_rc"] == 0 and r["perturbed_rc"] == 1, r


def test_inspect_names_the_perturbed_tensor_and_lists_a_checkpoint(records, work, capsys):
    """inspect.py A B on each family's conversion and its perturbed copy: exit 1, the one tensor
    named with its max abs difference (the first as a process: the script runs as a file, its
    name beside the standard library's inspect); inspect.py CKPT: what it holds."""
    inspect = tool("inspect")
    for i, name in enumerate(FAMILIES.values()):
        pair = [str(work / "mc" / f"{name}-t1p1e1w1"), str(work / "perturbed" / name)]
        if i == 0:
            proc = subprocess.run([sys.executable, "checkpoint_tools/inspect.py", *pair], cwd=ROOT, capture_output=True,
                                  text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
            code, out = proc.returncode, proc.stdout + proc.stderr
        else:
            code, out = inspect(pair), capsys.readouterr().out
        assert code == 1, out
        differing = [line.split() for line in out.splitlines() if line.startswith("  ")]
        assert [d[:2] for d in differing] == [["values", PERTURBED]], out
        assert abs(float(differing[0][-1]) - PERTURBATION) < 1e-6, out
    # a dist checkpoint's tensors, layout metadata, conversion record and source config
    assert inspect([str(work / "mc" / "tiny-deepseek-v3-t1p2e2w4")]) == 0
    out = capsys.readouterr().out
    assert "one key per layer (decoder.layers.N.*)" in out and "format: torch_dist" in out, out
    assert f"converted: hf-to-mcore from {work / 'hf' / 'tiny-deepseek-v3'} (3 files hashed)" in out, out
    assert "on 4 ranks at (tp=1, pp=2, dp=2, ep=2)" in out and "model_type=deepseek_v3" in out, out
    listed = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert listed["decoder.layers.1.self_attention.linear_kv_down_proj.weight"][0] == "float32", out
    assert listed["embedding.word_embeddings.weight"] == ["float32", "[256,", "64]"], out


def test_two_ranks_write_what_one_rank_writes(work):
    """hf_to_mcore.py run from torchrun by two ranks at tp=2, and by one: the same tensors bit for
    bit, the same source config and tokenizer files; mcore_to_hf.py (a job list) by those two
    ranks (splitting the tensors) and by one: the same tensors and side files (the shards are cut
    per rank). The records differ only in the world and layout (and, for the exports, in their
    sources); none left a temporary directory."""
    from megarl.checkpoint.inspection import diff
    from megarl.checkpoint.integrity import file_digest
    from megarl.checkpoint.jobs import read_record

    for name in FAMILIES.values():
        one, two = f"{name}-t1p1e1w1", f"{name}-t2p1e1w2"
        for kind in ("mc", "rt"):
            found, compared = diff(work / kind / one, work / kind / two)
            assert not found and compared >= 9, (kind, name, found)
        same_bytes = [("mc", f"hf/{f.name}") for f in (work / "mc" / one / "hf").iterdir()]
        same_bytes += [("rt", "config.json"), ("rt", "generation_config.json")]
        for kind, file in same_bytes:
            assert (work / kind / one / file).read_bytes() == (work / kind / two / file).read_bytes(), (kind, file)
        records = [read_record(work / "mc" / tag) for tag in (one, two)]
        assert [r.pop("world_size") for r in records] == [1, 2]
        assert [r.pop("layout")["tp"] for r in records] == [1, 2]
        assert records[0] == records[1] and records[0]["megarl_version"] and records[0]["direction"] == "hf-to-mcore"
        hashed = records[0]["source_files"]
        assert hashed and all(entry["sha256"] == file_digest(work / "hf" / name / f) for f, entry in hashed.items())
        assert not list((work / "mc").glob("*.tmp")) and not list((work / "rt").glob("*.tmp"))
        exports = [read_record(work / "rt" / tag) for tag in (one, two)]
        for export, tag in zip(exports, (one, two)):  # each read its own source's config
            config_dir = export["options"].pop("hf_config")
            assert export.pop("source") == str(work / "mc" / tag) and config_dir == str(work / "mc" / tag / "hf")
            assert [export.pop(k) for k in ("world_size", "source_files")][0] == int(tag[-1])
        assert exports[0] == exports[1] and exports[0]["direction"] == "mcore-to-hf", exports

