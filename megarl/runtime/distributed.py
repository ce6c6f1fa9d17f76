"""Start torch.distributed for megarl: NCCL with CUDA, gloo (plus CPU mode) without; in tests,
the GPU-shaped harness (``MEGARL_GPU_SHAPED=1``, :mod:`megarl.testing.gpu_shaped`)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import importlib
import os

import torch

from megarl.runtime import cpu_mode


def _slurm_to_torch_env() -> None:
    # srun starts one task per rank with SLURM_* variables; torch reads RANK/WORLD_SIZE/LOCAL_RANK.
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ:
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_PORT", "29500")


def world_size_from_env() -> int:
    """The world size this process will join (torchrun, srun, or 1), before any group exists."""
    _slurm_to_torch_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


_timeout_s = 600.0  # of every collective of this process's groups (init_distributed's timeout_s)


GPU_SHAPED_ENV = "MEGARL_GPU_SHAPED"  # set by tests: run under megarl.testing.gpu_shaped
GPU_SHAPED_MODULE = "megarl.testing.gpu_shaped"


def gpu_shaped_requested() -> bool:
    """Whether a test asked this process (and the workers it starts) for the GPU-shaped harness."""
    return os.environ.get(GPU_SHAPED_ENV) == "1"


def collective_timeout() -> datetime.timedelta:
    """The timeout of this process's collectives: the default group's, which every group megarl
    builds (Megatron's, the weights groups) takes too."""
    return datetime.timedelta(seconds=_timeout_s)


def init_distributed(timeout_s: float = 600) -> int:
    """Initialise the default process group from torchrun/srun/Ray environment variables.

    Without ``RANK``/``WORLD_SIZE`` (or srun's ``SLURM_PROCID`` plus ``MASTER_ADDR``) it starts a
    world of one on a free local port. Returns this process's global rank. Idempotent.
    ``timeout_s``: of the rendezvous and of every collective (a backstop: the RL driver names a
    stuck rank earlier, see megarl.runtime.progress).
    """
    global _timeout_s
    settle_collector()
    _slurm_to_torch_env()
    _timeout_s = float(timeout_s)
    if gpu_shaped_requested():  # tests only: CUDA code paths on CPU, with device checks
        # loaded by name, as a plugin: the runtime does not depend on the test-only package
        importlib.import_module(GPU_SHAPED_MODULE).enable()
    if torch.cuda.is_available():
        # torchrun shows a process every GPU of its node (LOCAL_RANK picks one); Ray shows a worker
        # only the GPU(s) it was given, so there the index wraps to the visible ones
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        backend = "nccl"
    else:
        cpu_mode.enable()
        share_gloo_device()
        backend = "gloo"
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _store_on_master_addr(timeout)
    if store is None:
        torch.distributed.init_process_group(backend=backend, timeout=timeout)
    else:
        torch.distributed.init_process_group(backend=backend, timeout=timeout, store=store,
                                             rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return torch.distributed.get_rank()


_settled = False


def _gloo_lazy_init() -> bool:
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "").strip().lower() in ("1", "true", "yes", "y", "on")


def share_gloo_device() -> None:
    """Give every gloo process group of this process one transport device, not one each.

    torch builds a new gloo device for each group (``ProcessGroupGloo(store, rank, size,
    timeout)``), and each device runs a thread that wakes every 10 ms (gloo's TCP loop polls its
    ``epoll`` with that timeout). Megatron builds some 50 groups per rank: 8 ranks had 400 such
    threads, 40,000 wake-ups a second, which took most of 2 cores in the kernel's context switches
    (measured in ``tests/distributed/test_reshard.py``: more system than user time). gloo's
    devices are made to be shared by many contexts; one per process (or one per interface of
    ``GLOO_SOCKET_IFNAME``, as torch would make) carries every group's pairs. Groups that pass
    their own options keep them, and so does every group under ``TORCH_GLOO_LAZY_INIT`` (lazily
    connected pairs on a shared device hung past the collective timeout: measured, torch 2.13).
    Idempotent; a forked child makes its own."""
    c10d = torch.distributed.distributed_c10d
    if not c10d.is_gloo_available() or getattr(c10d.ProcessGroupGloo, "_megarl_shared", False):
        return
    base = c10d.ProcessGroupGloo
    devices: dict = {}

    class ProcessGroupGloo(base):
        _megarl_shared = True

        def __init__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)):
            if isinstance(timeout, base._Options) or _gloo_lazy_init():  # torch's own devices
                super().__init__(store, rank, size, timeout)
                return
            pid = os.getpid()
            if pid not in devices:
                devices.clear()
                names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
                devices[pid] = ([base.create_device(interface=n) for n in names] if names
                                else [base.create_default_device()])
            options = base._Options()
            options._devices = devices[pid]
            options._timeout = timeout
            options._threads = 2 * len(devices[pid])  # torch's own choice for these groups
            super().__init__(store, rank, size, options)

    ProcessGroupGloo.__module__ = base.__module__
    ProcessGroupGloo.__qualname__ = base.__qualname__
    c10d.ProcessGroupGloo = ProcessGroupGloo


def settle_collector() -> None:
    """Keep Python's cyclic garbage collector off the objects that live as long as the process.

    A rank holds some 300k objects of torch, Megatron and transformers from its imports on; each
    full collection walks all of them (0.2-0.5 s, several per minute of training), and so does the
    interpreter's last collection at exit (1 s here, several on a loaded node; nothing of a
    finished rank needs it). One collection of the start-up's garbage, then ``gc.freeze``: the
    collector scans only what is made later; at exit (``atexit``, which Python runs before that
    last collection) everything is frozen. Idempotent; the GPU path is the same."""
    global _settled
    if _settled:
        return
    _settled = True
    gc.collect()
    gc.freeze()
    atexit.register(gc.freeze)


def _store_on_master_addr(timeout: datetime.timedelta):
    """The rendezvous store, listening on ``MASTER_ADDR`` only (torch's own listens on every
    interface): loopback for a run on one machine, the cluster interface otherwise. None (torch's
    default) under torchrun, whose agent already hosts the store, or when ``MASTER_ADDR`` is a
    host name rather than an address."""
    import ipaddress

    addr = os.environ["MASTER_ADDR"]
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    return bound_store(addr, int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]),
                       timeout)


STORE_FD_ENV = "MEGARL_STORE_FD"  # a launcher's listening socket on MASTER_PORT, handed to rank 0


def bound_store(addr: str, port: int, world_size: int, rank: int, timeout: datetime.timedelta):
    """A TCPStore whose master (rank 0) listens on ``addr`` (an IP address) only. A launcher that
    already listens on ``MASTER_PORT`` passes its socket to rank 0 as file descriptor
    ``MEGARL_STORE_FD`` (tests/distributed/launch.py): a port it found free and closed could be
    taken by another process's outgoing connection before rank 0 binds it."""
    import socket

    listen_fd = None
    if rank == 0:
        inherited = os.environ.get(STORE_FD_ENV)
        if inherited and port == int(os.environ.get("MASTER_PORT", -1)):
            listen_fd = int(os.environ.pop(STORE_FD_ENV))
        else:
            server = socket.create_server((addr, port), family=socket.AF_INET6 if ":" in addr else socket.AF_INET,
                                          backlog=128)
            listen_fd = server.detach()  # the store owns the socket from here
    return torch.distributed.TCPStore(addr, port, world_size, rank == 0, timeout, master_listen_fd=listen_fd)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shutdown() -> None:
    """Tear down the default group (and Megatron's registry) if they exist."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def torn_down():
    """Destroy this process's groups on every way out of the body (an entry point's ``main``).

    Left alive to interpreter exit, gloo's process groups and their store are destroyed after
    Python has finalized, in whatever order, and a worker thread still joinable then aborts the
    process (``terminate called without an active exception``: SIGABRT, exit -6, in place of the
    entry point's documented code). torch asks for ``destroy_process_group`` before exit."""
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            shutdown()


def set_seed(seed: int, groups) -> None:
    """Seed Python, NumPy and torch, and Megatron's model-parallel RNG tracker for ``groups``.

    Data-parallel ranks share the default seed; tensor/expert-parallel ranks get Megatron's
    per-rank offsets for dropout inside parallel regions.
    """
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, tp_rank=groups.tp_rank, ep_rank=groups.ep_rank, etp_rank=groups.pg.expt_tp.rank())
