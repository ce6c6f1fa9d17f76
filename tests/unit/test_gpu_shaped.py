"""The GPU-shaped harness's own rules (megarl.testing.gpu_shaped), in a fresh process each: it
patches torch process-wide. CUDA torch's device rules: same-device operands except CPU scalars,
CPU indices and copies; generators on the sampled tensor's device; NCCL groups take CUDA tensors,
gloo groups CPU ones; ``.cpu()`` copies; numpy refuses CUDA tensors; modules move with ``.cuda()``."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_shaped

SCRIPT = """
import datetime, os
import torch, torch.distributed as dist
from megarl.testing import gpu_shaped as gs
assert gs.enable() and torch.cuda.is_available()

def refused(fn, text):
    try:
        fn()
    except (gs.DeviceMismatch, TypeError) as e:
        assert text in str(e), str(e)
        return
    raise AssertionError("not refused: " + text)

x = torch.randn(4, device="cuda")
assert x.device == torch.device("cuda", 0) and x.is_cuda and x.type() == "torch.cuda.FloatTensor"
y = (x * 2).sum()
assert y.is_cuda and abs(y.item() - 2 * x.cpu().sum().item()) < 1e-6
refused(lambda: x + torch.ones(4), "expected all tensors to be on the same device")
assert (x + torch.tensor(1.0)).is_cuda                      # a CPU scalar is allowed
assert x[torch.tensor([0, 2])].is_cuda                       # so are CPU indices
refused(lambda: torch.ones(4)[torch.tensor([0], device="cuda")], "indices should be either on cpu")
c = x.cpu(); c += 1
assert not c.is_cuda and not torch.equal(c, x.cpu())         # .cpu() is a copy
host = torch.zeros(4); host[:] = x                           # copies between devices are allowed
refused(lambda: x.numpy(), "can't convert cuda:0 device type tensor to numpy")
probs = torch.softmax(x, 0)
refused(lambda: torch.multinomial(probs, 1, generator=torch.Generator()), "Expected a 'cuda' device type")
g = torch.Generator(device="cuda").manual_seed(3)
assert g.device.type == "cuda" and torch.multinomial(probs, 1, generator=g).is_cuda
lin = torch.nn.Linear(4, 2)
refused(lambda: lin(x), "expected all tensors to be on the same device")
lin.cuda()
assert lin.weight.is_cuda and lin(x).is_cuda
lin(x).sum().backward()                                      # backward runs under the harness
assert lin.weight.grad is not None
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("nccl", rank=0, world_size=1)
assert dist.get_backend() == "nccl"
dist.all_reduce(x)
refused(lambda: dist.all_reduce(torch.ones(2)), "a cpu tensor of shape [2] on a NCCL group")
gloo = dist.new_group([0], backend="gloo")
dist.all_reduce(torch.ones(2), group=gloo)
refused(lambda: dist.all_reduce(x, group=gloo), "a cuda:0 tensor of shape [4] on a gloo group")
objs = [None]; dist.all_gather_object(objs, {"a": 1}); assert objs == [{"a": 1}]
import pickle
assert pickle.loads(pickle.dumps(x)).is_cuda
print("PICKLED " + pickle.dumps(x).hex())
print("OK")
"""


def test_harness_rules():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PORT": str(port), "PATH": "/usr/bin:/bin",
                                            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
    # a device tensor that leaves its worker unmoved cannot be read by a driver without CUDA
    import pickle

    data = bytes.fromhex(next(line for line in proc.stdout.splitlines() if line.startswith("PICKLED "))[8:])
    with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
        pickle.loads(data)
