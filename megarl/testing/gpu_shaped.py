"""A GPU-shaped harness for tests: megarl's CUDA code paths on a CPU-only machine, with device checks.

Under gloo on CPU a tensor's device never matters, so CPU tests cannot see the faults a first GPU
run hits first: a CPU batch fed to a CUDA model, a CPU tensor in an NCCL collective, a CPU random
generator sampling CUDA probabilities. :func:`enable` makes the process look like one with one
CUDA device, and checks devices as CUDA torch and NCCL would:

* ``torch.cuda.is_available()`` is True (one device, ordinal 0), so megarl and megatron-core take
  their GPU branches: NCCL process groups, ``device="cuda"`` allocations, ``.cuda()`` moves;
* a tensor placed on ``cuda`` is a :class:`CudaShapedTensor`: its storage is on the CPU and its
  values are real (``.item()``, ``.tolist()`` and parity checks work), but it reports
  ``device == cuda:0``; tensors computed from such tensors are CUDA-shaped too, and ``.cpu()`` /
  ``.to("cpu")`` copy to a plain CPU tensor, ``.numpy()`` refuses as CUDA torch does;
* every torch call that mixes CUDA-shaped and plain CPU tensors raises :class:`DeviceMismatch`
  (CUDA torch's "Expected all tensors to be on the same device"), with the exceptions CUDA torch
  makes: CPU scalars (0-dim tensors), CPU index tensors, and copies between devices;
* process groups asked for NCCL (the default backend here) run on gloo and accept only
  CUDA-shaped tensors; groups asked for gloo accept only CPU tensors, as on a GPU machine;
* point-to-point on NCCL-shaped groups pairs as NCCL does, in posting order per pair of ranks,
  ignoring tags, and a receive paired with a send it disagrees with raises
  (:mod:`megarl.testing.nccl_p2p`);
* ``torch.Generator(device="cuda")`` gives a generator that reports ``cuda``, and sampling CUDA
  probabilities with a CPU generator (or CPU probabilities with a CUDA one) raises, as torch does.

Values are real rather than FakeTensors: FakeTensor cannot run the ``.item()`` and ``.tolist()``
calls the engines make each step, and its CUDA tensors cannot run a backward pass on a CPU-only
build (autograd asks for a CUDA device guard). Autograd here runs on the CPU storage and its
hooks run outside the function mode, so gradients computed by autograd are plain CPU tensors:
the checks cover forward passes, optimizer steps and collectives, not autograd's internals.

Only tests use this module (``pytest -m gpu_shaped``; workers set ``MEGARL_GPU_SHAPED=1``, read by
:func:`megarl.runtime.init_distributed`). It includes :mod:`megarl.runtime.cpu_mode`'s
megatron-core patches that do not depend on the device (Transformer Engine guards).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from megarl.runtime import cpu_mode
from megarl.runtime.cpu_mode import _is_cuda_device as _device_is_cuda
from megarl.testing import device_memory
from megarl.runtime.distributed import GPU_SHAPED_ENV, gpu_shaped_requested
from megarl.runtime.distributed import collective_timeout
from megarl.testing import nccl_p2p

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
ENV = GPU_SHAPED_ENV

_lock = threading.Lock()
_state = threading.local()  # .backward: inside an autograd backward pass run by the harness
_state.backward = False
_mode: "_GpuShapedMode | None" = None
_group_device: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> device its backend takes
_default_device = CUDA  # the default group's (NCCL)
_OriginalGenerator = torch.Generator


class DeviceMismatch(RuntimeError):
    """A torch call or collective got tensors on devices CUDA torch or NCCL would refuse."""


class CudaShapedTensor(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # the mode handles every call

    @property
    def device(self):
        return CUDA

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False

    def get_device(self):
        return 0

    def type(self, *args, **kwargs):
        if args or kwargs:
            return _as_cuda(torch.Tensor.type(self, *args, **kwargs))
        name = torch.Tensor.type(self)
        return name.replace("torch.", "torch.cuda.", 1)

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    def __reduce_ex__(self, protocol):
        # Pickling (torch.save, Ray) keeps the device, as for a real CUDA tensor.
        return (_rebuild_cuda, (torch.Tensor(self).as_subclass(torch.Tensor).clone(),))

    def __repr__(self, *args, **kwargs):
        return "CudaShaped" + torch.Tensor.__repr__(self.as_subclass(torch.Tensor))


def _rebuild_cuda(cpu: torch.Tensor) -> torch.Tensor:
    if _mode is None:  # a process without the harness (the driver) is a process without CUDA
        raise RuntimeError("Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is "
                           "False: a CUDA-shaped tensor reached a process without the GPU-shaped harness; move "
                           "it to the host (megarl.runtime.devices.to_host) before it leaves its worker")
    return _as_cuda(cpu)


def _as_cuda(t):
    """``t`` marked CUDA-shaped in place (its class changes; identity, view base and autograd
    history stay), for tensors just made on the "device"."""
    if type(t) is torch.Tensor:
        t.__class__ = CudaShapedTensor
    elif isinstance(t, torch.Tensor) and not isinstance(t, CudaShapedTensor):
        if type(t) is torch.nn.Parameter:
            t.__class__ = CudaShapedTensor  # keeps _is_param: still an nn.Parameter to isinstance
            t._is_param = True
        else:
            t = t.as_subclass(CudaShapedTensor)
    if isinstance(t, torch.Tensor):
        device_memory.track(t)  # the device memory model counts its storage
    return t


def _as_cpu(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, CudaShapedTensor) else t


def is_cuda(t) -> bool:
    """Whether ``t`` is CUDA-shaped (what ``t.is_cuda`` says under the harness)."""
    return isinstance(t, CudaShapedTensor)


def _device_arg(args, kwargs):
    """The device a ``.to(...)`` call names, or None."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


# Calls whose tensors may sit on different devices (CUDA torch allows these) and whose result is
# on the device of their first argument (or of their ``device`` argument).
_SELF_DEVICE = {torch.Tensor.new_tensor, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
                torch.Tensor.new_full, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_,
                torch.Tensor.set_, torch.Tensor.__reduce_ex__, torch.Tensor.expand_as, torch.Tensor.view_as,
                torch.Tensor.reshape_as}
# Indexing: index tensors may be on the CPU for a CUDA tensor, not the other way round.
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put,
             torch.index_put}
# Queries and object bookkeeping, not computations: no device rule applies.
_UNCHECKED = {torch._has_compatible_shallow_copy_type, torch.Tensor.data.__set__, torch.Tensor.grad.__set__,
              torch.Tensor.is_set_to, torch.Tensor.data_ptr, torch.Tensor.untyped_storage}
_IN_PLACE_COPIES = {torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.set_}
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward}
_GETTERS = {torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__}


class _GpuShapedMode(TorchFunctionMode):
    """Places ``cuda`` tensors on the CPU as :class:`CudaShapedTensor` and checks devices."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _GETTERS:
            return func(*args, **kwargs)
        if func in _BACKWARD:
            return self._backward(func, args, kwargs)
        if kwargs.get("pin_memory"):  # host memory, counted as the caching host allocator pins it
            kwargs["pin_memory"] = False
            return device_memory.pinned(self.__torch_function__(func, types, args, kwargs))
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return _move(func, args, kwargs)
        if func is torch.Tensor.numpy and is_cuda(args[0]):
            args[0].numpy()  # raises, as for a CUDA tensor
        named = kwargs.get("device")
        to_cuda = named is not None and _device_is_cuda(named)
        if to_cuda:
            kwargs["device"] = CPU
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if getattr(_state, "backward", False):
            # Autograd's gradients are plain CPU tensors here (see the module docstring): in a
            # backward pass every tensor counts as on the device, and nothing is checked.
            return _placed(func(*args, **kwargs), args) if tensors or to_cuda else func(*args, **kwargs)
        if func in _INDEXING:
            _check_indices(func, args)
        elif func not in _SELF_DEVICE and func not in _UNCHECKED:
            _check_same_device(func, tensors)
        _check_generator(func, kwargs, tensors)
        out = func(*args, **kwargs)
        if func in _IN_PLACE_COPIES or func in _UNCHECKED:
            return out
        if named is not None:
            on_cuda = to_cuda
        elif func in _SELF_DEVICE:
            on_cuda = is_cuda(args[0])
        else:
            on_cuda = any(is_cuda(t) for t in tensors)
        return _placed(out, args) if on_cuda else out

    def _backward(self, func, args, kwargs):
        """Run autograd's engine with this mode active (a handler runs with its mode popped), so
        that backward passes written in Python (custom autograd functions, Megatron's gradient
        hooks) place ``device=...cuda`` tensors as the forward does."""
        if func is torch.Tensor.backward:
            names = ("gradient", "retain_graph", "create_graph", "inputs")
            bound = dict(zip(names, args[1:]), **kwargs)
            tensors, grads = (args[0],), bound.get("gradient")
            inputs, retain, create = bound.get("inputs"), bound.get("retain_graph"), bound.get("create_graph", False)
        else:  # torch.autograd.backward
            names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
            bound = dict(zip(names, args), **kwargs)
            tensors, grads = bound["tensors"], bound.get("grad_tensors")
            inputs, retain, create = bound.get("inputs"), bound.get("retain_graph"), bound.get("create_graph", False)
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False)
        outer, _state.backward = getattr(_state, "backward", False), True
        try:
            with self:
                _engine_run_backward(tensors, grads, create if retain is None else retain, create, inputs,
                                     allow_unreachable=True, accumulate_grad=True)
        finally:
            _state.backward = outer


def _move(func, args, kwargs):
    """``Tensor.to/.cuda/.cpu``: a copy between devices, the tensor itself when it stays."""
    src = args[0]
    if func is torch.Tensor.cuda:
        target, rest = CUDA, {}
    elif func is torch.Tensor.cpu:
        target, rest = CPU, {}
    else:
        target = _device_arg(args, kwargs)
        if isinstance(target, torch.Tensor):
            target = target.device
        rest = dict(kwargs)
        rest.pop("device", None)
        extra = [a for a in args[1:] if not (a is target or isinstance(a, (torch.device, str, torch.Tensor))
                                             or (isinstance(a, int) and not isinstance(a, bool)))]
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                rest.setdefault("dtype", a.dtype)
        if extra:
            rest.setdefault("dtype", extra[0])
        rest.pop("non_blocking", None)
        rest.pop("memory_format", None)
    rest.pop("copy", None)
    plain = _as_cpu(src)
    out = plain.to(**rest) if rest else plain
    src_cuda = is_cuda(src)
    want_cuda = src_cuda if target is None else _device_is_cuda(target)
    if want_cuda == src_cuda:
        if out is plain:
            return src
        return _as_cuda(out) if want_cuda else out
    if out is plain:  # a move between devices is a copy
        out = plain.clone()
    return _as_cuda(out) if want_cuda else out


def _placed(out, args):
    """``out`` with its new tensors CUDA-shaped (inputs returned in place stay as they are)."""
    if isinstance(out, torch.Tensor):
        return out if any(out is a for a in args) else _as_cuda(out)
    if isinstance(out, (list, tuple)) and not isinstance(out, torch.Size) and any(
            isinstance(x, torch.Tensor) for x in out):
        items = [_placed(x, args) for x in out]
        return items if type(out) is list else tuple(items) if type(out) is tuple else type(out)(items)
    return out


def _name(func) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", str(func)))


def _check_indices(func, args) -> None:
    """CUDA torch indexes a CUDA tensor with CPU or CUDA indices, a CPU tensor with CPU ones only."""
    if args and not is_cuda(args[0]):
        flat, _ = tree_flatten(args[1:2])
        if any(is_cuda(t) for t in flat):
            raise DeviceMismatch(f"{_name(func)}: indices should be either on cpu or on the same device as "
                                 f"the indexed tensor (cpu); got cuda:0 indices")


def _check_same_device(func, tensors) -> None:
    if not any(is_cuda(t) for t in tensors):
        return
    cpu = [t for t in tensors if not is_cuda(t) and t.dim() > 0]
    if cpu:
        raise DeviceMismatch(f"{_name(func)}: expected all tensors to be on the same device, but found at least two "
                             f"devices, cuda:0 and cpu (a CPU tensor of shape {list(cpu[0].shape)})")


def _check_generator(func, kwargs, tensors) -> None:
    gen = kwargs.get("generator")
    if gen is None or not tensors:
        return
    want = "cuda" if is_cuda(tensors[0]) else "cpu"
    if gen.device.type != want:
        name = getattr(func, "__name__", str(func))
        raise DeviceMismatch(f"{name}: Expected a '{want}' device type for generator but found '{gen.device.type}'")


class _Generator(_OriginalGenerator):
    """``torch.Generator`` under the harness: a CPU generator that reports the device it was asked for."""

    def __new__(cls, device="cpu"):
        gen = super().__new__(cls, "cpu")
        gen._cuda = _device_is_cuda(device)
        return gen

    def __init__(self, device="cpu"):  # the device was taken by __new__ (torch's own __init__ takes none)
        super().__init__()

    @property
    def device(self):
        return CUDA if self._cuda else CPU


# ----------------------------------------------------------------------------- process groups
def _backend_device(backend) -> torch.device:
    if backend is None:
        return _default_device
    name = str(backend).lower()
    if "nccl" in name and "gloo" not in name:
        return CUDA
    if name in ("gloo", "cpu:gloo"):
        return CPU
    return _default_device if "nccl" in name else CPU  # "cpu:gloo,cuda:nccl": tensors pick; treat as default


def _to_gloo(backend):
    return None if backend is None else "gloo"


def group_device(group=None) -> torch.device:
    """The device a group's (real) backend would take tensors on."""
    if group is None or group is dist.GroupMember.WORLD:
        return _default_device
    return _group_device.get(group, _default_device)


def _check_collective(name: str, group, tensors) -> None:
    want = group_device(group)
    for t in tensors:
        if isinstance(t, torch.Tensor) and is_cuda(t) != (want.type == "cuda"):
            got = "cuda:0" if is_cuda(t) else "cpu"
            backend = "NCCL" if want.type == "cuda" else "gloo"
            raise DeviceMismatch(f"torch.distributed.{name}: a {got} tensor of shape {list(t.shape)} on a "
                                 f"{backend} group, which takes {want.type} tensors only")


def _tensors_of(args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            out.append(x)
    return out


def _group_of(name, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a
    return None


_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base",
                "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single",
                "all_to_all", "send", "recv", "isend", "irecv", "reduce", "gather",
                "scatter")


_internal = threading.local()  # inside torch's object collectives, which place their own tensors
_P2P = {"send": True, "isend": True, "recv": False, "irecv": False}  # name -> sends
_pairings: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # c10d group -> nccl_p2p.Pairing


def _paired(name, args, kwargs):
    """``dist.send/recv/isend/irecv`` on an NCCL-shaped group: NCCL's pairing (nccl_p2p)."""
    import torch.distributed.distributed_c10d as c10d

    names = ("tensor", "dst" if _P2P[name] else "src", "group", "tag", "group_dst" if _P2P[name] else "group_src")
    bound = dict(zip(names, args), **kwargs)
    group = c10d._group_or_default_group(bound.get("group"))
    if bound.get(names[1]) is None and bound.get(names[4]) is None:
        raise RuntimeError(f"torch.distributed.{name}: a receive from any source; NCCL has none (name the peer)")
    peer = c10d._canonicalize_group_rank(group, bound.get(names[1]), bound.get(names[4]))
    if c10d._rank_not_in_group(group):
        return None
    if group not in _pairings:
        _pairings[group] = nccl_p2p.Pairing(group, f"NCCL-shaped group {group.group_name!r}", collective_timeout(),
                                            lambda r, g=group: f"{c10d.get_global_rank(g, r)} (group rank {r})")
    tensor = bound["tensor"]
    tensor = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    work = getattr(_pairings[group], "send" if _P2P[name] else "recv")(tensor, peer, bound.get("tag", 0))
    if name in ("isend", "irecv"):
        return work
    work.wait()
    return None if _P2P[name] else c10d.get_global_rank(group, peer)


def _checked(name, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        if not getattr(_internal, "depth", 0) and not getattr(_state, "backward", False):
            _check_collective(name, _group_of(name, args, kwargs), _tensors_of(args, kwargs))
        # gloo gets the CPU storage: plain tensors share it, so in-place results land in place
        # (torch re-enters the patched function through __torch_function__: checked once)
        plain = tree_map(_as_cpu, (args, kwargs))
        if name in _P2P and group_device(_group_of(name, args, kwargs)).type == "cuda":
            return _paired(name, *plain)
        _internal.depth = getattr(_internal, "depth", 0) + 1
        try:
            return original(*plain[0], **plain[1])
        finally:
            _internal.depth -= 1

    collective._gpu_shaped = True
    return collective


def _internal_collective(original):
    """torch's object collectives pick their staging device from the real (gloo) backend; on a
    GPU they pick the current CUDA device themselves, so their tensors are not checked."""

    @functools.wraps(original)
    def collective(*args, **kwargs):
        _internal.depth = getattr(_internal, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _internal.depth -= 1

    collective._gpu_shaped = True
    return collective


class _ProcessGroupNCCL:
    """Stand-in for ``torch.distributed.ProcessGroupNCCL`` (absent from CPU builds), for groups
    code builds directly: gloo underneath, CUDA-shaped tensors only."""

    _TENSOR_METHODS = {"broadcast", "send", "recv", "allreduce", "allgather", "_allgather_base", "reduce_scatter",
                       "_reduce_scatter_base", "alltoall_base", "recv_anysource", "reduce", "gather", "scatter"}

    class Options:
        """``ProcessGroupNCCL.Options``: the timeout is the one field read here."""

        def __init__(self):
            import datetime

            self._timeout = datetime.timedelta(minutes=10)

    def __init__(self, store, rank: int, size: int, options=None):
        timeout = (options or self.Options())._timeout
        self._pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._pairing = nccl_p2p.Pairing(self._pg, f"ProcessGroupNCCL (size {size})", timeout)

    def __getattr__(self, name):
        attr = getattr(self._pg, name)
        if name in ("send", "recv"):  # NCCL's pairing: posting order, tags ignored (nccl_p2p)
            attr = functools.partial(lambda call, tensors, peer, tag=0: call(tensors[0], peer, tag),
                                     getattr(self._pairing, name))
        elif name == "recv_anysource":
            raise AttributeError("ProcessGroupNCCL has no receive from any source (name the peer)")
        if name not in self._TENSOR_METHODS:
            return attr

        def checked(*args, **kwargs):
            flat, _ = tree_flatten((args, kwargs))
            for t in flat:
                if isinstance(t, torch.Tensor) and not is_cuda(t):
                    raise DeviceMismatch(f"ProcessGroupNCCL.{name}: a cpu tensor of shape {list(t.shape)}; NCCL "
                                         f"takes cuda tensors only")
            return attr(*tree_map(_as_cpu, args), **tree_map(_as_cpu, kwargs))

        return checked


def _patch_distributed() -> None:
    import torch.distributed.distributed_c10d as c10d

    for name in _COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is not None and not getattr(original, "_gpu_shaped", False):
            checked = _checked(name, original)  # one object: P2POp compares ops by identity
            setattr(c10d, name, checked)
            setattr(dist, name, checked)

    for name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                 "send_object_list", "recv_object_list"):
        original = getattr(c10d, name, None)
        if original is not None and not getattr(original, "_gpu_shaped", False):
            setattr(dist, name, _internal_collective(original))
            setattr(c10d, name, getattr(dist, name))

    batch = c10d.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        _check_collective("batch_isend_irecv", p2p_op_list[0].group if p2p_op_list else None,
                          [op.tensor for op in p2p_op_list])
        for op in p2p_op_list:
            op.tensor = _as_cpu(op.tensor)  # gloo gets the CPU storage, which the tensor shares
        _internal.depth = getattr(_internal, "depth", 0) + 1
        try:
            if p2p_op_list and group_device(p2p_op_list[0].group).type == "cuda":
                # NCCL's group call posts the ops in list order: each pairs as its own op does
                works = [op.op(op.tensor, group=op.group, tag=op.tag,
                               **{"group_dst" if _P2P[op.op.__name__] else "group_src": op.group_peer})
                         for op in p2p_op_list]
                return [w for w in works if w is not None]
            return batch(p2p_op_list)
        finally:
            _internal.depth -= 1

    if not getattr(batch, "_gpu_shaped", False):
        batch_isend_irecv._gpu_shaped = True
        dist.batch_isend_irecv = c10d.batch_isend_irecv = batch_isend_irecv

    init = c10d.init_process_group

    @functools.wraps(init)
    def init_process_group(backend=None, *args, **kwargs):
        global _default_device
        _default_device = _backend_device(backend) if backend is not None else CUDA
        kwargs.pop("pg_options", None)
        kwargs.pop("device_id", None)
        return init(_to_gloo(backend) or "gloo", *args, **kwargs)

    new_group = c10d.new_group

    @functools.wraps(new_group)
    def new_group_(*args, **kwargs):
        backend = kwargs.pop("backend", None)
        if len(args) > 2:
            backend, args = args[2], args[:2] + args[3:]
        kwargs.pop("pg_options", None)
        group = new_group(*args, backend=_to_gloo(backend), **kwargs)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            _group_device[group] = _backend_device(backend)
        return group

    get_backend = c10d.get_backend

    @functools.wraps(get_backend)
    def get_backend_(group=None):
        name = get_backend(group)
        return dist.Backend.NCCL if group_device(group).type == "cuda" and name == "gloo" else name

    destroy = c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        # the groups' pairings (and their threads) go with them
        _pairings.clear() if group is None else _pairings.pop(group, None)
        return destroy(group)

    if not getattr(destroy, "_gpu_shaped", False):
        destroy_process_group._gpu_shaped = True
        dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group

    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.new_group = new_group_
        module.get_backend = get_backend_
    dist.is_nccl_available = c10d.is_nccl_available = lambda: True
    dist.ProcessGroupNCCL = _ProcessGroupNCCL


# ----------------------------------------------------------------------------- torch.cuda
def _patch_torch_cuda() -> None:
    cpu_mode._patch_torch_cuda()  # streams, events, memory queries, the RNG tracker's states
    cpu_mode._patch_megatron_rng()
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.get_device_name = lambda *a, **k: "GPU-shaped harness (CPU)"
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.is_bf16_supported = lambda *a, **k: True
    torch.cuda.nccl.version = lambda: (2, 21, 5)
    # torch's argument parser refuses the stand-in stream before any override is asked; CPU work
    # is in program order anyway
    torch.Tensor.record_stream = lambda self, stream: None
    torch.Generator = _Generator


def _as_cpu_in_place(t: torch.Tensor) -> None:
    if isinstance(t, CudaShapedTensor):
        t.__class__ = torch.nn.Parameter if getattr(t, "_is_param", False) else torch.Tensor


def _patch_module_moves() -> None:
    """``Module.cuda()`` / ``.to("cuda")`` / ``.cpu()`` set each parameter's ``.data`` (a setter the
    function mode does not see): mark the module's tensors afterwards."""
    module = torch.nn.Module
    cuda, to, cpu = module.cuda, module.to, module.cpu

    def mark(m, on_cuda: bool):
        for t in list(m.parameters()) + list(m.buffers()):
            _as_cuda(t) if on_cuda else _as_cpu_in_place(t)
        return m

    def to_(self, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (torch.device, str, int))
                                            and not isinstance(a, bool)), None))
        out = to(self, *args, **kwargs)
        return out if device is None else mark(out, _device_is_cuda(device))

    module.cuda = functools.wraps(cuda)(lambda self, device=None: mark(cuda(self, device), True))
    module.cpu = functools.wraps(cpu)(lambda self: mark(cpu(self), False))
    module.to = functools.wraps(to)(to_)


def enable() -> bool:
    """Turn the harness on for this process (idempotent; only on a machine without CUDA).

    Call it before building any model or process group. Returns whether it is on."""
    global _mode
    with _lock:
        if _mode is not None:
            return True
        if torch._C._cuda_getDeviceCount() > 0 if hasattr(torch._C, "_cuda_getDeviceCount") else False:
            raise RuntimeError("the GPU-shaped harness is for machines without CUDA")
        _patch_torch_cuda()
        _patch_distributed()
        cpu_mode.fix_missing_transformer_engine()
        _patch_module_moves()
        device_memory.enable()  # torch.cuda's memory queries read the model from here on
        _mode = _GpuShapedMode()
        _mode.__enter__()
        return True


def requested() -> bool:
    """Whether this process was started under the harness (``MEGARL_GPU_SHAPED=1``)."""
    return gpu_shaped_requested()


def is_enabled() -> bool:
    return _mode is not None
