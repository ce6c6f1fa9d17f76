"""Training engines: one Megatron model in its training layout, a few verbs."""
