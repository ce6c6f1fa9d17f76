"""The hybrid engine's tensor names against a built model's: plans name every tensor as the local
layer spec does; a model built from Transformer Engine's spec names some of them otherwise.

TE's spec fuses a norm into the linear layer that reads its output (TELayerNormColumnParallelLinear:
``self_attention.linear_qkv.layer_norm_weight`` for ``input_layernorm.weight``; the norm's own
submodule is then an IdentityOp) and keeps an MoE layer's experts in one grouped linear
(TEGroupedMLP: ``mlp.experts.linear_fc1.weight{e}`` for
``mlp.experts.local_experts.{e}.linear_fc1.weight``). :func:`canonical_name` reads a built model's
name back to the plan's, so the renames apply exactly where the built model has the fused or
grouped modules.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Sequence, Set

import torch

from megarl.hybrid.shards import LocalTensor
from megarl.models import lora

# Norms TE fuses into the next linear: (prefix under the local spec, prefix under TE) within a
# decoder layer, written as megatron-core's local GPT spec writes the first two in its
# ``sharded_state_dict_keys_map`` (MLA's latent norms are the TE MLA spec's up-projections).
FUSED_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
    ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"),
)

_LAYER = re.compile(r"^(decoder\.layers\.\d+\.)(.+)$")
# TE's GroupedLinear registers one weight per local expert: weight0, weight1, ...
_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def canonical_name(name: str) -> str:
    """A built model's parameter or buffer name -> the plan's (local-spec) name; local-spec names
    map to themselves."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer, rest = m.groups()
    for local, te in FUSED_NORMS:
        if rest.startswith(te):
            return layer + local + rest[len(te):]
    g = _GROUPED.match(rest)
    if g:
        linear, kind, expert = g.groups()
        return f"{layer}mlp.experts.local_experts.{expert}.{linear}.{kind}"
    return name


def planned_tensors(chunk: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A model chunk's parameters and buffers by the plan's names (a DDP wrapper's ``module``
    unwrapped): what the hybrid engine's senders and receivers look tensors up in. With LoRA
    adapters, an adapted weight is its merged tensor (filled inside ``lora.merged_for_sync``)."""
    module = getattr(chunk, "module", chunk)
    out: Dict[str, torch.Tensor] = {}
    merged = lora.merged_weights(module)  # a LoRA model syncs W + (alpha/r) B A, never its adapters
    replaced = merged.tensors() if merged is not None else {}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if lora.is_adapter_name(name):
            continue
        tensor = replaced.get(name, tensor)
        key = canonical_name(name)
        if key in out and out[key] is not tensor:
            raise ValueError(f"'{name}' and another tensor of the model both read as '{key}'; the model's "
                             f"layer spec fuses or groups modules the hybrid engine does not know")
        out[key] = tensor
    return out


def check_planned(chunks: Sequence[torch.nn.Module], tensors: Iterable[LocalTensor], where: str) -> None:
    """Raise if a parameter of ``chunks`` is in none of ``tensors`` (a rank's plan entries) of its
    chunk: a sync would leave it stale."""
    planned: Dict[int, Set[str]] = {}
    for t in tensors:
        planned.setdefault(t.chunk, set()).add(t.name)
    for c, chunk in enumerate(chunks):
        module = getattr(chunk, "module", chunk)
        missed = [n for n, _ in module.named_parameters()
                  if canonical_name(n) not in planned.get(c, ()) and not lora.is_adapter_name(n)]
        if missed:
            raise ValueError(f"{where}: parameters {missed[:4]} of model chunk {c} are in no plan entry "
                             f"({len(missed)} in all); the hybrid engine would leave them stale")
