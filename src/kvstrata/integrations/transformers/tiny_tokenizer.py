"""An offline byte-level tokenizer with a ChatML chat template, for tiny test models.

It is built, not trained: three special tokens, then one token per byte (id = 3 + byte value), no
merges. Every string round-trips, ids never depend on a training corpus, and nothing is fetched.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TINY_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The printable character the byte-level pre-tokenizer uses for each byte 0..255 (GPT-2's map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = 0
    alphabet: list[str] = []
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + extra))
            extra += 1
    return alphabet


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh byte-level tokenizer: ``<|endoftext|>`` = 0 (bos, pad), ``<|im_start|>`` = 1,
    ``<|im_end|>`` = 2 (eos, ends a chat turn), byte ``b`` = ``3 + b``."""
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *_byte_alphabet()])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Already in the vocabulary; this marks them special so text never splits them into bytes.
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE,
    )
