"""The GPU-shaped harness's device memory model (megarl.testing.device_memory), in a fresh process
each (the harness patches torch process-wide): live CUDA-shaped storage counted once per storage,
followed through resizes and freed with its last tensor; torch.cuda's memory queries read it; an
allocation past the budget runs out of memory; vLLM refuses to start below its
gpu_memory_utilization of free memory, SGLang takes what is free beyond 1 - mem_fraction_static;
peaks per megarl phase; pinned host memory rounded as the caching host allocator rounds it."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_shaped

SCRIPT = """
import gc, os
import torch
from megarl.runtime import progress
from megarl.testing import device_memory, gpu_shaped as gs
assert gs.enable()
m = device_memory.model()
GiB = 1 << 30
assert m.total == 4 * GiB and torch.cuda.mem_get_info() == (4 * GiB, 4 * GiB)

a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")         # 1 MiB
view = a[10:]                                                     # the same storage: counted once
b = (a.float() * 2)                                               # 4 MiB, computed on the device
assert torch.cuda.memory_allocated() == 5 << 20, torch.cuda.memory_allocated()
host = torch.empty(1 << 20)                                       # host tensors are not counted
assert torch.cuda.memory_allocated() == 5 << 20
del b; gc.collect()
assert torch.cuda.memory_allocated() == 1 << 20
assert torch.cuda.max_memory_allocated() == 9 << 20              # a.float()'s 4 MiB beside b's
assert torch.cuda.memory_reserved() == 9 << 20                    # freed blocks stay cached ...
torch.cuda.empty_cache()
assert torch.cuda.memory_reserved() == 1 << 20                    # ... until empty_cache
a.untyped_storage().resize_(0)                                    # an offload frees by resizing
assert torch.cuda.memory_allocated() == 0
a.untyped_storage().resize_(1 << 20)
assert torch.cuda.memory_allocated() == 1 << 20
del a, view; gc.collect()
assert torch.cuda.memory_allocated() == 0
torch.cuda.reset_peak_memory_stats()
assert torch.cuda.max_memory_allocated() == 0

try:                                                              # past the budget: out of memory
    torch.empty(5 * GiB, dtype=torch.uint8, device="cuda")      # not touched: no host memory used
    raise AssertionError("no OOM")
except torch.OutOfMemoryError as e:
    assert "CUDA out of memory" in str(e), str(e)
gc.collect()
assert torch.cuda.memory_allocated() == 0
torch.cuda.empty_cache()

with progress.phase("actor.update_actor"):                        # megarl's phases are memory phases
    w = torch.empty(GiB // 4, dtype=torch.float32, device="cuda")  # 1 GiB
    del w
with progress.phase("rollout.update_weights"):
    torch.cuda.empty_cache()
    vllm = device_memory.start_engine("vllm", 0.5)                 # 2 GiB of 4: fits on the empty device
from megarl.runtime import memory                                  # megarl's metrics read the model
assert memory.device_used_gb() == 2.0 and memory.peak_gpu_reserved_gb() >= 1.0
assert device_memory.report() == {"actor.update_actor": {"allocated": 1.0, "device": 1.0},
                                  "rollout.update_weights": {"allocated": 0.0, "device": 2.0}}, device_memory.report()
start = device_memory.engine_starts()[0]
assert start["engine"] == "vllm" and start["process_live"] == 0 and start["phase"] == "rollout.update_weights"
assert torch.cuda.mem_get_info()[0] == 2 * GiB                    # the engine's pool is used device memory

resident = torch.empty(GiB // 4, dtype=torch.float32, device="cuda")  # a trainer's 1 GiB, resident
try:                                                               # vLLM refuses: 1 GiB free < 2 GiB asked
    device_memory.start_engine("vllm", 0.5)
    raise AssertionError("vLLM started")
except ValueError as e:
    assert "on startup is less than desired GPU memory utilization (0.5, 2.00 GiB)" in str(e), str(e)
m.release_engine(vllm)                                             # asleep: its pool is free
sglang = device_memory.start_engine("sglang", 0.75)                # free 3 GiB - 1 GiB kept free = 2 GiB
assert sglang.pool == 2 * GiB, sglang.pool
try:                                                               # waking vLLM's pool over both: OOM
    m.resume_engine(vllm)
    raise AssertionError("no OOM")
except torch.OutOfMemoryError:
    pass
m.release_engine(vllm)
m.release_engine(sglang)
del resident; gc.collect(); torch.cuda.empty_cache()
assert device_memory.start_engine("sglang", 0.75).pool == 3 * GiB  # an empty device: the whole fraction
try:
    device_memory.start_engine("sglang", 0.2)                       # 1 GiB free, 3.2 GiB to keep free
    raise AssertionError("SGLang started")
except RuntimeError as e:
    assert "Not enough memory" in str(e)

p = torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True)       # the caching host allocator: 4 MiB
assert m.pinned_bytes() == 4 << 20 and not p.is_cuda
exact = torch.empty(3 << 20, dtype=torch.uint8)                    # cudaHostRegister: exact
assert torch.cuda.cudart().cudaHostRegister(exact.data_ptr(), exact.numel(), 0) == 0
assert m.pinned_bytes() == 7 << 20
assert torch.cuda.cudart().cudaHostUnregister(exact.data_ptr()) == 0
del p; gc.collect()
assert m.pinned_bytes() == 0
host = memory.pinned_host_bytes((3 << 20) + 5)                      # megarl's offload buffers: exact
assert m.pinned_bytes() == (3 << 20) + 5
memory.unpin_host(host)
assert m.pinned_bytes() == 0

from types import SimpleNamespace                                   # the trainer's offload pins exactly
from megarl.engines.offload import offload
lin = torch.nn.Linear(60, 60).cuda()                                # 14400 + 240 bytes (rounded: 16384 + 256)
live = torch.cuda.memory_allocated()
handle = offload(SimpleNamespace(model=[lin], optimizer=None), ("params",))
assert torch.cuda.memory_allocated() == live - 14640
assert m.pinned_bytes() == 14640, m.pinned_bytes()
handle.reload()
assert m.pinned_bytes() == 0 and torch.cuda.memory_allocated() == live
print("OK")
"""


def test_device_memory_model():
    env = {"PYTHONPATH": str(ROOT), "MEGARL_GPU_SHAPED_MEMORY_GB": "4", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_allocator_env_merges_expandable_segments():
    from megarl.runtime.memory import allocator_env

    assert allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    assert allocator_env({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8"}) == {
        "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8,expandable_segments:True"}
    assert allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == {}  # the user's choice stays
