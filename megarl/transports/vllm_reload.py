"""vLLM's CPU build: each bucket of whole HF tensors is written as a safetensors file (in
``/dev/shm`` where there is one) that the worker extension reloads in place
(:class:`megarl.rollout.vllm_worker.WeightLoader`, vLLM's ``reload_weights``), then removed.
The CPU build has no weight-transfer engine to hand tensors to (``ipc`` and the NCCL engines
need CUDA), and ``collective_rpc`` would serialize tensors as nested lists; a file is read by
memory map."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Optional

from megarl.hybrid.hf_names import NamedTensors
from megarl.transports import EngineHandOver, HandOverCall


def bucket_file(bucket: NamedTensors, directory: str) -> str:
    """``bucket`` as a safetensors file in ``directory``, written under a temporary name and renamed."""
    from safetensors.torch import save_file

    fd, partial = tempfile.mkstemp(prefix="megarl-vllm-", suffix=".partial", dir=directory)
    os.close(fd)
    try:
        save_file({name: t.contiguous() for name, t in bucket}, partial)
        path = partial.removesuffix(".partial") + ".safetensors"
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    return path


class ReloadHandOver(EngineHandOver):
    """The carrier file of each bucket, written and reloaded by the engine's rank."""

    on_host = True
    sleep_level = 1  # the CPU build keeps what it had

    def __init__(self, tp_group=None, keeps_weights: bool = True):
        self.shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    def bucket(self, call: Optional[HandOverCall], named: NamedTensors) -> int:
        """The file beside the tensors while it is written and read: in memory in ``/dev/shm``."""
        if call is None:
            return 0
        path = bucket_file(named, self.shm)
        try:
            call("megarl_reload_weights", path)
        finally:
            os.unlink(path)
        return sum(t.numel() * t.element_size() for _, t in named) if self.shm == "/dev/shm" else 0
