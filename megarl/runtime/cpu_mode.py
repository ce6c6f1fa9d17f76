"""Run unmodified megatron-core on machines without CUDA.

megatron-core is written for GPUs: it asks ``torch.cuda.current_device()`` for a device,
creates CUDA streams and events, places a few tensors on ``device='cuda'`` and checks
``param.type() == 'torch.cuda.FloatTensor'``. :func:`enable` redirects exactly those spots to
the CPU so that Megatron's real TP/PP/EP/DP code runs under gloo. It does nothing when CUDA is
available, and it is the only place in megarl that knows about these redirections.

What it does (see ``shared/MEGATRON_ON_CPU.md`` for how each spot was found):

* a ``TorchFunctionMode`` maps any CUDA device argument (``'cuda'``, ``'cuda:0'``, an integer
  ordinal, ``torch.device('cuda')``) to the CPU, including ``Tensor.cuda()`` and ``Tensor.to``;
* ``Tensor.type()`` of a CPU tensor reports the CUDA type name (``torch.cuda.FloatTensor``), so
  Megatron's optimizer and grad-clipping type checks accept CPU parameters;
* ``torch.cuda`` stream/event/synchronize/memory helpers become CPU no-ops; the "CUDA" RNG
  state that Megatron's RNG tracker forks lives in a separate CPU generator (so, unlike on GPUs,
  dropout inside a tracker fork draws from the CPU default generator: megarl trains with
  dropout 0, where this does not matter);
* the alltoall MoE dispatcher's split sizes become NumPy arrays, as they do after its
  device-to-host copy on GPUs;
* :func:`fix_missing_transformer_engine` guards the two spots that assume Transformer Engine
  (also used on GPUs without the ``gpu`` extra);
* the gated delta net's ``fla`` kernel (Qwen3-Next, Qwen3.5) needs no patch here: megarl's layer
  (:mod:`megarl.models.gated_delta_net`) runs its torch recurrence whenever CUDA or ``fla`` is
  absent, and builds Megatron's module without asking for ``fla``;
* :func:`light_megatron_import` imports ``megatron.core`` with its ``jit_fuser`` a no-op instead
  of ``torch.compile``, whose first use imports TorchDynamo and Inductor (2-3 s per process) for
  fused kernels that megarl turns off on CPU (:mod:`megarl.megatron_import` calls it).

The function mode intercepts every torch call in Python (measured in issue 17: +9% on the ops
of a batch-64 decode step, +37% at batch 1). Hot loops known to name no CUDA device run under
:func:`suspended`: the native rollout's decode, and the training engine's model forward but at
cp > 1 (Megatron's RoPE slice for context parallelism moves a pinned index with ``.cuda()``).
Backward passes never see the mode (torch pops it while autograd runs a Python backward).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
# Stands in for the CUDA default generator (see _patch_torch_cuda).
_CUDA_SHADOW = torch.Generator()
_mode: "_CudaToCpuMode | None" = None


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Integers are CUDA ordinals in torch's device arguments (``device=0`` means ``cuda:0``).
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu_device(device):
    return torch.device("cpu") if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # staging for a host-to-GPU copy (Megatron's CP RoPE slice)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.to and len(args) > 1:
            args = tuple(_to_cpu_device(a) for a in args)
        return func(*args, **kwargs)


class _Stream:
    """Stand-in for ``torch.cuda.Stream``/``Event``: CPU work is already in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Stream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


def _returning(value):
    # A new function object per patched attribute: torch.compile keys its rules on identity.
    return lambda *args, **kwargs: value() if callable(value) else value


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # A device object rather than an ordinal: backward passes run outside the function mode
    # (torch pops modes while a handler runs), so ``device=torch.cuda.current_device()`` there
    # must already mean the CPU.
    cuda.current_device = _returning(torch.device("cpu"))
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
        setattr(cuda, name, _returning(0))
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(cuda, name, _returning(None))
    cuda.device_count = _returning(1)
    cuda.Stream = _Stream
    cuda.Event = type("_Event", (_Stream,), {})
    cuda.current_stream = _returning(_Stream)
    cuda.default_stream = _returning(_Stream)
    cuda.stream = _returning(contextlib.nullcontext)
    # Megatron's RNG tracker seeds, saves and restores "CUDA" RNG states; a separate CPU
    # generator holds them, so the CPU default generator is left alone as it is on GPUs.
    cuda.manual_seed = lambda seed: _CUDA_SHADOW.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: _CUDA_SHADOW.manual_seed(seed)
    cuda.get_rng_state = lambda *args, **kwargs: _CUDA_SHADOW.get_state()
    cuda.set_rng_state = lambda state, *args, **kwargs: _CUDA_SHADOW.set_state(state)


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: _CUDA_SHADOW.set_state(state)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: _CUDA_SHADOW.get_state()


def _patch_megatron() -> None:
    from megatron.core.transformer.moe import moe_utils

    _patch_megatron_rng()

    # The alltoall dispatcher turns split sizes into NumPy only for CUDA tensors (its
    # device-to-host copy); CPU tensors would reach all_to_all_single as tensors and be refused.
    from megatron.core.transformer.moe import token_dispatcher

    def split_sizes_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = split_sizes_to_host
    token_dispatcher.maybe_move_tensor_to_cpu = split_sizes_to_host


def fix_missing_transformer_engine() -> None:
    """Guard two megatron-core spots that assume Transformer Engine when it is absent (CPU, or a
    GPU machine without the ``gpu`` extra): the router's unguarded ``te_general_gemm`` name and
    MLA's ``isinstance(..., TELinear)`` with a placeholder ``TELinear``. Idempotent."""
    try:
        import transformer_engine  # noqa: F401
        return
    except ImportError:
        pass
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(multi_latent_attention.TELinear, type):  # None or a MagicMock placeholder
        multi_latent_attention.HAVE_TE = False


def _passthrough_compile(model=None, **kwargs):
    """``torch.compile``'s two call forms, compiling nothing."""
    return (lambda fn: fn) if model is None else model


@contextlib.contextmanager
def light_megatron_import():
    """The body (the import of ``megatron.core``) sees ``torch.compile`` as a no-op, and megatron's
    ``jit_fuser`` stays one afterwards, when CUDA is absent; with CUDA, nothing changes. The fused
    kernels it decorates are off on CPU (``megarl.models.builder``: ``bias_activation_fusion`` and
    ``masked_softmax_fusion`` follow Transformer Engine, ``apply_rope_fusion`` is off), so eager
    and compiled would run the same nothing. ``torch.compile`` is swapped only for the import's
    duration, under the import lock; so is ``wandb`` hidden (megatron's inference context, which
    megarl does not use, would import it)."""
    if torch.cuda.is_available():
        yield
        return
    real, torch.compile = torch.compile, _passthrough_compile
    # Its dynamic inference context (unused by megarl) imports wandb when installed: 1 s of every
    # process. Hidden for the import only; megarl's own tracker imports the real wandb later.
    hidden = "wandb" not in sys.modules
    if hidden:
        sys.modules["wandb"] = None
    try:
        yield
    finally:
        torch.compile = real
        if hidden and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
    from megatron.core import jit

    jit.disable_jit_fuser()


def enable() -> bool:
    """Turn CPU mode on for this process if CUDA is absent; returns whether it is on.

    Idempotent. Call it before building any Megatron object (``megarl.runtime.init_distributed``
    does). With CUDA present it changes nothing and returns False.
    """
    global _mode
    with _lock:
        if _mode is not None:
            return True
        if torch.cuda.is_available():
            return False
        _patch_torch_cuda()
        _patch_megatron()
        fix_missing_transformer_engine()
        _mode = _CudaToCpuMode()
        _mode.__enter__()
        return True


@contextlib.contextmanager
def suspended():
    """Run the body without the function mode (the other patches stay): for hot loops whose torch
    calls name no CUDA device. A CUDA device named inside fails loudly (torch is CPU-only), so a
    wrong use cannot go unnoticed. Does nothing when CPU mode is off, or when another function
    mode was pushed above this one (popping that would change its behaviour)."""
    mode = _mode
    depth = torch._C._len_torch_function_stack()
    if mode is None or depth == 0 or torch._C._get_function_stack_at(depth - 1) is not mode:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


def is_enabled() -> bool:
    """Whether :func:`enable` switched this process to CPU mode."""
    return _mode is not None
