"""Hugging Face ↔ Megatron dist-checkpoint conversion: mapping tables, safetensors I/O, drivers."""
