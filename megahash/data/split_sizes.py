"""Whether each split of ``data.split`` can give the samples a run asks of it, checked before
megatron-core's builder, which would otherwise loop for ever (a split with no documents or no tokens,
``train.steps=1e30``: deaf to SIGTERM) or allocate an index past the machine's memory (``1e12``).

No torch and no megatron-core here: :func:`check_run` runs in ``pretrain.py --check inputs`` and before
every run's heavy imports (megahash/inputs.py), :func:`check_split_sizes` again in
``megahash.data.dataset.build_datasets`` with the exact sample counts. Documents are divided as
``BlendedMegatronDatasetBuilder`` divides them (:func:`split_bounds`, its arithmetic step for step).
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from megahash.errors import DataError

_INDEX_KEYS = {"train": "train.steps (or train.global_batch_size)", "validation": "data.valid_samples"}


def split_bounds(split: str) -> list[tuple[float, float] | None]:
    """``data.split`` (e.g. ``98,2,0``) -> each split's (begin, end) fraction of the documents, or None for an
    empty one: megatron-core's ``parse_and_normalize_split`` then ``convert_split_vector_to_split_matrix``,
    the same float operations in the same order (so ``round(b N)`` picks the same documents)."""
    weights = [float(w) for w in re.findall(r"[.0-9]+", str(split))]
    weights += [0.0] * (3 - len(weights))
    if len(weights) != 3 or not sum(weights) > 0:
        raise DataError(f"data.split={split!r} is not a valid split: give three weights, train > 0 (e.g. 98,2,0)")
    w = np.array(weights, dtype=np.float64)
    ends = [0]
    for x in (w / np.sum(w)).tolist():
        ends.append(ends[-1] + x)
    return [(a, b) if b > a else None for a, b in zip(ends[:-1], ends[1:])]


def check_split_sizes(
    split: str, paths: list[str], samples: dict, seq_length: int | None = None, weights: list[float] | None = None
) -> None:
    """One-line DataError when ``data.split`` gives a split that must yield samples no document of a shard
    (``paths``: megatron dataset paths, ``PREFIX_text_document``); split i of N documents is
    ``round(b_i N) : round(e_i N)``. With ``seq_length``, also when a split's documents hold no token, or when
    the samples asked of them (a blend's share by ``weights``) need an index larger than the machine's memory
    (:func:`_index_bytes`): megatron-core counts the epochs one at a time and then allocates epochs x documents
    entries."""
    from megahash.data.verify import base_prefix, read_index

    matrix = split_bounds(split)
    for i, path in enumerate(paths):
        fix = f"rebuild the set with `python data_tools/preprocess_data.py --output-prefix {base_prefix(path)} ...`"
        sizes = read_index(path + ".idx", fix).lengths
        n = len(sizes)
        for (name, want), bounds in zip(samples.items(), matrix):
            if not want or bounds is None:
                continue
            lo, hi = int(round(bounds[0] * n)), int(round(bounds[1] * n))
            if hi <= lo:
                share = max(1, -(-100 // n))
                if name == "validation" and share < 50:
                    fix = f"give the {name} split at least {share}% (e.g. data.split={100 - share},{share},0)"
                else:
                    fix = (
                        "use a larger corpus" if name == "validation" else "use a larger corpus or a larger train share"
                    )
                raise DataError(
                    f"data.split={split} leaves the {name} split no documents of the {n} in {path}: "
                    f"{fix}, or data.split=100,0,0 to train without validation"
                )
            if seq_length is not None:
                share = None if weights is None else weights[i] / sum(weights)
                _check_index_size(name, want, share, seq_length, path, lo, hi, sizes)
        del sizes  # the index's memory map closes with its last view


def check_run(cfg) -> None:
    """:func:`check_split_sizes` for a training config, before torch: its ``data.prefix`` blend, the samples of
    ``train.steps`` (with a batch ramp a lower bound, every step taking at least the ramp's first batch; the
    exact count is checked again when the datasets are built) and ``data.valid_samples``."""
    from megahash.data.samples import consumed_samples, ramp_on
    from megahash.data.verify import blend_paths

    t, d = cfg.train, cfg.data
    train = t.steps * int(t.batch_ramp[0]) if ramp_on(t) else consumed_samples(t, t.steps)
    paths, weights = blend_paths(list(d.prefix))
    check_split_sizes(d.split, paths, {"train": train, "validation": d.valid_samples}, d.seq_length, weights)


def _index_bytes(epochs: int, docs: int, samples: int) -> int:
    """Bytes megatron-core's GPTDataset indices of a split take while they are built: the document index
    (``numpy.mgrid`` of two int64 arrays of ``epochs x docs``, then int32) and the sample and shuffle
    indices (up to two int64 and one int64 per sample)."""
    return 20 * epochs * docs + 24 * samples


def _check_index_size(name: str, want: int, share, seq_length: int, path: str, lo: int, hi: int, sizes) -> None:
    """The index check of :func:`check_split_sizes` for the split of documents ``lo:hi`` of ``path``."""
    tokens = int(sizes[lo:hi].sum(dtype=np.int64))
    if share is not None:  # BlendedMegatronDatasetBuilder's share of a blend, with its 0.5% surplus
        want = math.ceil(math.ceil(want * share) * 1.005)
    if tokens == 0:
        raise DataError(f"the {name} split of {path} (documents {lo}:{hi}) holds no tokens; use a larger corpus")
    epochs = -(-(want * seq_length + 1) // tokens)
    need = _index_bytes(epochs, hi - lo, want)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: the bound of a large node
        memory = 2 << 40
    if need > memory:
        raise DataError(
            f"{want:,} {name} samples of {seq_length} tokens need {epochs:,} epochs of the {hi - lo:,} documents "
            f"({tokens:,} tokens) of the {name} split of {path}: megatron-core's index of them would take "
            f"{need / 2**30:,.0f} GiB, more than this machine's {memory / 2**30:,.0f} GiB of memory; "
            f"lower {_INDEX_KEYS.get(name, name)} or train on a larger corpus"
        )
