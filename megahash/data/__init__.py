"""Everything about data, in one place. Reading side (training): ``shards`` (a preprocessed shard
set), ``verify`` (against its meta), ``dataset`` (megatron-core samples + aligned hash codes),
``validation``, ``fixed_text``. Writing side: :mod:`megahash.data.preprocess` (tokenizer training,
preprocessing, inspection, eval task suites; the repository's ``data_tools/*.py`` run its CLIs)."""
