"""The import of ``megatron.core`` on machines without CUDA, made 2-3 s lighter per process.

megatron-core decorates its fused kernels (bias-GeLU, bias-SwiGLU, RoPE, ...) with
``torch.compile`` when it is imported, and that first decoration imports TorchDynamo and Inductor:
about 2.5 s of every process that imports Megatron, of a 7 s import. On CPU megarl turns those
fusions off (``bias_activation_fusion`` and its kin follow Transformer Engine), so nothing compiled
would ever run. This finder wraps the one import of ``megatron.core`` so that
:func:`megarl.runtime.cpu_mode.light_megatron_import` runs it; with CUDA present that changes
nothing. It imports nothing itself (the package root stays torch-free for the reward workers)
and removes itself after its one use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_NAME = "megatron.core"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        from megarl.runtime import cpu_mode

        with cpu_mode.light_megatron_import():
            self.inner.exec_module(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _NAME:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Wrap the next import of ``megatron.core`` (idempotent; nothing if it is already imported)."""
    if _NAME not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
