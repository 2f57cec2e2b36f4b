"""Data stage CLIs: train a tokenizer, preprocess a corpus into megatron-core shards plus word-hash
side shards, inspect/verify shards. See docs/data.md. Their library code (corpus readers, encoding,
shard writing and publishing) is :mod:`megahash.data_stage` (also importable as ``data_tools.X``)."""
from megahash.module_aliases import alias_submodules

alias_submodules(__name__, "megahash.data_stage",
                 ("common", "encoding", "indexed_writer", "ordered_pool", "publish", "sources"))
