"""Megatron training plumbing shared by the engines, the LM demo and the parity tests."""
