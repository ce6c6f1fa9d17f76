"""LoRA adapters on Megatron's tensor-parallel linear layers (megatron-core 0.16 ships none), laid
out so that a fused Megatron linear maps exactly onto PEFT's separate HF modules.

An adapter is a child ``lora`` of the linear it adapts (the base weight keeps its name) and a
forward hook adds ``(alpha / r) · B_p A_p x`` per HF part p to the linear's output:
* column-parallel (``linear_qkv``: q/k/v; ``linear_fc1``: gate/up): each part has its own A_p
  [r, in], replicated over tp, and B_p [out_p / tp, r], split with the output; the parts'
  outputs are placed where Megatron's fused layout keeps them (per query group q, k, v; [gate;
  up]). Sharing one A between q, k and v could not load a PEFT adapter, whose A's differ.
* row-parallel (``linear_proj``, ``linear_fc2``): A [r, in / tp] split with the input, its
  output reduced over tp before B [out, r] (replicated).
With sequence parallelism the column adapter gathers A x over the sequence (as the linear
gathers x) and the row adapter reduce-scatters it; the replicated factor that then sees only a
sequence slice (A, resp. B) is marked ``sequence_parallel`` so that Megatron sums its gradient
over tp, as it does for norms. Transformer Engine's fused norm + linear is fed the normed input.

Everything else is frozen: the base has no gradient, no main-parameter copy and no optimizer
state. ``merged_weights`` gives the weight sync W + (alpha / r) B A in the training layout;
``adapters_off`` turns the actor into the reference policy. A is drawn from a generator seeded by
the adapter's global name (PEFT's kaiming-uniform bound 1/sqrt(in)), B is zero: the same adapters
in every layout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# Megatron linear (within a decoder layer) -> (parallel kind, its HF parts in fused order)
TARGETS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
_SHORT = {key.rsplit(".", 1)[1]: key for key in TARGETS}  # linear_qkv -> self_attention.linear_qkv
_PART = {part: key for key, (_, parts) in TARGETS.items() for part in parts}  # q_proj -> ...linear_qkv
# whole modules trained beside the adapters (PEFT's modules_to_save): accepted name -> Megatron module
SAVED = {"final_layernorm": "decoder.final_layernorm", "model.norm": "decoder.final_layernorm"}
_CONFIG_NAME = {"decoder.final_layernorm": "final_layernorm"}  # Megatron module -> its name in the config
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoRAError(ValueError):
    """A LoRA setting or adapter file that cannot be used; the message says what to change."""


def target_parts(names: Sequence[str]) -> Dict[str, Tuple[str, ...]]:
    """``model.lora.target_modules`` (Megatron or HF names) -> {linear key: its targeted HF parts,
    in fused order}."""
    wanted = set()
    for name in names:
        if name in _SHORT:
            wanted.update(TARGETS[_SHORT[name]][1])
        elif name in _PART:
            wanted.add(name)
        else:
            raise LoRAError(f"model.lora.target_modules: '{name}' is not a LoRA target; use "
                            f"{sorted(_SHORT)} or their HF parts {sorted(_PART)}")
    return {key: tuple(p for p in parts if p in wanted) for key, (_, parts) in TARGETS.items()
            if any(p in wanted for p in parts)}


def saved_modules(names: Sequence[str]) -> Tuple[str, ...]:
    """``model.lora.modules_to_save`` -> the Megatron modules trained whole."""
    unknown = [n for n in names if n not in SAVED]
    if unknown:
        raise LoRAError(f"model.lora.modules_to_save: {unknown} cannot be trained beside the adapters yet; "
                        f"use {sorted(SAVED)}")
    return tuple(sorted({SAVED[n] for n in names}))


def check_targets(lora_cfg, args) -> None:
    """Refuse, before anything starts, what this LoRA does not cover for the model ``args``:
    MLA attention (no ``linear_qkv``), routed experts (an MoE layer has no dense MLP), gated delta
    nets and gated attention."""
    if not lora_cfg.rank and not lora_cfg.path:
        return
    saved_modules(lora_cfg.modules_to_save)
    targets = target_parts(lora_cfg.target_modules)
    if args.mla and any(k.startswith("self_attention.") for k in targets):
        raise LoRAError(f"model.lora on {args.model_type}'s MLA attention is not built yet (its linears are not "
                        f"linear_qkv/linear_proj); target the dense MLP (linear_fc1, linear_fc2) or leave LoRA off")
    kw = args.config_kwargs
    if kw.get("experimental_attention_variant") == "gated_delta_net" or kw.get("attention_output_gate"):
        raise LoRAError(f"model.lora on {args.model_type} is not built yet: its gated delta nets (in_proj, "
                        f"out_proj) and gated attention's fused [q; gate; k; v] have no LoRA layout; leave LoRA off")
    moe_layers = kw.get("moe_layer_freq") if kw.get("num_moe_experts") else None
    if moe_layers and any(k.startswith("mlp.") for k in targets) and any(f == 1 for f in moe_layers):
        raise LoRAError(f"model.lora.target_modules: {args.model_type} has MoE layers, and LoRA on routed experts "
                        f"is not built yet; target attention only: [linear_qkv, linear_proj]")


@dataclass(frozen=True)
class PartLayout:
    """How a column-parallel linear's local output is made of its HF parts: ``groups`` repeats
    of [part 0 rows, part 1 rows, ...] (Megatron's QKV: one repeat per query group)."""

    groups: int
    rows: Tuple[int, ...]  # per repeat, in fused order

    def local_rows(self, index: int) -> int:
        return self.groups * self.rows[index]


def part_layout(key: str, config, tp: int) -> PartLayout:
    if key == "self_attention.linear_qkv":
        heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        return PartLayout(groups // tp, (heads // groups * d, d, d))
    ffn = config.ffn_hidden_size // tp
    return PartLayout(1, (ffn, ffn) if config.gated_linear_unit else (ffn,))


def _interleave(parts: Dict[int, torch.Tensor], layout: PartLayout, dim: int, like: torch.Tensor) -> torch.Tensor:
    """Place part tensors (``dim`` = their local rows) in the fused order; untargeted parts are
    zero. ``like``: a tensor of the full fused shape (dtype, device, other dims)."""
    pieces = []
    for index, rows in enumerate(layout.rows):
        t = parts.get(index)
        if t is None:
            shape = list(like.shape)
            shape[dim] = layout.groups * rows
            t = like.new_zeros(shape)
        shape = list(t.shape)
        pieces.append(t.reshape(shape[:dim] + [layout.groups, rows] + shape[dim + 1:]))
    joined = torch.cat(pieces, dim=dim + 1)
    shape = list(joined.shape)
    return joined.reshape(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:])


class LoRAAdapter(torch.nn.Module):
    """The adapters of one linear: ``A[part]``, ``B[part]`` (see the module docstring)."""

    def __init__(self, key: str, layer: int, parts: Tuple[str, ...], base: torch.nn.Module, config,
                 tp_group, rank: int, alpha: float, dropout: float):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.key, self.layer, self.kind = key, layer, TARGETS[key][0]
        self.all_parts = TARGETS[key][1]
        self.parts = parts
        self.tp_group = tp_group
        self.tp = tp_group.size() if tp_group is not None else 1
        self.tp_rank = tp_group.rank() if tp_group is not None else 0
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp > 1
        self.rank, self.scaling, self.dropout = rank, alpha / rank, dropout
        self.enabled = True
        self.layout = part_layout(key, config, self.tp) if self.kind == "column" else None
        # TE's fused norm + linear reads the un-normed input: the adapter norms it the same way
        self.norm_eps = config.layernorm_epsilon if hasattr(base, "layer_norm_weight") else None
        weight = base.weight
        out_local, in_local = weight.shape
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for part in parts:
            rows = self.layout.local_rows(self.all_parts.index(part)) if self.kind == "column" else out_local
            a = torch.nn.Parameter(torch.empty(rank, in_local, dtype=weight.dtype, device=weight.device))
            b = torch.nn.Parameter(torch.zeros(rows, rank, dtype=weight.dtype, device=weight.device))
            split, replicated, dim = (b, a, 0) if self.kind == "column" else (a, b, 1)
            set_tensor_model_parallel_attributes(split, True, dim, 1)
            # the replicated factor sees a sequence slice under sequence parallelism: Megatron
            # then sums its gradient over tp (finalize_model_grads), as for norms
            replicated.sequence_parallel = self.sequence_parallel
            self.A[part], self.B[part] = a, b
        self.reset_parameters()

    def global_name(self, part: str) -> str:
        return f"decoder.layers.{self.layer}.{self.key}.{part}"

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform with a=sqrt(5)) drawn whole from a
        generator seeded by the part's global name, then this rank's slice; B = 0."""
        for part in self.parts:
            a = self.A[part]
            in_global = a.shape[1] * (self.tp if self.kind == "row" else 1)
            seed = (torch.initial_seed() + zlib.crc32(self.global_name(part).encode())) % (1 << 63)
            bound = 1.0 / math.sqrt(in_global)
            whole = torch.rand(self.rank, in_global, generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64) * (2 * bound) - bound
            if self.kind == "row":
                whole = whole[:, self.tp_rank * a.shape[1]:(self.tp_rank + 1) * a.shape[1]]
            a.copy_(whole.to(a.dtype))
            self.B[part].zero_()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, base: torch.nn.Module) -> torch.Tensor:
        """The adapters' addition to ``base``'s output for its input ``x`` ([s(/tp), b, in])."""
        from megatron.core.tensor_parallel import mappings

        if self.norm_eps is not None:
            x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.norm_eps).to(x.dtype) * base.layer_norm_weight
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        group = self.tp_group
        if self.kind == "row":
            part = self.parts[0]
            h = x @ self.A[part].t()  # [s, b, r], a partial sum over this rank's input slice
            if self.tp > 1:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if self.sequence_parallel
                     else mappings.reduce_from_tensor_model_parallel_region(h, group=group))
            return (h @ self.B[part].t()) * self.scaling
        a = torch.cat([self.A[p] for p in self.parts])  # one matmul for all parts: [parts * r, in]
        h = x @ a.t()
        if self.tp > 1:
            h = (mappings.gather_from_sequence_parallel_region(h, group=group) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h, group=group))
        outs = {self.all_parts.index(p): (h[..., i * self.rank:(i + 1) * self.rank] @ self.B[p].t()) * self.scaling
                for i, p in enumerate(self.parts)}
        like = h.new_empty(h.shape[:-1] + (sum(self.layout.rows) * self.layout.groups,))
        return _interleave(outs, self.layout, h.dim() - 1, like)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) · B A in the base weight's local layout ([out/tp, in] or [out, in/tp])."""
        if self.kind == "row":
            part = self.parts[0]
            return (self.B[part] @ self.A[part]) * self.scaling
        outs = {self.all_parts.index(p): (self.B[p] @ self.A[p]) * self.scaling for p in self.parts}
        a = self.A[self.parts[0]]
        like = a.new_empty(sum(self.layout.rows) * self.layout.groups, a.shape[1])
        return _interleave(outs, self.layout, 0, like)


def _hook(module, inputs, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(inputs[0], module).to(out.dtype), bias


def _sharded_state_dict(module, original):
    """The linear's sharded state dict with its adapters sharded as they are split: B of a
    column-parallel linear along dim 0, A of a row-parallel one along dim 1, the rest replicated."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    def sharded(prefix="", sharded_offsets=(), metadata=None):
        out = {k: v for k, v in original(prefix, sharded_offsets, metadata).items()
               if not k.startswith(f"{prefix}lora.")}
        adapter = module.lora
        split = "B" if adapter.kind == "column" else "A"
        state = {f"lora.{k}": v for k, v in adapter.state_dict(prefix="", keep_vars=True).items()}
        axes = {k: (0 if adapter.kind == "column" else 1) for k in state if k.startswith(f"lora.{split}.")}
        out.update(make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=adapter.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out

    return sharded


def decoder_layers(chunk: torch.nn.Module) -> Iterator[Tuple[int, torch.nn.Module]]:
    """(global layer index, layer) of a model chunk (DDP unwrapped)."""
    model = getattr(chunk, "module", chunk)
    decoder = getattr(model, "decoder", None)
    for layer in (decoder.layers if decoder is not None else ()):
        yield layer.layer_number - 1, layer


def apply_lora(chunks: Sequence[torch.nn.Module], lora_cfg, tp_group, freeze: bool = True) -> int:
    """Give the targeted linears of ``chunks`` adapters and freeze everything else (``freeze``;
    a critic unfreezes its value head after). Returns the adapters' parameter count on this rank."""
    targets = target_parts(lora_cfg.target_modules)
    if freeze:
        saved = saved_modules(lora_cfg.modules_to_save)
        for chunk in chunks:
            chunk.requires_grad_(False)
            module = getattr(chunk, "module", chunk)
            module._lora_base = []  # (parameter trained whole, its base value): the reference's
            for name, param in module.named_parameters():
                if name.startswith(tuple(f"{m}." for m in saved)):
                    param.requires_grad_(True)
                    module._lora_base.append((param, param.detach().clone()))
    count = 0
    for chunk in chunks:
        for layer, module in decoder_layers(chunk):
            for key, parts in targets.items():
                try:
                    linear = module.get_submodule(key)
                except AttributeError:
                    continue  # an MoE layer's mlp (refused up front when targeted), MLA attention
                adapter = LoRAAdapter(key, layer, parts, linear, linear.config, tp_group, lora_cfg.rank,
                                      lora_cfg.alpha, lora_cfg.dropout)
                linear.lora = adapter
                linear.register_forward_hook(_hook)
                linear.sharded_state_dict = _sharded_state_dict(linear, linear.sharded_state_dict)
                count += sum(p.numel() for p in adapter.parameters())
    if not count:
        raise LoRAError(f"model.lora.target_modules={list(lora_cfg.target_modules)} matched no linear layer "
                        f"of this model")
    return count


def adapters(chunks: Sequence[torch.nn.Module]) -> List[LoRAAdapter]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoRAAdapter)]


def has_lora(chunks: Sequence[torch.nn.Module]) -> bool:
    return bool(adapters(chunks))


@contextlib.contextmanager
def adapters_off(chunks: Sequence[torch.nn.Module]):
    """The base model alone while inside (the reference policy of a LoRA actor): adapters off, and
    the modules trained whole (modules_to_save) back at the base's values."""
    found = adapters(chunks)
    whole = [pair for chunk in chunks for pair in getattr(getattr(chunk, "module", chunk), "_lora_base", [])]
    trained = [param.detach().clone() for param, _ in whole]
    with torch.no_grad():
        for a in found:
            a.enabled = False
        for param, base in whole:
            param.copy_(base)
    try:
        yield
    finally:
        with torch.no_grad():
            for a in found:
                a.enabled = True
            for (param, _), value in zip(whole, trained):
                param.copy_(value)


def is_adapter_name(name: str) -> bool:
    """A parameter name of an adapter (``...linear_qkv.lora.A.q_proj``)."""
    return ".lora.A." in name or ".lora.B." in name


def static_tensors(model_spec, lora_cfg) -> frozenset:
    """Indices of ``model_spec``'s tensors that a LoRA actor never changes (all but the adapted
    weights; none without LoRA): a weight sync sends them once."""
    if not lora_cfg.rank:
        return frozenset()
    adapted = {f"{key}.weight" for key in target_parts(lora_cfg.target_modules)}
    saved = tuple(f"{m}." for m in saved_modules(lora_cfg.modules_to_save))
    return frozenset(i for i, t in enumerate(model_spec.tensors)
                     if not (t.layer is not None and t.key.split(".", 3)[-1] in adapted) and not t.key.startswith(saved))


class MergedWeights:
    """W + (alpha / r) B A of every adapted linear of a chunk, in the training layout: the tensors
    a weight sync reads in place of the base weights. Inside :meth:`during_sync` each is computed
    when the sync first reads it (:func:`filler`) and freed when the next one is: one merged
    tensor of this rank at a time, never the adapted model whole."""

    def __init__(self, chunk: torch.nn.Module):
        module = getattr(chunk, "module", chunk)
        self.entries: Dict[str, Tuple[torch.nn.Module, torch.Tensor]] = {}
        self.linears: Dict[int, torch.nn.Module] = {}  # id(merged) -> its linear
        self.current: Optional[torch.Tensor] = None  # the one filled now
        self.active = False
        for name, linear in module.named_modules():
            adapter = getattr(linear, "lora", None)
            if isinstance(adapter, LoRAAdapter):
                merged = torch.empty_like(linear.weight, requires_grad=False)
                merged.untyped_storage().resize_(0)
                merged._lora_merged_by = self
                self.entries[f"{name}.weight"] = (linear, merged)
                self.linears[id(merged)] = linear

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {name: merged for name, (_, merged) in self.entries.items()}

    @torch.no_grad()
    def fill(self, merged: torch.Tensor) -> int:
        """Compute ``merged`` (freeing the one filled before); its bytes."""
        nbytes = merged.numel() * merged.element_size()
        if not self.active:
            raise RuntimeError("a merged LoRA weight is read outside a weight sync (merged_for_sync)")
        if self.current is not merged:
            self._release()
            linear = self.linears[id(merged)]
            merged.untyped_storage().resize_(nbytes)
            torch.add(linear.weight, linear.lora.delta_weight().to(merged.dtype), out=merged)
            self.current = merged
        return nbytes

    def _release(self) -> None:
        if self.current is not None:
            self.current.untyped_storage().resize_(0)
            self.current = None

    @contextlib.contextmanager
    def during_sync(self):
        self.active = True
        try:
            yield
        finally:
            self._release()
            self.active = False


def filler(tensor: torch.Tensor):
    """For a merged LoRA weight (what planned_tensors names in place of an adapted base weight):
    the call that computes it before a sync reads it (returns its bytes); None for any other tensor."""
    owner = getattr(tensor, "_lora_merged_by", None)
    return None if owner is None else functools.partial(owner.fill, tensor)


def sync_base_weights(chunks: Sequence[torch.nn.Module]) -> None:
    """A weight sync of ``chunks`` reads the base weights, not merged ones: the rollout engine
    serves the adapters itself (``parallel.rollout.lora_sync=adapter``). Call before the sync's
    executor is built."""
    for chunk in chunks:
        getattr(chunk, "module", chunk)._lora_sync_base = True


def merged_weights(chunk: torch.nn.Module) -> Optional[MergedWeights]:
    """The chunk's :class:`MergedWeights` (made once), None without adapters or when the sync
    reads the base (:func:`sync_base_weights`)."""
    module = getattr(chunk, "module", chunk)
    if not has_lora([module]) or getattr(module, "_lora_sync_base", False):
        return None
    if getattr(module, "_lora_merged", None) is None:
        module._lora_merged = MergedWeights(module)
    return module._lora_merged


@contextlib.contextmanager
def merged_for_sync(chunks: Sequence[torch.nn.Module]):
    """The merged tensors of ``chunks`` filled while inside (a weight sync reads them)."""
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            merged = merged_weights(chunk)
            if merged is not None:
                stack.enter_context(merged.during_sync())
        yield


# ---------------------------------------------------------------------------- PEFT in and out
@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter directory, read and checked."""

    rank: int
    alpha: float
    dropout: float
    target_modules: Tuple[str, ...]  # HF part names
    modules_to_save: Tuple[str, ...]  # HF module names (SAVED)
    tensors: Dict[str, torch.Tensor]  # PEFT names -> tensors


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    """Read ``adapter_config.json`` and ``adapter_model.safetensors`` under ``path``; refuse by
    name what this LoRA does not reproduce exactly."""
    from safetensors.torch import load_file

    directory = Path(path)
    config_file, weights = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for f in (config_file, weights):
        if not f.is_file():
            raise LoRAError(f"model.lora.path={path}: {f.name} is missing (a PEFT adapter directory has "
                            f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads(config_file.read_text())
    unsupported = {"peft_type": ("LORA",), "bias": ("none",), "use_dora": (False, None), "use_rslora": (False, None),
                   "fan_in_fan_out": (False, None), "layers_to_transform": (None,),
                   "rank_pattern": ({}, None), "alpha_pattern": ({}, None)}
    for key, allowed in unsupported.items():
        if config.get(key, allowed[0]) not in allowed:
            raise LoRAError(f"model.lora.path={path}: {ADAPTER_CONFIG} has {key}={config[key]!r}; megarl's LoRA "
                            f"loads {key}={allowed[0]!r} only")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise LoRAError(f"model.lora.path={path}: target_modules is a pattern ({targets!r}); save the adapter "
                        f"with a list of module names")
    unknown = [t for t in targets if t not in _PART]
    if unknown:
        raise LoRAError(f"model.lora.path={path}: target_modules {unknown} are not LoRA targets megarl builds "
                        f"({sorted(_PART)})")
    saved = tuple(config.get("modules_to_save") or ())
    if any(m not in SAVED for m in saved):
        raise LoRAError(f"model.lora.path={path}: modules_to_save {list(saved)}: megarl trains {sorted(SAVED)} "
                        f"beside the adapters only")
    tensors = load_file(str(weights))
    return PeftAdapter(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout") or 0.0),
                       tuple(t for t in _PART if t in targets), saved, tensors)


def hf_weight(args, key: str) -> str:
    """The HF name of a Megatron weight outside the decoder layers (``decoder.final_layernorm.weight``)."""
    from megarl.models.hf_mapping import global_rules

    rule = next((r for r in global_rules(args, 1) if r.mcore == key), None)
    if rule is None:
        raise LoRAError(f"{args.model_type} has no '{key}' in the converter's table")
    return rule.hf_names()[0]


def hf_modules(args, layer: int, key: str) -> Dict[str, str]:
    """{HF part: HF module name} of Megatron linear ``key`` in ``layer``, from the converter's table."""
    from megarl.models.hf_mapping import layer_rules

    rule = next((r for r in layer_rules(args, layer) if r.mcore == f"{key}.weight"), None)
    if rule is None:
        raise LoRAError(f"{args.model_type} layer {layer} has no '{key}' in the converter's table")
    names = [n[:-len(".weight")] for n in rule.hf_names(layer)]
    return {n.rsplit(".", 1)[1]: n for n in names}


@torch.no_grad()
def load_peft(chunks: Sequence[torch.nn.Module], adapter: PeftAdapter, args, path: str) -> None:
    """Fill this rank's adapters from a PEFT adapter (each rank its own slices)."""
    for a in adapters(chunks):
        names = hf_modules(args, a.layer, a.key)
        for part in a.parts:
            keys = [f"{PEFT_PREFIX}{names[part]}.lora_{x}.weight" for x in "AB"]
            missing = [k for k in keys if k not in adapter.tensors]
            if missing:
                raise LoRAError(f"model.lora.path={path}: {ADAPTER_WEIGHTS} has no '{missing[0]}'")
            whole_a, whole_b = (adapter.tensors[k] for k in keys)
            if a.kind == "column":
                rows = a.B[part].shape[0]
                local_a, local_b = whole_a, whole_b[a.tp_rank * rows:(a.tp_rank + 1) * rows]
            else:
                cols = a.A[part].shape[1]
                local_a, local_b = whole_a[:, a.tp_rank * cols:(a.tp_rank + 1) * cols], whole_b
            for dst, src, k in ((a.A[part], local_a, keys[0]), (a.B[part], local_b, keys[1])):
                if tuple(dst.shape) != tuple(src.shape):
                    raise LoRAError(f"model.lora.path={path}: '{k}' gives {tuple(src.shape)} on tensor-parallel "
                                    f"rank {a.tp_rank}, the model expects {tuple(dst.shape)}")
                dst.copy_(src.to(dst.dtype))
    for chunk in chunks:
        params = dict(getattr(chunk, "module", chunk).named_parameters())
        for module in saved_modules(adapter.modules_to_save):
            key = f"{module}.weight"
            if key not in params:  # another pipeline stage's
                continue
            name = PEFT_PREFIX + hf_weight(args, key)
            if name not in adapter.tensors:
                raise LoRAError(f"model.lora.path={path}: {ADAPTER_WEIGHTS} has no '{name}' (modules_to_save)")
            params[key].copy_(adapter.tensors[name].to(params[key].dtype))


def gather_peft(chunks: Sequence[torch.nn.Module], args, contribute: bool) -> Dict[str, torch.Tensor]:
    """Every adapter of the model, whole, under PEFT's names, on every rank (collective over the
    world; the adapters are small). ``contribute``: this rank's pieces are needed (one data- and
    context-parallel replica contributes): TP slices of the split factors, TP rank 0's replicated ones."""
    import torch.distributed as dist

    pieces = []
    if contribute:
        for a in adapters(chunks):
            names = hf_modules(args, a.layer, a.key)
            split_factor, dim = ("B", 0) if a.kind == "column" else ("A", 1)
            for part in a.parts:
                for factor, tensor in (("A", a.A[part]), ("B", a.B[part])):
                    split = factor == split_factor
                    if split or a.tp_rank == 0:
                        pieces.append((f"{PEFT_PREFIX}{names[part]}.lora_{factor}.weight", dim if split else None,
                                       a.tp_rank, tensor.detach().cpu()))
    everyone: List[Optional[list]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    by_key: Dict[str, dict] = {}
    for rank_pieces in everyone:
        for key, dim, tp_rank, tensor in rank_pieces:
            by_key.setdefault(key, {"dim": dim, "parts": {}})["parts"][tp_rank] = tensor
    return {key: (v["parts"][0] if v["dim"] is None else torch.cat([v["parts"][r] for r in sorted(v["parts"])], v["dim"]))
            for key, v in by_key.items()}


def resolve(lora_cfg, field: str = "model.lora"):
    """``lora_cfg`` with rank, alpha, dropout and target_modules from its PEFT ``path`` (if any);
    a rank set here that differs from the adapter's is refused."""
    import dataclasses

    if not lora_cfg.path:
        return lora_cfg
    adapter = read_peft_adapter(lora_cfg.path)
    if lora_cfg.rank and lora_cfg.rank != adapter.rank:
        raise LoRAError(f"{field}.rank={lora_cfg.rank} but the adapter at {field}.path has r={adapter.rank}; "
                        f"leave {field}.rank unset (0) or set it to {adapter.rank}")
    return dataclasses.replace(lora_cfg, rank=adapter.rank, alpha=adapter.alpha, dropout=adapter.dropout,
                               target_modules=list(adapter.target_modules),
                               modules_to_save=sorted({_CONFIG_NAME[SAVED[m]] for m in adapter.modules_to_save})
                               or list(lora_cfg.modules_to_save))


def peft_config(lora_cfg, base: Optional[str], parts: Sequence[str], saved: Sequence[str] = ()) -> dict:
    """The ``adapter_config.json`` PEFT writes for this adapter; ``saved``: HF modules trained whole."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
            "lora_dropout": lora_cfg.dropout, "target_modules": sorted(parts), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "base_model_name_or_path": base, "modules_to_save": list(saved) or None}
