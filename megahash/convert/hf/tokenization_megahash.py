"""``AutoTokenizer`` class of megahash exports: the fast tokenizer of ``tokenizer.json`` as it is.

``tokenizer.json`` (written by ``megahash export-hf``) reproduces the run's sentencepiece model or
word table; this subclass only exists so that ``auto_map`` can name it (transformers maps some
model types, e.g. qwen2, to their own tokenizer classes otherwise).
"""

try:
    from transformers import PreTrainedTokenizerFast as _FastTokenizer
except ImportError:  # pragma: no cover
    from transformers import TokenizersBackend as _FastTokenizer


class MegahashTokenizerFast(_FastTokenizer):
    slow_tokenizer_class = None
    model_input_names = ["input_ids", "attention_mask"]  # no token_type_ids (transformers 4.x's default has them)
