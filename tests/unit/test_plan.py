"""``megarl plan``: per-rank memory from a model's tensors (by hand on a tiny model, and against the
planner's own sharding on every tiny family), and the layouts it proposes for reference models:
each passes the checks a run makes and fits the budget, or the command exits 2 saying what to change."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.cli import main
from megarl.config import load_config
from megarl.config.schema import Engine
from megarl.hybrid import ModelSpec, Placement, regroup
from megarl.models.builder import check_layout
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout
from megarl.rollout.backends import rollout_backend
from megarl.sizing import cost
from megarl.sizing.memory import (GiB, GenerationMemory, MicroBatches, ModelMemory, StageParams, TrainingMemory,
                                  phase_peaks)
from megarl.sizing.proposals import Cluster, plan_layouts
from megarl.trainer.steps import check_batch_split

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "models"
DEMO = str(ROOT / "configs" / "grpo_demo.yaml")
AT_SCALE = ["data.max_prompt_length=1024", "algorithm.max_new_tokens=3072"]  # the demo's lengths are 5 tokens


def _config(hf, *overrides):
    return load_config([DEMO], [f"model.hf_config={hf}", *AT_SCALE, *overrides])


# ---------------------------------------------------------------------------------------- memory by hand

def test_tiny_model_memory_by_hand():
    """tiny-digits at tp=2, dp=2: the parameters of a rank counted from the config's sizes; the
    grads, optimizer, activations and KV cache from the docstring's formulas."""
    args = megatron_args_from_hf(MODELS / "tiny-digits.json")
    model = ModelSpec.from_args(args)
    h, ffn, layers, heads, groups, head_dim, vocab = 64, 128, 2, 4, 4, 16, 128  # vocab 23 padded to 128
    split = (heads + 2 * groups) * head_dim * h + h * heads * head_dim + 2 * ffn * h + h * ffn  # qkv, proj, fc1, fc2
    per_rank = vocab * h // 2 + layers * (2 * h + split // 2) + h + vocab * h // 2  # + norms, final norm, output
    assert per_rank == 49472
    layout = Layout(tp=2, dp=2)
    placement = Placement(model, layout)
    assert [model.local_numel(placement.local_tensors(r)) for r in range(4)] == [per_rank] * 4

    memory = ModelMemory(args, model)
    m = memory.training(layout, 0, MicroBatches(seq_len=16, rows=2, count=3))
    assert (m.params, m.grads, m.optimizer) == (2 * per_rank, 4 * per_rank, 12 * per_rank // 2)
    tokens = 2 * 16
    layer = tokens * (18 * h + 6 * ffn) // 2
    logits = 4 * tokens * (h + vocab) // 2
    assert m.activations == layers * layer + logits  # pp=1: one micro-batch in flight
    assert m.activations_recompute == layers * tokens * 2 * h // 2 + layer + logits

    gen = Layout(tp=1, dp=4)
    weights = 2 * model.numel()
    kv = layers * 2 * 2 * groups * head_dim  # K and V, bf16
    assert memory.generation(gen, None, 100) == GenerationMemory(weights, kv, weights + 100 * kv, 100)
    assert memory.generation(gen, 1 << 20).kv_tokens == ((1 << 20) - weights) // kv


def _tied(name):
    return {**json.loads((MODELS / name).read_text()), "tie_word_embeddings": True}


@pytest.mark.parametrize("hf", sorted(p.name for p in MODELS.glob("tiny-*.json")) + [_tied("tiny-qwen3.json")],
                         ids=lambda hf: hf if isinstance(hf, str) else "tiny-qwen3-tied")
def test_stage_params_are_the_planners_shards(hf):
    """Every stage's parameters (dense and expert) equal what the 3D-HybridEngine's sharding model
    places on its ranks, and the optimizer shards dense ones over dp*cp, experts over expert-dp."""
    args = megatron_args_from_hf(MODELS / hf if isinstance(hf, str) else hf)
    model = ModelSpec.from_args(args)
    memory = ModelMemory(args, model)
    cfg = load_config([DEMO])
    checked = 0
    for tp, pp, dp, ep, cp in [(1, 1, 4, 1, 1), (2, 2, 2, 1, 1), (2, 1, 2, 2, 1), (1, 4, 2, 2, 1), (2, 2, 1, 2, 2),
                               (1, 2, 4, 4, 1)]:
        layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 else tp, cp=cp)
        try:
            layout.validate()
            check_layout(args, layout, cfg.model)
        except ValueError:
            continue
        placement = Placement(model, layout)
        for rank in range(layout.world_size):
            held = [t for t in placement.local_tensors(rank) if not model.tensors[t.spec].buffer]
            experts = model.local_numel([t for t in held if model.tensors[t.spec].expert is not None])
            stage = layout.coords(rank)["pp"]
            assert memory.stage_params(layout, stage) == StageParams(model.local_numel(held) - experts, experts), \
                (layout, rank)
        m = memory.training(layout, 0, MicroBatches(8, 1, 1))
        p = memory.stage_params(layout, 0)
        assert m.optimizer == int(12 * p.dense / (dp * cp) + 12 * p.experts / layout.expert_dp)
        checked += 1
    assert checked >= 2


def test_offload_frees_the_generate_phase_only():
    m = TrainingMemory(0, params=10, grads=20, optimizer=60, activations=7, activations_recompute=3)
    engine = GenerationMemory(weights=5, kv_per_token=1, pool=40, kv_tokens=35)
    off = SimpleNamespace(params=False, grads=True, optimizer=True)
    assert phase_peaks(m, engine, False, off, 1) == {"train": 97, "sync": 96, "generate": 50}
    assert phase_peaks(m, engine, True, SimpleNamespace(params=False, grads=False, optimizer=False), 1)["train"] == 93


# ---------------------------------------------------------------------------------------- proposals

def _check_proposals(cfg, hf, gpus, memory_gb):
    args = megatron_args_from_hf(hf)
    plan = plan_layouts(cfg, args, Cluster(gpus, memory_gb))
    assert plan.proposals and plan.fitting >= len(plan.proposals)
    model = ModelSpec.from_args(args, cfg.model.make_vocab_size_divisible_by)
    memory = ModelMemory(args, model)
    budget = memory_gb * GiB
    seq_len = cfg.data.max_prompt_length + cfg.algorithm.max_new_tokens
    for p in plan.proposals:
        # the checks a run makes before it starts: the layout, the model's split, the batch, the regrouping
        p.layout.validate(gpus)
        check_layout(args, p.layout, cfg.model)
        check_batch_split(cfg.data, cfg.algorithm, p.layout.dp)
        rg = regroup(p.layout, *p.gen, model.num_experts)
        if model.num_experts:
            assert model.num_experts % p.layout.ep == 0 and model.num_experts % p.gen[2] == 0
        rollout = cfg.parallel.rollout
        rollout_backend(rollout.engine).check(load_config([DEMO], [
            f"model.hf_config={hf}", f"parallel.rollout.engine={rollout.engine}", f"parallel.rollout.tp={p.gen[0]}",
            f"parallel.rollout.pp={p.gen[1]}", f"parallel.rollout.ep={p.gen[2]}"]))
        # the peak recomputed here from the memory model, stage by stage
        micro_rows = max(1, cfg.data.micro_batch_tokens * p.layout.cp // seq_len)
        rows = cfg.data.prompts_per_step * cfg.algorithm.samples_per_prompt
        micro = MicroBatches(seq_len, micro_rows, math.ceil(rows / p.layout.dp / micro_rows))
        pool = None if rollout.engine == Engine.native else int(rollout.mem_fraction_static * budget)
        engine = memory.generation(rg.gen, pool, math.ceil(rows / rg.gen.dp) * seq_len)
        assert engine.kv_tokens >= seq_len
        for stage in range(p.layout.pp):
            m = memory.training(p.layout, stage, micro)
            peaks = phase_peaks(m, engine, p.recompute, cfg.trainer.offload, cfg.parallel.rollout.bucket_mb << 20)
            assert max(peaks.values()) <= p.peak <= budget, (p.layout, stage, peaks)
    steps = [p.time["step_s"] for p in plan.proposals]
    assert steps == sorted(steps)
    return plan


@pytest.mark.parametrize("gpus", [8, 64, 256])
@pytest.mark.parametrize("name", ["llama2-7b", "llama3-70b", "qwen3-30b-a3b"])
def test_reference_models_get_layouts_that_fit(name, gpus):
    hf = str(MODELS / "reference" / f"{name}.json")
    cfg = _config(hf)
    if (name, gpus) == ("llama3-70b", 8):
        # bf16 weights, fp32 grads and Adam's 12 bytes, all sharded 8 ways, already exceed 80 GiB:
        # no layout of 8 GPUs can hold them (megarl keeps the optimizer on the GPU while training)
        n = cost.ParamCounts.of(ModelSpec.from_args(megatron_args_from_hf(hf)), 1).total
        assert (2 + 4 + 12) * n / 8 > 80 * GiB
        with pytest.raises(ValueError, match="--gpus=8 --gpu-memory-gb=80"):
            plan_layouts(cfg, megatron_args_from_hf(hf), Cluster(gpus, 80))
        return
    _check_proposals(cfg, hf, gpus, 80)


@pytest.mark.parametrize("name, gpus", [("llama2-7b", 8), ("llama3-70b", 64), ("llama3-70b", 256)])
def test_a_vllm_pool_fits_beside_the_trainer(name, gpus):
    """vLLM holds mem_fraction_static of the GPU while generating: the trainer's states fit in the rest."""
    hf = str(MODELS / "reference" / f"{name}.json")
    plan = _check_proposals(_config(hf, "parallel.rollout.engine=vllm"), hf, gpus, 80)
    for p in plan.proposals:
        assert p.gen[1:] == (1, 1)  # vLLM takes parallel.rollout.pp=1 and ep=1
        assert p.phases["generate"] == max(m.states for m in p.stages) + 40 * GiB


def test_a_critic_and_a_reference_are_counted():
    """PPO with a KL term: the critic's trained states (a value head instead of the output layer)
    and the reference's frozen copy; their passes in the step's training time."""
    hf = str(MODELS / "reference" / "llama2-7b.json")
    args = megatron_args_from_hf(hf)
    memory = ModelMemory(args, ModelSpec.from_args(args))
    layout, micro = Layout(tp=8, dp=8), MicroBatches(4096, 1, 16)
    actor = memory.stage_params(layout, 0).total
    critic = memory.stage_params(layout, 0, value_head=True).total
    assert critic == actor - memory.vocab * memory.hidden // 8 + memory.hidden + 1  # the value head's weight and bias
    m = memory.training(layout, 0, micro, reference=True, critic=True)
    assert (m.params, m.grads, m.optimizer) == (2 * (2 * actor + critic), 4 * (actor + critic),
                                                int(12 * actor / 8 + 12 * critic / 8))
    grpo = _check_proposals(_config(hf), hf, 64, 80).proposals[0]
    ppo = _check_proposals(_config(hf, "algorithm.name=ppo", "algorithm.kl_coef=0.01"), hf, 64, 80).proposals[0]
    assert ppo.time["train_s"] > 2 * grpo.time["train_s"]  # 2 + 6 + 2 + 8 FLOPs a parameter and token, not 2 + 6


def test_cost_model_moved_unchanged():
    """benchmarks/scaling.py's first setup (llama2-7b, 8 GPUs) gives the figures it gave before the
    cost model moved to megarl/sizing/cost.py."""
    args = megatron_args_from_hf(MODELS / "reference" / "llama2-7b.json")
    got = cost.predict(ModelSpec.from_args(args), 1, Layout(tp=2, dp=4), (1, 1, 1), cost.Hardware(), cost.Workload())
    assert got["generate_s"] == pytest.approx(35.721642532673485, rel=1e-12)
    assert got["train_s"] == pytest.approx(178.60821266336745, rel=1e-12)
    assert got["sync_s"] == pytest.approx(0.01497366528, rel=1e-12)
    assert got["decode_bound"] == "compute"


# ---------------------------------------------------------------------------------------- the command

def test_plan_command_prints_a_ranked_table(capsys):
    rc = main(["plan", "configs/grpo_demo.yaml", "model.hf_config=configs/models/reference/llama2-7b.json",
               "--gpus=8", "--gpu-memory-gb=80"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "layouts pass the layout checks" in out and "peak GiB" in out and "step s" in out
    rows = [line for line in out.splitlines() if re.match(r"^ ?\d+( +\d+){9} +(none|full) ", line)]
    assert 1 <= len(rows) <= 5 and [int(row.split()[0]) for row in rows] == list(range(1, len(rows) + 1))
    steps = [float(row.split("=")[0].split()[-1]) for row in rows]
    assert steps == sorted(steps)
    assert "#1: parallel.actor.tp=" in out and "parallel.rollout.tp=" in out
    assert "params" in out and "optim" in out and "act/rc" in out and "KV cache" in out


def test_nothing_fits_exits_2_naming_the_flags(capsys):
    rc = main(["plan", "configs/grpo_demo.yaml", "model.hf_config=configs/models/reference/llama3-70b.json",
               "--gpus", "8", "--gpu-memory-gb", "16"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "megarl plan: error: no layout" in err and "--gpus" in err and "--gpu-memory-gb" in err


def test_plan_flags_are_required_and_checked(capsys):
    assert main(["plan", "configs/grpo_demo.yaml", "--gpu-memory-gb=80"]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["plan", "configs/grpo_demo.yaml", "--gpus=0", "--gpu-memory-gb=80"]) == 2
    assert "--gpus=0" in capsys.readouterr().err
    assert main(["plan", "configs/grpo_demo.yaml", "--gpus=8", "--gpu-memory-gb=80", "--bogus=1"]) == 2
    assert "--bogus=1" in capsys.readouterr().err
