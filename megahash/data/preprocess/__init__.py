"""The data stage (docs/data.md). Each CLI is a module with ``main(argv) -> exit status``, run by the
repository's thin ``data_tools/NAME.py`` script of the same name: ``train_tokenizer``,
``preprocess_data`` (its encoding pass ``encode_pass`` and LSH side shards ``lsh_pass``),
``inspect_shards``, ``make_eval_tasks``. Library: corpus readers (``sources``), the worker-side
encoder (``encoding``), megatron-core shard writing (``indexed_writer``), atomic publishing
(``publish``), an ordered process pool (``ordered_pool``) and the one-line CLI plumbing
(``common``). Imports no torch (preprocessing workers stay light)."""
