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


PAIRING = """
import datetime, os, sys
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from megarl.testing import gpu_shaped as gs
from megarl.testing.nccl_p2p import PairingMismatch
assert gs.enable()
rank = int(os.environ["RANK"])
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
gloo = dist.new_group([0, 1], backend="gloo")
spanning = dist.ProcessGroupNCCL(dist.PrefixStore("spanning", c10d._get_default_store()), rank, 2)

def two_messages(device, first, second, send, recv):
    \"\"\"Rank 0 sends ``first`` (tag 1) then ``second`` (tag 2); rank 1 receives them in the other order.\"\"\"
    a = torch.arange(first[1], device=device).to(first[0])
    b = torch.arange(second[1], device=device).to(second[0]) + 100
    if rank == 0:
        works = [send(a, 1, 1), send(b, 1, 2)]
        for w in works:
            w.wait()
        return "sent"
    got_b, got_a = torch.empty_like(b), torch.empty_like(a)
    works = [recv(got_b, 0, 2), recv(got_a, 0, 1)]
    try:
        for w in works:
            w.wait()
    except PairingMismatch as e:
        return "MISMATCH " + str(e)
    assert torch.equal(got_a.cpu(), a.cpu()) and torch.equal(got_b.cpu(), b.cpu()), (got_a, got_b)
    return "paired by tag"

c10d_ops = lambda group: (lambda t, peer, tag: dist.isend(t, peer, group=group, tag=tag),
                          lambda t, peer, tag: dist.irecv(t, peer, group=group, tag=tag))
object_ops = (lambda t, peer, tag: spanning.send([t], peer, tag), lambda t, peer, tag: spanning.recv([t], peer, tag))
for name, device, ops in (("gloo", "cpu", c10d_ops(gloo)), ("nccl", "cuda", c10d_ops(None)),
                          ("ProcessGroupNCCL", "cuda", object_ops)):
    for dtypes in ((torch.float32, 4), (torch.bfloat16, 16)), ((torch.float32, 4), (torch.float32, 4)):
        print(f"CASE {name} {dtypes[0][0]}/{dtypes[1][0]}: {two_messages(device, *dtypes, *ops)}", flush=True)

# the same order on both sides (any tags) pairs on NCCL, also with both directions in one batch
x = torch.arange(6.0, device="cuda") + 10 * rank
mine, theirs = torch.empty(6, device="cuda"), torch.empty(6, device="cuda")
peer = 1 - rank
ops = [dist.P2POp(dist.irecv, mine, peer, tag=3), dist.P2POp(dist.isend, x, peer, tag=3),
       dist.P2POp(dist.irecv, theirs, peer, tag=9), dist.P2POp(dist.isend, x * 2, peer, tag=9)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
expect = torch.arange(6.0) + 10 * peer
assert torch.equal(mine.cpu(), expect) and torch.equal(theirs.cpu(), 2 * expect), (mine, theirs)
if rank == 0:
    dist.send(x, 1, tag=4)
else:
    assert dist.recv(mine, 0, tag=4) == 0 and torch.equal(mine.cpu(), torch.arange(6.0))
dist.barrier()

# a pairing keeps neither its group nor its threads past the group's owner: held to interpreter exit,
# a gloo group is destroyed after Python finalized and aborts the process (exit -6)
import gc, threading, time, weakref
spanning_gloo = weakref.ref(spanning._pg)
del spanning, object_ops, gloo, ops, w  # w: the last receive (its pairing)
dist.destroy_process_group()
gc.collect()
deadline = time.monotonic() + 30
while any(t.name.startswith("nccl-pairing") for t in threading.enumerate()) and time.monotonic() < deadline:
    time.sleep(0.05)
print("LEFT", spanning_gloo() is not None, sorted(t.name for t in threading.enumerate() if t.name.startswith("nccl")))
print("OK", flush=True)
"""


def test_point_to_point_pairs_as_nccl():
    """NCCL pairs a pair of ranks' messages in posting order, ignoring tags: two sends received in the
    other order pair by tag on gloo and are refused on NCCL-shaped groups (c10d's and a
    ProcessGroupNCCL built directly), naming both sides; the same order with any tags pairs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PYTHONPATH": str(ROOT), "PORT": str(port), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(PAIRING)], cwd=ROOT, env=env | {"RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip().endswith("OK"), out[-3000:] + err[-4000:]
    assert all("LEFT False []" in out for out, _ in outs), [out[-500:] for out, _ in outs]
    cases = {line.split(": ", 1)[0][5:]: line.split(": ", 1)[1] for line in outs[1][0].splitlines()
             if line.startswith("CASE ")}
    assert cases["gloo torch.float32/torch.bfloat16"] == cases["gloo torch.float32/torch.float32"] == "paired by tag"
    for group in ("nccl", "ProcessGroupNCCL"):
        for dtypes in ("torch.float32/torch.bfloat16", "torch.float32/torch.float32"):
            assert cases[f"{group} {dtypes}"].startswith("MISMATCH "), cases
    text = cases["nccl torch.float32/torch.bfloat16"]
    assert ("rank 1 (group rank 1)'s receive #1 from rank 0 (group rank 0) (tag 2, bfloat16 [16], 16 elements) is "
            "paired with rank 0 (group rank 0)'s send #1 to rank 1 (group rank 1) (tag 1, float32 [4], 4 elements)"
            in text), text
    assert "receive #3 from rank 0 (tag 2, float32 [4], 4 elements) is paired with rank 0's send #3 to rank 1 (tag 1, " \
        "float32 [4], 4 elements)" in cases["ProcessGroupNCCL torch.float32/torch.float32"], cases  # same size: by tag
