"""Words -> hash codes, pure Python/numpy (no torch): HashFormers MD5 and LSH ([Xue25] ch. 2), EELBERT
rolling hashes ([Cohn23]). Used by data_tools (side shards) and by the Hugging Face export."""
from megahash.hashing.codes import ZERO_ROW, CodeTable, hash_words
from megahash.hashing.lsh import (
    DEFAULT_NGRAM_VOCAB,
    NGRAM_ORDERS,
    LSHModel,
    count_ngrams,
    make_eta,
    make_hyperplanes,
    top_ngrams,
    word_ngrams,
)
from megahash.hashing.md5 import DEFAULT_KEY, md5_bits, md5_buckets, md5_digest
from megahash.hashing.rolling import (
    ROLLING_M,
    ROLLING_P,
    rolling_codes,
    rolling_embedding,
    rolling_embedding_from_codes,
    rolling_hash,
    rolling_partitions,
    rolling_seeds,
    rolling_width,
)
from megahash.hashing.specs import VALID_FORMS, HashSpec, parse_hash_spec, parse_hash_specs
from megahash.hashing.tokens import HASH_UNITS, SubwordCoder, group_words, subword_string, word_stream_row_ids
from megahash.hashing.words import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    NUM_SPECIAL,
    PAD_ID,
    SPECIAL_IDS,
    SPECIAL_TOKENS,
    UNK_ID,
    WORD_PATTERN,
    split_words,
)

__all__ = [
    "BOS_ID", "CodeTable", "DEFAULT_KEY", "DEFAULT_NGRAM_VOCAB", "EOS_ID", "HASH_UNITS", "HashSpec", "LSHModel",
    "MASK_ID", "NGRAM_ORDERS", "NUM_SPECIAL", "PAD_ID", "ROLLING_M", "ROLLING_P", "SPECIAL_IDS", "SPECIAL_TOKENS",
    "SubwordCoder", "UNK_ID", "VALID_FORMS", "WORD_PATTERN", "ZERO_ROW", "count_ngrams", "group_words", "hash_words",
    "make_eta", "make_hyperplanes", "md5_bits", "md5_buckets", "md5_digest", "parse_hash_spec", "parse_hash_specs",
    "rolling_codes", "rolling_embedding", "rolling_embedding_from_codes", "rolling_hash", "rolling_partitions",
    "rolling_seeds", "rolling_width", "split_words", "subword_string", "top_ngrams", "word_ngrams",
    "word_stream_row_ids",
]
