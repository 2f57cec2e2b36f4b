"""Library of the data stage (the CLIs are the repository's ``data_tools/`` scripts, docs/data.md):
corpus readers (``sources``), the worker-side encoder (``encoding``), megatron-core shard writing
(``indexed_writer``), atomic publishing (``publish``), an ordered process pool (``ordered_pool``) and
the one-line CLI plumbing (``common``). Imports no torch (preprocessing workers stay light)."""
