"""HashFormers word splitter and special tokens ([Xue25] sec. 2.3; reference tokenizer of HUIYINXUE/hashformer).

A document is lowercased and split with the regex ``\\w+|[^\\w\\s]+``: runs of word characters and runs
of punctuation; whitespace is dropped. Special tokens keep the ids of the reference code, which the
sentencepiece tokenizers trained by ``data_tools/train_tokenizer.py`` share.
"""

from __future__ import annotations

import re

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
BOS_ID, PAD_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
NUM_SPECIAL = len(SPECIAL_TOKENS)
SPECIAL_IDS = {"bos": BOS_ID, "pad": PAD_ID, "eos": EOS_ID, "unk": UNK_ID, "mask": MASK_ID}

WORD_PATTERN = r"\w+|[^\w\s]+"
WORD_RE = re.compile(WORD_PATTERN)


def split_words(text: str) -> list[str]:
    """Lowercase ``text`` and return its HashFormers words (``\\w+|[^\\w\\s]+``)."""
    return WORD_RE.findall(text.lower())
