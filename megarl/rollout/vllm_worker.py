"""The worker extension megarl adds to vLLM's workers (``worker_extension_cls``), called through
``LLM.collective_rpc``. It runs inside vLLM's worker processes, so it imports nothing of megarl.

Weights arrive as a safetensors file per bucket (in ``/dev/shm`` where there is one): arguments
of ``collective_rpc`` are serialized (tensors become nested lists), a file is read by memory
map. Each bucket holds whole decoder layers (``megarl.hybrid.hf_names.shard_buckets``), so
vLLM's layerwise reload, which processes a fused layer (QKV, gate/up) once all of its tensors
have arrived, never sees half a layer. ``reload_weights`` is vLLM's in-place path; a plain
``load_weights`` after start-up fails on CPU, where the linear weights are repacked.
"""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def megarl_reload_weights(self, path: str) -> int:
        """Load the HF-named tensors of the safetensors file ``path`` in place; the count."""
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            self.model_runner.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names))
        return len(names)

    def megarl_weights_digest(self) -> float:
        """The sum of every parameter (a cheap fingerprint for tests; repacked tensors included)."""
        import torch

        total = torch.zeros((), dtype=torch.float64)
        for p in self.model_runner.get_model().parameters():
            if p.numel():
                total += p.detach().double().sum().cpu()
        return float(total)
