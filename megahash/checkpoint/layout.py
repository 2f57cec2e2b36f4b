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
WEIGHTS_DIR = "model"
EMA_DIR = "ema"  # the weight average of train.ema.decay (megahash/training/ema.py)
TAG_RE = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def read_state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has no readable {STATE_FILE} ({e}); it is incomplete") from None


def pin_path(root: Path, tag: str) -> Path:
    """``ROOT/eval/TAG.pin``: present while checkpoint ``TAG`` is evaluated (eval.interval,
    megahash/training/eval_during.py); ``train.keep_last`` pruning leaves a pinned checkpoint."""
    return Path(root) / "eval" / f"{tag}.pin"
