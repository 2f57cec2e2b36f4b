"""Named validation sets (``data.valid``): held-out shard prefixes, each a fixed set reported by name.

``data.valid=[wiki=data/wiki/wiki,code=data/code/code]`` names one shard set per entry (``NAME=PREFIX``).
They are built with megatron-core's per-split blends: ``BlendedMegatronDatasetConfig(blend_per_split=
[None, (prefixes, None), None], multiple_validation_sets=True, full_validation=True)`` gives one
``GPTDataset`` per prefix over all of its documents, one epoch, shuffled by ``data.seed`` (Megatron's
``--valid-data-path`` with ``--multiple-validation-sets --full-validation``). Each set is then fixed like
the split's set (megahash/data/validation.py): its first ``data.valid_samples`` sequences (fewer when the
prefix holds fewer), fixed chunks, a token-weighted loss. The ``data.split`` share of the training blend
stays the set named ``valid`` in the logs.

Bad input is one line (exit 2): an entry without ``=``, an empty or duplicate name, a name that is not
``[A-Za-z0-9_.-]+`` or is ``valid`` (the split's name), a prefix whose shards do not exist or fail
``data.verify``, a set shorter than one sequence (``data.seq_length + 1`` tokens).
"""

from __future__ import annotations

import os

from megahash.config_checks import parse_valid  # the config check owns the grammar
from megahash.errors import DataError

SPLIT_NAME = "valid"  # the data.split set's name in the logs (kept from before data.valid)


def check_valid_shards(cfg) -> None:
    """Every named set's token shards exist and pass ``data.verify`` (before torch)."""
    from megahash import catalog
    from megahash.data.verify import base_prefix, check_prefix, read_meta, verify_set

    spec = cfg.model.embed.hash_spec if catalog.reads_hash_codes(cfg) else None
    for name, prefix in parse_valid(cfg.data.valid):
        try:
            check_prefix(prefix)
            verify_set(prefix, cfg.data.verify)
        except DataError as e:
            raise DataError(f"data.valid set {name!r}: {e}") from None
        if spec:
            _refuse_missing_side(name, f"{base_prefix(prefix)}_hash_{spec}")
        tokens = (read_meta(prefix, required=False).get("counts") or {}).get("tokens")
        if tokens is not None:
            _refuse_short(name, prefix, int(tokens), cfg.data.seq_length)


def _refuse_missing_side(name: str, side: str) -> None:
    if not (os.path.isfile(side + ".bin") and os.path.isfile(side + ".idx")):
        raise DataError(
            f"data.valid set {name!r}: the model reads hash codes but {side}.bin/.idx does not "
            f"exist; preprocess the set with the training set's --word-hashes"
        )


def _refuse_short(name: str, path: str, tokens: int, seq_length: int) -> None:
    if tokens < seq_length + 1:
        raise DataError(
            f"data.valid set {name!r} ({path}) holds {tokens} tokens, fewer than one sequence "
            f"(data.seq_length + 1 = {seq_length + 1}); use a larger set or a shorter data.seq_length"
        )


def _check_length(name: str, path: str, seq_length: int) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    index = IndexedDataset(path)  # kept alive while its memory-mapped lengths are read
    tokens = int(index.sequence_lengths.sum())
    _refuse_short(name, path, tokens, seq_length)


def build_valid_sets(cfg, ds_config, dataset_cls, side_paths=lambda path: []) -> dict:
    """{name: dataset} of ``data.valid`` (empty when unset), built from ``ds_config`` (the training
    blend's ``GPTDatasetConfig``: tokenizer, sequence length, seed, cache) with per-split blends;
    ``side_paths(path)``: the hash side shards the model reads of a set (each must exist)."""
    import dataclasses

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megahash.data.verify import check_prefix, token_path, verify_set

    sets = parse_valid(cfg.data.valid)
    if not sets:
        return {}
    paths = [token_path(p) for _, p in sets]
    for (name, _), path in zip(sets, paths):
        try:
            check_prefix(path)
            verify_set(path, cfg.data.verify)
        except DataError as e:
            raise DataError(f"data.valid set {name!r}: {e}") from None
        for side in side_paths(path):
            _refuse_missing_side(name, side)
        _check_length(name, path, cfg.data.seq_length)
    fields = {f.name: getattr(ds_config, f.name) for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    fields.update(
        blend=None,
        split=None,
        blend_per_split=[None, (paths, None), None],
        multiple_validation_sets=True,
        full_validation=True,
    )
    config = GPTDatasetConfig(**fields)
    try:
        _, built, _ = BlendedMegatronDatasetBuilder(dataset_cls, [0, None, 0], lambda: True, config).build()
    except (AssertionError, ValueError, IndexError) as e:
        raise DataError(f"cannot build the data.valid sets {paths}: {e or type(e).__name__}") from None
    built = built if isinstance(built, list) else [built]
    return {name: ds for (name, _), ds in zip(sets, built)}
