"""Weight transports: how the actor's weights reach a rollout engine, one file per transport.

Each transport is a sender (the trainer's side) and a receiver (the engine's side) over the
interfaces below; a rollout backend (megarl/rollout/backends/) picks one per placement, and
engines receive through it without knowing which:

- :mod:`~megarl.transports.micro_dp`: colocated, in process (the 3D-HybridEngine's micro-DP resharding);
- :mod:`~megarl.transports.p2p`: split placement, each rollout rank its shard point to point;
- :mod:`~megarl.transports.cuda_ipc`: colocated hand-over of whole tensors to SGLang as CUDA-IPC handles;
- :mod:`~megarl.transports.nccl_broadcast`: split placement, whole HF tensors broadcast to SGLang;
- :mod:`~megarl.transports.vllm_ipc`, :mod:`~megarl.transports.vllm_reload`: the last step into vLLM
  after either receiver (an :class:`EngineHandOver`): its ``ipc`` weight-transfer engine on GPUs,
  ``reload_weights`` from a carrier file on its CPU build.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Optional, Tuple

import torch


class WeightSender(abc.ABC):
    """A training rank's side of a sync to another worker group (split placement)."""

    @abc.abstractmethod
    def connect(self, address: str, port: int) -> None:
        """Join the group spanning the senders and the receivers (collective over both)."""

    @abc.abstractmethod
    def send(self) -> int:
        """Send one sync; the bytes this rank sent."""

    def last_stats(self):
        """The last send's megarl.hybrid.SyncStats (peak extra memory, delta copy), None if not kept."""
        return None


class WeightReceiver(abc.ABC):
    """An engine rank's side: where its generation layout's ranks sit and what fills its weights.

    An engine calls :meth:`place` for its process groups, then :meth:`bind` with the tensors to
    fill (local name -> tensor); the returned executor's ``sync()`` fills them, its ``outputs``,
    ``versions`` (what moved last: cleared, everything moves) and ``last`` (SyncStats) say how."""

    @property
    @abc.abstractmethod
    def gen(self):
        """The generation layout (megarl.parallel.Layout)."""

    @abc.abstractmethod
    def place(self, gen):
        """The generation layout's process groups on this world's ranks (``gen`` may differ from
        :attr:`gen` in settings that do not move ranks, e.g. sequence parallelism)."""

    @abc.abstractmethod
    def bind(self, model, outputs: Optional[Dict[str, torch.Tensor]] = None):
        """The executor filling ``outputs`` for ``model`` (megarl.hybrid.ModelSpec)."""

    def bind_buffers(self, model, dtype: torch.dtype):
        """The executor filling buffers of its own (an engine that copies the shard onwards, e.g.
        into vLLM), ``dtype`` where the transport lets the receiver choose."""
        return self.bind(model)

    @abc.abstractmethod
    def shard(self, executor, rank: int) -> List:
        """The planned local tensors of ``rank``'s generation shard (what the model must hold)."""

    def connect(self, address: str, port: int, executor) -> None:
        """Join the group spanning the senders and this world (split placement); in process: nothing."""

    def sync_bytes(self, executor) -> Optional[Tuple[int, int]]:
        """(bytes received in the last sync, bytes of this rank's shard); None where the transport
        does not move shards (in process, or whole tensors)."""
        return None


HandOverCall = Callable[..., object]
"""``call(method, *args, **kwargs)``: a worker method run on every worker of an engine (vLLM's
``collective_rpc``)."""


class EngineHandOver(abc.ABC):
    """How an external engine's workers take a replica's whole HF tensors, bucket by bucket, once
    a receiver above has filled the generation shard (vLLM: :mod:`~megarl.transports.vllm_ipc` on
    GPUs, :mod:`~megarl.transports.vllm_reload` on its CPU build; picked by
    ``megarl.rollout.backends.vllm.HAND_OVERS``). ``call`` is None on ranks without the engine;
    every method is collective over the generation TP group."""

    on_host: bool
    """Whether the bucket's tensors must be on the host (else on this rank's device)."""

    sleep_level: int
    """vLLM's sleep level while the trainer holds the device: 2 discards the weights, 1 keeps them on the host."""

    def engine_kwargs(self) -> Dict[str, object]:
        """Keywords the engine starts with."""
        return {}

    def engine_env(self) -> Dict[str, str]:
        """Environment the engine's processes start with."""
        return {}

    def connect(self, call: Optional[HandOverCall]) -> None:
        """Once, after the engine has started."""

    def begin(self, call: Optional[HandOverCall]) -> None:
        """Before a sync's first bucket."""

    @abc.abstractmethod
    def bucket(self, call: Optional[HandOverCall], named) -> int:
        """Hand ``named`` ([(HF name, whole tensor)]) to the engine; the bytes it held meanwhile
        beyond the tensors themselves."""

    def end(self, call: Optional[HandOverCall]) -> None:
        """After a sync's last bucket."""
