"""Layout parity: the same tiny dense and MoE models, batch and seed give the same loss and
gradients at every layout, and the same losses and weights after 3 steps with the distributed
optimizer. Tolerance: relative difference <= 1e-5 in fp32 (norm of difference / norm of the
single-process value, per tensor; the worst tensor is reported).

Through the RL engine (actor PPO loss, seq-mean-token-mean, entropy bonus), padded and packed:
log-probs and entropies (max abs diff on real tokens, zeros past them), loss, grad norm and the
weights after one update, against the single process, <= 1e-5; and at every layout the packed
run against the padded one (data.pack_sequences: the loss aggregates per sequence either way), <= 1e-5. Layouts include context
parallelism (cp=2, tp2·cp2). Activation recompute (selective, full) at one process matches the
run without it to 1e-6 and really recomputes (twice the core-attention calls).

Two more families at a few layouts: a Qwen2-MoE (shared expert with its gate, q/k/v bias; tp2
and dp2·ep2) and a Mistral sliding a window of 6 over the 16-token rows (tp2 and cp2, the window
crossing the CP chunks); a GLM-4.5-style MoE (sigmoid router with expert bias, qk norm, partial
rope; tp2 and dp2·ep2) and a gpt-oss (attention sinks, a window of 8 on every other layer over the
16-token rows, biases everywhere, clamped SwiGLU; tp2·ep2, dp2·ep2 and pp2, all at etp=1, which
its biased experts need: at tp2·ep2 the two tp ranks hold different experts); and a Qwen3-Next
(gated delta nets and gated full attention, zero-centred norms; tp2, dp2·ep2 and pp2) and a Qwen3.5
text model (every layer MoE; tp2 and dp2·ep2). Biases,
expert biases and zero-centred norms start non-zero (parity_worker.nonzero_biases).

The MoE model also runs with Megatron's load-balancing loss on (``moe_aux``) at the layouts that
split a micro-batch's tokens over ranks (sp, cp) or pad it differently (vpp, cp, packing): its
gradient must not depend on either.

``megarl sft``'s loss (the real vocabulary's softmax; conversation-shaped rows of varied length,
two assistant spans trained each) on the dense and the MoE model: its loss and reduced gradients
at every layout, padded and packed, equal the single process's padded run to 1e-5; and the single
process's equal transformers' on the same weights and batch (fp32, <= 1e-5: the loss, and every
tensor's gradient read back through megarl's Megatron -> HF converter; measured 8.6e-8 and 8.6e-7).
``megarl dpo``'s loss and gradients at one process (the dense model against the weights after its
3 steps as the reference) equal DPO's formula computed directly in float64 with transformers, 1e-5.

Every layout loads the initial weights the single-process run wrote (a Megatron dist
checkpoint), and saves its reduced gradients and final weights the same way, so they are read
back as whole tensors whatever the layout.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.distributed.launch import torchrun

TOL = 1e-5
RECOMPUTE_TOL = 1e-6
# (t, p, d, e[, vpp[, cp]])[:recompute]; e=2 runs for MoE only; 1,2,1,1,2 = two virtual pipeline
# stages per rank; 1,1,1,1,0,2 = cp=2
LAYOUTS_1 = ["1,1,1,1", "1,1,1,1:selective", "1,1,1,1:full"]
# 2,1,1,2 (tp=2·ep=2) at etp=1, for the biased-expert model only (parity_worker.ETP1_LAYOUTS)
LAYOUTS_2 = ["2,1,1,1", "1,2,1,1", "1,1,2,1", "1,1,2,2", "1,2,1,1,2", "1,1,1,1,0,2", "2,1,1,2"]
LAYOUTS_4 = ["2,2,1,1", "2,1,1,1,0,2"]
COMMON = {"t1p1d1e1", "t1p1d1e1rselective", "t1p1d1e1rfull", "t2p1d1e1", "t1p2d1e1", "t1p1d2e1", "t2p2d1e1",
          "t1p2d1e1v2", "t1p1d1e1c2", "t2p1d1e1c2"}
# moe_aux: the MoE model with the load-balancing loss on, at the layouts that split or pad a
# micro-batch's tokens (parity_worker.AUX_LAYOUTS)
# qwen2_moe (shared expert and its gate, q/k/v bias) and mistral_swa (a sliding window of 6 over
# the 16-token rows, crossing the CP chunks) at a few layouts only (parity_worker.ONLY_LAYOUTS); so
# are glm4_moe (sigmoid router with expert bias, qk norm, partial rope; tp2, dp2·ep2) and gpt_oss
# (sinks, a window of 8 on every other layer, biases, clamped SwiGLU; tp2·ep2, dp2·ep2 and pp2, all
# at etp=1, which its biased experts need: parity_worker.ETP1_MODELS)
EXPECTED = {"dense": COMMON, "moe": COMMON | {"t1p1d2e2"},
            "moe_aux": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2", "t1p2d1e1v2", "t1p1d1e1c2", "t2p1d1e1c2"},
            "qwen2_moe": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2"}, "mistral_swa": {"t1p1d1e1", "t2p1d1e1", "t1p1d1e1c2"},
            "glm4_moe": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2"}, "gpt_oss": {"t1p1d1e1", "t2p1d1e2", "t1p1d2e2", "t1p2d1e1"},
            "qwen3_next": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2", "t1p2d1e1"},
            "qwen3_5_moe": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2"}}
MODELS = list(EXPECTED)
# glm4_moe's router expert bias (a buffer) moves 1e-3 a step by the expert loads (Megatron's
# aux-loss-free balancing): the engine hands the router its padding mask, so that padded rows,
# packed ones and a layout's padding count alike (without it: relative 5.4e-2 packed vs padded,
# 1.2e-1 at tp2 vs one process)
ENGINE_METRICS = [f"engine_{what}_{mode}" for mode in ("padded", "packed")
                  for what in ("log_probs", "entropy", "loss", "grad_norm", "weights")]
# each layout's packed engine run against its padded one: log-probs and entropies (max abs diff),
# loss and grad norm, weights after the update (relative)
PACKED_METRICS = ["packed_vs_padded_log_probs", "packed_vs_padded_loss", "packed_vs_padded_weights"]


def tolerance(key: str, metric: str) -> float:
    """Against the single process: 1e-6 for its own run with recompute, 1e-5 for other layouts.
    Packed against padded (the same layout, recompute or not): 1e-5, packing's own bound (on AVX-512
    kernels the recompute layouts' packed run is 1.6e-6 off their padded one, as without recompute)."""
    if metric in PACKED_METRICS:
        return TOL
    return RECOMPUTE_TOL if key.endswith(("rselective", "rfull")) else TOL


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("parity")
    worker = "tests/distributed/parity_worker.py"
    torchrun(1, worker, "run", "--workdir", str(work), "--reference", "--layouts", *LAYOUTS_1[:1])  # the initial weights
    with ThreadPoolExecutor(2) as pool:  # one process's recompute layouts beside the two-rank session
        recompute = pool.submit(torchrun, 1, worker, "run", "--workdir", str(work), "--layouts", *LAYOUTS_1[1:])
        torchrun(2, worker, "run", "--workdir", str(work), "--layouts", *LAYOUTS_2)
        recompute.result()
    torchrun(4, worker, "run", "--workdir", str(work), "--layouts", *LAYOUTS_4)
    torchrun(1, worker, "compare", "--workdir", str(work), "--report", str(work / "report.json"))
    return json.loads((work / "report.json").read_text())


@pytest.mark.parametrize("model", MODELS)
def test_every_layout_ran(report, model):
    ran = {key.split("/")[1] for key in report if key.startswith(model + "/")}
    assert ran == EXPECTED[model]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("metric", ["loss", "grads", "step_losses", "grad_norms", "weights"] + ENGINE_METRICS
                         + PACKED_METRICS)
def test_layout_matches_single_process(report, model, metric):
    worst = {key: entry[metric] for key, entry in report.items() if key.startswith(model + "/")}
    bad = {key: value for key, value in worst.items() if not value <= tolerance(key, metric)}
    assert not bad, f"{metric} differs from the single-process run by more than the tolerance: {bad}"


SFT_METRICS = [f"sft_{what}_{mode}" for what in ("loss", "grads") for mode in ("padded", "packed")]


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("metric", SFT_METRICS)
def test_sft_loss_and_gradients_match_single_process(report, model, metric):
    worst = {key: entry[metric] for key, entry in report.items() if key.startswith(model + "/")}
    assert set(worst) == {f"{model}/{layout}" for layout in EXPECTED[model]}
    bad = {key: value for key, value in worst.items() if not value <= tolerance(key, metric)}
    assert not bad, f"{metric} differs from the single-process padded run: {bad}"


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_untrained_targets_change_neither_loss_nor_gradient(report, model):
    """The labels of every untrained position (prompt, the turn between the spans, padding) set to
    other tokens: the SFT loss and every gradient are bit for bit the same, at every layout."""
    entries = {key: e for key, e in report.items() if key.startswith(model + "/")}
    assert entries and all(e["sft_changed_targets"] > 20 for e in entries.values())
    moved = {key: (e["sft_changed_targets_loss_diff"], e["sft_changed_targets_grad_diff"]) for key, e in entries.items()
             if e["sft_changed_targets_loss_diff"] or e["sft_changed_targets_grad_diff"]}
    assert not moved, moved


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_sft_step_equals_transformers(report, model):
    r = report[f"sft_transformers/{model}"]
    assert r["tensors"] == r["tensors_compared"] > 20, r  # every parameter's gradient, under its HF name
    assert r["loss"] <= TOL and r["grads"] <= TOL, r


def test_dpo_step_equals_the_formula_in_float64(report):
    """megarl dpo's loss and gradients (one process, fp32; the reference the weights after 3 steps,
    so the log-ratios are not zero) against DPO's formula computed directly in float64."""
    r = report["dpo_float64/dense"]
    assert r["tensors"] == r["tensors_compared"] > 20 and r["h_abs_mean"] > 1e-3, r
    assert r["loss"] <= TOL and r["grads"] <= TOL, r


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_recompute_runs_attention_again(report, model):
    calls = {key: report[f"{model}/{key}"]["attention_calls_vs_reference"]
             for key in ("t1p1d1e1rselective", "t1p1d1e1rfull")}
    assert calls == {"t1p1d1e1rselective": 2.0, "t1p1d1e1rfull": 2.0}, calls


@pytest.mark.parametrize("model", ["dense", "moe", "qwen2_moe", "mistral_swa", "glm4_moe", "gpt_oss", "qwen3_next",
                                   "qwen3_5_moe"])
def test_every_tensor_got_a_gradient(report, model):
    counts = {key: entry["grads_nonzero"] for key, entry in report.items() if key.startswith(model + "/")}
    assert len(set(counts.values())) == 1 and min(counts.values()) > 20, counts
