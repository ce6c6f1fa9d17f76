"""Rollout backends (``parallel.rollout.engine``): one file per backend, one line each in
:data:`ROLLOUT_BACKENDS`. An entry validates its own config section, names what it needs before
any process starts, builds its engine for a placement and picks the weight transport
(megarl.transports) that feeds it. No code outside this package branches on the backend's name.

A new backend: a file here subclassing :class:`RolloutBackend`, a member of
``megarl.config.schema.Engine`` and a line in :data:`ROLLOUT_BACKENDS`; the backend contract
test (tests/distributed/test_rollout.py) runs it through the shared cases.
"""

from __future__ import annotations

import abc
import importlib
from typing import Dict, List, Optional

from megarl.config.schema import Engine, WeightSync
from megarl.hybrid.shards import ModelSpec
from megarl.hybrid.transfer import TransferPlan, plan_transfer
from megarl.models import lora
from megarl.parallel import Layout


class RolloutBackend(abc.ABC):
    """One rollout backend. Every method takes the sub-configs it needs; the defaults are the
    native engine's answers where a backend has nothing to add."""

    name: Engine
    records_routing = False
    """Whether its responses carry the experts each token was routed to (routing replay)."""
    needs_gpus = False
    """Whether it runs on GPUs only (a Ray cluster without GPUs is refused)."""
    serves_lora = False
    """Whether its engine serves LoRA adapters (``parallel.rollout.lora_sync=adapter``, colocated)."""
    delta_sync = True
    """Whether its transports take ``parallel.rollout.weight_sync=delta`` (shards it keeps between syncs)."""
    sliding_window = False
    """Whether its engine is checked to run a sliding-window model (Megatron's ``window_size``) exactly."""
    hf_weight_names = True
    """Whether its weight sync names tensors as the HF checkpoint does (``megarl.hybrid.hf_names``),
    which a model whose checkpoint stacks its experts (gpt_oss) cannot take."""
    gated_delta_net = False
    """Whether its engine is checked to run gated delta nets (Qwen3-Next, Qwen3.5) exactly."""
    partial_rollout = False
    """Whether its engine pauses between tokens for a weight sync and continues its responses under the
    new weights (``parallel.rollout.partial_rollout``)."""
    sample_streaming = False
    """Whether its engine takes new requests into a rollout in flight (``admit``: ``trainer.loop=async``)."""

    def check(self, cfg) -> None:
        """Refuse (ConfigError) settings of ``parallel.rollout`` this backend cannot take."""

    def check_available(self, cfg) -> None:
        """Refuse (ConfigError) a run on a machine that lacks what the backend needs (``--dry-run``
        plans without it)."""

    def worker_env(self) -> Dict[str, str]:
        """Environment every worker of a run with this backend starts with."""
        return {}

    def plan_lines(self, cfg, gen, placement) -> List[str]:
        """What the backend would run, for ``megarl train --dry-run`` and ``megarl layout``."""
        return []

    def weight_path(self) -> str:
        """How split placement's sync reaches the engines (the plan's note), "" when point to point."""
        return ""

    def split_plan_lines(self, cfg, plan, layout, itemsize: int) -> Optional[List[str]]:
        """Split placement's per-rank plan lines of a sync; None: each rollout rank's shard point to
        point, as the transfer plan lists them."""
        return None

    @abc.abstractmethod
    def colocated(self, cfg, args, regrouping, train_chunks):
        """The engine on the training ranks, fed in process from ``train_chunks``."""

    @abc.abstractmethod
    def split(self, cfg, args, plan):
        """The engine on the rollout's own ranks (split placement; ``plan``: the transfer plan)."""

    @abc.abstractmethod
    def sender(self, cfg, args, layout, train_chunks):
        """The training ranks' side of split placement's sync (a megarl.transports.WeightSender)."""


# the backend of each engine name, imported when first used ("module:Class")
ROLLOUT_BACKENDS: Dict[Engine, str] = {
    Engine.native: "megarl.rollout.backends.native:NativeBackend",
    Engine.sglang: "megarl.rollout.backends.sglang:SGLangBackend",
    Engine.vllm: "megarl.rollout.backends.vllm:VLLMBackend",
}

_built: Dict[Engine, RolloutBackend] = {}


def rollout_backend(engine) -> RolloutBackend:
    """The backend registered for ``engine`` (an Engine or its value)."""
    engine = Engine(engine)
    if engine not in _built:
        module, cls = ROLLOUT_BACKENDS[engine].split(":")
        _built[engine] = getattr(importlib.import_module(module), cls)()
    return _built[engine]


def rollout_dtype(rollout_cfg) -> Optional[str]:
    """The generation model's params_dtype: None = the actor's (``parallel.rollout.dtype=auto``)."""
    from megarl.config.schema import RolloutDtype

    return None if rollout_cfg.dtype == RolloutDtype.auto else str(rollout_cfg.dtype)


# Split placement's layouts and weight-sync plan, from the config (the plan itself is pure:
# megarl.hybrid.transfer.plan_transfer over a model spec and the two layouts).
def rollout_layout(cfg) -> Layout:
    """The rollout's own layout under split placement: parallel.rollout.tp over its nproc ranks, pp = 1."""
    r = cfg.parallel.rollout
    return Layout(tp=r.tp, pp=1, dp=max(1, r.nproc // r.tp))


def transfer_plan(cfg, args) -> TransferPlan:
    """The weight sync's plan (pure: the trainer's ranks and the rollout's compute the same)."""
    train = Layout.from_config(cfg.parallel.actor, cfg.trainer.nnodes * cfg.trainer.nproc_per_node)
    elems = max(1, (cfg.parallel.rollout.bucket_mb << 20) // 4 // 2)  # fp32 elements; two buckets in flight
    model = ModelSpec.from_args(args, cfg.model.make_vocab_size_divisible_by)
    return plan_transfer(model, train, rollout_layout(cfg), elems, lora.static_tensors(model, cfg.model.lora),
                         cfg.parallel.rollout.weight_sync == WeightSync.delta)
