"""Training samples from data-stage shards: megatron-core ``GPTDataset`` plus aligned hash codes.

Token shards (``PREFIX_text_document.bin/.idx``) go through megatron-core's
``BlendedMegatronDatasetBuilder`` + ``GPTDataset`` unchanged (train/valid/test split, document,
sample and shuffle indices, blending). :class:`HashGPTDataset` reuses those very indices to cut the
same spans out of the word-hash side shards (``PREFIX_hash_{spec}.bin/.idx``), so a sample's
``hash_codes[t]`` always belongs to ``tokens[t]``.

Sampling is a pure function of (seed, consumed samples): a run resumed at step k reads exactly the
batches the uninterrupted run read (Megatron's ``MegatronPretrainingSampler`` scheme).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megahash.accelerator import policy
from megahash.data import documents
from megahash.data.token_check import check_range, code_range
from megahash.data.verify import (  # noqa: F401 (one owner; re-exported)
    base_prefix,
    blend_paths,
    check_prefix,
    check_side_shards,
    read_meta,
    token_path,
)
from megahash.errors import DataError


def side_path(prefix: str, spec: str) -> str:
    return f"{base_prefix(prefix)}_hash_{spec}"


class _Tokenizer:
    """The three facts GPTDataset needs of a tokenizer (specials of the data stage: pad=1, eod=2)."""

    def __init__(self, vocab_size: int, eod: int = 2, pad: int = 1):
        self.vocab_size = vocab_size
        self.eod = eod
        self.pad = pad
        # part of the dataset cache key (megatron hashes the config's identifiers)
        self.unique_identifiers = {"class": "megahash", "vocab_size": vocab_size, "eod": eod, "pad": pad}


class HashGPTDataset(GPTDataset):
    """GPTDataset whose samples also carry the hash codes of their tokens (when configured)."""

    hash_spec: str | None = None  # set by build_datasets before building
    hash_width: int = 0
    hash_range: tuple[int, int] | None = None  # [low, high) of the spec's code values (bucket/rolling specs)
    documents = None  # (data config, eod id) when a packed-document flag is on (megahash/data/documents.py)

    def _spans(self, idx: int) -> list[tuple[int, int, int | None]]:
        """(document id, offset, length or None=to end) pieces of sample ``idx`` — the same walk
        as ``GPTDataset._query_document_sample_shuffle_indices``."""
        if self.shuffle_index is None:
            self._query_document_sample_shuffle_indices(0)  # lazily memory-maps the indices
        idx = self.shuffle_index[idx]
        beg, beg_off = self.sample_index[idx]
        end, end_off = self.sample_index[idx + 1]
        extra = self.config.add_extra_token_to_sequence
        if beg == end:
            return [(int(self.document_index[beg]), int(beg_off), int(end_off - beg_off + extra))]
        spans = []
        for i in range(beg, end + 1):
            offset = 0 if i > beg else int(beg_off)
            length = None if i < end else int(end_off + extra)
            spans.append((int(self.document_index[i]), offset, length))
        return spans

    def _side(self) -> IndexedDataset:
        if getattr(self, "_side_ds", None) is None:
            self._side_ds = IndexedDataset(side_path(self.dataset_path, self.hash_spec))
        return self._side_ds

    def __getitem__(self, idx):
        spans = self._spans(idx)
        pieces = [self.dataset.get(d, offset=o, length=n) for d, o, n in spans]
        text = np.concatenate(pieces)
        check_range(
            text,
            0,
            self.config.tokenizer.vocab_size,
            [(d, o, len(p)) for (d, o, _), p in zip(spans, pieces)],
            self.dataset_path,
            base_prefix(self.dataset_path),
            "token id",
        )  # a .bin damaged in place: one line naming it, not an IndexError in the model
        text = text.astype(np.int64)
        need = self.config.sequence_length + 1
        pad = need - len(text)
        if pad > 0:
            fill = self._pad_token_id if self._pad_token_id >= 0 else self.config.tokenizer.eod
            text = np.concatenate([text, np.full(pad, fill, dtype=np.int64)])
        loss_mask = np.ones(self.config.sequence_length, dtype=np.float32)
        if pad > 0:
            loss_mask[len(loss_mask) - pad :] = 0.0
        sample = {
            "tokens": torch.from_numpy(text[:-1].copy()),
            "labels": torch.from_numpy(text[1:].copy()),
            "loss_mask": torch.from_numpy(loss_mask),
        }
        if self.documents is not None:  # boundaries from the tokens, no [s, s] mask (megatron's would materialise it)
            sample.update(documents.sample_fields(sample["tokens"], sample["loss_mask"], *self.documents))
        if self.hash_spec:
            w = self.hash_width
            side = self._side()
            parts = []
            for d, o, n in spans:
                flat = side.get(d, offset=o * w, length=None if n is None else n * w)
                parts.append(flat.reshape(-1, w))
            codes = np.concatenate(parts)
            if self.hash_range is not None:
                check_range(
                    codes,
                    *self.hash_range,
                    [(d, o, len(c)) for (d, o, _), c in zip(spans, parts)],
                    side_path(self.dataset_path, self.hash_spec),
                    base_prefix(self.dataset_path),
                    "code",
                    w,
                )
            if pad > 0:
                codes = np.concatenate([codes, np.zeros((pad, w), dtype=codes.dtype)])
            codes = torch.from_numpy(codes.astype(np.int64 if codes.dtype != np.uint8 else np.uint8))
            sample["hash_codes"] = codes[:-1].contiguous()
            sample["label_codes"] = codes[1:].contiguous()
        return sample


@dataclass
class Datasets:
    train: object
    valid: object | None
    vocab_size: int
    meta: dict
    valid_sets: dict = field(default_factory=dict)  # data.valid: {name: dataset} (megahash/data/valid_sets.py)
    token_bytes: object = None  # bytes per token of the tokenizer, for bits per byte (megahash/data/text_bytes.py)


def _vocab_size(cfg, meta: dict) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    tok = meta.get("tokenizer") or {}
    if tok.get("vocab_size"):
        return int(tok["vocab_size"])
    from megahash.tokenization import WORDS, load_tokenizer

    if cfg.data.tokenizer and cfg.data.tokenizer != WORDS:  # any kind megahash.tokenization loads
        return load_tokenizer(cfg.data.tokenizer).vocab_size
    raise DataError(
        "cannot tell the vocabulary size: set model.vocab_size or data.tokenizer, or rebuild the shards with meta.json"
    )


def run_vocab_size(cfg) -> int:
    """The vocabulary a run of ``cfg`` builds its model with: ``model.vocab_size``, else its tokenizer's
    (the shard meta's, else ``data.tokenizer``'s), as :func:`build_datasets` finds it."""
    paths = blend_paths(list(cfg.data.prefix))[0] if cfg.data.prefix else []
    return _vocab_size(cfg, read_meta(paths[0] if paths else None, required=False))


def build_datasets(cfg, train_samples: int, valid_samples: int, cache_dir: str | None) -> Datasets:
    """Train/valid datasets of ``cfg.data`` with megatron-core's builder (cache under cache_dir)."""
    if not cfg.data.prefix:
        raise DataError("data.prefix is empty; point it at shards made by data_tools/preprocess_data.py")
    paths, weights = blend_paths(list(cfg.data.prefix))
    for p in paths:
        check_prefix(p)
    from megahash.data.verify import verify_set

    for p in paths:  # sizes, headers and counts of every shard against its meta before step 1 (data.verify)
        verify_set(p, cfg.data.verify)
    meta = read_meta(paths[0], required=False)
    from megahash import catalog

    reads_codes = catalog.reads_hash_codes(cfg)
    spec = cfg.model.embed.hash_spec if reads_codes else None
    width = 0
    check_side_shards(paths, spec, cfg.model.embedding, meta)  # as pretrain.py --check inputs did
    if spec:
        specs = {s["name"]: s for s in meta.get("hash_specs", [])}
        width = int(specs[spec]["width"]) if spec in specs else _width_from_shards(paths[0], spec)
    vocab = _vocab_size(cfg, meta)
    special = record_special_ids(cfg, meta)
    eod = special.get("eos") if special.get("eos") is not None else 2
    pad = special.get("pad") if special.get("pad") is not None else -1  # megatron's "no pad token"
    ds_cfg = GPTDatasetConfig(
        random_seed=cfg.data.seed,
        sequence_length=cfg.data.seq_length,
        blend=(paths, weights),
        split=cfg.data.split,
        path_to_cache=cache_dir,
        tokenizer=_Tokenizer(vocab, eod=eod, pad=pad),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    HashGPTDataset.hash_spec = spec
    HashGPTDataset.hash_width = width
    HashGPTDataset.hash_range = code_range(spec) if spec else None
    HashGPTDataset.documents = (cfg.data, eod) if documents.enabled(cfg.data) else None
    from megahash.data.split_sizes import check_split_sizes

    check_split_sizes(  # again with the exact samples (inputs.py checked a ramp's lower bound)
        cfg.data.split, paths, {"train": train_samples, "validation": valid_samples}, cfg.data.seq_length, weights
    )
    from megahash.data import index_cache

    try:
        with index_cache.writing(cache_dir):  # a full disk or unwritable cache_dir: one line
            train, valid, _ = BlendedMegatronDatasetBuilder(
                HashGPTDataset, [train_samples, valid_samples, 0], lambda: True, ds_cfg
            ).build()
    except (AssertionError, ValueError, IndexError) as e:
        raise DataError(f"cannot build datasets from {paths}: {e or type(e).__name__}") from None
    if train is None:
        raise DataError(f"data.split={cfg.data.split!r} leaves no training documents")
    from megahash.data.valid_sets import build_valid_sets

    sides = (lambda path: [side_path(path, spec)]) if spec else (lambda path: [])
    from megahash.data.text_bytes import token_bytes_for

    with index_cache.writing(cache_dir):
        valid_sets = build_valid_sets(cfg, ds_cfg, HashGPTDataset, sides)
    return Datasets(train, valid, vocab, meta, valid_sets, token_bytes_for(cfg, meta))


def record_special_ids(cfg, meta: dict) -> dict:
    """The tokenizer's special ids by role, from the shard meta into ``cfg.data.special_ids`` (so
    the resolved config of the checkpoint records them); a role the config gives wins, the others are the
    meta's (``data.special_ids.mask=4`` alone used to drop eos and pad: EOD 2 and no pad whatever the tokenizer)."""
    from megahash.tokenization import special_ids_of

    tok = meta.get("tokenizer") or {}
    if tok.get("special_ids"):
        cfg.data.special_ids = {**special_ids_of(tok["special_ids"]), **cfg.data.special_ids}
    return special_ids_of(cfg.data.special_ids)


def _width_from_shards(path: str, spec: str) -> int:
    tok = IndexedDataset(token_path(path))
    side = IndexedDataset(side_path(path, spec))
    n_tok, n_side = int(tok.sequence_lengths.sum()), int(side.sequence_lengths.sum())
    if n_tok == 0 or n_side % n_tok:
        raise DataError(f"side shard {side_path(path, spec)} does not align with {token_path(path)}")
    return n_side // n_tok


class ResumableBatchSampler(torch.utils.data.Sampler):
    """Megatron's pretraining sampler: global sample ids in order from ``consumed``, each DP rank
    taking its contiguous micro-batch slice of every global batch."""

    def __init__(self, total: int, consumed: int, micro_batch: int, dp_rank: int, dp_size: int):
        self.total, self.consumed = total, consumed
        self.mb, self.rank, self.size = micro_batch, dp_rank, dp_size

    def __len__(self):
        return (self.total - self.consumed) // (self.mb * self.size)

    def __iter__(self):
        stride = self.mb * self.size
        for start in range(self.consumed, self.total - stride + 1, stride):
            lo = start + self.rank * self.mb
            yield list(range(lo, lo + self.mb))


def make_loader(dataset, consumed: int, micro_batch: int, dp_rank: int, dp_size: int, num_workers: int = 0):
    """The train loader from sample ``consumed`` on. Its iterator draws its workers' base seed from a generator of
    its own: from torch's global one (the DataLoader's default) it took a draw at every ``iter()``, after a resume
    restored the checkpoint's RNG state too, so every dropout mask after a resume differed from the
    uninterrupted run's."""
    sampler = ResumableBatchSampler(len(dataset), consumed, micro_batch, dp_rank, dp_size)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=policy.has_gpu(),
        persistent_workers=False,
        generator=torch.Generator(),
    )
