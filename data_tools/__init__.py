"""Data stage CLIs: train a tokenizer, preprocess a corpus into megatron-core shards plus word-hash
side shards, inspect/verify shards. See docs/data.md."""
