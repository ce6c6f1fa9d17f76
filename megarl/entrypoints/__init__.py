"""SPMD programs that torchrun (or the ``megarl`` CLI) starts on every rank."""
