"""The built-in digit tokenizer as a Hugging Face fast tokenizer, so a model trained on the
built-in task can be saved, converted and loaded by transformers with its tokenizer.

Same ids as :class:`megarl.data.tokenizer.DigitTokenizer` (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2,
then one token per character) and the same prompts: encoding prepends ``<bos>`` as
``DigitTokenizer.prompt_ids`` does. With ``chat_template`` (``make demo``'s SFT data; train-lm's
and the agent demo's tokenizer has none: their prompts and observations are plain text),
:data:`CHAT_TEMPLATE` renders the built-in task's format: a conversation ``[user: "1234=", assistant: "4321"]`` is ``<bos>1234=4321<eos>``,
the assistant's text and EOS inside ``{% generation %}`` markers (``megarl sft``'s loss mask), and
a user prompt with the generation prompt is the RL prompt's ids, ``<bos>1234=``.
"""

from __future__ import annotations

import json
from pathlib import Path

from megarl.data.tokenizer import DigitTokenizer


CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + eos_token }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] }}{%- endif %}"
    "{%- endfor %}"
)


def build_digit_tokenizer(chat_template: bool = False):
    """A ``PreTrainedTokenizerFast`` with exactly the ids of ``DigitTokenizer`` (and :data:`CHAT_TEMPLATE`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reference = DigitTokenizer()
    pad, bos, eos = (reference.vocab[i] for i in (reference.pad_token_id, reference.bos_token_id,
                                                   reference.eos_token_id))
    # No unk token: a character outside the vocabulary is an error, as in DigitTokenizer.encode.
    tok = Tokenizer(models.WordLevel(vocab=dict(reference.ids)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # characters join without separators
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, reference.bos_token_id)])
    tok.add_special_tokens([pad, bos, eos])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def save_digit_tokenizer(directory: str | Path, chat_template: bool = False) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` (and the
    chat template) to ``directory``."""
    tokenizer = build_digit_tokenizer(chat_template)
    tokenizer.save_pretrained(str(directory))
    # transformers 5 names its fast class "TokenizersBackend", which transformers 4 (and the
    # engines pinned to it, e.g. SGLang) cannot resolve; both resolve "PreTrainedTokenizerFast".
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    specials = {"pad_token": tokenizer.pad_token, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    (Path(directory) / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
