"""Names in a checkpoint folder and its state file (the bottom of :mod:`megahash.checkpoint`).

Layout of ``train.save_dir``::

    step_00000100/            one complete checkpoint (DeepSpeed files + megahash files)
        mp_rank_00_model_states.pt, *_optim_states.pt    (DeepSpeed; not in an asynchronous save)
        model/, optimizer/    weights and Adam's state as megatron dist checkpoints (any layout)
        ema/                  the weight average of train.ema.decay (when on)
        manifest.json         bytes and sha256 of every file (manifest.py, digest.py)
        megahash_state.json   step, consumed samples, model signature: written last = complete
        rng_rank00000.json    RNG states of each rank (rng.py)
        resolved_config.yaml
    latest                    name of the newest complete checkpoint (written last, atomically)
    megahash.lock             held by the run writing here (megahash/training/run_lock.py)
    eval/step_N.pin           present while step_N is evaluated (eval.interval)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from megahash.errors import CheckpointError

STATE_FILE = "megahash_state.json"
STATE_FORMAT = 1  # the state file's layout, its "format" key; absent in checkpoints written before it was recorded
WEIGHTS_DIR = "model"
EMA_DIR = "ema"  # the weight average of train.ema.decay (megahash/training/ema.py)
TAG_RE = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


MAX_JSON_BYTES = 64 << 20  # a checkpoint's JSON files are KBs (the RNG states) to MBs (a manifest)


def read_json(path: Path) -> dict:
    """A JSON object file of a checkpoint or export. ValueError (one line) for a file that is not one: over
    :data:`MAX_JSON_BYTES`, not UTF-8 JSON, nested past Python's recursion limit, not an object; OSError as is."""
    path = Path(path)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(f"{path.name} is over {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path.name} is not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} holds a {type(data).__name__}, not a JSON object")
    return data


def read_state(ckpt: Path) -> dict:
    """A checkpoint's state file; one-line CheckpointError for an unreadable one, a damaged ``format`` or a format
    newer than :data:`STATE_FORMAT` (a later megahash's checkpoint: read as this one's it would be misread)."""
    try:
        state = read_json(ckpt / STATE_FILE)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has no readable {STATE_FILE} ({e}); it is incomplete") from None
    fmt = state.get("format", 1)
    if not (isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= 1):
        raise CheckpointError(
            f"checkpoint {ckpt}: {STATE_FILE} format is {str(fmt)[:40]!r}, not a version; it is damaged"
        )
    if fmt > STATE_FORMAT:
        raise CheckpointError(
            f"checkpoint {ckpt} was written by a newer megahash ({STATE_FILE} format {fmt}; this one reads up to "
            f"{STATE_FORMAT}); upgrade megahash to read it"
        )
    return state


MAX_VOCAB = 1 << 31  # token ids are int32 in the shards and the models


def padded_vocab(state: dict, ckpt: Path) -> int:
    """The ``padded_vocab_size`` a checkpoint's state records: a positive integer, else one-line CheckpointError
    (a string or a list was a ValueError/TypeError traceback of eval and report)."""
    vocab = state.get("padded_vocab_size")
    if not vocab:
        raise CheckpointError(f"checkpoint {ckpt} does not record its vocabulary size")
    if not (isinstance(vocab, int) and not isinstance(vocab, bool) and 0 < vocab <= MAX_VOCAB):  # 10**30: overflow
        raise CheckpointError(f"checkpoint {ckpt}: padded_vocab_size is {str(vocab)[:40]!r}, not a size; it is damaged")
    return vocab


def pin_path(root: Path, tag: str) -> Path:
    """``ROOT/eval/TAG.pin``: present while checkpoint ``TAG`` is evaluated (eval.interval,
    megahash/training/eval_during.py); ``train.keep_last`` pruning leaves a pinned checkpoint."""
    return Path(root) / "eval" / f"{tag}.pin"
