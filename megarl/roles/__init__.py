"""Model roles (actor, reference, ...): thin classes over a Megatron engine."""
