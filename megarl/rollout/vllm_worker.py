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
            model = self.model_runner.get_model()
            with _cpu_experts_repacked(model), _tied_heads_reprocessed(model):
                self.model_runner.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names))
        return len(names)

    def megarl_idle_spin(self, seconds: float) -> int:
        """Make this worker's shared-memory message queues go idle ``seconds`` after a message
        instead of vLLM's 1 s of busy-looping (``SpinCondition.busy_loop_s``); their writer
        notifies every message, so a reader woken from its poll loses nothing. On CPU the spin
        held a core for a second after every call, beside the engine's own compute and the
        colocated trainer's (a vLLM step here: 0.48 s -> 0.34 s). The queues found."""
        import gc

        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        found = [o for o in gc.get_objects() if isinstance(o, SpinCondition) and o.is_reader]
        for condition in found:
            condition.busy_loop_s = seconds
        return len(found)

    def megarl_weights_digest(self) -> float:
        """The sum of every parameter (a cheap fingerprint for tests; repacked tensors included)."""
        import torch

        total = torch.zeros((), dtype=torch.float64)
        for p in self.model_runner.get_model().parameters():
            if p.numel():
                total += p.detach().double().sum().cpu()
        return float(total)


class _cpu_experts_repacked:
    """vLLM 0.32's in-place reload of an unquantized MoE layer treats it as a weight update once
    its kernel exists (``UnquantizedFusedMoEMethod._setup_kernel``: ``is_weight_update``) and skips
    the experts' ``process_weights_after_loading``, which on CPU prepacks the weights into the
    grouped-gemm layout: the reloaded weights then ran unpacked (the same numbers in another
    order, so the parameters' sum did not change), and an MoE rollout's log-probs left
    transformers' by up to 4.1. While the reload runs, the CPU experts' kernels are set aside, so
    each reloaded layer goes through the first-load path (prepacking) and its processed weights
    are copied into the engine's tensors; then every layer gets its own kernel back (layers outside
    the file are not touched). GPU kernels are left alone."""

    def __init__(self, model):
        self.kernels = []
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
                self.kernels.append((method, method.moe_kernel))

    def __enter__(self):
        for method, _ in self.kernels:
            method.moe_kernel = None
        return self

    def __exit__(self, *exc):
        for method, kernel in self.kernels:
            method.moe_kernel = kernel
        return False


class _tied_heads_reprocessed:
    """A tied output layer (``lm_head.tie_weights(embed_tokens)``: Llama, Qwen2/3, SmolLM) shares
    the embedding's Parameter but is a module of its own, and the checkpoint has no tensor for it
    (``load_weights`` skips ``lm_head.``). vLLM 0.32's in-place reload
    (``reload/layerwise.py``: ``finalize_layerwise_processing``) therefore finds it loaded nothing,
    puts its kernel tensors back and skips its ``process_weights_after_loading``; on CPU that is
    ``dispatch_cpu_unquantized_gemm``, which packs the weight into a oneDNN (or sgl) kernel of its
    own, so the head kept the start-up dummy weights' kernel: log-probs ~ -ln(vocabulary) although
    the shared weight holds the new values. After the reload, each tied module whose shared
    Parameter was reloaded (the embedding's, by the names ``load_weights`` reports) runs its quant
    method's ``process_weights_after_loading`` again, as a fresh load does after every tensor has
    arrived; a reload without the embedding leaves the head alone."""

    def __init__(self, model):
        owner = {}  # id(Parameter) -> the name it is loaded under (its first module's)
        for name, param in model.named_parameters():
            owner.setdefault(id(param), name)
        self.model, self.loaded = model, set()
        self.tied = []  # (module, name of the Parameter it shares)
        for prefix, module in model.named_modules():
            weight = module._parameters.get("weight")
            if weight is None or getattr(module, "quant_method", None) is None:
                continue
            shared = owner.get(id(weight))
            if shared is not None and shared != f"{prefix}.weight":
                self.tied.append((module, shared))

    def __enter__(self):
        if self.tied:  # the names vLLM's model reports as loaded
            load = self.model.load_weights

            def load_weights(weights):
                loaded = load(weights)
                self.loaded.update(loaded or ())
                return loaded

            self.model.load_weights = load_weights
        return self

    def __exit__(self, exc_type, *exc):
        self.model.__dict__.pop("load_weights", None)
        if exc_type is None:
            for module, shared in self.tied:
                if shared in self.loaded:
                    module.quant_method.process_weights_after_loading(module)
        return False
