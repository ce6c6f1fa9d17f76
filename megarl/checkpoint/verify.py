"""A converted checkpoint's logits against transformers' on the HF model of the other side: the check
a conversion job runs before its output is used (``megarl convert verify``, checkpoint_tools/verify.py).

The Megatron model runs in a chosen layout (Megatron's pipeline schedule, forward only; the
vocabulary-parallel logits gathered over tp), transformers' model on global rank 0, on the CPU;
both in float32 from the same weights, so the difference measures the conversion, not a dtype.
Memory-bounded: with ``layers`` both sides build only the first N layers (the embedding, those
layers, the final norm and the head), and the Megatron side reads only those from the checkpoint,
so a model too large for one process is checked on a slice.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.checkpoint.dist_ckpt import load_first_layers, load_model, verify_dist_checkpoint
from megarl.checkpoint.hf_files import tokenizer_files
from megarl.checkpoint.hf_io import HFCheckpoint
from megarl.config import ModelConfig
from megarl.models.builder import check_layout
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel.layout import Layout
from megarl.runtime import set_seed
from megarl.runtime.devices import compute_device

DEFAULT_TOL = 1e-4  # max |logit difference|; float32 conversions of the tiny models differ by < 3e-7
# Prompts when the HF directory has a tokenizer; without one, seeded random token ids
PROMPTS = ("The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return",
           "Question: what is 17 * 23? Answer:")
RANDOM_PROMPTS, RANDOM_TOKENS = 3, 16


@dataclass(frozen=True)
class Pair:
    """A verification's two sides, whichever order they were given in."""

    checkpoint: Path  # the Megatron dist checkpoint
    hf: Path  # the HF directory (safetensors) transformers reads


def pair(a: str | Path, b: str | Path) -> Pair:
    """``a`` and ``b``, one a Megatron dist checkpoint (metadata.json) and the other an HF directory
    (config.json + safetensors), in either order: a job list's ``SRC DST`` for either direction."""
    a, b = Path(a), Path(b)
    dist_a, dist_b = (a / "metadata.json").is_file(), (b / "metadata.json").is_file()
    if dist_a == dist_b:
        kind = ("both are Megatron dist checkpoints" if dist_a
                else "neither is a Megatron dist checkpoint (metadata.json)")
        raise ValueError(f"verify compares a Megatron dist checkpoint with an HF directory, but of {a} and {b} {kind}")
    checkpoint, hf = (a, b) if dist_a else (b, a)
    HFCheckpoint(hf)  # config.json and complete safetensors files, or a named error
    verify_dist_checkpoint(checkpoint)
    return Pair(checkpoint, hf)


@dataclass
class VerifyResult:
    """The largest logit difference found, where, and what was compared."""

    max_abs_diff: float
    ref_scale: float  # the largest |logit| of transformers', for scale
    worst: str  # the prompt and token of max_abs_diff
    layers: int  # the first ``layers`` layers were compared
    num_layers: int  # of the model
    prompts: int
    tokens: int

    def passed(self, tol: float) -> bool:
        return self.max_abs_diff <= tol  # NaN fails

    def line(self, tol: float) -> str:
        what = ("every layer" if self.layers == self.num_layers
                else f"the first {self.layers} of {self.num_layers} layers")
        verdict = "ok" if self.passed(tol) else "FAILED"
        return (f"{verdict}: max |logits - transformers'| = {self.max_abs_diff:.3g} at {self.worst} "
                f"({'<=' if self.passed(tol) else '>'} tol {tol:g}; logits up to {self.ref_scale:.3g}) over "
                f"{self.prompts} prompts, {self.tokens} tokens, {what}")


def _text_config(config: Dict) -> Dict:
    """The part of an HF config that holds the layers (a wrapper's text_config, else itself)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else config


def num_layers(config: Dict) -> int:
    return int(_text_config(config)["num_hidden_layers"])


def first_layers_config(config: Dict, layers: int) -> Dict:
    """``config`` for a model of its first ``layers`` layers (per-layer lists cut alike)."""
    out = copy.deepcopy(config)
    text = _text_config(out)
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    return out


def layers_to_check(requested: Optional[int], total: int, layout: Layout) -> int:
    """``requested`` (None: all) rounded up to a multiple of the pipeline's stages (pp·vpp), which
    must each hold a layer."""
    if requested is None or requested >= total:
        return total
    if requested < 1:
        raise ValueError(f"--layers {requested} must be at least 1")
    stages = layout.pp * (layout.vpp or 1)
    return min(-(-requested // stages) * stages, total)


def sample_prompts(hf_dir: Path, vocab_size: int, prompts: Sequence[str] = ()) -> List[torch.Tensor]:
    """Token ids of ``prompts`` (default :data:`PROMPTS`) by the tokenizer of ``hf_dir``; without a
    tokenizer, :data:`RANDOM_PROMPTS` rows of seeded random ids."""
    if tokenizer_files(hf_dir):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        return [torch.tensor(tokenizer(text)["input_ids"]) for text in (prompts or PROMPTS)]
    if prompts:
        raise ValueError(f"--prompt needs a tokenizer, and {hf_dir} has none; leave it out (random token ids)")
    generator = torch.Generator().manual_seed(0)
    return list(torch.randint(vocab_size, (RANDOM_PROMPTS, RANDOM_TOKENS), generator=generator))


def _padded(rows: List[torch.Tensor], multiple: int) -> torch.Tensor:
    """The rows right-padded with token 0 to one width, a multiple of ``multiple`` (sequence
    parallelism splits it over tp). A causal model's logits at a token never see what follows it."""
    width = -(-max(len(r) for r in rows) // multiple) * multiple
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    return batch


def _megatron_logits(chunks: List[torch.nn.Module], groups, batch: torch.Tensor) -> Optional[torch.Tensor]:
    """Logits [rows, width, padded vocab] of ``batch`` on the first rank of the last pipeline stage
    (None elsewhere): Megatron's schedule forward-only, one row per micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    layout = groups.layout
    device = compute_device()
    micro = [row.unsqueeze(0).to(device) for row in batch]
    if layout.vpp and len(micro) % layout.pp:  # the interleaved schedule takes them in groups of pp
        micro += micro[:layout.pp - len(micro) % layout.pp]
    positions = torch.arange(batch.shape[1], device=device).unsqueeze(0)

    def forward_step(iterator, model):
        output = model(next(iterator), positions, None)  # [1, width, vocab/tp] on the last stage
        return output, lambda out: (out.new_zeros(()), torch.tensor(1, dtype=torch.int), {"logits": out})

    for chunk in chunks:
        chunk.eval()
    iterators = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    with torch.no_grad():
        outputs = get_forward_backward_func(layout.pp, layout.vpp)(
            forward_step_func=forward_step, data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micro),
            seq_length=batch.shape[1], micro_batch_size=1, forward_only=True, pg_collection=groups.pg,
            p2p_communicator=P2PCommunicator(pp_group=groups.pg.pp, config=chunks[0].config))
    if not groups.is_last_stage:
        return None
    logits = torch.cat([out["logits"] for out in outputs[:len(batch)]], dim=0)
    if layout.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(layout.tp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.pg.tp)
        logits = torch.cat(parts, dim=-1)
    return logits.float().cpu() if groups.tp_rank == 0 else None


def _reference_logits(hf_dir: Path, config: Optional[Dict], rows: List[torch.Tensor]) -> List[torch.Tensor]:
    """transformers' logits of each row ([tokens, vocab]), float32 on the CPU; ``config``: a
    first-layers config (:func:`first_layers_config`), else the directory's own. Its load report
    (the later layers' tensors unused, for a slice) is not printed; a tensor it lacks is an error,
    since a reference with random weights would prove nothing."""
    import transformers
    from transformers.utils import logging as hf_logging

    extra = {} if config is None else {"config": transformers.AutoConfig.for_model(**config)}
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **extra)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(f"transformers finds no '{missing[0]}' in {hf_dir} ({len(missing)} tensors missing): "
                         f"it cannot be the reference")
    with torch.no_grad():
        return [model.eval()(row.unsqueeze(0)).logits[0] for row in rows]


@dataclass
class VerifyPlan:
    """What :func:`verify` builds, checked before any process group exists."""

    checked: int  # the first ``checked`` layers are compared
    total: int
    config: Dict  # the HF config of the model compared (its first ``checked`` layers)
    args: object  # MegatronModelArgs of ``config``
    model_cfg: ModelConfig


def plan(checkpoint: str | Path, hf_dir: str | Path, layout: Layout, layers: Optional[int] = None) -> VerifyPlan:
    """The model :func:`verify` compares in ``layout``, checked against it (pure: no groups)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    total = num_layers(config)
    checked = layers_to_check(layers, total, layout)
    if checked < total:
        config = first_layers_config(config, checked)
    args = megatron_args_from_hf(config)
    # the checkpoint's own padded vocabulary (whatever --vocab-multiple it was converted with)
    embedding = verify_dist_checkpoint(checkpoint).state_dict_metadata.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ValueError(f"{checkpoint} has no 'embedding.word_embeddings.weight': not a model's checkpoint")
    model_cfg = ModelConfig(hf_config=str(hf_dir), make_vocab_size_divisible_by=embedding.size[0],
                            params_dtype="float32")
    check_layout(args, layout, model_cfg, training=False)
    return VerifyPlan(checked, total, config, args, model_cfg)


def verify(checkpoint: str | Path, hf_dir: str | Path, groups, layers: Optional[int] = None,
           prompts: Sequence[str] = (), tokens: Optional[List[torch.Tensor]] = None) -> VerifyResult:
    """Compare the logits of the dist ``checkpoint``, built in ``groups``' layout, with
    transformers' on ``hf_dir`` over sample prompts (``tokens``: rows of token ids instead);
    ``layers``: only the first N (see the module docstring). Collective; every rank returns the
    same result."""
    from megarl.models import build_model

    checkpoint, hf_dir = Path(checkpoint), Path(hf_dir)
    made = plan(checkpoint, hf_dir, groups.layout, layers)
    sliced = made.checked < made.total
    set_seed(0, groups)  # Megatron's embedding forks the model-parallel RNG tracker, even in eval
    chunks = build_model(made.model_cfg, groups, made.args, initialize=False, training=False)
    (load_first_layers if sliced else load_model)(chunks, checkpoint)
    args = made.args
    rows = tokens if tokens is not None else sample_prompts(hf_dir, args.vocab_size, prompts)
    tp_multiple = groups.layout.tp if groups.layout.sequence_parallel else 1
    got = _megatron_logits(chunks, groups, _padded(rows, tp_multiple))
    del chunks
    holder = groups.layout.group_ranks("pp")[0][-1]  # the last stage of rank 0's pipeline, tp rank 0
    if holder != 0:
        sent = [got]
        dist.broadcast_object_list(sent, src=holder)
        got = sent[0]
    result: List[Optional[VerifyResult]] = [None]
    if dist.get_rank() == 0:
        refs = _reference_logits(hf_dir, made.config if sliced else None, rows)
        found = []  # (largest difference, where) per prompt; a NaN anywhere is the worst
        for i, (row, ref) in enumerate(zip(rows, refs)):
            diff = (got[i, :len(row), :ref.shape[-1]] - ref).abs().amax(dim=-1)  # [tokens]
            nan = diff.isnan().nonzero()
            j = int(nan[0]) if len(nan) else int(diff.argmax())
            found.append((float(diff[j]), f"prompt {i} token {j}"))
        worst, where = next((f for f in found if math.isnan(f[0])), max(found))
        scale = max(float(ref.abs().max()) for ref in refs)
        result[0] = VerifyResult(worst, scale, where, made.checked, made.total, len(rows), sum(len(r) for r in rows))
    dist.broadcast_object_list(result, src=0)
    return result[0]

