"""CPU mode: CUDA device arguments, type names, streams and the CUDA RNG land on the CPU.

Runs in a child process: enabling CPU mode patches torch.cuda for the whole process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import torch
    from megarl.runtime import cpu_mode

    assert not torch.cuda.is_available()
    assert not cpu_mode.is_enabled()
    assert cpu_mode.enable() and cpu_mode.enable() and cpu_mode.is_enabled()

    made = [
        torch.empty(2, device="cuda"),
        torch.zeros(2, device="cuda:0"),
        torch.ones(2, device=torch.device("cuda")),
        torch.full((2,), 3.0, device=0),
        torch.arange(3, device=torch.cuda.current_device()),
        torch.ones(2).cuda(),
        torch.ones(2).to("cuda"),
        torch.ones(2).to(device="cuda", dtype=torch.float64),
        torch.tensor([1.0], device="cuda"),
    ]
    assert all(t.device.type == "cpu" for t in made), [t.device for t in made]
    assert made[7].dtype == torch.float64
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64  # the converting form still works

    # Backward passes run outside the function mode: current_device() itself must mean CPU.
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.full((1,), 2.0, device=torch.cuda.current_device())

    x = torch.ones(3, requires_grad=True)
    Double.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
        event = stream.record_event()
    event.synchronize()
    torch.cuda.synchronize()

    # The "CUDA" generator is its own CPU generator: seeding it leaves the CPU stream alone.
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    torch.cuda.manual_seed(123)
    saved = torch.cuda.get_rng_state()
    assert torch.equal(torch.rand(3), expected)
    torch.cuda.manual_seed(7)
    torch.cuda.set_rng_state(saved)
    assert torch.equal(torch.cuda.get_rng_state(), saved)

    # suspended(): no redirection inside (a CUDA device fails loudly), back on afterwards
    with cpu_mode.suspended():
        assert torch.ones(2).type() == "torch.FloatTensor"
        try:
            torch.empty(2, device="cuda")
            raise AssertionError("a CUDA tensor was made while CPU mode was suspended")
        except (AssertionError, RuntimeError) as err:
            assert "suspended" not in str(err), err
    assert torch.empty(2, device="cuda").device.type == "cpu"
    # with another function mode above CPU mode's, suspended() leaves the stack alone
    class Counting(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        with cpu_mode.suspended():
            assert torch.empty(2, device="cuda").device.type == "cpu"
        assert Counting.calls >= 1  # the mode above still sees the calls

    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mcore_random
    mcore_random.get_cuda_rng_tracker().reset()
    mcore_random.get_cuda_rng_tracker().add("model-parallel-rng", 99)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        pass
    print("CPU MODE OK")
''')


def test_cpu_mode_redirects_cuda_to_cpu():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "CPU MODE OK" in proc.stdout, proc.stderr[-3000:]


LIGHT_IMPORT = textwrap.dedent('''
    import sys
    import megarl  # installs the finder for megatron.core
    import torch
    real = torch.compile
    import megatron.core
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_swiglu
    assert "torch._dynamo" not in sys.modules and "torch._inductor.compile_fx" not in sys.modules, "dynamo imported"
    assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
    assert torch.compile is real  # swapped for the import only
    x = torch.randn(4, 6)
    assert torch.equal(fused_bias_swiglu.bias_swiglu_impl(x, None), torch.nn.functional.silu(x[:, :3]) * x[:, 3:])
    assert megarl.megatron_import._FINDER not in sys.meta_path  # gone after its one use
    # a worker's imports skip wandb (megatron's unused inference context) and omegaconf (only the
    # driver composes configs); the real wandb still imports for megarl's tracker afterwards
    import megarl.controller.rl_worker
    assert "wandb" not in sys.modules and "omegaconf" not in sys.modules, [m for m in ("wandb", "omegaconf") if m in sys.modules]
    import wandb
    assert wandb.__version__

    # with CUDA present the import is megatron's own
    from megarl.runtime import cpu_mode
    torch.cuda.is_available = lambda: True
    with cpu_mode.light_megatron_import():
        assert torch.compile is real
    print("LIGHT IMPORT OK")
''')


def test_megatron_core_imports_without_dynamo_on_cpu():
    """megarl's finder imports megatron.core with jit_fuser a no-op when CUDA is absent (2-3 s less
    per process: no TorchDynamo or Inductor); the fused kernels it decorates run eagerly."""
    proc = subprocess.run([sys.executable, "-c", LIGHT_IMPORT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "LIGHT IMPORT OK" in proc.stdout, proc.stderr[-3000:]
