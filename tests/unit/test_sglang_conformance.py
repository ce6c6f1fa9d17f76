"""SGLang conformance (issue 27, item 4): every SGLang call megarl makes, checked against the pinned
release's source. The wheel is downloaded without its dependencies (once, into
``$XDG_CACHE_HOME/megarl/wheels``) and parsed; nothing of it is imported, no GPU is needed. A
version bump that renames a parameter or a field megarl passes fails here, on CPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megarl.rollout import sglang_conformance as conf
from megarl.rollout.sglang_engine import SGLANG_PIN

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["flush_cache", "generate", "init_weights_update_group", "release_memory_occupation",
           "resume_memory_occupation", "shutdown", "update_weights_from_distributed", "update_weights_from_tensor"]


@pytest.fixture(scope="module")
def wheel() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megarl" / "wheels"
    found = sorted(cache.glob(f"sglang-{SGLANG_PIN}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # a whole wheel or none in the cache
        proc = subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_PIN}", "--no-deps",
                               "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", tmp],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"pip download sglang=={SGLANG_PIN} failed (the package registry is needed once):\n" \
                                     f"{proc.stderr[-2000:]}"
        (downloaded,) = Path(tmp).glob("sglang-*.whl")
        shutil.move(str(downloaded), cache / downloaded.name)
    return cache / downloaded.name


def test_the_dockerfile_image_is_the_pinned_release():
    image = re.search(r"^ARG SGLANG_IMAGE=lmsysorg/sglang:v(\S+?)-cu", (ROOT / "Dockerfile").read_text(), re.M)
    assert image and image[1] == SGLANG_PIN


def test_megarl_calls_are_found():
    """The reading of megarl's own source finds every call site (a change there that hides one
    from the AST walk fails here, not silently)."""
    use = conf.megarl_calls()
    assert conf.methods_called(use) == METHODS
    assert {k for _, k in use.server_args} >= {"model_path", "tp_size", "load_format", "enable_memory_saver", "port"}
    assert {k for _, k in use.sampling_keys} >= {"temperature", "max_new_tokens", "stop_token_ids", "sampling_seed"}
    assert set(use.memory_tags) == {"weights", "kv_cache", "cuda_graph"}


def test_the_pinned_release_takes_every_call(wheel):
    api = conf.sglang_api(conf.wheel_reader(wheel))
    assert set(METHODS) <= set(api.engine) and len(api.server_args) > 100
    assert conf.check(conf.megarl_calls(), api) == []


def test_every_answer_is_read_as_the_pinned_release_gives_it(wheel):
    """The weight calls answer (success, message), flush_cache a FlushCacheReqOutput, the memory
    calls nothing (SGLang 0.5.6.post2's TokenizerManager coroutines); every call megarl makes has
    an entry in ENGINE_ANSWERS, and the names it imports lazily exist."""
    from megarl.rollout.sglang_engine import ENGINE_ANSWERS

    api = conf.sglang_api(conf.wheel_reader(wheel))
    assert {m: api.answers[m] for m in ["update_weights_from_tensor", "update_weights_from_distributed",
                                        "init_weights_update_group", "flush_cache", "release_memory_occupation",
                                        "resume_memory_occupation"]} == {
        "update_weights_from_tensor": "Tuple[bool, str]", "update_weights_from_distributed": "Tuple[bool, str]",
        "init_weights_update_group": "Tuple[bool, str]", "flush_cache": "FlushCacheReqOutput",
        "release_memory_occupation": "None", "resume_memory_occupation": "None"}
    assert sorted(ENGINE_ANSWERS) == METHODS
    use = conf.megarl_calls()
    assert {(m, n) for _, m, n in use.imports} == {
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
        ("sglang.srt.utils", "MultiprocessingSerializer"),  # through sglang/srt/utils/__init__.py's import *
        ("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions")}
    unread = {k: v for k, v in ENGINE_ANSWERS.items() if k != "flush_cache"}
    assert any(re.search(r"Engine.flush_cache: sglang_engine.ENGINE_ANSWERS does not say how to read", e)
               for e in conf.check(use, api, unread))


@pytest.mark.parametrize("path, old, new, named", [
    # a parameter renamed in a method megarl calls by keyword
    (conf.ENGINE_SOURCE, "named_tensors: List[Tuple[str, torch.Tensor]]", "tensors: List[Tuple[str, torch.Tensor]]",
     r"megarl/transports/cuda_ipc.py:\d+: Engine.update_weights_from_tensor has no parameter 'named_tensors'"),
    # a parameter dropped before those megarl passes by position: its fifth is now backend, which it
    # also passes by keyword
    (conf.ENGINE_SOURCE, "        rank_offset: int,\n", "",
     r"megarl/transports/nccl_broadcast.py:\d+: Engine.init_weights_update_group gets \['backend'\] by position and by keyword"),
    # two dropped: more positional arguments than parameters
    (conf.ENGINE_SOURCE, "        rank_offset: int,\n        world_size: int,\n", "",
     r"megarl/transports/nccl_broadcast.py:\d+: Engine.init_weights_update_group takes 4 positional arguments, megarl passes 5"),
    # a ServerArgs field renamed
    (conf.SERVER_ARGS_SOURCE, "    enable_memory_saver: bool", "    memory_saver: bool",
     r"megarl/rollout/sglang_engine.py:\d+: sglang.Engine\(enable_memory_saver=...\): ServerArgs has no field"),
    # a sampling parameter renamed
    (conf.SAMPLING_SOURCE, "sampling_seed", "seed",
     r"sampling parameter 'sampling_seed': SamplingParams has no such parameter"),
    # a memory-saver tag renamed
    (conf.CONSTANTS_SOURCE, 'GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"', 'GPU_MEMORY_TYPE_CUDA_GRAPH = "graphs"',
     r"memory-saver tag 'cuda_graph' is not one of SGLang's"),
    # an answer megarl reads changes type
    (conf.MANAGER_SOURCES[0], "async def flush_cache(self: TokenizerManager) -> FlushCacheReqOutput:",
     "async def flush_cache(self: TokenizerManager) -> bool:",
     r"megarl/transports/\S+:\d+: Engine.flush_cache answers bool in this release; megarl reads FlushCacheReqOutput"),
    # a call whose answer megarl ignores starts answering
    (conf.MANAGER_SOURCES[0], "        await self.release_memory_occupation_communicator(obj)",
     "        return await self.release_memory_occupation_communicator(obj)",
     r"Engine.release_memory_occupation answers \? in this release; megarl reads None"),
    # a name megarl imports lazily is gone
    ("sglang/srt/utils/patch_torch.py", "def monkey_patch_torch_reductions():", "def patch_reductions():",
     r"megarl/transports/cuda_ipc.py:\d+: from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions: "
     r"the release has no"),
])
def test_a_renamed_name_fails_naming_the_call_site(wheel, path, old, new, named):
    api = conf.sglang_api(conf.wheel_reader(wheel, replace={path: (old, new)}))
    errors = conf.check(conf.megarl_calls(), api)
    assert any(re.search(named, e) for e in errors), errors
