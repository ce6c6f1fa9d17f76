"""Prompts for RL: datasets from jsonl/parquet, the built-in task, tokenizers."""

from megarl.data.datasets import DataError, PromptRecord, load_records
from megarl.data.tokenizer import DigitTokenizer, load_tokenizer

__all__ = ["DataError", "DigitTokenizer", "PromptRecord", "load_records", "load_tokenizer"]
