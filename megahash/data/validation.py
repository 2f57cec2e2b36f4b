"""The validation set: fixed by the data config alone, so validation losses of runs are comparable.

The set is the first ``data.valid_samples`` sequences of the validation split, in the order of
megatron-core's ``GPTDataset`` for that split (built with ``num_samples = data.valid_samples``, so
its document/sample/shuffle indices depend on the data config only: prefixes, split, seed,
sequence length). It does not depend on the number of data-parallel ranks, ``train.steps``,
the batch sizes or the tensor-parallel size:

- the sequences are cut into fixed chunks of ``data.valid_micro_batch`` consecutive samples; chunk
  ``c`` is evaluated by data-parallel rank ``c % dp_size`` (a partition of the same set);
- the loss is the token-weighted mean over the whole set (sum of per-token losses / number of
  loss tokens, all-reduced), not a mean of per-batch means, so the partition does not change it;
- corrupting objectives (mlm, sr) seed each chunk from its index, never from the rank or step;
- every rank runs the same number of forward passes: a rank with fewer chunks (or none: fewer chunks
  than ranks) ends with stand-ins, a forward of chunk 0 that is not counted. Under ZeRO-3 a forward is
  a collective (the partitioned parameters are all-gathered), so a rank that ran fewer left the others
  waiting for it forever (e.g. ``data.valid_samples=8`` on 2 ranks, or the default 64 on 16).
"""

from __future__ import annotations

import torch


def chunks_for_rank(n_samples: int, chunk: int, dp_rank: int, dp_size: int) -> list[tuple[int, list[int]]]:
    """(chunk index, sample ids) of the validation chunks that ``dp_rank`` evaluates."""
    chunk = max(1, int(chunk))
    out = []
    for c, lo in enumerate(range(0, n_samples, chunk)):
        if c % dp_size == dp_rank:
            out.append((c, list(range(lo, min(lo + chunk, n_samples)))))
    return out


def validation_size(dataset, data_cfg) -> int:
    """Sequences the validation set covers: ``data.valid_samples`` (at most the split's length)."""
    if dataset is None:
        return 0
    return min(int(data_cfg.valid_samples), len(dataset))


def batch_sizes(dataset, data_cfg) -> set[int]:
    """The batch sizes of a set's chunks: full chunks of ``data.valid_micro_batch`` and the last, shorter one (a
    compiled model keeps a graph per size: ``trainer.compile_layers``); empty for no set."""
    n, chunk = validation_size(dataset, data_cfg), max(1, int(data_cfg.valid_micro_batch))
    return {size for size in (min(chunk, n), n % chunk) if size > 0}


def rounds_for_rank(n_samples: int, chunk: int, dp_rank: int, dp_size: int) -> list[tuple[int, list[int], bool]]:
    """(chunk index, sample ids, counted) of every forward pass ``dp_rank`` runs over the validation set: its
    chunks (counted), then stand-ins (chunk 0, not counted) up to the most chunks any rank has, so every
    data-parallel rank runs the same number of forward passes (a collective under ZeRO-3)."""
    own = [(c, ids, True) for c, ids in chunks_for_rank(n_samples, chunk, dp_rank, dp_size)]
    most = len(chunks_for_rank(n_samples, chunk, 0, dp_size))  # rank 0 holds the most: chunk c goes to c % dp_size
    first = chunks_for_rank(n_samples, chunk, 0, 1)[:1]
    return own + [(c, ids, False) for c, ids in first] * (most - len(own))


def validation_batches(dataset, data_cfg, dp_rank: int, dp_size: int):
    """Yield (chunk index, collated batch, counted) of this rank's forward passes over the validation set
    (:func:`rounds_for_rank`: its share, counted, then uncounted stand-ins)."""
    n = validation_size(dataset, data_cfg)
    for c, ids, counted in rounds_for_rank(n, data_cfg.valid_micro_batch, dp_rank, dp_size):
        yield c, torch.utils.data.default_collate([dataset[i] for i in ids]), counted
