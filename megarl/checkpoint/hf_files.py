"""The files of an exported Hugging Face directory besides its weights: config.json with the
fields loaders need (``architectures``, the weights' dtype), generation_config.json and the
tokenizer files, copied from an explicit allow-list so source weights never come along."""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

# Tokenizer files of every HF tokenizer family (fast, sentencepiece, BPE vocab/merges, tiktoken)
# and chat templates. An allow-list: a deny-list would let a new weight format through.
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
                      "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"
HF_SUBDIR = "hf"  # the source's config.json and tokenizer files, kept inside a converted Megatron checkpoint
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tokenizer_files(directory: Path) -> List[Path]:
    """The tokenizer files in ``directory`` (none if it is not a directory)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in TOKENIZER_PATTERNS))


def causal_lm_architecture(model_type: str) -> str:
    """``LlamaForCausalLM`` for ``llama``: transformers' own causal-LM class for the model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"transformers has no causal-LM class for model_type '{model_type}'")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def sequence_classification_architecture(model_type: str) -> str:
    """``LlamaForSequenceClassification`` for ``llama``: transformers' scorer class for the model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise ValueError(f"transformers has no sequence-classification class for model_type '{model_type}'")
    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[model_type]


def export_config(config: Dict, dtype: torch.dtype, sequence_classification: bool = False) -> Dict:
    """The source config.json for weights written as ``dtype`` by our converter: ``architectures``
    is the model type's causal-LM class (the source may name a reward or remote-code class; a
    multimodal wrapper, hf_config.Wrapper, keeps its own, whose tensors the export carries),
    ``dtype`` (transformers 5) and ``torch_dtype`` (older readers, SGLang) name the weights' dtype,
    and ``auto_map`` is dropped (the weights follow transformers' own classes, not remote code)."""
    from megarl.models.hf_config import WRAPPERS

    out = {k: v for k, v in config.items() if k != "auto_map"}
    if not (config["model_type"] in WRAPPERS and config.get("architectures")):  # a wrapper keeps its class:
        out["architectures"] = [causal_lm_architecture(config["model_type"])]  # its carried tensors are in
    if sequence_classification:  # a reward model: one score, at the last non-pad token
        out["architectures"] = [sequence_classification_architecture(config["model_type"])]
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    out["dtype"] = out["torch_dtype"] = _DTYPE_NAMES[dtype]
    return out


def derived_generation_config(config: Dict) -> Optional[Dict]:
    """A generation config from config.json's special ids, as transformers derives one; None
    without an eos id (generation could not stop anyway)."""
    ids = {key: config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if ids["eos_token_id"] is None:
        return None
    return {key: value for key, value in ids.items() if value is not None}


def write_side_files(dest: Path, config: Dict, dtype: torch.dtype, config_dir: Optional[Path],
                     tokenizer_dir: Optional[Path], sequence_classification: bool = False) -> List[str]:
    """Write config.json (:func:`export_config`), generation_config.json (the first found in
    ``config_dir``, ``tokenizer_dir``, else derived from the config) and the tokenizer files
    (of ``tokenizer_dir``, else of ``config_dir``) into ``dest``. Returns the names written. A
    ``sequence_classification`` export's config gets the tokenizer's pad id when it has none
    (transformers finds each row's last token by it)."""
    written = ["config.json"]
    out = export_config(config, dtype, sequence_classification)
    files = tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
    if not files and config_dir is not None:
        files = tokenizer_files(config_dir)
    if sequence_classification and out.get("pad_token_id") is None and files:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(files[0].parent)
        out["pad_token_id"] = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    (dest / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    sources: Sequence[Path] = [d for d in (config_dir, tokenizer_dir) if d is not None]
    found = next((d / GENERATION_CONFIG for d in sources if (d / GENERATION_CONFIG).is_file()), None)
    if found is not None:
        shutil.copy2(found, dest / GENERATION_CONFIG)
        written.append(GENERATION_CONFIG)
    elif (derived := derived_generation_config(config)) is not None:
        (dest / GENERATION_CONFIG).write_text(json.dumps(derived, indent=2) + "\n")
        written.append(GENERATION_CONFIG)
    for path in files:
        shutil.copy2(path, dest / path.name)
        written.append(path.name)
    return written
